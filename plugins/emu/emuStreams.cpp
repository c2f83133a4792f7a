/*
 * Streams of the emulated device (docs/EMULATION.md): one queue per stream, run when
 * something waits (a stream or device synchronize, a synchronous copy or fill, a free).
 *
 * - Work on one stream runs in issue order. Between streams the order is a seeded
 *   interleaving (PYTRT_KV_EMU_STREAMS=random[:SEED], the default random:1; issue: the
 *   issue order), so two streams (or two threads' per-thread default streams) that touch
 *   the same memory without an ordering race visibly, as they may on a GPU.
 * - The legacy default stream (0, cudaStreamLegacy) keeps its CUDA semantics towards the
 *   blocking streams cudaStreamCreate makes and the per-thread default stream: its work
 *   starts after all earlier work and all later work starts after it.
 * - Under ThreadSanitizer each stream is a fiber ordered only by those rules and by the
 *   host's synchronizations, so unordered accesses of two streams are a reported race.
 */
#include "emuInternal.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <new>
#include <vector>

namespace pytrt_kv
{
namespace emu
{
namespace detail
{
namespace
{
//! The queue a stream handle names: 0 the legacy default stream; the per-thread default
//! stream has one per OS thread.
using StreamKey = uintptr_t;
constexpr StreamKey kLEGACY = 0;
thread_local char tPerThreadStream;

StreamKey keyOf(cudaStream_t s)
{
    if (s == nullptr || s == cudaStreamLegacy)
    {
        return kLEGACY;
    }
    if (s == cudaStreamPerThread)
    {
        return reinterpret_cast<StreamKey>(&tPerThreadStream);
    }
    return reinterpret_cast<StreamKey>(s);
}

struct Op
{
    StreamKey stream;
    std::function<void()> run;
};

//! ThreadSanitizer's view of a stream (sync objects are addresses: these members).
struct StreamState
{
    char issued{0}; //!< host -> stream: released at enqueue, acquired before each op
    char done{0};   //!< stream -> host and dependants: released after each op
    void* fiber{nullptr};
    std::vector<void*> threadFibers;
    void* scheduler{nullptr};
};

std::recursive_mutex gDeviceMutex; // held while queued work runs, and by frees
std::mutex gQueueMutex;
std::deque<Op> gPending;                                   // every stream's work, issue order
std::map<StreamKey, std::unique_ptr<StreamState>> gStates; // streams that have had work
std::map<StreamKey, bool> gCreated;                        // cudaStreamCreate's live handles
uint64_t gInterleave = 0;                                  // 0: issue order, else the rng state
bool gInterleaveRead = false;

std::mutex gRecordMutex;
std::deque<std::unique_ptr<LaunchRecord>> gRecords;
constexpr size_t kMAX_RECORDS = 4096;

thread_local std::atomic<LaunchRecord*> tRecord{nullptr};
// Atomics: the stream fibers and the host share them (see LaunchRecord).
thread_local std::atomic<StreamState*> tRunningStream{nullptr};

StreamState& stateOf(StreamKey key)
{
    auto& slot = gStates[key];
    if (!slot)
    {
        slot = std::make_unique<StreamState>();
    }
    return *slot;
}

//! PYTRT_KV_EMU_STREAMS, read once (under gQueueMutex).
void readInterleave()
{
    if (gInterleaveRead)
    {
        return;
    }
    gInterleaveRead = true;
    char const* s = std::getenv("PYTRT_KV_EMU_STREAMS");
    if (s != nullptr && std::strcmp(s, "issue") == 0)
    {
        gInterleave = 0;
        return;
    }
    uint64_t seed = 1;
    if (s != nullptr && s[0] != '\0')
    {
        if (std::strncmp(s, "random", 6) != 0 || (s[6] != '\0' && s[6] != ':'))
        {
            std::fprintf(stderr,
                "pytrt_kv emulated device: PYTRT_KV_EMU_STREAMS=%s is not issue or random[:SEED]; using "
                "random:1\n",
                s);
        }
        else if (s[6] == ':')
        {
            seed = std::strtoull(s + 7, nullptr, 10);
        }
    }
    gInterleave = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
}

uint64_t nextInterleave()
{
    gInterleave ^= gInterleave << 13;
    gInterleave ^= gInterleave >> 7;
    gInterleave ^= gInterleave << 17;
    return gInterleave;
}

//! Take the next op to run (under gQueueMutex): one of the first pending ops of each
//! stream that may start now, picked by the interleaving. False when nothing is pending.
bool takeNext(std::unique_ptr<Op>& out)
{
    if (gPending.empty())
    {
        return false;
    }
    readInterleave();
    std::vector<size_t> ready;
    std::vector<StreamKey> seen;
    for (size_t i = 0; i < gPending.size(); ++i)
    {
        StreamKey const k = gPending[i].stream;
        if (k == kLEGACY)
        {
            if (i == 0)
            {
                ready.push_back(i); // everything before it has run
            }
            break; // nothing issued after a pending legacy op may start before it
        }
        bool first = true;
        for (StreamKey s : seen)
        {
            first = first && s != k;
        }
        if (first)
        {
            seen.push_back(k);
            ready.push_back(i);
        }
    }
    size_t const pick = gInterleave == 0 ? ready.front() : ready[nextInterleave() % ready.size()];
    out = std::make_unique<Op>(std::move(gPending[pick]));
    gPending.erase(gPending.begin() + static_cast<std::ptrdiff_t>(pick));
    return true;
}

//! Run \p op on its stream and destroy it there. Under ThreadSanitizer the stream is a
//! fiber: entered with synchronization (the host issued the work before), left without
//! (the host learns what ran only when it synchronizes), so the op, which its kernel's
//! threads read, is freed on the stream and the host never touches it again.
void runOp(Op* op)
{
    StreamState* st = nullptr;
    {
        std::lock_guard<std::mutex> lock(gQueueMutex);
        st = &stateOf(op->stream);
    }
#if defined(PYTRT_KV_EMU_TSAN)
    void* host = __tsan_get_current_fiber();
    if (st->fiber == nullptr)
    {
        st->fiber = __tsan_create_fiber(0);
    }
    __tsan_switch_to_fiber(st->fiber, 0);
    __tsan_acquire(&st->issued);
    {
        std::lock_guard<std::mutex> lock(gQueueMutex);
        for (auto const& other : gStates)
        {
            if (op->stream == kLEGACY || other.first == kLEGACY)
            {
                __tsan_acquire(&other.second->done);
            }
        }
    }
#endif
    StreamState* previous = tRunningStream.exchange(st, std::memory_order_relaxed);
    op->run();
    delete op;
    tRunningStream.store(previous, std::memory_order_relaxed);
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_release(&st->done);
    __tsan_switch_to_fiber(host, 1 /* no synchronization: see above */);
#endif
}

//! After the device went idle the host has seen all the work (ThreadSanitizer).
void hostSawEverything()
{
#if defined(PYTRT_KV_EMU_TSAN)
    std::lock_guard<std::mutex> lock(gQueueMutex);
    for (auto const& st : gStates)
    {
        __tsan_acquire(&st.second->done);
    }
#endif
}
} // namespace

LaunchRecord* runningLaunch() noexcept
{
    return tRecord.load(std::memory_order_relaxed);
}

std::recursive_mutex& deviceMutex()
{
    return gDeviceMutex;
}

bool validStream(cudaStream_t s)
{
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread)
    {
        return true;
    }
    std::lock_guard<std::mutex> lock(gQueueMutex);
    return gCreated.count(reinterpret_cast<StreamKey>(s)) != 0;
}

void enqueue(cudaStream_t stream, std::function<void()> run)
{
    StreamKey const key = keyOf(stream);
    std::lock_guard<std::mutex> lock(gQueueMutex);
#if defined(PYTRT_KV_EMU_TSAN)
    __tsan_release(&stateOf(key).issued);
#endif
    gPending.push_back(Op{key, std::move(run)});
}

void drain()
{
    std::lock_guard<std::recursive_mutex> device(gDeviceMutex);
    for (;;)
    {
        std::unique_ptr<Op> op;
        {
            std::lock_guard<std::mutex> lock(gQueueMutex);
            if (!takeNext(op))
            {
                break;
            }
        }
        if (sticky() == cudaSuccess)
        {
            runOp(op.release()); // after a fault the context is dead: queued work is dropped
        }
    }
    hostSawEverything();
}

void runNow(std::function<void()> const& run)
{
    drain();
    std::lock_guard<std::recursive_mutex> device(gDeviceMutex);
    run();
}

void dropQueued()
{
    std::lock_guard<std::mutex> lock(gQueueMutex);
    gPending.clear();
}

#if defined(PYTRT_KV_EMU_TSAN)
namespace
{
StreamState& runningStream()
{
    static StreamState gHostRun; // a kernel run outside any stream (not done by the runtime)
    StreamState* running = tRunningStream.load(std::memory_order_relaxed);
    return running != nullptr ? *running : gHostRun;
}
} // namespace

void*& streamScheduler()
{
    return runningStream().scheduler;
}

void* const* streamThreadFibers(int threads)
{
    StreamState& st = runningStream();
    while (static_cast<int>(st.threadFibers.size()) < threads)
    {
        st.threadFibers.push_back(__tsan_create_fiber(0));
    }
    return st.threadFibers.data();
}
#endif
} // namespace detail

using namespace detail;

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
    enqueue(stream, [kernelName, grid, block, body = std::move(body)]() {
        auto record = std::make_unique<LaunchRecord>();
        record->name = kernelName;
        record->grid = grid;
        record->block = block;
        LaunchRecord* previous = tRecord.load(std::memory_order_relaxed);
        tRecord.store(record.get(), std::memory_order_relaxed);
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

cudaError_t cudaDeviceSynchronize()
{
    drain();
    return stickyOrSuccess();
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
    gCreated[reinterpret_cast<StreamKey>(handle)] = true;
    *stream = handle;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    {
        std::lock_guard<std::mutex> lock(gQueueMutex);
        if (stream == nullptr || gCreated.erase(reinterpret_cast<StreamKey>(stream)) == 0)
        {
            return fail(cudaErrorInvalidResourceHandle);
        }
    }
    // Its queued work stays queued, as in CUDA (run before the handle's memory is reused:
    // a new stream at the same address would otherwise share its queue).
    drain();
    delete[] reinterpret_cast<char*>(stream);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    if (!validStream(stream))
    {
        return fail(cudaErrorInvalidResourceHandle);
    }
    drain();
    return stickyOrSuccess();
}

} // namespace emu
} // namespace pytrt_kv

// --- C ABI of the emulated device (exported by the emulated kernel library) --------------
namespace
{
void appendJson(std::string& out, pytrt_kv::emu::detail::LaunchRecord const& r)
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
    using namespace pytrt_kv::emu::detail;
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

//! Clear a sticky fault (cudaDeviceReset for the emulated device; tests of the fault path).
extern "C" __attribute__((visibility("default"))) void pytrt_kv_emu_reset()
{
    using namespace pytrt_kv::emu::detail;
    dropQueued();
    clearErrors();
}
