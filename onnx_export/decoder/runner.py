"""Running the graphs: a paged cache handed out by :class:`BlockAllocator` and greedy
generation by :class:`DecoderRunner` on the CPU runtime (``pytrt_kv.runtime``: the NumPy
reference for our ops, ONNX's reference evaluator for the rest); ``save_graphs`` writes
both graphs with one shared weight file."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from .export import export_decoder
from .families import decoder_spec
from .graph import dtype_of, is_held
from .sparse import reps_width, selection_width

#: The bound on |our logits - transformers' logits|, relative to the largest |logit| of
#: the step (at least 1), per ``dtype`` (docs/YOUR_MODEL.md "Tolerances"). Half types
#: may also pick another token at a near tie (within the bound of the best).
LOGIT_RTOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}


def logit_bound(dtype: str, reference: np.ndarray) -> float:
    """The absolute bound for logits compared with ``reference`` (``LOGIT_RTOL``)."""
    return LOGIT_RTOL[dtype] * max(1.0, float(np.abs(reference).max()))


def compare_greedy(
    got: list[int], logits: np.ndarray, want: list[int], want_logits: np.ndarray, dtype: str
) -> tuple[bool, int, float, float]:
    """Our greedy tokens and logits ``[tokens, V]`` against the reference's:
    ``(ok, first differing step or len, largest logit difference up to it, bound)``. A
    differing token is ok only in a half type at a near tie of the reference."""
    n = len(got)
    same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), n)
    bound = logit_bound(dtype, want_logits[: same + 1])
    diff = float(np.abs(logits[: same + 1] - want_logits[: same + 1]).max())
    ok = diff <= bound
    if same < n:
        row = want_logits[same]
        ok = ok and dtype != "float32" and float(row.max() - row[got[same]]) <= bound
    return ok, same, diff, bound


class BlockAllocator:
    """Pages of ``block_size`` slots handed out as sequences grow (a free list, as a
    serving engine keeps one); block 0 is never handed out, it pads the block tables."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: expected >= 2, got {num_blocks}")
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: list[list[int]] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        return len(self.tables) - 1

    def slot(self, seq: int, position: int) -> int:
        """The cache slot of ``position`` of ``seq``, taking a new page when it starts one."""
        table = self.tables[seq]
        page = position // self.block_size
        while len(table) <= page:
            if not self.free:
                raise ValueError(
                    f"num_blocks: the paged cache is full ({len(self.tables)} sequences, "
                    f"{sum(map(len, self.tables))} pages); give more blocks"
                )
            table.append(self.free.pop())
        return table[page] * self.block_size + position % self.block_size

    def block_tables(self, width: int | None = None) -> np.ndarray:
        """``[sequences, width]`` (default: the longest table), padded with page 0."""
        need = max(1, max(len(t) for t in self.tables))
        if width is None:
            width = need
        elif width < need:
            raise ValueError(
                f"max_pages: a sequence needs {need} pages, more than the block-table "
                f"width {width}; export with a larger max_pages"
            )
        out = np.zeros((len(self.tables), width), np.int32)
        for b, t in enumerate(self.tables):
            out[b, : len(t)] = t
        return out


def check_capacity(
    lengths: list[int],
    tokens: int,
    *,
    block_size: int,
    num_blocks: int,
    max_positions: int | None = None,
) -> None:
    """Refuse, by name, prompts of ``lengths`` that with ``tokens`` new tokens each need
    more pages than ``num_blocks - 1`` (page 0 pads) or positions past the model's."""
    if not lengths or min(lengths) < 1:
        raise ValueError("prompts: expected at least one non-empty prompt")
    if tokens < 1:
        raise ValueError(f"tokens: expected >= 1, got {tokens}")
    # The last generated token is never written: positions [0, len + tokens - 1).
    need = sum(-(-(n + tokens - 1) // block_size) for n in lengths)
    if need > num_blocks - 1:
        raise ValueError(
            f"num_blocks: {len(lengths)} prompts of {sum(lengths)} tokens plus {tokens} "
            f"new tokens each need {need} pages of {block_size} tokens, the cache has "
            f"{num_blocks - 1} (num_blocks {num_blocks}, page 0 pads); give --num-blocks "
            f">= {need + 1}"
        )
    longest = max(lengths) + tokens - 1
    if max_positions is not None and longest > max_positions:
        raise ValueError(
            f"tokens: the longest prompt ({max(lengths)}) plus {tokens} tokens reaches "
            f"position {longest - 1}, past the model's max_position_embeddings {max_positions}"
        )


@dataclass
class Generation:
    tokens: list[list[int]]
    texts: list[str]
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.tokens)
        return n / max(self.prefill_s + self.decode_s, 1e-9)


def _weights_as_inputs(graph: onnx.ModelProto) -> onnx.ModelProto:
    """The graph the CPU runtime runs: the held weights declared as inputs (fed from
    :attr:`DecoderRunner.weights` at each step, by reference: no copy)."""
    out = onnx.ModelProto()
    out.CopyFrom(graph)
    held = [t for t in out.graph.initializer if is_held(t)]
    kept = [t for t in out.graph.initializer if not is_held(t)]
    out.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in held
    )
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


class DecoderRunner:
    """Greedy generation with the prefill and decode graphs of ``model`` on the CPU
    runtime; the caches live here and are replaced by each step's ``*_out``.
    ``last_logits``: the ``[B, V]`` float32 logits of each step of the last generate().
    ``retrieval``, ``max_pages``, ``basis``: the sparse graphs (``export_decoder``;
    ``basis``: the per-layer "lowrank" basis, ``calibrate_lowrank``)."""

    def __init__(
        self,
        model: Any,
        *,
        block_size: int = 16,
        num_blocks: int = 64,
        kv_cache_dtype: str = "float32",
        scales: dict[str, np.ndarray] | None = None,
        retrieval: Any = None,
        max_pages: int | None = None,
        dtype: str = "float32",
        basis: Any = None,
    ):
        from pytrt_kv import runtime  # noqa: PLC0415

        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks: expected an int >= 2, got {num_blocks!r}")
        self.shape = decoder_spec(model.config)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache_dtype, self.dtype = kv_cache_dtype, dtype
        self.retrieval, self.max_pages = retrieval, max_pages
        self.last_logits: list[np.ndarray] = []
        if kv_cache_dtype == "fp8" and scales is None:
            raise ValueError("scales: expected k_scale_<i>/v_scale_<i> arrays for fp8 caches")
        kw = dict(
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            retrieval=retrieval,
            dtype=dtype,
            basis=basis,
        )
        self.weights: dict[str, np.ndarray] = {}
        kw["held"] = self.weights
        self.prefill_graph = export_decoder(model, **kw)
        self.decode_graph = export_decoder(model, decode=True, max_pages=max_pages, **kw)
        self._prefill = runtime.make_evaluator(_weights_as_inputs(self.prefill_graph))
        self._decode = runtime.make_evaluator(_weights_as_inputs(self.decode_graph))
        self.scales = dict(scales or {})

    def full_graph(self, which: str) -> onnx.ModelProto:
        """A copy of the ``"prefill"`` or ``"decode"`` graph with its weights inside
        (the runner's graphs declare them; :attr:`weights` holds them once for both)."""
        from onnx import numpy_helper  # noqa: PLC0415

        graphs = {"prefill": self.prefill_graph, "decode": self.decode_graph}
        if which not in graphs:
            raise ValueError(f"which: expected 'prefill' or 'decode', got {which!r}")
        out = onnx.ModelProto()
        out.CopyFrom(graphs[which])
        for t in out.graph.initializer:
            if is_held(t):
                t.CopyFrom(numpy_helper.from_array(self.weights[t.name], t.name))
        return out

    def _caches(self, batch: int = 0) -> dict[str, np.ndarray]:
        """The state the graphs update: paged caches; with retrieval, the page
        representations and, for ``batch`` sequences, their selection caches (K pages
        each, fresh status)."""
        import ml_dtypes  # noqa: PLC0415

        s = self.shape
        shape = (self.num_blocks, self.block_size, s.kv_heads, s.head_dim)
        act = dtype_of(self.dtype)[0]
        dt = ml_dtypes.float8_e4m3fn if self.kv_cache_dtype == "fp8" else act
        out = {
            f"{k}_cache_{i}": np.zeros(shape, dt) for i in range(s.layers) for k in ("key", "value")
        }
        if self.retrieval is None:
            return out
        sel_k = selection_width(self.retrieval, self.max_pages)
        for i in range(s.layers):
            out[f"key_reps_{i}"] = np.zeros(
                (self.num_blocks, reps_width(self.retrieval, s.kv_heads, s.head_dim)), np.float32
            )
            for k in ("key", "value"):
                out[f"sel_{k}_{i}"] = np.zeros((batch * sel_k, self.block_size, s.kd), act)
            out[f"sel_status_{i}"] = np.full((batch, 1, sel_k + 1), -1, np.int32)
        return out

    @staticmethod
    def _prefill_feeds(alloc: BlockAllocator, prompts: list[list[int]]):
        """(sequence ids, prefill feeds) of ``prompts`` flattened into one batch."""
        seqs = [alloc.add_sequence() for _ in prompts]
        positions = [i for p in prompts for i in range(len(p))]
        batch = [b for b, p in zip(seqs, prompts) for _ in p]
        feeds = {
            "input_ids": np.array([t for p in prompts for t in p], np.int64),
            "positions": np.array(positions, np.int64),
            "token_batch": np.array(batch, np.int64),
            "slot_mapping": np.array(
                [alloc.slot(b, i) for b, i in zip(batch, positions)], np.int32
            ),
            "block_tables": alloc.block_tables(),
            "last_token": np.cumsum([len(p) for p in prompts]).astype(np.int64) - 1,
        }
        return seqs, feeds

    def _step(self, evaluator, graph, feeds, caches) -> np.ndarray:
        names = [o.name for o in graph.graph.output]
        wanted = {i.name for i in graph.graph.input}
        state = {n: v for n, v in caches.items() if n in wanted}
        run = {**feeds, **state, **self.scales, **self.weights}
        out = dict(zip(names, evaluator.run(None, run)))
        for name in state:
            if f"{name}_out" in out:  # sel_block_tables is only read
                caches[name] = out[f"{name}_out"]
        return out["logits"]

    def generate(
        self, prompts: list[list[int]], tokens: int
    ) -> tuple[list[list[int]], float, float]:
        """``tokens`` greedy tokens after each prompt (token ids), all prompts in one
        batch: one prefill of the flattened prompts, then one decode step per token.
        Returns the tokens and the prefill and decode seconds."""
        check_capacity(
            [len(p) for p in prompts],
            tokens,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_positions=self.shape.max_positions,
        )
        alloc = BlockAllocator(self.num_blocks, self.block_size)
        caches = self._caches(len(prompts))
        seqs, feeds = self._prefill_feeds(alloc, prompts)
        if self.retrieval is not None:
            sel_k = selection_width(self.retrieval, self.max_pages)
            # Row b owns selection pages [b*K, (b+1)*K).
            caches["sel_block_tables"] = np.arange(len(prompts) * sel_k, dtype=np.int32).reshape(
                len(prompts), sel_k
            )
        t0 = time.perf_counter()
        logits = self._step(self._prefill, self.prefill_graph, feeds, caches)
        t1 = time.perf_counter()
        self.last_logits = [logits]
        out = [[int(x)] for x in logits.argmax(-1)]
        lens = [len(p) for p in prompts]
        for _ in range(tokens - 1):
            pos = list(lens)
            feeds = {
                "input_ids": np.array([o[-1] for o in out], np.int64),
                "positions": np.array(pos, np.int64),
                "slot_mapping": np.array([alloc.slot(b, p) for b, p in zip(seqs, pos)], np.int32),
                "block_tables": alloc.block_tables(self.max_pages),
                "seq_lens": np.array([p + 1 for p in pos], np.int32),
            }
            logits = self._step(self._decode, self.decode_graph, feeds, caches)
            self.last_logits.append(logits)
            for o, x in zip(out, logits.argmax(-1)):
                o.append(int(x))
            lens = [n + 1 for n in lens]
        self.last_caches = caches
        return out, t1 - t0, time.perf_counter() - t1

    def calibrate(self, prompts: list[list[int]]) -> dict[str, np.ndarray]:
        """Per-layer, per-head fp8 scales ``amax / 448`` of the keys (after RoPE) and
        values this float32 runner writes for ``prompts`` (one prefill)."""
        if self.kv_cache_dtype != "float32" or self.dtype != "float32":
            raise ValueError("calibrate: expected a float32 runner (it reads the float caches)")
        alloc = BlockAllocator(self.num_blocks, self.block_size)
        caches = self._caches()
        _, feeds = self._prefill_feeds(alloc, prompts)
        slots = feeds["slot_mapping"]
        self._step(self._prefill, self.prefill_graph, feeds, caches)
        out = {}
        s = self.shape
        for i in range(s.layers):
            for kind, name in (("k", "key"), ("v", "value")):
                rows = caches[f"{name}_cache_{i}"].reshape(-1, s.kv_heads, s.head_dim)
                amax = np.abs(rows[slots]).max(axis=(0, 2))
                out[f"{kind}_scale_{i}"] = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
        return out


def save_graphs(runner: DecoderRunner, folder: str | os.PathLike) -> tuple[str, str]:
    """Write ``prefill.onnx`` and ``decode.onnx`` into ``folder`` with their weights in one
    shared external file ``llama_weights.bin`` (the two graphs name them alike)."""
    from pathlib import Path  # noqa: PLC0415

    from onnx.external_data_helper import convert_model_to_external_data  # noqa: PLC0415

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    data = "llama_weights.bin"
    pre = runner.full_graph("prefill")
    convert_model_to_external_data(
        pre, all_tensors_to_one_file=True, location=data, size_threshold=4096
    )
    onnx.save(pre, str(out / "prefill.onnx"))
    where = {}
    for t in pre.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            where[t.name] = {e.key: e.value for e in t.external_data}
    del pre
    dec = runner.decode_graph  # its weights are in the prefill's file: refer to them
    dec_out = onnx.ModelProto()
    dec_out.CopyFrom(dec)
    dec = dec_out
    for t in dec.graph.initializer:
        ext = where.get(t.name)
        if ext is None or t.name.startswith("c_"):
            continue
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        for k, v in ext.items():
            t.external_data.add(key=k, value=v)
    missing = [
        t.name
        for t in dec.graph.initializer
        if t.data_location == TensorProto.EXTERNAL and t.name not in where
    ]
    if missing:
        raise ValueError(f"runner: decode weights {missing[:3]} are not in the prefill graph")
    onnx.save(dec, str(out / "decode.onnx"))
    return str(out / "prefill.onnx"), str(out / "decode.onnx")
