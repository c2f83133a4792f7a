"""Find the shared libraries that ship inside the package (pytrt_kv/lib).

``PYTRT_KV_DEVICE=emu`` selects the emulated-device build of the kernel library
(``libpytrt_kv_kernels_emu.so``, docs/EMULATION.md): the same kernel sources compiled for
the CPU, so ``pytrt_kv.ops`` runs without a GPU. Unset (or ``cuda``), nothing changes.

Search order: the folder named by ``PYTRT_KV_LIB_DIR``, then the package's own ``lib``
folder (importlib.resources), then the ``lib`` folder of the installed ``pytrt-kv``
distribution when that is elsewhere. The last one matters when Python imports pytrt_kv
from a source checkout (the current directory comes first on ``sys.path``, e.g.
``python3 -m pytrt_kv info`` in the repository root): the source tree holds no built
libraries, but the installed ones are still found and used. A miss raises
FileNotFoundError that lists every path searched, says when the imported package is a
source tree without libraries, and, when the package was built without CUDA or
TensorRT headers, why.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

#: Environment variable naming a folder searched before the package's own.
LIB_DIR_ENV = "PYTRT_KV_LIB_DIR"

#: CUDA kernels with the C ABI (``pytrt_kv_*`` symbols), used by ``pytrt_kv.ops``.
KERNELS_LIB = "libpytrt_kv_kernels.so"
#: TensorRT plugins exporting ``getCreators``/``setLoggerFinder`` (no libnvinfer link):
#: for ``IPluginRegistry::loadLibrary`` and ``trtexec --dynamicPlugins``.
PLUGINS_LIB = "libpytrt_kv_plugins.so"
#: The same plugins, registering their creators when loaded: for ``polygraphy --plugins``,
#: ``ctypes.CDLL`` and ``trtexec --staticPlugins``. Never load both into one process.
PLUGINS_AUTOREG_LIB = "libpytrt_kv_plugins_autoreg.so"


#: Environment variable selecting the device: ``emu`` (the emulated device) or unset/``cuda``.
DEVICE_ENV = "PYTRT_KV_DEVICE"
#: The kernels built for the emulated device (same C ABI, plus ``pytrt_kv_emu_*``).
EMU_KERNELS_LIB = "libpytrt_kv_kernels_emu.so"


def emulated() -> bool:
    """True when ``PYTRT_KV_DEVICE=emu`` selects the emulated device.

    Raises
    ------
    ValueError
        ``PYTRT_KV_DEVICE`` holds anything but ``emu``, ``cuda`` or nothing.
    """
    value = os.environ.get(DEVICE_ENV, "").strip()
    if value in ("", "cuda"):
        return False
    if value == "emu":
        return True
    raise ValueError(f"{DEVICE_ENV}: expected 'emu' or 'cuda' (or unset), got {value!r}")


def kernels_lib() -> str:
    """File name of the kernel library for the selected device (:func:`emulated`)."""
    return EMU_KERNELS_LIB if emulated() else KERNELS_LIB


def _package_lib_dir() -> Path:
    return Path(str(resources.files("pytrt_kv").joinpath("lib")))


#: Distribution name of the project (pyproject.toml).
DIST_NAME = "pytrt-kv"


def installed_lib_dir() -> Path | None:
    """``lib`` folder of the installed ``pytrt-kv`` distribution, or None (not installed,
    or installed without libraries)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("pytrt_kv/lib")))
    return path if path.is_dir() else None


def search_dirs() -> list[Path]:
    """Folders searched for the libraries, in order (see the module docstring)."""
    dirs = []
    env = os.environ.get(LIB_DIR_ENV)
    if env:
        dirs.append(Path(env))
    own = _package_lib_dir()
    dirs.append(own)
    installed = installed_lib_dir()
    if installed is not None and installed.resolve() != own.resolve():
        dirs.append(installed)
    return dirs


def build_info() -> dict[str, str]:
    """What the native build found (written by CMake at install time); {} if absent."""
    for d in search_dirs():
        f = d / "build_info.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError):
                return {}
    return {}


def kernel_architectures() -> str | None:
    """CMake's ``CUDA_ARCHITECTURES`` (``"80-real;89-real;120"``) recorded in the
    ``build_info.json`` beside the CUDA kernels library that would be loaded; None when
    that library or its record is absent (a record elsewhere may describe other
    kernels)."""
    lib = find(KERNELS_LIB)
    record = lib.parent / "build_info.json" if lib is not None else None
    if record is None or not record.is_file():
        return None
    try:
        return json.loads(record.read_text()).get("cuda_architectures") or None
    except (OSError, ValueError):
        return None


def find(filename: str) -> Path | None:
    """Path of ``filename`` in the search folders, or None."""
    for d in search_dirs():
        p = d / filename
        if p.is_file():
            return p
    return None


def require(filename: str) -> Path:
    """Path of ``filename``; FileNotFoundError listing the searched paths if missing."""
    p = find(filename)
    if p is not None:
        return p
    searched = ", ".join(str(d / filename) for d in search_dirs())
    info = build_info()
    why = ""
    if filename == EMU_KERNELS_LIB:
        why = (
            f" The emulated device ({DEVICE_ENV}=emu) is built only with "
            f"-DPYTRT_KV_EMU=ON (pip: --config-settings=cmake.define.PYTRT_KV_EMU=ON; "
            f"scripts/test.sh does that)."
        )
    elif info.get("cuda") in ("OFF", "", None) and info.get("no_cuda_reason"):
        why = f" This installation was built without CUDA: {info['no_cuda_reason']}."
    elif filename != KERNELS_LIB and info.get("no_plugins_reason"):
        why = f" The plugins were not built: {info['no_plugins_reason']}."
    own = _package_lib_dir()
    if not own.is_dir():
        why += (
            f" The imported pytrt_kv ({own.parent}) has no lib folder: it is a source "
            f"tree, and no installed {DIST_NAME} with libraries was found."
        )
    raise FileNotFoundError(
        f"{filename} not found; searched {searched}.{why} Install the binary wheel "
        f"that scripts/build_wheel.sh makes (kernels and plugins, no nvcc or headers "
        f"needed), or reinstall from source with nvcc on PATH (and, for the plugins, "
        f"--config-settings=cmake.define.TensorRT_INCLUDE_DIR=/path/to/TensorRT/include; "
        f'docs/TENSORRT.md, "Installing the plugins"), or point {LIB_DIR_ENV} at a '
        f"folder holding the library."
    )


def install_command(extra: str) -> str:
    """The command that installs the ``extra`` of this pytrt_kv into the running Python:
    from the source tree it is imported from (a checkout), else from where the installed
    distribution came from (its PEP 610 ``direct_url.json``: a folder or a wheel file, or
    a URL), else by name (an index). Install hints print this, never a placeholder."""
    import shlex  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415
    from urllib.parse import unquote, urlparse  # noqa: PLC0415

    root = Path(__file__).resolve().parent.parent
    target = f"{DIST_NAME}[{extra}]"
    if (root / "pyproject.toml").is_file():
        target = f"{root}[{extra}]"
    else:
        try:
            raw = metadata.distribution(DIST_NAME).read_text("direct_url.json") or "{}"
            url = str(json.loads(raw).get("url", ""))
        except (metadata.PackageNotFoundError, ValueError, AttributeError):
            url = ""
        if url.startswith("file://"):
            target = f"{unquote(urlparse(url).path)}[{extra}]"
        elif url:
            target = f"{DIST_NAME}[{extra}] @ {url}"
    return f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(target)}"
