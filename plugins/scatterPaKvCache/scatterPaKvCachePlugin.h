/*
 * ScatterPaKvCache TensorRT plugin (docs/SPEC.md section S, ONNX form in O).
 *
 * Inputs, in pytrt_kv/specs.py order. A node has 5 inputs (3-D key: docs/SPEC.md S3-S5) or 8
 * (4-D key: S6). An optional tensor that a model leaves out reaches the plugin as a
 * zero-element tensor at its position, because the ONNX parser hands a plugin its
 * inputs by position and cannot pass an empty name:
 *   - key-only write: value and value_cache both zero-element (e.g. [T, H, 0] and
 *     [NB, BS, H, 0]); value_cache_out is then zero-element too;
 *   - 4-D key without compress_seq_offsets ("alibi"): compress_seq_offsets of shape [0];
 *   - an 8-input node with a 3-D key: the three compress tensors zero-element.
 * Outputs: key_cache_out, value_cache_out, the in-place updated caches.
 */
#pragma once

#include "NvInferRuntime.h"
#include "kvContract.h"
#include "pluginBase.h"
#include "pluginFields.h"
#include "scatterPaKvCache.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace pytrt_kv
{
namespace plugin
{

class ScatterPaKvCachePlugin : public PluginBase<ScatterPaKvCachePlugin, contract::scatterPaKvCache::kNB_INPUTS>
{
public:
    //! TensorRT plugin name (kvContract.h, generated from pytrt_kv/specs.py).
    static constexpr char const* kPLUGIN_NAME{contract::scatterPaKvCache::kNAME};
    //! Input and output positions: contract::scatterPaKvCache's kIN_* / kOUT_*
    //! (kvContract.h, generated from specs.py SCATTER_PA_KV_CACHE).
    //! Accepted input counts: without the compress tensors, with them, with the scales
    //! (docs/SPEC.md S9; the compress tensors are then zero-element placeholders).
    static constexpr int32_t kNB_INPUTS_BASIC{5};
    static constexpr int32_t kNB_INPUTS_COMPRESS{8};
    static constexpr int32_t kNB_INPUTS_QUANT{contract::scatterPaKvCache::kNB_INPUTS};
    static_assert(contract::scatterPaKvCache::kIN_SEQ_LENS + 1 == kNB_INPUTS_COMPRESS
            && contract::scatterPaKvCache::kIN_V_SCALE + 1 == kNB_INPUTS_QUANT,
        "ScatterPaKvCache input order changed: update the accepted input counts");
    static constexpr char const* kINPUT_COUNTS{"5, 8 or 10"};
    static constexpr bool validInputCount(int32_t n)
    {
        return n == kNB_INPUTS_BASIC || n == kNB_INPUTS_COMPRESS || n == kNB_INPUTS_QUANT;
    }
    static constexpr int32_t kNB_OUTPUTS{contract::scatterPaKvCache::kNB_OUTPUTS};
    static constexpr auto const& kINPUT_NAMES = contract::scatterPaKvCache::kINPUT_NAMES;
    static constexpr auto const& kALIASES = contract::scatterPaKvCache::kALIASES;
    static constexpr char const* kFIELD_ALIAS_IO{contract::scatterPaKvCache::kFIELD_ALIAS_IO};

    //! The plugin's fields: cache_layout, compress_mode (strings), alias_io (int).
    static std::vector<FieldSpec> const& fieldSpecs();

    explicit ScatterPaKvCachePlugin(PluginFields fields);
    ScatterPaKvCachePlugin(ScatterPaKvCachePlugin const&) = default;
    ~ScatterPaKvCachePlugin() override = default;

    //! What describe() finds: the kernel parameters without pointers, and which optional
    //! inputs are present (not zero-element placeholders).
    struct Shape
    {
        kernels::ScatterParams params{};
        bool hasValue{false};   //!< value/value_cache present (else a key-only write)
        bool hasOffsets{false}; //!< compress_seq_offsets present
        bool hasKScale{false};  //!< k_scale present (key quantised on write)
        bool hasVScale{false};  //!< v_scale present
    };

    //! The kernel parameters for these input dims and dtypes. Throws PluginError for any
    //! broken docs/SPEC.md shape/dtype rule; dims of -1 (build time) are checked only once known.
    Shape describe(nvinfer1::Dims const* dims, nvinfer1::DataType const* types, int32_t nbInputs) const;

    //! describe(); with \p keep, its result is what enqueue launches with (PluginBase).
    void accept(nvinfer1::Dims const* dims, nvinfer1::DataType const* types, int32_t nbInputs, bool keep);

    //! The dtype rules of describe() that need no dims (docs/SPEC.md S8): run from
    //! getOutputDataTypes too, so a wrong dtype fails the build with this message.
    void checkTypes(nvinfer1::DataType const* types, int32_t nbInputs) const;

    //! Both outputs are in place (PluginBase): nothing else to declare.
    void otherOutputTypes(nvinfer1::DataType* /* outputTypes */) const {}
    void otherOutputShapes(nvinfer1::DimsExprs const* /* inputs */, nvinfer1::DimsExprs* /* outputs */) const {}

    // IPluginV3OneBuildV2 (the rest of IPluginV3 is PluginBase's)
    //! Whether input/output \p pos may have inOut[pos]'s dtype, given inOut[0..pos)
    //! (PluginBase::supportsFormatCombination checks the rest).
    bool supportsType(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs) const noexcept;

    //! enqueue's work once PluginBase checked the shapes and copied the caches: the
    //! kernel launch (none for an empty batch, docs/SPEC.md S7).
    cudaError_t launch(void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const;

private:
    std::string mCacheLayout;
    std::string mCompressMode;
    //! What describe() made of the shapes onShapeChange accepted; enqueue only fills in
    //! the pointers. (A key-only write's zero-element value_cache is not declared as an
    //! alias: PluginBase::getAliasedInput.)
    Shape mShape{};
};

//! The creator registered for ScatterPaKvCache (registration.cpp).
using ScatterPaKvCachePluginCreator = PluginCreatorT<ScatterPaKvCachePlugin>;

} // namespace plugin
} // namespace pytrt_kv
