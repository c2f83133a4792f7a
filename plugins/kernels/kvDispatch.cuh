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

#include <cstdint>
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
    static __device__ __forceinline__ float toFloat(float x) { return x; }
    static __device__ __forceinline__ float fromFloat(float x) { return x; }
};
template <>
struct FloatIO<__half>
{
    static __device__ __forceinline__ float toFloat(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half fromFloat(float x) { return __float2half_rn(x); }
};
template <>
struct FloatIO<__nv_bfloat16>
{
    static __device__ __forceinline__ float toFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 fromFloat(float x) { return __float2bfloat16_rn(x); }
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

//! Blocks for a grid-stride copy over \p tasks groups of \p group threads: enough to fill
//! every SM (8 blocks of kBLOCK_THREADS each, more than can be resident), no more, so that
//! tasks with nothing to copy (kept slots, padding) cost a loop iteration, not a block.
inline int64_t copyGridSize(int64_t tasks, int32_t group)
{
    int64_t const groupsPerBlock = kBLOCK_THREADS / group;
    int64_t const needed = (tasks + groupsPerBlock - 1) / groupsPerBlock;
    int device = 0;
    int sms = 0;
    // Both queries are cheap and allowed during stream capture; on failure fall back to a
    // generous fixed cap (the kernels are grid-stride loops, any size is correct). Only an
    // error these queries caused is cleared: a caller's pending error is left for it.
    bool const nonePending = cudaPeekAtLastError() == cudaSuccess;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0)
    {
        if (nonePending)
        {
            cudaGetLastError();
        }
        sms = 256;
    }
    return needed < int64_t{8} * sms ? needed : int64_t{8} * sms;
}

} // namespace kernels
} // namespace pytrt_kv
