/*
 * GatherSelectionKvCache TensorRT plugin (docs/SPEC.md section G, ONNX form in O).
 *
 * Ten inputs and four outputs in pytrt_kv/specs.py order. selection_k_rope_out,
 * selection_kv_cache_out and selection_kv_block_status_out are the in-place updated
 * inputs; selection_kv_actual_seq is [R] (dim 0 of selection_kv_block_table). The full
 * caches may be bound to pinned, mapped host memory (read through unified addressing).
 */
#pragma once

#include "NvInferRuntime.h"
#include "gatherSelectionKvCache.h"
#include "kvContract.h"
#include "pluginBase.h"
#include "pluginFields.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace pytrt_kv
{
namespace plugin
{

class GatherSelectionKvCachePlugin
    : public PluginBase<GatherSelectionKvCachePlugin, contract::gatherSelectionKvCache::kNB_INPUTS>
{
public:
    //! TensorRT plugin name (kvContract.h, generated from pytrt_kv/specs.py).
    static constexpr char const* kPLUGIN_NAME{contract::gatherSelectionKvCache::kNAME};
    //! Input and output positions: contract::gatherSelectionKvCache's kIN_* / kOUT_*
    //! (kvContract.h, generated from specs.py GATHER_SELECTION_KV_CACHE).
    static constexpr int32_t kNB_INPUTS{contract::gatherSelectionKvCache::kNB_INPUTS};
    static constexpr int32_t kNB_OUTPUTS{contract::gatherSelectionKvCache::kNB_OUTPUTS};
    static constexpr auto const& kINPUT_NAMES = contract::gatherSelectionKvCache::kINPUT_NAMES;
    static constexpr auto const& kALIASES = contract::gatherSelectionKvCache::kALIASES;
    static constexpr char const* kFIELD_ALIAS_IO{contract::gatherSelectionKvCache::kFIELD_ALIAS_IO};
    static constexpr char const* kINPUT_COUNTS{"10"};
    static constexpr bool validInputCount(int32_t n)
    {
        return n == kNB_INPUTS;
    }
    //! docs/SPEC.md G2: K <= kMAX_TOPK, for any TBS.
    static constexpr int64_t kMAX_TOPK{contract::kMAX_TOPK};

    //! The plugin's fields: selection_topk_block_size, alias_io (ints).
    static std::vector<FieldSpec> const& fieldSpecs();

    explicit GatherSelectionKvCachePlugin(PluginFields fields);
    GatherSelectionKvCachePlugin(GatherSelectionKvCachePlugin const&) = default;
    ~GatherSelectionKvCachePlugin() override = default;

    //! Kernel parameters for these input dims and dtypes, without pointers. Throws
    //! PluginError for any broken docs/SPEC.md G2 rule; dims of -1 (build time) are checked
    //! only once known.
    kernels::GatherSelectionParams describe(nvinfer1::Dims const* dims, nvinfer1::DataType const* types) const;

    //! describe(); with \p keep, its result is what enqueue launches with (PluginBase).
    void accept(nvinfer1::Dims const* dims, nvinfer1::DataType const* types, int32_t nbInputs, bool keep);

    //! The dtype rules of describe() (docs/SPEC.md G2): run from getOutputDataTypes too,
    //! so a wrong dtype fails the build with this message.
    void checkTypes(nvinfer1::DataType const* types, int32_t nbInputs) const;

    //! selection_kv_actual_seq: int32 [R] (the outputs not in place; PluginBase).
    void otherOutputTypes(nvinfer1::DataType* outputTypes) const;
    void otherOutputShapes(nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs) const;

    // IPluginV3OneBuildV2 (the rest of IPluginV3 is PluginBase's)
    //! Whether input/output \p pos may have inOut[pos]'s dtype, given inOut[0..pos)
    //! (PluginBase::supportsFormatCombination checks the rest).
    bool supportsType(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs) const noexcept;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    //! enqueue's work once PluginBase checked the shapes and copied the in-place inputs
    //! (the kernel then reads the old status there): the kernel launch, or for an empty
    //! batch only zeroing selection_kv_actual_seq (docs/SPEC.md G3).
    cudaError_t launch(void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const;

private:
    int32_t mTopkBlockSize{64};
    //! What describe() made of the shapes onShapeChange accepted; enqueue only fills in
    //! the pointers. (C8 mode's zero-element selection_k_rope is not declared as an
    //! alias: PluginBase::getAliasedInput.)
    kernels::GatherSelectionParams mParams{};
};

//! The creator registered for GatherSelectionKvCache (registration.cpp).
using GatherSelectionKvCachePluginCreator = PluginCreatorT<GatherSelectionKvCachePlugin>;

} // namespace plugin
} // namespace pytrt_kv
