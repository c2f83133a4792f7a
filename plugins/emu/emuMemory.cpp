/*
 * Memory of the emulated device (docs/EMULATION.md): device allocations and pinned host
 * memory are host memory with a registry of live ranges of their exact requested sizes.
 *
 * - A kernel's global loads and stores (the cache-hint intrinsics and the kernels'
 *   loadGlobal/storeGlobal, kvHostDevice.h) must fall inside a live device or pinned range,
 *   else cudaErrorIllegalAddress (sticky, as on a GPU), reported with the source line.
 * - Allocations have their exact requested size (posix_memalign; 256-byte device, 4096-byte
 *   pinned alignment, as CUDA's): under AddressSanitizer a one-byte overflow by any access,
 *   checked or not, is a heap-buffer-overflow.
 * - Copies and fills must stay inside their allocations; those touching pageable host
 *   memory run at once (CUDA stages them before returning).
 */
#include "emuInternal.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <shared_mutex>

namespace pytrt_kv
{
namespace emu
{
namespace detail
{
namespace
{
enum class Kind
{
    kDEVICE,
    kPINNED_ALLOC,
    kREGISTERED,
};

struct Range
{
    size_t bytes; //!< what was asked for (and allocated): every check uses this
    Kind kind;
};

// Kernels look allocations up under a shared lock: readers do not order each other, so two
// streams' kernels are not ordered through it (ThreadSanitizer); the host changes the map.
std::shared_mutex gMemMutex;
std::map<uintptr_t, Range> gRanges; // base -> range (never overlapping)
//! Bumped when a range goes away: the per-thread lookup caches below then miss.
std::atomic<uint64_t> gGeneration{1};

// The allocation the last kernel access of this thread fell in (atomics: see LaunchRecord).
thread_local std::atomic<uintptr_t> tHitBase{0};
thread_local std::atomic<size_t> tHitBytes{0};
thread_local std::atomic<uint64_t> tHitGeneration{0};

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

//! Exactly \p bytes of fresh device or pinned memory, \p align-aligned, filled with 0xCD
//! (device memory is uninitialized: never rely on zeros). Not rounded up: ASan's redzone
//! starts at the first byte past the request.
cudaError_t allocate(void** ptr, size_t bytes, size_t align, Kind kind)
{
    void* p = nullptr;
    if (posix_memalign(&p, align, bytes) != 0 || p == nullptr)
    {
        return fail(cudaErrorMemoryAllocation);
    }
    std::memset(p, 0xCD, bytes);
    std::lock_guard<std::shared_mutex> lock(gMemMutex);
    gRanges[reinterpret_cast<uintptr_t>(p)] = Range{bytes, kind};
    *ptr = p;
    return cudaSuccess;
}

cudaError_t release(void* ptr, Kind kind, cudaError_t notFound)
{
    if (ptr == nullptr)
    {
        return cudaSuccess;
    }
    drain(); // frees synchronize the device
    std::lock_guard<std::recursive_mutex> device(deviceMutex());
    std::lock_guard<std::shared_mutex> lock(gMemMutex);
    auto it = gRanges.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == gRanges.end() || it->second.kind != kind)
    {
        return fail(notFound);
    }
    gRanges.erase(it);
    gGeneration.fetch_add(1, std::memory_order_relaxed);
    if (kind != Kind::kREGISTERED)
    {
        std::free(ptr);
    }
    return stickyOrSuccess();
}
} // namespace

int where(void const* p, size_t bytes)
{
    std::lock_guard<std::shared_mutex> lock(gMemMutex);
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
} // namespace detail

using namespace detail;

bool deviceAccess(void const* p, size_t bytes, bool write, bool counted, char const* file, int line) noexcept
{
    if (!inKernel())
    {
        return true; // host code (the host planning path) reads host memory
    }
    auto const a = reinterpret_cast<uintptr_t>(p);
    uintptr_t const base = tHitBase.load(std::memory_order_relaxed);
    size_t const size = tHitBytes.load(std::memory_order_relaxed);
    uint64_t const generation = gGeneration.load(std::memory_order_relaxed);
    bool ok = tHitGeneration.load(std::memory_order_relaxed) == generation && a >= base && size >= bytes
        && a - base <= size - bytes;
    if (!ok)
    {
        std::shared_lock<std::shared_mutex> lock(gMemMutex);
        auto it = findRange(p, bytes);
        ok = it != gRanges.end();
        if (ok)
        {
            tHitBase.store(it->first, std::memory_order_relaxed);
            tHitBytes.store(it->second.bytes, std::memory_order_relaxed);
            tHitGeneration.store(gGeneration.load(std::memory_order_relaxed), std::memory_order_relaxed);
        }
    }
    LaunchRecord* r = runningLaunch();
    if (!ok)
    {
        char buf[512];
        std::snprintf(buf, sizeof(buf),
            "illegal address: %s of %zu bytes at %p (%s:%d) by %s in kernel %s: not inside live device or pinned "
            "host memory",
            write ? "store" : "load", bytes, p, file != nullptr ? file : "?", line, describeThread().c_str(),
            r != nullptr ? r->name.c_str() : "?");
        fault(cudaErrorIllegalAddress, buf);
        return false;
    }
    if (r != nullptr && counted)
    {
        (write ? r->bytesWritten : r->bytesRead).fetch_add(bytes, std::memory_order_relaxed);
        (write ? r->stores : r->loads).fetch_add(1, std::memory_order_relaxed);
    }
    return true;
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
    return allocate(ptr, bytes, 256, Kind::kDEVICE);
}

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
    return allocate(ptr, std::max<size_t>(bytes, 1), 4096, Kind::kPINNED_ALLOC);
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
    std::lock_guard<std::shared_mutex> lock(gMemMutex);
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
    std::lock_guard<std::shared_mutex> lock(gMemMutex);
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
    std::lock_guard<std::shared_mutex> lock(gMemMutex);
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
        runNow(run);
        return cudaSuccess;
    }
    enqueue(stream, run);
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
        runNow(run);
        return cudaSuccess;
    }
    enqueue(stream, run);
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

} // namespace emu
} // namespace pytrt_kv
