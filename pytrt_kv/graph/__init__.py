"""The graph layer of pytrt_kv: everything that works on ONNX graphs holding our ops.

- :mod:`.check`: export-time validation of one node (attributes, shapes, dtypes through
  the contract's checks) and its output types;
- :mod:`.nodes`: the checks of a whole model's nodes that the CPU runtime and
  ``prepare_for_tensorrt`` share (docs/GRAPH_MODE.md, "Model checks");
- :mod:`.schemas`: the ONNX schemas, registered with ``onnx.defs`` on import;
- :mod:`.runtime`: the CPU runtime (``onnx.reference`` + the NumPy reference); public
  path :mod:`pytrt_kv.runtime`;
- :mod:`.tensorrt`: ``prepare_for_tensorrt`` and the aliasing facts TensorRT builders need;
  public path :mod:`pytrt_kv.trt`;
- :mod:`.lint`: :func:`check_model` and :func:`validate_model`, every rule deciding
  whether a model is valid, in one place (``pytrt-kv check``); the checks of
  :mod:`.nodes` and :mod:`.check` are its parts;
- :mod:`.feeds`: the valid-input generator ``make_feeds`` (tests, examples, demo, harness
  case maker, Polygraphy data loader); pure: it never reads argv or the environment.

It imports the contract, the reference and ``pytrt_kv._lib.kernel_architectures`` (the
kernels' CUDA architectures, for :func:`check_model`'s targets), never ``onnx_export`` (which
builds on it) nor the GPU layers (docs/ARCHITECTURE.md). Submodules are imported on
demand: importing this package needs no onnx.
"""


def __getattr__(name):
    # pytrt_kv.graph.check_model etc., imported on first use (importing this package
    # needs no onnx).
    if name in ("check_model", "validate_model", "Problem"):
        from . import lint  # noqa: PLC0415

        return getattr(lint, name)
    raise AttributeError(name)


__all__ = ["check_model", "validate_model", "Problem"]
