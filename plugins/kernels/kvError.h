/*
 * Why the last host-side check of this thread refused a call (the kernels return
 * cudaErrorInvalidValue; this says which rule broke). Never throws.
 */
#pragma once

#include <cuda_runtime_api.h>

namespace pytrt_kv
{
namespace kernels
{

//! Record \p message for this thread and return cudaErrorInvalidValue.
cudaError_t invalidArgument(char const* message) noexcept;

//! Record the launch status \p e (with \p where) when it is an error; returns \p e.
cudaError_t recordLaunch(cudaError_t e, char const* where) noexcept;

//! Call before the first CUDA call of a launch. A CUDA error already pending on this
//! thread (left by earlier, unrelated work; sticky or not) is returned as is and
//! described as "\p op: not launched: ...", and it is NOT cleared (cudaPeekAtLastError):
//! it belongs to the code that caused it. Nothing is launched then, so the
//! cudaGetLastError() after each of our launches only ever reports our own launch.
//! Returns cudaSuccess when nothing is pending.
cudaError_t refusePendingError(char const* op) noexcept;

//! The message recorded by the last failing call on this thread ("" after a success).
char const* lastErrorMessage() noexcept;

//! Forget the recorded message (each entry point calls it first).
void clearLastError() noexcept;

} // namespace kernels
} // namespace pytrt_kv
