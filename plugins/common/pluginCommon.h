/*
 * pytrt_kv plugins: what both plugins share. Throwing checks (TensorRT overrides catch
 * them), logging through TensorRT's logger, the one nvinfer1 -> kernels dtype mapping
 * and small Dims helpers that understand build-time wildcards (-1).
 */
#pragma once

#include "NvInferRuntime.h"
#include "kvCommon.h"
#include "kvContract.h"

#include <cstdint>
#include <cuda_runtime_api.h>
#include <sstream>
#include <stdexcept>
#include <string>

//! Marks the libraries' entry points. TensorRT's TENSORRTAPI is empty outside TensorRT's
//! own build, and this project compiles with hidden visibility, so it cannot be used.
#define PYTRT_KV_EXPORT __attribute__((visibility("default")))

namespace pytrt_kv
{
namespace plugin
{

//! Plugin namespace (= ONNX domain) and version of every plugin in this library
//! (kvContract.h, generated from pytrt_kv/specs.py NAMESPACE, PLUGIN_VERSION).
constexpr char const* kPLUGIN_NAMESPACE{contract::kPLUGIN_NAMESPACE};
constexpr char const* kPLUGIN_VERSION{contract::kPLUGIN_VERSION};

//! Thrown by every check inside the plugins; the noexcept TensorRT overrides catch it,
//! log it and return an error status (never abort).
class PluginError : public std::runtime_error
{
public:
    using std::runtime_error::runtime_error;
};

//! Builds a message from stream-insertable parts: check(cond, "x: expected ", a, ", got ", b).
template <typename... Parts>
std::string concat(Parts const&... parts)
{
    std::ostringstream os;
    (os << ... << parts);
    return os.str();
}

//! Throws PluginError with the concatenated message when \p condition is false.
template <typename... Parts>
void check(bool condition, Parts const&... parts)
{
    if (!condition)
    {
        throw PluginError(concat(parts...));
    }
}

//! The interface layout of the TensorRT library loaded in this process: 11 when
//! libnvinfer.so.11 or TensorRT-RTX's libtensorrt_rtx.so.1 is loaded, 10 for
//! libnvinfer.so.10, 0 when neither or both (unknown). TensorRT 11 (and TensorRT-RTX 1.x)
//! made ILogger, ILoggerFinder and IPluginRegistry derive from IVersionedInterface and
//! dropped deprecated methods, so their vtables differ from TensorRT 10's; the plugin
//! interfaces (IPluginV3, IPluginCreatorV3One) kept theirs.
int32_t loadedTensorRtAbi() noexcept;

//! The interface layout of the TensorRT library that holds \p address (a symbol, or an
//! object's vtable), from its file name: 11, 10, or loadedTensorRtAbi() when the library
//! is not recognised. Decides correctly where loadedTensorRtAbi() cannot: two TensorRT
//! majors loaded in one process (e.g. libnvinfer.so.10 beside libtensorrt_rtx.so.1).
int32_t tensorRtAbiOf(void const* address) noexcept;

//! True when \p abi (from loadedTensorRtAbi) is unknown or the one of the headers this
//! library was compiled with: only then may TensorRT's ILogger, ILoggerFinder and
//! IPluginRegistry objects be called (docs/TENSORRT.md, "Header version vs TensorRT ABI").
bool abiMatchesHeaders(int32_t abi) noexcept;

//! Keeps the finder TensorRT hands over through setLoggerFinder (first one wins); a
//! finder of the other layout (abiMatchesHeaders) is not kept: messages go to stderr.
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

//! A second way to find a logger, used by the self-registering library, which has no
//! finder: a function returning TensorRT's global logger (looked up at load time).
using LoggerGetter = nvinfer1::ILogger* (*) () noexcept;
void setFallbackLoggerGetter(LoggerGetter getter) noexcept;

//! The logger messages go to: the finder's, else the fallback's, else nullptr (then
//! messages go to stderr).
nvinfer1::ILogger* getLogger() noexcept;

//! Sends \p message to the logger at \p severity, prefixed with "pytrt_kv::<where>: ".
void log(nvinfer1::ILogger::Severity severity, char const* where, std::string const& message) noexcept;
void logError(char const* where, std::string const& message) noexcept;
void logWarning(char const* where, std::string const& message) noexcept;

//! Logs the exception caught in a noexcept override, at error severity.
void logException(char const* where, std::exception const& e) noexcept;

//! As logException, with the location in two parts joined as they are: the plugin name
//! and "::method" (e.g. "ScatterPaKvCache", "::clone").
void logException(char const* wherePrefix, char const* whereSuffix, std::exception const& e) noexcept;

//! The one dtype mapping: returns false (and leaves \p out) for types the kernels do
//! not know (kBOOL, kINT4, kFP4, ...).
bool toKernelType(nvinfer1::DataType type, kernels::DataType& out) noexcept;

//! As toKernelType, throwing PluginError naming \p what for an unknown type.
kernels::DataType kernelTypeOf(nvinfer1::DataType type, char const* what);

//! Spelling of a TensorRT dtype in messages ("kHALF", ...).
char const* dataTypeName(nvinfer1::DataType type) noexcept;

//! "[4, -1, 8]".
std::string dimsToString(nvinfer1::Dims const& dims);

//! \p dims for a check() message, formatted only when the message is built (on failure):
//! check(ok, "x: expected ..., got ", dimsText(d)).
struct DimsText
{
    nvinfer1::Dims const& dims;
};
inline DimsText dimsText(nvinfer1::Dims const& dims) noexcept
{
    return DimsText{dims};
}
std::ostream& operator<<(std::ostream& os, DimsText const& text);

//! Same rank and dims (what enqueue compares with the shapes onShapeChange validated).
bool sameDims(nvinfer1::Dims const& a, nvinfer1::Dims const& b) noexcept;

//! Product of the dims; -1 when a dim is unknown (build-time wildcard).
int64_t volume(nvinfer1::Dims const& dims) noexcept;

//! True when the dim is known; build-time descriptors use -1 for "not yet known".
inline bool known(int64_t d) noexcept
{
    return d >= 0;
}

//! Equality that holds whenever one side is still unknown: build-time checks refuse
//! only what is certainly wrong, run-time checks (all dims known) refuse everything.
inline bool sameOrUnknown(int64_t a, int64_t b) noexcept
{
    return !known(a) || !known(b) || a == b;
}

//! Checks the rank of input \p name and throws "name: expected rank R, got [dims]".
void checkRank(nvinfer1::Dims const& dims, int32_t rank, char const* name);

//! Checks dims[axis] == expected (unless one is unknown) with a message naming both.
void checkDim(nvinfer1::Dims const& dims, int32_t axis, int64_t expected, char const* name, char const* what);

//! True when a known dim is 0: how a model passes an absent optional tensor.
bool isEmpty(nvinfer1::Dims const& dims) noexcept;

//! The build-time form of isEmpty(): a dim that is the constant 0.
bool isEmpty(nvinfer1::DimsExprs const& dims) noexcept;

//! Bit i set when input i is a known zero-element tensor (an absent optional tensor, or
//! a cache with no blocks). The alias policy of both plugins: an output is declared
//! aliased to its input unless that input is zero-element (nothing to update in place,
//! and TensorRT cannot alias a zero-element constant). getAliasedInput may be called
//! right after getOutputShapes, before configurePlugin (TensorRT-RTX does), so the mask
//! is computed there from the DimsExprs, and again in configurePlugin
//! (docs/TENSORRT.md, "Aliasing").
uint32_t emptyInputMask(nvinfer1::DimsExprs const* inputs, int32_t nbInputs) noexcept;
uint32_t emptyInputMask(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs) noexcept;

//! \p aliased unless input \p aliased is flagged in \p emptyInputs (then -1): the alias
//! policy above.
inline int32_t aliasUnlessEmpty(int32_t aliased, uint32_t emptyInputs) noexcept
{
    return aliased >= 0 && aliased < 32 && ((emptyInputs >> aliased) & 1U) != 0 ? -1 : aliased;
}

//! Copies the tensor described by \p desc from \p src to \p dst on \p stream when the two
//! addresses differ (the in-place contract: an output bound elsewhere than its input
//! first receives the input). Unified addressing copies host or device memory alike.
//! Distinct but overlapping ranges are refused with cudaErrorInvalidValue.
cudaError_t copyIfDistinct(
    void* dst, void const* src, nvinfer1::PluginTensorDesc const& desc, cudaStream_t stream) noexcept;

//! Narrows a known dim to int32 or throws naming \p name (the kernels use int32 sizes).
int32_t toInt32(int64_t value, char const* name);

} // namespace plugin
} // namespace pytrt_kv
