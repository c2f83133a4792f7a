"""The quantised cache dtypes of ScatterPaKvCache (docs/SPEC.md S9), one row each.

A float ``key`` / ``value`` written with a scale into a cache of one of these dtypes
becomes ``convert(clamp(float32(x) / float32(scale[h]), -max, max))``. The NumPy
reference, the contract's validators and the generated C++ header
(``scripts/gen_contract_header.py``, ``kQUANT_*``) read this table; the NumPy, ONNX and
TensorRT types are those of :mod:`.dtypes` (one mapping for every dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from . import dtypes, limits, specs


@dataclass(frozen=True)
class QuantDtype:
    """One quantised cache dtype (docs/SPEC.md S9).

    Attributes
    ----------
    name : str
        dtype name (specs.py spelling).
    max : float
        M, the clamp bound: ``|q| <= M``.
    integer : bool
        True when ``convert`` rounds to an integer (int8), False for a float8.
    rounding : str
        How ``convert`` rounds.
    nan : str
        What a NaN source element becomes.
    nan_bits : int
        The byte a kernel writes for a NaN source element: e4m3's canonical NaN ``0x7F``;
        0 for int8, where the reference refuses a NaN source and the kernels, which trust
        the data, write 0.
    """

    name: str
    max: float
    integer: bool
    rounding: str
    nan: str
    nan_bits: int

    @property
    def numpy(self) -> np.dtype:
        """NumPy / ml_dtypes dtype."""
        return dtypes.NUMPY[self.name]

    @property
    def onnx(self) -> int:
        """``onnx.TensorProto`` data type number."""
        return dtypes.ONNX[self.name]

    @property
    def tensorrt(self) -> str:
        """Name of the ``tensorrt.DataType`` member."""
        return dtypes.TENSORRT[self.name]

    @property
    def code(self) -> int:
        """``kernels::DataType`` value."""
        return limits.DTYPE_CODES[self.name]


#: Every quantised cache dtype, by name (the order of specs.SCATTER_QUANT_CACHE_DTYPES).
QUANT: Mapping[str, QuantDtype] = {
    q.name: q
    for q in (
        QuantDtype(
            specs.FLOAT8_E4M3,
            448.0,
            integer=False,
            rounding="to nearest, ties to even; float8 subnormals kept",
            nan="written as 0x7F (the canonical e4m3 NaN, sign dropped)",
            nan_bits=0x7F,
        ),
        QuantDtype(
            specs.INT8,
            127.0,
            integer=True,
            rounding="to the nearest integer, ties to even",
            nan="refused by the reference (int8 has no NaN); the kernels write 0",
            nan_bits=0x00,
        ),
    )
}
