"""Types of the block-push API (names of CANN LLM-DataDist, Pythonic values).

docs/SPEC.md D1 (caches), D2 (layers), D5 (statuses).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..contract.dtypes import NUMPY, name_of


class LLMStatus(enum.IntEnum):
    """Result codes of LLM-DataDist (``LLM_SUCCESS`` ... without the prefix)."""

    SUCCESS = 0
    PARAM_INVALID = 1
    NOT_YET_LINK = 2
    TIMEOUT = 3
    KV_CACHE_NOT_EXIST = 4
    FAILED = 5
    #: A transfer into blocks that one of this node's transfers still writes (docs/SPEC.md
    #: D8, "Two writers"); nothing was posted.
    REPEAT_REQUEST = 6


class LLMException(Exception):
    """A refused or failed call: ``status`` (:class:`LLMStatus`) and a message.

    ``PARAM_INVALID`` errors are raised as :class:`LLMParamInvalid`, which is also a
    ``ValueError``, so code that catches bad arguments the usual way catches them too.
    """

    def __init__(self, status: LLMStatus, message: str):
        super().__init__(f"{LLMStatus(status).name}: {message}")
        self.status = LLMStatus(status)
        self.message = message

    def __reduce__(self):  # picklable across processes (multiprocessing results)
        return (type(self), (self.status, self.message))


class LLMParamInvalid(LLMException, ValueError):
    """``PARAM_INVALID``: an argument breaks docs/SPEC.md D4; nothing was transferred."""

    def __init__(self, message: str):
        super().__init__(LLMStatus.PARAM_INVALID, message)

    def __reduce__(self):
        return (type(self), (self.message,))


def param_invalid(arg: str, expected: str, got: Any) -> LLMParamInvalid:
    """``LLMParamInvalid("arg: expected ..., got ... (docs/SPEC.md D4)")``."""
    return LLMParamInvalid(f"{arg}: expected {expected}, got {got} (docs/SPEC.md D4)")


class LinkResult(NamedTuple):
    """One cluster's result of ``link_clusters`` (an entry of CANN's ``rets``); a tuple,
    so it goes into JSON as ``[status, cluster_id, message]``.

    Attributes
    ----------
    status : LLMStatus
        SUCCESS, or why this cluster was not linked (FAILED: unreachable within the
        timeout, refused, the same cluster id, another backend).
    cluster_id : int or None
        The peer's cluster id once linked (it is learned from the peer), else None.
    message : str
        Empty on success, else the reason.
    """

    status: LLMStatus
    cluster_id: int | None
    message: str = ""

    @property
    def ok(self) -> bool:
        """True when the cluster is linked."""
        return self.status is LLMStatus.SUCCESS


class LLMRole(str, enum.Enum):
    """A node's role: only a PROMPT node pushes, only a DECODER node pulls (D4)."""

    PROMPT = "prompt"
    DECODER = "decoder"

    @classmethod
    def of(cls, role: Any) -> LLMRole:
        if isinstance(role, cls):
            return role
        if isinstance(role, str) and role.lower() in ("prompt", "decoder"):
            return cls(role.lower())
        raise TypeError(
            f"role: expected LLMRole.PROMPT/DECODER or 'prompt'/'decoder', got {role!r}"
        )


#: Where a cache lives. ``"host"``: host memory (pinned or pageable; NIXL "DRAM");
#: ``"device"``: CUDA device memory (NIXL "VRAM").
PLACEMENTS = ("host", "device")


@dataclass(frozen=True)
class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and dtype (docs/SPEC.md D1).

    Parameters
    ----------
    num_tensors : int
        Tensors of the cache, layer-major: with ``tensor_num_per_layer = 2``, tensors
        ``2l`` and ``2l+1`` are layer ``l``'s K and V.
    shape : tuple of int
        ``[NB, ...]``: ``shape[0]`` is the block count; block ``b`` of a tensor is its
        contiguous row ``t[b]``, ``block_bytes = prod(shape[1:]) * itemsize`` bytes.
    data_type : dtype
        Any dtype :func:`pytrt_kv.dtypes.name_of` accepts (NumPy/ml_dtypes, torch or a
        name such as ``"bfloat16"``); stored as its name.
    placement : {"host", "device"}
    device : int
        CUDA device of a ``"device"`` cache (ignored for host caches).

    Examples
    --------
    >>> CacheDesc(4, (4, 16), "int32").block_bytes
    64
    """

    num_tensors: int
    shape: tuple[int, ...]
    data_type: Any = "float16"
    placement: str = "host"
    device: int = 0

    def __post_init__(self):
        nt = self.num_tensors
        if isinstance(nt, bool) or not isinstance(nt, (int, np.integer)) or nt < 1:
            raise ValueError(f"num_tensors: expected an int >= 1, got {nt!r}")
        object.__setattr__(self, "num_tensors", int(nt))
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError):
            raise TypeError(f"shape: expected a sequence of ints, got {self.shape!r}") from None
        if len(shape) < 1 or any(d < 1 for d in shape):
            raise ValueError(
                f"shape: expected [NB, ...] with every dimension >= 1 (a block "
                f"holds bytes), got {list(shape)}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data_type", name_of(self.data_type))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: expected one of {PLACEMENTS}, got {self.placement!r}")
        object.__setattr__(self, "device", int(self.device))

    @property
    def num_blocks(self) -> int:
        """NB = ``shape[0]``."""
        return self.shape[0]

    @property
    def dtype(self) -> np.dtype:
        return NUMPY[self.data_type]

    @property
    def block_bytes(self) -> int:
        # math.prod: exact, and ~30x faster than np.prod (three calls per push check).
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def tensor_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict:
        return {
            "num_tensors": self.num_tensors,
            "shape": list(self.shape),
            "data_type": self.data_type,
            "placement": self.placement,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CacheDesc:
        return cls(
            d["num_tensors"], tuple(d["shape"]), d["data_type"], d["placement"], d.get("device", 0)
        )


@dataclass(frozen=True)
class CacheIndex:
    """Names a cache of a linked node: ``(cluster_id, cache_id)``.

    ``batch_index`` exists for LLM-DataDist's non-block caches; block transfers address
    blocks by id, so it must be 0.
    """

    cluster_id: int
    cache_id: int
    batch_index: int = 0


@dataclass(frozen=True)
class KvCacheExtParam:
    """Layer ranges of a transfer (docs/SPEC.md D2).

    ``(-1, -1)`` means every layer; otherwise ``(first, second)`` with
    ``0 <= first <= second <= num_tensors / tensor_num_per_layer - 1`` on its own side.
    ``tensor_num_per_layer`` must divide ``num_tensors`` on both sides, also with the
    default ranges (D4): a 1-tensor cache takes ``tensor_num_per_layer=1``.
    """

    src_layer_range: tuple[int, int] = (-1, -1)
    dst_layer_range: tuple[int, int] = (-1, -1)
    tensor_num_per_layer: int = 2


@dataclass(eq=False)
class Cache:
    """A cache this node owns (from ``allocate_cache`` or ``register_cache``).

    Attributes
    ----------
    cache_id : int
        Unique in its :class:`LlmDataDist` for its whole life (never reused).
    cache_desc : CacheDesc
    tensor_addrs : tuple of int
        Address of each tensor's first block (host or device address per placement).
    tensors : list
        The arrays: NumPy arrays for allocated host caches (read and write them freely),
        the caller's objects for registered ones (kept alive while registered).
    generation : int
        Changes whenever a cache id is bound to new memory; peers compare it (D5).
    """

    cache_id: int
    cache_desc: CacheDesc
    tensor_addrs: tuple[int, ...]
    tensors: list = field(repr=False, default_factory=list)
    generation: int = 0
    owned: bool = field(default=False, repr=False)
    _keepalive: Any = field(default=None, repr=False)
    _backend_state: Any | None = field(default=None, repr=False)
    #: Its CacheInfo, made once at registration (a push needs it; building a frozen
    #: dataclass per push costs ~1 us).
    _info: Any = field(default=None, repr=False)
