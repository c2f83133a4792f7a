#include "gpuRunner.h"

#include "NvInferRuntime.h"
#include "harnessCheck.h"
#include "harnessIo.h"
#include "mockTrt.h"
#include "pluginCommon.h"
#include "pluginDriver.h"

#include <cuda_runtime_api.h>

#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using namespace nvinfer1;
using pytrt_kv::plugin::dimsToString;

namespace pytrt_kv
{
namespace harness
{

namespace
{

#define HARNESS_CUDA(call)                                                                                             \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const e_ = (call);                                                                                 \
        if (e_ != cudaSuccess)                                                                                         \
        {                                                                                                              \
            throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorName(e_));                                \
        }                                                                                                              \
    } while (0)

struct Buffer
{
    void* base{nullptr};   //!< what to free
    void* device{nullptr}; //!< what the plugin sees
    bool host{false};
    size_t bytes{0};
    ~Buffer()
    {
        if (base != nullptr)
        {
            host ? cudaFreeHost(base) : cudaFree(base);
        }
    }
};

std::unique_ptr<Buffer> allocate(size_t bytes, bool host)
{
    auto b = std::make_unique<Buffer>();
    b->bytes = bytes;
    b->host = host;
    size_t const n = bytes == 0 ? 1 : bytes; // zero-element tensors still get a valid address
    if (host)
    {
        HARNESS_CUDA(cudaHostAlloc(&b->base, n, cudaHostAllocMapped));
        HARNESS_CUDA(cudaHostGetDevicePointer(&b->device, b->base, 0));
    }
    else
    {
        HARNESS_CUDA(cudaMalloc(&b->base, n));
        b->device = b->base;
    }
    return b;
}

std::vector<uint8_t> download(Buffer const& b)
{
    std::vector<uint8_t> out(b.bytes);
    if (b.bytes != 0)
    {
        HARNESS_CUDA(cudaMemcpy(out.data(), b.device, b.bytes, cudaMemcpyDefault));
    }
    return out;
}

std::string firstDifference(std::vector<uint8_t> const& got, std::vector<uint8_t> const& want)
{
    if (got.size() != want.size())
    {
        return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
    }
    for (size_t i = 0; i < got.size(); ++i)
    {
        if (got[i] != want[i])
        {
            return "first differing byte " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", want "
                + std::to_string(want[i]);
        }
    }
    return "";
}

//! Everything up to onShapeChange runs on the CPU; \p gpu adds enqueue on buffers.
void runCase(std::string const& dir, bool gpu)
{
    Case c = loadCase(dir);
    std::string const label = c.plugin + " " + dir;
    IPluginCreatorV3One* creator = findCreator(c.plugin);
    expect(creator != nullptr, label + ": creator");
    if (creator == nullptr)
    {
        return;
    }
    Fields f;
    for (auto const& fld : c.fields)
    {
        fld.isInt ? f.i32(fld.name.c_str(), fld.intValue) : f.str(fld.name.c_str(), fld.text);
    }
    PluginPtr built = create(c.plugin, f);
    expect(built != nullptr, label + ": build-phase plugin");
    if (!built)
    {
        return;
    }
    std::vector<T> in;
    for (auto const& t : c.inputs)
    {
        in.push_back({t.type, std::vector<int64_t>(t.dims.d, t.dims.d + t.dims.nbDims)});
    }
    std::vector<T> out;
    expect(declaredOutputs(built.get(), in, out) && out.size() == c.outputs.size(), label + ": outputs declared");
    for (size_t o = 0; o < out.size() && o < c.outputs.size(); ++o)
    {
        std::vector<int64_t> want(c.outputs[o].dims.d, c.outputs[o].dims.d + c.outputs[o].dims.nbDims);
        expect(out[o].type == c.outputs[o].type && out[o].dims == want,
            label + ": output " + c.outputs[o].name + " type/shape as the reference");
    }
    auto din = dynamicDescs(in);
    auto dout = dynamicDescs(out);
    int32_t const nbIn = static_cast<int32_t>(in.size());
    int32_t const nbOut = static_cast<int32_t>(out.size());
    expect(formatsAccepted(built.get(), in, out), label + ": formats");
    expect(buildOf(built.get())->configurePlugin(din.data(), nbIn, dout.data(), nbOut) == 0, label + ": configure");
    size_t const workspace = buildOf(built.get())->getWorkspaceSize(din.data(), nbIn, dout.data(), nbOut);

    // The alias map, whatever alias_io the case uses (the copy path is tested with it).
    Fields aliasOn;
    aliasOn.i32("alias_io", 1);
    if (c.plugin == "ScatterPaKvCache")
    {
        for (auto const& fld : c.fields)
        {
            if (!fld.isInt)
            {
                aliasOn.str(fld.name.c_str(), fld.text);
            }
        }
    }
    PluginPtr aliasProbe = create(c.plugin, aliasOn);
    std::vector<int32_t> alias(nbOut, -1);
    for (int32_t o = 0; aliasProbe && o < nbOut; ++o)
    {
        alias[o] = buildOf(aliasProbe.get())->getAliasedInput(o);
    }

    PluginPtr runtime(creator->createPlugin(
        c.plugin.c_str(), runtimeOf(built.get())->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    expect(runtime != nullptr, label + ": runtime-phase plugin from the serialized fields");
    if (!runtime)
    {
        return;
    }
    PluginPtr context(runtimeOf(runtime.get())->attachToContext(nullptr));
    auto rin = runtimeDescs(in);
    auto rout = runtimeDescs(out);
    expect(
        runtimeOf(context.get())->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) == 0, label + ": onShapeChange");
    if (!gpu)
    {
        return;
    }

    cudaStream_t stream{};
    HARNESS_CUDA(cudaStreamCreate(&stream));
    for (bool inPlace : {true, false})
    {
        std::string const mode = inPlace ? " [in place]" : " [separate outputs]";
        std::vector<std::unique_ptr<Buffer>> inBufs;
        std::vector<void const*> inPtrs;
        for (auto const& t : c.inputs)
        {
            inBufs.push_back(allocate(t.bytes.size(), t.host));
            if (!t.bytes.empty())
            {
                HARNESS_CUDA(cudaMemcpy(inBufs.back()->device, t.bytes.data(), t.bytes.size(), cudaMemcpyDefault));
            }
            inPtrs.push_back(inBufs.back()->device);
        }
        std::vector<std::unique_ptr<Buffer>> outBufs;
        std::vector<void*> outPtrs;
        for (int32_t o = 0; o < nbOut; ++o)
        {
            if (inPlace && alias[o] >= 0)
            {
                outBufs.push_back(nullptr);
                outPtrs.push_back(inBufs[alias[o]]->device);
                continue;
            }
            // Garbage, so that a missing input->output copy cannot go unnoticed.
            outBufs.push_back(allocate(c.outputs[o].bytes.size(), false));
            HARNESS_CUDA(cudaMemset(outBufs.back()->device, 0xA5, outBufs.back()->bytes));
            outPtrs.push_back(outBufs.back()->device);
        }
        auto ws = allocate(workspace, false);
        int32_t const rc = runtimeOf(context.get())
                               ->enqueue(rin.data(), rout.data(), inPtrs.data(), outPtrs.data(),
                                   workspace ? ws->device : nullptr, stream);
        expect(rc == 0, label + mode + ": enqueue returned 0");
        HARNESS_CUDA(cudaStreamSynchronize(stream));
        HARNESS_CUDA(cudaGetLastError());
        for (int32_t o = 0; o < nbOut; ++o)
        {
            Buffer const& b = (inPlace && alias[o] >= 0) ? *inBufs[alias[o]] : *outBufs[o];
            std::string const diff = firstDifference(download(b), c.outputs[o].bytes);
            expect(diff.empty(), label + mode + ": " + c.outputs[o].name + " bit-exact vs reference " + diff);
        }
        for (int32_t i = 0; i < nbIn; ++i)
        {
            bool aliasedHere = false;
            for (int32_t o = 0; o < nbOut; ++o)
            {
                aliasedHere = aliasedHere || (inPlace && alias[o] == i);
            }
            if (!aliasedHere)
            {
                std::string const diff = firstDifference(download(*inBufs[i]), c.inputs[i].bytes);
                expect(diff.empty(), label + mode + ": input " + c.inputs[i].name + " unchanged " + diff);
            }
        }
    }
    HARNESS_CUDA(cudaStreamDestroy(stream));
}

} // namespace

int32_t commandRun(int argc, char** argv, bool gpu)
{
    int32_t devices = 0;
    if (gpu && (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0))
    {
        std::cerr << "harness run: no CUDA device\n";
        return 2;
    }
    for (int i = 2; i < argc; ++i)
    {
        try
        {
            runCase(argv[i], gpu);
        }
        catch (std::exception const& e)
        {
            expect(false, std::string(argv[i]) + ": " + e.what());
        }
    }
    std::cout << "harness " << (gpu ? "run" : "cases") << ": " << argc - 2 << " cases, " << gChecks << " checks, "
              << gFailures << " failed\n";
    return gFailures == 0 ? 0 : 1;
}

} // namespace harness
} // namespace pytrt_kv
