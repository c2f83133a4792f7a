"""Block push/pull between prefill and decode nodes (docs/SPEC.md D; CANN LLM-DataDist's
PushKvBlocks/PullKvBlocks API over NIXL).

- :mod:`.types`: :class:`CacheDesc`, :class:`Cache`, :class:`CacheIndex`,
  :class:`KvCacheExtParam`, :class:`LLMRole`, :class:`LLMStatus`, :class:`LLMException`,
  :class:`LinkResult`.
- :mod:`.contract`: the D4 checks in one place, the transfer plan, and the NumPy
  reference :func:`push_kv_blocks_reference` the backends are tested against.
- :mod:`.llm_datadist`: :class:`LlmDataDist`, the node (links, caches, transfers, tags).
- :mod:`.layerwise`: :class:`LayerwisePush`, a request pushed layer by layer.
- :mod:`.transport` (``"local"``, in-process) and :mod:`.nixl_transport` (``"nixl"``).

``import pytrt_kv.datadist`` does not import nixl; a ``backend="nixl"`` node does.
See docs/DATADIST.md.
"""

from .backends import nixl_unavailable_reason
from .contract import TransferPlan, check_transfer, push_kv_blocks_reference
from .layerwise import LayerwisePush
from .llm_datadist import DEFAULT_OPTIONS, LlmDataDist, TransferHandle
from .types import (
    Cache,
    CacheDesc,
    CacheIndex,
    KvCacheExtParam,
    LinkResult,
    LLMException,
    LLMParamInvalid,
    LLMRole,
    LLMStatus,
)

__all__ = [
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "KvCacheExtParam",
    "LinkResult",
    "LLMException",
    "LLMParamInvalid",
    "LLMRole",
    "LLMStatus",
    "LayerwisePush",
    "LlmDataDist",
    "TransferHandle",
    "TransferPlan",
    "DEFAULT_OPTIONS",
    "check_transfer",
    "push_kv_blocks_reference",
    "nixl_unavailable_reason",
]
