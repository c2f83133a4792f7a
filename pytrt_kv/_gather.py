"""Old import path of GatherSelectionKvCache's checks and reference (kept for callers).

The checks and the G5 planner are :mod:`pytrt_kv.contract.gather`, the data movement is
:func:`pytrt_kv.reference.gather_selection_kv_cache` (docs/ARCHITECTURE.md); new code
imports those.
"""

from .contract.gather import (
    GATHER_ARG_NAMES,
    GATHER_READ_OR_WRITTEN,
    GATHER_WRITTEN,
    MAX_TOPK,
    GatherMeta,
    RowPlan,
    check_gather,
    check_gather_numpy,
    check_gather_values,
    id_size,
    plan_row,
)
from .reference import gather_selection_kv_cache

__all__ = [
    "GatherMeta",
    "RowPlan",
    "MAX_TOPK",
    "GATHER_WRITTEN",
    "GATHER_READ_OR_WRITTEN",
    "GATHER_ARG_NAMES",
    "check_gather",
    "check_gather_values",
    "check_gather_numpy",
    "plan_row",
    "id_size",
    "gather_selection_kv_cache",
]
