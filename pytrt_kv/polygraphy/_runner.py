"""Polygraphy runner over :mod:`pytrt_kv.runtime`."""

from __future__ import annotations

import time
from collections import OrderedDict

from polygraphy import util
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata


class PytrtKvRefRunner(BaseRunner):
    """Runs an ONNX model with pytrt_kv ops on the CPU reference runtime.

    Like Polygraphy's own runners it takes the model in any form its loaders do.

    Feed it with :func:`pytrt_kv.polygraphy.data_loader.load_data` (or data of your own)
    when graph inputs feed the index inputs of our ops: Polygraphy's default data loader
    makes index values for which every row is skipped or refused, so a comparison would
    check nothing. ``polygraphy run --pytrt-kv-ref`` refuses to run such a model without
    ``--data-loader-script`` or ``--load-inputs``.

    Parameters
    ----------
    model : onnx.ModelProto, path (str or os.PathLike), serialized bytes, or a callable
        returning one of these (a Polygraphy loader such as ``OnnxFromPath``)
    name : str, optional
    """

    def __init__(self, model, name=None):
        super().__init__(name=name, prefix="pytrt-kv-ref-runner")
        self._model = model

    @util.check_called_by("activate")
    def activate_impl(self):
        import os

        import onnx

        from pytrt_kv.runtime import make_evaluator

        model, _ = util.invoke_if_callable(self._model)
        if isinstance(model, (bytes, bytearray)):
            model = onnx.load_model_from_string(bytes(model))
        elif isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"model: expected an ONNX file, got {path!r} (no such file)"
                )
            model = onnx.load(path)
        elif not isinstance(model, onnx.ModelProto):
            raise TypeError(
                f"model: expected an onnx.ModelProto, a path, bytes or a loader "
                f"returning one, got {type(model).__name__}"
            )
        self.model = model
        self.evaluator = make_evaluator(model)

    @util.check_called_by("get_input_metadata")
    def get_input_metadata_impl(self):
        return input_metadata(self.model)

    @util.check_called_by("infer")
    def infer_impl(self, feed_dict):
        from pytrt_kv.runtime import run

        start = time.time()
        outputs = run(self.evaluator, dict(feed_dict))
        self.inference_time = time.time() - start
        return OrderedDict((n, outputs[n]) for n in self.evaluator.output_names)

    @util.check_called_by("deactivate")
    def deactivate_impl(self):
        del self.evaluator
        del self.model


class FunctionRunner(BaseRunner):
    """A Polygraphy runner over a Python function ``feeds -> {output name: array}``, such
    as an independent computation to compare a graph with: fed ``model``'s graph inputs
    (:func:`input_metadata`), it returns the outputs named in ``outputs`` (default the
    model's graph outputs), in that order.

    Parameters
    ----------
    model : onnx.ModelProto
    fn : callable, dict of name -> numpy.ndarray -> mapping of name -> numpy.ndarray
    name : str
        The runner's name in Polygraphy's reports (its prefix too).
    outputs : sequence of str, optional
    """

    def __init__(self, model, fn, name: str, outputs=None):
        super().__init__(name=name, prefix=f"{name}-runner")
        self.model, self.fn = model, fn
        self.outputs = (
            list(outputs) if outputs is not None else [o.name for o in model.graph.output]
        )

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        # Polygraphy passes a runner only the inputs its metadata names.
        return input_metadata(self.model)

    def infer_impl(self, feed_dict):
        start = time.time()
        out = self.fn(dict(feed_dict))
        self.inference_time = time.time() - start
        return OrderedDict((n, out[n]) for n in self.outputs)

    def deactivate_impl(self):
        pass


def input_metadata(model) -> TensorMetadata:
    """Polygraphy metadata of the graph inputs of ``model`` (an ``onnx.ModelProto``) that
    are not initializers: name, dtype and shape (symbolic dims by name, unknown as None).
    Polygraphy feeds a runner only the inputs its metadata names."""
    from polygraphy.datatype import DataType

    from pytrt_kv.contract import dtypes
    from pytrt_kv.graph.feeds import graph_inputs

    meta = TensorMetadata()
    for name, (shape, elem) in graph_inputs(model).items():
        # Polygraphy's own DataType (NumPy dtypes are deprecated there); it knows the
        # ONNX types, bfloat16 and float8 included.
        dtype = DataType.from_dtype(elem, "onnx")
        if dtype is None or not isinstance(dtype, DataType):
            dtype = dtypes.numpy_of_onnx(elem, name)
        meta.add(name, dtype=dtype, shape=shape)
    return meta
