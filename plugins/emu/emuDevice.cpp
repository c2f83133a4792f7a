/*
 * The emulated device's errors and description (docs/EMULATION.md): CUDA's numeric codes,
 * a per-thread last error (cudaGetLastError clears it, cudaPeekAtLastError does not) and
 * sticky kernel faults, as on a GPU context after an illegal access.
 */
#include "emuInternal.h"

#include <algorithm>
#include <cstdio>

namespace pytrt_kv
{
namespace emu
{
namespace detail
{
namespace
{
thread_local cudaError_t tLastError = cudaSuccess;
std::atomic<int> gSticky{cudaSuccess};
} // namespace

cudaError_t sticky()
{
    return static_cast<cudaError_t>(gSticky.load(std::memory_order_relaxed));
}

cudaError_t fail(cudaError_t e)
{
    if (e != cudaSuccess)
    {
        tLastError = e;
    }
    return e;
}

void fault(cudaError_t e, std::string const& what)
{
    int expected = cudaSuccess;
    gSticky.compare_exchange_strong(expected, e);
    std::fprintf(stderr, "pytrt_kv emulated device: %s\n", what.c_str());
}

void clearErrors()
{
    gSticky.store(cudaSuccess);
    tLastError = cudaSuccess;
}
} // namespace detail

using namespace detail;

cudaError_t cudaGetLastError()
{
    cudaError_t const e = sticky() != cudaSuccess ? sticky() : detail::tLastError;
    detail::tLastError = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError()
{
    return sticky() != cudaSuccess ? sticky() : detail::tLastError;
}

char const* cudaGetErrorName(cudaError_t e)
{
    switch (e)
    {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorStubLibrary: return "cudaErrorStubLibrary";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorUnknown: return "cudaErrorUnknown";
    }
    return "cudaErrorUnknown";
}

char const* cudaGetErrorString(cudaError_t e)
{
    switch (e)
    {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorStubLibrary: return "CUDA driver is a stub library";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorUnknown: return "unknown error";
    }
    return "unknown error";
}

cudaError_t cudaGetDeviceCount(int* count)
{
    if (count == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device)
{
    if (device == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    *device = 0;
    return stickyOrSuccess();
}

cudaError_t cudaSetDevice(int device)
{
    if (device != 0)
    {
        return fail(cudaErrorInvalidDevice);
    }
    return stickyOrSuccess();
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device)
{
    if (value == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    if (device != 0)
    {
        return fail(cudaErrorInvalidDevice);
    }
    switch (attr)
    {
    case cudaDevAttrMaxThreadsPerBlock: *value = kMAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = kSHARED_PER_BLOCK; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = kSM_COUNT; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = kMAX_THREADS_PER_SM; break;
    case cudaDevAttrUnifiedAddressing: *value = 1; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t occupancyMaxActiveBlocksPerMultiprocessor(int* blocks, int blockSize, size_t dynamicSmem)
{
    if (blocks == nullptr || blockSize <= 0 || blockSize > kMAX_THREADS_PER_BLOCK
        || dynamicSmem > static_cast<size_t>(kSHARED_PER_BLOCK))
    {
        return fail(cudaErrorInvalidValue);
    }
    *blocks = std::min(kMAX_BLOCKS_PER_SM, kMAX_THREADS_PER_SM / blockSize);
    return cudaSuccess;
}

} // namespace emu
} // namespace pytrt_kv

//! One line describing the emulated device (for `pytrt-kv info`).
extern "C" __attribute__((visibility("default"))) char const* pytrt_kv_emu_describe()
{
#if defined(PYTRT_KV_EMU_ASAN) && defined(__SANITIZE_UNDEFINED__)
    static char const* const kSan = "AddressSanitizer";
#elif defined(PYTRT_KV_EMU_ASAN)
    static char const* const kSan = "AddressSanitizer";
#elif defined(PYTRT_KV_EMU_TSAN)
    static char const* const kSan = "ThreadSanitizer";
#else
    static char const* const kSan = "none";
#endif
    static std::string const text = std::string(
                                        "emulated device (pytrt_kv, CPU): H100-like description, 132 SMs, "
                                        "2048 threads/SM, 48 KiB shared/block; sanitizer: ")
        + kSan;
    return text.c_str();
}
