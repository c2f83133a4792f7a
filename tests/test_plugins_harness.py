"""Layer 3 on a CPU with TensorRT headers only (marker ``trt_headers``): the project is
configured and built into a temporary folder, then the C++ harness drives both plugins
through their creators without libnvinfer (plugins/harness/, entry point pluginHarness.cpp).

Set TensorRT_INCLUDE_DIR (or TensorRT_ROOT) to run these; the GPU half of the harness
(``pytrt_kv_plugin_harness run``) is in scripts/gpu_check.sh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from pytrt_kv.contract import specs
from support.env import REPO, run_python, trt_include_dir

pytestmark = pytest.mark.trt_headers

# Files of this layer: their compiler output must be free of warnings (-Wall -Wextra).
_OWN_SOURCES = re.compile(
    r"plugins/(common|scatterPaKvCache|gatherSelectionKvCache|harness)/|"
    r"plugins/(registration|autoRegister)\.cpp"
)


def _run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """Configure + build the plugin targets once for this module; returns (dir, log)."""
    inc = trt_include_dir()
    out = tmp_path_factory.mktemp("plugins-build")
    cmd = [
        "cmake",
        "-S",
        REPO,
        "-B",
        out,
        f"-DTensorRT_INCLUDE_DIR={inc}",
        "-DCMAKE_CUDA_ARCHITECTURES=90",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    conf = _run(cmd)
    assert conf.returncode == 0, conf.stdout + conf.stderr
    log = conf.stdout + conf.stderr
    if "no CUDA compiler" in log:
        pytest.skip(
            "no CUDA compiler (nvcc): the plugins link the kernels, so they cannot be built"
        )
    assert "skipping the TensorRT plugins" not in log, log
    assert re.search(r"Found TensorRT: .* \(found version \"\d+\.\d+\.\d+\"\)", log), log
    b = _run(
        [
            "cmake",
            "--build",
            out,
            "-j2",
            "--target",
            "pytrt_kv_plugin_harness",
            "pytrt_kv_plugins",
            "pytrt_kv_plugins_autoreg",
        ]
    )
    assert b.returncode == 0, b.stdout[-6000:] + b.stderr[-6000:]
    return out, log + b.stdout + b.stderr


def _harness(build, *args):
    exe = build[0] / "bin" / "pytrt_kv_plugin_harness"
    return _run([exe, *args])


def test_own_sources_compile_without_warnings(build):
    bad = [
        line for line in build[1].splitlines() if "warning" in line and _OWN_SOURCES.search(line)
    ]
    assert not bad, "\n".join(bad)


def test_harness_cpu_checks_pass(build):
    r = _harness(build, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"harness check: (\d+) checks, (\d+) failed", r.stdout)
    assert m and int(m.group(2)) == 0 and int(m.group(1)) >= 200, r.stdout


def test_creator_fields_match_specs(build):
    r = _harness(build, "fields")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    by_name = {p["name"]: p for p in info["plugins"]}
    assert sorted(by_name) == sorted(specs.OPS)
    kinds = {"int": "kINT32", "string": "kCHAR"}  # what the ONNX parser passes
    for name, op in specs.OPS.items():
        p = by_name[name]
        assert p["interface"] == "PLUGIN CREATOR_V3ONE"
        assert p["version"] == specs.PLUGIN_VERSION and p["namespace"] == specs.NAMESPACE
        assert [f["name"] for f in p["fields"]] == list(op.attribute_names)
        assert [f["type"] for f in p["fields"]] == [kinds[a.type] for a in op.attributes]
        assert p["defaults"] == {a.name: a.default for a in op.attributes}
        assert p["nb_outputs"] == len(op.outputs)
        assert p["aliases"] == [op.aliased_input_index(k) for k in range(len(op.outputs))]
        assert p["aliases_alias_io_0"] == [-1] * len(op.outputs)


def test_harness_build_and_runtime_phases_on_reference_cases(build, tmp_path):
    # Every case the GPU run uses, up to onShapeChange: the plugins accept what the
    # reference accepts and declare its output dtypes and shapes.
    gen = _run(
        [sys.executable, REPO / "plugins" / "harness" / "makeCases.py", tmp_path],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert gen.returncode == 0, gen.stderr
    cases = sorted(str(p) for p in tmp_path.iterdir() if (p / "case.txt").is_file())
    assert len(cases) >= 60
    r = _harness(build, "cases", *cases)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert re.search(rf"harness cases: {len(cases)} cases, \d+ checks, 0 failed", r.stdout), (
        r.stdout
    )


def test_harness_reports_a_wrong_expectation(build, tmp_path):
    # The harness must be able to fail: a reference output whose shape disagrees.
    gen = _run(
        [sys.executable, REPO / "plugins" / "harness" / "makeCases.py", tmp_path],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert gen.returncode == 0, gen.stderr
    case = tmp_path / "scatter_nd_float16_int32"
    text = (case / "case.txt").read_text()
    (case / "case.txt").write_text(
        text.replace(
            "output key_cache_out float16 4 5 8 2 16", "output key_cache_out float16 4 5 4 4 16"
        )
    )
    r = _harness(build, "cases", case)
    assert r.returncode == 1 and "FAIL: ScatterPaKvCache" in r.stdout, r.stdout


def _with_library_in_a_child(lib, code: str):
    """Run ``code`` in a child Python process with ``ctypes`` imported and the library at
    ``lib`` loaded as ``l`` (this process never loads it); it must exit 0."""
    r = run_python("-c", f"import ctypes\nl = ctypes.CDLL({str(lib)!r})\n" + code, timeout=900)
    assert r.returncode == 0, r.stderr
    return r


def test_loader_library_exports_only_the_entry_points(build):
    lib = build[0] / "lib" / "libpytrt_kv_plugins.so"
    r = _with_library_in_a_child(
        lib,
        "n = ctypes.c_int32(-1)\n"
        "l.getCreators.restype = ctypes.c_void_p\n"
        "p = l.getCreators(ctypes.byref(n))\n"
        "print(n.value, bool(p), hasattr(l, 'setLoggerFinder'),\n"
        "      hasattr(l, 'pytrt_kv_registered_creators'))\n",
    )
    assert r.stdout.split() == ["2", "True", "True", "False"]


def test_autoreg_library_loads_without_libnvinfer(build):
    # In a child process: whether libnvinfer can be found is probed there too, after the
    # library's load-time registration ran, so that this process never loads libnvinfer.
    lib = build[0] / "lib" / "libpytrt_kv_plugins_autoreg.so"
    code = (
        "have = False\n"
        "for so in ('libnvinfer.so.11', 'libnvinfer.so.10'):\n"
        "    try:\n"
        "        ctypes.CDLL(so); have = True; break\n"
        "    except OSError:\n"
        "        pass\n"
        "print(l.pytrt_kv_registered_creators(), hasattr(l, 'getCreators'), have)\n"
    )
    r = _with_library_in_a_child(lib, code)
    registered, exports_get_creators, have_nvinfer = r.stdout.split()
    assert exports_get_creators == "False"
    if have_nvinfer == "True":
        assert registered == "2", r.stderr
    else:
        assert registered == "-1"
        assert "getPluginRegistry not found" in r.stderr


def test_libraries_do_not_depend_on_libnvinfer(build):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not installed")
    for name in ("libpytrt_kv_plugins.so", "libpytrt_kv_plugins_autoreg.so"):
        r = _run([readelf, "-d", build[0] / "lib" / name])
        assert r.returncode == 0, r.stderr
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", r.stdout)
        assert needed and not any("nvinfer" in n or "cudart" in n for n in needed), needed


def _autoreg_with_two_majors(lib, tmp_path, registry_in):
    """Load stand-ins of libtensorrt_rtx.so.1 (layout 11) and libnvinfer.so.10 (layout 10)
    in one process, getPluginRegistry only in ``registry_in`` (a soname), then the autoreg
    library; returns the child's CompletedProcess."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in TensorRT libraries")
    tmp_path.mkdir(exist_ok=True)
    libs = []
    for soname in ("libtensorrt_rtx.so.1", "libnvinfer.so.10"):
        src = tmp_path / f"{soname}.c"
        body = "int pytrt_kv_stand_in(void) { return 1; }\n"
        if soname == registry_in:
            body = (
                "#include <stdio.h>\n"
                'void* getPluginRegistry(void) { fputs("FAKE REGISTRY CALLED\\n", stderr);'
                " return 0; }\n"
            )
        src.write_text(body)
        out = tmp_path / soname
        r = _run([cc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", out, src])
        assert r.returncode == 0, r.stderr
        libs.append(out)
    code = "import ctypes\n"
    code += "".join(f"ctypes.CDLL({str(x)!r})\n" for x in libs)
    code += f"l = ctypes.CDLL({str(lib)!r})\nprint(l.pytrt_kv_registered_creators())\n"
    r = run_python("-c", code, timeout=900)
    assert r.returncode == 0, r.stderr
    return r


def test_autoreg_judges_the_registry_library_not_the_loaded_set(build, tmp_path):
    """libnvinfer.so.10 and libtensorrt_rtx.so.1 loaded side by side (two TensorRT majors
    in one process): the set of loaded sonames is ambiguous, so the ABI guard must judge
    the library that getPluginRegistry comes from. Run with the headers at hand (10.x in
    CI, from scripts/test.sh; 11.x elsewhere): a registry from the library of the other
    layout must never be called, one of the headers' own layout must be."""
    # (CMake also reports the CUDA toolkit's "found version": take TensorRT's.)
    found = re.search(r"Found TensorRT: .* \(found version \"(\d+)\.", build[1])
    assert found, build[1]
    major = int(found.group(1))
    own, other = ("libtensorrt_rtx.so.1", "libnvinfer.so.10")[:: 1 if major >= 11 else -1]
    lib = build[0] / "lib" / "libpytrt_kv_plugins_autoreg.so"
    r = _autoreg_with_two_majors(lib, tmp_path / "other", other)
    assert "FAKE REGISTRY CALLED" not in r.stderr, r.stderr
    assert "other interface layout" in r.stderr, r.stderr
    assert r.stdout.split() == ["-1"]
    # Control: the same setup reaches the registry when its layout is the headers' (it
    # returns no registry, so nothing is registered).
    r = _autoreg_with_two_majors(lib, tmp_path / "own", own)
    assert "FAKE REGISTRY CALLED" in r.stderr, r.stderr
    assert "other interface layout" not in r.stderr, r.stderr
