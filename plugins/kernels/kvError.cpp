#include "kvError.h"

#include <cstdio>

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
        std::snprintf(tLastError, sizeof(tLastError), "%s: %s (%s)", where, cudaGetErrorName(e),
            cudaGetErrorString(e));
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
