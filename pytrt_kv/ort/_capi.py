"""ONNX Runtime's C custom-op ABI from Python (ctypes): an ``OrtCustomOp`` table whose
entries are Python callbacks, and the few ``OrtApi`` functions a kernel needs.

Why ctypes (docs/GRAPH_MODE.md, "ONNX Runtime"): onnxruntime-extensions' Python custom
ops (``onnx_op``/PyOp) refuse float16, bfloat16 and float8 tensors ("Type float16 not
supported by python customops api") and return outputs through ``tolist()``; our caches
are float16/bfloat16/float8 and large. The C ABI has no such limit. onnxruntime-extensions
still carries the ops into a session: its library exports ``RegisterCustomOps`` (what
``SessionOptions.register_custom_ops_library`` calls) and ``AddExternalCustomOp``, which
queues an ``OrtCustomOp`` for its domain ``ai.onnx.contrib``.

The layout below is the C header's (``onnxruntime_c_api.h``, ``ORT_API_VERSION`` 29): the
``OrtApi`` table only grows at its end, so the indices of these entries (all from API
version 1) hold for every ONNX Runtime release; ``OrtCustomOp`` is read by ONNX Runtime up
to the fields its ``version`` names (16 here: ``CreateKernelV2``/``KernelComputeV2``
return a status, so a refusal reaches the caller as an error, not a crash).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..contract import dtypes

#: ``OrtCustomOp::version`` we fill in (the fields up to ``GetEndVersion`` exist).
CUSTOM_OP_VERSION = 16
#: Domain of onnxruntime-extensions' ``AddExternalCustomOp`` (its ``c_OpDomain``).
EXTENSIONS_DOMAIN = "ai.onnx.contrib"

#: ``OrtApi`` entries: index of the function pointer in the table.
_API = {
    "CreateStatus": 0,
    "GetErrorMessage": 2,
    "GetTensorMutableData": 51,
    "GetTensorElementType": 60,
    "GetDimensionsCount": 61,
    "GetDimensions": 62,
    "GetTensorTypeAndShape": 65,
    "KernelContext_GetInputCount": 88,
    "KernelContext_GetOutputCount": 89,
    "KernelContext_GetInput": 90,
    "KernelContext_GetOutput": 91,
    "ReleaseStatus": 93,
    "ReleaseTensorTypeAndShapeInfo": 99,
}
#: ``OrtCustomOp`` fields, in order (8 bytes each on a 64-bit ABI; ``version`` is a
#: uint32 padded to 8).
_OP_FIELDS = (
    "version",
    "CreateKernel",
    "GetName",
    "GetExecutionProviderType",
    "GetInputType",
    "GetInputTypeCount",
    "GetOutputType",
    "GetOutputTypeCount",
    "KernelCompute",
    "KernelDestroy",
    "GetInputCharacteristic",
    "GetOutputCharacteristic",
    "GetInputMemoryType",
    "GetVariadicInputMinArity",
    "GetVariadicInputHomogeneity",
    "GetVariadicOutputMinArity",
    "GetVariadicOutputHomogeneity",
    "CreateKernelV2",
    "KernelComputeV2",
    "InferOutputShapeFn",
    "GetStartVersion",
    "GetEndVersion",
    "GetMayInplace",
    "ReleaseMayInplace",
    "GetAliasMap",
    "ReleaseAliasMap",
)
REQUIRED, OPTIONAL = 0, 1  # OrtCustomOpInputOutputCharacteristic
ORT_FAIL, ORT_INVALID_ARGUMENT = 1, 2  # OrtErrorCode

_vp, _sz, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "CreateStatus": (_vp, _int, ctypes.c_char_p),
    "GetErrorMessage": (ctypes.c_char_p, _vp),
    "GetTensorMutableData": (_vp, _vp, ctypes.POINTER(_vp)),
    "GetTensorElementType": (_vp, _vp, ctypes.POINTER(_int)),
    "GetDimensionsCount": (_vp, _vp, ctypes.POINTER(_sz)),
    "GetDimensions": (_vp, _vp, ctypes.POINTER(ctypes.c_int64), _sz),
    "GetTensorTypeAndShape": (_vp, _vp, ctypes.POINTER(_vp)),
    "KernelContext_GetInputCount": (_vp, _vp, ctypes.POINTER(_sz)),
    "KernelContext_GetOutputCount": (_vp, _vp, ctypes.POINTER(_sz)),
    "KernelContext_GetInput": (_vp, _vp, _sz, ctypes.POINTER(_vp)),
    "KernelContext_GetOutput": (
        _vp,
        _vp,
        _sz,
        ctypes.POINTER(ctypes.c_int64),
        _sz,
        ctypes.POINTER(_vp),
    ),
    "ReleaseStatus": (None, _vp),
    "ReleaseTensorTypeAndShapeInfo": (None, _vp),
}


class OrtApi:
    """The ``OrtApi`` functions a kernel uses, each raising RuntimeError on a status."""

    def __init__(self, address: int):
        table = ctypes.cast(address, ctypes.POINTER(_vp))
        self._fn = {
            name: ctypes.CFUNCTYPE(*_SIGNATURES[name])(table[index]) for name, index in _API.items()
        }

    def _call(self, name: str, *args) -> None:
        status = self._fn[name](*args)
        if status:
            message = self._fn["GetErrorMessage"](status).decode(errors="replace")
            self._fn["ReleaseStatus"](status)
            raise RuntimeError(f"onnxruntime {name}: {message}")

    def status(self, code: int, message: str) -> int:
        """A new ``OrtStatus*`` (ONNX Runtime takes ownership when it is returned)."""
        return int(self._fn["CreateStatus"](code, message.encode()) or 0)

    def _count(self, name: str, context: int) -> int:
        n = _sz()
        self._call(name, context, ctypes.byref(n))
        return n.value

    def input_count(self, context: int) -> int:
        return self._count("KernelContext_GetInputCount", context)

    def output_count(self, context: int) -> int:
        return self._count("KernelContext_GetOutputCount", context)

    def input(self, context: int, index: int) -> np.ndarray | None:
        """Input ``index`` as a NumPy view of ONNX Runtime's buffer (None when absent)."""
        value = _vp()
        self._call("KernelContext_GetInput", context, index, ctypes.byref(value))
        return None if not value.value else self._array(value.value)

    def output(self, context: int, index: int, shape: tuple[int, ...]) -> np.ndarray | None:
        """Output ``index`` allocated with ``shape``, as a writable NumPy view (None when
        the node does not produce it)."""
        value = _vp()
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._call("KernelContext_GetOutput", context, index, dims, len(shape), ctypes.byref(value))
        return None if not value.value else self._array(value.value)

    def _array(self, value: int) -> np.ndarray:
        info = _vp()
        self._call("GetTensorTypeAndShape", value, ctypes.byref(info))
        try:
            elem = _int()
            self._call("GetTensorElementType", info, ctypes.byref(elem))
            rank = _sz()
            self._call("GetDimensionsCount", info, ctypes.byref(rank))
            dims = (ctypes.c_int64 * max(rank.value, 1))()
            self._call("GetDimensions", info, dims, rank.value)
        finally:
            self._fn["ReleaseTensorTypeAndShapeInfo"](info)
        shape = tuple(int(d) for d in dims[: rank.value])
        dtype = dtypes.numpy_of_onnx(elem.value, "onnxruntime tensor")
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.empty(shape, dtype)
        data = _vp()
        self._call("GetTensorMutableData", value, ctypes.byref(data))
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(data.value or 0))
        return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype).reshape(shape)


_c = ctypes.CFUNCTYPE
_PROTOTYPES: dict[str, Any] = {
    "CreateKernel": _c(_vp, _vp, _vp, _vp),
    "GetName": _c(_vp, _vp),
    "GetExecutionProviderType": _c(_vp, _vp),
    "GetInputType": _c(_int, _vp, _sz),
    "GetInputTypeCount": _c(_sz, _vp),
    "GetOutputType": _c(_int, _vp, _sz),
    "GetOutputTypeCount": _c(_sz, _vp),
    "KernelCompute": _c(None, _vp, _vp),
    "KernelDestroy": _c(None, _vp),
    "GetInputCharacteristic": _c(_int, _vp, _sz),
    "GetOutputCharacteristic": _c(_int, _vp, _sz),
    "GetInputMemoryType": _c(_int, _vp, _sz),
    "GetVariadicInputMinArity": _c(_int, _vp),
    "GetVariadicInputHomogeneity": _c(_int, _vp),
    "GetVariadicOutputMinArity": _c(_int, _vp),
    "GetVariadicOutputHomogeneity": _c(_int, _vp),
    "CreateKernelV2": _c(_vp, _vp, _vp, _vp, ctypes.POINTER(_vp)),
    "KernelComputeV2": _c(_vp, _vp, _vp),
}

#: Compute function of a registered op: (api, kernel context) -> None; raises on refusal.
Compute = Callable[[OrtApi, int], None]


class CustomOp:
    """One ``OrtCustomOp`` (kept alive as long as the process: ONNX Runtime and the
    extensions library hold its address).

    ``input_types``/``output_types`` are ONNX element types; ``optional_inputs`` /
    ``optional_outputs`` the indices that may be absent. ``compute`` runs on every call;
    an exception it raises becomes the call's error status, and :func:`take_error`
    gives the exception object back to the thread that sees the error.
    """

    def __init__(
        self,
        name: str,
        input_types: list[int],
        output_types: list[int],
        optional_inputs: set[int],
        optional_outputs: set[int],
        compute: Compute,
    ):
        self.name = name
        self._name = ctypes.create_string_buffer(name.encode())
        self._provider = ctypes.create_string_buffer(b"CPUExecutionProvider")
        self._api: OrtApi | None = None
        self._api_address = 0
        ins, outs = list(input_types), list(output_types)

        def create_kernel_v2(op, api, info, kernel):
            try:
                if api != self._api_address:
                    self._api, self._api_address = OrtApi(api), api
                kernel[0] = ctypes.addressof(self._name)
                return None
            except Exception as exc:  # noqa: BLE001 - becomes ONNX Runtime's error status
                return _fail(self._api, exc)

        def compute_v2(kernel, context):
            assert self._api is not None  # set by create_kernel_v2 before any compute
            try:
                compute(self._api, context)
                return None
            except Exception as exc:  # noqa: BLE001 - becomes ONNX Runtime's error status
                return _fail(self._api, exc)

        impl: dict[str, Callable[..., Any]] = {
            "CreateKernel": lambda op, api, info: ctypes.addressof(self._name),
            "GetName": lambda op: ctypes.addressof(self._name),
            "GetExecutionProviderType": lambda op: ctypes.addressof(self._provider),
            "GetInputType": lambda op, i: ins[i],
            "GetInputTypeCount": lambda op: len(ins),
            "GetOutputType": lambda op, i: outs[i],
            "GetOutputTypeCount": lambda op: len(outs),
            "KernelCompute": lambda kernel, context: None,  # unused: version >= 16 uses V2
            "KernelDestroy": lambda kernel: None,
            "GetInputCharacteristic": lambda op, i: OPTIONAL if i in optional_inputs else REQUIRED,
            "GetOutputCharacteristic": lambda op, i: (
                OPTIONAL if i in optional_outputs else REQUIRED
            ),
            "GetInputMemoryType": lambda op, i: 0,  # OrtMemTypeDefault
            "GetVariadicInputMinArity": lambda op: 1,
            "GetVariadicInputHomogeneity": lambda op: 1,
            "GetVariadicOutputMinArity": lambda op: 1,
            "GetVariadicOutputHomogeneity": lambda op: 1,
            "CreateKernelV2": create_kernel_v2,
            "KernelComputeV2": compute_v2,
        }
        self._callbacks = {k: _PROTOTYPES[k](fn) for k, fn in impl.items()}
        self.table = (_vp * len(_OP_FIELDS))()
        self.table[0] = CUSTOM_OP_VERSION
        for i, field in enumerate(_OP_FIELDS[1:], start=1):
            cb = self._callbacks.get(field)
            self.table[i] = ctypes.cast(cb, _vp).value if cb is not None else None

    @property
    def address(self) -> int:
        return ctypes.addressof(self.table)


_errors_lock = threading.Lock()
#: message -> exception raised by a compute function, until the caller takes it back.
_errors: dict[str, BaseException] = {}


def _fail(api: OrtApi | None, exc: BaseException) -> int | None:
    message = str(exc)
    with _errors_lock:
        if len(_errors) > 64:  # errors nobody took back (a caller outside make_session)
            _errors.clear()
        _errors[message] = exc
    if api is None:
        return None
    code = ORT_INVALID_ARGUMENT if isinstance(exc, (ValueError, TypeError)) else ORT_FAIL
    return api.status(code, message)


def take_error(ort_message: str) -> BaseException | None:
    """The exception a compute function raised whose message ``ort_message`` (ONNX
    Runtime's error text) contains, removed from the record; None when there is none."""
    with _errors_lock:
        for message in sorted(_errors, key=len, reverse=True):
            if message and message in ort_message:
                return _errors.pop(message)
    return None


def extensions_library() -> str:
    """Path of onnxruntime-extensions' custom-op library (ImportError naming the package
    when it is not installed)."""
    spec = importlib.util.find_spec("onnxruntime_extensions._extensions_pydll")
    if spec is None or not spec.origin:
        raise ImportError(
            "onnxruntime-extensions: expected the package (it registers pytrt_kv's ops with "
            "ONNX Runtime: pip install onnxruntime-extensions, or the [polygraphy] extra), "
            "got none installed"
        )
    return spec.origin


_added_lock = threading.Lock()
_added: dict[str, CustomOp] = {}


def add_op(op: CustomOp) -> None:
    """Queue ``op`` in onnxruntime-extensions' library once per process (every session
    that registers the library afterwards gets it)."""
    with _added_lock:
        if op.name in _added:
            return
        lib = ctypes.CDLL(extensions_library())
        lib.AddExternalCustomOp.restype = ctypes.c_bool
        lib.AddExternalCustomOp.argtypes = [_vp]
        if not lib.AddExternalCustomOp(op.address):
            raise RuntimeError(f"onnxruntime-extensions: AddExternalCustomOp({op.name}) failed")
        _added[op.name] = op


def added(name: str) -> bool:
    with _added_lock:
        return name in _added
