#include "pluginDriver.h"

#include <cstring>

using namespace nvinfer1;

namespace pytrt_kv
{
namespace harness
{

IPluginCreatorV3One* findCreator(std::string const& name)
{
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    for (int32_t i = 0; i < n; ++i)
    {
        if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0)
        {
            continue;
        }
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        if (name == c->getPluginName())
        {
            return c;
        }
    }
    return nullptr;
}

IPluginV3OneCore* coreOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
}

IPluginV3OneBuildV2* buildOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
}

IPluginV3OneRuntime* runtimeOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}

PluginPtr create(std::string const& plugin, Fields& f, TensorRTPhase phase)
{
    IPluginCreatorV3One* c = findCreator(plugin);
    return PluginPtr(c == nullptr ? nullptr : c->createPlugin(plugin.c_str(), f.collection(), phase));
}

std::map<std::string, FieldValue> readFields(PluginFieldCollection const* fc)
{
    std::map<std::string, FieldValue> out;
    for (int32_t k = 0; fc != nullptr && k < fc->nbFields; ++k)
    {
        PluginField const& f = fc->fields[k];
        FieldValue v;
        v.type = f.type;
        if (f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            int32_t x{0};
            std::memcpy(&x, f.data, sizeof(x));
            v.i = x;
        }
        else if (f.type == PluginFieldType::kINT64 && f.length == 1)
        {
            std::memcpy(&v.i, f.data, sizeof(v.i));
        }
        else if (f.type == PluginFieldType::kCHAR)
        {
            auto const* c = static_cast<char const*>(f.data);
            size_t n = 0;
            while (n < static_cast<size_t>(f.length) && c[n] != '\0')
            {
                ++n;
            }
            v.s.assign(c, n);
        }
        out[f.name] = v;
    }
    return out;
}

char const* fieldTypeName(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kCHAR: return "kCHAR";
    default: return "other";
    }
}

std::string jsonString(std::string const& s)
{
    std::string out = "\"";
    for (char c : s)
    {
        if (c == '"' || c == '\\')
        {
            out += '\\';
        }
        out += c;
    }
    return out + "\"";
}

bool declaredOutputs(IPluginV3* p, std::vector<T> const& inputs, std::vector<T>& outputs)
{
    IPluginV3OneBuildV2* b = buildOf(p);
    int32_t const nbOut = b->getNbOutputs();
    int32_t const nbIn = static_cast<int32_t>(inputs.size());
    std::vector<DataType> inTypes;
    for (auto const& t : inputs)
    {
        inTypes.push_back(t.type);
    }
    std::vector<DataType> outTypes(nbOut, DataType::kBOOL);
    if (b->getOutputDataTypes(outTypes.data(), nbOut, inTypes.data(), nbIn) != 0)
    {
        return false;
    }
    ExprBuilder builder;
    std::vector<DimsExprs> in(nbIn);
    for (int32_t i = 0; i < nbIn; ++i)
    {
        in[i].nbDims = static_cast<int32_t>(inputs[i].dims.size());
        for (int32_t a = 0; a < in[i].nbDims; ++a)
        {
            in[i].d[a] = builder.constant(inputs[i].dims[a]);
        }
    }
    std::vector<DimsExprs> out(nbOut);
    if (b->getOutputShapes(in.data(), nbIn, nullptr, 0, out.data(), nbOut, builder) != 0)
    {
        return false;
    }
    outputs.clear();
    for (int32_t o = 0; o < nbOut; ++o)
    {
        T t{outTypes[o], {}};
        for (int32_t a = 0; a < out[o].nbDims; ++a)
        {
            t.dims.push_back(
                out[o].d[a] != nullptr && out[o].d[a]->isConstant() ? out[o].d[a]->getConstantValue() : -2);
        }
        outputs.push_back(t);
    }
    return true;
}

bool formatsAccepted(IPluginV3* p, std::vector<T> const& inputs, std::vector<T> const& outputs, TensorFormat format,
    int32_t* firstRefused)
{
    std::vector<T> all = inputs;
    all.insert(all.end(), outputs.begin(), outputs.end());
    auto descs = dynamicDescs(all, format);
    for (int32_t pos = 0; pos < static_cast<int32_t>(all.size()); ++pos)
    {
        if (!buildOf(p)->supportsFormatCombination(
                pos, descs.data(), static_cast<int32_t>(inputs.size()), static_cast<int32_t>(outputs.size())))
        {
            if (firstRefused != nullptr)
            {
                *firstRefused = pos;
            }
            return false;
        }
    }
    return true;
}

} // namespace harness
} // namespace pytrt_kv
