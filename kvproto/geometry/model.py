"""The shape of one rank's paged KV cache, as plain integers.

Theory of operation
-------------------
A rank holds, for every layer, one or two *planes* (K and V; MLA has a single latent plane;
a *fused* cache keeps each head's K and V side by side in one plane, as vLLM lays out its cache
since 0.33: ``head_dim`` then counts both, and heads split over TP as for K and V).
Each plane is one dense *region* of ``num_blocks`` pages. A page holds ``block_size`` tokens of
the rank's local heads, laid out either token-major (NHD: ``[token][head][dim]``) or
head-major (HND: ``[head][token][dim]``). Region ``r`` is ``layer * planes + plane``.

Heads are split over tensor-parallel ranks. With ``tp_size <= num_kv_heads`` rank ``r`` holds
the contiguous heads ``[r*h, (r+1)*h)`` with ``h = num_kv_heads // tp_size``. With
``tp_size > num_kv_heads`` every rank holds one head, ``r * num_kv_heads // tp_size``, and each
head lives on ``tp_size // num_kv_heads`` ranks (GQA replication). MLA keeps one latent
"head" of ``head_dim`` elements, replicated on every rank.

Everything here is pure Python over ints: no torch, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Layout(enum.IntEnum):
    """Order of a page's contents. Values are wire numbers: never renumber."""

    NHD = 0  # [token][head][dim]
    HND = 1  # [head][token][dim]


class DType(enum.IntEnum):
    """Element type of the KV cache. Values are wire numbers: never renumber."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT8_E4M3FN = 4
    FLOAT8_E5M2 = 5
    UINT8 = 6
    INT8 = 7

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT8_E4M3FN: 1,
    DType.FLOAT8_E5M2: 1,
    DType.UINT8: 1,
    DType.INT8: 1,
}


class GeometryError(ValueError):
    """A geometry that cannot describe a real KV cache (bad sizes, heads not divisible...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVGeometry:
    """One rank's KV cache shape. ``num_kv_heads`` is the model's total (1 for MLA)."""

    tp_size: int
    tp_rank: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    block_size: int
    layout: Layout
    mla: bool
    num_blocks: int
    kv_fused: bool = False
    """One plane per layer holding each head's K and V side by side (``head_dim`` = K + V)."""
    _sizes: tuple[int, int, int] = field(init=False, repr=False, compare=False, default=(0, 0, 0))
    """(local heads, head bytes, page bytes), computed once: every write plans with them."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise GeometryError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise GeometryError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if self.mla and self.kv_fused:
            raise GeometryError("a cache is MLA or fused K/V, not both")
        if self.mla and self.num_kv_heads != 1:
            raise GeometryError(f"MLA has one latent head, got num_kv_heads={self.num_kv_heads}")
        if not self.mla:
            h, t = self.num_kv_heads, self.tp_size
            if t <= h and h % t:
                raise GeometryError(f"{h} KV heads do not split evenly over TP {t}")
            if t > h and t % h:
                raise GeometryError(f"TP {t} is not a multiple of {h} KV heads")
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "layout", Layout(self.layout))
        heads = 1 if self.mla else max(1, self.num_kv_heads // self.tp_size)
        head_bytes = self.head_dim * self.dtype.itemsize
        object.__setattr__(self, "_sizes", (heads, head_bytes, self.block_size * heads * head_bytes))

    # --- derived sizes -------------------------------------------------------------------
    @property
    def planes(self) -> int:
        """Planes per layer: 2 (K, V) or 1 (MLA latent, or fused K/V)."""
        return 1 if self.mla or self.kv_fused else 2

    @property
    def num_regions(self) -> int:
        return self.num_layers * self.planes

    @property
    def local_heads(self) -> int:
        return self._sizes[0]

    @property
    def head_start(self) -> int:
        """First global head held by this rank."""
        if self.mla:
            return 0
        if self.tp_size <= self.num_kv_heads:
            return self.tp_rank * self.local_heads
        return self.tp_rank * self.num_kv_heads // self.tp_size

    @property
    def replicas(self) -> int:
        """How many ranks hold each of this rank's heads."""
        if self.mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token."""
        return self._sizes[1]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's local heads in one plane."""
        return self._sizes[0] * self._sizes[1]

    @property
    def page_bytes(self) -> int:
        return self._sizes[2]

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    def with_rank(self, tp_rank: int) -> KVGeometry:
        """The same cluster geometry seen from another rank."""
        return KVGeometry(
            tp_size=self.tp_size,
            tp_rank=tp_rank,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=self.block_size,
            layout=self.layout,
            mla=self.mla,
            num_blocks=self.num_blocks,
            kv_fused=self.kv_fused,
        )

    def byte_offset(self, page: int, token: int, head: int) -> int:
        """Offset inside a region of (page, token-in-page, local head, element 0)."""
        if self.layout is Layout.NHD:
            inner = (token * self.local_heads + head) * self.head_bytes
        else:
            inner = (head * self.block_size + token) * self.head_bytes
        return page * self.page_bytes + inner


def pages_for_tokens(num_tokens: int, block_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens of KV (the sampled token has none)."""
    if num_tokens < 0:
        raise GeometryError(f"negative token count {num_tokens}")
    return -(-num_tokens // block_size)
