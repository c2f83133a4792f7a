/*
 * The one kernel-launch form of the kernels: PYTRT_KV_LAUNCH(name, kernel, grid, block,
 * stream, args...) is kernel<<<grid, block, 0, stream>>>(args...) under nvcc, and a
 * launch on the emulated device (plugins/emu, docs/EMULATION.md) when the same sources
 * are compiled as host C++ there. \p name labels the launch in the emulator's records.
 */
#pragma once

#if defined(PYTRT_KV_EMU)
#define PYTRT_KV_LAUNCH(name, kernel, grid, block, stream, ...)                                                        \
    ::pytrt_kv::emu::launch(name, kernel, grid, block, stream, __VA_ARGS__)
#else
#define PYTRT_KV_LAUNCH(name, kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif
