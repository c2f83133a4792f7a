/*
 * OPS.md G3-G5: the per-row decisions of GatherSelectionKvCache (visible length, valid
 * ids, which ids stay in place, which slot each id takes). Compiled for the GPU (the
 * planning kernel uses the predicates below in parallel) and for the host: planRowHost()
 * is the same placement written sequentially, exported as
 * pytrt_kv_gather_plan_rows_host() and compared with pytrt_kv._gather.plan_row in the
 * CPU tests.
 */
#pragma once

#include "kvHostDevice.h"

#include <cstdint>

namespace pytrt_kv
{
namespace kernels
{

//! OPS.md G3/G4 quantities of one row.
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

//! OPS.md G4: 0 <= v <= max_id (negative entries are padding, larger ones are dropped).
PYTRT_KV_HD bool isValidId(int64_t v, RowGeometry const& g)
{
    return !g.skipped && v >= 0 && v <= g.maxId;
}

//! Tokens of valid id \p v: the last id may be partial.
PYTRT_KV_HD int64_t idSize(int64_t v, RowGeometry const& g, int32_t tbs)
{
    return v == g.maxId ? g.eff - g.maxId * tbs : static_cast<int64_t>(tbs);
}

//! OPS.md G5.1: the old row's partial-tail slot, or -1. \p oldN = non-negative entries
//! of old[0..K-1]; \p oldTotal = old[K].
PYTRT_KV_HD int32_t oldTailSlot(int32_t oldN, int32_t oldTotal, int32_t tbs)
{
    // Only the zero test of the remainder matters, so C++ and Python modulo agree.
    return (tbs > 1 && oldTotal % tbs != 0) ? oldN - 1 : -1;
}

//! OPS.md G5.3: whether slot n-1 is reserved for max_id.
PYTRT_KV_HD bool reservesLastSlot(int32_t tbs, bool maxIdPresent)
{
    return tbs > 1 && maxIdPresent;
}

//! OPS.md G5.2: may valid id \p v, found at old slot \p oldSlot (-1: absent), keep it?
//! \p n = valid ids of the row.
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

//! Result of planning one row on the host (the same fields as pytrt_kv._gather.RowPlan).
struct HostRowPlan
{
    int32_t* status;   //!< [K+1] new status (left as the old one for a skipped row)
    uint8_t* copy;     //!< [K] slot j receives size(status[j]) tokens from the full cache
    int32_t actualSeq; //!< status[K], 0 for skipped rows
    bool skipped;
};

//! Sequential OPS.md G5 placement of one row (host reference of the planning kernel).
//! \p oldStatus [K+1], \p topk [K]; \p scratch needs 2*K ints. \p out.status may alias
//! nothing else. Duplicated ids stay in bounds with an unspecified placement.
inline void planRowHost(int32_t const* oldStatus, int32_t const* topk, int32_t topkCount, int64_t kvLen,
    int32_t seqPerBatch, int32_t s, int32_t tbs, int32_t* scratch, HostRowPlan& out)
{
    int32_t const k = topkCount;
    for (int32_t j = 0; j <= k; ++j)
    {
        out.status[j] = oldStatus[j];
    }
    for (int32_t j = 0; j < k; ++j)
    {
        out.copy[j] = 0;
    }
    RowGeometry const g = rowGeometry(kvLen, seqPerBatch, s, tbs);
    out.skipped = g.skipped;
    out.actualSeq = 0;
    if (g.skipped)
    {
        return;
    }
    int32_t oldN = 0;
    for (int32_t j = 0; j < k; ++j)
    {
        oldN += oldStatus[j] >= 0 ? 1 : 0;
    }
    int32_t const oldTail = oldTailSlot(oldN, oldStatus[k], tbs);
    int32_t n = 0;
    int64_t total = 0;
    int32_t reservedOwner = -1; // first topk position holding max_id
    for (int32_t e = 0; e < k; ++e)
    {
        if (isValidId(topk[e], g))
        {
            ++n;
            total += idSize(topk[e], g, tbs);
            if (topk[e] == g.maxId && reservedOwner < 0)
            {
                reservedOwner = e;
            }
        }
    }
    bool const reserveLast = reservesLastSlot(tbs, reservedOwner >= 0);
    int32_t* pinnedBy = scratch;   // [K] topk position pinned at each slot, -1 = none
    int32_t* slotOf = scratch + k; // [K] slot of each topk position, -1 = not placed yet
    for (int32_t j = 0; j < k; ++j)
    {
        pinnedBy[j] = -1;
        slotOf[j] = -1;
    }
    for (int32_t e = 0; e < k; ++e)
    {
        int64_t const v = topk[e];
        if (!isValidId(v, g) || (reserveLast && e == reservedOwner))
        {
            continue;
        }
        int32_t oldSlot = -1;
        for (int32_t j = 0; j < k && oldSlot < 0; ++j)
        {
            oldSlot = oldStatus[j] == v ? j : -1;
        }
        if (keepInPlace(v, oldSlot, n, oldTail, g, seqPerBatch, tbs, reserveLast) && pinnedBy[oldSlot] < 0)
        {
            pinnedBy[oldSlot] = e;
            slotOf[e] = oldSlot;
        }
    }
    if (reserveLast)
    {
        slotOf[reservedOwner] = n - 1;
    }
    int32_t nextFree = 0;
    for (int32_t e = 0; e < k; ++e)
    {
        if (!isValidId(topk[e], g) || slotOf[e] >= 0)
        {
            continue;
        }
        while (nextFree < n && (pinnedBy[nextFree] >= 0 || (reserveLast && nextFree == n - 1)))
        {
            ++nextFree;
        }
        slotOf[e] = nextFree++;
    }
    for (int32_t j = 0; j < k; ++j)
    {
        out.status[j] = -1;
    }
    for (int32_t e = 0; e < k; ++e)
    {
        int32_t const j = slotOf[e];
        if (j >= 0 && j < n)
        {
            out.status[j] = topk[e];
            out.copy[j] = pinnedBy[j] == e ? 0 : 1;
        }
    }
    out.actualSeq = static_cast<int32_t>(total);
    out.status[k] = out.actualSeq;
}

} // namespace kernels
} // namespace pytrt_kv
