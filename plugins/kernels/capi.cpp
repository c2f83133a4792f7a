#include "capi.h"

#include "gatherPlan.h"
#include "kvError.h"
#include "scatterRows.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <new>

using pytrt_kv::kernels::GatherSelectionParams;
using pytrt_kv::kernels::ScatterParams;

// The Python ctypes mirror (pytrt_kv/ops.py) assumes these layouts; the CPU test
// compares them with pytrt_kv_params_layout(). Bump ABI_VERSION in
// pytrt_kv/contract/limits.py (and regenerate kvContract.h) with any change.
namespace
{
static_assert(sizeof(void*) == 8, "64-bit only");
static_assert(sizeof(ScatterParams) == 168, "ScatterParams layout changed: update pytrt_kv/ops.py");
static_assert(offsetof(ScatterParams, keyType) == 64 && offsetof(ScatterParams, compress) == 76
        && offsetof(ScatterParams, numTokens) == 88 && offsetof(ScatterParams, numBlocks) == 120
        && offsetof(ScatterParams, kScale) == 136 && offsetof(ScatterParams, vScaleCount) == 164,
    "ScatterParams layout changed: update pytrt_kv/ops.py");
static_assert(sizeof(GatherSelectionParams) == 160, "GatherSelectionParams layout changed: update pytrt_kv/ops.py");
static_assert(offsetof(GatherSelectionParams, cacheType) == 80
        && offsetof(GatherSelectionParams, selectionBlockNum) == 104
        && offsetof(GatherSelectionParams, workspace) == 144,
    "GatherSelectionParams layout changed: update pytrt_kv/ops.py");

//! Makes \p device current for its lifetime and restores the caller's device after.
class DeviceGuard
{
public:
    explicit DeviceGuard(int32_t device)
    {
        if (device >= 0 && cudaGetDevice(&mPrevious) == cudaSuccess && mPrevious != device)
        {
            mStatus = cudaSetDevice(device);
            mRestore = mStatus == cudaSuccess;
        }
    }
    ~DeviceGuard()
    {
        if (mRestore)
        {
            cudaSetDevice(mPrevious);
        }
    }
    DeviceGuard(DeviceGuard const&) = delete;
    DeviceGuard& operator=(DeviceGuard const&) = delete;
    cudaError_t status() const
    {
        return mStatus;
    }

private:
    int mPrevious{-1};
    bool mRestore{false};
    cudaError_t mStatus{cudaSuccess};
};

//! Copies \p values to \p out (no allocation: called from extern "C").
int32_t writeLayout(int64_t* out, int32_t capacity, std::initializer_list<int64_t> values)
{
    if (out == nullptr || capacity < static_cast<int32_t>(values.size()))
    {
        return -1;
    }
    int32_t n = 0;
    for (int64_t const v : values)
    {
        out[n++] = v;
    }
    return n;
}

//! The result of a helper's own CUDA call: recorded, returned, and cleared from the
//! runtime's last error (this library links cudart statically, so that state holds only
//! this library's calls; the caller learns of the failure from the return value). Left
//! pending, it would make the next launch refuse to run (kvError.h refusePendingError).
//! Sticky errors stay whatever we do.
int32_t ownError(cudaError_t e, char const* where)
{
    if (e != cudaSuccess)
    {
        cudaGetLastError();
    }
    return pytrt_kv::kernels::recordLaunch(e, where);
}

//! What both launch entry points do: refuse a null \p params (recording \p nullMessage),
//! make \p device current (see DeviceGuard), then run \p launch on \p stream.
template <typename Params>
int32_t launchOnDevice(cudaError_t (*launch)(Params const&, cudaStream_t), Params const* params, void* stream,
    int32_t device, char const* nullMessage)
{
    if (params == nullptr)
    {
        return pytrt_kv::kernels::invalidArgument(nullMessage);
    }
    DeviceGuard guard(device);
    if (guard.status() != cudaSuccess)
    {
        return pytrt_kv::kernels::recordLaunch(guard.status(), "cudaSetDevice");
    }
    return launch(*params, static_cast<cudaStream_t>(stream));
}
} // namespace

int32_t pytrt_kv_version(void)
{
    return pytrt_kv::contract::kVERSION_NUMBER;
}

int32_t pytrt_kv_abi_version(void)
{
    return pytrt_kv::contract::kABI_VERSION;
}

char const* pytrt_kv_get_last_error(void)
{
    return pytrt_kv::kernels::lastErrorMessage();
}

char const* pytrt_kv_error_string(int32_t code)
{
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

#define PYTRT_KV_OFF(T, f) static_cast<int64_t>(offsetof(T, f))

int32_t pytrt_kv_params_layout(int32_t which, int64_t* out, int32_t capacity)
{
    if (which == 0)
    {
        using T = ScatterParams;
        return writeLayout(out, capacity,
            {static_cast<int64_t>(sizeof(T)), PYTRT_KV_OFF(T, key), PYTRT_KV_OFF(T, value), PYTRT_KV_OFF(T, keyCache),
                PYTRT_KV_OFF(T, valueCache), PYTRT_KV_OFF(T, slotMapping), PYTRT_KV_OFF(T, compressLens),
                PYTRT_KV_OFF(T, compressSeqOffsets), PYTRT_KV_OFF(T, seqLens), PYTRT_KV_OFF(T, keyType),
                PYTRT_KV_OFF(T, valueType), PYTRT_KV_OFF(T, indexType), PYTRT_KV_OFF(T, compress),
                PYTRT_KV_OFF(T, layout), PYTRT_KV_OFF(T, mode), PYTRT_KV_OFF(T, numTokens), PYTRT_KV_OFF(T, batch),
                PYTRT_KV_OFF(T, maxSeqLen), PYTRT_KV_OFF(T, numHeads), PYTRT_KV_OFF(T, headSizeK),
                PYTRT_KV_OFF(T, headSizeV), PYTRT_KV_OFF(T, numBlocks), PYTRT_KV_OFF(T, blockSize),
                PYTRT_KV_OFF(T, kScale), PYTRT_KV_OFF(T, vScale), PYTRT_KV_OFF(T, keyCacheType),
                PYTRT_KV_OFF(T, valueCacheType), PYTRT_KV_OFF(T, kScaleCount), PYTRT_KV_OFF(T, vScaleCount)});
    }
    if (which == 1)
    {
        using T = GatherSelectionParams;
        return writeLayout(out, capacity,
            {static_cast<int64_t>(sizeof(T)), PYTRT_KV_OFF(T, selectionKRope), PYTRT_KV_OFF(T, selectionKvCache),
                PYTRT_KV_OFF(T, selectionKvBlockTable), PYTRT_KV_OFF(T, selectionKvBlockStatus),
                PYTRT_KV_OFF(T, selectionTopkIndices), PYTRT_KV_OFF(T, fullKRope), PYTRT_KV_OFF(T, fullKvCache),
                PYTRT_KV_OFF(T, fullKvBlockTable), PYTRT_KV_OFF(T, fullKvActualSeq),
                PYTRT_KV_OFF(T, selectionKvActualSeq), PYTRT_KV_OFF(T, cacheType), PYTRT_KV_OFF(T, batch),
                PYTRT_KV_OFF(T, seqPerBatch), PYTRT_KV_OFF(T, topk), PYTRT_KV_OFF(T, topkBlockSize),
                PYTRT_KV_OFF(T, selectionRows), PYTRT_KV_OFF(T, selectionBlockNum), PYTRT_KV_OFF(T, selectionBlockSize),
                PYTRT_KV_OFF(T, selectionMaxBlockNum), PYTRT_KV_OFF(T, fullBlockNum), PYTRT_KV_OFF(T, fullBlockSize),
                PYTRT_KV_OFF(T, fullMaxBlockNum), PYTRT_KV_OFF(T, kRopeDim), PYTRT_KV_OFF(T, kvDim),
                PYTRT_KV_OFF(T, workspace), PYTRT_KV_OFF(T, workspaceBytes)});
    }
    return -1;
}

int32_t pytrt_kv_scatter_pa_kv_cache(ScatterParams const* params, void* stream, int32_t device)
{
    return launchOnDevice(
        &pytrt_kv::kernels::launchScatterPaKvCache, params, stream, device, "scatter: params is null");
}

size_t pytrt_kv_gather_workspace_size(GatherSelectionParams const* params)
{
    return params == nullptr ? 0 : pytrt_kv::kernels::getGatherSelectionWorkspaceSize(*params);
}

int32_t pytrt_kv_gather_selection_kv_cache(GatherSelectionParams const* params, void* stream, int32_t device)
{
    return launchOnDevice(
        &pytrt_kv::kernels::launchGatherSelectionKvCache, params, stream, device, "gather: params is null");
}

int32_t pytrt_kv_pointer_info(void const* ptr, int32_t* kind, int32_t* device, void** devicePtr)
{
    pytrt_kv::kernels::clearLastError();
    if (kind == nullptr || device == nullptr || devicePtr == nullptr)
    {
        return pytrt_kv::kernels::invalidArgument("pointer_info: null output argument");
    }
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
    if (e != cudaSuccess)
    {
        cudaGetLastError(); // not sticky: clear it so the caller's next launch is not blamed
        return pytrt_kv::kernels::recordLaunch(e, "cudaPointerGetAttributes");
    }
    *device = attr.device;
    *devicePtr = attr.devicePointer;
    switch (attr.type)
    {
    case cudaMemoryTypeHost:
        *kind = pytrt_kv::contract::kPOINTER_PINNED;
        if (*devicePtr == nullptr)
        {
            // Registered without cudaHostRegisterMapped: ask for the mapping explicitly.
            e = cudaHostGetDevicePointer(devicePtr, const_cast<void*>(ptr), 0);
            if (e != cudaSuccess)
            {
                cudaGetLastError();
                return pytrt_kv::kernels::recordLaunch(e, "cudaHostGetDevicePointer");
            }
        }
        break;
    case cudaMemoryTypeDevice: *kind = pytrt_kv::contract::kPOINTER_DEVICE; break;
    case cudaMemoryTypeManaged: *kind = pytrt_kv::contract::kPOINTER_MANAGED; break;
    default:
        *kind = pytrt_kv::contract::kPOINTER_HOST;
        *device = -1;
        *devicePtr = nullptr;
        break;
    }
    return pytrt_kv::contract::kSTATUS_SUCCESS;
}

int32_t pytrt_kv_gather_plan_rows_host(int32_t rows, int32_t topk, int32_t seqPerBatch, int32_t topkBlockSize,
    int32_t const* oldStatus, int32_t const* topkIndices, int32_t const* kvLen, int32_t const* s, int32_t* newStatus,
    uint8_t* copy, int32_t* actualSeq, uint8_t* skipped)
{
    namespace k = pytrt_kv::kernels;
    k::clearLastError();
    if (rows < 0 || topk < 0 || topk > k::kMAX_TOPK || seqPerBatch < 1 || topkBlockSize < 1
        || static_cast<int64_t>(topk) * topkBlockSize > INT32_MAX)
    {
        return k::invalidArgument("gather_plan_rows_host: need rows >= 0, 0 <= K <= " PYTRT_KV_MAX_TOPK_STR
                                  ", S >= 1, TBS >= 1, K * TBS <= INT32_MAX");
    }
    if (rows > 0
        && (oldStatus == nullptr || (topk > 0 && topkIndices == nullptr) || kvLen == nullptr || s == nullptr
            || newStatus == nullptr || (topk > 0 && copy == nullptr) || actualSeq == nullptr || skipped == nullptr))
    {
        return k::invalidArgument("gather_plan_rows_host: null array");
    }
    for (int32_t r = 0; r < rows; ++r)
    {
        if (s[r] < 0 || s[r] >= seqPerBatch)
        {
            return k::invalidArgument("gather_plan_rows_host: need 0 <= s[r] < S");
        }
    }
    // Scratch of one planning CTA and one row's miss list, from the heap (nothrow: nothing
    // is thrown across extern "C").
    struct Scratch
    {
        k::PlanShared shared;
        k::PlanThread threads[k::kPLAN_MAX_THREADS];
        k::MissEntry misses[k::kMAX_TOPK];
    };
    std::unique_ptr<Scratch> scratch(new (std::nothrow) Scratch);
    if (!scratch)
    {
        return k::recordLaunch(cudaErrorMemoryAllocation, "gather_plan_rows_host");
    }
    size_t const kk = static_cast<size_t>(topk);
    for (int32_t r = 0; r < rows; ++r)
    {
        // The planner works in place, like the kernel on the status tensor.
        int32_t* status = newStatus + r * (kk + 1);
        for (size_t j = 0; j <= kk; ++j)
        {
            status[j] = oldStatus[r * (kk + 1) + j];
        }
        // One row as a call of its own (B = S rows, this one at s[r]); no tables, so every
        // miss entry is "skipped" but keeps its slot: the copy flags are the miss slots.
        int32_t missCount = 0;
        k::PlanArgs a{};
        a.status = status;
        a.topk = topkIndices + r * kk;
        a.kvLen = kvLen + r;
        a.actualSeq = actualSeq + r;
        a.missCount = &missCount;
        a.misses = scratch->misses;
        a.fullBlockSize = k::Divider::make(1);
        a.selectionBlockSize = k::Divider::make(1);
        a.seqPerBatch = seqPerBatch;
        a.topkCount = topk;
        a.tbs = topkBlockSize;
        a.rows = 1;
        k::PlanRow probe{};
        skipped[r] = k::planBeginAt(a, 0, 0, s[r], 1, probe) ? 0 : 1;
        k::planRowOnHost(a, 0, 0, s[r], scratch->shared, scratch->threads);
        for (size_t j = 0; j < kk; ++j)
        {
            copy[r * kk + j] = 0;
        }
        for (int32_t m = 0; m < missCount; ++m)
        {
            int32_t const slot = scratch->misses[m].slot;
            if (slot >= 0 && slot < topk)
            {
                copy[r * kk + static_cast<size_t>(slot)] = 1;
            }
        }
    }
    return 0;
}

int32_t pytrt_kv_gather_plan_host(GatherSelectionParams const* params)
{
    if (params == nullptr)
    {
        pytrt_kv::kernels::clearLastError();
        return pytrt_kv::kernels::invalidArgument("gather_plan_host: params is null");
    }
    return pytrt_kv::kernels::planGatherOnHost(*params);
}

int32_t pytrt_kv_compress_rows_host(
    int32_t mode, int64_t seqLen, int64_t width, int64_t offset, int32_t maxSeqLen, int32_t* source)
{
    using pytrt_kv::kernels::CompressMode;
    pytrt_kv::kernels::clearLastError();
    if (mode < 0 || mode > 2 || maxSeqLen < 0 || (maxSeqLen > 0 && source == nullptr))
    {
        return -1;
    }
    auto const m = static_cast<CompressMode>(mode);
    pytrt_kv::kernels::CompressRun const run = pytrt_kv::kernels::compressRun(m, seqLen, width, offset, maxSeqLen);
    for (int32_t i = 0; i < maxSeqLen; ++i)
    {
        source[i] = pytrt_kv::kernels::compressRowSource(m, run, i);
    }
    return run.rows;
}

int32_t pytrt_kv_device_malloc(size_t bytes, int32_t device, void** ptr)
{
    pytrt_kv::kernels::clearLastError();
    if (ptr == nullptr)
    {
        return pytrt_kv::kernels::invalidArgument("device_malloc: ptr is null");
    }
    *ptr = nullptr;
    DeviceGuard guard(device);
    if (guard.status() != cudaSuccess)
    {
        return pytrt_kv::kernels::recordLaunch(guard.status(), "cudaSetDevice");
    }
    return ownError(cudaMalloc(ptr, bytes), "cudaMalloc");
}

int32_t pytrt_kv_device_free(void* ptr, int32_t device)
{
    pytrt_kv::kernels::clearLastError();
    DeviceGuard guard(device);
    if (guard.status() != cudaSuccess)
    {
        return pytrt_kv::kernels::recordLaunch(guard.status(), "cudaSetDevice");
    }
    return ownError(cudaFree(ptr), "cudaFree");
}

int32_t pytrt_kv_copy(void* dst, void const* src, size_t bytes, void* stream, int32_t device)
{
    pytrt_kv::kernels::clearLastError();
    DeviceGuard guard(device);
    if (guard.status() != cudaSuccess)
    {
        return pytrt_kv::kernels::recordLaunch(guard.status(), "cudaSetDevice");
    }
    auto const s = static_cast<cudaStream_t>(stream);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
    if (e == cudaSuccess)
    {
        e = cudaStreamSynchronize(s);
    }
    return ownError(e, "pytrt_kv_copy");
}

int32_t pytrt_kv_host_register(void* ptr, size_t bytes, uint32_t extraFlags)
{
    pytrt_kv::kernels::clearLastError();
    // Portable: the pinning holds for every device's context, not only the current one
    // (a multi-GPU process copies from the same pinned array on any device).
    cudaError_t const e = cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable | extraFlags);
    if (e != cudaSuccess)
    {
        cudaGetLastError();
    }
    return pytrt_kv::kernels::recordLaunch(e, "cudaHostRegister");
}

int32_t pytrt_kv_host_unregister(void* ptr)
{
    pytrt_kv::kernels::clearLastError();
    cudaError_t const e = cudaHostUnregister(ptr);
    if (e != cudaSuccess)
    {
        cudaGetLastError();
    }
    return pytrt_kv::kernels::recordLaunch(e, "cudaHostUnregister");
}
