/*
 * GatherSelectionKvCache (docs/SPEC.md G). One memset and two launches on one stream, all
 * graph-capturable:
 *  0. the miss counter at the head of the workspace is zeroed;
 *  1. gatherPlanKernel, one CTA of planThreads(K) threads (two topk positions each) per
 *     selection-table row, runs the phases of gatherPlan.h
 *     (shared with the host tests): reads the old status row, places the row's ids (a
 *     shared-memory hash finds each id's old slot, a block scan hands out free slots in
 *     topk order), appends one MissEntry per copied id to the workspace's miss list with
 *     its source and destination token rows resolved, then writes the new status row
 *     and actual_seq;
 *  2. gatherCopyKernel, a resident grid over (miss, token) tasks: groups of G threads move
 *     one token's kv (and k_rope) row with W-byte vectors. It reads the miss list and the
 *     full cache only, never the status, so writing the status in launch 1 is safe; the
 *     full cache may be pinned host memory (unified addressing). Its work is
 *     proportional to the copied tokens: kept slots, padding and unused slots cost
 *     nothing there.
 */
#include "gatherSelectionKvCache.h"

#include "gatherPlan.h"
#include "kvDispatch.cuh"
#include "kvError.h"
#include "kvLaunch.h"

#include <algorithm>
#include <climits>
#include <new>

namespace pytrt_kv
{
namespace kernels
{
namespace
{

//! Exclusive prefix sum over the CTA of one int per thread (thread order), and the total.
__device__ int32_t blockExclusiveScan(int32_t x, int32_t* warpTotals, int32_t& total)
{
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    int32_t inclusive = x;
#pragma unroll
    for (int32_t d = 1; d < 32; d *= 2)
    {
        int32_t const y = __shfl_up_sync(0xffffffffU, inclusive, d);
        inclusive += lane >= d ? y : 0;
    }
    int32_t const warps = static_cast<int32_t>(blockDim.x) / 32; // planThreads(K): whole warps
    static_assert(kPLAN_MAX_THREADS / 32 <= 32, "one warp scans the warp totals");
    if (lane == 31)
    {
        warpTotals[warp] = inclusive;
    }
    __syncthreads();
    // Warp 0 turns the warp totals into inclusive prefixes in place (each lane reads and
    // writes its own entry), so that no thread loops over every warp's total.
    if (warp == 0)
    {
        int32_t w = lane < warps ? warpTotals[lane] : 0;
#pragma unroll
        for (int32_t d = 1; d < 32; d *= 2)
        {
            int32_t const y = __shfl_up_sync(0xffffffffU, w, d);
            w += lane >= d ? y : 0;
        }
        if (lane < warps)
        {
            warpTotals[lane] = w;
        }
    }
    __syncthreads();
    total = warpTotals[warps - 1];
    int32_t const before = warp > 0 ? warpTotals[warp - 1] : 0;
    return before + inclusive - x;
}

__global__ void __launch_bounds__(kPLAN_MAX_THREADS) gatherPlanKernel(PlanArgs const a)
{
    __shared__ PlanShared sh;
    int32_t const tid = threadIdx.x;
    PlanRow row;
    if (!planBegin(a, blockIdx.x, tid, row))
    {
        return;
    }
    planInit(row, sh, tid);
    // Issued with the phase-2 loads; every read of the old status row precedes the
    // barrier after planLoad, every write follows it.
    int32_t const oldTotal = loadGlobal(a.status + static_cast<int64_t>(row.r) * (a.topkCount + 1) + a.topkCount);
    __syncthreads();
    planLoad(a, row, sh, tid);
    __syncthreads();
    PlanThread t;
    planPin(a, row, sh, t, tid, oldTotal);
    __syncthreads();
    int32_t total = 0;
    int32_t const before = blockExclusiveScan(planCount(a, row, sh, t, tid), sh.warpTotals, total);
    planFree(a, sh, t, tid, before, total);
    __syncthreads();
    planWrite(a, row, sh, t, tid);
}

struct CopyArgs
{
    int32_t const* missCount; // written by gatherPlanKernel
    MissEntry const* misses;  // [*missCount]
    char const* fullKv;
    char const* fullRope;
    char* selectionKv;
    char* selectionRope;
    int64_t kvBytes;   // per token row
    int64_t ropeBytes; // per token row, 0 in quantised mode
    Divider tbs;       // tasks per miss entry
    int32_t group;
};

template <int W>
__global__ void __launch_bounds__(kBLOCK_THREADS) gatherCopyKernel(CopyArgs const a)
{
    int32_t const groupsPerBlock = kBLOCK_THREADS / a.group;
    int32_t const lane = threadIdx.x % a.group;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * groupsPerBlock;
    // The list the plan just wrote: tasks are (miss, token), token fastest, so
    // neighbouring groups read neighbouring rows of one full block.
    int64_t const tasks = static_cast<int64_t>(loadGlobal(a.missCount)) * a.tbs.divisor;
    int32_t const kvVectors = static_cast<int32_t>(a.kvBytes / W);
    int32_t const allVectors = kvVectors + static_cast<int32_t>(a.ropeBytes / W);
    for (int64_t task = static_cast<int64_t>(blockIdx.x) * groupsPerBlock + threadIdx.x / a.group; task < tasks;
        task += stride)
    {
        // A shift for power-of-two TBS, else a 32-bit division while the index fits.
        int64_t const m
            = (a.tbs.shift >= 0 || task > INT_MAX) ? a.tbs.div(task) : a.tbs.div32(static_cast<int32_t>(task));
        int32_t const i = static_cast<int32_t>(task - m * a.tbs.divisor);
        MissEntry const entry = loadGlobal(a.misses + m);
        int64_t const srcRow = entry.srcRow;
        int64_t const dstRow = entry.dstRow;
        if (i >= entry.size || srcRow < 0 || dstRow < 0)
        {
            continue; // past a partial id, or an id whose table entries are out of range
        }
        char const* kvSrc = a.fullKv + (srcRow + i) * a.kvBytes;
        char* kvDst = a.selectionKv + (dstRow + i) * a.kvBytes;
        char const* ropeSrc = a.fullRope + (srcRow + i) * a.ropeBytes;
        char* ropeDst = a.selectionRope + (dstRow + i) * a.ropeBytes;
        // kv vectors, then rope vectors, as one row of allVectors.
        copyVectors<W, LoadPolicy::kSTREAM>(
            allVectors, lane, a.group,
            [&](int32_t idx) {
                return idx < kvVectors ? kvSrc + static_cast<int64_t>(idx) * W
                                       : ropeSrc + static_cast<int64_t>(idx - kvVectors) * W;
            },
            [&](int32_t idx) {
                return idx < kvVectors ? kvDst + static_cast<int64_t>(idx) * W
                                       : ropeDst + static_cast<int64_t>(idx - kvVectors) * W;
            },
            AlwaysReady{});
    }
}

int64_t planEntries(GatherSelectionParams const& p)
{
    return static_cast<int64_t>(p.batch) * p.seqPerBatch * p.topk;
}

cudaError_t checkGather(GatherSelectionParams const& p)
{
    int32_t const item = dataTypeSize(p.cacheType);
    if (!(item == 1 || item == 2 || item == 4))
    {
        return invalidArgument("gather: cacheType must be a 1-, 2- or 4-byte type");
    }
    // B*S == 0 (an empty batch) is accepted: nothing is planned or copied (docs/SPEC.md
    // G2 allows any TBS with K <= kMAX_TOPK; the Ascend kernel's K > 32 => TBS == 1 is lifted).
    if (p.batch < 0 || p.seqPerBatch < 0 || (p.batch > 0 && p.seqPerBatch < 1) || p.topk < 0 || p.topk > kMAX_TOPK
        || p.topkBlockSize < 1)
    {
        return invalidArgument(
            "gather: need batch >= 0, seqPerBatch >= 1 (>= 0 when batch == 0), 0 <= topk <= " PYTRT_KV_MAX_TOPK_STR
            ", "
            "topkBlockSize >= 1");
    }
    if (static_cast<int64_t>(p.batch) * p.seqPerBatch > INT_MAX)
    {
        return invalidArgument("gather: batch * seqPerBatch must fit in int32");
    }
    // The miss list is counted and indexed in int32 (gatherPlan.h): a larger list would
    // wrap the count and write before the workspace.
    if (planEntries(p) > INT_MAX)
    {
        return invalidArgument("gather: batch * seqPerBatch * topk must fit in int32");
    }
    if (p.selectionBlockSize < 1 || p.fullBlockSize < 1 || p.selectionBlockSize % p.topkBlockSize != 0
        || p.fullBlockSize % p.topkBlockSize != 0)
    {
        return invalidArgument(
            "gather: selection and full block sizes must be positive multiples of "
            "topkBlockSize");
    }
    if (static_cast<int64_t>(p.selectionRows) < static_cast<int64_t>(p.batch) * p.seqPerBatch)
    {
        return invalidArgument("gather: selectionRows must be >= batch * seqPerBatch");
    }
    if (p.topk > 0
        && static_cast<int64_t>(p.selectionMaxBlockNum) * p.selectionBlockSize
            < static_cast<int64_t>(p.topk) * p.topkBlockSize)
    {
        return invalidArgument(
            "gather: selectionMaxBlockNum must be >= ceil(topk * topkBlockSize / "
            "selectionBlockSize)");
    }
    // The status and selection_kv_actual_seq hold a row's token total (<= topk * TBS) in
    // int32, and the plan sums it with a 32-bit add (gatherPlan.h PlanShared::total).
    if (static_cast<int64_t>(p.topk) * p.topkBlockSize > INT_MAX)
    {
        return invalidArgument("gather: topk * topkBlockSize must fit in int32");
    }
    if (p.selectionBlockNum < 0 || p.fullBlockNum < 0 || p.fullMaxBlockNum < 0 || p.kvDim < 1 || p.kRopeDim < 0)
    {
        return invalidArgument("gather: need block counts >= 0, kvDim >= 1, kRopeDim >= 0");
    }
    // The copy kernel counts a token row's vectors in int32 (W >= 1 byte each).
    if ((static_cast<int64_t>(p.kvDim) + p.kRopeDim) * item > INT_MAX)
    {
        return invalidArgument("gather: (kvDim + kRopeDim) * itemsize must fit in int32");
    }
    // A pointer is required only where its tensor has elements: TensorRT passes null for
    // zero-volume tensors, and an empty cache is never addressed (every table entry is then
    // out of range, so its copies are skipped).
    bool const rows = static_cast<int64_t>(p.batch) * p.seqPerBatch > 0;
    if ((rows && (p.selectionKvBlockStatus == nullptr || p.fullKvActualSeq == nullptr))
        || (rows && p.topk > 0 && p.selectionTopkIndices == nullptr)
        || (rows && p.fullMaxBlockNum > 0 && p.fullKvBlockTable == nullptr)
        || (p.selectionRows > 0 && p.selectionMaxBlockNum > 0 && p.selectionKvBlockTable == nullptr)
        || (p.selectionRows > 0 && p.selectionKvActualSeq == nullptr)
        || (p.selectionBlockNum > 0 && p.selectionKvCache == nullptr)
        || (p.fullBlockNum > 0 && p.fullKvCache == nullptr))
    {
        return invalidArgument("gather: a required pointer is null");
    }
    if (p.kRopeDim > 0
        && ((p.selectionBlockNum > 0 && p.selectionKRope == nullptr) || (p.fullBlockNum > 0 && p.fullKRope == nullptr)))
    {
        return invalidArgument("gather: kRopeDim > 0 needs selectionKRope and fullKRope");
    }
    if (planEntries(p) > 0 && (p.workspace == nullptr || p.workspaceBytes < getGatherSelectionWorkspaceSize(p)))
    {
        return invalidArgument("gather: workspace missing or smaller than getGatherSelectionWorkspaceSize()");
    }
    if (reinterpret_cast<uintptr_t>(p.workspace) % alignof(MissEntry) != 0)
    {
        return invalidArgument("gather: workspace must be 8-byte aligned");
    }
    return cudaSuccess;
}

} // namespace

size_t getGatherSelectionWorkspaceSize(GatherSelectionParams const& params)
{
    return getGatherPlanWorkspaceSize(planEntries(params));
}

size_t getGatherPlanWorkspaceSize(int64_t entries)
{
    size_t const bytes = gatherWorkspaceBytes(entries);
    return (bytes + 255) / 256 * 256;
}

namespace
{
PlanArgs makePlanArgs(GatherSelectionParams const& params)
{
    PlanArgs a{};
    a.status = params.selectionKvBlockStatus;
    a.topk = params.selectionTopkIndices;
    a.kvLen = params.fullKvActualSeq;
    a.actualSeq = params.selectionKvActualSeq;
    a.fullTable = params.fullKvBlockTable;
    a.selectionTable = params.selectionKvBlockTable;
    bool const list = planEntries(params) > 0;
    a.missCount = list ? static_cast<int32_t*>(params.workspace) : nullptr;
    a.misses = list ? reinterpret_cast<MissEntry*>(static_cast<char*>(params.workspace) + kMISS_LIST_OFFSET) : nullptr;
    a.fullBlockNum = params.fullBlockNum;
    a.selectionBlockNum = params.selectionBlockNum;
    a.fullBlockSize = Divider::make(params.fullBlockSize);
    a.selectionBlockSize = Divider::make(params.selectionBlockSize);
    a.fullMaxBlockNum = params.fullMaxBlockNum;
    a.selectionMaxBlockNum = params.selectionMaxBlockNum;
    a.seqPerBatch = params.seqPerBatch;
    a.topkCount = params.topk;
    a.tbs = params.topkBlockSize;
    a.rows = params.batch * params.seqPerBatch;
    return a;
}
} // namespace

cudaError_t planGatherOnHost(GatherSelectionParams const& params)
{
    clearLastError();
    cudaError_t const status = checkGather(params);
    if (status != cudaSuccess)
    {
        return status;
    }
    PlanArgs const a = makePlanArgs(params);
    if (a.missCount != nullptr)
    {
        *a.missCount = 0;
    }
    // Scratch of one planning CTA (about 57 KiB): from the heap, never thrown across the
    // C ABI.
    struct Scratch
    {
        PlanShared shared;
        PlanThread threads[kPLAN_MAX_THREADS];
    };
    Scratch* scratch = new (std::nothrow) Scratch;
    if (scratch == nullptr)
    {
        return recordLaunch(cudaErrorMemoryAllocation, "gather plan on the host");
    }
    for (int32_t r = 0; r < params.selectionRows; ++r)
    {
        int32_t const b = r < a.rows ? r / a.seqPerBatch : 0;
        planRowOnHost(a, r, b, r < a.rows ? r - b * a.seqPerBatch : 0, scratch->shared, scratch->threads);
    }
    delete scratch;
    return cudaSuccess;
}

cudaError_t launchGatherSelectionKvCache(GatherSelectionParams const& params, cudaStream_t stream)
{
    clearLastError();
    cudaError_t const status = checkGather(params);
    if (status != cudaSuccess || params.selectionRows == 0)
    {
        return status;
    }
    cudaError_t e = refusePendingError("gather");
    if (e != cudaSuccess)
    {
        return e;
    }
    PlanArgs const plan = makePlanArgs(params);
    int64_t const entries = planEntries(params);
    if (entries > 0)
    {
        e = recordLaunch(cudaMemsetAsync(plan.missCount, 0, sizeof(int32_t), stream), "gather: zeroing the miss count");
        if (e != cudaSuccess)
        {
            cudaGetLastError(); // ours: nothing was pending before (refusePendingError)
            return e;
        }
    }
    // Rows past B*S (and every row of an empty batch) get actual_seq = 0 from the plan.
    PYTRT_KV_LAUNCH("gatherPlanKernel", gatherPlanKernel, static_cast<unsigned>(params.selectionRows),
        static_cast<unsigned>(planThreads(params.topk)), stream, plan);
    e = recordLaunch(cudaGetLastError(), "gatherPlanKernel");
    if (e != cudaSuccess || entries == 0)
    {
        return e;
    }

    CopyArgs c{};
    c.missCount = plan.missCount;
    c.misses = plan.misses;
    c.fullKv = static_cast<char const*>(params.fullKvCache);
    c.fullRope = static_cast<char const*>(params.fullKRope);
    c.selectionKv = static_cast<char*>(params.selectionKvCache);
    c.selectionRope = static_cast<char*>(params.selectionKRope);
    int64_t const item = dataTypeSize(params.cacheType);
    c.kvBytes = params.kvDim * item;
    c.ropeBytes = params.kRopeDim * item;
    c.tbs = Divider::make(params.topkBlockSize);
    int const width = c.ropeBytes > 0
        ? vectorWidth({reinterpret_cast<uint64_t>(c.fullKv), reinterpret_cast<uint64_t>(c.selectionKv),
              static_cast<uint64_t>(c.kvBytes), reinterpret_cast<uint64_t>(c.fullRope),
              reinterpret_cast<uint64_t>(c.selectionRope), static_cast<uint64_t>(c.ropeBytes)})
        : vectorWidth({reinterpret_cast<uint64_t>(c.fullKv), reinterpret_cast<uint64_t>(c.selectionKv),
              static_cast<uint64_t>(c.kvBytes)});
    c.group = groupSize((c.kvBytes + c.ropeBytes) / width);
    // Sized for the worst case (every slot of every row copied), capped at one resident
    // wave; the kernel reads the real miss count, so blocks beyond the misses exit at once.
    int64_t const worstTasks = entries * params.topkBlockSize;
    return dispatchVectorWidth(width, [&](auto w) {
        constexpr auto kernel = gatherCopyKernel<decltype(w)::value>;
        int64_t const grid = residentGridSize<kernel>(worstTasks, c.group);
        PYTRT_KV_LAUNCH("gatherCopyKernel", kernel, static_cast<unsigned>(grid), kBLOCK_THREADS, stream, c);
        return recordLaunch(cudaGetLastError(), "gatherCopyKernel");
    });
}

} // namespace kernels
} // namespace pytrt_kv
