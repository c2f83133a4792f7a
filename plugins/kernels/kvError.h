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

//! The message recorded by the last failing call on this thread ("" after a success).
char const* lastErrorMessage() noexcept;

//! Forget the recorded message (each entry point calls it first).
void clearLastError() noexcept;

} // namespace kernels
} // namespace pytrt_kv
