/*
 * What every plugin in this library implements the same way: the IPluginV3 plumbing
 * (PluginBase, a CRTP base: counts, in-place outputs and aliases, the checks of
 * configurePlugin / onShapeChange, enqueue's guards) and the creator (PluginCreatorT).
 * Both read from the plugin class Plugin (kMaxInputs: the most inputs it takes):
 *   static constexpr char const* kPLUGIN_NAME;          the TensorRT plugin name
 *   static constexpr int32_t kNB_OUTPUTS;                its output count
 *   static constexpr auto const& kINPUT_NAMES;           its input names (kvContract.h)
 *   static constexpr auto const& kALIASES;               {output, input} in-place pairs
 *                                                        (kvContract.h, from specs.py)
 *   static constexpr char const* kFIELD_ALIAS_IO;        its alias_io field
 *   static constexpr char const* kINPUT_COUNTS;          the input counts it takes, in words
 *   static bool validInputCount(int32_t);                whether it takes that many inputs
 *   static std::vector<FieldSpec> const& fieldSpecs();   its fields
 *   explicit Plugin(PluginFields fields);                construction from parsed fields
 *   Plugin(Plugin const&);                               clone()
 *   void accept(Dims const*, DataType const*, int32_t nbInputs, bool keep);
 *       checks the inputs (throws PluginError on a broken rule); with keep, keeps what
 *       the kernel launch needs for enqueue
 *   void checkTypes(DataType const*, int32_t nbInputs) const;   the dtype rules
 *   bool supportsType(int32_t pos, DynamicPluginTensorDesc const*, int32_t nbInputs)
 *       const noexcept;                                  may tensor pos have that dtype
 *   void otherOutputTypes(DataType*) const;              dtypes and shapes of the
 *   void otherOutputShapes(DimsExprs const*, DimsExprs*) const;  outputs not in place
 *   cudaError_t launch(inputs, outputs, workspace, stream) const;  enqueue's kernel launch
 * A plugin whose kernels need a workspace also overrides getWorkspaceSize.
 */
#pragma once

#include "NvInferRuntime.h"
#include "pluginCommon.h"
#include "pluginFields.h"

#include <array>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>

namespace pytrt_kv
{
namespace plugin
{

//! The name, version and namespace of Plugin, as the plugin (Interface
//! IPluginV3OneCore) and its creator (IPluginCreatorV3One) both report them.
template <typename Plugin, typename Interface>
class PluginIdentity : public Interface
{
public:
    char const* getPluginName() const noexcept override
    {
        return Plugin::kPLUGIN_NAME;
    }

    char const* getPluginVersion() const noexcept override
    {
        return kPLUGIN_VERSION;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kPLUGIN_NAMESPACE;
    }
};

template <typename Plugin, int32_t kMaxInputs>
class PluginBase : public nvinfer1::IPluginV3,
                   public PluginIdentity<Plugin, nvinfer1::IPluginV3OneCore>,
                   public nvinfer1::IPluginV3OneBuildV2,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    ~PluginBase() override = default;

    // IPluginV3
    //! The core, build and runtime interfaces, all implemented by this object.
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        }
        return nullptr;
    }

    //! A deep copy (Plugin's copy constructor); nullptr, logged, when it throws.
    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            return new Plugin(static_cast<Plugin const&>(*this));
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::clone", e);
        }
        return nullptr;
    }

    // IPluginV3OneCore: PluginIdentity

    // IPluginV3OneBuildV2
    int32_t getNbOutputs() const noexcept override
    {
        return Plugin::kNB_OUTPUTS;
    }

    //! The field values ("name=value ..."), as PluginFields::toString wrote them.
    char const* getMetadataString() noexcept override
    {
        return mMetadata.c_str();
    }

    //! Linear tensors of accepted counts only; the dtype of \p pos: Plugin::supportsType,
    //! which decides from inOut[0..pos] only (TensorRT fills the rest in later).
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override
    {
        return inOut != nullptr && Plugin::validInputCount(nbInputs) && nbOutputs == Plugin::kNB_OUTPUTS && pos >= 0
            && pos < nbInputs + nbOutputs && inOut[pos].desc.format == nvinfer1::TensorFormat::kLINEAR
            && self().supportsType(pos, inOut, nbInputs);
    }

    //! Checks the input shapes and dtypes TensorRT chose (Plugin::accept, nothing kept).
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override
    {
        try
        {
            Inputs const x = inputsOf(in, nbInputs, out, nbOutputs, "configurePlugin", false);
            self().accept(x.dims.data(), x.types.data(), nbInputs, false);
            mEmptyInputs = emptyInputMask(in, nbInputs);
            return 0;
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::configurePlugin", e);
        }
        return -1;
    }

    //! Each in-place output has its input's dtype (Plugin::kALIASES), the others
    //! Plugin::otherOutputTypes'. The dtype rules are checked here (Plugin::checkTypes),
    //! where TensorRT first shows all input types: supportsFormatCombination can only say
    //! no, and a builder then reports "no supported formats", not why.
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        try
        {
            check(outputTypes != nullptr && inputTypes != nullptr, "getOutputDataTypes: null arrays");
            checkCounts(nbInputs, nbOutputs);
            self().checkTypes(inputTypes, nbInputs);
            for (auto const& alias : Plugin::kALIASES)
            {
                outputTypes[alias[0]] = inputTypes[alias[1]];
            }
            self().otherOutputTypes(outputTypes);
            return 0;
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::getOutputDataTypes", e);
        }
        return -1;
    }

    //! In place: each aliased output has its input's shape (Plugin::kALIASES), the others
    //! Plugin::otherOutputShapes'. Also notes the zero-element inputs: getAliasedInput may
    //! come next, before configurePlugin (pluginCommon.h).
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& /* exprBuilder */) noexcept override
    {
        try
        {
            check(inputs != nullptr && outputs != nullptr, "getOutputShapes: null arrays");
            checkCounts(nbInputs, nbOutputs);
            for (auto const& alias : Plugin::kALIASES)
            {
                outputs[alias[0]] = inputs[alias[1]];
            }
            self().otherOutputShapes(inputs, outputs);
            mEmptyInputs = emptyInputMask(inputs, nbInputs);
            return 0;
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::getOutputShapes", e);
        }
        return -1;
    }

    //! No workspace; a plugin whose kernels need one overrides this.
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /* inputs */, int32_t /* nbInputs */,
        nvinfer1::DynamicPluginTensorDesc const* /* outputs */, int32_t /* nbOutputs */) const noexcept override
    {
        return 0;
    }

    //! Each in-place output's input (Plugin::kALIASES) when alias_io = 1, unless that
    //! input is a zero-element placeholder; else -1.
    int32_t getAliasedInput(int32_t outputIndex) noexcept override
    {
        if (mAliasIo)
        {
            for (auto const& alias : Plugin::kALIASES)
            {
                if (alias[0] == outputIndex)
                {
                    return aliasUnlessEmpty(alias[1], mEmptyInputs);
                }
            }
        }
        return -1;
    }

    // IPluginV3OneRuntime
    //! Checks the run-time shapes (all known) and keeps them and what Plugin::accept made
    //! of them; enqueue refuses any other shapes.
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override
    {
        mShapeReady = false;
        try
        {
            Inputs const x = inputsOf(in, nbInputs, out, nbOutputs, "onShapeChange", true);
            self().accept(x.dims.data(), x.types.data(), nbInputs, true);
            mDims = x.dims;
            mTypes = x.types;
            mNbInputs = nbInputs;
            mShapeReady = true;
            return 0;
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::onShapeChange", e);
        }
        return -1;
    }

    //! beginEnqueue(), then Plugin::launch; a failed check or a launch status other than
    //! cudaSuccess is logged and returned as -1.
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        try
        {
            beginEnqueue(inputDesc, outputDesc, inputs, outputs, stream);
            cudaError_t const st = self().launch(inputs, outputs, workspace, stream);
            check(st == cudaSuccess, "enqueue: the ", Plugin::kPLUGIN_NAME, " kernels failed: ", cudaGetErrorName(st),
                " (", cudaGetErrorString(st), ")");
            return 0;
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::enqueue", e);
        }
        return -1;
    }

    //! A clone: the plugins hold no per-context resources.
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* /* context */) noexcept override
    {
        return clone();
    }

    //! The field values, for the creator's createPlugin at run time.
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        try
        {
            return mFields.toCollection();
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "::getFieldsToSerialize", e);
        }
        return nullptr;
    }

protected:
    //! Keeps the parsed \p fields (Plugin reads its members from mFields).
    explicit PluginBase(PluginFields fields)
        : mFields(std::move(fields))
        , mMetadata(mFields.toString())
        , mAliasIo(mFields.getInt(Plugin::kFIELD_ALIAS_IO) != 0)
    {
    }

    PluginBase(PluginBase const&) = default;

    //! The input dims and dtypes of one phase's descriptors (\p where), after the checks
    //! every phase makes: descriptors there, accepted counts, and with \p runtime every
    //! dim known.
    struct Inputs
    {
        std::array<nvinfer1::Dims, kMaxInputs> dims{};
        std::array<nvinfer1::DataType, kMaxInputs> types{};
    };

    template <typename Desc>
    static Inputs inputsOf(
        Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs, char const* where, bool runtime)
    {
        check(in != nullptr && out != nullptr, where, ": null descriptors");
        checkCounts(nbInputs, nbOutputs);
        Inputs x;
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            nvinfer1::PluginTensorDesc const& d = tensorDesc(in[i]);
            x.dims[i] = d.dims;
            x.types[i] = d.type;
            check(!runtime || volume(d.dims) >= 0, Plugin::kINPUT_NAMES[i], ": expected known dims at run time, got ",
                dimsText(d.dims));
        }
        return x;
    }

    static nvinfer1::PluginTensorDesc const& tensorDesc(nvinfer1::DynamicPluginTensorDesc const& d) noexcept
    {
        return d.desc;
    }

    static nvinfer1::PluginTensorDesc const& tensorDesc(nvinfer1::PluginTensorDesc const& d) noexcept
    {
        return d;
    }

    //! Refuses input and output counts the plugin does not take.
    static void checkCounts(int32_t nbInputs, int32_t nbOutputs)
    {
        check(Plugin::validInputCount(nbInputs), "inputs: expected ", Plugin::kINPUT_COUNTS, ", got ", nbInputs);
        check(nbOutputs == Plugin::kNB_OUTPUTS, "outputs: expected ", Plugin::kNB_OUTPUTS, ", got ", nbOutputs);
    }

    //! enqueue's first steps (PluginBase::enqueue): the arguments are there, onShapeChange accepted these very
    //! shapes, and each in-place output bound elsewhere than its input first receives
    //! the input (functional ONNX form, in-place execution).
    void beginEnqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, cudaStream_t stream) const
    {
        check(inputDesc != nullptr && outputDesc != nullptr && inputs != nullptr && outputs != nullptr,
            "enqueue: null arguments");
        check(mShapeReady, "enqueue: called before onShapeChange accepted the input shapes");
        for (int32_t i = 0; i < mNbInputs; ++i)
        {
            check(sameDims(inputDesc[i].dims, mDims[i]) && inputDesc[i].type == mTypes[i],
                "enqueue: ", Plugin::kINPUT_NAMES[i], " is ", dimsText(inputDesc[i].dims), " ",
                dataTypeName(inputDesc[i].type), ", not the ", dimsText(mDims[i]), " ", dataTypeName(mTypes[i]),
                " onShapeChange accepted");
        }
        for (auto const& alias : Plugin::kALIASES)
        {
            int32_t const i = alias[1];
            cudaError_t const st = copyIfDistinct(outputs[alias[0]], inputs[i], inputDesc[i], stream);
            check(st == cudaSuccess, "enqueue: copying ", Plugin::kINPUT_NAMES[i],
                " to its output failed: ", cudaGetErrorName(st));
        }
    }

    PluginFields mFields;
    std::string mMetadata;
    bool mAliasIo{true};
    //! emptyInputMask() of the inputs (getOutputShapes, then configurePlugin): a
    //! zero-element placeholder is not declared as an alias.
    uint32_t mEmptyInputs{0};
    //! Set by a successful onShapeChange, with the inputs it accepted.
    bool mShapeReady{false};
    int32_t mNbInputs{0};
    std::array<nvinfer1::Dims, kMaxInputs> mDims{};
    std::array<nvinfer1::DataType, kMaxInputs> mTypes{};

private:
    Plugin& self() noexcept
    {
        return static_cast<Plugin&>(*this);
    }

    Plugin const& self() const noexcept
    {
        return static_cast<Plugin const&>(*this);
    }
};

//! The creator of Plugin: parses the PluginFieldCollection against Plugin::fieldSpecs().
template <typename Plugin>
class PluginCreatorT : public PluginIdentity<Plugin, nvinfer1::IPluginCreatorV3One>
{
public:
    PluginCreatorT()
        : mFieldNames(&Plugin::fieldSpecs())
    {
    }

    ~PluginCreatorT() override = default;

    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return mFieldNames.collection();
    }

    //! A new Plugin, or nullptr (logged) for fields that break the contract.
    nvinfer1::IPluginV3* createPlugin(char const* /* name */, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase /* phase */) noexcept override
    {
        try
        {
            // Both phases parse the same contract: at build time the ONNX parser's fields,
            // at run time what getFieldsToSerialize wrote.
            return new Plugin(PluginFields::parse(&Plugin::fieldSpecs(), fc));
        }
        catch (std::exception const& e)
        {
            logException(Plugin::kPLUGIN_NAME, "Creator::createPlugin", e);
        }
        return nullptr;
    }

private:
    FieldNames mFieldNames;
};

} // namespace plugin
} // namespace pytrt_kv
