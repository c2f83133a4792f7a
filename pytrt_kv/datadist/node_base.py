"""What every part of :class:`~pytrt_kv.datadist.LlmDataDist` shares: the options, the
in-band notice names, a linked peer (:class:`Peer`), a fenced one (:class:`Fence`), a kept
plan (:class:`Kept`), and :class:`NodeState`, the node's attributes, which the parts
(:mod:`.caches`, :mod:`.links`, :mod:`.plans`, :mod:`.notices`, :mod:`.llm_datadist`)
read and write (the methods one part calls on another are declared there).
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..contract.errors import describe
from .contract import TransferPlan
from .inflight import span
from .transport import CacheInfo, Prepared, Transport
from .types import Cache, LLMException, LLMRole, LLMStatus, param_invalid

if TYPE_CHECKING:
    from . import control
    from .inflight import Writes

#: Options and their defaults (``LlmDataDist(..., options={...})``).
DEFAULT_OPTIONS: dict[str, Any] = {
    # Default timeout of push/pull and wait(): None scales it with the bytes moved,
    # timeout_min_s + nbytes / timeout_floor_bytes_per_s (docs/DATADIST.md, "Failure semantics").
    "timeout_s": None,
    "timeout_min_s": 5.0,
    "timeout_floor_bytes_per_s": 64 << 20,  # 64 MiB/s: 2 GiB may take 37 s
    "wait_timeout_s": 60.0,  # default of wait_received (a failed push ends it earlier)
    "control_timeout_s": 2.0,  # each control-channel request (link, table, drop, bye)
    # The cluster's shared secret (str or bytes; None: the environment variable
    # PYTRT_KV_DATADIST_SECRET, else none: loopback only; docs/DATADIST.md "Security").
    "llm_datadist.auth_secret": None,
    # With no secret, listen on a non-loopback address anyway (anyone who reaches the port
    # can read and write every registered cache).
    "llm_datadist.allow_unauthenticated": False,
    # How long memory stays quarantined for a fenced peer that never answers (docs/SPEC.md D8).
    "llm_datadist.fence_timeout_s": 300.0,
    "local.latency_s": 0.0,  # "local" backend: simulated transfer latency
    "nixl.backends": ["UCX"],  # "nixl" backend: NIXL backends to create
    "nixl.num_threads": 0,
    # NIXL's progress thread: on, sleeping up to this long between idle checks (0: NIXL's
    # default, a busy loop that burns a core per node; docs/DATADIST.md "Idle CPU").
    "nixl.progress_thread": True,
    "nixl.progress_delay_us": 1000,
}
SECRET_ENV = "PYTRT_KV_DATADIST_SECRET"

#: In-band notices (NIXL notifications); each names the link epoch it belongs to and is
#: accepted only from the NIXL agent authenticated for that epoch (docs/SPEC.md D7, D8):
#: a tag ``_NOTIF|epoch|cache_id|generation|tag``; a failure ``_FAIL|epoch|status|tag``
#: (docs/DATADIST.md, "The receiver sees failures"); a deallocation sent with the data
#: path ``_DROP|epoch|from|cache_id|generation`` and its acknowledgement ``_DACK|...``;
#: an unlink the control channel could not deliver ``_BYE|epoch|from`` and its
#: acknowledgement ``_BACK|epoch|from``.
NOTIF = "pytrt_kv.dd2"
DROP = "pytrt_kv.dd2drop"
DACK = "pytrt_kv.dd2dack"
FAIL = "pytrt_kv.dd2fail"
BYE = "pytrt_kv.dd2bye"
BACK = "pytrt_kv.dd2back"
#: Failure notices kept for tags nobody waits on (a notice may outlive its tag's wait).
MAX_FAILED = 4096
#: While a transfer is pending, check this often whether the peer is still there.
PROBE_EVERY_S = 0.2


def checked_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """:data:`DEFAULT_OPTIONS` updated with ``options``, whose keys and values are checked
    (ValueError/TypeError naming the key)."""
    opts = dict(DEFAULT_OPTIONS)
    unknown = sorted(set(options or {}) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(
            f"options: unknown keys {unknown}; expected some of {sorted(DEFAULT_OPTIONS)}"
        )
    opts.update(options or {})
    for key, least in (
        ("timeout_min_s", 0.0),
        ("timeout_floor_bytes_per_s", 1.0),
        ("llm_datadist.fence_timeout_s", 0.0),
    ):
        v = opts[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= least:
            raise ValueError(f"options[{key!r}]: expected a number >= {least}, got {v!r}")
    if opts["timeout_s"] is not None:
        seconds("options['timeout_s']", opts["timeout_s"])
    seconds("options['wait_timeout_s']", opts["wait_timeout_s"])
    seconds("options['control_timeout_s']", opts["control_timeout_s"], finite=True)
    if not isinstance(opts["llm_datadist.allow_unauthenticated"], bool):
        raise TypeError(
            f"options['llm_datadist.allow_unauthenticated']: expected a bool, got "
            f"{opts['llm_datadist.allow_unauthenticated']!r}"
        )
    secret_of(opts)  # a secret of the wrong type is refused here, not at initialize
    return opts


def seconds(arg: str, value: Any, finite: bool = False) -> float:
    """A timeout argument: a number > 0 (``inf``: no limit, unless ``finite``), as a float.

    Raises
    ------
    LLMParamInvalid
        PARAM_INVALID (also a ValueError) naming ``arg``: a bool, a non-number, NaN, 0 or
        less, or inf where ``finite``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or (finite and value == float("inf"))
    ):
        got = repr(value) if isinstance(value, (int, float)) else describe(value)
        what = "a finite number of seconds > 0" if finite else "a number of seconds > 0"
        raise param_invalid(arg, what + ("" if finite else " (inf: no limit)"), got)
    return float(value)


def secret_of(options: dict[str, Any]) -> bytes:
    """The cluster's secret: the option, else the environment variable, else b""."""
    v = options["llm_datadist.auth_secret"]
    if v is None:
        v = os.environ.get(SECRET_ENV) or b""
    if isinstance(v, str):
        v = v.encode()
    if not isinstance(v, bytes):
        raise TypeError(
            f"options['llm_datadist.auth_secret']: expected a str or bytes, got {describe(v)}"
        )
    return v


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Peer:
    cluster_id: int
    agent: str
    address: tuple[str, int]
    #: This link's epoch: chosen by the side that linked, sent in the authenticated
    #: hello; every in-band notice names it (a relink gets a new one).
    epoch: str = ""
    caches: dict[int, CacheInfo] = field(default_factory=dict)
    broken: bool = False
    #: Transport metadata not loaded yet (a link request is answered before it is).
    pending: str | None = None
    load_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Fence:
    """A peer unlinked without hearing it (docs/SPEC.md D8): its epoch no longer counts
    (its notices are ignored), it is told in-band, and until it acknowledges, links
    again, is found gone, or ``fence_timeout_s`` passes, every cache it knew (generation
    up to ``generation``) stays quarantined when deallocated."""

    peer: Peer
    generation: int
    until: float
    next_try: float = 0.0


def dst_key(op: str, me: int, local: Cache, peer: Peer, remote: CacheInfo) -> tuple:
    """The destination cache of a transfer, ``(cluster id, cache id, generation)``: the
    peer's cache for a push (``op`` "WRITE"/"push"), this node's for a pull (``me``: this
    node's cluster id). Transfers in flight are tracked by it (:mod:`.inflight`)."""
    if op in ("WRITE", "push"):
        return (peer.cluster_id, remote.cache_id, remote.generation)
    return (me, local.cache_id, local.generation)


class Kept:
    """A checked plan kept for repeated requests (decision 12) with what its posts need,
    resolved once: the local cache, peer and remote :class:`CacheInfo` it was checked
    against (used only while they are still this node's, :meth:`LlmDataDist._resolve`), the
    tag notification's prefix (with the link epoch), the destination's key
    (:func:`dst_key`) and the transport's :class:`Prepared` (decision 13)."""

    __slots__ = (
        "local", "peer", "remote", "plan", "notif", "epoch", "dst_key", "span", "copies",
        "small", "prepared", "closed", "fast",
    )  # fmt: skip

    def __init__(self, local: Cache, peer: Peer, remote: CacheInfo, plan: TransferPlan, key: tuple):
        self.local, self.peer, self.remote, self.plan = local, peer, remote, plan
        self.epoch = peer.epoch
        self.notif = f"{NOTIF}|{peer.epoch}|{remote.cache_id}|{remote.generation}|".encode()
        self.dst_key = key
        self.span = span(plan)  # the destination tensors [lo, hi)
        self.copies = plan.num_copies
        #: Pushed by push_kv_blocks' small-push path: blocks to move, of host memory (a
        #: device source waits for its stream first).
        self.small = bool(plan.num_copies) and local.cache_desc.placement != "device"
        self.prepared: Prepared | None = None
        self.closed = False
        #: What the C small-push path (plugins/python/smallpush.c) reads of this plan, fixed for its
        #: life: one attribute instead of one per field (each costs ~30 ns from C).
        self.fast = (
            local, local.cache_id, peer, peer.cluster_id, remote, remote.cache_id, self.epoch,
            plan, self.notif, key, self.span[0], self.span[1], self.small,
        )  # fmt: skip

    def close(self) -> None:
        """The node no longer keeps this plan: release what its transport kept."""
        self.closed = True
        if self.prepared is not None:
            self.prepared.close()


class NodeState:
    """The node's attributes (set by ``LlmDataDist.__init__``) and the methods its parts
    call on each other."""

    cluster_id: int
    role: LLMRole
    backend: str
    options: dict[str, Any]
    listen_address: tuple[str, int] | None
    _lock: threading.RLock
    _transport: Transport | None
    _server: control.ControlServer | None
    _auth: control.Auth | None
    _caches: dict[int, Cache]
    _peers: dict[int, Peer]
    #: NIXL agent name -> the linked peer it was authenticated for.
    _by_agent: dict[str, Peer]
    _fences: dict[int, Fence]
    _quarantine: dict[int, tuple[Cache, set[int]]]
    _plans: dict[tuple, Kept]
    _fast: tuple
    _writes: Writes
    _received: set
    _stale: set
    _failed: dict[str, str]
    _drained_at: float
    _last_generation: int
    _ids: Iterator[int]
    _generations: Iterator[int]

    def _require(self) -> Transport:
        if self._transport is None:
            raise LLMException(LLMStatus.FAILED, "call initialize() first")
        return self._transport

    def _control_timeout(self) -> float:
        return float(self.options["control_timeout_s"])

    # Defined by the parts (declared here for the others and for mypy).
    def _drain(self) -> None:
        raise NotImplementedError

    def _metadata(self) -> dict[str, Any]:
        raise NotImplementedError

    def _acknowledged(self, cluster_id: int, cache_id: int | None = None) -> None:
        raise NotImplementedError

    def _forget_remote_cache(self, peer: Peer, cache_id: int, generation: int) -> None:
        raise NotImplementedError

    def _drop_plans(self, match: Any) -> None:
        raise NotImplementedError

    def _unlink_peer(self, peer: Peer, heard: bool) -> None:
        raise NotImplementedError

    def _release_fence(self, cluster_id: int, keep_agent: bool = False) -> None:
        raise NotImplementedError

    def _tell_unlink(self, peer: Peer) -> None:
        raise NotImplementedError

    def _send_failure(self, peer: Peer, status: LLMStatus, tag: str) -> None:
        raise NotImplementedError

    def _transfer_error(
        self, exc: LLMException, arg: str, local: Cache, peer: Peer
    ) -> LLMException:
        raise NotImplementedError

    def _backend_failure(self, exc: LLMException, peer: Peer) -> LLMException:
        raise NotImplementedError

    def _reconnect(self, peer: Peer) -> None:
        raise NotImplementedError

    def _peer_alive(self, peer: Peer) -> bool:
        raise NotImplementedError

    def _review_fences(self, force: bool = False) -> None:
        raise NotImplementedError

    def _release_memory(self, cache: Cache, retain: bool = False) -> None:
        raise NotImplementedError

    def _local_cache(self, arg: str, cache: Any) -> Cache:
        raise NotImplementedError

    def _remote_cache(self, arg: str, index: Any) -> tuple[Peer, CacheInfo]:
        raise NotImplementedError
