/*
 * The harness's check bookkeeping: every expect() counts one check and prints the
 * failures; `check` exits non-zero when any failed.
 */
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace pytrt_kv
{
namespace harness
{

//! Checks run and failed so far.
extern int32_t gChecks;
extern int32_t gFailures;

//! Counts one check; prints "FAIL: \p what" when \p ok is false.
void expect(bool ok, std::string const& what);

//! Runs \p f, expecting it to fail with an error logged whose text contains \p needle.
void expectLoggedError(std::function<bool()> const& f, std::string const& needle, std::string const& what);

} // namespace harness
} // namespace pytrt_kv
