"""dtype names (specs.py) <-> NumPy / ml_dtypes, ONNX and TensorRT types.

NumPy has no bfloat16 or float8; those are the ``ml_dtypes`` types (docs/SPEC.md S8).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from . import specs

#: dtype name -> NumPy dtype.
NUMPY: dict[str, np.dtype] = {
    specs.FLOAT32: np.dtype(np.float32),
    specs.FLOAT16: np.dtype(np.float16),
    specs.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    specs.INT8: np.dtype(np.int8),
    specs.UINT8: np.dtype(np.uint8),
    specs.FLOAT8_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    specs.FLOAT8_E5M2: np.dtype(ml_dtypes.float8_e5m2),
    specs.INT32: np.dtype(np.int32),
    specs.INT64: np.dtype(np.int64),
}

#: dtype name -> ``onnx.TensorProto`` data type number (kept numeric so that this
#: module does not import onnx).
ONNX: dict[str, int] = {
    specs.FLOAT32: 1,
    specs.UINT8: 2,
    specs.INT8: 3,
    specs.INT32: 6,
    specs.INT64: 7,
    specs.FLOAT16: 10,
    specs.BFLOAT16: 16,
    specs.FLOAT8_E4M3: 17,
    specs.FLOAT8_E5M2: 19,
}
ONNX_TO_NAME: dict[int, str] = {v: k for k, v in ONNX.items()}

#: dtype name -> name of the ``tensorrt.DataType`` member (looked up lazily).
TENSORRT: dict[str, str] = {
    specs.FLOAT32: "FLOAT",
    specs.FLOAT16: "HALF",
    specs.BFLOAT16: "BF16",
    specs.INT8: "INT8",
    specs.UINT8: "UINT8",
    specs.FLOAT8_E4M3: "FP8",
    specs.INT32: "INT32",
    specs.INT64: "INT64",
}


def name_of(dtype: Any) -> str:
    """Name (specs.py spelling) of a NumPy/ml_dtypes dtype, torch dtype or dtype name.

    Raises
    ------
    TypeError
        If the dtype is not one pytrt_kv knows.
    """
    if isinstance(dtype, str) and dtype in NUMPY:
        return dtype
    mod = type(dtype).__module__
    if mod.startswith("torch"):
        text = str(dtype).replace("torch.", "")
        if text in NUMPY:
            return text
        raise TypeError(
            f"dtype: torch dtype {dtype} is not supported; expected one of {sorted(NUMPY)}"
        )
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"dtype: expected a NumPy, ml_dtypes or torch dtype, got {dtype!r}"
        ) from None
    for name, known in NUMPY.items():
        if dt == known:
            return name
    raise TypeError(f"dtype: {dt} is not supported; expected one of {sorted(NUMPY)}")


def numpy_dtype(name_or_dtype: Any) -> np.dtype:
    """NumPy dtype for a dtype name or any dtype :func:`name_of` accepts."""
    return NUMPY[name_of(name_or_dtype)]


def itemsize(name_or_dtype: Any) -> int:
    return numpy_dtype(name_or_dtype).itemsize


def numpy_of_onnx(elem_type: int, arg: str = "dtype") -> np.dtype:
    """NumPy dtype of an ONNX tensor type: pytrt_kv's own types (bfloat16 and float8 as
    ml_dtypes), else whatever ONNX maps it to (graphs hold standard ops too).

    Raises
    ------
    TypeError
        Naming ``arg`` when ONNX has no NumPy equivalent for the type.
    """
    name = ONNX_TO_NAME.get(int(elem_type))
    if name is not None:
        return NUMPY[name]
    import onnx

    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(elem_type)))
    except (KeyError, ValueError, TypeError):
        raise TypeError(
            f"{arg}: expected an ONNX tensor type with a NumPy equivalent, got "
            f"type number {int(elem_type)}"
        ) from None
