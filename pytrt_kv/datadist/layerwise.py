"""Layer-wise push: a prefill node pushes each layer's blocks as soon as that layer's KV
is written, so that the transfer overlaps the rest of the prefill (docs/DATADIST.md
"Layer-wise push"; issue 19).

    lw = LayerwisePush(node, src_cache, CacheIndex(2, dst_id), src_blocks, dst_blocks)
    for layer in range(num_layers):
        run_layer(layer)                  # writes layer's KV into src_cache
        lw.layer_ready(layer)             # CPU: posted now; GPU: layer_ready(layer, event)
    tag = lw.wait()                       # every layer in place, then the tag

Each layer is one push of ``KvCacheExtParam((l, l), (l, l), tensor_num_per_layer)``
without a tag; when every layer has completed, one notification carries the tag, so the
destination's ``received(tag)`` means the whole request is in place, as for
``push_kv_blocks``.

Ordering after the engine's writes: on the CPU the caller marks a layer ready when its
writes returned. On a GPU it passes an event recorded on the engine's stream after the
layer (anything with ``query() -> bool``: ``torch.cuda.Event``, CuPy's ``Event``); the
layer is posted once ``query()`` is True, checked in :meth:`poll`, :meth:`layer_ready`
and :meth:`wait`, without synchronizing the stream. **The event path is untested on a
GPU** (none was available); its logic is tested with a fake event on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .contract import check_transfer
from .handles import TransferHandle, _poll_sleep
from .llm_datadist import LlmDataDist
from .node_base import NOTIF, seconds
from .transport import WRITE
from .types import (
    Cache,
    CacheIndex,
    KvCacheExtParam,
    LLMException,
    LLMRole,
    LLMStatus,
    param_invalid,
)


class LayerwisePush:
    """One request's blocks, pushed layer by layer (see the module docstring).

    Parameters
    ----------
    node : LlmDataDist
        A prompt node linked to the destination.
    src_cache : Cache
        The node's cache; layer ``l`` is tensors ``[l * tnpl, (l + 1) * tnpl)``.
    dst_cache_index : CacheIndex
        The destination; its layer ``l`` receives the source's layer ``l``.
    src_blocks, dst_blocks : sequence of int
        As :meth:`LlmDataDist.push_kv_blocks`, the same for every layer.
    tensor_num_per_layer : int
        Default 2 (K and V).
    tag, timeout_s
        As :meth:`LlmDataDist.push_kv_blocks`; ``timeout_s`` bounds :meth:`wait`.

    Raises
    ------
    LLMException
        As ``push_kv_blocks`` (PARAM_INVALID, NOT_YET_LINK, KV_CACHE_NOT_EXIST), checked
        for the whole request before any layer moves.
    """

    def __init__(
        self,
        node: LlmDataDist,
        src_cache: Cache,
        dst_cache_index: CacheIndex,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        tensor_num_per_layer: int = 2,
        *,
        tag: str | None = None,
        timeout_s: float | None = None,
    ):
        if not isinstance(node, LlmDataDist):
            raise TypeError(f"node: expected an LlmDataDist, got {type(node).__name__}")
        node._require()
        if node.role is not LLMRole.PROMPT:
            raise param_invalid("role", "push only from a prompt node", "a decoder node")
        self._node = node
        self._local = node._local_cache("src_cache", src_cache)
        self._peer, self._remote = node._remote_cache("dst_cache_index", dst_cache_index)
        ext = KvCacheExtParam(tensor_num_per_layer=tensor_num_per_layer)
        # The whole request checked once (blocks, layouts, layer counts), then per layer.
        check_transfer(
            self._local.cache_desc,
            self._remote.desc,
            src_blocks,
            dst_blocks,
            ext,
            op="push",
            role=node.role,
        )
        self.num_layers = self._local.cache_desc.num_tensors // int(tensor_num_per_layer)
        self._plans = [
            check_transfer(
                self._local.cache_desc,
                self._remote.desc,
                src_blocks,
                dst_blocks,
                KvCacheExtParam((i, i), (i, i), tensor_num_per_layer),
            )
            for i in range(self.num_layers)
        ]
        self.tag = node._tag(tag)
        # The call's timeout, else the node's rule for the whole request's bytes (a fixed
        # options["timeout_s"], or scaled with the bytes: docs/DATADIST.md).
        self.timeout_s = node._timeout(sum(p.nbytes for p in self._plans), timeout_s)
        self._events: dict[int, Any] = {}  # layer -> event not yet complete
        self._handles: dict[int, TransferHandle] = {}  # layer -> posted push
        self._done = False

    def layer_ready(self, layer: int, event: Any = None) -> None:
        """Layer ``layer``'s KV is written (``event is None``) or will be once ``event``
        completes (``event.query()`` True). Each layer once."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")
        if layer in self._events or layer in self._handles:
            raise ValueError(f"layer: layer {layer} was already marked ready")
        if event is not None and not callable(getattr(event, "query", None)):
            raise TypeError(
                f"event: expected None or an event with query() (torch.cuda.Event), "
                f"got {type(event).__name__}"
            )
        self._events[layer] = event
        self.poll()

    def poll(self) -> bool:
        """Post the layers whose writes completed; True when every layer's push is done."""
        for layer, event in list(self._events.items()):
            if event is None or event.query():
                try:
                    handle = self._node._start(
                        WRITE,
                        "src_cache",
                        self._local,
                        self._peer,
                        self._remote,
                        self._plans[layer],
                        f"{self.tag}#layer{layer}",
                        None,
                        self.timeout_s,
                        notify=False,
                        source_ready=True,
                    )
                except LLMException as exc:
                    if exc.status != LLMStatus.REPEAT_REQUEST:
                        raise
                    continue  # another push of this node writes these blocks: later
                del self._events[layer]
                self._handles[layer] = handle
        if len(self._handles) < self.num_layers:
            return False
        return all(h.done() for h in self._handles.values())

    def wait(self, timeout_s: float | None = None) -> str:
        """Block until every layer is pushed, then send the tag; returns it.

        Raises
        ------
        ValueError
            Some layer was never marked ready (nothing would ever post it).
        LLMException
            TIMEOUT (layers still pending or in flight after ``timeout_s``), or a layer's
            push failed (NOT_YET_LINK, FAILED...).
        """
        if self._done:
            return self.tag
        missing = sorted(set(range(self.num_layers)) - set(self._events) - set(self._handles))
        if missing:
            raise ValueError(f"layer_ready: layers {missing} were never marked ready")
        timeout = self.timeout_s if timeout_s is None else seconds("timeout_s", timeout_s)
        start = time.monotonic()
        while not self.poll():
            if time.monotonic() - start >= timeout:
                for h in self._handles.values():
                    h._release()
                raise LLMException(
                    LLMStatus.TIMEOUT,
                    f"layer-wise push {self.tag!r}: {len(self._events)} layers not ready "
                    f"and {sum(not h.released for h in self._handles.values())} in flight "
                    f"after {timeout} s; the destination blocks are undefined",
                )
            _poll_sleep(start)
        # Every layer is in place at the destination: now the tag.
        notif = (
            f"{NOTIF}|{self._peer.epoch}|{self._remote.cache_id}|{self._remote.generation}|"
            f"{self.tag}"
        )
        self._node._require().notify(self._peer.agent, notif.encode())
        self._done = True
        return self.tag


__all__ = ["LayerwisePush"]
