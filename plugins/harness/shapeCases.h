/*
 * The shape cases of `check`: valid and refused input combinations for both plugins,
 * with the fields to create them with. Inputs are addressed by name (the positions of
 * kvContract.h, generated from pytrt_kv/specs.py), never by bare index.
 */
#pragma once

#include "NvInferRuntime.h"
#include "kvContract.h"
#include "mockTrt.h"
#include "pluginDriver.h"

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace pytrt_kv
{
namespace harness
{

namespace scatterOp = pytrt_kv::contract::scatterPaKvCache;
namespace gatherOp = pytrt_kv::contract::gatherSelectionKvCache;

//! One combination: \p ok says whether the plugin must accept it; a refusal's logged
//! error must contain \p needle.
struct ShapeCase
{
    std::string label;
    std::string plugin;
    std::function<void(Fields&)> fields;
    std::vector<T> inputs;
    bool ok;
    std::string needle; //!< expected in the logged error when !ok
};

constexpr nvinfer1::DataType kF16 = nvinfer1::DataType::kHALF;
constexpr nvinfer1::DataType kBF = nvinfer1::DataType::kBF16;
constexpr nvinfer1::DataType kF32 = nvinfer1::DataType::kFLOAT;
constexpr nvinfer1::DataType kI8 = nvinfer1::DataType::kINT8;
constexpr nvinfer1::DataType kI32 = nvinfer1::DataType::kINT32;
constexpr nvinfer1::DataType kI64 = nvinfer1::DataType::kINT64;

//! Sets cache_layout / compress_mode (left out when empty).
std::function<void(Fields&)> layout(std::string const& l, std::string const& mode = "");

//! Sets selection_topk_block_size.
std::function<void(Fields&)> tbs(int32_t v);

//! 3-D scatter, T=5 tokens, H=2 heads, Dk=8, Dv=4, NB=4 blocks of BS=16.
std::vector<T> scatterNd(nvinfer1::DataType k = kF16, nvinfer1::DataType idx = kI32);

//! 4-D scatter, B=2, Smax=6, H=3, Dk=Dv=8, NB=10, BS=16, compress_seq_offsets [offsets].
std::vector<T> scatterCompress(nvinfer1::DataType k, nvinfer1::DataType idx, int64_t offsets);

//! BSND gather, B=2, S=2, H=1, K=4, TBS=64 (default), SBS=64, FBS=128, R=4, KV=512, K_ROPE=64.
std::vector<T> gatherBsnd(nvinfer1::DataType c = kF16);

//! \p ts with input \p index replaced by \p t.
std::vector<T> withInput(std::vector<T> ts, int32_t index, T const& t);

//! \p ts with each {index, tensor} of \p changes put in place.
std::vector<T> withInputs(std::vector<T> ts, std::initializer_list<std::pair<int32_t, T>> changes);

//! \p ts (a gather) with K = \p k: selection_topk_indices [lead..., K] and
//! selection_kv_block_status [lead..., K+1] (BSND lead {B, S, 1}, TND {T, 1}).
std::vector<T> withTopk(std::vector<T> ts, std::vector<int64_t> lead, int64_t k);

//! \p ts followed by \p more (inputs after the given ones).
std::vector<T> followedBy(std::vector<T> ts, std::initializer_list<T> more);

//! Every shape case.
std::vector<ShapeCase> shapeCases();

} // namespace harness
} // namespace pytrt_kv
