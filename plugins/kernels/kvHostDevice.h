/*
 * Decorators and small helpers for logic compiled both for the GPU and for the host (CPU
 * tests run the host copy through the C ABI, so CI checks the decisions without a GPU).
 */
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PYTRT_KV_HD __host__ __device__ __forceinline__
#else
#define PYTRT_KV_HD inline
#endif

// Unrolling hint for the device pass only (the host compiler does not know the pragma).
#if defined(__CUDA_ARCH__)
#define PYTRT_KV_UNROLL _Pragma("unroll")
#else
#define PYTRT_KV_UNROLL
#endif

#if defined(PYTRT_KV_EMU)
#include "pytrtKvEmu.h"
#endif

namespace pytrt_kv
{
namespace kernels
{

// Plain global-memory loads and stores of the kernels (index tensors, tables, status rows,
// miss lists, single elements): `*p` under nvcc (zero cost, inlined); on the emulated
// device checked against the live allocations like the cache-hint intrinsics and reported
// at the caller's source line (docs/EMULATION.md). Host code (the host planning path) is
// not checked. Shared memory is accessed directly.
#if defined(PYTRT_KV_EMU)
template <typename T>
inline T loadGlobal(T const* p, char const* file = __builtin_FILE(), int line = __builtin_LINE())
{
    return ::pytrt_kv::emu::deviceLoad(p, false, file, line);
}

template <typename T>
inline void storeGlobal(T* p, T const& v, char const* file = __builtin_FILE(), int line = __builtin_LINE())
{
    ::pytrt_kv::emu::deviceStore(p, v, false, file, line);
}
#else
template <typename T>
PYTRT_KV_HD T loadGlobal(T const* p)
{
    return *p;
}

template <typename T>
PYTRT_KV_HD void storeGlobal(T* p, T const& v)
{
    *p = v;
}
#endif

//! Division of non-negative values by a positive divisor fixed at launch: a shift and a
//! mask when the divisor is a power of two (block sizes and TBS usually are), so the
//! kernels do no 64-bit division there; a plain division otherwise.
struct Divider
{
    int64_t divisor;
    int32_t shift; //!< log2(divisor) when it is a power of two, else -1

    //! \p d must be >= 1.
    static PYTRT_KV_HD Divider make(int64_t d)
    {
        Divider r{d, -1};
        if (d > 0 && (d & (d - 1)) == 0)
        {
            r.shift = 0;
            while ((int64_t{1} << r.shift) != d)
            {
                ++r.shift;
            }
        }
        return r;
    }

    //! \p x / divisor for \p x >= 0.
    PYTRT_KV_HD int64_t div(int64_t x) const
    {
        return shift >= 0 ? (x >> shift) : x / divisor;
    }

    //! \p x / divisor for 0 <= \p x < 2^31 and a divisor < 2^31: a shift, or a 32-bit
    //! division (several times cheaper than a 64-bit one on the GPU).
    PYTRT_KV_HD int32_t div32(int32_t x) const
    {
        return shift >= 0 ? (x >> shift) : x / static_cast<int32_t>(divisor);
    }

    //! \p x % divisor for \p x >= 0.
    PYTRT_KV_HD int64_t mod(int64_t x) const
    {
        return shift >= 0 ? (x & (divisor - 1)) : x - (x / divisor) * divisor;
    }
};

} // namespace kernels
} // namespace pytrt_kv
