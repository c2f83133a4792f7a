/*
 * What the parts of the emulated device's runtime share (docs/EMULATION.md); the API they
 * implement is include/pytrtKvEmu.h.
 *
 *   emuDevice.cpp       errors (last error, sticky faults), the device description
 *   emuMemory.cpp       allocations (of their exact size), the live-range registry,
 *                       the kernels' checked accesses, copies and fills
 *   emuStreams.cpp      one queue per stream, the seeded interleaving between them,
 *                       launches and their records, synchronization
 *   emuFibers.cpp       blocks as fibers: barriers, warp exchanges, schedules
 *   emuConversions.cpp  fp16 / bf16 conversions with the GPU's rounding and NaN
 */
#pragma once

#include "pytrtKvEmu.h"

// The runtime names its own variables like the built-ins.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#define PYTRT_KV_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define PYTRT_KV_EMU_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PYTRT_KV_EMU_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define PYTRT_KV_EMU_TSAN 1
#endif
#endif

#if defined(PYTRT_KV_EMU_ASAN)
extern "C" void __sanitizer_start_switch_fiber(void** fakeStackSave, void const* bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fakeStackSave, void const** bottomOld, size_t* sizeOld);
#endif
#if defined(PYTRT_KV_EMU_TSAN)
extern "C" void* __tsan_get_current_fiber();
extern "C" void* __tsan_create_fiber(unsigned flags);
extern "C" void __tsan_destroy_fiber(void* fiber);
extern "C" void __tsan_switch_to_fiber(void* fiber, unsigned flags);
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace pytrt_kv
{
namespace emu
{
namespace detail
{

// --- device description (H100-like) -------------------------------------------------------
constexpr int kSM_COUNT = 132;
constexpr int kMAX_THREADS_PER_SM = 2048;
constexpr int kMAX_BLOCKS_PER_SM = 32;
constexpr int kMAX_THREADS_PER_BLOCK = 1024;
constexpr int kSHARED_PER_BLOCK = 48 * 1024;

// --- errors (emuDevice.cpp) ------------------------------------------------------------------
//! The sticky fault of the process (cudaSuccess while the context is alive).
cudaError_t sticky();
//! Record \p e as this thread's last error and return it (cudaSuccess passes through).
cudaError_t fail(cudaError_t e);
//! A kernel fault: sticky for the process, like a GPU context after an illegal access.
void fault(cudaError_t e, std::string const& what);
//! cudaDeviceReset for the tests: no sticky fault, no last error.
void clearErrors();
//! sticky() as this thread's last error, or cudaSuccess.
inline cudaError_t stickyOrSuccess()
{
    return sticky() != cudaSuccess ? fail(sticky()) : cudaSuccess;
}

// --- memory (emuMemory.cpp) ------------------------------------------------------------------
//! Where [p, p + bytes) lies: 0 pageable host, 1 pinned/mapped host, 2 device; -1 when it
//! starts inside device or pinned memory but runs past its end.
int where(void const* p, size_t bytes);

// --- launches and queues (emuStreams.cpp) ----------------------------------------------------
//! One kernel launch and what its load/store intrinsics moved. The counters are atomics
//! only so that ThreadSanitizer, which sees each fiber as a thread, does not flag them.
struct LaunchRecord
{
    std::string name;
    dim3 grid;
    dim3 block;
    std::atomic<uint64_t> bytesRead{0};
    std::atomic<uint64_t> bytesWritten{0};
    std::atomic<uint64_t> loads{0};
    std::atomic<uint64_t> stores{0};
    // ThreadSanitizer sync objects of this launch only (a launch on another stream must not
    // be ordered through them): block start and end, block barrier and warp exchanges (one
    // per parity of their generation).
    char tsanStart{0};
    char tsanEnd{0};
    char tsanBlock[2]{};
    char tsanWarp[kMAX_THREADS_PER_BLOCK / 32][2]{};
};

//! The launch running on this OS thread (null outside kernels).
LaunchRecord* runningLaunch() noexcept;
bool validStream(cudaStream_t s);
//! Queue \p run on \p stream (issue order within the stream).
void enqueue(cudaStream_t stream, std::function<void()> run);
//! Run everything issued so far: each stream in its order, the streams interleaved by the
//! seeded schedule (legacy default stream semantics kept). Returns with the device idle.
void drain();
//! Run \p run on the device, in its issue order, now (synchronous copies and fills).
void runNow(std::function<void()> const& run);
//! Drop queued work (cudaDeviceReset for the tests).
void dropQueued();
//! Held while work runs on the device (frees take it so nothing runs on freed memory).
std::recursive_mutex& deviceMutex();
#if defined(PYTRT_KV_EMU_TSAN)
//! ThreadSanitizer fibers for the first \p threads threads of a block of the stream whose
//! work runs now: each stream has its own, so two streams' kernels are never ordered
//! through a reused fiber (a race between streams is reported).
void* const* streamThreadFibers(int threads);
//! The running stream's slot for its own kernel scheduler (emuFibers.cpp owns what it holds).
void*& streamScheduler();
#endif

// --- kernels (emuFibers.cpp) -----------------------------------------------------------------
//! Run every block of a launch; false after a fault.
void runKernel(LaunchRecord& record, dim3 grid, dim3 block, std::function<void()> const& body);
//! True while a kernel thread (a fiber) runs on this OS thread.
bool inKernel() noexcept;
//! "thread (x,y,z) of block (x,y,z)" of the running kernel thread.
std::string describeThread();

} // namespace detail
} // namespace emu
} // namespace pytrt_kv
