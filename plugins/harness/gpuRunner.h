/*
 * The harness's case subcommands, on the cases plugins/harness/makeCases.py wrote from
 * pytrt_kv.reference (harnessIo.h): `cases` runs the build- and runtime-phase steps on
 * the CPU (formats, output types/shapes vs the reference, configure, serialize,
 * re-create, onShapeChange); `run` adds enqueue on a GPU, in place and with separate
 * output buffers, compared bit-exact.
 */
#pragma once

#include <cstdint>

namespace pytrt_kv
{
namespace harness
{

//! Runs the case folders argv[2..argc); \p gpu: enqueue too. Returns 0 when every check
//! passed, 1 otherwise, 2 when \p gpu and no CUDA device is present.
int32_t commandRun(int argc, char** argv, bool gpu);

} // namespace harness
} // namespace pytrt_kv
