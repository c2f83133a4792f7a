/*
 * What every plugin in this library implements the same way: the IPluginV3 plumbing
 * (PluginBase, a CRTP base) and the creator (PluginCreatorT). Both read from the
 * plugin class Plugin:
 *   static constexpr char const* kPLUGIN_NAME;          the TensorRT plugin name
 *   static constexpr int32_t kNB_OUTPUTS;                its output count
 *   static std::vector<FieldSpec> const& fieldSpecs();   its fields
 *   explicit Plugin(PluginFields fields);                construction from parsed fields
 *   Plugin(Plugin const&);                               clone()
 * A plugin still implements IPluginV3OneBuildV2 and IPluginV3OneRuntime (all but
 * getNbOutputs, getMetadataString, attachToContext and getFieldsToSerialize).
 */
#pragma once

#include "NvInferRuntime.h"
#include "pluginCommon.h"
#include "pluginFields.h"

#include <cstdint>
#include <exception>
#include <string>
#include <utility>

namespace pytrt_kv
{
namespace plugin
{

template <typename Plugin>
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
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

    // IPluginV3OneCore
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

    // IPluginV3OneRuntime
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
    {
    }

    PluginBase(PluginBase const&) = default;

    PluginFields mFields;
    std::string mMetadata;
};

//! The creator of Plugin: parses the PluginFieldCollection against Plugin::fieldSpecs().
template <typename Plugin>
class PluginCreatorT : public nvinfer1::IPluginCreatorV3One
{
public:
    PluginCreatorT()
        : mFieldNames(&Plugin::fieldSpecs())
    {
    }

    ~PluginCreatorT() override = default;

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
