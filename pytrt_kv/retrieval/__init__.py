"""RetrievalKV: retrieval-based sparse decode with KV offload (docs/SPEC.md R).

The first tokens (init) and a sliding window (local) are always attended; the tokens
between are cut into blocks of ``block_size``, each reduced to a representation (by
default "lowrank": the block's keys projected on a basis calibrated once per model,
:func:`calibrate_basis`); at every decode step the blocks are scored with the current
query and the top ``topk_percent`` are recalled (GatherSelectionKvCache with TBS = block
size, from a full cache that may live in pinned host memory) and attended with init and
local.

- :mod:`.config`: :class:`RetrievalConfig` (R1, ``from_env``), ``mode_for`` (R2),
  ``partition`` (R3), ``num_selected`` (R4);
- :mod:`.reference`: representations (and the "lowrank" basis, :func:`calibrate_basis`),
  scoring, selection and the NumPy reference :func:`sparse_decode_attention` (R5, R6);
- :mod:`.planner`: host planner that feeds GatherSelectionKvCache and tracks offload;
- the ONNX decode step, :func:`onnx_export.retrieval.build_retrieval_decode_step`, lives
  in the export layer (docs/ARCHITECTURE.md: pytrt_kv never imports onnx_export);
- :mod:`.study` (extra ``study``, a package): accuracy study on SmolLM2-135M
  (``pytrt-kv study``).
"""

from .config import (
    DENSE,
    LOWRANK,
    MASS,
    MEAN,
    MINMAX,
    REPRESENTATIONS,
    SPARSE,
    SPARSE_OFFLOAD,
    Partition,
    RetrievalConfig,
)
from .planner import RetrievalPlanner, RetrievalSizes
from .reference import (
    block_representations,
    block_scores,
    calibrate_basis,
    dense_attention,
    group_query,
    score_blocks,
    select_blocks,
    sparse_decode_attention,
)

__all__ = [
    "RetrievalConfig",
    "Partition",
    "DENSE",
    "SPARSE",
    "SPARSE_OFFLOAD",
    "LOWRANK",
    "MINMAX",
    "MEAN",
    "MASS",
    "REPRESENTATIONS",
    "block_representations",
    "block_scores",
    "calibrate_basis",
    "dense_attention",
    "group_query",
    "score_blocks",
    "select_blocks",
    "sparse_decode_attention",
    "RetrievalPlanner",
    "RetrievalSizes",
]
