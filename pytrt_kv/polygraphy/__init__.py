"""Polygraphy extension module: ``polygraphy run m.onnx --pytrt-kv-ref``.

Polygraphy's ``run`` tool loads every ``polygraphy.run.plugins`` entry point and adds
the argument groups the function returns; pyproject.toml declares
``pytrt-kv = "pytrt_kv.polygraphy:export_argument_groups"``. The runner executes the
model with :mod:`pytrt_kv.runtime` (onnx.reference plus our ops on the NumPy
reference), so it works on any CPU and is the trusted side of a TensorRT comparison.
Loading the extension also lets ``--onnxrt`` run such models (:func:`install_onnxrt`)::

    polygraphy run m.onnx --trt --plugins <libpytrt_kv_plugins_autoreg.so> --pytrt-kv-ref \\
        --data-loader-script <pytrt_kv/polygraphy/data_loader.py>

Polygraphy is imported only when these functions are called.
"""

from __future__ import annotations


def export_argument_groups():
    """Argument groups Polygraphy adds to ``polygraphy run`` (entry point target).

    Also lets Polygraphy's own ``--onnxrt`` runner run models with our ops
    (:func:`install_onnxrt`) when ONNX Runtime sessions with them work here."""
    from ._args import PytrtKvRefRunnerArgs

    install_onnxrt()
    return [PytrtKvRefRunnerArgs()]


def install_onnxrt() -> bool:
    """Make Polygraphy's ONNX-Runtime loader (``SessionFromOnnx``, the ``--onnxrt``
    runner) build sessions of models with ``pytrt_kv`` ops through
    :func:`pytrt_kv.ort.make_session`; other models are untouched. Returns False (and
    changes nothing) where such sessions do not work here (``pytrt-kv info`` says why)."""
    from ..ort import availability

    if availability():
        return False
    from ._onnxrt import install

    install()
    return True


def __getattr__(name):
    # The runners and input_metadata for Polygraphy's Python API, imported lazily.
    if name in ("PytrtKvRefRunner", "FunctionRunner", "input_metadata"):
        from . import _runner

        return getattr(_runner, name)
    raise AttributeError(name)


__all__ = [
    "export_argument_groups",
    "install_onnxrt",
    "FunctionRunner",
    "PytrtKvRefRunner",
    "input_metadata",
]
