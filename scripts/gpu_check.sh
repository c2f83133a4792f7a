#!/usr/bin/env bash
# The whole GPU check in one command that fits the lent GPU machine's 10-minute limit
# (issue 36; BENCHMARKS.md "GPU check"): build the kernels for the local GPU only, the GPU
# tests of ops / quantise / aliasing, the e4m3 NaN cases, compute-sanitizer over a small
# workload, the benchmarks. Steps run in that order (value per second), each under its own
# time limit and all under one budget; OUT_DIR/summary.md (step, status, seconds, device,
# driver, date, commit) is rewritten after every step, so it is there even when a step
# fails, times out, or the whole command is killed.
#
#   bash scripts/gpu_check.sh [--dry-run] [--steps a,b,...] [--budget S] [OUT_DIR]
#
#   --dry-run    the rehearsal, without a GPU: each step's small version on the emulated
#                device (PYTRT_KV_DEVICE=emu, docs/EMULATION.md); what needs a GPU is marked
#                "simulated" with the reason (never silently skipped)
#   --steps      run only these steps (the others are listed as "not selected"); the build
#                runs anyway when the kernel library is missing (a fresh machine)
#   --budget S   seconds for the whole run (default 420: the device command's timeout_s
#                below, less 30 s for the summary); a step gets min(its limit, what is left)
#   OUT_DIR      default ./out; on the device machine "$OUT" (what is under it comes back)
#
# Steps: build, gpu-tests, e4m3-nan, memcheck, racecheck, synccheck, bench-scatter,
# bench-gather, bench-quant, initcheck, plugin-harness (the TensorRT plugins' enqueue
# through plugins/harness, without libnvinfer: only where TensorRT_INCLUDE_DIR names
# TensorRT headers, e.g. a carried .venv-test/trt-headers/include; else skipped, saying
# so), profile (ncu over scripts/gpu_profile.py, the benchmark's gather and quantise
# shapes: speed of light, stall reasons, the source lines they fall on; the kernels are
# built with -lineinfo for it and for the sanitizers' reports). Logs: OUT_DIR/<step>.log; benchmark tables:
# OUT_DIR/bench-<op>.md and .json (paste into BENCHMARKS.md); everything in two files
# whose names sort first (the device returns at most 8 files): OUT_DIR/all-logs.txt (the
# summary, the logs, the tables) and OUT_DIR/all.tar.gz (every file). Exit status 0 when every
# step passed (or was simulated in a dry run), 1 when one failed or timed out, 2 when there
# is no GPU (without --dry-run).
#
# The lent machine (H100/H200, issue 36): nvcc, CMake, ninja, python3 with torch (CUDA),
# CuPy, Triton, numpy, ml_dtypes, onnx, pytest, hypothesis, compute-sanitizer; no
# TensorRT and no package index: nothing here installs anything. The exact `run` call the
# first session with a GPU makes (repository root on the device machine; 450 s leaves
# about 5 minutes of the 15 for the machine's start and one rerun of what failed):
#
#   run(command="PYTRT_KV_COMMIT=<git rev-parse --short HEAD> bash scripts/gpu_check.sh --budget 420 \"$OUT\"", timeout_s=450, carry=["build/pycarry"])
#
# (<...> filled in by the session: the copy there has no .git; build/pycarry holds
# onnx_graphsurgeon, which that machine lacks: docs/GPU_CHECK.md fills it) and a rerun of
# what failed:
#   run(command="PYTRT_KV_COMMIT=<...> bash scripts/gpu_check.sh --budget 200 --steps gpu-tests,bench-gather \"$OUT\"", timeout_s=230, carry=["build/pycarry"])
#
# Environment:
#   PYTHON                  interpreter (default python3)
#   PYTRT_KV_COMMIT         the commit named in the summary where there is no .git
#   PYTRT_KV_ARCH           CUDA architecture to build (default: nvidia-smi's compute_cap,
#                           else 90)
#   PYTRT_KV_BUILD_DIR      build folder (default build/gpu-check, build/gpu-check-dry)
#   PYTRT_KV_CHECK_SAMPLE   dry run: every Nth GPU test (default 25)
#   PYTRT_KV_CHECK_FAIL     steps made to fail (comma list): tests of this script
#   PYTRT_KV_CHECK_HANG     steps made to hang past their limit, which is then at most
#                           PYTRT_KV_CHECK_HANG_LIMIT s (default 2): tests of this script
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

STEPS=(build gpu-tests e4m3-nan memcheck racecheck synccheck bench-scatter bench-gather
  bench-quant initcheck plugin-harness profile)
# Per-step limits (s) on the GPU; the projection behind them and the times an H200 took
# (2026-11-27) are in docs/GPU_CHECK.md.
declare -A LIMIT=([build]=150 [gpu-tests]=150 [e4m3-nan]=60 [memcheck]=90 [racecheck]=90
  [synccheck]=90 [bench-scatter]=120 [bench-gather]=120 [bench-quant]=90 [initcheck]=90
  [plugin-harness]=120 [profile]=120)
declare -A STATUS=() SECS=() NOTE=()

DRY=0
BUDGET=420
SELECTED=""
OUT_ARG=""
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --steps) SELECTED=${2:?--steps needs a comma list}; shift ;;
    --steps=*) SELECTED=${1#--steps=} ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --budget=*) BUDGET=${1#--budget=} ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 64 ;;
    *) OUT_ARG=$1 ;;
  esac
  shift
done
if ! [[ $BUDGET =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 10 ]; then
  echo "gpu_check.sh: --budget: expected whole seconds >= 10, got '$BUDGET'" >&2
  exit 64
fi
FAIL_STEPS=${PYTRT_KV_CHECK_FAIL:-}
HANG_STEPS=${PYTRT_KV_CHECK_HANG:-}
for s in ${SELECTED//,/ } ${FAIL_STEPS//,/ } ${HANG_STEPS//,/ }; do
  [[ " ${STEPS[*]} " == *" $s "* ]] || {
    echo "gpu_check.sh: unknown step '$s' (steps: ${STEPS[*]})" >&2
    exit 64
  }
done

OUT=${OUT_ARG:-./out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.md
PY=${PYTHON:-python3}
# Pure-Python packages the lent machine lacks (it has no package index), carried in
# build/pycarry: onnx_graphsurgeon, which the CLI (`pytrt_kv info`, `pytrt_kv bench`)
# imports through onnx_export. docs/GPU_CHECK.md gives the command that fills it.
PYCARRY="none (no build/pycarry)"
if [ -d "$ROOT/build/pycarry" ]; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/build/pycarry
  PYCARRY="build/pycarry ($(cd "$ROOT/build/pycarry" && ls | paste -sd' ' -))"
fi
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
# The device machine gets a copy of the work tree whose .git, where there is one, is not
# the session's (the H200 runs of 2026-11-27 read an older commit from it): the run
# command names the commit (PYTRT_KV_COMMIT=$(git rev-parse --short HEAD), expanded where
# it is typed), and that name wins over git.
if [ -n "${PYTRT_KV_COMMIT:-}" ]; then
  COMMIT="$PYTRT_KV_COMMIT (named by PYTRT_KV_COMMIT)"
elif COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT (+ uncommitted changes)"
else
  COMMIT="unknown (no git here: set PYTRT_KV_COMMIT)"
fi
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')

# --- where we run ---------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  MODE="dry run (rehearsal without a GPU, emulated device)"
  DEVICE="emulated device (PYTRT_KV_DEVICE=emu, H100-like, docs/EMULATION.md)"
  DRIVER="none (no GPU)"
  ARCH=${PYTRT_KV_ARCH:-90}
  BUILD=${PYTRT_KV_BUILD_DIR:-$ROOT/build/gpu-check-dry}
  export PYTRT_KV_DEVICE=emu
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  MODE="GPU run"
  q=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n1)
  DEVICE=$(echo "$q" | cut -d, -f1 | xargs)
  DRIVER=$(echo "$q" | cut -d, -f2 | xargs)
  cap=$(echo "$q" | cut -d, -f3 | tr -d ' .')
  [[ $cap =~ ^[0-9]+$ ]] || cap=90  # an older nvidia-smi without compute_cap
  ARCH=${PYTRT_KV_ARCH:-$cap}
  BUILD=${PYTRT_KV_BUILD_DIR:-$ROOT/build/gpu-check}
  unset PYTRT_KV_DEVICE
else
  MODE="GPU run: no usable GPU (nvidia-smi failed); use --dry-run for the rehearsal"
  DEVICE="none"
  DRIVER="none"
  ARCH=${PYTRT_KV_ARCH:-90}
  BUILD=${PYTRT_KV_BUILD_DIR:-$ROOT/build/gpu-check}
fi
NVCC=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo "not found")
SAN=$(command -v compute-sanitizer || true)

render_summary() {  # the whole summary.md, from what is known now
  local s total=$(( $(date +%s) - T0 )) failed=0
  {
    echo "# pytrt_kv GPU check"
    echo
    echo "- mode: $MODE"
    echo "- device: $DEVICE; driver: $DRIVER; built for sm_$ARCH (nvcc $NVCC)"
    echo "- date: $DATE; commit: $COMMIT"
    echo "- budget: $BUDGET s; elapsed: $total s"
    echo "- carried Python packages: $PYCARRY"
    echo
    echo "| step | status | seconds | limit | log | note |"
    echo "|---|---|---|---|---|---|"
    for s in "${STEPS[@]}"; do
      echo "| $s | ${STATUS[$s]:-not reached} | ${SECS[$s]:-} | ${LIMIT[$s]} | $s.log | ${NOTE[$s]:-} |"
      case ${STATUS[$s]:-} in FAILED* | TIMEOUT*) failed=1 ;; esac
    done
    echo
    if [ $failed = 1 ]; then echo "Result: some steps FAILED or timed out (see their logs)."
    else echo "Result: no step failed."; fi
  } >"$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
  bundle
}
# The device returns at most 8 files from $OUT (call 7 of the first H200 run lost
# summary.md and every log): OUT/all-logs.txt (the summary, then every step's log and the
# benchmark tables) and OUT/all.tar.gz (every file of OUT) are rewritten with the summary.
# Their names sort before every other file's.
bundle() {
  local f s
  {
    cat "$SUMMARY"
    for s in "${STEPS[@]}"; do
      f=$OUT/$s.log
      [ -f "$f" ] || continue
      printf '\n===== %s.log =====\n' "$s"
      tail -c 2000000 "$f"
    done
    for f in "$OUT"/bench-*.md; do
      [ -f "$f" ] || continue
      printf '\n===== %s =====\n' "${f##*/}"
      cat "$f"
    done
  } >"$OUT/all-logs.txt.tmp" && mv "$OUT/all-logs.txt.tmp" "$OUT/all-logs.txt"
  tar -czf "$OUT/.all.tar.gz.tmp" -C "$OUT" --exclude='./.*' --exclude=./all.tar.gz . 2>/dev/null &&
    mv "$OUT/.all.tar.gz.tmp" "$OUT/all.tar.gz"
}
STEP_PID=""
on_signal() {
  # Stop the running step (its `timeout` passes the signal on to everything it started).
  if [ -n "$STEP_PID" ]; then
    kill -TERM "$STEP_PID" 2>/dev/null
    wait "$STEP_PID" 2>/dev/null
    # `timeout` leads its own process group: whatever of the step outlived it goes too.
    kill -KILL -- "-$STEP_PID" 2>/dev/null
  fi
  for s in "${STEPS[@]}"; do
    [ "${STATUS[$s]:-}" = running ] && STATUS[$s]="TIMEOUT (the whole command was stopped)"
  done
  render_summary
  exit 1
}
trap on_signal TERM INT

selected() { [ -z "$SELECTED" ] || [[ ",$SELECTED," == *",$1,"* ]]; }
listed() { [[ ",$2," == *",$1,"* ]]; }

# run_step NAME FUNCTION: the step's body runs in a child bash (so that `timeout` can stop
# it and everything it started) with its output in OUT/NAME.log; the body may write
# "simulated: why" (a dry-run stand-in) or a note to OUT/.NAME.status / .NAME.note.
run_step() {
  local name=$1 fn=$2 limit=${LIMIT[$1]} left rc t0
  if ! selected "$name" && ! { [ "$name" = build ] && [ ! -f "$BUILD/lib/libpytrt_kv_kernels.so" ] && [ $DRY = 0 ]; }; then
    STATUS[$name]="not selected"; render_summary; return 0
  fi
  if [ -n "${BLOCKED:-}" ]; then
    STATUS[$name]="not run: $BLOCKED"; render_summary; return 0
  fi
  left=$((DEADLINE - $(date +%s)))
  if [ $left -lt 10 ]; then
    STATUS[$name]="not run: budget spent ($left s left of $BUDGET)"; render_summary; return 0
  fi
  [ $limit -gt $((left - 5)) ] && limit=$((left - 5))
  local cmd=(bash -c "$(declare -f); $fn")
  if listed "$name" "${PYTRT_KV_CHECK_FAIL:-}"; then
    cmd=(bash -c "echo 'forced failure (PYTRT_KV_CHECK_FAIL=$name)'; exit 3")
  elif listed "$name" "${PYTRT_KV_CHECK_HANG:-}"; then
    [ "${PYTRT_KV_CHECK_HANG_LIMIT:-2}" -lt $limit ] && limit=${PYTRT_KV_CHECK_HANG_LIMIT:-2}
    cmd=(bash -c "echo 'forced hang (PYTRT_KV_CHECK_HANG=$name)'; sleep 600")
  fi
  rm -f "$OUT/.$name.status" "$OUT/.$name.note"
  STATUS[$name]=running; render_summary
  echo "== $name (limit $limit s)"
  t0=$(date +%s)
  # In the background with `wait`, so that a TERM to this script is handled at once.
  STEP=$name timeout --kill-after=10 "$limit" "${cmd[@]}" >"$OUT/$name.log" 2>&1 </dev/null &
  STEP_PID=$!
  wait "$STEP_PID"
  rc=$?
  kill -KILL -- "-$STEP_PID" 2>/dev/null  # anything the step left running (its group)
  STEP_PID=""
  SECS[$name]=$(( $(date +%s) - t0 ))
  [ -f "$OUT/.$name.note" ] && NOTE[$name]=$(tr '|' '/' <"$OUT/.$name.note" | paste -sd';' | sed 's/;\([^ ]\)/; \1/g')
  if [ $rc = 0 ]; then
    STATUS[$name]=$(cat "$OUT/.$name.status" 2>/dev/null || echo ok)
  elif [ $rc = 124 ] || [ $rc = 137 ]; then
    STATUS[$name]="TIMEOUT after $limit s"
    echo "(stopped after its limit of $limit s)" >>"$OUT/$name.log"
  else
    STATUS[$name]="FAILED (rc $rc)"
  fi
  rm -f "$OUT/.$name.status" "$OUT/.$name.note"
  tail -n 8 "$OUT/$name.log"
  echo "-- $name: ${STATUS[$name]} (${SECS[$name]} s)"
  render_summary
}

export ROOT OUT PY BUILD ARCH DRY SAN
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
[ $DRY = 0 ] && export PYTRT_KV_LIB_DIR=$BUILD/lib

# --- step bodies (run by run_step in a child bash; STEP is the step's name) ----------------

pytest_tail() {  # the counts line of a pytest log, as a note
  grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$OUT/$STEP.log" | tail -n1 |
    tr -d '=' | xargs >>"$OUT/.$STEP.note"
}

step_build() {
  set -e
  local gen="Unix Makefiles" one
  command -v ninja >/dev/null 2>&1 && gen=Ninja
  local args=(-S "$ROOT" -B "$BUILD" -G "$gen" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_CUDA_ARCHITECTURES=$ARCH-real" "-DCMAKE_CUDA_FLAGS=-lineinfo")
  # With TensorRT headers the plugins and their harness are built too (plugin-harness).
  [ -n "${TensorRT_INCLUDE_DIR:-}" ] && [ "$DRY" = 0 ] &&
    args+=("-DTensorRT_INCLUDE_DIR=$TensorRT_INCLUDE_DIR")
  # The CLI (`pytrt_kv info` below, `pytrt_kv bench`) imports onnx_graphsurgeon through
  # onnx_export; the lent machine has none and no index: say how to carry it.
  "$PY" -c "import onnx_graphsurgeon" || {
    echo "onnx_graphsurgeon does not import: the CLI (pytrt_kv info, bench) needs it." \
      "Carry it (docs/GPU_CHECK.md): where it is installed run"
    echo "  mkdir -p build/pycarry && cp -r .venv-test/lib/python3*/site-packages/onnx_graphsurgeon build/pycarry/"
    echo "and name build/pycarry in the run call's carry."
    exit 1
  }
  for tool in nvcc cmake; do
    command -v $tool >/dev/null 2>&1 && continue
    [ "$DRY" = 1 ] || { echo "$tool is not on PATH"; exit 1; }
    echo "simulated: no $tool here, nothing compiled" >"$OUT/.$STEP.status"
    exit 0
  done
  # A folder configured for another architecture or generator starts from scratch.
  if [ -f "$BUILD/CMakeCache.txt" ] && ! {
    grep -qE "^CMAKE_CUDA_ARCHITECTURES:[A-Z]+=$ARCH-real\$" "$BUILD/CMakeCache.txt" &&
      grep -qx "CMAKE_GENERATOR:INTERNAL=$gen" "$BUILD/CMakeCache.txt"
  }; then
    rm -rf "$BUILD"
  fi
  cmake "${args[@]}"
  if [ "$DRY" = 1 ]; then
    # The rehearsal compiles one kernel translation unit for sm_$ARCH (the scatter one
    # takes 13 s more on 2 cores); the emulated library comes from the installed package.
    one=gatherSelectionKvCache.cu.o
    if [ "$gen" = Ninja ]; then
      cmake --build "$BUILD" --target "plugins/kernels/CMakeFiles/pytrt_kv_kernels_impl.dir/$one"
    else
      make -C "$BUILD/plugins/kernels" "$one"
    fi
    "$PY" -c "from pytrt_kv import _lib; import sys; p = _lib.find(_lib.EMU_KERNELS_LIB); \
print('emulated kernels:', p); sys.exit(p is None)"
    echo "configure + gatherSelectionKvCache.cu for sm_$ARCH; emulated library found" \
      >"$OUT/.$STEP.note"
  else
    cmake --build "$BUILD" -j "$(nproc)"
    lib=$BUILD/lib/libpytrt_kv_kernels.so
    # The build record beside the library: `pytrt-kv info` and the tests read it there.
    cp "$BUILD/build_info.json" "$BUILD/lib/"
    if command -v cuobjdump >/dev/null 2>&1; then
      cuobjdump --list-elf "$lib" | tee /dev/stderr | grep -q "sm_$ARCH" ||
        { echo "no sm_$ARCH code in $lib"; exit 1; }
    fi
    "$PY" -m pytrt_kv info
    echo "kernels for sm_$ARCH only" >"$OUT/.$STEP.note"
  fi
}

GPU_TEST_FILES="tests/test_ops_scatter.py tests/test_ops_gather.py tests/test_quantise.py \
tests/test_aliasing.py tests/test_workspace_cache.py"
export GPU_TEST_FILES

step_gpu_tests() {
  local rc files
  read -ra files <<<"$GPU_TEST_FILES"
  if [ "$DRY" = 1 ]; then
    # Every Nth test of the same selection, on the emulated device.
    local n=${PYTRT_KV_CHECK_SAMPLE:-25} ids
    mapfile -t ids < <("$PY" -m pytest -q -p no:cacheprovider --device emu --collect-only \
      "${files[@]}" | grep '::' | awk -v n="$n" 'NR % n == 1')
    [ ${#ids[@]} -gt 0 ] || { echo "no tests collected"; exit 1; }
    "$PY" -m pytest -q -ra -p no:cacheprovider --device emu "${ids[@]}"
    rc=$?
    pytest_tail
    echo "every ${n}th test, emulated device" >>"$OUT/.$STEP.note"
    exit $rc
  fi
  "$PY" -m pytest -q -ra -p no:cacheprovider --device gpu "${files[@]}"
  rc=$?
  pytest_tail
  # On the GPU nothing of these files may skip (torch CUDA and CuPy are there).
  if grep -q '^SKIPPED' "$OUT/$STEP.log"; then
    echo "tests SKIPPED on the GPU (see the log)" >>"$OUT/.$STEP.note"
    [ $rc = 0 ] && rc=1
  fi
  exit $rc
}

step_e4m3_nan() {
  local dev=gpu rc
  [ "$DRY" = 1 ] && dev=emu
  "$PY" -m pytest -v -ra -p no:cacheprovider --device $dev tests/test_quantise.py -k nan
  rc=$?
  pytest_tail
  echo "e4m3 cases: $(grep -c 'e4m3.*PASSED' "$OUT/$STEP.log")" >>"$OUT/.$STEP.note"
  exit $rc
}

sanitizer() {  # sanitizer TOOL: compute-sanitizer TOOL over scripts/gpu_workload.py
  local tool=$1
  local cmd=(compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50
    "$PY" "$ROOT/scripts/gpu_workload.py")
  if [ "$DRY" = 0 ]; then
    [ -n "$SAN" ] || { echo "compute-sanitizer is not on PATH"; exit 1; }
    "${cmd[@]}"
    exit $?
  fi
  # Rehearsal: the workload itself on the emulated device (bit-exact against the
  # reference), and the exact command line the GPU run uses.
  case $tool in memcheck | racecheck | synccheck | initcheck) ;; *) exit 1 ;; esac
  printf 'GPU run would execute:'
  printf ' %q' "${cmd[@]}"
  echo
  local why="compute-sanitizer is not installed here"
  [ -n "$SAN" ] && why="no GPU for compute-sanitizer"
  # The workload is the same for every tool: it runs once per rehearsal.
  if [ -f "$OUT/.workload-ran" ]; then
    echo "simulated: $why; command built (workload: see $(cat "$OUT/.workload-ran"))" \
      >"$OUT/.$STEP.status"
    exit 0
  fi
  "$PY" "$ROOT/scripts/gpu_workload.py" || exit 1
  echo "$STEP" >"$OUT/.workload-ran"
  echo "simulated: $why; workload ran on the emulator, command built" >"$OUT/.$STEP.status"
}
step_memcheck() { sanitizer memcheck; }
step_racecheck() { sanitizer racecheck; }
step_synccheck() { sanitizer synccheck; }
step_initcheck() { sanitizer initcheck; }

bench() {  # bench OP: pytrt-kv bench --op OP
  local op=$1
  local args=(bench --op "$op" --output "$OUT/bench-$op.md" --json "$OUT/bench-$op.json")
  if [ "$DRY" = 0 ]; then
    "$PY" -m pytrt_kv "${args[@]}"
    exit $?
  fi
  # Rehearsal: the timing needs torch.cuda; checked here: the exact arguments parse, the
  # benchmark's CPU-side logic and (TRITON_INTERPRET=1, where Triton is installed) the
  # Triton scatter baseline.
  # The CPU-side check is the same for every op: it runs once per rehearsal.
  local cpu=1
  [ -f "$OUT/.bench-checked" ] && cpu=0
  TRITON_INTERPRET=1 "$PY" - "$cpu" "${args[@]}" <<'EOF' || exit 1
import sys
from pytrt_kv.cli import build_parser
args = build_parser().parse_args(sys.argv[2:])
print("GPU run would execute: python -m pytrt_kv", " ".join(sys.argv[2:]))
print(f"arguments parse: op={args.op} iters={args.iters} repeats={args.repeats}")
if sys.argv[1] == "1":
    import torch
    from pytrt_kv import bench
    bench.cpu_check(torch, print)
EOF
  if [ $cpu = 1 ]; then
    echo "$STEP" >"$OUT/.bench-checked"
    echo "simulated: timing needs torch.cuda; arguments and CPU-side logic checked" \
      >"$OUT/.$STEP.status"
    grep -E '^Triton' "$OUT/$STEP.log" >"$OUT/.$STEP.note" || true
  else
    echo "simulated: timing needs torch.cuda; arguments checked (CPU-side logic: see" \
      "$(cat "$OUT/.bench-checked"))" >"$OUT/.$STEP.status"
  fi
}
step_bench_scatter() { bench scatter; }
step_bench_gather() { bench gather; }
step_bench_quant() { bench quant; }

step_plugin_harness() {
  local inc=${TensorRT_INCLUDE_DIR:-} bin=$BUILD/bin/pytrt_kv_plugin_harness
  local cases=$BUILD/plugin_cases  # about 4 MB: kept out of OUT, which comes back
  if [ -z "$inc" ]; then
    echo "skipped: no TensorRT headers (set TensorRT_INCLUDE_DIR, e.g. to a carried" \
      ".venv-test/trt-headers/include)" >"$OUT/.$STEP.status"
    exit 0
  fi
  [ -f "$inc/NvInfer.h" ] || { echo "TensorRT_INCLUDE_DIR=$inc has no NvInfer.h"; exit 1; }
  rm -rf "$cases"
  "$PY" "$ROOT/plugins/harness/makeCases.py" "$cases" || exit 1
  if [ "$DRY" = 1 ]; then
    echo "GPU run would execute: $bin check && $bin run $cases/*/"
    echo "simulated: the harness enqueues on a GPU; its $(find "$cases" -mindepth 1 \
      -maxdepth 1 -type d | wc -l) cases were written, commands built" >"$OUT/.$STEP.status"
    exit 0
  fi
  [ -x "$bin" ] || { echo "$bin was not built (see build.log)"; exit 1; }
  "$bin" check || exit 1
  "$bin" run "$cases"/*/
}

step_profile() {
  # ncu over the benchmark-shaped launches of scripts/gpu_profile.py (every result checked
  # against the reference): the sections that say why a kernel is slow, then the SASS
  # lines with their stall samples (the source page, where this ncu has it).
  local rep=$OUT/profile
  local cmd=(ncu --section SpeedOfLight --section LaunchStats --section Occupancy
    --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis
    --import-source yes -k "regex:gatherPlanKernel|gatherCopyKernel|scatterQuantTokensKernel|scatterTokensKernel"
    --launch-count 12 -f -o "$rep" "$PY" "$ROOT/scripts/gpu_profile.py")
  if [ "$DRY" = 1 ]; then
    printf 'GPU run would execute:'
    printf ' %q' "${cmd[@]}"
    echo
    "$PY" "$ROOT/scripts/gpu_profile.py" --small || exit 1
    echo "simulated: ncu needs a GPU; the profiled workload ran (small shapes) on the emulator" \
      >"$OUT/.$STEP.status"
    exit 0
  fi
  command -v ncu >/dev/null 2>&1 || { echo "ncu is not on PATH"; exit 1; }
  "${cmd[@]}" || exit 1
  ncu --import "$rep.ncu-rep" --print-summary per-kernel
  ncu --import "$rep.ncu-rep" --page details
  # Per-instruction stall samples (SASS with the CUDA lines), kept whole in the report;
  # the log gets the hottest lines of each kernel.
  if ncu --import "$rep.ncu-rep" --page source --csv --print-source cuda,sass >"$OUT/profile-source.csv" \
    2>"$OUT/profile-source.err"; then
    echo "source page: profile-source.csv ($(wc -l <"$OUT/profile-source.csv") lines)"
  else
    echo "no source page from this ncu: $(head -c 300 "$OUT/profile-source.err")"
  fi
}

# --- the run --------------------------------------------------------------------------------
rm -f "$OUT/.workload-ran" "$OUT/.bench-checked"
render_summary
if [ "$DEVICE" = none ]; then
  for s in "${STEPS[@]}"; do STATUS[$s]="not run: no GPU"; done
  render_summary
  cat "$SUMMARY"
  exit 2
fi
for s in "${STEPS[@]}"; do
  run_step "$s" "step_${s//-/_}"
  case $s:${STATUS[$s]} in build:FAILED* | build:TIMEOUT*) BLOCKED="the build failed" ;; esac
done
render_summary
echo
cat "$SUMMARY"
grep -qE '^\| [a-z0-9-]+ \| (FAILED|TIMEOUT)' "$SUMMARY" && exit 1
exit 0
