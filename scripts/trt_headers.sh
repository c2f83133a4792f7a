#!/usr/bin/env bash
# TensorRT headers for building the plugins, shared by scripts/test.sh and
# scripts/build_wheel.sh (docs/TENSORRT.md, "Where the TensorRT headers come from").
#
#   bash scripts/trt_headers.sh PYTHON DEST    # prints the include folder on stdout
#
# Downloads the `kernel-lens==2.0.1` wheel from the package index (`pip download
# --no-deps`, never installed) and unpacks the TensorRT 10.14.1 headers it carries
# (NVIDIA's Apache-2.0 OSS headers) into DEST/include. Nothing is installed or committed.
# Callers use TensorRT_INCLUDE_DIR / TensorRT_ROOT instead when those are set.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 PYTHON DEST (a Python with pip; the folder to unpack into)" >&2
  exit 2
fi
py=$1
hdr=$2
mkdir -p "$hdr"
hdr=$(cd "$hdr" && pwd)
echo "== fetching TensorRT headers (kernel-lens 2.0.1 wheel from the index, unpacked into $hdr)" >&2
"$py" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  "kernel-lens==2.0.1" -d "$hdr/wheel" >&2
"$py" - "$hdr" <<'PY' >&2
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
wheel = next((root / "wheel").glob("kernel_lens-*.whl"))
prefix = "kernel_lens/include/tensorrt/"
out = root / "include"
out.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".h")]
    for n in names:
        (out / n[len(prefix):]).write_bytes(z.read(n))
if not (out / "NvInferRuntime.h").is_file():
    sys.exit(f"{wheel.name} has no NvInferRuntime.h under {prefix}")
print(f"   {len(names)} headers in {out}")
PY
echo "$hdr/include"
