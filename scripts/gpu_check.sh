#!/usr/bin/env bash
# One command for a GPU machine: build the kernels, run the GPU tests and the CPU tests,
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over a small workload of
# every kernel path, and the benchmarks. Writes everything under the output folder
# (default ./out):
#   summary.md        step results, device, driver, date (exit status = any failure)
#   benchmarks.md     the Markdown table to paste into BENCHMARKS.md (+ benchmarks.json)
#   *.log             full logs of each step
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# Offline: nothing is downloaded. Needs nvcc (CUDA 12.x/13.x), cmake >= 3.24, python3 with
# numpy, ml_dtypes, torch (CUDA), pytest and hypothesis, and compute-sanitizer. CuPy is
# used by a few tests when installed. Environment:
#   PYTRT_KV_ARCHS=90          CUDA architectures to build (default: the local GPU's;
#                              PYTRT_KV_ARCHS=default builds the package's full list)
#   TensorRT_INCLUDE_DIR=...   also build the TensorRT plugins (their tests need TensorRT)
#   PYTRT_KV_SKIP_BENCH=1      skip the benchmarks
#   PYTHON=python3.12          interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUILD=${PYTRT_KV_BUILD_DIR:-$ROOT/build/gpu-check}  # /build/ is git-ignored
SUMMARY=$OUT/summary.md
failed=0
start_all=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME TIMEOUT_S LOG CMD...: run, time and record one step
  local name=$1 limit=$2 log=$3; shift 3
  local t0 rc
  t0=$(date +%s)
  echo "== $name"
  timeout --kill-after=30 "$limit" "$@" >"$OUT/$log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$log"
  if [ $rc -eq 0 ]; then
    note "| $name | ok | $(( $(date +%s) - t0 )) s | $log |"
  else
    [ $rc -eq 124 ] && echo "(timed out after $limit s)" >>"$OUT/$log"
    note "| $name | **FAILED (rc $rc)** | $(( $(date +%s) - t0 )) s | $log |"
    failed=1
  fi
  return $rc
}

: >"$SUMMARY"
note "# pytrt_kv GPU check"
note ""
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  note "No usable GPU (nvidia-smi failed): nothing to check."
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n1)
note "- GPU: $gpu"
note "- nvcc: $(nvcc --version 2>/dev/null | tail -n 2 | head -n 1)"
note "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note ""
note "| step | result | time | log |"
note "|---|---|---|---|"

# --- build -------------------------------------------------------------------------------
archs=${PYTRT_KV_ARCHS:-}
if [ -z "$archs" ]; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')
  archs=$cap
fi
cmake_args=(-S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release)
[ "$archs" != default ] && cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=$archs")
command -v ninja >/dev/null 2>&1 && cmake_args+=(-G Ninja)
[ -n "${TensorRT_INCLUDE_DIR:-}" ] && cmake_args+=("-DTensorRT_INCLUDE_DIR=$TensorRT_INCLUDE_DIR")
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "CMAKE_CUDA_ARCHITECTURES:STRING=${archs}$" "$BUILD/CMakeCache.txt" 2>/dev/null; then
  [ "$archs" != default ] && rm -rf "$BUILD"
fi
if ! step "configure (archs $archs)" 300 configure.log cmake "${cmake_args[@]}" ||
   ! step "build" 900 build.log cmake --build "$BUILD" -j "$(nproc)"; then
  note ""
  note "Build failed: see $OUT/build.log"
  exit 1
fi
grep -iE "warning" "$OUT/build.log" >"$OUT/build_warnings.log" && \
  note "| build warnings | $(wc -l <"$OUT/build_warnings.log") lines | | build_warnings.log |"

export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTRT_KV_LIB_DIR=$BUILD/lib
"$PY" -m pytrt_kv info >"$OUT/info.log" 2>&1

# --- tests -------------------------------------------------------------------------------
# pytest-xdist, where installed, spreads the tests over the machine's cores.
par=()
"$PY" -c "import xdist" 2>/dev/null && par=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
# GPU tests first (marker gpu): none of them may skip for lack of a GPU or library.
# --device gpu: on the real GPU only (never the emulated device, docs/EMULATION.md).
step "GPU tests (pytest -m 'gpu or real_gpu')" 1500 gpu_tests.log \
  "$PY" -m pytest tests -m "gpu or real_gpu" --device gpu -q -ra -p no:cacheprovider "${par[@]}"
if grep -E "SKIPPED.*(no CUDA GPU|was not built)" "$OUT/gpu_tests.log" >/dev/null; then
  note "| GPU tests ran | **FAILED: GPU tests were skipped** | | gpu_tests.log |"
  failed=1
fi
step "CPU tests (pytest -m 'not gpu and not real_gpu')" 900 cpu_tests.log \
  "$PY" -m pytest tests -m "not gpu and not real_gpu" --device gpu -q -ra -p no:cacheprovider "${par[@]}"

# --- TensorRT plugins through the C++ harness (no libnvinfer needed) ---------------------
if [ -x "$BUILD/bin/pytrt_kv_plugin_harness" ]; then
  step "plugin cases (makeCases.py)" 300 plugin_cases.log \
    "$PY" "$ROOT/plugins/harness/makeCases.py" "$OUT/plugin_cases"
  step "plugin harness check (CPU)" 120 plugin_harness_check.log \
    "$BUILD/bin/pytrt_kv_plugin_harness" check
  step "plugin harness run (GPU enqueue vs reference)" 600 plugin_harness_run.log \
    "$BUILD/bin/pytrt_kv_plugin_harness" run "$OUT"/plugin_cases/*/
  if command -v compute-sanitizer >/dev/null 2>&1; then
    step "compute-sanitizer memcheck: plugin harness" 900 sanitizer_plugins.log \
      compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 50 \
        "$BUILD/bin/pytrt_kv_plugin_harness" run "$OUT"/plugin_cases/*/
  fi
elif [ -n "${TensorRT_INCLUDE_DIR:-}" ]; then
  note "| plugin harness | **FAILED: TensorRT_INCLUDE_DIR set but the harness was not built** | | build.log |"
  failed=1
else
  note "| plugin harness | skipped: set TensorRT_INCLUDE_DIR to build the plugins | | |"
fi
if "$PY" -c "import tensorrt" 2>/dev/null; then
  step "TensorRT tests (pytest -m trt)" 1800 trt_tests.log \
    "$PY" -m pytest tests -m trt -q -ra -p no:cacheprovider
fi

# --- compute-sanitizer ---------------------------------------------------------------------
if command -v compute-sanitizer >/dev/null 2>&1; then
  # synccheck: the planning kernel's barriers and warp shuffles (block scan) must be
  # reached by every thread of a CTA.
  for tool in memcheck racecheck synccheck; do
    step "compute-sanitizer $tool" 600 "sanitizer_$tool.log" \
      compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
        "$PY" "$ROOT/scripts/gpu_workload.py"
  done
  step "compute-sanitizer initcheck" 600 sanitizer_initcheck.log \
    compute-sanitizer --tool initcheck --error-exitcode 99 --print-limit 50 \
      "$PY" "$ROOT/scripts/gpu_workload.py"
else
  note "| compute-sanitizer | **FAILED: not on PATH** | | |"
  failed=1
fi

# --- benchmarks ----------------------------------------------------------------------------
if [ "${PYTRT_KV_SKIP_BENCH:-0}" != 1 ]; then
  step "benchmarks" 900 bench.log \
    "$PY" -m pytrt_kv bench --output "$OUT/benchmarks.md" --json "$OUT/benchmarks.json"
fi

note ""
note "Total: $(( $(date +%s) - start_all )) s. $( [ $failed -eq 0 ] && echo 'All steps passed.' || echo 'Some steps FAILED.')"
[ -f "$OUT/benchmarks.md" ] && note "Benchmark table: $OUT/benchmarks.md (paste into BENCHMARKS.md)."
echo
cat "$SUMMARY"
exit $failed
