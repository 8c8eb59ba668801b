"""Pattern copies: the same extents in each of several region pairs, in one kernel launch.

Theory of operation
-------------------
A KV write is a *pattern* repeated over regions: the geometry planner gives, for one room and
one peer pair, a list of extents ``(src_off, dst_off, length)`` relative to a region's base, and
the same list applies to every region (layer and plane) of the cache. A transport that moves
bytes with descriptors expands the pattern into ``regions x extents`` rows (tens of thousands
for a fragmented room, each with a fixed price); a kernel can instead read the pattern once
and let every program compute its own addresses. This module is that kernel, for memory this
process can address directly (its own, or a peer's mapped through CUDA IPC).

``plan_pattern`` cuts extents into *tiles* of at most ``tile_bytes`` and picks the *word*: the
widest integer (8, 4, 2 or 1 bytes) that divides every base address, offset and length, so any
dtype moves bit for bit. ``tile_bytes`` shrinks for small writes so that ``tiles x regions``
programs still fill the GPU (``MIN_PROGRAMS``), and grows to ``MAX_TILE_BYTES`` for large ones
(fewer, longer programs: 16-byte vector loads and stores, as a device copy does). The grid is
``(tiles, regions)``: program ``(t, r)`` copies tile ``t`` from ``src_bases[r]`` to
``dst_bases[r]``. Base addresses travel in two device ``int64`` tables, offsets and lengths in
a third of three words per tile, so the launch takes a fixed number of arguments whatever the
room's shape.

Three ways to run a plan: ``launch`` (Triton, compiled for CUDA or interpreted on CPU with
``TRITON_INTERPRET=1``, which the CPU tests use) and ``copy_reference`` (plain torch over byte
views of the regions, the ground truth the tests compare against). Nothing here checks that the
addresses belong to anyone: callers check every row against registered memory first
(``kvproto.transport.cuda_ipc``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvproto.geometry import KVGeometry, Layout, PairPlan
from kvproto.geometry.plan import PageListError, _strides

MAX_TILE_BYTES = 32768
"""Longest tile: one program moves at most this many bytes."""
MIN_TILE_BYTES = 1024
MIN_PROGRAMS = 4096
"""Programs a write should offer to keep every SM of an H100/H200 busy (132 SMs x ~30)."""


@dataclass(frozen=True, slots=True)
class PatternPlan:
    tiles: np.ndarray
    """``(T, 3)`` int64: source offset, destination offset and length of every tile, in
    vectors of ``vec`` words (so that the kernel knows their alignment)."""
    word: int
    """Bytes per word (8, 4, 2 or 1)."""
    vec: int
    """Words per vector: every base, offset and length is a multiple of ``vec * word`` bytes
    (16 where it can be: 16-byte loads and stores)."""
    tile_words: int
    """Most words one tile holds (a power of two)."""
    regions: int
    nbytes: int
    """Bytes the whole write moves (every region)."""

    @property
    def programs(self) -> int:
        return len(self.tiles) * self.regions


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def alignment(values: np.ndarray | Sequence[int], limit: int = 16) -> int:
    """The largest power of two up to ``limit`` that divides every value."""
    value = int(np.bitwise_or.reduce(np.asarray(values, dtype=np.int64).reshape(-1))) if len(values) else 0
    return min(limit, value & -value) if value else limit


def plan_pattern(pattern: np.ndarray, *, regions: int, base_align: int = 16,
                 max_tile_bytes: int = MAX_TILE_BYTES, min_programs: int = MIN_PROGRAMS) -> PatternPlan:
    """Tiles and word of one write: ``pattern`` is ``(E, 3)`` (src_off, dst_off, length) in bytes,
    applied to ``regions`` region pairs whose base addresses are all multiples of ``base_align``
    (``alignment(bases)``)."""
    pattern = np.ascontiguousarray(np.asarray(pattern, dtype=np.int64).reshape(-1, 3))  # the kernel reads rows
    if len(pattern) == 0:
        raise ValueError("a pattern write needs at least one extent")
    if (pattern[:, 2] <= 0).any():
        raise ValueError("pattern lengths must be positive")
    if regions < 1:
        raise ValueError(f"a pattern write needs at least one region, got {regions}")
    align = min(base_align, alignment(pattern))  # bytes dividing every base, offset and length
    word = min(align, 8)
    vec = align // word
    per_region = int(pattern[:, 2].sum())
    tile = min(max_tile_bytes, max(MIN_TILE_BYTES, _pow2_floor(per_region * regions // max(1, min_programs))))
    tile_vecs = max(1, tile // align)
    vecs = pattern // align
    if int(vecs[:, 2].max()) <= tile_vecs:  # every extent fits one tile (the common case): no splitting
        return PatternPlan(tiles=vecs, word=word, vec=vec, tile_words=tile_vecs * vec, regions=regions,
                           nbytes=per_region * regions)
    counts = -(-vecs[:, 2] // tile_vecs)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    step = (np.arange(int(counts.sum()), dtype=np.int64) - first) * tile_vecs
    tiles = np.empty((len(step), 3), dtype=np.int64)
    tiles[:, 0] = np.repeat(vecs[:, 0], counts) + step
    tiles[:, 1] = np.repeat(vecs[:, 1], counts) + step
    tiles[:, 2] = np.minimum(np.repeat(vecs[:, 2], counts) - step, tile_vecs)
    return PatternPlan(tiles=tiles, word=word, vec=vec, tile_words=tile_vecs * vec, regions=regions,
                       nbytes=per_region * regions)


@dataclass(frozen=True, slots=True)
class StridedRows:
    """Rows of absolute addresses planned once, moved by whole strides at each write: a state
    slot's runs (slot ``s`` of a region lies ``s`` slot strides past slot 0), or a staged piece's
    state block (wherever the piece lies). ``tiles(src_slot, dst_slot, src_base=, dst_base=)``
    shifts every tile's source by ``src_slot`` of its row's source stride plus ``src_base`` bytes,
    and likewise its destination: one ``PatternPlan`` (over one region of base 0) serves every
    write, because every stride and base is a multiple of its alignment."""

    plan: PatternPlan
    src_step: np.ndarray
    """``(tiles, 3)``: vectors one slot moves each tile's source (column 0; the others zero)."""
    dst_step: np.ndarray
    """Likewise for the destination (column 1)."""
    rows: np.ndarray
    """The row each tile belongs to (a write may move rows of several slots: ``tiles`` takes a
    slot per tile)."""

    @property
    def align(self) -> int:
        return self.plan.word * self.plan.vec

    def tiles(self, src_slot: int | np.ndarray = 0, dst_slot: int | np.ndarray = 0, *, src_base: int = 0,
              dst_base: int = 0) -> np.ndarray:
        """The plan's tiles for one write; a slot may be an int or a ``(tiles, 1)`` array."""
        align = self.align
        if src_base % align or dst_base % align:
            raise ValueError(f"bases {src_base:#x}, {dst_base:#x} are not multiples of the plan's {align} bytes")
        tiles = self.plan.tiles + (src_slot * self.src_step + dst_slot * self.dst_step)
        if src_base or dst_base:
            tiles = tiles + np.array([src_base // align, dst_base // align, 0], dtype=np.int64)
        return tiles

    def stepped(self) -> np.ndarray:
        """``(tiles, 5)`` int64, in vectors: each tile's source and destination at slot 0, its
        length, and the vectors one slot moves its source and its destination. A kernel that
        reads these moves any pair of slots with the same table (``copy_paged``): the tiles of a
        write are ``tiles(src_slot, dst_slot)`` without computing them on the host."""
        out = np.empty((len(self.plan.tiles), 5), dtype=np.int64)
        out[:, :3] = self.plan.tiles
        out[:, 3] = self.src_step[:, 0]
        out[:, 4] = self.dst_step[:, 1]
        return out


def plan_strided_rows(src: np.ndarray, src_stride: np.ndarray, dst: np.ndarray, dst_stride: np.ndarray,
                      length: np.ndarray, *, base_align: int = 16) -> StridedRows:
    """``StridedRows`` of rows ``src[i] -> dst[i]`` of ``length[i]`` bytes (slot 0, base 0) whose
    slots lie ``src_stride[i]`` / ``dst_stride[i]`` bytes apart; ``base_align`` divides every base
    a write will add. A slot is small and rides in a launch of many other programs: a tile per row
    (up to ``MAX_TILE_BYTES``), no wider than the longest row."""
    strides = np.concatenate([np.asarray(src_stride, dtype=np.int64), np.asarray(dst_stride, dtype=np.int64)])
    align = min(base_align, alignment(strides[strides > 0]) if (strides > 0).any() else 16)
    longest = 1 << (max(1, int(np.max(length))) - 1).bit_length()
    plan = plan_pattern(np.stack([src, dst, length], axis=1), regions=1, base_align=align, min_programs=1,
                        max_tile_bytes=max(MIN_TILE_BYTES, min(MAX_TILE_BYTES, longest)))
    align = plan.word * plan.vec
    tile_vecs = plan.tile_words // plan.vec
    row = np.repeat(np.arange(len(length)), -(-(np.asarray(length) // align) // tile_vecs))
    src_step, dst_step = (np.zeros_like(plan.tiles) for _ in range(2))
    src_step[:, 0] = np.asarray(src_stride, dtype=np.int64)[row] // align
    dst_step[:, 1] = np.asarray(dst_stride, dtype=np.int64)[row] // align
    return StridedRows(plan, src_step, dst_step, row)


def pair_extents(plan: PairPlan, src_pages: Sequence[int], dst_pages: Sequence[int], start: int,
                 end: int) -> np.ndarray:
    """``plan.extents(...)`` as an ``(E, 3)`` int64 array (src_off, dst_off, length), computed
    with array operations: the same extents, in the same order, merged the same way (a test holds
    the two equal), at a host cost of a few array passes instead of a Python object per extent
    (a fragmented 1 GiB room with different TP sizes has tens of thousands)."""
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    if start == end:
        return np.zeros((0, 3), dtype=np.int64)
    src, dst = plan.src, plan.dst
    spages = _pages("source", src_pages, src, start, end)
    dpages = _pages("destination", dst_pages, dst, start, end)
    if plan.direct:
        block, size = src.block_size, src.page_bytes
        idx = np.arange(start // block, (end - 1) // block + 1)
        return _merge(np.stack([spages[idx] * size, dpages[idx] * size, np.full(len(idx), size)], axis=1))
    cell, heads = src.head_bytes, plan.head_count
    s_tok, s_head = _strides(src)
    d_tok, d_head = _strides(dst)
    sb, db = src.block_size, dst.block_size
    cuts = np.union1d(np.arange((start // sb + 1) * sb, end, sb), np.arange((start // db + 1) * db, end, db))
    t = np.concatenate([[start], cuts]).astype(np.int64)
    n = np.diff(np.concatenate([t, [end]]))
    s0 = spages[t // sb] * src.page_bytes + (t % sb) * s_tok + plan.src_head_offset * s_head
    d0 = dpages[t // db] * dst.page_bytes + (t % db) * d_tok + plan.dst_head_offset * d_head
    if heads == 1 or (s_head == cell and d_head == cell):  # the moved heads of a token form one row
        row = heads * cell
        if s_tok == row and d_tok == row:
            return _merge(np.stack([s0, d0, n * row], axis=1))
        k = _within(n)
        run = np.repeat(np.arange(len(n)), n)
        return _merge(np.stack([s0[run] + k * s_tok, d0[run] + k * d_tok, np.full(len(k), row)], axis=1))
    if s_tok == cell and d_tok == cell:  # the run's tokens of a head form one row
        h = np.tile(np.arange(heads), len(n))
        run = np.repeat(np.arange(len(n)), heads)
        return _merge(np.stack([s0[run] + h * s_head, d0[run] + h * d_head, n[run] * cell], axis=1))
    k = _within(n)  # layouts cross: single (token, head) cells
    run = np.repeat(np.arange(len(n)), n)
    ks = np.repeat(k, heads)
    rs = np.repeat(run, heads)
    h = np.tile(np.arange(heads), len(k))
    return _merge(np.stack([s0[rs] + ks * s_tok + h * s_head, d0[rs] + ks * d_tok + h * d_head,
                            np.full(len(ks), cell)], axis=1))


def _pages(side: str, pages: Sequence[int], g: KVGeometry, start: int, end: int) -> np.ndarray:
    first, last = start // g.block_size, (end - 1) // g.block_size
    if last >= len(pages):
        raise PageListError(f"{side} page list has {len(pages)} pages, but tokens [{start}, {end}) in blocks "
                            f"of {g.block_size} need page index {last}")
    arr = np.asarray(pages, dtype=np.int64)
    used = arr[first:last + 1]
    bad = np.flatnonzero((used < 0) | (used >= g.num_blocks))
    if bad.size:
        index = first + int(bad[0])
        raise PageListError(f"{side} page {int(arr[index])} at index {index} is outside the pool "
                            f"[0, {g.num_blocks})")
    return arr


def _within(n: np.ndarray) -> np.ndarray:
    """``0, 1, ..., n[i] - 1`` for every run, concatenated."""
    return np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)


def _merge(ext: np.ndarray) -> np.ndarray:
    """``merge_runs`` over an array: join consecutive extents that abut on both sides."""
    if len(ext) < 2:
        return ext
    joins = (ext[:-1, 0] + ext[:-1, 2] == ext[1:, 0]) & (ext[:-1, 1] + ext[:-1, 2] == ext[1:, 1])
    if not joins.any():
        return ext
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    out = ext[starts].copy()
    out[:, 2] = np.add.reduceat(ext[:, 2], starts)
    return out


@dataclass(frozen=True, slots=True)
class RowsPlan:
    """One paged-to-paged write: every moved head of every token ``[start, start + num_rows /
    head_count)`` is a *row* of ``head_dim`` elements, contiguous on both sides whatever their
    block sizes and layouts; program ``(i, r)`` copies rows ``[i * ROWS, (i + 1) * ROWS)`` of
    region ``r``, computing both addresses from the two page lists, so the host does no work per
    token. ``constants`` are the kernel's compile-time parameters (one compilation per pair of
    geometries)."""

    start: int
    num_rows: int
    regions: int
    word: int
    rows_per_program: int
    constants: dict[str, int]
    nbytes: int

    @property
    def programs_x(self) -> int:
        return -(-self.num_rows // self.rows_per_program)


def plan_rows(plan: PairPlan, start: int, end: int, *, regions: int, base_align: int = 16,
              min_programs: int = MIN_PROGRAMS, tile_bytes: int = 16384) -> RowsPlan:
    """The rows write of tokens ``[start, end)`` for ``plan`` over ``regions`` region pairs whose
    bases are multiples of ``base_align``."""
    if not 0 <= start < end:
        raise ValueError(f"bad token range [{start}, {end})")
    src, dst = plan.src, plan.dst
    head_bytes = src.head_bytes
    # NHD on both sides keeps a token's moved heads side by side: one row per token, not per head
    whole = src.layout is Layout.NHD and dst.layout is Layout.NHD
    per_token, row_bytes = (1, plan.head_count * head_bytes) if whole else (plan.head_count, head_bytes)
    align = min(base_align, alignment([head_bytes, src.page_bytes, dst.page_bytes]))
    word = min(align, 8)
    num_rows = (end - start) * per_token
    rows = _pow2_floor(max(1, tile_bytes // row_bytes))
    while rows > 1 and -(-num_rows // rows) * regions < min_programs:
        rows //= 2
    row_words = row_bytes // word
    constants = dict(
        HEAD_COUNT=per_token, HEAD_WORDS=head_bytes // word, ROW_WORDS=row_words,
        ROW_BLOCK=1 << (row_words - 1).bit_length(), ROWS=rows, ALIGN=align,
        SRC_BLOCK=src.block_size, SRC_HEADS=src.local_heads, SRC_HEAD0=plan.src_head_offset,
        SRC_PAGE_WORDS=src.page_bytes // word, SRC_HND=int(src.layout is Layout.HND),
        DST_BLOCK=dst.block_size, DST_HEADS=dst.local_heads, DST_HEAD0=plan.dst_head_offset,
        DST_PAGE_WORDS=dst.page_bytes // word, DST_HND=int(dst.layout is Layout.HND),
    )
    return RowsPlan(start=start, num_rows=num_rows, regions=regions, word=word, rows_per_program=rows,
                    constants=constants, nbytes=num_rows * row_bytes * regions)


def rows_key(plan: PairPlan) -> tuple[Any, ...]:
    """What ``plan_rows`` reads of ``plan``: groups whose plans have one key (their page geometry,
    not their pools) can share a rows launch, each region reading its own group's page lists."""
    src, dst = plan.src, plan.dst
    return (src.layout, dst.layout, src.head_bytes, plan.head_count, src.block_size, dst.block_size,
            src.local_heads, dst.local_heads, plan.src_head_offset, plan.dst_head_offset, src.page_bytes,
            dst.page_bytes)


def launch_rows(plan: RowsPlan, src_table: torch.Tensor, dst_table: Any, src_pages: Any, dst_pages: Any, *,
                stream: Any = None, lists: Any = None, slots: Any = None, src_slot: int = 0,
                dst_slot: int = 0) -> None:
    """Run a ``RowsPlan`` with Triton (CPU tensors: the interpreter); ``src_pages``/``dst_pages``
    are int64 page lists from token 0, where the kernel reads them; ``lists``, where regions of
    several groups share the launch, each region's offsets into them; ``slots``, a state slot's
    copy in the same launch (``kvproto.kernels.paged.SlotTiles``: ``StridedRows.stepped`` tiles), from
    slot ``src_slot`` into slot ``dst_slot``. ``stream``: a CUDA stream to launch on, current or not
    (the current device must be its device); None: the current stream."""
    from kvproto.kernels import paged

    paged.copy_paged(plan, src_table, dst_table, src_pages, dst_pages, lists, slots, src_slot, dst_slot,
                              stream if src_table.device.type == "cuda" else None)


def forget_tables(tables: Sequence[Any]) -> None:
    """Region tables that a transport no longer uses (a peer unmapped, the agent closed): the
    rows launches bound to them are dropped (``kvproto.kernels.paged.PagedLaunch.forget``). Nothing to
    do where no rows launch ran in this process."""
    bound = sys.modules.get("kvproto.kernels.paged")
    if bound is not None and tables:
        bound.PagedLaunch.forget(tables)


def copy_reference(pattern: np.ndarray, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """The plain-torch meaning of a pattern write between region tensors (offsets in bytes)."""
    for s, d in zip(src, dst, strict=True):
        sb = s.view(-1).view(torch.uint8) if s.is_contiguous() else s.contiguous().view(-1).view(torch.uint8)
        db = d.view(-1).view(torch.uint8)
        for so, do, n in np.asarray(pattern, dtype=np.int64).reshape(-1, 3).tolist():
            db[do:do + n].copy_(sb[so:so + n])


def launch(plan: PatternPlan, src_table: torch.Tensor, dst_table: torch.Tensor, tiles: torch.Tensor, *,
           stream: Any = None) -> None:
    """Run ``plan`` with Triton: ``src_table``/``dst_table`` hold the regions' base addresses
    (int64, on the device that runs the kernel), ``tiles`` is ``plan.tiles`` there. On CPU
    tensors the Triton interpreter runs it (tests; needs ``TRITON_INTERPRET=1``). ``stream``: as
    ``launch_rows`` takes it."""
    from kvproto.kernels import paged

    paged.copy_pattern(plan, src_table, dst_table, tiles, stream if src_table.device.type == "cuda" else None)
