/*
 * Drives the plugins the way TensorRT does: finds their creators in this process (the
 * plugin objects are linked in), creates plugins from field collections built as a
 * producer (the ONNX parser, deserialization) would, and asks them for output types,
 * shapes and format support.
 */
#pragma once

#include "NvInferRuntime.h"
#include "mockTrt.h"

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

//! The plugin library's entry points (registration.cpp), linked into the harness.
extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

namespace pytrt_kv
{
namespace harness
{

//! The V3One creator named \p name, or nullptr.
nvinfer1::IPluginCreatorV3One* findCreator(std::string const& name);

//! The capability interfaces of \p p.
nvinfer1::IPluginV3OneCore* coreOf(nvinfer1::IPluginV3* p);
nvinfer1::IPluginV3OneBuildV2* buildOf(nvinfer1::IPluginV3* p);
nvinfer1::IPluginV3OneRuntime* runtimeOf(nvinfer1::IPluginV3* p);

using PluginPtr = std::unique_ptr<nvinfer1::IPluginV3>;

//! A nvinfer1::PluginFieldCollection with owned storage, filled the way a producer would.
class Fields
{
public:
    Fields& i32(char const* name, int32_t v)
    {
        return raw(name, &v, sizeof(v), nvinfer1::PluginFieldType::kINT32, 1);
    }
    Fields& i64(char const* name, int64_t v)
    {
        return raw(name, &v, sizeof(v), nvinfer1::PluginFieldType::kINT64, 1);
    }
    //! As the ONNX parser passes a STRING attribute: the characters, no terminator.
    Fields& str(char const* name, std::string const& s)
    {
        return raw(name, s.data(), s.size(), nvinfer1::PluginFieldType::kCHAR, static_cast<int32_t>(s.size()));
    }
    Fields& raw(char const* name, void const* data, size_t bytes, nvinfer1::PluginFieldType type, int32_t length)
    {
        mNames.emplace_back(name);
        mData.emplace_back(static_cast<uint8_t const*>(data), static_cast<uint8_t const*>(data) + bytes);
        mTypes.push_back(type);
        mLengths.push_back(length);
        return *this;
    }
    Fields& nullData(char const* name, nvinfer1::PluginFieldType type, int32_t length)
    {
        mNames.emplace_back(name);
        mData.emplace_back();
        mTypes.push_back(type);
        mLengths.push_back(-length - 1); // marker: pass a null pointer
        return *this;
    }
    nvinfer1::PluginFieldCollection const* collection()
    {
        mFields.clear();
        for (size_t i = 0; i < mNames.size(); ++i)
        {
            bool const null = mLengths[i] < 0;
            mFields.emplace_back(
                mNames[i].c_str(), null ? nullptr : mData[i].data(), mTypes[i], null ? -mLengths[i] - 1 : mLengths[i]);
        }
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.data();
        return &mCollection;
    }

private:
    std::deque<std::string> mNames;
    std::deque<std::vector<uint8_t>> mData;
    std::vector<nvinfer1::PluginFieldType> mTypes;
    std::vector<int32_t> mLengths;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

//! createPlugin of \p plugin's creator with \p f (nullptr when either refuses).
PluginPtr create(std::string const& plugin, Fields& f, nvinfer1::TensorRTPhase phase = nvinfer1::TensorRTPhase::kBUILD);

//! One field as a plugin wrote it (getFieldsToSerialize, getFieldNames).
struct FieldValue
{
    nvinfer1::PluginFieldType type{nvinfer1::PluginFieldType::kUNKNOWN};
    int64_t i{0};
    std::string s;
    bool operator==(FieldValue const& o) const
    {
        return type == o.type && i == o.i && s == o.s;
    }
};

//! The fields of \p fc by name (ints widened, strings up to their first NUL).
std::map<std::string, FieldValue> readFields(nvinfer1::PluginFieldCollection const* fc);

//! "kINT32", "kINT64", "kCHAR" or "other".
char const* fieldTypeName(nvinfer1::PluginFieldType t);

//! \p s as a JSON string literal.
std::string jsonString(std::string const& s);

//! Output types and shapes the plugin declares for \p inputs; false when it refuses.
bool declaredOutputs(nvinfer1::IPluginV3* p, std::vector<T> const& inputs, std::vector<T>& outputs);

//! Every position of the combination accepted, asked in TensorRT's order; \p firstRefused
//! (when given) receives the first position refused.
bool formatsAccepted(nvinfer1::IPluginV3* p, std::vector<T> const& inputs, std::vector<T> const& outputs,
    nvinfer1::TensorFormat format = nvinfer1::TensorFormat::kLINEAR, int32_t* firstRefused = nullptr);

} // namespace harness
} // namespace pytrt_kv
