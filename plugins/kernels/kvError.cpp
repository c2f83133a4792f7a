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
