/*
 * The one dtype-dispatch helper of the kernels: byte movers are instantiated per vector
 * width (never per dtype), index tensors per index type, and the "rope" mean per float
 * format. Each dispatcher calls \p f with a tag type and returns its cudaError_t, or
 * cudaErrorInvalidValue for a value it does not know.
 */
#pragma once

#include "kvCommon.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace pytrt_kv
{
namespace kernels
{

//! Unsigned type that moves W bytes in one access.
template <int W>
struct VecOf;
template <>
struct VecOf<16>
{
    using Type = uint4;
};
template <>
struct VecOf<8>
{
    using Type = uint2;
};
template <>
struct VecOf<4>
{
    using Type = unsigned int;
};
template <>
struct VecOf<2>
{
    using Type = unsigned short;
};
template <>
struct VecOf<1>
{
    using Type = unsigned char;
};

//! Largest power of two <= 16 dividing every value of \p v (addresses and byte counts).
inline int vectorWidth(std::initializer_list<uint64_t> v)
{
    int w = 16;
    for (uint64_t x : v)
    {
        while (w > 1 && x % static_cast<uint64_t>(w) != 0)
        {
            w /= 2;
        }
    }
    return w;
}

template <typename F>
cudaError_t dispatchVectorWidth(int width, F&& f)
{
    switch (width)
    {
    case 16: return f(std::integral_constant<int, 16>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 1: return f(std::integral_constant<int, 1>{});
    default: return cudaErrorInvalidValue;
    }
}

template <typename T>
struct TypeTag
{
    using Type = T;
};

template <typename F>
cudaError_t dispatchIndexType(DataType t, F&& f)
{
    switch (t)
    {
    case DataType::kINT32: return f(TypeTag<int32_t>{});
    case DataType::kINT64: return f(TypeTag<int64_t>{});
    default: return cudaErrorInvalidValue;
    }
}

template <typename F>
cudaError_t dispatchFloatType(DataType t, F&& f)
{
    switch (t)
    {
    case DataType::kFLOAT32: return f(TypeTag<float>{});
    case DataType::kFLOAT16: return f(TypeTag<__half>{});
    case DataType::kBFLOAT16: return f(TypeTag<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
    }
}

//! float conversions of the "rope" mean: exact widening, round-to-nearest-even narrowing.
template <typename T>
struct FloatIO;
template <>
struct FloatIO<float>
{
    static __device__ __forceinline__ float toFloat(float x)
    {
        return x;
    }
    static __device__ __forceinline__ float fromFloat(float x)
    {
        return x;
    }
};
template <>
struct FloatIO<__half>
{
    static __device__ __forceinline__ float toFloat(__half x)
    {
        return __half2float(x);
    }
    static __device__ __forceinline__ __half fromFloat(float x)
    {
        return __float2half_rn(x);
    }
};
template <>
struct FloatIO<__nv_bfloat16>
{
    static __device__ __forceinline__ float toFloat(__nv_bfloat16 x)
    {
        return __bfloat162float(x);
    }
    static __device__ __forceinline__ __nv_bfloat16 fromFloat(float x)
    {
        return __float2bfloat16_rn(x);
    }
};

//! Rows of \p n vectors moved by groups of G threads, G a power of two <= 32 (small rows
//! share a warp, so no lane idles on 1-head decode rows).
inline int groupSize(int64_t vectorsPerRow)
{
    int g = 1;
    while (g < 32 && g < vectorsPerRow)
    {
        g *= 2;
    }
    return g;
}

//! Vectors each lane keeps in flight: loads are all issued before the first store.
constexpr int kUNROLL = 4;
constexpr int kBLOCK_THREADS = 256;

//! How copyVectors loads: kSTREAM (__ldcs, data read once and evicted first: the gather's
//! full cache, possibly pinned host memory) or kREADONLY (__ldg: the scatter's sources).
enum class LoadPolicy
{
    kSTREAM,
    kREADONLY,
};

template <LoadPolicy P, typename V>
__device__ __forceinline__ V loadVector(V const* p)
{
    if constexpr (P == LoadPolicy::kSTREAM)
    {
        return __ldcs(p);
    }
    else
    {
        return __ldg(p);
    }
}

//! The one copy primitive of both operators: a group of \p group lanes moves \p nv
//! W-byte vectors, vector idx from src(idx) to dst(idx). Each lane issues kUNROLL loads
//! before its first store (many outstanding reads per thread, as pinned host memory needs).
//! ready() is called once, after the first loads are issued and before the first store:
//! a caller whose destination depends on a value still in flight (the scatter's slot)
//! tests it there, so that the source loads overlap the slot load; returning false drops
//! the row (the loaded values are discarded: sources must be readable either way).
template <int W, LoadPolicy P, typename SrcFn, typename DstFn, typename ReadyFn>
__device__ __forceinline__ void copyVectors(
    int32_t nv, int32_t lane, int32_t group, SrcFn src, DstFn dst, ReadyFn ready)
{
    using V = typename VecOf<W>::Type;
    int32_t base = lane;
    bool first = true;
    for (; base < nv; base += group * kUNROLL)
    {
        V buf[kUNROLL];
#pragma unroll
        for (int u = 0; u < kUNROLL; ++u)
        {
            int32_t const idx = base + u * group;
            if (idx < nv)
            {
                buf[u] = loadVector<P>(reinterpret_cast<V const*>(src(idx)));
            }
        }
        if (first)
        {
            first = false;
            if (!ready())
            {
                return;
            }
        }
#pragma unroll
        for (int u = 0; u < kUNROLL; ++u)
        {
            int32_t const idx = base + u * group;
            if (idx < nv)
            {
                __stwb(reinterpret_cast<V*>(dst(idx)), buf[u]); // a plain store (write-back)
            }
        }
    }
}

//! ready() for copies whose destination is known up front.
struct AlwaysReady
{
    __device__ __forceinline__ bool operator()() const
    {
        return true;
    }
};

//! Blocks for a grid-stride kernel over \p tasks groups of \p group threads: at most as
//! many as can be resident at once (the occupancy API, for this kernel's registers and
//! shared memory), no more, so that a grid never queues a second wave of blocks.
//!
//! Pending-error policy: the launch entry points refuse to run while a CUDA error is
//! pending (refusePendingError, kvError.h), so an error raised by these queries is ours
//! and is cleared here (the kernels are grid-stride loops: any grid size is correct, so
//! a failed query falls back to a generous fixed size).
//!
//! \p Kernel is a template argument, not a function argument: the cache below is then one
//! per kernel. Keyed by the kernel's type, every vector width (and index or float type
//! with the same argument struct) would share the first instantiation's count.
template <auto Kernel>
int64_t residentGridSize(int64_t tasks, int32_t group)
{
    int64_t const groupsPerBlock = kBLOCK_THREADS / group;
    int64_t const needed = (tasks + groupsPerBlock - 1) / groupsPerBlock;
    // Resident blocks per device, computed once per kernel and device (the occupancy
    // query costs microseconds; eager calls should not pay it every time).
    constexpr int kCACHED_DEVICES = 16;
    static std::atomic<int32_t> cache[kCACHED_DEVICES]{};
    int device = 0;
    int sms = 0;
    int perSm = 0;
    int64_t resident = 0;
    bool const known = cudaGetDevice(&device) == cudaSuccess;
    if (known && device >= 0 && device < kCACHED_DEVICES)
    {
        resident = cache[device].load(std::memory_order_relaxed);
    }
    if (resident <= 0)
    {
        if (!known || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess
            || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, Kernel, kBLOCK_THREADS, 0) != cudaSuccess
            || sms <= 0 || perSm <= 0)
        {
            cudaGetLastError();
            resident = int64_t{132} * 8;
        }
        else
        {
            resident = static_cast<int64_t>(sms) * perSm;
            if (device >= 0 && device < kCACHED_DEVICES)
            {
                cache[device].store(static_cast<int32_t>(resident), std::memory_order_relaxed);
            }
        }
    }
    return needed < resident ? (needed > 0 ? needed : 1) : resident;
}

} // namespace kernels
} // namespace pytrt_kv
