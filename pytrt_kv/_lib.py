"""Find the shared libraries that ship inside the package (pytrt_kv/lib).

Search order: the folder named by ``PYTRT_KV_LIB_DIR``, then the package's own ``lib``
folder (importlib.resources). A miss raises FileNotFoundError that lists every path
searched and, when the package was built without CUDA or TensorRT headers, why.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

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


def _package_lib_dir() -> Path:
    return Path(str(resources.files("pytrt_kv").joinpath("lib")))


def search_dirs() -> List[Path]:
    dirs = []
    env = os.environ.get(LIB_DIR_ENV)
    if env:
        dirs.append(Path(env))
    dirs.append(_package_lib_dir())
    return dirs


def build_info() -> Dict[str, str]:
    """What the native build found (written by CMake at install time); {} if absent."""
    for d in search_dirs():
        f = d / "build_info.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError):
                return {}
    return {}


def find(filename: str) -> Optional[Path]:
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
    if info.get("cuda") in ("OFF", "", None) and info.get("no_cuda_reason"):
        why = f" This installation was built without CUDA: {info['no_cuda_reason']}."
    elif filename != KERNELS_LIB and info.get("no_plugins_reason"):
        why = f" The plugins were not built: {info['no_plugins_reason']}."
    raise FileNotFoundError(
        f"{filename} not found; searched {searched}.{why} Reinstall with nvcc on PATH "
        f"(and -DTensorRT_INCLUDE_DIR for the plugins), or point {LIB_DIR_ENV} at a "
        f"folder holding the library.")
