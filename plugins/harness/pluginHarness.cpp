/*
 * pytrt_kv plugin harness: drives both plugins through their creators the way TensorRT
 * does, without libnvinfer (docs/ARCHITECTURE.md, "Verifying without TensorRT").
 *
 *   pytrt_kv_plugin_harness fields          creators, field names/types, defaults, aliases as JSON
 *   pytrt_kv_plugin_harness check           CPU checks: fields as the ONNX parser passes them,
 *                                           serialize round-trip, clone, bad fields refused,
 *                                           formats, output types/shapes, shape validation
 *   pytrt_kv_plugin_harness cases DIR...    CPU: the build/runtime-phase steps of those cases
 *                                           (formats, output types/shapes vs the reference,
 *                                           configure, serialize, re-create, onShapeChange)
 *   pytrt_kv_plugin_harness run DIR...      GPU: enqueue on the cases that plugins/harness/
 *                                           makeCases.py wrote from pytrt_kv.reference, in place
 *                                           and with separate output buffers, bit-exact
 * Exit status 0 when every check passed, 1 otherwise, 2 for a usage or setup error.
 *
 * Layout: mockTrt (what TensorRT provides a plugin), pluginDriver (creators, fields,
 * output/format queries), harnessCheck (expect), shapeCases (the cases of `check`),
 * cpuChecks (`fields`, `check`), gpuRunner (`cases`, `run`), harnessIo (case files).
 */
#include "cpuChecks.h"
#include "gpuRunner.h"
#include "mockTrt.h"
#include "pluginDriver.h"

#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>

int main(int argc, char** argv)
{
    using namespace pytrt_kv::harness;
    setLoggerFinder(&gFinder);
    std::string const cmd = argc > 1 ? argv[1] : "";
    // Refusals are expected during `check`; `run` shows everything the plugins log.
    gLogger.mEcho = cmd == "run" || std::getenv("PYTRT_KV_HARNESS_VERBOSE") != nullptr;
    try
    {
        if (cmd == "fields")
        {
            return commandFields();
        }
        if (cmd == "check")
        {
            return commandCheck();
        }
        if ((cmd == "run" || cmd == "cases") && argc > 2)
        {
            return commandRun(argc, argv, cmd == "run");
        }
    }
    catch (std::exception const& e)
    {
        std::cerr << "harness: " << e.what() << "\n";
        return 2;
    }
    std::cerr << "usage: " << (argc > 0 ? argv[0] : "pytrt_kv_plugin_harness")
              << " fields | check | cases CASE_DIR... | run CASE_DIR...\n";
    return 2;
}
