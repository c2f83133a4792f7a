/*
 * pytrt_kv plugins: shared helpers (see pluginCommon.h).
 */
#include "pluginCommon.h"

#include "NvInferVersion.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <limits>
#include <mutex>

namespace pytrt_kv
{
namespace plugin
{
namespace
{

std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder{nullptr};
std::atomic<LoggerGetter> gFallbackGetter{nullptr};
//! Set when TensorRT handed over a finder of the other interface layout (setLoggerFinder):
//! a handled situation, so nothing is said until a message actually goes to stderr.
std::atomic<bool> gForeignFinder{false};
std::atomic<bool> gForeignNoteSaid{false};

char const* severityName(nvinfer1::ILogger::Severity severity) noexcept
{
    switch (severity)
    {
    case nvinfer1::ILogger::Severity::kINTERNAL_ERROR: return "INTERNAL_ERROR";
    case nvinfer1::ILogger::Severity::kERROR: return "ERROR";
    case nvinfer1::ILogger::Severity::kWARNING: return "WARNING";
    case nvinfer1::ILogger::Severity::kINFO: return "INFO";
    case nvinfer1::ILogger::Severity::kVERBOSE: return "VERBOSE";
    }
    return "?";
}

} // namespace

int32_t loadedTensorRtAbi() noexcept
{
    auto loaded = [](char const* soname) {
        void* h = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
        if (h != nullptr)
        {
            dlclose(h);
        }
        return h != nullptr;
    };
    bool const v11 = loaded("libnvinfer.so.11") || loaded("libtensorrt_rtx.so.1");
    bool const v10 = loaded("libnvinfer.so.10");
    return v11 == v10 ? 0 : (v11 ? 11 : 10);
}

int32_t tensorRtAbiOf(void const* address) noexcept
{
    // The library that holds the address, by its file name (a symlink such as
    // libnvinfer.so is resolved to the versioned file it points to).
    auto classify = [](char const* path) {
        char const* slash = path != nullptr ? std::strrchr(path, '/') : nullptr;
        char const* base = slash != nullptr ? slash + 1 : path;
        if (base == nullptr)
        {
            return 0;
        }
        if (std::strncmp(base, "libnvinfer.so.11", 16) == 0 || std::strncmp(base, "libtensorrt_rtx.so", 18) == 0)
        {
            return 11;
        }
        return std::strncmp(base, "libnvinfer.so.10", 16) == 0 ? 10 : 0;
    };
    Dl_info info{};
    if (address != nullptr && dladdr(address, &info) != 0 && info.dli_fname != nullptr)
    {
        int32_t abi = classify(info.dli_fname);
        if (abi == 0)
        {
            if (char* real = realpath(info.dli_fname, nullptr))
            {
                abi = classify(real);
                std::free(real);
            }
        }
        if (abi != 0)
        {
            return abi;
        }
    }
    return loadedTensorRtAbi();
}

bool abiMatchesHeaders(int32_t abi) noexcept
{
    return abi == 0 || (abi >= 11) == (NV_TENSORRT_MAJOR >= 11);
}

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    // The finder's vtable lies in the TensorRT library that made it: with two TensorRT
    // majors loaded in one process, that one decides, not whichever is loaded. A finder of
    // the other layout is not called (its messages go to stderr instead); that is handled,
    // so it is not announced here (issue 17): log() says it once, with the first message
    // that actually goes to stderr because of it.
    if (finder != nullptr && !abiMatchesHeaders(tensorRtAbiOf(*reinterpret_cast<void* const*>(finder))))
    {
        gForeignFinder.store(true);
        return;
    }
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    // TensorRT may call this once per loadLibrary; the first finder stays valid for the
    // library's lifetime, so later calls are ignored rather than racing a reader.
    if (gLoggerFinder == nullptr)
    {
        gLoggerFinder = finder;
    }
}

void setFallbackLoggerGetter(LoggerGetter getter) noexcept
{
    gFallbackGetter.store(getter);
}

nvinfer1::ILogger* getLogger() noexcept
{
    {
        std::lock_guard<std::mutex> lock(gLoggerMutex);
        if (gLoggerFinder != nullptr)
        {
            // findLogger must run on the thread of the plugin call (ILoggerFinder docs),
            // which is why it is asked each time and never cached.
            try
            {
                if (nvinfer1::ILogger* logger = gLoggerFinder->findLogger())
                {
                    return logger;
                }
            }
            catch (...)
            {
            }
        }
    }
    LoggerGetter getter = gFallbackGetter.load();
    return getter != nullptr ? getter() : nullptr;
}

void log(nvinfer1::ILogger::Severity severity, char const* where, std::string const& message) noexcept
{
    try
    {
        std::string const text = concat("pytrt_kv::", where, ": ", message);
        if (nvinfer1::ILogger* logger = getLogger())
        {
            logger->log(severity, text.c_str());
        }
        else
        {
            if (gForeignFinder.load() && !gForeignNoteSaid.exchange(true))
            {
                std::fprintf(stderr,
                    "[pytrt_kv] NOTE: plugin messages go to stderr, not to TensorRT's logger: this "
                    "library was built against TensorRT %d headers and the loaded TensorRT has "
                    "the other ILoggerFinder layout (docs/TENSORRT.md, \"Header version vs "
                    "TensorRT ABI\")\n",
                    static_cast<int>(NV_TENSORRT_MAJOR));
            }
            std::fprintf(stderr, "[pytrt_kv] %s: %s\n", severityName(severity), text.c_str());
        }
    }
    catch (...)
    {
        // Out of memory while formatting: nothing sensible is left to do, and aborting
        // is not an option.
    }
}

void logError(char const* where, std::string const& message) noexcept
{
    log(nvinfer1::ILogger::Severity::kERROR, where, message);
}

void logWarning(char const* where, std::string const& message) noexcept
{
    log(nvinfer1::ILogger::Severity::kWARNING, where, message);
}

void logException(char const* where, std::exception const& e) noexcept
{
    logError(where, e.what());
}

void logException(char const* wherePrefix, char const* whereSuffix, std::exception const& e) noexcept
{
    try
    {
        logException(concat(wherePrefix, whereSuffix).c_str(), e);
    }
    catch (std::exception const&)
    {
        logException(wherePrefix, e); // out of memory for the name: the prefix alone
    }
}

bool toKernelType(nvinfer1::DataType type, kernels::DataType& out) noexcept
{
    using nvinfer1::DataType;
    using K = kernels::DataType;
    switch (type)
    {
    case DataType::kFLOAT: out = K::kFLOAT32; return true;
    case DataType::kHALF: out = K::kFLOAT16; return true;
    case DataType::kBF16: out = K::kBFLOAT16; return true;
    case DataType::kINT8: out = K::kINT8; return true;
    case DataType::kUINT8: out = K::kUINT8; return true;
    // TensorRT has one FP8 type and it is E4M3; E5M2 caches cannot reach a plugin.
    case DataType::kFP8: out = K::kFP8_E4M3; return true;
    case DataType::kINT32: out = K::kINT32; return true;
    case DataType::kINT64: out = K::kINT64; return true;
    default: return false;
    }
}

kernels::DataType kernelTypeOf(nvinfer1::DataType type, char const* what)
{
    kernels::DataType out{};
    check(toKernelType(type, out), what, ": dtype ", dataTypeName(type), " is not supported by pytrt_kv");
    return out;
}

char const* dataTypeName(nvinfer1::DataType type) noexcept
{
    using nvinfer1::DataType;
    switch (type)
    {
    case DataType::kFLOAT: return "kFLOAT";
    case DataType::kHALF: return "kHALF";
    case DataType::kBF16: return "kBF16";
    case DataType::kINT8: return "kINT8";
    case DataType::kUINT8: return "kUINT8";
    case DataType::kFP8: return "kFP8";
    case DataType::kINT32: return "kINT32";
    case DataType::kINT64: return "kINT64";
    case DataType::kBOOL: return "kBOOL";
    default: return "(other)";
    }
}

std::ostream& operator<<(std::ostream& os, DimsText const& text)
{
    os << '[';
    for (int32_t i = 0; i < text.dims.nbDims && i < nvinfer1::Dims::MAX_DIMS; ++i)
    {
        os << (i ? ", " : "") << text.dims.d[i];
    }
    return os << ']';
}

std::string dimsToString(nvinfer1::Dims const& dims)
{
    return concat(dimsText(dims));
}

bool sameDims(nvinfer1::Dims const& a, nvinfer1::Dims const& b) noexcept
{
    if (a.nbDims != b.nbDims || a.nbDims < 0 || a.nbDims > nvinfer1::Dims::MAX_DIMS)
    {
        return a.nbDims == b.nbDims;
    }
    for (int32_t i = 0; i < a.nbDims; ++i)
    {
        if (a.d[i] != b.d[i])
        {
            return false;
        }
    }
    return true;
}

int64_t volume(nvinfer1::Dims const& dims) noexcept
{
    int64_t v = 1;
    for (int32_t i = 0; i < dims.nbDims && i < nvinfer1::Dims::MAX_DIMS; ++i)
    {
        if (!known(dims.d[i]))
        {
            return -1;
        }
        v *= dims.d[i];
    }
    return v;
}

bool isEmpty(nvinfer1::Dims const& dims) noexcept
{
    for (int32_t i = 0; i < dims.nbDims && i < nvinfer1::Dims::MAX_DIMS; ++i)
    {
        if (dims.d[i] == 0)
        {
            return true;
        }
    }
    return false;
}

bool isEmpty(nvinfer1::DimsExprs const& dims) noexcept
{
    for (int32_t i = 0; i < dims.nbDims && i < nvinfer1::Dims::MAX_DIMS; ++i)
    {
        if (dims.d[i] != nullptr && dims.d[i]->isConstant() && dims.d[i]->getConstantValue() == 0)
        {
            return true;
        }
    }
    return false;
}

uint32_t emptyInputMask(nvinfer1::DimsExprs const* inputs, int32_t nbInputs) noexcept
{
    uint32_t mask = 0;
    for (int32_t i = 0; inputs != nullptr && i < nbInputs && i < 32; ++i)
    {
        mask |= isEmpty(inputs[i]) ? (1U << i) : 0U;
    }
    return mask;
}

uint32_t emptyInputMask(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs) noexcept
{
    uint32_t mask = 0;
    for (int32_t i = 0; inputs != nullptr && i < nbInputs && i < 32; ++i)
    {
        mask |= isEmpty(inputs[i].desc.dims) ? (1U << i) : 0U;
    }
    return mask;
}

cudaError_t copyIfDistinct(
    void* dst, void const* src, nvinfer1::PluginTensorDesc const& desc, cudaStream_t stream) noexcept
{
    kernels::DataType t{};
    if (!toKernelType(desc.type, t))
    {
        return cudaErrorInvalidValue;
    }
    int64_t const n = volume(desc.dims);
    if (n < 0)
    {
        return cudaErrorInvalidValue;
    }
    if (dst == src || n == 0)
    {
        return cudaSuccess;
    }
    if (dst == nullptr || src == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    size_t const bytes = static_cast<size_t>(n) * static_cast<size_t>(kernels::dataTypeSize(t));
    auto const d = reinterpret_cast<uintptr_t>(dst);
    auto const s = reinterpret_cast<uintptr_t>(src);
    if (d < s + bytes && s < d + bytes)
    {
        // Distinct but overlapping ranges: cudaMemcpyAsync's result is undefined there
        // (issue 16), and no binding of the in-place contract produces them.
        return cudaErrorInvalidValue;
    }
    cudaError_t const e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
    if (e != cudaSuccess)
    {
        // Ours (cudart is linked statically): left pending, it would make every later
        // launch on this thread refuse to run (kvError.h refusePendingError).
        cudaGetLastError();
    }
    return e;
}

// Messages are built only on failure: these run on every shape check.
void checkRank(nvinfer1::Dims const& dims, int32_t rank, char const* name)
{
    if (dims.nbDims != rank)
    {
        throw PluginError(concat(name, ": expected rank ", rank, ", got ", dimsText(dims)));
    }
}

void checkDim(nvinfer1::Dims const& dims, int32_t axis, int64_t expected, char const* name, char const* what)
{
    if (axis >= dims.nbDims)
    {
        throw PluginError(concat(name, ": expected at least ", axis + 1, " dims, got ", dimsText(dims)));
    }
    if (!sameOrUnknown(dims.d[axis], expected))
    {
        throw PluginError(
            concat(name, ": expected dim ", axis, " = ", expected, " (", what, "), got ", dimsText(dims)));
    }
}

int32_t toInt32(int64_t value, char const* name)
{
    check(value >= 0 && value <= std::numeric_limits<int32_t>::max(), name, ": expected a size in [0, 2^31), got ",
        value);
    return static_cast<int32_t>(value);
}

} // namespace plugin
} // namespace pytrt_kv
