"""Old import path of ScatterPaKvCache's checks and reference (kept for callers).

The checks are :mod:`pytrt_kv.contract.scatter`, the data movement is
:func:`pytrt_kv.reference.scatter_pa_kv_cache` (docs/ARCHITECTURE.md); new code imports
those.
"""

from .contract.scatter import (
    SCATTER_WRITTEN,
    ScatterMeta,
    check_scatter,
    check_scatter_numpy,
    check_scatter_values,
    nz_last_dim,
)
from .reference import scatter_pa_kv_cache

__all__ = [
    "ScatterMeta",
    "SCATTER_WRITTEN",
    "check_scatter",
    "check_scatter_values",
    "check_scatter_numpy",
    "scatter_pa_kv_cache",
    "nz_last_dim",
]
