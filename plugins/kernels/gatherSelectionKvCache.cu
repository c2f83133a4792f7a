/*
 * GatherSelectionKvCache (OPS.md G). Two launches on one stream, both graph-capturable:
 *  1. gatherPlanKernel, one CTA per selection-table row: reads the old status row,
 *     places the row's ids (gatherPlan.h predicates, run in parallel: a shared-memory
 *     hash finds each id's old slot, a block scan hands out free slots in topk order),
 *     writes the copy plan into the workspace, then the new status row and actual_seq.
 *  2. gatherCopyKernel, over (row, slot, token) tasks on the whole GPU: groups of G
 *     threads move one token's kv (and k_rope) row with W-byte vectors. The copies read
 *     the plan and the full cache only, never the status, so writing the status in
 *     launch 1 is safe; the full cache may be pinned host memory (unified addressing).
 */
#include "gatherSelectionKvCache.h"

#include "gatherPlan.h"
#include "kvDispatch.cuh"
#include "kvError.h"

#include <algorithm>
#include <climits>

namespace pytrt_kv
{
namespace kernels
{
namespace
{

constexpr int32_t kMAX_TOPK = 2048;
constexpr int32_t kPLAN_THREADS = 256;
constexpr int32_t kPLAN_ITEMS = kMAX_TOPK / kPLAN_THREADS; // entries (and slots) per thread
constexpr int32_t kHASH_SLOTS = 2 * kMAX_TOPK;             // load factor <= 1/2
constexpr int32_t kHASH_EMPTY = -1;

struct PlanArgs
{
    int32_t* status;             // [B*S, K+1]
    int32_t const* topk;         // [B*S, K]
    int32_t const* kvLen;        // [B]
    int32_t* actualSeq;          // [R]
    int32_t* plan;               // [B*S, K]: id to copy into each slot, -1 = no copy
    int32_t seqPerBatch;
    int32_t topkCount;
    int32_t tbs;
    int32_t rows;                // B*S
};

__device__ __forceinline__ uint32_t hashId(int32_t v, uint32_t mask)
{
    return (static_cast<uint32_t>(v) * 2654435761U) & mask;
}

//! Exclusive prefix sum over the CTA of one int per thread (thread order).
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
    if (lane == 31)
    {
        warpTotals[warp] = inclusive;
    }
    __syncthreads();
    int32_t before = 0;
    total = 0;
    for (int32_t w = 0; w < kPLAN_THREADS / 32; ++w)
    {
        before += w < warp ? warpTotals[w] : 0;
        total += warpTotals[w];
    }
    __syncthreads(); // warpTotals may be reused by the caller
    return before + inclusive - x;
}

__global__ void __launch_bounds__(kPLAN_THREADS) gatherPlanKernel(PlanArgs const a)
{
    __shared__ int32_t sKeys[kHASH_SLOTS];
    __shared__ int16_t sVals[kHASH_SLOTS];
    __shared__ int32_t sTopk[kMAX_TOPK];
    __shared__ int32_t sPinnedBy[kMAX_TOPK];
    __shared__ int16_t sFreeSlot[kMAX_TOPK];
    __shared__ int32_t sWarpTotals[kPLAN_THREADS / 32];
    __shared__ int32_t sOldN;
    __shared__ int32_t sValidN;
    __shared__ int32_t sReservedOwner;
    __shared__ unsigned long long sTotal;

    int32_t const r = blockIdx.x;
    int32_t const k = a.topkCount;
    int32_t const tid = threadIdx.x;
    if (r >= a.rows)
    {
        if (tid == 0)
        {
            a.actualSeq[r] = 0; // table rows past B*S are not addressed
        }
        return;
    }
    int32_t const s = r % a.seqPerBatch;
    int32_t const b = r / a.seqPerBatch;
    RowGeometry const g = rowGeometry(a.kvLen[b], a.seqPerBatch, s, a.tbs);
    int32_t* plan = a.plan + static_cast<int64_t>(r) * k;
    if (g.skipped)
    {
        for (int32_t j = tid; j < k; j += kPLAN_THREADS)
        {
            plan[j] = -1;
        }
        if (tid == 0)
        {
            a.actualSeq[r] = 0;
        }
        return;
    }
    int32_t* status = a.status + static_cast<int64_t>(r) * (k + 1);
    int32_t const* topk = a.topk + static_cast<int64_t>(r) * k;
    uint32_t hashSlots = 32;
    while (hashSlots < 2U * static_cast<uint32_t>(k))
    {
        hashSlots *= 2;
    }
    uint32_t const mask = hashSlots - 1;
    for (uint32_t i = tid; i < hashSlots; i += kPLAN_THREADS)
    {
        sKeys[i] = kHASH_EMPTY;
    }
    if (tid == 0)
    {
        sOldN = 0;
        sValidN = 0;
        sReservedOwner = INT_MAX;
        sTotal = 0;
    }
    __syncthreads();

    // Old status: count entries, index id -> old slot.
    int32_t const oldTotal = status[k];
    int32_t localOld = 0;
    for (int32_t j = tid; j < k; j += kPLAN_THREADS)
    {
        int32_t const v = status[j];
        sPinnedBy[j] = -1;
        if (v < 0)
        {
            continue;
        }
        ++localOld;
        for (uint32_t h = hashId(v, mask), probe = 0; probe < hashSlots; h = (h + 1) & mask, ++probe)
        {
            int32_t const prev = atomicCAS(&sKeys[h], kHASH_EMPTY, v);
            if (prev == kHASH_EMPTY)
            {
                sVals[h] = static_cast<int16_t>(j);
                break;
            }
            if (prev == v)
            {
                break; // a duplicated old id (corrupted status): either slot is in bounds
            }
        }
    }
    // New ids: count valid ones, their total size and the first max_id.
    int32_t localValid = 0;
    long long localTotal = 0;
    for (int32_t e = tid; e < k; e += kPLAN_THREADS)
    {
        int32_t const v = topk[e];
        sTopk[e] = v;
        if (isValidId(v, g))
        {
            ++localValid;
            localTotal += idSize(v, g, a.tbs);
            if (v == g.maxId)
            {
                atomicMin(&sReservedOwner, e);
            }
        }
    }
    atomicAdd(&sOldN, localOld);
    atomicAdd(&sValidN, localValid);
    atomicAdd(&sTotal, static_cast<unsigned long long>(localTotal));
    __syncthreads(); // every read of the old status row is done past this point

    int32_t const n = sValidN;
    int32_t const oldTail = oldTailSlot(sOldN, oldTotal, a.tbs);
    int32_t const reservedOwner = sReservedOwner;
    bool const reserveLast = reservesLastSlot(a.tbs, reservedOwner != INT_MAX);

    // Each thread owns a contiguous range of topk positions and of slots, so that
    // "in topk order" and "ascending slots" are thread order plus item order.
    int32_t const first = tid * kPLAN_ITEMS;
    int32_t pinnedAt[kPLAN_ITEMS];
#pragma unroll
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const e = first + i;
        pinnedAt[i] = -1;
        if (e >= k)
        {
            continue;
        }
        int32_t const v = sTopk[e];
        if (!isValidId(v, g) || (reserveLast && e == reservedOwner))
        {
            continue;
        }
        int32_t oldSlot = -1;
        for (uint32_t h = hashId(v, mask), probe = 0; probe < hashSlots; h = (h + 1) & mask, ++probe)
        {
            int32_t const key = sKeys[h];
            if (key == v)
            {
                oldSlot = sVals[h];
                break;
            }
            if (key == kHASH_EMPTY)
            {
                break;
            }
        }
        if (keepInPlace(v, oldSlot, n, oldTail, g, a.seqPerBatch, a.tbs, reserveLast))
        {
            pinnedAt[i] = oldSlot;
            atomicCAS(&sPinnedBy[oldSlot], -1, e); // a duplicated id pins once
        }
    }
    __syncthreads();

    // Count the ids that need a free slot and the free slots, in thread order.
    int32_t needy = 0;
    int32_t freeSlots = 0;
#pragma unroll
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const e = first + i;
        if (e < k)
        {
            bool const kept = pinnedAt[i] >= 0 && sPinnedBy[pinnedAt[i]] == e;
            needy += (isValidId(sTopk[e], g) && !kept && !(reserveLast && e == reservedOwner)) ? 1 : 0;
        }
        int32_t const j = first + i;
        freeSlots += (j < n && sPinnedBy[j] < 0 && !(reserveLast && j == n - 1)) ? 1 : 0;
    }
    // Both counts are <= 2048: one scan of the packed pair.
    int32_t totalPacked = 0;
    int32_t const before = blockExclusiveScan((needy << 16) | freeSlots, sWarpTotals, totalPacked);
    int32_t needyRank = before >> 16;
    int32_t freeRank = before & 0xFFFF;
    int32_t const freeCount = totalPacked & 0xFFFF;
#pragma unroll
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const j = first + i;
        if (j < n && sPinnedBy[j] < 0 && !(reserveLast && j == n - 1))
        {
            sFreeSlot[freeRank++] = static_cast<int16_t>(j);
        }
    }
    __syncthreads();

    // Slots n..K-1 are unused; slots 0..n-1 are each written by exactly one id below.
    for (int32_t j = n + tid; j < k; j += kPLAN_THREADS)
    {
        status[j] = -1;
        plan[j] = -1;
    }
#pragma unroll
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const e = first + i;
        if (e >= k)
        {
            continue;
        }
        int32_t const v = sTopk[e];
        if (!isValidId(v, g))
        {
            continue;
        }
        int32_t slot = -1;
        bool copy = true;
        if (reserveLast && e == reservedOwner)
        {
            slot = n - 1;
        }
        else if (pinnedAt[i] >= 0 && sPinnedBy[pinnedAt[i]] == e)
        {
            slot = pinnedAt[i];
            copy = false;
        }
        else if (needyRank < freeCount)
        {
            slot = sFreeSlot[needyRank++];
        }
        if (slot >= 0 && slot < k)
        {
            status[slot] = v;
            plan[slot] = copy ? v : -1;
        }
    }
    if (tid == 0)
    {
        int32_t const total = static_cast<int32_t>(sTotal);
        status[k] = total;
        a.actualSeq[r] = total;
    }
}

struct CopyArgs
{
    int32_t const* plan;             // [B*S, K]
    int32_t const* kvLen;            // [B]
    int32_t const* fullTable;        // [B, F_MAX_BLOCK_NUM]
    int32_t const* selectionTable;   // [R, S_MAX_BLOCK_NUM]
    char const* fullKv;
    char const* fullRope;
    char* selectionKv;
    char* selectionRope;
    int64_t kvBytes;                 // per token row
    int64_t ropeBytes;               // per token row, 0 in quantised mode
    int64_t fullBlockNum;
    int64_t selectionBlockNum;
    int32_t fullBlockSize;
    int32_t fullMaxBlockNum;
    int32_t selectionBlockSize;
    int32_t selectionMaxBlockNum;
    int32_t seqPerBatch;
    int32_t topkCount;
    int32_t tbs;
    int32_t rows;                    // B*S
    int32_t group;
};

template <int W>
__global__ void __launch_bounds__(kBLOCK_THREADS) gatherCopyKernel(CopyArgs const a)
{
    using V = typename VecOf<W>::Type;
    int32_t const groupsPerBlock = kBLOCK_THREADS / a.group;
    int32_t const lane = threadIdx.x % a.group;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * groupsPerBlock;
    int64_t const tasks = static_cast<int64_t>(a.rows) * a.topkCount * a.tbs;
    int32_t const kvVectors = static_cast<int32_t>(a.kvBytes / W);
    int32_t const allVectors = kvVectors + static_cast<int32_t>(a.ropeBytes / W);
    for (int64_t task = static_cast<int64_t>(blockIdx.x) * groupsPerBlock + threadIdx.x / a.group; task < tasks;
         task += stride)
    {
        // Token fastest: neighbouring groups read neighbouring rows of one full block.
        int64_t const slotTask = task / a.tbs;
        int64_t const i = task - slotTask * a.tbs;
        int64_t const r = slotTask / a.topkCount;
        int64_t const j = slotTask - r * a.topkCount;
        int64_t const v = a.plan[slotTask];
        if (v < 0)
        {
            continue; // kept in place, unused slot or skipped row
        }
        int64_t const b = r / a.seqPerBatch;
        RowGeometry const g = rowGeometry(a.kvLen[b], a.seqPerBatch, static_cast<int32_t>(r - b * a.seqPerBatch), a.tbs);
        if (!isValidId(v, g) || i >= idSize(v, g, a.tbs))
        {
            continue;
        }
        int64_t const p = v * a.tbs + i;
        int64_t const fullCol = p / a.fullBlockSize;
        int64_t const q = j * a.tbs + i;
        int64_t const selCol = q / a.selectionBlockSize;
        if (fullCol >= a.fullMaxBlockNum || selCol >= a.selectionMaxBlockNum)
        {
            continue; // an id past the tables: skipped, never read
        }
        int64_t const fullBlock = a.fullTable[b * a.fullMaxBlockNum + fullCol];
        int64_t const selBlock = a.selectionTable[r * a.selectionMaxBlockNum + selCol];
        if (fullBlock < 0 || fullBlock >= a.fullBlockNum || selBlock < 0 || selBlock >= a.selectionBlockNum)
        {
            continue;
        }
        int64_t const srcRow = fullBlock * a.fullBlockSize + (p - fullCol * a.fullBlockSize);
        int64_t const dstRow = selBlock * a.selectionBlockSize + (q - selCol * a.selectionBlockSize);
        char const* kvSrc = a.fullKv + srcRow * a.kvBytes;
        char* kvDst = a.selectionKv + dstRow * a.kvBytes;
        char const* ropeSrc = a.fullRope + srcRow * a.ropeBytes;
        char* ropeDst = a.selectionRope + dstRow * a.ropeBytes;
        // kv vectors then rope vectors, all loads of a lane in flight before its stores
        // (the host path needs many outstanding PCIe reads per thread).
        for (int32_t base = lane; base < allVectors; base += a.group * kUNROLL)
        {
            V buf[kUNROLL];
#pragma unroll
            for (int u = 0; u < kUNROLL; ++u)
            {
                int32_t const idx = base + u * a.group;
                if (idx < allVectors)
                {
                    V const* src = idx < kvVectors
                        ? reinterpret_cast<V const*>(kvSrc) + idx
                        : reinterpret_cast<V const*>(ropeSrc) + (idx - kvVectors);
                    buf[u] = __ldcs(src);
                }
            }
#pragma unroll
            for (int u = 0; u < kUNROLL; ++u)
            {
                int32_t const idx = base + u * a.group;
                if (idx < allVectors)
                {
                    V* dst = idx < kvVectors ? reinterpret_cast<V*>(kvDst) + idx
                                             : reinterpret_cast<V*>(ropeDst) + (idx - kvVectors);
                    *dst = buf[u];
                }
            }
        }
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
    if (p.batch < 0 || p.seqPerBatch < 1 || p.topk < 0 || p.topk > kMAX_TOPK || p.topkBlockSize < 1)
    {
        return invalidArgument("gather: need batch >= 0, seqPerBatch >= 1, 0 <= topk <= 2048, topkBlockSize >= 1");
    }
    if (p.topk > 32 && p.topkBlockSize != 1)
    {
        return invalidArgument("gather: topk > 32 requires topkBlockSize == 1");
    }
    if (p.selectionBlockSize < 1 || p.fullBlockSize < 1 || p.selectionBlockSize % p.topkBlockSize != 0
        || p.fullBlockSize % p.topkBlockSize != 0)
    {
        return invalidArgument("gather: selection and full block sizes must be positive multiples of "
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
        return invalidArgument("gather: selectionMaxBlockNum must be >= ceil(topk * topkBlockSize / "
                               "selectionBlockSize)");
    }
    if (p.selectionBlockNum < 0 || p.fullBlockNum < 0 || p.fullMaxBlockNum < 0 || p.kvDim < 1 || p.kRopeDim < 0)
    {
        return invalidArgument("gather: need block counts >= 0, kvDim >= 1, kRopeDim >= 0");
    }
    // A pointer is required only where its tensor has elements: TensorRT passes null for
    // zero-volume tensors, and an empty cache is never addressed (every table entry is then
    // out of range, so its copies are skipped).
    bool const rows = p.batch > 0;
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
    return cudaSuccess;
}

} // namespace

size_t getGatherSelectionWorkspaceSize(GatherSelectionParams const& params)
{
    return getGatherPlanWorkspaceSize(planEntries(params));
}

size_t getGatherPlanWorkspaceSize(int64_t entries)
{
    if (entries <= 0)
    {
        return 0;
    }
    size_t const bytes = static_cast<size_t>(entries) * sizeof(int32_t);
    return (bytes + 255) / 256 * 256;
}

cudaError_t launchGatherSelectionKvCache(GatherSelectionParams const& params, cudaStream_t stream)
{
    clearLastError();
    cudaError_t const status = checkGather(params);
    if (status != cudaSuccess)
    {
        return status;
    }
    if (params.selectionRows == 0)
    {
        return cudaSuccess;
    }
    int32_t const rows = params.batch * params.seqPerBatch;
    PlanArgs plan{};
    plan.status = params.selectionKvBlockStatus;
    plan.topk = params.selectionTopkIndices;
    plan.kvLen = params.fullKvActualSeq;
    plan.actualSeq = params.selectionKvActualSeq;
    plan.plan = static_cast<int32_t*>(params.workspace);
    plan.seqPerBatch = params.seqPerBatch;
    plan.topkCount = params.topk;
    plan.tbs = params.topkBlockSize;
    plan.rows = rows;
    gatherPlanKernel<<<static_cast<unsigned>(params.selectionRows), kPLAN_THREADS, 0, stream>>>(plan);
    cudaError_t e = recordLaunch(cudaGetLastError(), "gatherPlanKernel");
    if (e != cudaSuccess || planEntries(params) == 0)
    {
        return e;
    }

    CopyArgs c{};
    c.plan = plan.plan;
    c.kvLen = params.fullKvActualSeq;
    c.fullTable = params.fullKvBlockTable;
    c.selectionTable = params.selectionKvBlockTable;
    c.fullKv = static_cast<char const*>(params.fullKvCache);
    c.fullRope = static_cast<char const*>(params.fullKRope);
    c.selectionKv = static_cast<char*>(params.selectionKvCache);
    c.selectionRope = static_cast<char*>(params.selectionKRope);
    int64_t const item = dataTypeSize(params.cacheType);
    c.kvBytes = params.kvDim * item;
    c.ropeBytes = params.kRopeDim * item;
    c.fullBlockNum = params.fullBlockNum;
    c.selectionBlockNum = params.selectionBlockNum;
    c.fullBlockSize = params.fullBlockSize;
    c.fullMaxBlockNum = params.fullMaxBlockNum;
    c.selectionBlockSize = params.selectionBlockSize;
    c.selectionMaxBlockNum = params.selectionMaxBlockNum;
    c.seqPerBatch = params.seqPerBatch;
    c.topkCount = params.topk;
    c.tbs = params.topkBlockSize;
    c.rows = rows;
    int const width = c.ropeBytes > 0
        ? vectorWidth({reinterpret_cast<uint64_t>(c.fullKv), reinterpret_cast<uint64_t>(c.selectionKv),
            static_cast<uint64_t>(c.kvBytes), reinterpret_cast<uint64_t>(c.fullRope),
            reinterpret_cast<uint64_t>(c.selectionRope), static_cast<uint64_t>(c.ropeBytes)})
        : vectorWidth({reinterpret_cast<uint64_t>(c.fullKv), reinterpret_cast<uint64_t>(c.selectionKv),
            static_cast<uint64_t>(c.kvBytes)});
    c.group = groupSize((c.kvBytes + c.ropeBytes) / width);
    int64_t const tasks = planEntries(params) * params.topkBlockSize;
    int64_t const grid = copyGridSize(tasks, c.group);
    return dispatchVectorWidth(width, [&](auto w) {
        gatherCopyKernel<decltype(w)::value><<<static_cast<unsigned>(grid), kBLOCK_THREADS, 0, stream>>>(c);
        return recordLaunch(cudaGetLastError(), "gatherCopyKernel");
    });
}

} // namespace kernels
} // namespace pytrt_kv
