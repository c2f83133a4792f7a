/*
 * The emulated device (docs/EMULATION.md): what the unchanged kernel sources (plugins/kernels),
 * capi.cpp, the plugins and the harness need of CUDA, for a host C++17 compiler.
 *
 * - Qualifiers (__global__, __device__, __shared__, ...), dim3 / vector types, the
 *   built-in index variables, __syncthreads() with real barrier semantics (the threads of
 *   a block are fibers: emuFibers.cpp), the warp shuffle with per-warp lockstep semantics,
 *   atomics, the load/store cache-hint intrinsics (bounds-checked against the live
 *   allocations, reported at their source line, counted per launch; the kernels' plain
 *   global accesses go through loadGlobal/storeGlobal, kvHostDevice.h, checked the same
 *   way), fp16/bf16 conversions with the GPU's rounding and canonical NaN.
 * - The runtime subset our code calls (the cuda* functions below), with CUDA's numeric
 *   error codes and last-error semantics. Work on a stream is deferred to its own queue
 *   and executed when something waits, the streams interleaved by a seeded schedule
 *   (emuStreams.cpp), so a host read that forgets to synchronize sees stale memory and two
 *   unordered streams race, as on a GPU.
 * - PYTRT_KV_LAUNCH (plugins/kernels/kvLaunch.h) maps to pytrt_kv::emu::launch.
 *
 * Everything is C++ in namespace pytrt_kv::emu (the cuda* names are brought to the global
 * namespace by using-declarations), so nothing here can bind to a real libcudart loaded
 * in the same process.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>

#define PYTRT_KV_EMU 1

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// Block-shared storage: function statics in one section, which the runtime fills with a
// poison pattern before every block (shared memory is uninitialized on a GPU); blocks
// run one at a time, so one copy serves every block.
#define __shared__ static __attribute__((section("pytrt_kv_emu_shared"), aligned(16)))

//! CUDA's warp size.
constexpr int warpSize = 32;

struct dim3
{
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx)
        , y(vy)
        , z(vz)
    {
    }
};

struct uint3
{
    unsigned int x, y, z;
};

struct alignas(16) uint4
{
    unsigned int x, y, z, w;
};

struct alignas(8) uint2
{
    unsigned int x, y;
};

//! IEEE binary16 storage (the kernels only convert it).
struct __half
{
    unsigned short bits;
};

//! bfloat16 storage.
struct __nv_bfloat16
{
    unsigned short bits;
};

// --- runtime types and constants (CUDA's values) -------------------------------------

enum cudaError
{
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorStubLibrary = 34,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalAddress = 700,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorUnknown = 999,
};
using cudaError_t = cudaError;

struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;

#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

enum cudaMemcpyKind
{
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaMemoryType
{
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3,
};

struct cudaPointerAttributes
{
    cudaMemoryType type;
    int device;
    void* devicePointer;
    void* hostPointer;
};

enum cudaDeviceAttr
{
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxThreadsPerMultiProcessor = 39,
    cudaDevAttrUnifiedAddressing = 41,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
};

constexpr unsigned int cudaHostRegisterDefault = 0x00;
constexpr unsigned int cudaHostRegisterPortable = 0x01;
constexpr unsigned int cudaHostRegisterMapped = 0x02;
constexpr unsigned int cudaHostRegisterIoMemory = 0x04;
constexpr unsigned int cudaHostRegisterReadOnly = 0x08;
constexpr unsigned int cudaHostAllocDefault = 0x00;
constexpr unsigned int cudaHostAllocPortable = 0x01;
constexpr unsigned int cudaHostAllocMapped = 0x02;
constexpr unsigned int cudaHostAllocWriteCombined = 0x04;

namespace pytrt_kv
{
namespace emu
{

// --- the runtime subset (emuDevice/Memory/Streams.cpp) ----------------------------------

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
char const* cudaGetErrorName(cudaError_t e);
char const* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int flags);
cudaError_t cudaHostUnregister(void* ptr);
cudaError_t cudaHostGetDevicePointer(void** devicePtr, void* hostPtr, unsigned int flags);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, void const* ptr);
cudaError_t cudaMemcpy(void* dst, void const* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(
    void* dst, void const* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t occupancyMaxActiveBlocksPerMultiprocessor(int* blocks, int blockSize, size_t dynamicSmem);

template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, F /*kernel*/, int blockSize, size_t dynamicSmem)
{
    return occupancyMaxActiveBlocksPerMultiprocessor(blocks, blockSize, dynamicSmem);
}

// --- kernels -------------------------------------------------------------------------

//! The built-in variables of the thread that is running.
struct ThreadState
{
    uint3 threadIdx;
    uint3 blockIdx;
    dim3 blockDim;
    dim3 gridDim;
};

ThreadState const& currentThread() noexcept;

//! Enqueue a launch of \p body (the kernel with its arguments, captured by value) on
//! \p stream; sets the launch error (cudaGetLastError) like <<<>>> does.
void enqueueLaunch(char const* name, dim3 grid, dim3 block, cudaStream_t stream, std::function<void()> body);

template <typename Kernel, typename... Args>
void launch(char const* name, Kernel kernel, dim3 grid, dim3 block, cudaStream_t stream, Args const&... args)
{
    enqueueLaunch(name, grid, block, stream, [kernel, args...]() { kernel(args...); });
}

void syncthreads();
//! Lockstep exchange of one 64-bit value among the lanes of \p mask; returns the value of
//! lane \p srcLane (own value when \p srcLane is outside the mask's lanes).
uint64_t warpExchange(unsigned int mask, uint64_t value, int srcLane);
//! A kernel access of \p bytes at \p p from \p file:\p line: true when it lies inside live
//! device, pinned or mapped memory (\p counted: in the launch's work counters), false after
//! recording an illegal address. Host code (no kernel running) is not checked.
bool deviceAccess(void const* p, size_t bytes, bool write, bool counted, char const* file, int line) noexcept;
//! A point where another thread of the block may run (atomics, with a shuffled schedule).
void maybeYield();

//! A checked kernel load (\p counted: a cache-hint intrinsic, in the work counters).
template <typename T>
T deviceLoad(T const* p, bool counted, char const* file, int line)
{
    T v{};
    if (deviceAccess(p, sizeof(T), false, counted, file, line))
    {
        std::memcpy(&v, p, sizeof(T));
    }
    return v;
}

//! A checked kernel store (see deviceLoad).
template <typename T>
void deviceStore(T* p, T const& v, bool counted, char const* file, int line)
{
    if (deviceAccess(p, sizeof(T), true, counted, file, line))
    {
        std::memcpy(p, &v, sizeof(T));
    }
}

float halfToFloat(unsigned short h) noexcept;
unsigned short floatToHalfRn(float f) noexcept;
float bf16ToFloat(unsigned short h) noexcept;
unsigned short floatToBf16Rn(float f) noexcept;

} // namespace emu
} // namespace pytrt_kv

using pytrt_kv::emu::cudaDeviceGetAttribute;
using pytrt_kv::emu::cudaDeviceSynchronize;
using pytrt_kv::emu::cudaFree;
using pytrt_kv::emu::cudaFreeHost;
using pytrt_kv::emu::cudaGetDevice;
using pytrt_kv::emu::cudaGetDeviceCount;
using pytrt_kv::emu::cudaGetErrorName;
using pytrt_kv::emu::cudaGetErrorString;
using pytrt_kv::emu::cudaGetLastError;
using pytrt_kv::emu::cudaHostAlloc;
using pytrt_kv::emu::cudaHostGetDevicePointer;
using pytrt_kv::emu::cudaHostRegister;
using pytrt_kv::emu::cudaHostUnregister;
using pytrt_kv::emu::cudaMalloc;
using pytrt_kv::emu::cudaMemcpy;
using pytrt_kv::emu::cudaMemcpyAsync;
using pytrt_kv::emu::cudaMemset;
using pytrt_kv::emu::cudaMemsetAsync;
using pytrt_kv::emu::cudaOccupancyMaxActiveBlocksPerMultiprocessor;
using pytrt_kv::emu::cudaPeekAtLastError;
using pytrt_kv::emu::cudaPointerGetAttributes;
using pytrt_kv::emu::cudaSetDevice;
using pytrt_kv::emu::cudaStreamCreate;
using pytrt_kv::emu::cudaStreamDestroy;
using pytrt_kv::emu::cudaStreamSynchronize;

#define threadIdx (::pytrt_kv::emu::currentThread().threadIdx)
#define blockIdx (::pytrt_kv::emu::currentThread().blockIdx)
#define blockDim (::pytrt_kv::emu::currentThread().blockDim)
#define gridDim (::pytrt_kv::emu::currentThread().gridDim)

inline void __syncthreads()
{
    ::pytrt_kv::emu::syncthreads();
}

template <typename T>
T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize)
{
    static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value, "__shfl_up_sync: 64-bit max");
    int const lane = static_cast<int>(threadIdx.x % warpSize);
    int const segment = lane - lane % width;
    int const src = lane - static_cast<int>(delta) >= segment ? lane - static_cast<int>(delta) : lane;
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    uint64_t const got = ::pytrt_kv::emu::warpExchange(mask, bits, src);
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

// Atomics: real atomic operations (ThreadSanitizer sees them as such), each a point where
// a shuffled schedule may switch threads.
inline int atomicCAS(int* p, int expected, int desired)
{
    ::pytrt_kv::emu::maybeYield();
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expected;
}

inline int atomicAdd(int* p, int x)
{
    ::pytrt_kv::emu::maybeYield();
    return __atomic_fetch_add(p, x, __ATOMIC_RELAXED);
}

inline unsigned int atomicAdd(unsigned int* p, unsigned int x)
{
    ::pytrt_kv::emu::maybeYield();
    return __atomic_fetch_add(p, x, __ATOMIC_RELAXED);
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long x)
{
    ::pytrt_kv::emu::maybeYield();
    return __atomic_fetch_add(p, x, __ATOMIC_RELAXED);
}

inline int atomicMin(int* p, int x)
{
    ::pytrt_kv::emu::maybeYield();
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (x < old && !__atomic_compare_exchange_n(p, &old, x, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    {
    }
    return old;
}

// Cache-hint loads and stores: bounds-checked against live allocations, reported at the
// caller's source line, and counted (the extra parameters take the caller's location).
template <typename T>
T __ldg(T const* p, char const* file = __builtin_FILE(), int line = __builtin_LINE())
{
    return ::pytrt_kv::emu::deviceLoad(p, true, file, line);
}

template <typename T>
T __ldcs(T const* p, char const* file = __builtin_FILE(), int line = __builtin_LINE())
{
    return ::pytrt_kv::emu::deviceLoad(p, true, file, line);
}

template <typename T>
void __stwb(T* p, T v, char const* file = __builtin_FILE(), int line = __builtin_LINE())
{
    ::pytrt_kv::emu::deviceStore(p, v, true, file, line);
}

inline float __half2float(__half h)
{
    return ::pytrt_kv::emu::halfToFloat(h.bits);
}

inline __half __float2half_rn(float f)
{
    return __half{::pytrt_kv::emu::floatToHalfRn(f)};
}

inline float __bfloat162float(__nv_bfloat16 h)
{
    return ::pytrt_kv::emu::bf16ToFloat(h.bits);
}

inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    return __nv_bfloat16{::pytrt_kv::emu::floatToBf16Rn(f)};
}
