/*
 * C ABI of libpytrt_kv_kernels.so (used by pytrt_kv/ops.py through ctypes). Every
 * function returns a cudaError_t value (0 = success) unless stated otherwise; the
 * reason of a refusal is in pytrt_kv_get_last_error(). Nothing here throws or aborts.
 */
#pragma once

#include "gatherSelectionKvCache.h"
#include "kvContract.h"
#include "scatterPaKvCache.h"

#include <cstddef>
#include <cstdint>

#define PYTRT_KV_API extern "C" __attribute__((visibility("default")))

//! Library version as major * 10000 + minor * 100 + patch (kvContract.h kVERSION_NUMBER).
PYTRT_KV_API int32_t pytrt_kv_version(void);

//! Bumped whenever ScatterParams or GatherSelectionParams change layout (kABI_VERSION).
PYTRT_KV_API int32_t pytrt_kv_abi_version(void);

//! Message of the last refusal or launch failure on this thread ("" if none).
PYTRT_KV_API char const* pytrt_kv_get_last_error(void);

//! cudaGetErrorString of \p code.
PYTRT_KV_API char const* pytrt_kv_error_string(int32_t code);

//! Layout of the Params structs, for the ctypes mirror's test: \p which 0 = ScatterParams,
//! 1 = GatherSelectionParams; writes sizeof then each field's offset in declaration order
//! into \p out (capacity \p capacity); returns the number of values, or -1.
PYTRT_KV_API int32_t pytrt_kv_params_layout(int32_t which, int64_t* out, int32_t capacity);

//! launchScatterPaKvCache on \p stream (a cudaStream_t); \p device >= 0 makes that device
//! current for the launch and restores the caller's afterwards.
PYTRT_KV_API int32_t pytrt_kv_scatter_pa_kv_cache(
    pytrt_kv::kernels::ScatterParams const* params, void* stream, int32_t device);

//! getGatherSelectionWorkspaceSize.
PYTRT_KV_API size_t pytrt_kv_gather_workspace_size(pytrt_kv::kernels::GatherSelectionParams const* params);

//! launchGatherSelectionKvCache (see pytrt_kv_scatter_pa_kv_cache for \p device).
PYTRT_KV_API int32_t pytrt_kv_gather_selection_kv_cache(
    pytrt_kv::kernels::GatherSelectionParams const* params, void* stream, int32_t device);

//! What \p ptr is: \p kind 0 = unregistered host memory, 1 = pinned host, 2 = device,
//! 3 = managed; \p device its device (-1 for unregistered host memory); \p devicePtr
//! the address a kernel must use (for pinned host memory: cudaHostGetDevicePointer).
PYTRT_KV_API int32_t pytrt_kv_pointer_info(void const* ptr, int32_t* kind, int32_t* device, void** devicePtr);

//! cudaMalloc of \p bytes on \p device (the caller's device is restored); for the
//! eager API's cached workspaces and outputs when no framework allocator is at hand.
PYTRT_KV_API int32_t pytrt_kv_device_malloc(size_t bytes, int32_t device, void** ptr);

//! cudaFree (synchronizes the device; never call it during graph capture).
PYTRT_KV_API int32_t pytrt_kv_device_free(void* ptr, int32_t device);

//! Copy \p bytes between any two addresses (device, pinned or pageable host; direction
//! inferred through unified addressing), ordered on \p stream, and wait for it.
//! validate=True reads index values back this way; tests upload with it.
PYTRT_KV_API int32_t pytrt_kv_copy(void* dst, void const* src, size_t bytes, void* stream, int32_t device);

//! cudaHostRegister(\p ptr, \p bytes, Mapped | Portable | \p extraFlags): pins host
//! memory (e.g. a NumPy full cache) so that the gather kernel can read it.
PYTRT_KV_API int32_t pytrt_kv_host_register(void* ptr, size_t bytes, uint32_t extraFlags);

//! cudaHostUnregister.
PYTRT_KV_API int32_t pytrt_kv_host_unregister(void* ptr);

//! Host run of the planning kernel's code (gatherPlan.h) over \p rows independent rows,
//! for the CPU tests. oldStatus/newStatus [rows, K+1], topk [rows, K], kvLen and s [rows]
//! (per row), copy [rows, K] (0/1: the slots of the row's miss list), actualSeq and
//! skipped [rows]. Returns 0, or cudaErrorInvalidValue for K outside [0, kMAX_TOPK], S < 1,
//! TBS < 1 or s[r] outside [0, S).
PYTRT_KV_API int32_t pytrt_kv_gather_plan_rows_host(int32_t rows, int32_t topk, int32_t seqPerBatch,
    int32_t topkBlockSize, int32_t const* oldStatus, int32_t const* topkIndices, int32_t const* kvLen, int32_t const* s,
    int32_t* newStatus, uint8_t* copy, int32_t* actualSeq, uint8_t* skipped);

//! The planning step of pytrt_kv_gather_selection_kv_cache run on the host with HOST
//! addresses in \p params (kernels::planGatherOnHost: the same checks and the same phase
//! code as the planning kernel): writes the status rows, selectionKvActualSeq and the
//! miss list in \p params->workspace (int32 count at byte 0, 32-byte entries
//! {int64 srcRow, int64 dstRow, int32 size, row, slot, id} from byte 256). No copy.
PYTRT_KV_API int32_t pytrt_kv_gather_plan_host(pytrt_kv::kernels::GatherSelectionParams const* params);

//! Host run of scatterRows.h for one (b, h) run: source token of each of the \p maxSeqLen
//! possible rows (-1 none, -2 the rope mean); returns the number of rows written.
PYTRT_KV_API int32_t pytrt_kv_compress_rows_host(
    int32_t mode, int64_t seqLen, int64_t width, int64_t offset, int32_t maxSeqLen, int32_t* source);
