"""Contract of ScatterPaKvCache (docs/SPEC.md section S): every argument check.

:func:`validate_scatter` is the one check of a call, used identically by the NumPy
reference, :mod:`pytrt_kv.ops` and (through the reference) the CPU runtime; its parts,
one module per concern, are :func:`check_scatter` (shapes, dtypes, attributes: never
reads a value, so graph export calls it alone; :mod:`.shapes`, with the layout choice in
:mod:`.layout` and the S9 rules in :mod:`.quant`), :func:`check_scatter_values`
(:mod:`.values`), :func:`check_scale_values` (:mod:`.quant`) and
:func:`check_scatter_numpy` (:mod:`.host`). Which part runs where: docs/DECISIONS.md
"Validation". :func:`run_segments` is the S6 run geometry, shared by the value checks and
the write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from .. import specs
from ..args import op_call, op_tensors
from .basics import SCATTER_WRITTEN, ScatterMeta, nz_last_dim
from .host import check_scatter_numpy
from .quant import check_scale_values
from .shapes import check_scatter
from .values import check_scatter_values, run_segments

__all__ = [
    "ScatterMeta",
    "validate_scatter",
    "run_segments",
    "SCATTER_WRITTEN",
    "check_scatter",
    "check_scatter_values",
    "check_scale_values",
    "check_scatter_numpy",
    "nz_last_dim",
]


#: The data tensors: a GPU call never copies them back to check values.
_DATA_ARGS = ("key", "value", "key_cache", "value_cache")


#: How :func:`validate_scatter` / ``validate_gather`` reach the index values: "numpy"
#: (the arguments are the NumPy reference's arrays), a function returning a host copy of
#: one tensor (:mod:`pytrt_kv.ops` with ``validate=True``), or None (shapes only).
Read = Literal["numpy"] | Callable[[Any], np.ndarray] | None


@op_call(specs.SCATTER_PA_KV_CACHE, read="numpy")
def validate_scatter(call: dict[str, Any]) -> ScatterMeta:
    """Every rule of docs/SPEC.md S on one call, before anything is written.

    Arguments as :func:`pytrt_kv.reference.scatter_pa_kv_cache` (the signature is the op
    spec's, :func:`pytrt_kv.contract.args.op_call`); ``read`` as :data:`Read`.
    With "numpy" the arguments must also be NumPy arrays, the caches writeable and
    C-contiguous, and no argument may share memory with a cache (:func:`check_scatter_numpy`),
    and a source quantised into an int8 cache must hold no NaN.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, what was expected and what came.
    """
    read: Read = call.pop("read")
    named = op_tensors(specs.SCATTER_PA_KV_CACHE, call)
    meta = check_scatter(**call)
    if read is None:
        return meta
    if read == "numpy":
        check_scatter_numpy(named)
        host = named
        sources = (call["key"], call["value"])
    else:
        fetch = read  # a GPU call: only the index tensors and scales are copied back
        host = {
            k: (None if x is None else fetch(x)) for k, x in named.items() if k not in _DATA_ARGS
        }
        sources = (None, None)
    check_scale_values(meta, host["k_scale"], host["v_scale"], *sources)
    check_scatter_values(
        meta,
        host["slot_mapping"],
        compress_lens=host["compress_lens"],
        compress_seq_offsets=host["compress_seq_offsets"],
        seq_lens=host["seq_lens"],
    )
    return meta
