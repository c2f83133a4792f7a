/*
 * Runtime of the emulated device (docs/EMULATION.md; declarations in
 * include/pytrtKvEmu.h).
 *
 * - Memory: device allocations and pinned host memory are host memory with a registry of
 *   live ranges; kernel loads/stores through the cache-hint intrinsics must fall inside a
 *   live device or pinned range (else: cudaErrorIllegalAddress, sticky, as on a GPU).
 * - Streams: one queue in issue order for every stream (a valid schedule of any stream
 *   program); it runs when something waits: a stream or device synchronize, a synchronous
 *   copy, a free. Copies touching pageable host memory run at once, as CUDA stages them.
 * - Kernels: blocks run one after another; the threads of a block are fibers (ucontext)
 *   switched only at __syncthreads, warp shuffles and (shuffled schedules) atomics. A
 *   barrier that not every live thread reaches is reported, not waited on forever.
 * - Sanitizers: fiber switches are annotated for AddressSanitizer and ThreadSanitizer;
 *   under ThreadSanitizer, fibers are ordered only by the barriers (release/acquire), so
 *   a missing __syncthreads is a reported data race.
 * Nothing here throws across the API or aborts the process.
 */
#include "pytrtKvEmu.h"

// The runtime names its own variables like the built-ins.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <vector>

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
#endif

// Bounds of the __shared__ section of the library this runtime is linked into (weak: a
// library without kernels has none).
extern "C" char __start_pytrt_kv_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_pytrt_kv_emu_shared[] __attribute__((weak, visibility("hidden")));

namespace pytrt_kv
{
namespace emu
{
namespace
{

// --- device description (H100-like) -----------------------------------------------------
constexpr int kSM_COUNT = 132;
constexpr int kMAX_THREADS_PER_SM = 2048;
constexpr int kMAX_BLOCKS_PER_SM = 32;
constexpr int kMAX_THREADS_PER_BLOCK = 1024;
constexpr int kSHARED_PER_BLOCK = 48 * 1024;
constexpr unsigned char kSHARED_POISON = 0xA5;

// --- errors ---------------------------------------------------------------------------
thread_local cudaError_t tLastError = cudaSuccess;
std::atomic<int> gSticky{cudaSuccess};

cudaError_t sticky()
{
    return static_cast<cudaError_t>(gSticky.load(std::memory_order_relaxed));
}

//! Record \p e as this thread's last error and return it (cudaSuccess passes through).
cudaError_t fail(cudaError_t e)
{
    if (e != cudaSuccess)
    {
        tLastError = e;
    }
    return e;
}

//! A kernel fault: sticky for the process, like a GPU context after an illegal access.
void fault(cudaError_t e, std::string const& what)
{
    int expected = cudaSuccess;
    gSticky.compare_exchange_strong(expected, e);
    std::fprintf(stderr, "pytrt_kv emulated device: %s\n", what.c_str());
}

// --- memory registry --------------------------------------------------------------------
enum class Kind
{
    kDEVICE,
    kPINNED_ALLOC,
    kREGISTERED,
};

struct Range
{
    size_t bytes;
    Kind kind;
};

std::mutex gMemMutex;
std::map<uintptr_t, Range> gRanges; // base -> range (never overlapping)

//! The live range holding [p, p + bytes), or end().
std::map<uintptr_t, Range>::const_iterator findRange(void const* p, size_t bytes)
{
    auto const a = reinterpret_cast<uintptr_t>(p);
    auto it = gRanges.upper_bound(a);
    if (it == gRanges.begin())
    {
        return gRanges.end();
    }
    --it;
    if (a >= it->first && bytes <= it->second.bytes && a - it->first <= it->second.bytes - bytes)
    {
        return it;
    }
    return gRanges.end();
}

bool overlapsAny(uintptr_t a, size_t bytes)
{
    auto it = gRanges.upper_bound(a);
    if (it != gRanges.end() && it->first < a + bytes)
    {
        return true;
    }
    if (it == gRanges.begin())
    {
        return false;
    }
    --it;
    return it->first + it->second.bytes > a;
}

// --- the queue ------------------------------------------------------------------------
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
};

struct Op
{
    std::function<void()> run;
};

std::recursive_mutex gDeviceMutex; // held while the queue runs, and by frees
std::mutex gQueueMutex;
std::deque<Op> gQueue;
std::set<cudaStream_t> gStreams;
std::mutex gRecordMutex;
std::deque<std::unique_ptr<LaunchRecord>> gRecords;
constexpr size_t kMAX_RECORDS = 4096;

bool validStream(cudaStream_t s)
{
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread)
    {
        return true;
    }
    std::lock_guard<std::mutex> lock(gQueueMutex);
    return gStreams.count(s) != 0;
}

void enqueue(std::function<void()> run)
{
    std::lock_guard<std::mutex> lock(gQueueMutex);
    gQueue.push_back(Op{std::move(run)});
}

//! Run everything issued so far, in issue order.
void drain()
{
    std::lock_guard<std::recursive_mutex> device(gDeviceMutex);
    for (;;)
    {
        Op op;
        {
            std::lock_guard<std::mutex> lock(gQueueMutex);
            if (gQueue.empty())
            {
                return;
            }
            op = std::move(gQueue.front());
            gQueue.pop_front();
        }
        if (sticky() == cudaSuccess)
        {
            op.run(); // after a fault the context is dead: queued work is dropped
        }
    }
}

// --- fibers -----------------------------------------------------------------------------
enum class FiberState
{
    kRUNNABLE,
    kBLOCK_BARRIER,
    kWARP_BARRIER,
    kDONE,
};

struct Fiber
{
    int index{0};
    ucontext_t ctx;
    char* stack{nullptr};
    size_t stackBytes{0};
    ThreadState state{};
    std::atomic<FiberState> status{FiberState::kDONE};
    void* asanFakeStack{nullptr};
    void* tsanFiber{nullptr};
    uint64_t rng{0}; //!< this thread's draws of a random schedule (seeded per block)
};

struct Warp
{
    std::atomic<int> arrived{0};
    std::atomic<unsigned int> mask{0};
    std::atomic<unsigned int> generation{0};
    uint64_t values[32];
    char tsanTokens[2];
};

//! Schedule of the threads of a block between switch points.
enum class Schedule
{
    kFORWARD,
    kREVERSE,
    kRANDOM,
};

struct Scheduler
{
    std::vector<std::unique_ptr<Fiber>> fibers; //!< grown on demand, stacks kept
    int threads{0};                             //!< fibers of the block that runs
    std::atomic<int> live{0};                   //!< its threads that have not exited
    Warp warps[kMAX_THREADS_PER_BLOCK / 32];
    std::atomic<int> blockArrived{0};
    // ThreadSanitizer sync objects of the block barrier, one per parity of its generation:
    // a thread resuming from barrier g must not acquire what others released at g + 1.
    std::atomic<unsigned int> blockGeneration{0};
    char tsanBlockTokens[2];
    ucontext_t main;
    void const* mainStackBottom{nullptr};
    size_t mainStackBytes{0};
    void* mainTsan{nullptr};
    std::atomic<Fiber*> current{nullptr};
    std::function<void()> const* body{nullptr};
    LaunchRecord* record{nullptr};
    bool failed{false};
    Schedule schedule{Schedule::kFORWARD};
    uint64_t rng{0x9E3779B97F4A7C15ULL};
};

// Set by the scheduler, read by the fibers of the same OS thread (atomics: see LaunchRecord).
thread_local std::atomic<Scheduler*> tScheduler{nullptr};
thread_local std::atomic<ThreadState const*> tThread{nullptr};
// ThreadSanitizer sync objects: block start (scheduler -> fibers) and end (fibers -> scheduler).
char gTsanStartToken;
char gTsanEndToken;
ThreadState const kHOST_THREAD{};

size_t stackBytes()
{
#if defined(PYTRT_KV_EMU_ASAN) || defined(PYTRT_KV_EMU_TSAN)
    return size_t{512} * 1024;
#else
    return size_t{128} * 1024;
#endif
}

Schedule configuredSchedule(uint64_t& seed)
{
    char const* s = std::getenv("PYTRT_KV_EMU_SCHEDULE");
    if (s == nullptr || std::strcmp(s, "forward") == 0 || s[0] == '\0')
    {
        return Schedule::kFORWARD;
    }
    if (std::strcmp(s, "reverse") == 0)
    {
        return Schedule::kREVERSE;
    }
    if (std::strncmp(s, "random", 6) == 0)
    {
        seed = s[6] == ':' ? std::strtoull(s + 7, nullptr, 10) * 0x9E3779B97F4A7C15ULL + 1 : 0x2545F4914F6CDD1DULL;
        return Schedule::kRANDOM;
    }
    std::fprintf(stderr,
        "pytrt_kv emulated device: PYTRT_KV_EMU_SCHEDULE=%s is not forward, reverse or random[:SEED]; "
        "using forward\n",
        s);
    return Schedule::kFORWARD;
}

uint64_t nextRandom(uint64_t& x)
{
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
}

void switchToFiber(Scheduler& s, Fiber& f)
{
    s.current.store(&f, std::memory_order_relaxed);
    tThread.store(&f.state, std::memory_order_relaxed);
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_switch_to_fiber(f.tsanFiber, 1 /* no synchronization: barriers order fibers */);
#endif
#if defined(PYTRT_KV_EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack, f.stackBytes);
#endif
    swapcontext(&s.main, &f.ctx);
#if defined(PYTRT_KV_EMU_ASAN)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    tThread.store(&kHOST_THREAD, std::memory_order_relaxed);
    s.current.store(nullptr, std::memory_order_relaxed);
}

//! Back to the scheduler from the running fiber (\p exiting: it never resumes).
void switchToMain(Scheduler& s, bool exiting)
{
    Fiber& f = *s.current.load(std::memory_order_relaxed);
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_switch_to_fiber(s.mainTsan, 1);
#endif
#if defined(PYTRT_KV_EMU_ASAN)
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f.asanFakeStack, s.mainStackBottom, s.mainStackBytes);
#else
    (void) exiting;
#endif
    swapcontext(&f.ctx, &s.main);
#if defined(PYTRT_KV_EMU_ASAN)
    __sanitizer_finish_switch_fiber(f.asanFakeStack, &s.mainStackBottom, &s.mainStackBytes);
#endif
}

void fiberEntry()
{
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_acquire(&gTsanStartToken);
#endif
    Scheduler& s = *tScheduler.load(std::memory_order_relaxed);
#if defined(PYTRT_KV_EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &s.mainStackBottom, &s.mainStackBytes);
#endif
    (*s.body)();
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_release(&gTsanEndToken);
#endif
    s.current.load(std::memory_order_relaxed)->status.store(FiberState::kDONE, std::memory_order_relaxed);
    s.live.fetch_sub(1, std::memory_order_relaxed);
    switchToMain(s, true);
}

int liveThreads(Scheduler const& s)
{
    return s.live.load(std::memory_order_relaxed);
}

//! Release the barriers every live participant has reached. False when a warp exchange
//! names a lane that exited (undefined on a GPU).
bool releaseBarriers(Scheduler& s)
{
    int const live = liveThreads(s);
    int const arrived = s.blockArrived.load(std::memory_order_relaxed);
    if (arrived > 0 && arrived == live)
    {
        for (int t = 0; t < s.threads; ++t)
        {
            Fiber& f = *s.fibers[t];
            if (f.status.load(std::memory_order_relaxed) == FiberState::kBLOCK_BARRIER)
            {
                f.status.store(FiberState::kRUNNABLE, std::memory_order_relaxed);
            }
        }
        s.blockArrived.store(0, std::memory_order_relaxed);
        s.blockGeneration.fetch_add(1, std::memory_order_relaxed);
    }
    int const threads = s.threads;
    for (int w = 0; w * 32 < threads; ++w)
    {
        Warp& warp = s.warps[w];
        int const got = warp.arrived.load(std::memory_order_relaxed);
        if (got == 0)
        {
            continue;
        }
        unsigned int const mask = warp.mask.load(std::memory_order_relaxed);
        int expected = 0;
        for (int lane = 0; lane < 32; ++lane)
        {
            if ((mask >> lane) & 1U)
            {
                int const t = w * 32 + lane;
                if (t >= threads || s.fibers[t]->status.load(std::memory_order_relaxed) == FiberState::kDONE)
                {
                    return false;
                }
                ++expected;
            }
        }
        if (got == expected)
        {
            for (int lane = 0; lane < 32 && w * 32 + lane < threads; ++lane)
            {
                Fiber& f = *s.fibers[w * 32 + lane];
                if (f.status.load(std::memory_order_relaxed) == FiberState::kWARP_BARRIER)
                {
                    f.status.store(FiberState::kRUNNABLE, std::memory_order_relaxed);
                }
            }
            warp.arrived.store(0, std::memory_order_relaxed);
            warp.generation.fetch_add(1, std::memory_order_relaxed);
        }
    }
    return true;
}

std::string describeBlock(Scheduler const& s, std::string const& why)
{
    ThreadState const& t = s.fibers.front()->state;
    char buf[256];
    std::snprintf(buf, sizeof(buf), "kernel %s, block (%u,%u,%u): %s", s.record->name.c_str(), t.blockIdx.x,
        t.blockIdx.y, t.blockIdx.z, why.c_str());
    return buf;
}

//! A fault ends the block with threads still suspended; they never run again. Tell
//! ThreadSanitizer that what they did happened before the scheduler's next steps (it frees
//! the kernel's arguments, which they read).
void abandonBlock(Scheduler& s)
{
#if defined(PYTRT_KV_EMU_TSAN)
    for (int t = 0; t < s.threads; ++t)
    {
        Fiber& f = *s.fibers[t];
        if (f.status.load(std::memory_order_relaxed) != FiberState::kDONE)
        {
            __tsan_switch_to_fiber(f.tsanFiber, 1);
            __tsan_release(&gTsanEndToken);
            __tsan_switch_to_fiber(s.mainTsan, 1);
        }
    }
    __tsan_acquire(&gTsanEndToken);
#else
    (void) s;
#endif
}

//! Run one block of \p threads fibers to completion; false after a fault.
bool runBlock(Scheduler& s, uint3 blockIdx, dim3 block, dim3 grid)
{
    if (__start_pytrt_kv_emu_shared != nullptr && __stop_pytrt_kv_emu_shared != nullptr)
    {
        std::memset(__start_pytrt_kv_emu_shared, kSHARED_POISON,
            static_cast<size_t>(__stop_pytrt_kv_emu_shared - __start_pytrt_kv_emu_shared));
    }
    int const threads = s.threads;
    s.blockArrived.store(0, std::memory_order_relaxed);
    for (int w = 0; w * 32 < threads; ++w)
    {
        s.warps[w].arrived.store(0, std::memory_order_relaxed);
    }
    for (int t = 0; t < threads; ++t)
    {
        Fiber& f = *s.fibers[t];
        unsigned int const tx = static_cast<unsigned int>(t) % block.x;
        unsigned int const ty = static_cast<unsigned int>(t) / block.x % block.y;
        unsigned int const tz = static_cast<unsigned int>(t) / (block.x * block.y);
        f.state = ThreadState{uint3{tx, ty, tz}, blockIdx, block, grid};
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = f.stackBytes;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiberEntry, 0);
        f.asanFakeStack = nullptr;
        f.rng = nextRandom(s.rng) | 1U;
        f.status.store(FiberState::kRUNNABLE, std::memory_order_relaxed);
    }
    s.live.store(threads, std::memory_order_relaxed);
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_release(&gTsanStartToken);
#endif
    std::vector<int> order(static_cast<size_t>(threads));
    for (int t = 0; t < threads; ++t)
    {
        order[t] = s.schedule == Schedule::kREVERSE ? threads - 1 - t : t;
    }
    for (;;)
    {
        if (s.schedule == Schedule::kRANDOM)
        {
            for (int i = threads - 1; i > 0; --i)
            {
                std::swap(order[i], order[nextRandom(s.rng) % static_cast<uint64_t>(i + 1)]);
            }
        }
        bool progressed = false;
        for (int t : order)
        {
            Fiber& f = *s.fibers[t];
            if (f.status.load(std::memory_order_relaxed) != FiberState::kRUNNABLE)
            {
                continue;
            }
            switchToFiber(s, f);
            progressed = true;
            if (!releaseBarriers(s))
            {
                fault(cudaErrorLaunchFailure,
                    describeBlock(s, "a warp shuffle names a lane that has exited (undefined behaviour)"));
                abandonBlock(s);
                return false;
            }
            if (sticky() != cudaSuccess)
            {
                abandonBlock(s); // an illegal address in this block
                return false;
            }
        }
        if (liveThreads(s) == 0)
        {
            break;
        }
        if (!progressed)
        {
            fault(cudaErrorLaunchFailure,
                describeBlock(s,
                    "deadlock: live threads wait at different barriers (a __syncthreads or warp exchange "
                    "not reached by every live thread of the block or warp)"));
            abandonBlock(s);
            return false;
        }
    }
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_acquire(&gTsanEndToken);
#endif
    return true;
}

Scheduler& schedulerFor(int threads)
{
    thread_local Scheduler* sched = nullptr;
    if (sched == nullptr)
    {
        sched = new Scheduler();
        sched->schedule = configuredSchedule(sched->rng);
#if defined(PYTRT_KV_EMU_TSAN)
        sched->mainTsan = __tsan_get_current_fiber();
#endif
    }
    while (static_cast<int>(sched->fibers.size()) < threads)
    {
        auto f = std::make_unique<Fiber>();
        f->index = static_cast<int>(sched->fibers.size());
        size_t const bytes = stackBytes();
        size_t const guard = 4096;
        void* mem = mmap(nullptr, bytes + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED)
        {
            throw std::bad_alloc();
        }
        mprotect(mem, guard, PROT_NONE); // a stack overflow faults instead of corrupting memory
        f->stack = static_cast<char*>(mem) + guard;
        f->stackBytes = bytes;
#if defined(PYTRT_KV_EMU_TSAN)
        f->tsanFiber = __tsan_create_fiber(0);
#endif
        sched->fibers.push_back(std::move(f));
    }
    sched->threads = threads;
    return *sched;
}

void runKernel(LaunchRecord& record, dim3 grid, dim3 block, std::function<void()> const& body)
{
    Scheduler& s = schedulerFor(static_cast<int>(block.x * block.y * block.z));
    Scheduler* previous = tScheduler.load(std::memory_order_relaxed);
    tScheduler.store(&s, std::memory_order_relaxed);
    s.body = &body;
    s.record = &record;
    bool ok = true;
    for (unsigned int z = 0; ok && z < grid.z; ++z)
    {
        for (unsigned int y = 0; ok && y < grid.y; ++y)
        {
            for (unsigned int x = 0; ok && x < grid.x; ++x)
            {
                ok = runBlock(s, uint3{x, y, z}, block, grid);
            }
        }
    }
    tScheduler.store(previous, std::memory_order_relaxed);
}

thread_local std::atomic<LaunchRecord*> tRecord{nullptr};
// The allocation the last kernel access fell in (a lookup cache; atomics: see LaunchRecord).
thread_local std::atomic<uintptr_t> tHitBase{0};
thread_local std::atomic<size_t> tHitBytes{0};

} // namespace

// --- kernels ---------------------------------------------------------------------------

ThreadState const& currentThread() noexcept
{
    ThreadState const* t = tThread.load(std::memory_order_relaxed);
    return t != nullptr ? *t : kHOST_THREAD;
}

void enqueueLaunch(char const* name, dim3 grid, dim3 block, cudaStream_t stream, std::function<void()> body)
{
    if (sticky() != cudaSuccess)
    {
        fail(sticky());
        return;
    }
    uint64_t const threads = uint64_t{block.x} * block.y * block.z;
    if (threads == 0 || threads > kMAX_THREADS_PER_BLOCK || grid.x == 0 || grid.y == 0 || grid.z == 0
        || grid.x > 0x7FFFFFFFU || grid.y > 65535U || grid.z > 65535U)
    {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    if (!validStream(stream))
    {
        fail(cudaErrorInvalidResourceHandle);
        return;
    }
    std::string const kernelName = name;
    enqueue([kernelName, grid, block, body = std::move(body)]() {
        auto record = std::make_unique<LaunchRecord>();
        record->name = kernelName;
        record->grid = grid;
        record->block = block;
        LaunchRecord* previous = tRecord.load(std::memory_order_relaxed);
        tRecord.store(record.get(), std::memory_order_relaxed);
        tHitBase.store(0, std::memory_order_relaxed);
        tHitBytes.store(0, std::memory_order_relaxed);
        try
        {
            runKernel(*record, grid, block, body);
        }
        catch (std::exception const& e)
        {
            fault(cudaErrorLaunchFailure, kernelName + ": " + e.what());
        }
        tRecord.store(previous, std::memory_order_relaxed);
        std::lock_guard<std::mutex> lock(gRecordMutex);
        gRecords.push_back(std::move(record));
        while (gRecords.size() > kMAX_RECORDS)
        {
            gRecords.pop_front();
        }
    });
}

void syncthreads()
{
    Scheduler* s = tScheduler.load(std::memory_order_relaxed);
    if (s == nullptr || s->current.load(std::memory_order_relaxed) == nullptr)
    {
        return; // host code (the host planning path): nothing to wait for
    }
#if defined(PYTRT_KV_EMU_TSAN)
    char* token = &s->tsanBlockTokens[s->blockGeneration.load(std::memory_order_relaxed) & 1U];
    __tsan_release(token);
#endif
    s->current.load(std::memory_order_relaxed)->status.store(FiberState::kBLOCK_BARRIER, std::memory_order_relaxed);
    s->blockArrived.fetch_add(1, std::memory_order_relaxed);
    switchToMain(*s, false);
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_acquire(token);
#endif
}

uint64_t warpExchange(unsigned int mask, uint64_t value, int srcLane)
{
    Scheduler* s = tScheduler.load(std::memory_order_relaxed);
    Fiber* self = s != nullptr ? s->current.load(std::memory_order_relaxed) : nullptr;
    if (self == nullptr)
    {
        return value;
    }
    int const t = self->index;
    int const lane = t % 32;
    Warp& warp = s->warps[t / 32];
    if (((mask >> lane) & 1U) == 0)
    {
        fault(cudaErrorLaunchFailure,
            describeBlock(*s, "a warp shuffle from a lane outside its own mask (undefined behaviour)"));
    }
    auto waitWarp = [&]() {
#if defined(PYTRT_KV_EMU_TSAN)
        char* token = &warp.tsanTokens[warp.generation.load(std::memory_order_relaxed) & 1U];
        __tsan_release(token);
#endif
        warp.mask.store(mask, std::memory_order_relaxed);
        self->status.store(FiberState::kWARP_BARRIER, std::memory_order_relaxed);
        warp.arrived.fetch_add(1, std::memory_order_relaxed);
        switchToMain(*s, false);
#if defined(PYTRT_KV_EMU_TSAN)
        __tsan_acquire(token);
#endif
    };
    warp.values[lane] = value;
    waitWarp(); // every lane of the mask has published its value
    uint64_t const got = ((mask >> srcLane) & 1U) ? warp.values[srcLane] : value;
    waitWarp(); // every lane has read before any lane publishes again
    return got;
}

void maybeYield()
{
    Scheduler* s = tScheduler.load(std::memory_order_relaxed);
    Fiber* self = s != nullptr ? s->current.load(std::memory_order_relaxed) : nullptr;
    if (self == nullptr || s->schedule != Schedule::kRANDOM)
    {
        return;
    }
    if (nextRandom(self->rng) % 4 == 0)
    {
        // Stay runnable: the scheduler resumes this fiber later in its pass (or the next).
        switchToMain(*s, false);
    }
}

bool deviceAccess(void const* p, size_t bytes, bool write) noexcept
{
    auto const a = reinterpret_cast<uintptr_t>(p);
    uintptr_t const base = tHitBase.load(std::memory_order_relaxed);
    size_t const size = tHitBytes.load(std::memory_order_relaxed);
    bool ok = a >= base && size >= bytes && a - base <= size - bytes;
    if (!ok)
    {
        std::lock_guard<std::mutex> lock(gMemMutex);
        auto it = findRange(p, bytes);
        ok = it != gRanges.end();
        if (ok)
        {
            tHitBase.store(it->first, std::memory_order_relaxed);
            tHitBytes.store(it->second.bytes, std::memory_order_relaxed);
        }
    }
    LaunchRecord* r = tRecord.load(std::memory_order_relaxed);
    if (!ok)
    {
        ThreadState const& t = currentThread();
        char buf[320];
        std::snprintf(buf, sizeof(buf),
            "illegal address: %s of %zu bytes at %p by thread (%u,%u,%u) of block (%u,%u,%u) in kernel %s: not "
            "inside live device or pinned host memory",
            write ? "store" : "load", bytes, p, t.threadIdx.x, t.threadIdx.y, t.threadIdx.z, t.blockIdx.x, t.blockIdx.y,
            t.blockIdx.z, r != nullptr ? r->name.c_str() : "?");
        fault(cudaErrorIllegalAddress, buf);
        return false;
    }
    if (r != nullptr)
    {
        (write ? r->bytesWritten : r->bytesRead).fetch_add(bytes, std::memory_order_relaxed);
        (write ? r->stores : r->loads).fetch_add(1, std::memory_order_relaxed);
    }
    return true;
}

// --- numerics ------------------------------------------------------------------------------

float halfToFloat(unsigned short h) noexcept
{
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000U) << 16;
    uint32_t const exp = (h >> 10) & 0x1FU;
    uint32_t mant = h & 0x3FFU;
    uint32_t bits = 0;
    if (exp == 0x1FU)
    {
        bits = sign | 0x7F800000U | (mant << 13);
    }
    else if (exp != 0)
    {
        bits = sign | ((exp + 112U) << 23) | (mant << 13);
    }
    else if (mant != 0)
    {
        int e = -1;
        do
        {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400U) == 0);
        bits = sign | ((112U - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3FFU) << 13);
    }
    else
    {
        bits = sign;
    }
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

unsigned short floatToHalfRn(float f) noexcept
{
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    uint32_t const sign = (x >> 16) & 0x8000U;
    uint32_t const absx = x & 0x7FFFFFFFU;
    if (absx > 0x7F800000U)
    {
        return 0x7FFF; // NaN: canonical, as the GPU's cvt.rn.f16.f32
    }
    if (absx >= 0x477FF000U) // rounds to >= 65520: infinity
    {
        return static_cast<unsigned short>(sign | 0x7C00U);
    }
    if (absx < 0x33000000U) // < 2^-25: rounds to zero (2^-25 itself ties to even zero)
    {
        return static_cast<unsigned short>(sign);
    }
    int32_t const exp = static_cast<int32_t>(absx >> 23) - 127;
    uint32_t mant = (absx & 0x7FFFFFU) | 0x800000U;
    uint32_t shift = 0;
    uint32_t base = 0;
    if (exp < -14)
    {
        shift = static_cast<uint32_t>(13 + (-14 - exp)); // subnormal result
        base = 0;
    }
    else
    {
        shift = 13;
        base = static_cast<uint32_t>(exp + 15) << 10;
        mant &= 0x7FFFFFU;
    }
    uint32_t const kept = mant >> shift;
    uint32_t const rest = mant & ((1U << shift) - 1U);
    uint32_t const half = 1U << (shift - 1);
    uint32_t out = base + kept;
    if (rest > half || (rest == half && (kept & 1U)))
    {
        ++out; // may carry into the exponent, and into infinity: both correct
    }
    return static_cast<unsigned short>(sign | out);
}

float bf16ToFloat(unsigned short h) noexcept
{
    uint32_t const bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

unsigned short floatToBf16Rn(float f) noexcept
{
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    if ((x & 0x7FFFFFFFU) > 0x7F800000U)
    {
        return 0x7FFF; // NaN: canonical, as the GPU's cvt.rn.bf16.f32
    }
    x += 0x7FFFU + ((x >> 16) & 1U);
    return static_cast<unsigned short>(x >> 16);
}

// --- runtime API -------------------------------------------------------------------------

cudaError_t cudaGetLastError()
{
    cudaError_t const e = sticky() != cudaSuccess ? sticky() : tLastError;
    tLastError = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError()
{
    return sticky() != cudaSuccess ? sticky() : tLastError;
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
    return sticky() != cudaSuccess ? fail(sticky()) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    if (device != 0)
    {
        return fail(cudaErrorInvalidDevice);
    }
    return sticky() != cudaSuccess ? fail(sticky()) : cudaSuccess;
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

cudaError_t cudaDeviceSynchronize()
{
    drain();
    return sticky() != cudaSuccess ? fail(sticky()) : cudaSuccess;
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

cudaError_t cudaMalloc(void** ptr, size_t bytes)
{
    if (ptr == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    if (sticky() != cudaSuccess)
    {
        return fail(sticky());
    }
    *ptr = nullptr;
    if (bytes == 0)
    {
        return cudaSuccess; // as CUDA: a null pointer
    }
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr)
    {
        return fail(cudaErrorMemoryAllocation);
    }
    std::memset(p, 0xCD, bytes); // device memory is uninitialized: never rely on zeros
    std::lock_guard<std::mutex> lock(gMemMutex);
    gRanges[reinterpret_cast<uintptr_t>(p)] = Range{bytes, Kind::kDEVICE};
    *ptr = p;
    return cudaSuccess;
}

namespace
{
cudaError_t release(void* ptr, Kind kind, cudaError_t notFound)
{
    if (ptr == nullptr)
    {
        return cudaSuccess;
    }
    drain(); // frees synchronize the device
    std::lock_guard<std::recursive_mutex> device(gDeviceMutex);
    std::lock_guard<std::mutex> lock(gMemMutex);
    auto it = gRanges.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == gRanges.end() || it->second.kind != kind)
    {
        return fail(notFound);
    }
    gRanges.erase(it);
    tHitBase.store(0, std::memory_order_relaxed);
    tHitBytes.store(0, std::memory_order_relaxed);
    if (kind != Kind::kREGISTERED)
    {
        std::free(ptr);
    }
    return sticky() != cudaSuccess ? fail(sticky()) : cudaSuccess;
}
} // namespace

cudaError_t cudaFree(void* ptr)
{
    return release(ptr, Kind::kDEVICE, cudaErrorInvalidValue);
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int /*flags*/)
{
    if (ptr == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    *ptr = nullptr;
    void* p = std::aligned_alloc(4096, (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096);
    if (p == nullptr)
    {
        return fail(cudaErrorMemoryAllocation);
    }
    std::memset(p, 0xCD, bytes);
    std::lock_guard<std::mutex> lock(gMemMutex);
    gRanges[reinterpret_cast<uintptr_t>(p)] = Range{std::max<size_t>(bytes, 1), Kind::kPINNED_ALLOC};
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr)
{
    return release(ptr, Kind::kPINNED_ALLOC, cudaErrorInvalidValue);
}

cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int flags)
{
    if (ptr == nullptr || bytes == 0
        || (flags
               & ~(cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterIoMemory
                   | cudaHostRegisterReadOnly))
            != 0)
    {
        return fail(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(gMemMutex);
    if (overlapsAny(reinterpret_cast<uintptr_t>(ptr), bytes))
    {
        return fail(cudaErrorHostMemoryAlreadyRegistered);
    }
    gRanges[reinterpret_cast<uintptr_t>(ptr)] = Range{bytes, Kind::kREGISTERED};
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr)
{
    if (ptr == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    return release(ptr, Kind::kREGISTERED, cudaErrorHostMemoryNotRegistered);
}

cudaError_t cudaHostGetDevicePointer(void** devicePtr, void* hostPtr, unsigned int flags)
{
    if (devicePtr == nullptr || flags != 0)
    {
        return fail(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(gMemMutex);
    auto it = findRange(hostPtr, 1);
    if (it == gRanges.end() || it->second.kind == Kind::kDEVICE)
    {
        return fail(cudaErrorInvalidValue);
    }
    *devicePtr = hostPtr; // unified addressing: the mapping is the host address
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, void const* ptr)
{
    if (attr == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(gMemMutex);
    auto it = findRange(ptr, 1);
    *attr = cudaPointerAttributes{cudaMemoryTypeUnregistered, -1, nullptr, nullptr};
    if (it == gRanges.end())
    {
        return cudaSuccess; // unregistered host memory (CUDA 11+: not an error)
    }
    attr->device = 0;
    attr->devicePointer = const_cast<void*>(ptr);
    if (it->second.kind == Kind::kDEVICE)
    {
        attr->type = cudaMemoryTypeDevice;
    }
    else
    {
        attr->type = cudaMemoryTypeHost;
        attr->hostPointer = const_cast<void*>(ptr);
    }
    return cudaSuccess;
}

namespace
{
//! Where [p, p + bytes) lies: 0 pageable host, 1 pinned/mapped host, 2 device; -1 when it
//! starts inside device or pinned memory but runs past its end.
int where(void const* p, size_t bytes)
{
    std::lock_guard<std::mutex> lock(gMemMutex);
    auto inside = findRange(p, bytes);
    if (inside != gRanges.end())
    {
        return inside->second.kind == Kind::kDEVICE ? 2 : 1;
    }
    auto start = findRange(p, 1);
    if (start != gRanges.end())
    {
        return -1;
    }
    return 0;
}

cudaError_t copy(void* dst, void const* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream, bool async)
{
    if (sticky() != cudaSuccess)
    {
        return fail(sticky());
    }
    if (kind != cudaMemcpyDefault && (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDeviceToDevice))
    {
        return fail(cudaErrorInvalidMemcpyDirection);
    }
    if (!validStream(stream))
    {
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (bytes == 0)
    {
        return cudaSuccess;
    }
    if (dst == nullptr || src == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    int const d = where(dst, bytes);
    int const s = where(src, bytes);
    if (d < 0 || s < 0)
    {
        return fail(cudaErrorInvalidValue); // runs past the end of an allocation
    }
    bool const dstDevice = d == 2;
    bool const srcDevice = s == 2;
    if ((kind == cudaMemcpyHostToDevice && (!dstDevice || srcDevice))
        || (kind == cudaMemcpyDeviceToHost && (dstDevice || !srcDevice))
        || (kind == cudaMemcpyDeviceToDevice && (!dstDevice || !srcDevice)))
    {
        return fail(cudaErrorInvalidValue);
    }
    auto run = [dst, src, bytes]() { std::memmove(dst, src, bytes); };
    if (!async || d == 0 || s == 0)
    {
        // Synchronous, or pageable host memory (staged by CUDA before the call returns).
        drain();
        std::lock_guard<std::recursive_mutex> device(gDeviceMutex);
        run();
        return cudaSuccess;
    }
    enqueue(run);
    return cudaSuccess;
}

cudaError_t fill(void* dst, int value, size_t bytes, cudaStream_t stream, bool async)
{
    if (sticky() != cudaSuccess)
    {
        return fail(sticky());
    }
    if (!validStream(stream))
    {
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (bytes == 0)
    {
        return cudaSuccess;
    }
    if (where(dst, bytes) <= 0)
    {
        return fail(cudaErrorInvalidValue); // not device (or mapped) memory, or past its end
    }
    auto run = [dst, value, bytes]() { std::memset(dst, value, bytes); };
    if (!async)
    {
        drain();
        std::lock_guard<std::recursive_mutex> device(gDeviceMutex);
        run();
        return cudaSuccess;
    }
    enqueue(run);
    return cudaSuccess;
}
} // namespace

cudaError_t cudaMemcpy(void* dst, void const* src, size_t bytes, cudaMemcpyKind kind)
{
    return copy(dst, src, bytes, kind, nullptr, false);
}

cudaError_t cudaMemcpyAsync(void* dst, void const* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream)
{
    return copy(dst, src, bytes, kind, stream, true);
}

cudaError_t cudaMemset(void* dst, int value, size_t bytes)
{
    return fill(dst, value, bytes, nullptr, false);
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream)
{
    return fill(dst, value, bytes, stream, true);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream)
{
    if (stream == nullptr)
    {
        return fail(cudaErrorInvalidValue);
    }
    if (sticky() != cudaSuccess)
    {
        return fail(sticky());
    }
    // A unique, never-dereferenced handle.
    auto* handle = reinterpret_cast<cudaStream_t>(new (std::nothrow) char[1]);
    if (handle == nullptr)
    {
        return fail(cudaErrorMemoryAllocation);
    }
    std::lock_guard<std::mutex> lock(gQueueMutex);
    gStreams.insert(handle);
    *stream = handle;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    {
        std::lock_guard<std::mutex> lock(gQueueMutex);
        if (stream == nullptr || gStreams.erase(stream) == 0)
        {
            return fail(cudaErrorInvalidResourceHandle);
        }
    }
    delete[] reinterpret_cast<char*>(stream); // its queued work stays queued, as in CUDA
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    if (!validStream(stream))
    {
        return fail(cudaErrorInvalidResourceHandle);
    }
    drain();
    return sticky() != cudaSuccess ? fail(sticky()) : cudaSuccess;
}

} // namespace emu
} // namespace pytrt_kv

// --- C ABI of the emulated device (exported by the emulated kernel library) --------------
namespace
{
void appendJson(std::string& out, pytrt_kv::emu::LaunchRecord const& r)
{
    char buf[512];
    std::snprintf(buf, sizeof(buf),
        "{\"name\": \"%s\", \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], \"bytes_read\": %llu, "
        "\"bytes_written\": %llu, \"loads\": %llu, \"stores\": %llu}\n",
        r.name.c_str(), r.grid.x, r.grid.y, r.grid.z, r.block.x, r.block.y, r.block.z,
        static_cast<unsigned long long>(r.bytesRead.load()), static_cast<unsigned long long>(r.bytesWritten.load()),
        static_cast<unsigned long long>(r.loads.load()), static_cast<unsigned long long>(r.stores.load()));
    out += buf;
}
} // namespace

//! The launch records (one JSON object per line) of the kernels that ran since the last
//! call, in order; at most \p capacity bytes are written to \p out (NUL-terminated).
//! Returns the bytes the whole text needs (excluding the NUL); the records are taken
//! only when they fit.
extern "C" __attribute__((visibility("default"))) size_t pytrt_kv_emu_take_launches(char* out, size_t capacity)
{
    using namespace pytrt_kv::emu;
    drain();
    std::lock_guard<std::mutex> lock(gRecordMutex);
    std::string text;
    for (auto const& r : gRecords)
    {
        appendJson(text, *r);
    }
    if (out != nullptr && text.size() < capacity)
    {
        std::memcpy(out, text.c_str(), text.size() + 1);
        gRecords.clear();
    }
    return text.size();
}

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

//! Clear a sticky fault (cudaDeviceReset for the emulated device; tests of the fault path).
extern "C" __attribute__((visibility("default"))) void pytrt_kv_emu_reset()
{
    using namespace pytrt_kv::emu;
    {
        std::lock_guard<std::mutex> lock(gQueueMutex);
        gQueue.clear();
    }
    gSticky.store(cudaSuccess);
    tLastError = cudaSuccess;
}
