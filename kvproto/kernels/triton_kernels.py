"""Triton staging kernels: one launch moves a token range of every region (gather, scatter).

Theory of operation
-------------------
The unit of work is a *row*: one head of one token, ``head_dim`` elements that are contiguous in
both the cache page (NHD and HND alike) and the staging tensor. Row ``i`` of region ``r`` is
token ``start_token + i // head_count``, head ``head_offset + i % head_count``, and lives at
``staging[r, i // head_count, i % head_count]``. A program copies a tile of ``ROWS``
consecutive rows (about ``TILE_BYTES``) of one region; the grid is ``(cdiv(T * head_count,
ROWS), regions)``, axis 1 counting regions from ``first_region``.

Rows are copied as raw integer *words* (8, 4, 2 or 1 bytes, the widest that divides the row,
the page stride and every base address), so every dtype, fp8 included, moves bit for bit.

Regions are separate allocations. Their base addresses sit in a device ``int64`` *region
table*; a program loads entry ``r`` and casts it to a word pointer, so one launch serves up to
hundreds of regions without a kernel argument per region. The table is built once per list of
base addresses and cached (LRU); its host-to-device upload is ordered before first use by an
event, never by a synchronisation. ``tl.multiple_of`` hands the compiler the table's common
alignment so that aligned rows move with 16-byte vector accesses.

The same kernel runs in Triton's interpreter on CPU tensors (tests); compiled kernels are
built for CUDA tensors. Both are constructed explicitly, so whichever a process uses first,
the other stays available (the ``TRITON_INTERPRET`` variable only gates the CPU path).

Host staging (a pinned CPU staging tensor for a CUDA cache) has two paths. ``"bounce"``
stages through a device buffer in up to 8 chunks of regions: gather launches for chunk ``c``
run on the current stream while a side stream DMAs chunk ``c - 1`` to the host (scatter: the
side stream DMAs chunk ``c + 1`` in while chunk ``c`` is scattered), so the bus stays busy and
the kernels hide behind it. ``"mapped"`` lets the kernel read or write the pinned memory
directly over the bus. Either way the current stream is ordered after all the work (the side
stream first waits for it, and it waits for the side stream), and nothing here waits for the
device.

Launches go through ``kvproto.kernels.launcher`` (the JIT once per specialisation, the compiled
kernel's launcher after that); the kernel path's own kernels (pattern and paged-to-paged rows,
which share this kernel's way of moving a state block in the grid's first rows) are in
``kvproto.kernels.paged``.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kvproto.geometry.model import Layout
from kvproto.kernels.launcher import NUM_WARPS, _WORDS, _launch, _word_tensor
from kvproto.kernels.plan import JOIN_MAX, CopyPlan, Regions, StagingError, as_regions, plan_copy, staging_heads
from kvproto.kernels.uploads import Pointer

HostPath = Literal["bounce", "mapped"]

TILE_BYTES = 8192  # bytes one program moves (rounded down to a power of two of rows)
_TABLE_CACHE_SIZE = 64
_RUNTIME_INTS = ("start_token", "num_rows", "head_offset", "first_region", "num_slot_tiles", "num_regions",
                 "split1", "base1", "split2", "base2", "split3", "base3", "slot0", "slot1", "slot2", "slot3",
                 "slot_shift")


def _copy_rows(
    table_ptr,
    stage_ptr,
    pages_ptr,
    split1,
    base1,
    split2,
    base2,
    split3,
    base3,
    slot_tiles,
    num_slot_tiles,
    slot_base,
    slot_word_ptr,
    slot0,
    slot1,
    slot2,
    slot3,
    slot_shift,
    num_regions,
    start_token,
    num_rows,
    head_offset,
    first_region,
    LISTS: tl.constexpr,
    SLOTS: tl.constexpr,
    S_TILE_WORDS: tl.constexpr,
    S_VEC: tl.constexpr,
    S_ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_COUNT: tl.constexpr,
    PAGE_WORDS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
    HND: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    region = first_region + tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    limit = num_rows
    if SLOTS:  # the grid's first rows copy a piece's state block (``Slots``), tile row x columns +
        # column, beside the regions' programs rather than after them
        slot_rows = (num_slot_tiles + tl.num_programs(0) - 1) // tl.num_programs(0)
        if tl.program_id(1) < slot_rows:  # only the block's programs read its tiles
            t = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
            on = (t < num_slot_tiles).to(tl.int64)
            t = tl.minimum(t, num_slot_tiles - 1)  # a tile there is (no scalar masks)
            tile = slot_tiles + t * 5
            group = tl.load(tile + 4)
            slot = tl.where(group == 0, slot0, tl.where(group == 1, slot1, tl.where(group == 2, slot2, slot3)))
            moved = tl.load(tile + 3) * slot  # the slot side: that group's slot, strides of its row
            if TO_STAGING:  # slots -> the block, which lies slot_shift vectors on
                s_src = (tl.load(tile) + moved) * S_VEC
                s_dst = (tl.load(tile + 1) + slot_shift) * S_VEC
            else:
                s_src = (tl.load(tile) + slot_shift) * S_VEC
                s_dst = (tl.load(tile + 1) + moved) * S_VEC
            s_count = tl.load(tile + 2) * S_VEC * on  # 0 words past the block's last tile
            zero = tl.multiple_of(tl.load(slot_base).to(tl.pointer_type(slot_word_ptr.dtype.element_ty)), S_ALIGN)
            s_words = tl.arange(0, S_TILE_WORDS)
            s_mask = s_words < s_count
            tl.store(zero + s_dst + s_words, tl.load(zero + s_src + s_words, mask=s_mask), mask=s_mask)
        limit = num_rows * (tl.program_id(1) >= slot_rows).to(tl.int64)  # the block's rows copy no rows
        region = first_region + tl.maximum(tl.program_id(1) - slot_rows, 0)  # the regions' rows follow
    live = rows < limit
    token = start_token + rows // HEAD_COUNT
    head = head_offset + rows % HEAD_COUNT
    if LISTS:  # regions of several groups (``copy_joined``): group g's regions, from split_g on, read
        # their pages from base_g on (unused groups: a split no region reaches)
        base = tl.where(region >= split1, base1, 0)
        base = tl.where(region >= split2, base2, base)
        base = tl.where(region >= split3, base3, base)
        pages_ptr += base
    page = tl.load(pages_ptr + token // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    slot = token % BLOCK_SIZE
    if HND:
        cell = head * BLOCK_SIZE + slot
    else:
        cell = slot * HEADS + head
    cache_row = page * PAGE_WORDS + cell.to(tl.int64) * ROW_WORDS
    stage_row = (region.to(tl.int64) * num_rows + rows) * ROW_WORDS
    words = tl.arange(0, ROW_BLOCK)
    if ROW_BLOCK == ROW_WORDS:
        mask = live[:, None]
    else:
        mask = live[:, None] & (words < ROW_WORDS)[None, :]
    base = tl.load(table_ptr + region).to(tl.pointer_type(stage_ptr.dtype.element_ty))
    base = tl.multiple_of(base, ALIGN)
    cache = base + cache_row[:, None] + words[None, :]
    stage = stage_ptr + stage_row[:, None] + words[None, :]
    if TO_STAGING:
        tl.store(stage, tl.load(cache, mask=mask), mask=mask)
    else:
        tl.store(cache, tl.load(stage, mask=mask), mask=mask)


@functools.cache
def _kernel(interpret: bool) -> Any:
    if interpret:
        return InterpretedFunction(_copy_rows)
    return JITFunction(_copy_rows, do_not_specialize=_RUNTIME_INTS)


SLOT_GROUPS = 4
"""Most state groups whose slots one launch's state block moves (the kernel's ``slot0..slot3``)."""


class Slots(NamedTuple):
    """A state block's copy riding in a staging launch (``kvproto.aio.staging.StateBlock``): the
    grid's first rows copy its tiles as ``copy_pattern`` does over one region of base 0, and only
    those programs read them. The tiles stay where the kernel reads them for every piece; what
    differs between pieces is scalars: each state group's slot, and where the block lies."""

    plan: Any
    """The block's ``PatternPlan`` (its word, vector and tile size)."""
    tiles: torch.Tensor
    """``(T, 5)`` int64, in vectors: source and destination at slot 0 and block 0 (the slot side's
    absolute address, the block side's offset), length, the slot side's step per slot, and the
    tile's group (an index into ``slots``)."""
    zero: torch.Tensor
    """A table whose first entry is 0 (the base the tiles' addresses are relative to)."""
    slots: tuple[int, ...] = (0,) * SLOT_GROUPS
    """The slot of each group (up to ``SLOT_GROUPS``)."""
    shift: int = 0
    """Vectors the block side lies past the tiles' offsets: the block's address / the plan's
    alignment (0 for tiles of absolute addresses)."""

    @classmethod
    def fixed(cls, plan: Any, tiles: Any, zero: torch.Tensor) -> Slots:
        """Tiles of absolute addresses ``(T, 3)`` (source, destination, length, as a plan's) as slots
        of one group that never move."""
        wide = torch.zeros((len(tiles), 5), dtype=torch.int64, device=zero.device)
        wide[:, :3] = torch.as_tensor(tiles, dtype=torch.int64).to(zero.device)
        return cls(plan, wide, zero)

    def args(self) -> tuple[Any, ...]:
        """The kernel's runtime arguments after the word type: the four slots, the shift."""
        return (*self.slots, *(0,) * (SLOT_GROUPS - len(self.slots)), self.shift)


@dataclass(slots=True)
class _Table:
    """A region table on its device; ``ready`` orders its upload until the upload is done."""

    tensor: torch.Tensor
    align: int  # largest power of two up to 16 dividing every base address
    host: torch.Tensor | None
    ready: torch.cuda.Event | None


_tables: OrderedDict[tuple[str, tuple[int, ...]], _Table] = OrderedDict()
_tables_lock = threading.Lock()


def region_table(cache: Sequence[torch.Tensor], joined: Sequence[Regions] = ()) -> _Table:
    """The region table of ``cache``: remembered by a :class:`Regions`, else found by address;
    with ``joined``, the table of those groups' regions side by side (found by address)."""
    if joined:
        # kept on the first group's Regions (a rank's groups are the same objects every piece, and
        # the tables go when the cache does), by each group's identity, first region and length
        key = tuple((id(regions), regions[0].data_ptr(), len(regions)) for regions in joined)
        known = joined[0].__dict__.setdefault("joined", {})
        table = known.get(key)
        if table is None:
            with _tables_lock:
                table = known[key] = _lookup_locked([region for regions in joined for region in regions])
    else:
        regions = as_regions(cache)
        table = regions.table
        if not isinstance(table, _Table):
            table = regions.table = _lookup(regions)
    if table.ready is not None:
        if table.ready.query():
            table.ready, table.host = None, None
        else:
            torch.cuda.current_stream(table.tensor.device).wait_event(table.ready)
    return table


def _lookup(regions: Regions) -> _Table:
    with _tables_lock:  # kernels may be warmed up from a background thread (``kernels.warm_up``)
        return _lookup_locked(regions)


def _lookup_locked(regions: Sequence[torch.Tensor]) -> _Table:
    device = regions[0].device
    key = (str(device), tuple(region.data_ptr() for region in regions))
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    host = torch.tensor(key[1], dtype=torch.int64)
    align = _alignment(key[1])
    if device.type == "cuda":
        host = host.pin_memory()
        event = torch.cuda.Event()
        table = _Table(tensor=host.to(device, non_blocking=True), align=align, host=host, ready=event)
        event.record()
    else:
        table = _Table(tensor=host, align=align, host=None, ready=None)
    _tables[key] = table
    if len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return table


def copy(plan: CopyPlan, pages: torch.Tensor, staging: torch.Tensor, *, to_staging: bool, interpret: bool = False,
         host_path: HostPath = "bounce", tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS,
         slots: Slots | None = None) -> None:
    """Triton gather (``to_staging``) or scatter of a checked copy (``kvproto.kernels.gather`` and
    ``scatter``). ``staging`` may be pinned host memory for a CUDA cache (the module docstring's
    host paths); ``slots``: a state block moved in the same launch (device staging only)."""
    if plan.num_tokens == 0:
        _no_empty_launch(slots)
        return
    if staging.device == plan.device or host_path == "mapped":
        launch = _Launch(plan, staging, pages, to_staging, interpret, tile_bytes, num_warps, slots=slots)
        launch.run(0, plan.num_regions)
        return
    if slots is not None:
        raise StagingError("a state block rides only in a launch into device staging")
    bounce = torch.empty(plan.staging_shape, dtype=plan.dtype, device=plan.device)
    launch = _Launch(plan, bounce, pages, to_staging, interpret, tile_bytes, num_warps)
    main, side = torch.cuda.current_stream(), _side_stream(plan.device)
    if to_staging:  # chunk c gathers on the current stream while the side stream takes chunk c - 1 to the host
        for first, last in _chunks(plan):
            launch.run(first, last)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                staging[first:last].copy_(bounce[first:last], non_blocking=True)
        main.wait_stream(side)
    else:  # the side stream brings chunk c + 1 from the host while chunk c scatters
        side.wait_stream(main)
        for first, last in _chunks(plan):
            with torch.cuda.stream(side):
                bounce[first:last].copy_(staging[first:last], non_blocking=True)
            main.wait_stream(side)
            launch.run(first, last)


def prepare(
    groups: Sequence[Regions],
    staging: torch.Tensor,
    table: Any,
    *,
    layout: Layout | int,
    start_token: int,
    end_token: int,
    head_offset: int,
    to_staging: bool,
    interpret: bool = False,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
    slots: Slots | None = None,
    starts: Sequence[int] | None = None,
) -> _Launch | None:
    """The checked launch of a device-staging copy of one group's blocks (``table``: its pages), or
    of up to ``JOIN_MAX`` groups' whose pages look alike (same page shape, page stride and dtype;
    pools of any size) in one launch, not yet run: ``run(0, launch.regions)`` runs it
    (``kvproto.kernels.copy_joined``), and ``again`` runs the same launch for another piece of the
    same shape (the staged path's later pieces: ``kvproto.aio.staging``). None for a piece of no
    tokens. ``staging`` is the groups' blocks back to back, ``(sum of regions, T, head_count,
    head_dim)`` on the cache's device; ``table`` (int64 where several groups share it, where the
    kernel reads it) is every group's pages from token 0 back to back, and ``starts`` where each
    group's pages start in it; without ``starts``, ``table`` is a host tensor that ends with each
    region's offset into its pages. The pages are trusted (checked when they entered the core), as a
    device table is. ``slots``: a state block moved in the same launch."""
    first = groups[0]
    if len(groups) > JOIN_MAX:
        raise StagingError(f"{len(groups)} groups in one launch: at most {JOIN_MAX}")
    for g, regions in enumerate(groups):
        if (regions.shape[1:], regions.page_stride, regions.dtype, regions.device) != \
                (first.shape[1:], first.page_stride, first.dtype, first.device):
            raise StagingError(f"group {g}'s regions are {tuple(regions.shape)} {regions.dtype} on {regions.device}, "
                               f"group 0's {tuple(first.shape)} {first.dtype}: they cannot share a launch")
    total = sum(len(regions) for regions in groups)
    plan = plan_copy(first, layout=layout, pages=table, start_token=start_token, end_token=end_token,
                     head_offset=head_offset, head_count=staging_heads(staging))
    want = (total, plan.num_tokens, plan.head_count, plan.head_dim)
    if tuple(staging.shape) != want or staging.dtype != plan.dtype or staging.device != plan.device \
            or not staging.is_contiguous():
        raise StagingError(f"staging is {tuple(staging.shape)} {staging.dtype} on {staging.device}, the groups "
                           f"need {want} {plan.dtype} on {plan.device}, contiguous")
    joined = len(groups) > 1
    if table.dim() != 1 or table.dtype not in (torch.int64, torch.int32) or (joined and table.dtype != torch.int64):
        raise StagingError("the page table must be 1-D int64 (int32 for one group)")
    if joined and starts is None:
        starts = _group_starts(groups, table)
    if joined and (len(starts) != len(groups) or any(b < a for a, b in zip(starts, starts[1:]))):
        raise StagingError(f"the groups' pages must start in table order, one start per group: {starts}")
    if not plan.num_tokens:
        _no_empty_launch(slots)
        return None
    if not isinstance(table, Pointer):
        table = table.to(plan.device, non_blocking=True)
    return _Launch(plan, staging, table, to_staging, interpret, tile_bytes, num_warps, joined=groups if joined else (),
                   starts=starts if joined else None, slots=slots)


def _group_starts(groups: Sequence[Regions], table: torch.Tensor) -> list[int]:
    """Where each group's pages start in a host ``table`` that ends with each region's offset."""
    total = sum(len(regions) for regions in groups)
    if table.device.type != "cpu" or len(table) < total:
        raise StagingError(f"a joined launch needs the groups' page starts, or a host table ending in {total} "
                           f"region offsets")
    offsets = table[len(table) - total:].tolist()
    starts, at = [], 0
    for regions in groups:
        group = offsets[at:at + len(regions)]
        if any(o != group[0] for o in group):
            raise StagingError("the regions of one group must read one page list")
        starts.append(group[0])
        at += len(regions)
    return starts


def _splits(joined: Sequence[Regions], starts: Sequence[int] | None) -> tuple[int, ...]:
    """The kernel's (split, base) pairs of a joined launch's groups beyond the first: the region
    where each group starts and where its pages start (unused pairs: a split no region reaches)."""
    out: list[int] = []
    at = 0
    for g, regions in enumerate(joined):
        if g:
            assert starts is not None
            out += [at, starts[g]]
        at += len(regions)
    out += [0x7FFFFFFF, 0] * (JOIN_MAX - 1 - len(out) // 2)
    return tuple(out)


_NO_SLOTS = (0,) * (SLOT_GROUPS + 1)
"""The slot scalars of a launch without a state block."""


def _no_empty_launch(slots: Slots | None) -> None:
    if slots is not None:
        raise StagingError("a state block rides in a launch of at least one token")


class _Launch:
    """One copy's kernel arguments, launched for a range of regions at a time."""

    def __init__(
        self,
        plan: CopyPlan,
        staging: torch.Tensor,
        pages: torch.Tensor,
        to_staging: bool,
        interpret: bool,
        tile_bytes: int,
        num_warps: int,
        joined: Sequence[Regions] = (),
        starts: Sequence[int] | None = None,
        slots: Slots | None = None,
    ) -> None:
        itemsize = plan.dtype.itemsize
        table = region_table(plan.regions, joined)
        align = table.align
        word = min(8, align, _alignment([staging.data_ptr(), plan.row_bytes, plan.page_stride * itemsize]))
        row_words = plan.row_bytes // word
        self.num_rows = plan.num_tokens * plan.head_count
        rows = min(_floor_pow2(max(1, tile_bytes // plan.row_bytes)), _ceil_pow2(self.num_rows))
        self.tiles = -(-self.num_rows // rows)
        self.kernel = _kernel(interpret)
        if not isinstance(pages, Pointer):  # a Pointer: a table the kernel reads where it lies (``Uploads``)
            pages = pages.to(device=plan.device, non_blocking=True).contiguous()
        self.slot_tiles = 0
        self.slot_word: Any = None
        if slots is None:
            slot_args: tuple[Any, ...] = (pages, 0, pages, staging.view(_WORDS[word]), *_NO_SLOTS)
            slot_constants = {"SLOTS": False, "S_TILE_WORDS": 1, "S_VEC": 1, "S_ALIGN": 1}
        else:
            slot_plan = slots.plan
            self.slot_tiles = len(slots.tiles)
            self.slot_word = _word_tensor(slot_plan.word, plan.device)
            slot_args = (slots.tiles, self.slot_tiles, slots.zero, self.slot_word, *slots.args())
            slot_constants = {"SLOTS": True, "S_TILE_WORDS": slot_plan.tile_words, "S_VEC": slot_plan.vec,
                              "S_ALIGN": slot_plan.word * slot_plan.vec}
        self.joined = tuple(joined)
        self._starts, self._splits = starts, _splits(self.joined, starts)
        self.args = (
            table.tensor,
            staging.view(_WORDS[word]),
            pages,
            *self._splits,
            *slot_args,
        )
        self.tail = (plan.start_token, self.num_rows, plan.head_offset)
        self.regions = plan.num_regions if not joined else sum(len(regions) for regions in joined)
        self.word = _WORDS[word]
        self.device = plan.device
        self.constants: dict[str, Any] = {
            **slot_constants,
            "LISTS": bool(joined),
            "BLOCK_SIZE": plan.block_size,
            "HEADS": plan.heads,
            "HEAD_COUNT": plan.head_count,
            "PAGE_WORDS": plan.page_stride * itemsize // word,
            "ROW_WORDS": row_words,
            "ROW_BLOCK": _ceil_pow2(row_words),
            "ROWS": rows,
            "ALIGN": align,
            "HND": plan.layout is Layout.HND,
            "TO_STAGING": to_staging,
        }
        if not interpret:
            self.constants.update(num_warps=num_warps, enable_fp_fusion=False)

    def again(self, staging: int, pages: Any, starts: Sequence[int] | None = None, slots: Slots | None = None,
              start_token: int = 0) -> None:
        """This launch for another piece of its shape (its token count, staging alignment, groups and
        state block, which the caller keys it by), whose staging starts at address ``staging``: its
        pages (a joined launch's groups from ``starts``) and its state block's ``slots`` (tiles of
        the same length), its tokens from ``start_token``. Nothing is checked again: the caller
        keeps the staging inside its buffer and the pages are the core's, range-checked."""
        stage = Pointer(staging, 0, self.device, self.word)
        table = self.args[0]
        if self.slot_tiles:  # the caller keys launches by their block's tiles: these are as many
            assert slots is not None
            slot_args = (slots.tiles, self.slot_tiles, slots.zero, self.slot_word, *slots.args())
        else:
            slot_args = (pages, 0, pages, stage, *_NO_SLOTS)
        if starts != self._starts:  # a joined launch's splits: the same while the groups' page counts are
            self._starts, self._splits = starts, _splits(self.joined, starts)
        self.args = (table, stage, pages, *self._splits, *slot_args)
        self.tail = (start_token, *self.tail[1:])
        self.run(0, self.regions)

    def run(self, first: int, last: int) -> None:
        """Copy regions ``[first, last)`` (and the state block, in grid rows before theirs, if any)."""
        if self.slot_tiles:  # the block's tiles in rows of their own, before the regions' rows
            grid = (self.tiles, last - first - (-self.slot_tiles // self.tiles))
        else:
            grid = (self.tiles, last - first)
        _launch(self.kernel, grid, (*self.args, last - first, *self.tail, first), self.constants)


def _chunks(plan: CopyPlan) -> list[tuple[int, int]]:
    """Region ranges of a pipelined host copy: up to 8, each of at least 4 MiB where possible."""
    region_bytes = plan.num_tokens * plan.head_count * plan.row_bytes
    count = max(1, min(8, plan.num_regions, plan.num_regions * region_bytes // (4 << 20)))
    bounds = [plan.num_regions * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream on which pipelined host copies overlap the kernels."""
    return torch.cuda.Stream(device)


def _floor_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1)


def _ceil_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


def _alignment(values: Sequence[int]) -> int:
    """Largest power of two up to 16 dividing every value."""
    align = 16
    for value in values:
        while value % align:
            align //= 2
    return align
