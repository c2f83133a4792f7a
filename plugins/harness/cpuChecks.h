/*
 * The harness's CPU subcommands: `fields` (the creators' fields as JSON, compared with
 * pytrt_kv/specs.py by tests/test_plugins_harness.py) and `check` (fields as the ONNX
 * parser passes them, serialize round-trip, clone, bad fields refused, formats, output
 * types and shapes, shape validation, empty batches).
 */
#pragma once

#include <cstdint>

namespace pytrt_kv
{
namespace harness
{

//! Prints the creators' fields as JSON; returns the exit status.
int32_t commandFields();

//! Runs every CPU check; returns 0 when all passed, 1 otherwise.
int32_t commandCheck();

} // namespace harness
} // namespace pytrt_kv
