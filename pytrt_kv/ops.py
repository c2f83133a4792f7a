"""GPU eager API: the two reference functions on GPU buffers, in place (layer 2 from Python).

Same signatures as :mod:`pytrt_kv.reference` (docs/SPEC.md S1 and G1) plus keyword-only
``stream=None`` and ``validate=False``. Buffers may be torch tensors, CuPy arrays, PyCUDA
GPUArrays or anything exposing ``__cuda_array_interface__`` or DLPack; the full caches of
the gather may also be pinned host memory (a pinned torch CPU tensor, CuPy pinned memory,
or host memory registered with ``cudaHostRegister``), read by the kernel through unified
addressing.

- Every call is checked by the reference's own ``validate_scatter`` / ``validate_gather``
  (:mod:`pytrt_kv.contract`): shapes, dtypes and attributes on the host, without reading
  values or synchronizing; index values are read back and checked too only with
  ``validate=True``, which synchronizes ``stream``.
  Without it, invalid index values never make the kernels write outside the caches
  (docs/SPEC.md S7, G4), but the result is unspecified.
- ``stream``: a torch or CuPy stream, a cuda-python stream, an int ``cudaStream_t``, or
  None for the framework's current stream (torch's for torch tensors, CuPy's for CuPy
  arrays, else the legacy default stream).
- CUDA graphs: both calls are capturable (no synchronization, no allocation) once warm:
  the gather keeps a grow-only workspace per (device, stream), allocated on the first
  call with a given size. Make one call with the largest sizes on the capture stream
  before capturing; pass ``out=`` so that the gather allocates no output during capture.

- Outputs: the gather returns ``selection_kv_actual_seq``. Without ``out=`` it comes
  from the framework of ``selection_kv_cache`` (torch's or CuPy's caching allocator),
  else from a per-(device, stream) pool of pytrt_kv's own device arrays: a result that
  is dropped gives its memory back to the pool and the next call on that stream reuses
  it, so a steady-state decode loop makes no ``cudaMalloc``/``cudaFree`` per call
  (``cudaFree`` synchronizes the device). Keep a result referenced while another stream
  still reads it (torch's ``record_stream`` rule). Passing ``out=`` allocates nothing.
- Buffers are checked before anything is allocated, read or written: negative dims,
  byte counts that overflow an int64, zero strides (elements sharing memory), read-only
  buffers (``__cuda_array_interface__`` ``data[1]``) where the call writes, and the
  kernels' 32-bit limits (docs/SPEC.md G2: B*S*K, B*S, a token row's bytes) are
  ValueErrors naming the argument and its shape.

- Thread safety: nothing here locks the caches. Calls (and :class:`Launch` replays) that
  update the same caches from several threads or streams must be serialized by the
  caller (one stream, or events between streams); an argument that shares memory with
  a cache the call writes is refused up front (ValueError naming both).

Importing this module needs neither torch nor CuPy; the kernel library is loaded on first
use, with ``pytrt_kv._lib``'s error (which lists the searched paths) if it is missing.

Examples
--------
>>> import torch, pytrt_kv.ops as ops                                  # doctest: +SKIP
>>> key = torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
>>> cache = torch.zeros(16, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
>>> ops.scatter_pa_kv_cache(key, key.clone(), cache, cache.clone(),
...                         torch.tensor([3, 17, -1, 40], device="cuda", dtype=torch.int32))
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

import numpy as np

from . import _cuda
from ._cuda import Buffer
from .contract import dtypes, specs
from .contract.alias import buffer_range, check_no_alias
from .contract.args import op_args, op_call, op_tensors
from .contract.errors import describe, value_error
from .contract.gather import GATHER_WRITTEN, check_gather, validate_gather
from .contract.scatter import SCATTER_WRITTEN, validate_scatter
from .reference import plan_row

__all__ = [
    "scatter_pa_kv_cache",
    "gather_selection_kv_cache",
    "gather_workspace_size",
    "prepare_scatter",
    "prepare_gather",
    "Launch",
]

_WORKSPACES = _cuda.WorkspaceCache()
#: The gather's own outputs (no out=, no framework allocator): reused per stream.
_OUTPUTS = _cuda.OutputPool()


def _buffers(named: dict[str, Any]) -> dict[str, Buffer | None]:
    return {k: (None if v is None else _cuda.buffer(k, v)) for k, v in named.items()}


def _place(bufs: dict[str, Buffer | None], host_ok: tuple = ()) -> int:
    """Check contiguity and memory placement; return the device of the call."""
    for name, buf in bufs.items():
        if buf is not None and buf.strides is not None and buf.nbytes:
            zero = [i for i, (d, st) in enumerate(zip(buf.shape, buf.strides)) if d > 1 and st == 0]
            if zero:
                # Elements that share memory: a kernel writing them races with itself
                # (and reads them as one); refused with the shape, like any strided buffer.
                raise value_error(
                    name,
                    "a C-contiguous buffer whose elements do not overlap",
                    f"{describe(buf)} with strides {list(buf.strides)} (stride 0 on dim "
                    f"{zero[0]}: its {buf.shape[zero[0]]} entries are one memory)",
                )
        if buf is not None and not buf.contiguous:
            raise value_error(
                name,
                "a C-contiguous (dense row-major) buffer; call "
                ".contiguous() / cupy.ascontiguousarray() first",
                f"a strided {describe(buf)}",
            )
    device = None
    for name, buf in bufs.items():
        if buf is None or buf.nbytes == 0:
            continue
        if not (_cuda._is_torch(buf.obj) and buf.kind == _cuda.DEVICE):
            _cuda.locate(buf)
        if buf.kind == _cuda.HOST:
            raise value_error(
                name,
                "GPU memory" + (" or pinned host memory" if name in host_ok else ""),
                "pageable host memory"
                + (" (pin it: tensor.pin_memory() or cudaHostRegister)" if name in host_ok else ""),
            )
        if buf.kind == _cuda.PINNED:
            if name not in host_ok:
                raise value_error(
                    name,
                    "GPU memory (only the full caches may be pinned host memory)",
                    "pinned host memory",
                )
            continue
        if device is None:
            device = buf.device
        elif buf.device != device:
            raise value_error(
                name,
                f"a buffer on cuda:{device} like the other arguments",
                f"a buffer on cuda:{buf.device}",
            )
    if device is None:
        raise value_error("arguments", "at least one non-empty GPU buffer", "none")
    return device


def _check_writable(bufs: dict[str, Buffer | None], written: tuple) -> None:
    """A buffer its producer marks read-only (``__cuda_array_interface__`` ``data[1]``, a
    NumPy array that is not writeable) is refused where the call writes it."""
    for name in written:
        buf = bufs.get(name)
        if buf is not None and buf.readonly and buf.nbytes:
            raise value_error(
                name,
                "a writable buffer (the call writes it in place)",
                f"a read-only {describe(buf)} (its __cuda_array_interface__ data[1] is True)",
            )


def _check_alias(bufs: dict[str, Buffer | None], written: tuple) -> None:
    """The reference's aliasing rule (pytrt_kv.contract.alias) on the addresses the kernel uses:
    placed buffers are dense, so their byte ranges are exact."""
    check_no_alias(
        {k: (None if b is None else buffer_range(b.ptr, b.nbytes)) for k, b in bufs.items()},
        written,
    )


def _ptr(buf: Buffer | None) -> int | None:
    return None if buf is None or buf.nbytes == 0 else buf.ptr


def _torch_compiling(x: Any) -> bool:
    """Whether ``x`` is a torch tensor seen by torch.compile's tracer (docs/GRAPH_MODE.md,
    "torch.compile")."""
    torch = sys.modules.get("torch")
    if torch is None or not type(x).__module__.startswith("torch"):
        return False
    return bool(torch.compiler.is_compiling())


def _torch_ops() -> Any:
    """``torch.ops.pytrt_kv``, whose ops ``import pytrt_kv.torch_ops`` registers (that
    module calls this one for CUDA tensors, so this one does not import it)."""
    import torch

    ns = torch.ops.pytrt_kv
    if not hasattr(ns, "scatter_pa_kv_cache_"):
        raise RuntimeError(
            "pytrt_kv.ops under torch.compile: expected the torch ops registered (import "
            "pytrt_kv.torch_ops before compiling), got torch.ops.pytrt_kv without them"
        )
    return ns


def scatter_pa_kv_cache(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    *,
    compress_lens: Any = None,
    compress_seq_offsets: Any = None,
    seq_lens: Any = None,
    cache_layout: str | None = None,
    compress_mode: str | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    stream: Any = None,
    validate: bool = False,
) -> None:
    """Write new key/value tokens into a paged KV cache on the GPU, in place (docs/SPEC.md S).

    Parameters
    ----------
    key : GPU buffer, ``[T, H, Dk]`` or ``[B, Smax, H, Dk]`` (compressing write)
    value : GPU buffer or None, ``[T, H, Dv]`` or ``[B, Smax, H, Dv]``
    key_cache : GPU buffer, nd ``[NB, BS, H, Dk]`` | nz ``[NB, H*Dk/L, BS, L]`` |
        hnd ``[NB, H, BS, Dk]`` | compress ``[NB, BS, 1, Dk]``; updated in place
    value_cache : GPU buffer or None, as key_cache with Dv; updated in place
    slot_mapping : GPU buffer, int32/int64 ``[T]`` or ``[B, H]``; negative = padding
    compress_lens, compress_seq_offsets, seq_lens : GPU buffers, ``[B, H]``, ``[B*H]``,
        ``[B]`` (4-D key only)
    cache_layout : {"nd", "nz", "hnd"} or None (auto-detected from the shapes)
    compress_mode : {"rope", "omni", "alibi"} or None
    k_scale, v_scale : GPU buffers or None, float32 ``[]`` or ``[H]`` (3-D key only)
        Quantise key (value) on write into a float8_e4m3fn or int8 cache (docs/SPEC.md S9).
        The kernel trusts their values (finite, > 0) unless ``validate=True``.
    stream : stream object, int handle or None (the framework's current stream)
    validate : bool
        Read the index values (and scales) back and apply every value rule of the
        reference (raises ValueError like the reference; synchronizes ``stream``). The
        data is not read: a NaN quantised into an int8 cache becomes 0 (the reference
        refuses it).

    Raises
    ------
    ValueError, TypeError
        Shapes, dtypes, placement or contiguity (and index values with validate=True);
        ValueError naming both arguments when an argument shares memory with a cache.
    FileNotFoundError
        The kernel library is not installed.
    RuntimeError
        No CUDA driver or GPU (the message says so), or another CUDA error.

    Notes
    -----
    Not synchronized: calls on the same caches from several threads or streams must be
    serialized by the caller (one stream, or events between them).
    """
    if stream is None and not validate and _torch_compiling(key):
        # Under torch.compile the ctypes launch cannot be traced: the registered op
        # (pytrt_kv/torch_ops.py) keeps the call in the graph and runs this function.
        _torch_ops().scatter_pa_kv_cache_(
            key, value, key_cache, value_cache, slot_mapping, compress_lens,
            compress_seq_offsets, seq_lens, cache_layout, compress_mode, k_scale, v_scale,
        )  # fmt: skip
        return
    launch = prepare_scatter(
        **op_args(specs.SCATTER_PA_KV_CACHE, locals()), stream=stream, validate=validate
    )
    launch()


class Launch:
    """One prepared kernel call: arguments checked, Params built, stream resolved.

    Calling it enqueues the kernel again with the same buffers (whatever values they
    hold now), without any Python-side checks: for benchmarks and tight loops.
    ``result`` is what the eager function returns (the gather's actual_seq buffer).
    """

    def __init__(
        self,
        fn_name: str,
        params: Any,
        stream: int,
        device: int,
        what: str,
        result: Any = None,
        keepalive: Any = None,
    ):
        self.fn = getattr(_cuda.kernels(), fn_name) if params is not None else None
        self.params, self.stream, self.device = params, stream, device
        self.what, self.result, self._keepalive = what, result, keepalive
        self._ref = ctypes.byref(params) if params is not None else None

    def __call__(self) -> Any:
        if self.fn is not None:
            _cuda.check_status(self.fn(self._ref, self.stream, self.device), self.what)
        return self.result


@op_call(specs.SCATTER_PA_KV_CACHE, stream=None, validate=False)
def prepare_scatter(call: dict[str, Any]) -> Launch:
    """Check a scatter call like :func:`scatter_pa_kv_cache` (same arguments: the op spec's
    signature, :func:`pytrt_kv.contract.args.op_call`) and return it as a :class:`Launch`
    without enqueuing it."""
    stream, validate = call.pop("stream"), call.pop("validate")
    named = op_tensors(specs.SCATTER_PA_KV_CACHE, call)
    bufs = _buffers(named)

    @functools.cache
    def site() -> tuple[int, int]:
        """Placement, aliasing and the stream: after the shape checks (no GPU work on a
        malformed call), before the first value is read back."""
        _check_writable(bufs, SCATTER_WRITTEN)
        device = _place(bufs)
        _check_alias(bufs, SCATTER_WRITTEN)
        return device, _cuda.resolve_stream(stream, list(named.values()), device)

    meta = validate_scatter(
        **bufs,
        cache_layout=call["cache_layout"],
        compress_mode=call["compress_mode"],
        read=(lambda b: _cuda.read_back(b, site()[1])) if validate else None,
    )
    device, handle = site()
    p = _cuda.ScatterParams()
    p.key, p.value = _ptr(bufs["key"]), _ptr(bufs["value"])
    p.keyCache, p.valueCache = _ptr(bufs["key_cache"]), _ptr(bufs["value_cache"])
    p.slotMapping = _ptr(bufs["slot_mapping"])
    p.compressLens, p.seqLens = _ptr(bufs["compress_lens"]), _ptr(bufs["seq_lens"])
    p.compressSeqOffsets = _ptr(bufs["compress_seq_offsets"])
    p.keyType = _cuda.DTYPE_CODE[meta.key_dtype]
    p.valueType = _cuda.DTYPE_CODE[meta.value_dtype or meta.key_dtype]
    p.indexType = _cuda.DTYPE_CODE[meta.index_dtype]
    p.compress = meta.compress
    p.layout = _cuda.LAYOUT_CODE[meta.layout or "nd"]
    p.mode = _cuda.MODE_CODE[meta.mode or "alibi"]
    p.numTokens, p.batch, p.maxSeqLen = meta.num_tokens, meta.batch, meta.max_seq_len
    p.numHeads, p.headSizeK, p.headSizeV = meta.num_heads, meta.head_size_k, meta.head_size_v
    p.numBlocks, p.blockSize = meta.num_blocks, meta.block_size
    p.kScale, p.vScale = _ptr(bufs["k_scale"]), _ptr(bufs["v_scale"])
    p.keyCacheType = _cuda.DTYPE_CODE[meta.key_cache_dtype or meta.key_dtype]
    p.valueCacheType = _cuda.DTYPE_CODE[
        meta.value_cache_dtype or meta.value_dtype or meta.key_cache_dtype or meta.key_dtype
    ]
    p.kScaleCount, p.vScaleCount = meta.k_scale_count, meta.v_scale_count
    if (
        meta.num_slots == 0
        or (meta.num_tokens == 0 and not meta.compress)
        or (meta.compress and meta.batch * meta.max_seq_len == 0)
    ):
        return Launch("", None, handle, device, "scatter_pa_kv_cache")  # nothing to write
    return Launch(
        "pytrt_kv_scatter_pa_kv_cache", p, handle, device, "scatter_pa_kv_cache", keepalive=bufs
    )


def _gather_params(meta: Any, bufs: dict[str, Buffer | None]) -> _cuda.GatherSelectionParams:
    p = _cuda.GatherSelectionParams()
    p.selectionKRope = _ptr(bufs["selection_k_rope"]) if meta.k_rope_dim else None
    p.selectionKvCache = _ptr(bufs["selection_kv_cache"])
    p.selectionKvBlockTable = _ptr(bufs["selection_kv_block_table"])
    p.selectionKvBlockStatus = _ptr(bufs["selection_kv_block_status"])
    p.selectionTopkIndices = _ptr(bufs["selection_topk_indices"])
    p.fullKRope = _ptr(bufs["full_k_rope"]) if meta.k_rope_dim else None
    p.fullKvCache = _ptr(bufs["full_kv_cache"])
    p.fullKvBlockTable = _ptr(bufs["full_kv_block_table"])
    p.fullKvActualSeq = _ptr(bufs["full_kv_actual_seq"])
    p.cacheType = _cuda.DTYPE_CODE[meta.cache_dtype]
    p.batch, p.seqPerBatch, p.topk, p.topkBlockSize = meta.batch, meta.seq, meta.topk, meta.tbs
    p.selectionRows = meta.rows
    p.selectionBlockNum, p.selectionBlockSize = meta.sel_block_num, meta.sel_block_size
    p.selectionMaxBlockNum = meta.sel_max_block_num
    p.fullBlockNum, p.fullBlockSize = meta.full_block_num, meta.full_block_size
    p.fullMaxBlockNum = meta.full_max_block_num
    p.kRopeDim, p.kvDim = meta.k_rope_dim, meta.kv_dim
    return p


#: The kernels count the gather's plan entries (B*S*K, the miss list), its rows (B*S) and
#: a token row's bytes ((KV + K_ROPE) * itemsize) in 32 bits (docs/SPEC.md G2).
KERNEL_INT32_MAX = 2**31 - 1


def _check_gather_limits(meta: Any) -> None:
    """docs/SPEC.md G2's kernel limits, checked before any output or workspace is
    allocated (a B*S*K over the limit once asked for a 137 GB workspace first)."""
    itemsize = dtypes.itemsize(meta.cache_dtype)
    checks = (
        ("selection_kv_block_status", "B*S", meta.batch * meta.seq),
        ("selection_topk_indices", "B*S*K", meta.batch * meta.seq * meta.topk),
        (
            "selection_kv_cache",
            "(KV + K_ROPE) * itemsize",
            (meta.kv_dim + meta.k_rope_dim) * itemsize,
        ),
    )
    for arg, what, n in checks:
        if n > KERNEL_INT32_MAX:
            raise value_error(
                arg,
                f"{what} <= 2^31-1 (the kernels count it in 32 bits, docs/SPEC.md G2)",
                f"{what} = {n} (B={meta.batch}, S={meta.seq}, K={meta.topk}, "
                f"KV={meta.kv_dim}, K_ROPE={meta.k_rope_dim})",
            )


def gather_workspace_size(batch: int, seq: int, topk: int) -> int:
    """Device scratch bytes of one gather call with these sizes (what the library's
    ``getGatherSelectionWorkspaceSize`` returns; the TensorRT plugin reserves the same)."""
    p = _cuda.GatherSelectionParams()
    p.batch, p.seqPerBatch, p.topk = batch, seq, topk
    return int(_cuda.kernels().pytrt_kv_gather_workspace_size(ctypes.byref(p)))


def _new_output(like: Buffer, rows: int, device: int, stream: int) -> Any:
    """selection_kv_actual_seq [R] int32 from the framework of ``like`` (torch's and
    CuPy's caching allocators), else from :data:`_OUTPUTS`: no cudaMalloc/cudaFree per
    call in a steady-state loop (module docstring, "Outputs")."""
    mod = type(like.obj).__module__
    if mod.startswith("torch") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        return torch.empty(rows, dtype=torch.int32, device=f"cuda:{device}")
    if mod.startswith("cupy") and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(device):
            return cupy.empty(rows, dtype=np.int32)
    return _OUTPUTS.take((rows,), np.int32, device, stream)


def gather_selection_kv_cache(
    selection_k_rope: Any,
    selection_kv_cache: Any,
    selection_kv_block_table: Any,
    selection_kv_block_status: Any,
    selection_topk_indices: Any,
    full_k_rope: Any,
    full_kv_cache: Any,
    full_kv_block_table: Any,
    full_kv_actual_seq: Any,
    full_q_actual_seq: Any,
    *,
    selection_topk_block_size: int = 64,
    stream: Any = None,
    validate: bool = False,
    out: Any = None,
) -> Any:
    """Gather top-k selected KV into the selection cache on the GPU, in place (docs/SPEC.md G).

    Parameters
    ----------
    selection_k_rope : GPU buffer ``[S_BLOCK_NUM, SBS, K_ROPE]`` or zero-element; in place
    selection_kv_cache : GPU buffer ``[S_BLOCK_NUM, SBS, KV]``; in place
    selection_kv_block_table : GPU int32 ``[R >= B*S, S_MAX_BLOCK_NUM]``
    selection_kv_block_status : GPU int32 BSND ``[B, S, 1, K+1]`` or TND ``[B*S, 1, K+1]``;
        in place
    selection_topk_indices : GPU int32, status's shape with last dim K
    full_k_rope : ``[F_BLOCK_NUM, FBS, K_ROPE]`` or zero-element; GPU or pinned host memory
    full_kv_cache : ``[F_BLOCK_NUM, FBS, KV]``; GPU or pinned host memory
    full_kv_block_table : GPU int32 ``[B, F_MAX_BLOCK_NUM]``
    full_kv_actual_seq : GPU int32 ``[B]``
    full_q_actual_seq : int32 ``[B]``: shape and dtype checked, never read
    selection_topk_block_size : int
        TBS.
    stream, validate
        As in :func:`scatter_pa_kv_cache`.
    out : GPU int32 ``[R]``, optional
        Receives selection_kv_actual_seq (else a new buffer of selection_kv_cache's
        framework is returned).

    Returns
    -------
    GPU int32 ``[R]``: selection_kv_actual_seq (``out`` when given).

    Raises
    ------
    ValueError, TypeError
        As :func:`scatter_pa_kv_cache`; an ``out`` or a selection cache/status that
        shares memory with another argument is refused naming both.

    Notes
    -----
    Not synchronized: calls on the same selection caches and status from several threads
    or streams must be serialized by the caller.
    """
    if stream is None and not validate and out is None and _torch_compiling(selection_kv_cache):
        # As in scatter_pa_kv_cache: torch.compile sees the registered op.
        return _torch_ops().gather_selection_kv_cache_(
            selection_k_rope, selection_kv_cache, selection_kv_block_table,
            selection_kv_block_status, selection_topk_indices, full_k_rope, full_kv_cache,
            full_kv_block_table, full_kv_actual_seq, full_q_actual_seq,
            selection_topk_block_size,
        )  # fmt: skip
    return prepare_gather(
        **op_args(specs.GATHER_SELECTION_KV_CACHE, locals()),
        stream=stream,
        validate=validate,
        out=out,
    )()


@op_call(specs.GATHER_SELECTION_KV_CACHE, stream=None, validate=False, out=None)
def prepare_gather(call: dict[str, Any]) -> Launch:
    """Check a gather call like :func:`gather_selection_kv_cache` (same arguments: the op
    spec's signature) and return it as a :class:`Launch` (its ``result`` is the
    actual_seq buffer) without enqueuing it."""
    stream, validate, out = call.pop("stream"), call.pop("validate"), call.pop("out")
    named = op_tensors(specs.GATHER_SELECTION_KV_CACHE, call)
    bufs = _buffers(named)

    @functools.cache
    def site() -> tuple[int, int, Buffer | None]:
        """The out check, placement, aliasing and the stream: after the shape checks (no
        GPU work on a malformed call), before the first value is read back."""
        # full_q_actual_seq is never read: it may live anywhere.
        placed = {k: v for k, v in bufs.items() if k != "full_q_actual_seq"}
        out_buf = None
        if out is not None:  # placed with the others: same device, GPU memory
            out_buf = placed["out"] = _cuda.buffer("out", out)
            rows = bufs["selection_kv_block_table"].shape[0]  # type: ignore[union-attr]  # R
            if out_buf.shape != (rows,) or out_buf.dtype != np.dtype(np.int32):
                raise value_error("out", f"int32[{rows}]", describe(out_buf))
        _check_writable(placed, GATHER_WRITTEN + ("out",))
        device = _place(placed, host_ok=("full_k_rope", "full_kv_cache"))
        _check_alias(placed, GATHER_WRITTEN + ("out",))
        return device, _cuda.resolve_stream(stream, list(named.values()), device), out_buf

    # Shapes first, then the kernels' limits: both before any value is read back (a
    # read allocates host memory) and before the output or workspace is allocated.
    tbs = call["selection_topk_block_size"]
    meta = check_gather(**bufs, selection_topk_block_size=tbs)
    _check_gather_limits(meta)
    if validate:
        meta, _ = validate_gather(
            **bufs,
            selection_topk_block_size=tbs,
            place=plan_row,
            read=lambda b: _cuda.read_back(b, site()[1]),
        )
    device, handle, out_buf = site()
    if out_buf is None:
        sel_kv = bufs["selection_kv_cache"]
        assert sel_kv is not None  # validate_gather refused a missing tensor
        out = _new_output(sel_kv, meta.rows, device, handle)
        out_buf = _cuda.buffer("out", out)
    p = _gather_params(meta, bufs)
    p.selectionKvActualSeq = _ptr(out_buf)
    lib = _cuda.kernels()
    need = int(lib.pytrt_kv_gather_workspace_size(ctypes.byref(p)))
    p.workspace, p.workspaceBytes = _WORKSPACES.get(device, handle, need)
    if meta.rows == 0:
        return Launch("", None, handle, device, "gather_selection_kv_cache", result=out)
    return Launch(
        "pytrt_kv_gather_selection_kv_cache",
        p,
        handle,
        device,
        "gather_selection_kv_cache",
        result=out,
        keepalive=(bufs, out_buf),
    )
