"""Run pytrt_kv engines with aliasing-aware bindings (docs/SPEC.md O: in place)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._cuda import BufferView, DeviceArray, binding_view, stream_handle
from ..contract import dtypes, specs
from ..contract.errors import type_error, value_error
from ._tensorrt import check_cuda, import_cudart, import_tensorrt


def _dtype_name(trt, trt_dtype, tensor: str) -> str:
    for name, member in dtypes.TENSORRT.items():
        if getattr(trt.DataType, member, None) == trt_dtype:
            return name
    raise type_error(tensor, f"a dtype in {sorted(dtypes.TENSORRT)}", trt_dtype)


def _default_aliases(output_names, input_names) -> dict[str, str]:
    """specs.py naming: '<input>_out' updates '<input>' in place."""
    out = {}
    inputs = set(input_names)
    for op in specs.OPS.values():
        for o, i in op.aliases.items():
            if o in output_names and i in inputs:
                out[o] = i
    return out


class EngineRunner:
    """Binds and runs one execution context of a pytrt_kv engine.

    Every ``*_out`` output whose input is an engine input is bound to that input's
    address, so caches are updated in place and never copied (docs/SPEC.md O). Inputs may be
    torch/CuPy/PyCUDA/Numba CUDA arrays, cuda-python allocations, or pinned host memory
    (:class:`HostArray`, a host-resident full cache). Outputs that alias nothing are
    allocated by the runner unless given.

    Parameters
    ----------
    engine : pytrt_kv.trt.Engine or tensorrt.ICudaEngine
    aliases : mapping output name -> input name, optional
        Overrides the pairs found in ``engine.aliases`` / TensorRT / specs.py naming.

    Examples
    --------
    >>> runner = EngineRunner(build_engine("model.onnx"))           # doctest: +SKIP
    >>> stream = torch.cuda.current_stream()                          # doctest: +SKIP
    >>> runner.run({"key": key_t, "key_cache": kc_t, ...}, stream=stream)  # doctest: +SKIP
    >>> graph = runner.capture_graph(stream)   # replay with graph.launch(stream)  # doctest: +SKIP
    """

    def __init__(self, engine, *, aliases: Mapping[str, str] | None = None):
        self._trt = import_tensorrt()
        trt = self._trt
        self.engine_handle = engine
        self.engine = getattr(engine, "engine", engine)
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError(
                "TensorRT could not create an execution context (out of GPU memory?)"
            )
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = [n for n in names if is_input[n]]
        self.output_names = [n for n in names if not is_input[n]]
        self.dtypes = {n: _dtype_name(trt, self.engine.get_tensor_dtype(n), n) for n in names}
        self._engine_shapes = {n: tuple(self.engine.get_tensor_shape(n)) for n in self.input_names}
        self._dynamic = {n: any(d < 0 for d in s) for n, s in self._engine_shapes.items()}
        self.aliases = self._resolve_aliases(engine, aliases)
        self._owned: dict[str, DeviceArray] = {}
        self._bound: dict[str, BufferView] = {}

    def _resolve_aliases(self, engine, given) -> dict[str, str]:
        pairs = _default_aliases(self.output_names, self.input_names)
        pairs.update(getattr(engine, "aliases", {}) or {})
        # TensorRT 10.14+/11 reports aliases of its own (e.g. KV-cache layers); an
        # engine that says otherwise than the model is a build problem to surface.
        getter = getattr(self.engine, "get_aliased_input_tensor", None)
        if getter is not None:
            for o in self.output_names:
                try:
                    src = getter(o)
                except Exception:
                    src = None
                if src:
                    if o in pairs and pairs[o] != src:
                        raise RuntimeError(
                            f"{o}: the model aliases it to {pairs[o]!r}, TensorRT to {src!r}"
                        )
                    pairs[o] = src
        if given:
            pairs.update(given)
        for o, i in pairs.items():
            if o not in self.output_names or i not in self.input_names:
                raise value_error(
                    "aliases", "output -> input names of this engine", f"{o!r} -> {i!r}"
                )
        first: dict[str, str] = {}
        for o, i in pairs.items():
            if i in first:
                raise value_error(
                    "aliases",
                    "at most one output per input",
                    f"{first[i]!r} and {o!r} both -> {i!r}",
                )
            first[i] = o
        return pairs

    # --- binding ---------------------------------------------------------------------

    def _check(self, name: str, view: BufferView, shape) -> None:
        want = self.dtypes[name]
        if view.dtype is not None and view.dtype != want:
            raise type_error(name, f"dtype {want}", view.dtype)
        if view.shape is not None and shape is not None and tuple(view.shape) != tuple(shape):
            raise value_error(name, f"shape {list(shape)}", list(view.shape))

    def bind(self, tensors: Mapping[str, Any], *, shapes: Mapping[str, Any] | None = None) -> None:
        """Set every input (and given output) address, and the dynamic input shapes.

        Parameters
        ----------
        tensors : mapping name -> buffer
            Every engine input; outputs optional (aliased ones default to their input's
            address, the others to a runner-owned :class:`DeviceArray`).
        shapes : mapping name -> shape, optional
            Shapes of dynamic inputs given as raw addresses (arrays carry their own).
        """
        unknown = set(tensors) - set(self.input_names) - set(self.output_names)
        if unknown:
            raise value_error(
                "tensors",
                f"names among inputs {self.input_names} and outputs {self.output_names}",
                sorted(unknown),
            )
        missing = [n for n in self.input_names if n not in tensors]
        if missing:
            raise value_error(
                "tensors", f"every engine input {self.input_names}", f"missing {missing}"
            )
        shapes = dict(shapes or {})
        for name in self.input_names:
            view = binding_view(name, tensors[name])
            engine_shape = self._engine_shapes[name]
            if self._dynamic[name]:
                self._check(name, view, None)
                shape = view.shape if view.shape is not None else shapes.get(name)
                if shape is None:
                    raise value_error(
                        name, f"a shape for the dynamic input {list(engine_shape)}", "none"
                    )
                if not self.context.set_input_shape(name, tuple(shape)):
                    raise value_error(
                        name, f"a shape within the profile of {list(engine_shape)}", list(shape)
                    )
            else:
                self._check(name, view, engine_shape)
            self._set(name, view)
        for name in self.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            if name in tensors:
                view = binding_view(name, tensors[name])
                self._check(name, view, shape)
            elif name in self.aliases:
                view = self._bound[self.aliases[name]]
            else:
                arr = self._owned.get(name)
                if arr is None or arr.shape != shape:
                    # Dropping the replaced array frees it (cudaFree waits for eager
                    # executions) unless a CudaGraph captured with it still holds it.
                    arr = DeviceArray(shape, self.dtypes[name])
                    self._owned[name] = arr
                view = arr.view()
            self._set(name, view)

    #: Key of the runner-owned buffer that zero-element tensors given at address 0 are
    #: bound to (``torch.empty(0)``, a null pointer): TensorRT wants a valid, aligned
    #: address for every tensor, and nothing is ever read or written through this one.
    _SCRATCH = "\0zero-element"

    def _set(self, name: str, view: BufferView) -> None:
        if view.address == 0:
            shape = (
                view.shape if view.shape is not None else tuple(self.context.get_tensor_shape(name))
            )
            if int(np.prod(shape, dtype=np.int64)) != 0:
                raise value_error(
                    name, f"a buffer with a non-null address for shape {list(shape)}", "address 0"
                )
            scratch = self._owned.get(self._SCRATCH)
            if scratch is None:
                scratch = self._owned[self._SCRATCH] = DeviceArray((256,), "uint8")
            view = BufferView(scratch.view().address, view.shape, view.dtype, view.host)
        if not self.context.set_tensor_address(name, view.address):
            raise RuntimeError(f"{name}: TensorRT refused the address {view.address:#x}")
        self._bound[name] = view

    def address(self, name: str) -> int:
        """The address bound to ``name`` (after :meth:`bind`)."""
        return self._bound[name].address

    def output(self, name: str) -> DeviceArray:
        """The runner-owned buffer of a non-aliased output (``__cuda_array_interface__``)."""
        if name not in self._owned:
            raise value_error(
                "name", f"a runner-owned output among {sorted(self._owned)}", repr(name)
            )
        return self._owned[name]

    # --- execution -------------------------------------------------------------------

    def execute(self, stream=None) -> None:
        """Enqueue the engine on ``stream`` (asynchronous)."""
        if not self.context.execute_async_v3(stream_handle(stream)):
            raise RuntimeError(
                "TensorRT execute_async_v3 failed (see the TensorRT log: a plugin "
                "refusing its shapes logs why)"
            )

    def run(self, tensors: Mapping[str, Any], *, stream=None, shapes=None) -> None:
        """:meth:`bind` then :meth:`execute`."""
        self.bind(tensors, shapes=shapes)
        self.execute(stream)

    def capture_graph(self, stream) -> CudaGraph:
        """Capture one execution into a CUDA graph on ``stream`` (not the default stream).

        The current bindings are baked in: replay only while the same buffers hold the
        next step's data (the usual decode-loop pattern). One eager execution is done
        first, as TensorRT requires before capture after shape/binding changes.

        The graph keeps this runner (its execution context) and the runner-owned output
        buffers it writes alive, also across a later :meth:`bind` that replaces them;
        buffers you passed to :meth:`bind` stay yours to keep alive.
        """
        handle = stream_handle(stream)
        if handle == 0:
            raise value_error(
                "stream",
                "a created stream (capture is illegal on the legacy default stream)",
                "the default stream",
            )
        cudart = import_cudart()
        self.execute(handle)
        check_cuda(cudart.cudaStreamSynchronize(handle), "cudaStreamSynchronize")
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check_cuda(cudart.cudaStreamBeginCapture(handle, mode), "cudaStreamBeginCapture")
        try:
            self.execute(handle)
        except BaseException:
            # End the capture so the stream is usable again, drop the partial graph, and
            # let the original error through (not a capture-invalidated one).
            try:
                partial = check_cuda(cudart.cudaStreamEndCapture(handle), "cudaStreamEndCapture")
                if partial is not None:
                    cudart.cudaGraphDestroy(partial)
            except Exception:
                pass
            raise
        graph = check_cuda(cudart.cudaStreamEndCapture(handle), "cudaStreamEndCapture")
        try:
            exe = check_cuda(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        except BaseException:
            cudart.cudaGraphDestroy(graph)
            raise
        return CudaGraph(cudart, graph, exe, self)


class CudaGraph:
    """An instantiated CUDA graph of one engine execution; :meth:`launch` replays it.

    Holds the :class:`EngineRunner` it was captured from (``runner``: the execution
    context the graph runs) and ``buffers``, the runner-owned outputs bound at capture,
    so neither is freed while the graph may still be launched. ``bindings`` are the
    addresses baked in (name -> :class:`BufferView`).
    """

    def __init__(self, cudart, graph, exe, runner: EngineRunner):
        self._cudart, self._graph, self._exe = cudart, graph, exe
        self.runner = runner
        self.buffers: dict[str, DeviceArray] = dict(runner._owned)
        self.bindings: dict[str, BufferView] = dict(runner._bound)

    def launch(self, stream) -> None:
        check_cuda(
            self._cudart.cudaGraphLaunch(self._exe, stream_handle(stream)), "cudaGraphLaunch"
        )

    def __del__(self):
        try:
            self._cudart.cudaGraphExecDestroy(self._exe)
            self._cudart.cudaGraphDestroy(self._graph)
        except Exception:
            pass


def run_steps(engine, feeds_list, *, stream=None):
    """Functional execution of ``engine`` on NumPy feeds, one dict per step.

    Each step copies its feeds to fresh device buffers, binds each ``*_out`` to its
    input (in place), runs, and returns every engine output as NumPy.
    """
    cudart = import_cudart()
    own_stream = stream is None
    handle = (
        int(check_cuda(cudart.cudaStreamCreate(), "cudaStreamCreate"))
        if own_stream
        else stream_handle(stream)
    )
    runner = EngineRunner(engine)
    results = []
    try:
        for step, feeds in enumerate(feeds_list):
            device = {}
            for name in runner.input_names:
                if name not in feeds:
                    raise value_error(
                        f"feeds_list[{step}]",
                        f"every engine input {runner.input_names}",
                        f"missing {name!r}",
                    )
                host = np.array(feeds[name], order="C", copy=None)  # a 0-d input stays 0-d
                device[name] = DeviceArray(host.shape, host.dtype).copy_from(host, handle)
            runner.bind(device)
            runner.execute(handle)
            out = {}
            for name in runner.output_names:
                src = runner.aliases.get(name)
                arr = device[src] if src is not None else runner.output(name)
                out[name] = arr.to_numpy(handle)
            results.append(out)
    finally:
        if own_stream:
            check_cuda(cudart.cudaStreamSynchronize(handle), "cudaStreamSynchronize")
            cudart.cudaStreamDestroy(handle)
    return results
