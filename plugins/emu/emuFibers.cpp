/*
 * Kernels on the emulated device (docs/EMULATION.md): blocks run one after another; the
 * threads of a block are fibers (ucontext, guarded stacks) switched only at __syncthreads,
 * warp shuffles and (shuffled schedules, PYTRT_KV_EMU_SCHEDULE) atomics. A barrier that not
 * every live thread reaches is reported, not waited on forever.
 *
 * Sanitizers: fiber switches are annotated for AddressSanitizer and ThreadSanitizer; under
 * ThreadSanitizer, fibers are ordered only by the barriers (release/acquire, sync objects
 * of the launch), so a missing __syncthreads is a reported data race.
 */
#include "emuInternal.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

// Bounds of the __shared__ section of the library this runtime is linked into (weak: a
// library without kernels has none).
extern "C" char __start_pytrt_kv_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_pytrt_kv_emu_shared[] __attribute__((weak, visibility("hidden")));

namespace pytrt_kv
{
namespace emu
{
namespace detail
{
namespace
{
constexpr unsigned char kSHARED_POISON = 0xA5;

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
    uint64_t rng{0}; //!< this thread's draws of a random schedule (seeded per block)
};

struct Warp
{
    std::atomic<int> arrived{0};
    std::atomic<unsigned int> mask{0};
    std::atomic<unsigned int> generation{0};
    uint64_t values[32];
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
    // The block barrier's generation: ThreadSanitizer sync objects (LaunchRecord) are one
    // per parity, so a thread resuming from barrier g does not acquire what others
    // released at g + 1.
    std::atomic<unsigned int> blockGeneration{0};
    ucontext_t main;
    void const* mainStackBottom{nullptr};
    size_t mainStackBytes{0};
    std::atomic<void*> mainTsan{nullptr}; //!< the stream's fiber, which runs the scheduler (atomic:
                                          //!< exiting threads read it after their last release)
    void* const* tsanThreads{nullptr};    //!< the stream's fibers for the block's threads
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
    __tsan_switch_to_fiber(s.tsanThreads[f.index], 1 /* no synchronization: barriers order fibers */);
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
    __tsan_switch_to_fiber(s.mainTsan.load(std::memory_order_relaxed), 1);
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
    // Through an atomic: nothing the scheduler wrote is ordered before this acquire.
    __tsan_acquire(&runningLaunch()->tsanStart);
#endif
    Scheduler& s = *tScheduler.load(std::memory_order_relaxed);
#if defined(PYTRT_KV_EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &s.mainStackBottom, &s.mainStackBytes);
#endif
    (*s.body)();
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_release(&s.record->tsanEnd);
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
            __tsan_switch_to_fiber(s.tsanThreads[t], 1);
            __tsan_release(&s.record->tsanEnd);
            __tsan_switch_to_fiber(s.mainTsan.load(std::memory_order_relaxed), 1);
        }
    }
    __tsan_acquire(&s.record->tsanEnd);
#else
    (void) s;
#endif
}

//! Run one block of \p threads fibers to completion; false after a fault.
bool runBlock(Scheduler& s, uint3 blockIdx, dim3 block, dim3 grid)
{
    if (__start_pytrt_kv_emu_shared != nullptr && __stop_pytrt_kv_emu_shared != nullptr)
    {
#if defined(PYTRT_KV_EMU_TSAN)
        __tsan_ignore_thread_begin(); // the emulator's poisoning is no access of a kernel's
#endif
        std::memset(__start_pytrt_kv_emu_shared, kSHARED_POISON,
            static_cast<size_t>(__stop_pytrt_kv_emu_shared - __start_pytrt_kv_emu_shared));
#if defined(PYTRT_KV_EMU_TSAN)
        __tsan_ignore_thread_end();
#endif
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
    __tsan_release(&s.record->tsanStart);
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
    __tsan_acquire(&s.record->tsanEnd);
#endif
    return true;
}

//! The scheduler (fibers, stacks, barrier state) of the kernels of this OS thread; under
//! ThreadSanitizer one per stream, so that two streams' kernels share no memory of the
//! emulator's that could order them (their races stay visible).
Scheduler& schedulerFor(int threads)
{
#if defined(PYTRT_KV_EMU_TSAN)
    Scheduler*& sched = *reinterpret_cast<Scheduler**>(&streamScheduler());
#else
    thread_local Scheduler* sched = nullptr;
#endif
    if (sched == nullptr)
    {
        sched = new Scheduler();
        sched->schedule = configuredSchedule(sched->rng);
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
        sched->fibers.push_back(std::move(f));
    }
    sched->threads = threads;
    return *sched;
}

} // namespace

void runKernel(LaunchRecord& record, dim3 grid, dim3 block, std::function<void()> const& body)
{
    int const threads = static_cast<int>(block.x * block.y * block.z);
    Scheduler& s = schedulerFor(threads);
    Scheduler* previous = tScheduler.load(std::memory_order_relaxed);
    tScheduler.store(&s, std::memory_order_relaxed);
    s.body = &body;
    s.record = &record;
#if defined(PYTRT_KV_EMU_TSAN)
    s.mainTsan.store(__tsan_get_current_fiber(), std::memory_order_relaxed);
    s.tsanThreads = streamThreadFibers(threads);
#endif
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

bool inKernel() noexcept
{
    Scheduler* s = tScheduler.load(std::memory_order_relaxed);
    return s != nullptr && s->current.load(std::memory_order_relaxed) != nullptr;
}

std::string describeThread()
{
    ThreadState const& t = currentThread();
    char buf[160];
    std::snprintf(buf, sizeof(buf), "thread (%u,%u,%u) of block (%u,%u,%u)", t.threadIdx.x, t.threadIdx.y,
        t.threadIdx.z, t.blockIdx.x, t.blockIdx.y, t.blockIdx.z);
    return buf;
}
} // namespace detail

using namespace detail;

ThreadState const& currentThread() noexcept
{
    ThreadState const* t = tThread.load(std::memory_order_relaxed);
    return t != nullptr ? *t : kHOST_THREAD;
}

void syncthreads()
{
    Scheduler* s = tScheduler.load(std::memory_order_relaxed);
    if (s == nullptr || s->current.load(std::memory_order_relaxed) == nullptr)
    {
        return; // host code (the host planning path): nothing to wait for
    }
#if defined(PYTRT_KV_EMU_TSAN)
    char* token = &s->record->tsanBlock[s->blockGeneration.load(std::memory_order_relaxed) & 1U];
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
        char* token = &s->record->tsanWarp[t / 32][warp.generation.load(std::memory_order_relaxed) & 1U];
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

} // namespace emu
} // namespace pytrt_kv
