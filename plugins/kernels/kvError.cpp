#include "kvError.h"

#include "kvContract.h"

#include <cstdio>

// The status codes pytrt_kv/contract/limits.py gives a meaning (the ctypes layer maps
// them to exceptions and to the "no GPU" message) are CUDA's own.
static_assert(pytrt_kv::contract::kSTATUS_SUCCESS == cudaSuccess, "kvContract.h: kSTATUS_SUCCESS");
static_assert(
    pytrt_kv::contract::kSTATUS_INVALID_VALUE == cudaErrorInvalidValue, "kvContract.h: kSTATUS_INVALID_VALUE");
static_assert(pytrt_kv::contract::kSTATUS_STUB_LIBRARY == cudaErrorStubLibrary, "kvContract.h: kSTATUS_STUB_LIBRARY");
static_assert(pytrt_kv::contract::kSTATUS_INSUFFICIENT_DRIVER == cudaErrorInsufficientDriver,
    "kvContract.h: kSTATUS_INSUFFICIENT_DRIVER");
static_assert(pytrt_kv::contract::kSTATUS_NO_DEVICE == cudaErrorNoDevice, "kvContract.h: kSTATUS_NO_DEVICE");

namespace pytrt_kv
{
namespace kernels
{
namespace
{
thread_local char tLastError[512] = {0};
} // namespace

cudaError_t invalidArgument(char const* message) noexcept
{
    std::snprintf(tLastError, sizeof(tLastError), "%s", message);
    return cudaErrorInvalidValue;
}

cudaError_t recordLaunch(cudaError_t e, char const* where) noexcept
{
    if (e != cudaSuccess)
    {
        std::snprintf(tLastError, sizeof(tLastError), "%s: %s (%s)", where, cudaGetErrorName(e), cudaGetErrorString(e));
    }
    return e;
}

cudaError_t refusePendingError(char const* op) noexcept
{
    cudaError_t const pending = cudaPeekAtLastError();
    if (pending != cudaSuccess)
    {
        std::snprintf(tLastError, sizeof(tLastError),
            "%s: not launched: CUDA reports an error from before this call: %s (%s) (an earlier failure on "
            "this thread, or a CUDA runtime that cannot start); it is left pending for its owner",
            op, cudaGetErrorName(pending), cudaGetErrorString(pending));
    }
    return pending;
}

char const* lastErrorMessage() noexcept
{
    return tLastError;
}

void clearLastError() noexcept
{
    tLastError[0] = '\0';
}

} // namespace kernels
} // namespace pytrt_kv
