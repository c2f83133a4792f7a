/*
 * GatherSelectionKvCache TensorRT plugin (shared/spec/OPS.md section G, ONNX form in O).
 *
 * Ten inputs and four outputs in pytrt_kv/specs.py order. selection_k_rope_out,
 * selection_kv_cache_out and selection_kv_block_status_out are the in-place updated
 * inputs; selection_kv_actual_seq is [R] (dim 0 of selection_kv_block_table). The full
 * caches may be bound to pinned, mapped host memory (read through unified addressing).
 */
#pragma once

#include "NvInferRuntime.h"
#include "gatherSelectionKvCache.h"
#include "pluginFields.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pytrt_kv
{
namespace plugin
{

class GatherSelectionKvCachePlugin : public nvinfer1::IPluginV3,
                                     public nvinfer1::IPluginV3OneCore,
                                     public nvinfer1::IPluginV3OneBuildV2,
                                     public nvinfer1::IPluginV3OneRuntime
{
public:
    //! Input indices (specs.py GATHER_SELECTION_KV_CACHE.inputs).
    static constexpr int32_t kIN_SELECTION_K_ROPE{0};
    static constexpr int32_t kIN_SELECTION_KV_CACHE{1};
    static constexpr int32_t kIN_SELECTION_KV_BLOCK_TABLE{2};
    static constexpr int32_t kIN_SELECTION_KV_BLOCK_STATUS{3};
    static constexpr int32_t kIN_SELECTION_TOPK_INDICES{4};
    static constexpr int32_t kIN_FULL_K_ROPE{5};
    static constexpr int32_t kIN_FULL_KV_CACHE{6};
    static constexpr int32_t kIN_FULL_KV_BLOCK_TABLE{7};
    static constexpr int32_t kIN_FULL_KV_ACTUAL_SEQ{8};
    static constexpr int32_t kIN_FULL_Q_ACTUAL_SEQ{9};
    static constexpr int32_t kNB_INPUTS{10};
    //! Output indices (specs.py GATHER_SELECTION_KV_CACHE.outputs).
    static constexpr int32_t kOUT_SELECTION_K_ROPE{0};
    static constexpr int32_t kOUT_SELECTION_KV_CACHE{1};
    static constexpr int32_t kOUT_SELECTION_KV_BLOCK_STATUS{2};
    static constexpr int32_t kOUT_SELECTION_KV_ACTUAL_SEQ{3};
    static constexpr int32_t kNB_OUTPUTS{4};
    //! OPS.md G2: K <= 2048; K > 32 needs TBS == 1.
    static constexpr int64_t kMAX_TOPK{2048};
    static constexpr int64_t kMAX_TOPK_BLOCKED{32};

    //! The plugin's fields: selection_topk_block_size, alias_io (ints).
    static std::vector<FieldSpec> const& fieldSpecs();

    explicit GatherSelectionKvCachePlugin(PluginFields fields);
    GatherSelectionKvCachePlugin(GatherSelectionKvCachePlugin const&) = default;
    ~GatherSelectionKvCachePlugin() override = default;

    //! Kernel parameters for these input dims and dtypes, without pointers. Throws
    //! PluginError for any broken OPS.md G2 rule; dims of -1 (build time) are checked
    //! only once known. \p lenient skips the cross-tensor rules, for workspace sizing
    //! from a profile's independent maxima.
    kernels::GatherSelectionParams describe(
        nvinfer1::Dims const* dims, nvinfer1::DataType const* types, bool lenient = false) const;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuildV2
    int32_t getNbOutputs() const noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    char const* getMetadataString() noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    PluginFields mFields;
    int32_t mTopkBlockSize{64};
    bool mAliasIo{true};
    std::string mMetadata;
};

class GatherSelectionKvCachePluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    GatherSelectionKvCachePluginCreator();
    ~GatherSelectionKvCachePluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    FieldNames mFieldNames;
};

} // namespace plugin
} // namespace pytrt_kv
