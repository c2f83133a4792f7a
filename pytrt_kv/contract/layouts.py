"""The cache layouts of ScatterPaKvCache (docs/SPEC.md S2-S5), one object each.

Every layout is the same addressing with another segment size: a token's ``H*D``
elements, in head-major order ``f = h*D + d``, are cut into ``nseg`` segments of ``seg``
elements, and element ``f`` of the token in slot ``(block, row)`` lies at element offset

    ((block * nseg + f // seg) * BS + row) * seg + f % seg

of a C-contiguous cache. "nd" keeps the token whole (``seg = H*D``, ``nseg = 1``), "hnd"
cuts it per head (``seg = D``), "nz" into 32-byte pieces (``seg = L = 32 // itemsize``).
The declared shape of the cache (:attr:`CacheLayout.dims`) names the same memory.

The contract's validators, the NumPy reference, the valid-feed generator and the
generated C++ header (``scripts/gen_contract_header.py``) read this table; adding a layout
touches it, the kernel's addressing and their tests (docs/ARCHITECTURE.md, "Adding a
cache layout"). Nothing here imports anything, so every layer can read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Bytes of an "nz" segment (docs/SPEC.md S4): L = NZ_SEGMENT_BYTES // itemsize.
NZ_SEGMENT_BYTES = 32

#: The symbols of the declared shapes (:attr:`CacheLayout.dims`): blocks, rows of a block,
#: heads, head size, segments of a token (F = H*D/L) and elements of a segment (L).
DIM_SYMBOLS: tuple[str, ...] = ("NB", "BS", "H", "D", "F", "L")

#: How a layout cuts a token's H*D elements: whole, per head, or in 32-byte pieces.
SEGMENT_KINDS: tuple[str, ...] = ("token", "head", "bytes")


@dataclass(frozen=True)
class CacheLayout:
    """One cache layout of a 3-D key write (docs/SPEC.md S3-S5).

    Attributes
    ----------
    name : str
        The ``cache_layout`` attribute value.
    code : int
        ``kernels::CacheLayout`` value (the C ABI and the generated header).
    spec : str
        Its docs/SPEC.md section.
    dims : tuple of str
        The declared 4-D shape in symbols: ``NB``, ``BS``, ``H``, ``D``, and for "nz"
        ``F`` (= H*D/L) and ``L``.
    segment : {"token", "head", "bytes"}
        What one contiguous run of a token's elements is (see the module docstring).
    """

    name: str
    code: int
    spec: str
    dims: tuple[str, str, str, str]
    segment: str

    @property
    def block_axis(self) -> int:
        """Axis of NB in the declared shape (0 for every layout)."""
        return self.dims.index("NB")

    @property
    def row_axis(self) -> int:
        """Axis of BS (the slot's row within its block) in the declared shape."""
        return self.dims.index("BS")

    def segment_elems(self, heads: int, size: int, itemsize: int) -> int:
        """``seg``: elements of one contiguous run of a token (module docstring)."""
        if self.segment == "token":
            return heads * size
        if self.segment == "head":
            return size
        return NZ_SEGMENT_BYTES // itemsize

    def fits_heads(self, heads: int, size: int, itemsize: int) -> bool:
        """Whether a token of H*D elements cuts into whole segments ("nz": H*D*itemsize
        divisible by 32)."""
        return (heads * size) % self.segment_elems(heads, size, itemsize) == 0

    def shape(self, nb: int, bs: int, heads: int, size: int, itemsize: int) -> tuple[int, ...]:
        """The declared cache shape for NB blocks of BS slots, H heads of D elements."""
        seg = self.segment_elems(heads, size, itemsize)
        values = {"NB": nb, "BS": bs, "H": heads, "D": size, "L": seg, "F": heads * size // seg}
        return tuple(values[d] for d in self.dims)

    def fit(
        self, shape: Sequence[int], heads: int, size: int, itemsize: int
    ) -> tuple[int, int] | None:
        """``(NB, BS)`` when the 4-D ``shape`` is this layout for H heads of D elements;
        else None."""
        if len(shape) != 4 or not self.fits_heads(heads, size, itemsize):
            return None
        nb, bs = int(shape[self.block_axis]), int(shape[self.row_axis])
        if tuple(int(n) for n in shape) != self.shape(nb, bs, heads, size, itemsize):
            return None
        return nb, bs

    def blocks(self, shape: Sequence[Any]) -> tuple[Any, Any]:
        """``(NB, BS)`` read from a cache shape of this layout (dims may be symbolic)."""
        return shape[self.block_axis], shape[self.row_axis]

    def pattern(self, heads: int, size: int, itemsize: int) -> str:
        """The expected shape for messages, e.g. ``[NB, BS, 8, 128]``."""
        seg = self.segment_elems(heads, size, itemsize)
        f: Any = (
            heads * size // seg
            if self.fits_heads(heads, size, itemsize)
            else (f"{heads}*{size}/{seg}")
        )
        values = {"NB": "NB", "BS": "BS", "H": heads, "D": size, "L": seg, "F": f}
        return "[" + ", ".join(str(values[d]) for d in self.dims) + "]"

    def element_offset(
        self, block: int, row: int, h: int, d: int, *, bs: int, heads: int, size: int, itemsize: int
    ) -> int:
        """Element offset of ``(block, row, h, d)`` in a C-contiguous cache (module
        docstring); what the kernels compute."""
        seg = self.segment_elems(heads, size, itemsize)
        nseg = heads * size // seg
        f = h * size + d
        return ((block * nseg + f // seg) * bs + row) * seg + f % seg

    def segments(self, cache: Any, heads: int, size: int) -> Any:
        """A C-contiguous cache array viewed as ``[NB, nseg, BS, seg]`` (no copy)."""
        nb, bs = self.blocks(cache.shape)
        seg = self.segment_elems(heads, size, cache.dtype.itemsize)
        return cache.reshape(nb, heads * size // seg, bs, seg)


#: Every layout, by name, in ``kernels::CacheLayout`` code order.
LAYOUTS: Mapping[str, CacheLayout] = {
    lay.name: lay
    for lay in (
        CacheLayout("nd", 0, "S3", ("NB", "BS", "H", "D"), "token"),
        CacheLayout("nz", 1, "S4", ("NB", "F", "BS", "L"), "bytes"),
        CacheLayout("hnd", 2, "S5", ("NB", "H", "BS", "D"), "head"),
    )
}


def get_layout(name: str) -> CacheLayout:
    """The :class:`CacheLayout` named ``name`` (a KeyError lists the layouts)."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise KeyError(f"cache_layout: expected one of {list(LAYOUTS)}, got {name!r}") from None


def nz_last_dim(itemsize: int) -> int:
    """L of the "nz" layout: 32 bytes of elements of ``itemsize`` bytes (docs/SPEC.md S4)."""
    return NZ_SEGMENT_BYTES // itemsize
