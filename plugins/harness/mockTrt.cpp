#include "mockTrt.h"

#include <iostream>

using namespace nvinfer1;

namespace pytrt_kv
{
namespace harness
{

CaptureLogger gLogger;
Finder gFinder;

void CaptureLogger::echo(AsciiChar const* msg)
{
    std::cerr << "  [log] " << msg << "\n";
}

ILogger* Finder::findLogger() noexcept
{
    return &gLogger;
}

Dims makeDims(std::vector<int64_t> const& v)
{
    Dims d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
    {
        d.d[i] = v[i];
    }
    return d;
}

std::vector<DynamicPluginTensorDesc> dynamicDescs(std::vector<T> const& ts, TensorFormat format)
{
    std::vector<DynamicPluginTensorDesc> out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i)
    {
        out[i].desc.dims = makeDims(ts[i].dims);
        out[i].desc.type = ts[i].type;
        out[i].desc.format = format;
        out[i].desc.scale = -1.F;
        Dims mx = out[i].desc.dims;
        for (int32_t a = 0; a < mx.nbDims; ++a)
        {
            mx.d[a] = mx.d[a] < 0 ? 64 : mx.d[a]; // a profile's maximum for a wildcard
        }
        out[i].min = mx;
        out[i].opt = mx;
        out[i].max = mx;
    }
    return out;
}

std::vector<PluginTensorDesc> runtimeDescs(std::vector<T> const& ts)
{
    std::vector<PluginTensorDesc> out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i)
    {
        out[i].dims = makeDims(ts[i].dims);
        out[i].type = ts[i].type;
        out[i].format = TensorFormat::kLINEAR;
        out[i].scale = -1.F;
    }
    return out;
}

bool hasWildcard(std::vector<T> const& ts)
{
    for (auto const& t : ts)
    {
        for (int64_t d : t.dims)
        {
            if (d < 0)
            {
                return true;
            }
        }
    }
    return false;
}

} // namespace harness
} // namespace pytrt_kv
