/*
 * Decorators for logic compiled both for the GPU and for the host (CPU tests run the
 * host copy through the C ABI, so CI checks the decisions without a GPU).
 */
#pragma once

#if defined(__CUDACC__)
#define PYTRT_KV_HD __host__ __device__ __forceinline__
#else
#define PYTRT_KV_HD inline
#endif
