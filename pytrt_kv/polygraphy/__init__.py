"""Polygraphy extension module: ``polygraphy run m.onnx --pytrt-kv-ref``.

Polygraphy's ``run`` tool loads every ``polygraphy.run.plugins`` entry point and adds
the argument groups the function returns; pyproject.toml declares
``pytrt-kv = "pytrt_kv.polygraphy:export_argument_groups"``. The runner executes the
model with :mod:`pytrt_kv.runtime` (onnx.reference plus our ops on the NumPy
reference), so it works on any CPU and is the trusted side of a TensorRT comparison::

    polygraphy run m.onnx --trt --plugins <libpytrt_kv_plugins_autoreg.so> --pytrt-kv-ref \\
        --data-loader-script <pytrt_kv/polygraphy/data_loader.py>

Polygraphy is imported only when these functions are called.
"""

from __future__ import annotations


def export_argument_groups():
    """Argument groups Polygraphy adds to ``polygraphy run`` (entry point target)."""
    from ._args import PytrtKvRefRunnerArgs

    return [PytrtKvRefRunnerArgs()]


def __getattr__(name):
    # PytrtKvRefRunner and input_metadata for Polygraphy's Python API, imported lazily.
    if name in ("PytrtKvRefRunner", "input_metadata"):
        from . import _runner

        return getattr(_runner, name)
    raise AttributeError(name)


__all__ = ["export_argument_groups", "PytrtKvRefRunner", "input_metadata"]
