"""The op's names as docs/SPEC.md spells them, written out once for the tests that pin them
(section O, S1, G1): the tests compare the package's specs, plans and graphs against these,
so they stay a copy independent of ``pytrt_kv.contract.specs``."""

from __future__ import annotations

SCATTER_INPUTS = (
    "key",
    "value",
    "key_cache",
    "value_cache",
    "slot_mapping",
    "compress_lens",
    "compress_seq_offsets",
    "seq_lens",
    "k_scale",
    "v_scale",
)
GATHER_INPUTS = (
    "selection_k_rope",
    "selection_kv_cache",
    "selection_kv_block_table",
    "selection_kv_block_status",
    "selection_topk_indices",
    "full_k_rope",
    "full_kv_cache",
    "full_kv_block_table",
    "full_kv_actual_seq",
    "full_q_actual_seq",
)
# The gather writes these three inputs in place (G1 outputs *_out); it only reads the rest.
GATHER_WRITTEN = ("selection_k_rope", "selection_kv_cache", "selection_kv_block_status")
GATHER_READ_ONLY = tuple(n for n in GATHER_INPUTS if n not in GATHER_WRITTEN)

# GatherSelectionParams (pytrt_kv/_cuda): the pointers the plan reads or writes, which the
# kernel refuses as null while there are rows to gather (the caches and k_rope aside).
GATHER_PLAN_POINTERS = (
    "selectionKvBlockTable",
    "selectionKvBlockStatus",
    "selectionTopkIndices",
    "fullKvBlockTable",
    "fullKvActualSeq",
    "selectionKvActualSeq",
    "workspace",
)
