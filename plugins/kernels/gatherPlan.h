/*
 * docs/SPEC.md G3-G5: the planning step of GatherSelectionKvCache, written ONCE for both
 * the GPU and the host. The planning kernel runs the phases below with one CTA per
 * selection-table row (planThreads(K) threads, __syncthreads() between phases); the host
 * entry points of capi.cpp run the very same phase functions for every virtual thread in
 * turn, which is one of the interleavings the GPU may execute. Only the four primitives
 * marked "interleaving" differ (atomics on the GPU, plain read-modify-writes on the host)
 * and the exclusive scan between two phases (warp shuffles on the GPU, a loop on the
 * host); both compute the same values, so the CPU tests check the kernel's algorithm
 * (shared-memory hash, block scan, miss-list compaction), not a second implementation.
 *
 * Output of the plan: the new status row, selection_kv_actual_seq, and a compacted miss
 * list (one MissEntry per id that is copied, addresses resolved), which the copy kernel
 * walks: its work is proportional to the copied tokens, not to B*S*K*TBS.
 */
#pragma once

#include "kvContract.h"
#include "kvHostDevice.h"

#include <climits>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__) || defined(PYTRT_KV_EMU)
#include <cuda_runtime.h>
#endif

namespace pytrt_kv
{
namespace kernels
{

//! docs/SPEC.md G2: largest K (any TBS).
constexpr int32_t kMAX_TOPK = contract::kMAX_TOPK;
//! Most threads of one planning CTA; each owns kPLAN_ITEMS consecutive topk positions and
//! slots. A CTA has planThreads(K) threads: as many as K needs, so that a small K syncs
//! few threads (the emulated device runs each as a fiber) and K = 2048 uses 1024 (on the
//! H200, 256 threads of 8 positions each took twice as long: BENCHMARKS.md).
constexpr int32_t kPLAN_MAX_THREADS = 1024;
constexpr int32_t kPLAN_ITEMS = kMAX_TOPK / kPLAN_MAX_THREADS;
static_assert(kPLAN_ITEMS * kPLAN_MAX_THREADS == kMAX_TOPK, "every topk position has an owner");

//! Threads of the planning CTA for \p k topk positions: ceil(k / kPLAN_ITEMS) rounded up
//! to whole warps, one warp at least, kPLAN_MAX_THREADS at most (k <= kMAX_TOPK).
PYTRT_KV_HD int32_t planThreads(int32_t k)
{
    int32_t const need = k <= 0 ? 1 : (k + kPLAN_ITEMS - 1) / kPLAN_ITEMS;
    int32_t const warps = (need + 31) / 32;
    return warps * 32 > kPLAN_MAX_THREADS ? kPLAN_MAX_THREADS : warps * 32;
}
//! Open-addressing hash of the old status row (load factor <= 1/2).
constexpr int32_t kHASH_SLOTS = 2 * kMAX_TOPK;
constexpr int32_t kHASH_EMPTY = -1;

//! docs/SPEC.md G3/G4 quantities of one row.
struct RowGeometry
{
    bool skipped{true}; //!< kv_len <= 0 or eff <= 0: status untouched, output 0
    int64_t kvLen{0};   //!< full_kv_actual_seq[b]
    int64_t eff{0};     //!< tokens visible to query token s
    int64_t maxId{-1};  //!< ceil(eff / TBS) - 1
};

PYTRT_KV_HD RowGeometry rowGeometry(int64_t kvLen, int32_t seqPerBatch, int32_t s, int32_t tbs)
{
    RowGeometry g;
    g.kvLen = kvLen;
    g.eff = kvLen - (seqPerBatch - 1 - s);
    g.skipped = kvLen <= 0 || g.eff <= 0 || tbs <= 0;
    if (!g.skipped)
    {
        g.maxId = (g.eff + tbs - 1) / tbs - 1;
    }
    return g;
}

//! docs/SPEC.md G4: 0 <= v <= max_id (negative entries are padding, larger ones are dropped).
PYTRT_KV_HD bool isValidId(int64_t v, RowGeometry const& g)
{
    return !g.skipped && v >= 0 && v <= g.maxId;
}

//! Tokens of valid id \p v: the last id may be partial.
PYTRT_KV_HD int64_t idSize(int64_t v, RowGeometry const& g, int32_t tbs)
{
    return v == g.maxId ? g.eff - g.maxId * tbs : static_cast<int64_t>(tbs);
}

//! docs/SPEC.md G5.1: the old row's partial-tail slot, or -1. \p oldN = non-negative
//! entries of old[0..K-1]; \p oldTotal = old[K].
PYTRT_KV_HD int32_t oldTailSlot(int32_t oldN, int32_t oldTotal, int32_t tbs)
{
    // Only the zero test of the remainder matters, so C++ and Python modulo agree.
    return (tbs > 1 && oldTotal % tbs != 0) ? oldN - 1 : -1;
}

//! docs/SPEC.md G5.3: whether slot n-1 is reserved for max_id.
PYTRT_KV_HD bool reservesLastSlot(int32_t tbs, bool maxIdPresent)
{
    return tbs > 1 && maxIdPresent;
}

//! docs/SPEC.md G5.2: may valid id \p v, found at old slot \p oldSlot (-1: absent), keep
//! it? \p n = valid ids of the row.
PYTRT_KV_HD bool keepInPlace(int64_t v, int32_t oldSlot, int32_t n, int32_t oldTail, RowGeometry const& g,
    int32_t seqPerBatch, int32_t tbs, bool reserveLast)
{
    if (oldSlot < 0 || oldSlot >= n || oldSlot == oldTail)
    {
        return false;
    }
    // None of its tokens may be among this step's newest S positions (maybe rewritten).
    if ((v + 1) * tbs > g.kvLen - seqPerBatch)
    {
        return false;
    }
    return !(reserveLast && (oldSlot == n - 1 || v == g.maxId));
}

//! One id copied into one slot: written by the plan, read by the copy kernel. Token i
//! (i < size) of the id goes from full-cache token row srcRow + i to selection-cache token
//! row dstRow + i (an id never straddles a block: FBS and SBS are multiples of TBS).
struct MissEntry
{
    int64_t srcRow; //!< full block * FBS + offset of the id's first token; -1: skipped (G4)
    int64_t dstRow; //!< selection block * SBS + offset of the slot's first token; -1: skipped
    int32_t size;   //!< tokens of the id, size(v) of G4
    int32_t row;    //!< r = b*S + s
    int32_t slot;   //!< j
    int32_t id;     //!< v
};
static_assert(sizeof(MissEntry) == 32, "MissEntry is read with aligned 16-byte loads");

//! Workspace layout: the miss count, then (at kMISS_LIST_OFFSET) up to B*S*K MissEntry.
constexpr size_t kMISS_LIST_OFFSET = 256;

//! Workspace bytes for \p planEntries = B*S*K (0 when there is nothing to plan).
PYTRT_KV_HD size_t gatherWorkspaceBytes(int64_t planEntries)
{
    return planEntries <= 0 ? 0 : kMISS_LIST_OFFSET + static_cast<size_t>(planEntries) * sizeof(MissEntry);
}

//! Everything the plan reads and writes (device addresses on the GPU, host ones on the CPU).
struct PlanArgs
{
    int32_t* status;               //!< [B*S, K+1]
    int32_t const* topk;           //!< [B*S, K]
    int32_t const* kvLen;          //!< [B]
    int32_t* actualSeq;            //!< [R]
    int32_t const* fullTable;      //!< [B, F_MAX_BLOCK_NUM]
    int32_t const* selectionTable; //!< [R, S_MAX_BLOCK_NUM]
    int32_t* missCount;            //!< workspace header; 0 before the plan runs
    MissEntry* misses;             //!< [B*S*K], filled in [0, *missCount)
    int64_t fullBlockNum;
    int64_t selectionBlockNum;
    Divider fullBlockSize;
    Divider selectionBlockSize;
    int32_t fullMaxBlockNum;
    int32_t selectionMaxBlockNum;
    int32_t seqPerBatch;
    int32_t topkCount;
    int32_t tbs;
    int32_t rows; //!< B*S
};

//! The CTA's shared state (a __shared__ variable on the GPU). No initializers: the
//! phases initialize what they use.
struct PlanShared
{
    int32_t keys[kHASH_SLOTS];
    int16_t vals[kHASH_SLOTS];
    int32_t topk[kMAX_TOPK];
    int32_t pinnedBy[kMAX_TOPK];
    int16_t freeSlot[kMAX_TOPK];
    int32_t warpTotals[kPLAN_MAX_THREADS / 32];
    int32_t oldN;
    int32_t validN;
    int32_t reservedOwner;
    int32_t missBase;
    //! Token total of the row: <= K * TBS <= INT32_MAX (checked before any launch), so
    //! a 32-bit shared add (one instruction, not the 64-bit CAS loop).
    int32_t total;
};

//! One thread's registers that live across phases.
struct PlanThread
{
    int32_t pinnedAt[kPLAN_ITEMS]; //!< old slot an item tries to keep, -1 none
    int32_t n;                     //!< valid ids of the row
    int32_t reservedOwner;         //!< topk position of the first max_id, INT_MAX none
    bool reserveLast;
    int32_t needyRank; //!< rank (row-wide, topk order) of the next needy item
    int32_t missRank;  //!< rank of this thread's next miss entry
    int32_t freeCount;
};

//! One row of the plan.
struct PlanRow
{
    int32_t r;
    int32_t b;
    int32_t s;
    RowGeometry g;
    uint32_t hashSlots; //!< power of two >= 2*K (>= 32)
    int32_t threads;    //!< planThreads(K): the CTA's threads, the strides below
};

// --- interleaving primitives --------------------------------------------------------

PYTRT_KV_HD int32_t planAtomicCas(int32_t* p, int32_t expected, int32_t desired)
{
#if defined(__CUDA_ARCH__) || defined(PYTRT_KV_EMU)
    return atomicCAS(p, expected, desired);
#else
    int32_t const old = *p;
    if (old == expected)
    {
        *p = desired;
    }
    return old;
#endif
}

PYTRT_KV_HD int32_t planAtomicAdd(int32_t* p, int32_t x)
{
#if defined(__CUDA_ARCH__) || defined(PYTRT_KV_EMU)
    return atomicAdd(p, x);
#else
    int32_t const old = *p;
    *p = old + x;
    return old;
#endif
}

PYTRT_KV_HD void planAtomicMin(int32_t* p, int32_t x)
{
#if defined(__CUDA_ARCH__) || defined(PYTRT_KV_EMU)
    atomicMin(p, x);
#else
    *p = x < *p ? x : *p;
#endif
}

//! Adds \p x of every thread of the CTA to \p p. On the GPU a warp sums its lanes with
//! shuffles and one lane adds (8 shared atomics a CTA, not 256 on one address); every
//! lane of the warp must call it.
PYTRT_KV_HD void planRowAdd(int32_t* p, int32_t x)
{
#if defined(__CUDA_ARCH__)
#pragma unroll
    for (int32_t d = 16; d > 0; d /= 2)
    {
        x += __shfl_xor_sync(0xffffffffU, x, d);
    }
    if (threadIdx.x % 32 == 0)
    {
        atomicAdd(p, x);
    }
#else
    planAtomicAdd(p, x);
#endif
}

PYTRT_KV_HD uint32_t hashId(int32_t v, uint32_t mask)
{
    return (static_cast<uint32_t>(v) * 2654435761U) & mask;
}

// --- phases -------------------------------------------------------------------------

//! Phase 0 (every thread): the geometry of row \p r, query token \p s of batch \p b.
//! Returns false when the row plans nothing (r >= B*S, or skipped by G3); thread 0 then
//! writes actual_seq = 0 and the CTA is done.
PYTRT_KV_HD bool planBeginAt(PlanArgs const& a, int32_t r, int32_t b, int32_t s, int32_t tid, PlanRow& row)
{
    row.r = r;
    row.b = b;
    row.s = s;
    row.g = RowGeometry{};
    row.hashSlots = 32;
    row.threads = planThreads(a.topkCount);
    if (r < a.rows)
    {
        row.g = rowGeometry(loadGlobal(a.kvLen + b), a.seqPerBatch, s, a.tbs);
    }
    if (r >= a.rows || row.g.skipped)
    {
        if (tid == 0)
        {
            storeGlobal(a.actualSeq + r, int32_t{0}); // rows past B*S are not addressed; skipped rows return 0
        }
        return false;
    }
    while (row.hashSlots < 2U * static_cast<uint32_t>(a.topkCount))
    {
        row.hashSlots *= 2;
    }
    return true;
}

//! Phase 0 of table row \p r (r = b*S + s, docs/SPEC.md G3).
PYTRT_KV_HD bool planBegin(PlanArgs const& a, int32_t r, int32_t tid, PlanRow& row)
{
    int32_t const b = r < a.rows ? r / a.seqPerBatch : 0;
    return planBeginAt(a, r, b, r < a.rows ? r - b * a.seqPerBatch : 0, tid, row);
}

//! Phase 1: empty hash and counters.
PYTRT_KV_HD void planInit(PlanRow const& row, PlanShared& sh, int32_t tid)
{
    for (uint32_t i = static_cast<uint32_t>(tid); i < row.hashSlots; i += static_cast<uint32_t>(row.threads))
    {
        sh.keys[i] = kHASH_EMPTY;
    }
    if (tid == 0)
    {
        sh.oldN = 0;
        sh.validN = 0;
        sh.reservedOwner = INT_MAX;
        sh.total = 0;
        sh.missBase = 0;
    }
}

//! Phase 2: read the old status row and the topk row (all of a thread's loads issued
//! before the first is used), index id -> old slot, count old and valid ids, the total
//! size, and find the first max_id. Every read of the old status happens here.
PYTRT_KV_HD void planLoad(PlanArgs const& a, PlanRow const& row, PlanShared& sh, int32_t tid)
{
    int32_t const k = a.topkCount;
    int32_t const* status = a.status + static_cast<int64_t>(row.r) * (k + 1);
    int32_t const* topk = a.topk + static_cast<int64_t>(row.r) * k;
    uint32_t const mask = row.hashSlots - 1;
    int32_t oldIds[kPLAN_ITEMS];
    int32_t newIds[kPLAN_ITEMS];
    // Strided by the CTA's threads: each of the 2*kPLAN_ITEMS loads is coalesced over the CTA
    // and none waits for another (they used to be one dependent load per hash insert).
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const j = tid + i * row.threads;
        oldIds[i] = j < k ? loadGlobal(status + j) : -1;
        newIds[i] = j < k ? loadGlobal(topk + j) : -1;
    }
    int32_t localOld = 0;
    int32_t localValid = 0;
    long long localTotal = 0;
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const j = tid + i * row.threads;
        if (j >= k)
        {
            continue;
        }
        sh.pinnedBy[j] = -1;
        sh.topk[j] = newIds[i];
        int32_t const v = oldIds[i];
        if (v >= 0)
        {
            ++localOld;
            for (uint32_t h = hashId(v, mask), probe = 0; probe < row.hashSlots; h = (h + 1) & mask, ++probe)
            {
                int32_t const prev = planAtomicCas(&sh.keys[h], kHASH_EMPTY, v);
                if (prev == kHASH_EMPTY)
                {
                    sh.vals[h] = static_cast<int16_t>(j);
                    break;
                }
                if (prev == v)
                {
                    break; // a duplicated old id (corrupted status): either slot is in bounds
                }
            }
        }
        int32_t const e = j;
        int32_t const nv = newIds[i];
        if (isValidId(nv, row.g))
        {
            ++localValid;
            localTotal += idSize(nv, row.g, a.tbs);
            if (nv == row.g.maxId)
            {
                planAtomicMin(&sh.reservedOwner, e);
            }
        }
    }
    planRowAdd(&sh.oldN, localOld);
    planRowAdd(&sh.validN, localValid);
    planRowAdd(&sh.total, static_cast<int32_t>(localTotal));
}

//! Phase 3: which ids stay in place (G5.2). Thread tid owns topk positions and slots
//! [tid*kPLAN_ITEMS, (tid+1)*kPLAN_ITEMS), so "topk order" is thread order + item order.
PYTRT_KV_HD void planPin(
    PlanArgs const& a, PlanRow const& row, PlanShared& sh, PlanThread& t, int32_t tid, int32_t oldTotal)
{
    int32_t const k = a.topkCount;
    uint32_t const mask = row.hashSlots - 1;
    t.n = sh.validN;
    t.reservedOwner = sh.reservedOwner;
    t.reserveLast = reservesLastSlot(a.tbs, t.reservedOwner != INT_MAX);
    int32_t const oldTail = oldTailSlot(sh.oldN, oldTotal, a.tbs);
    int32_t const first = tid * kPLAN_ITEMS;
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const e = first + i;
        t.pinnedAt[i] = -1;
        if (e >= k)
        {
            continue;
        }
        int32_t const v = sh.topk[e];
        if (!isValidId(v, row.g) || (t.reserveLast && e == t.reservedOwner))
        {
            continue;
        }
        int32_t oldSlot = -1;
        for (uint32_t h = hashId(v, mask), probe = 0; probe < row.hashSlots; h = (h + 1) & mask, ++probe)
        {
            int32_t const key = sh.keys[h];
            if (key == v)
            {
                oldSlot = sh.vals[h];
                break;
            }
            if (key == kHASH_EMPTY)
            {
                break;
            }
        }
        if (keepInPlace(v, oldSlot, t.n, oldTail, row.g, a.seqPerBatch, a.tbs, t.reserveLast))
        {
            t.pinnedAt[i] = oldSlot;
            planAtomicCas(&sh.pinnedBy[oldSlot], -1, e); // a duplicated id pins once
        }
    }
}

PYTRT_KV_HD bool planIsKept(PlanShared const& sh, PlanThread const& t, int32_t i, int32_t e)
{
    return t.pinnedAt[i] >= 0 && sh.pinnedBy[t.pinnedAt[i]] == e;
}

PYTRT_KV_HD bool planIsFreeSlot(PlanShared const& sh, PlanThread const& t, int32_t j)
{
    return j < t.n && sh.pinnedBy[j] < 0 && !(t.reserveLast && j == t.n - 1);
}

//! Phase 4a: this thread's ids that need a free slot and its free slots, packed as
//! (needy << 16) | free for one exclusive scan (both counts are <= 2048).
PYTRT_KV_HD int32_t planCount(
    PlanArgs const& a, PlanRow const& row, PlanShared const& sh, PlanThread const& t, int32_t tid)
{
    int32_t const k = a.topkCount;
    int32_t const first = tid * kPLAN_ITEMS;
    int32_t needy = 0;
    int32_t freeSlots = 0;
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const e = first + i;
        if (e < k)
        {
            bool const owner = t.reserveLast && e == t.reservedOwner;
            needy += (isValidId(sh.topk[e], row.g) && !planIsKept(sh, t, i, e) && !owner) ? 1 : 0;
        }
        freeSlots += planIsFreeSlot(sh, t, first + i) ? 1 : 0;
    }
    return (needy << 16) | freeSlots;
}

//! Phase 4b, after the exclusive scan of planCount (\p before for this thread, \p total
//! over the CTA): list the free slots in ascending order, reserve the row's range of the
//! miss list (one atomic per row) and rank this thread's misses inside it.
PYTRT_KV_HD void planFree(PlanArgs const& a, PlanShared& sh, PlanThread& t, int32_t tid, int32_t before, int32_t total)
{
    int32_t const first = tid * kPLAN_ITEMS;
    int32_t freeRank = before & 0xFFFF;
    t.needyRank = before >> 16;
    t.freeCount = total & 0xFFFF;
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        if (planIsFreeSlot(sh, t, first + i))
        {
            sh.freeSlot[freeRank++] = static_cast<int16_t>(first + i);
        }
    }
    // Copied ids = the needy ones plus max_id in its reserved slot; in topk order, this
    // thread's first miss follows the needy ids of earlier threads and max_id if an
    // earlier thread holds it.
    t.missRank = t.needyRank + ((t.reserveLast && t.reservedOwner < first) ? 1 : 0);
    int32_t const rowMisses = (total >> 16) + (t.reserveLast ? 1 : 0);
    if (tid == 0 && rowMisses > 0)
    {
        sh.missBase = planAtomicAdd(a.missCount, rowMisses);
    }
}

//! The block-table entries behind id \p v copied into \p slot of \p row (docs/SPEC.md
//! G4): \p fullBlock / \p selBlock stay -1 when a column is past its table. Loads only,
//! so that planWrite issues every one of a thread's loads before it waits for the first.
PYTRT_KV_HD void planResolveLoad(
    PlanArgs const& a, PlanRow const& row, int32_t slot, int32_t v, int32_t& fullBlock, int32_t& selBlock)
{
    int64_t const fullCol = a.fullBlockSize.div(static_cast<int64_t>(v) * a.tbs);
    int64_t const selCol = a.selectionBlockSize.div(static_cast<int64_t>(slot) * a.tbs);
    fullBlock = -1;
    selBlock = -1;
    if (fullCol < a.fullMaxBlockNum && selCol < a.selectionMaxBlockNum)
    {
        fullBlock = loadGlobal(a.fullTable + static_cast<int64_t>(row.b) * a.fullMaxBlockNum + fullCol);
        selBlock = loadGlobal(a.selectionTable + static_cast<int64_t>(row.r) * a.selectionMaxBlockNum + selCol);
    }
}

//! The miss entry of id \p v copied into \p slot, from planResolveLoad's table entries:
//! srcRow/dstRow stay -1 when a column or a table entry is out of range (skipped).
PYTRT_KV_HD MissEntry planResolve(
    PlanArgs const& a, PlanRow const& row, int32_t slot, int32_t v, int64_t fullBlock, int64_t selBlock)
{
    MissEntry m{-1, -1, static_cast<int32_t>(idSize(v, row.g, a.tbs)), row.r, slot, v};
    if (fullBlock < 0 || fullBlock >= a.fullBlockNum || selBlock < 0 || selBlock >= a.selectionBlockNum)
    {
        return m; // an id past the tables or a bad table entry: skipped, never read
    }
    m.srcRow = fullBlock * a.fullBlockSize.divisor + a.fullBlockSize.mod(static_cast<int64_t>(v) * a.tbs);
    m.dstRow = selBlock * a.selectionBlockSize.divisor + a.selectionBlockSize.mod(static_cast<int64_t>(slot) * a.tbs);
    return m;
}

//! Phase 5: write the new status row, actual_seq and this thread's miss entries. Slots
//! n..K-1 become -1; slots 0..n-1 are each written by exactly one id (for well-formed
//! input). Every reserved miss rank is written, so the copy kernel never reads an entry
//! the plan did not write (an id that found no slot, possible only with duplicated ids,
//! writes a skipped entry).
PYTRT_KV_HD void planWrite(PlanArgs const& a, PlanRow const& row, PlanShared const& sh, PlanThread& t, int32_t tid)
{
    int32_t const k = a.topkCount;
    int32_t* status = a.status + static_cast<int64_t>(row.r) * (k + 1);
    int32_t const first = tid * kPLAN_ITEMS;
    // Three passes: the slots (shared memory only), then every block-table load, then
    // every store. The loads of all items are in flight together (one item's load used
    // to wait behind the previous item's branch on its result), and none is issued after
    // a status or miss-list store (the compiler cannot prove that they do not alias; the
    // contract refuses such overlap). Per item: statusSlot < 0 writes no status, missed
    // says whether a miss entry follows, slot >= 0 that it has a slot to resolve.
    int32_t statusSlot[kPLAN_ITEMS];
    int32_t slots[kPLAN_ITEMS];
    bool missed[kPLAN_ITEMS];
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        int32_t const e = first + i;
        statusSlot[i] = -1;
        slots[i] = -1;
        missed[i] = false;
        if (e >= k)
        {
            continue;
        }
        int32_t const v = sh.topk[e];
        if (!isValidId(v, row.g))
        {
            continue;
        }
        if (planIsKept(sh, t, i, e))
        {
            statusSlot[i] = t.pinnedAt[i];
            continue;
        }
        int32_t slot = -1;
        if (t.reserveLast && e == t.reservedOwner)
        {
            slot = t.n - 1;
        }
        else if (t.needyRank < t.freeCount)
        {
            slot = sh.freeSlot[t.needyRank++];
        }
        missed[i] = true;
        if (slot >= 0 && slot < k)
        {
            statusSlot[i] = slot;
            slots[i] = slot;
        }
    }
    int32_t fullBlock[kPLAN_ITEMS];
    int32_t selBlock[kPLAN_ITEMS];
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        fullBlock[i] = -1;
        selBlock[i] = -1;
        if (slots[i] >= 0)
        {
            planResolveLoad(a, row, slots[i], sh.topk[first + i], fullBlock[i], selBlock[i]);
        }
    }
    for (int32_t j = t.n + tid; j < k; j += row.threads)
    {
        storeGlobal(status + j, int32_t{-1});
    }
    PYTRT_KV_UNROLL
    for (int32_t i = 0; i < kPLAN_ITEMS; ++i)
    {
        if (statusSlot[i] >= 0)
        {
            storeGlobal(status + statusSlot[i], sh.topk[first + i]);
        }
        if (missed[i])
        {
            int32_t const v = sh.topk[first + i];
            MissEntry const miss = slots[i] >= 0 ? planResolve(a, row, slots[i], v, fullBlock[i], selBlock[i])
                                                 : MissEntry{-1, -1, 0, row.r, -1, v};
            storeGlobal(a.misses + sh.missBase + t.missRank++, miss);
        }
    }
    if (tid == 0)
    {
        int32_t const total = sh.total;
        storeGlobal(status + k, total);
        storeGlobal(a.actualSeq + row.r, total);
    }
}

//! The whole plan of table row \p r (query token \p s of batch \p b) on the host: the
//! phases above for every virtual thread in turn, the scan as a loop. \p sh and
//! \p threads (kPLAN_MAX_THREADS entries) are caller-provided scratch.
inline void planRowOnHost(PlanArgs const& a, int32_t r, int32_t b, int32_t s, PlanShared& sh, PlanThread* threads)
{
    PlanRow row{};
    if (!planBeginAt(a, r, b, s, 0, row))
    {
        return;
    }
    for (int32_t tid = 0; tid < row.threads; ++tid)
    {
        planInit(row, sh, tid);
    }
    int32_t const oldTotal = a.status[static_cast<int64_t>(r) * (a.topkCount + 1) + a.topkCount];
    for (int32_t tid = 0; tid < row.threads; ++tid)
    {
        planLoad(a, row, sh, tid);
    }
    for (int32_t tid = 0; tid < row.threads; ++tid)
    {
        planPin(a, row, sh, threads[tid], tid, oldTotal);
    }
    int32_t packed[kPLAN_MAX_THREADS];
    int32_t total = 0;
    for (int32_t tid = 0; tid < row.threads; ++tid)
    {
        int32_t const x = planCount(a, row, sh, threads[tid], tid);
        packed[tid] = total;
        total += x;
    }
    for (int32_t tid = 0; tid < row.threads; ++tid)
    {
        planFree(a, sh, threads[tid], tid, packed[tid], total);
    }
    for (int32_t tid = 0; tid < row.threads; ++tid)
    {
        planWrite(a, row, sh, threads[tid], tid);
    }
}

} // namespace kernels
} // namespace pytrt_kv
