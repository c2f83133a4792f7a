#include "harnessCheck.h"

#include "mockTrt.h"

#include <iostream>

namespace pytrt_kv
{
namespace harness
{

int32_t gChecks{0};
int32_t gFailures{0};

void expect(bool ok, std::string const& what)
{
    ++gChecks;
    if (!ok)
    {
        ++gFailures;
        std::cout << "FAIL: " << what << "\n";
    }
}

void expectLoggedError(std::function<bool()> const& f, std::string const& needle, std::string const& what)
{
    int32_t const before = gLogger.mErrors;
    bool const failed = f();
    bool const logged = gLogger.mErrors > before;
    expect(failed && logged && gLogger.mLast.find(needle) != std::string::npos,
        what + " (failed=" + std::to_string(failed) + ", logged=" + std::to_string(logged) + ", last log: '"
            + (logged ? gLogger.mLast : std::string()) + "', wanted '" + needle + "')");
}

} // namespace harness
} // namespace pytrt_kv
