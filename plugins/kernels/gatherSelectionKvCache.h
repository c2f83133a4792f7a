/*
 * GatherSelectionKvCache kernels (docs/SPEC.md section G). No TensorRT types.
 */
#pragma once

#include "kvCommon.h"

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace pytrt_kv
{
namespace kernels
{

//! All arguments of one gather call. H == 1. Rows r in [0, B*S) are addressed; rows
//! r in [B*S, R) of the selection table are not, and their output is 0.
struct GatherSelectionParams
{
    void* selectionKRope{nullptr};                 //!< [S_BLOCK_NUM, SBS, K_ROPE]; nullptr when kRopeDim == 0
    void* selectionKvCache{nullptr};               //!< [S_BLOCK_NUM, SBS, KV]
    int32_t const* selectionKvBlockTable{nullptr}; //!< [R, S_MAX_BLOCK_NUM]
    int32_t* selectionKvBlockStatus{nullptr};      //!< [B*S, K+1] (BSND and TND alike)
    int32_t const* selectionTopkIndices{nullptr};  //!< [B*S, K]
    void const* fullKRope{nullptr};                //!< [F_BLOCK_NUM, FBS, K_ROPE]; may be pinned host memory
    void const* fullKvCache{nullptr};              //!< [F_BLOCK_NUM, FBS, KV]; may be pinned host memory
    int32_t const* fullKvBlockTable{nullptr};      //!< [B, F_MAX_BLOCK_NUM]
    int32_t const* fullKvActualSeq{nullptr};       //!< [B]
    int32_t* selectionKvActualSeq{nullptr};        //!< [R] (output)

    DataType cacheType{DataType::kFLOAT16}; //!< dtype of all four caches

    int32_t batch{0};                //!< B
    int32_t seqPerBatch{0};          //!< S (query tokens per batch)
    int32_t topk{0};                 //!< K (<= 2048, any TBS)
    int32_t topkBlockSize{64};       //!< TBS
    int32_t selectionRows{0};        //!< R (>= B*S)
    int64_t selectionBlockNum{0};    //!< S_BLOCK_NUM
    int32_t selectionBlockSize{0};   //!< SBS
    int32_t selectionMaxBlockNum{0}; //!< S_MAX_BLOCK_NUM
    int64_t fullBlockNum{0};         //!< F_BLOCK_NUM
    int32_t fullBlockSize{0};        //!< FBS
    int32_t fullMaxBlockNum{0};      //!< F_MAX_BLOCK_NUM
    int32_t kRopeDim{0};             //!< K_ROPE elements per row (0: quantised mode, no rope)
    int32_t kvDim{0};                //!< KV elements per row

    void* workspace{nullptr}; //!< device scratch of getGatherSelectionWorkspaceSize() bytes
    size_t workspaceBytes{0};
};

//! Device scratch bytes one call with these sizes needs (depends on sizes only, never
//! on pointers or values), so TensorRT can reserve it at build time: a 256-byte header
//! and one 32-byte miss-list entry per plan entry (B*S*K), rounded up to 256 bytes.
size_t getGatherSelectionWorkspaceSize(GatherSelectionParams const& params);

//! The same for \p planEntries = B*S*K plan entries (the volume of the topk indices),
//! without the other sizes: what the TensorRT plugin reserves from a profile's maxima.
size_t getGatherPlanWorkspaceSize(int64_t planEntries);

//! Enqueue one gather call on \p stream: no host synchronization, no allocation
//! (capturable in a CUDA graph). Status rows and selectionKvActualSeq are written after
//! every copy has read the old status. Ids whose table entries are out of range are
//! skipped, never read. Returns cudaErrorInvalidValue for parameters that break
//! docs/SPEC.md G2's shape rules or a workspace that is too small, else the launch status.
//!
//! Details (docs/SPEC.md G4/G5 where the reference raises and the kernel must not):
//! - A 4-byte memset and two launches on \p stream: a planning kernel (one CTA per table
//!   row, gatherPlan.h: reads the old status row, appends the row's copied ids to a
//!   compacted miss list in the workspace with their source and destination rows
//!   resolved, then writes the new status row and selectionKvActualSeq) and a copy kernel
//!   over (miss, token) tasks only: its work is proportional to the copied tokens. The
//!   copies read only the miss list and the full cache, never the status.
//! - Any TBS with K <= 2048 (the Ascend limit K > 32 => TBS == 1 is lifted).
//! - B*S == 0 (batch 0, or seqPerBatch 0 with batch 0): nothing is copied and no status
//!   is touched; selectionKvActualSeq (R rows) is set to 0, as for every row >= B*S.
//!   R == 0 launches nothing.
//! - Skipped copies: an id whose full-table column is >= F_MAX_BLOCK_NUM, whose full
//!   table entry is outside [0, F_BLOCK_NUM), or whose selection table entry is outside
//!   [0, S_BLOCK_NUM) is not copied (nothing is read or written for it); the placement,
//!   the status row and selectionKvActualSeq are those of docs/SPEC.md G5, as if it had
//!   been.
//! - Duplicated valid ids in a topk row, or a corrupted old status (duplicates, holes):
//!   every write stays inside the row's status and its selection blocks; which slot an
//!   id gets is unspecified.
//! - fullKvCache/fullKRope may be pinned host memory (pass the device address that
//!   cudaHostGetDevicePointer returns; under UVA it equals the host address).
//! - A CUDA error pending on this thread before the call is returned unchanged and left
//!   pending, and nothing is launched (kvError.h refusePendingError).
//! - Errors found by the host checks are also described by lastErrorMessage() (kvError.h).
cudaError_t launchGatherSelectionKvCache(GatherSelectionParams const& params, cudaStream_t stream);

//! The planning step of launchGatherSelectionKvCache run on the host, with host
//! addresses in \p params (same checks, same phase code as the planning kernel, rows one
//! after the other): writes the status rows, selectionKvActualSeq and the workspace's
//! miss list (int32 count at offset 0, MissEntry array at kMISS_LIST_OFFSET; gatherPlan.h).
//! Copies nothing. For the CPU tests.
cudaError_t planGatherOnHost(GatherSelectionParams const& params);

} // namespace kernels
} // namespace pytrt_kv
