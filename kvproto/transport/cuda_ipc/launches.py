"""A kernel-path write as planned: its launches, and what a write checks of its pages and slots.

Theory of operation
-------------------
The planner (``kvproto.transport.cuda_ipc.planner``) does once per link and shape of write what
does not depend on the pages: the region bases checked and uploaded (``_Bases``), a rows launch's
shape (``_RowsShape``), a state slot's plan (``_SlotPlan``). What it makes is a *recipe* per kernel
of the write (``_RowsRecipe``, ``_SlotRecipe``, ``_DescsRecipe``) and, for a write of several parts,
a ``PreparedParts`` that holds them. A write then only checks and lists what it names: its page
lists (``_page_rows``: one conversion, one unsigned maximum per list; ``_page_list`` names a
refused page) and its two slot numbers, and makes ``_Launch``es that the adapter runs on its lane.
This is the kernel path's per-write host cost: each call here was measured and trimmed (see the
git log of ``transport/cuda_ipc``); keep it free of per-write allocations and lookups.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvproto.kernels import pattern as kernels
from kvproto.transport.base import TransportError
from kvproto.transport.cuda import Pointer

if TYPE_CHECKING:
    from kvproto.transport.cuda_ipc.adapter import CudaIpcTransport, _Peer
    from kvproto.transport.cuda_ipc.writes import KernelXfer
    from kvproto.transport.base import MemKind

log = logging.getLogger("kvproto.transport")


@dataclass(eq=False)
class _Bases:
    """A (local, remote) pair of region-base lists, checked once: a link posts every write with
    the same pair, so only its extents need checking per write."""

    peer: _Peer | None
    src: np.ndarray
    dst: np.ndarray
    """The remote bases as addresses in this process."""
    src_room: int
    """Bytes from a local base to the end of its registered region, the least over regions: an
    extent ending within it stays inside registered memory in every region."""
    dst_room: int
    align: int
    table: Any
    """int64 tensor ``[src..., dst...]`` where the kernel runs."""

    @property
    def regions(self) -> int:
        return len(self.src)




@dataclass(eq=False, slots=True)
class _Launch:
    """One kernel of a write, checked and planned: ``table`` is the small int64 table it reads
    (tiles, or both page lists), put where the kernel reads it at launch; ``go(table, *slots,
    stream=None)`` launches it on the current stream or on ``stream`` (a CUDA stream that need not
    be current; on CPU memory: runs it at once, in the interpreter)."""

    bases: _Bases
    table: np.ndarray
    go: Callable[..., None]
    nbytes: int
    descriptors: int
    slots: tuple[int, ...] = ()
    """What ``go`` takes after the table: a fused state slot's two numbers (``_RowsRecipe``)."""
    rows: _RowsRecipe | None = None
    """A rows launch without a state slot: its recipe, whose ``batch_key`` says which other
    launches may join it in one (``CudaIpcTransport._flush``)."""


@dataclass(frozen=True, eq=False)
class _RowsShape:
    """A rows launch as planned for one link and token range (``_rows_shape``): all of it but
    the pages."""

    peer: _Peer
    refs: tuple[tuple[Any, Any, Any], ...]
    """Each plan's ``PairPlan`` and two base arrays (the cache key holds their ids)."""
    bases: _Bases
    rows: Any
    sides: tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]]
    """Per side (source, destination), per plan: first page used, pages listed (from page 0),
    page bytes, bytes from a base to the end of its registered region."""
    lists: Any
    """Where plans share the launch: each region's offset into the source then destination lists,
    where the kernel reads them (None: one plan)."""
    split: int




_FUSE_SLOTS = True
"""Whether a write's state slot rides in its rows launch (``post_parts``); turned off for the
process if that kernel variant ever fails to build, the slot then getting a launch of its own."""
_FEW_PAGES = 128
"""A write's page lists up to this long are checked with plain integers (``_RowsRecipe``). In a
loop of its own, numpy's conversion and reductions win from ~64 pages on; inside a serving
loop, each numpy call costs several times that (a prefill pass touches far more than the CPU's
caches hold), and for two lists of 64 pages the plain integers took half the time numpy did."""


# --- prepared writes --------------------------------------------------------------------------------------
def part_values(part: Any) -> tuple[Any, Any]:
    """What a write of ``part`` names that a ``PreparedParts`` leaves open: the two page lists of
    a plan's part, the two slot numbers of a state slot's, the two row arrays of a descriptor
    part."""
    if part.plan is not None:
        return part.plan[5], part.plan[6]
    if part.slots is not None:
        return part.src_slot, part.dst_slot
    return part.rows


@dataclass(frozen=True, eq=False)
class _SlotPlan:
    """A state group's slot rows to one peer as planned once per link (``_slot_plan``): slot 0's
    rows into slot 0 (``StridedRows``), their tiles with each tile's step per slot on each side
    where the kernel reads them (``stepped``), and how many slots fit each side's regions."""

    strided: Any
    steps: Any
    nbytes: int
    descriptors: int
    src_slots: int
    dst_slots: int

    def check(self, src_slot: int, dst_slot: int) -> None:
        if not (0 <= src_slot < self.src_slots and 0 <= dst_slot < self.dst_slots):
            raise TransportError(f"post_parts: state slot {src_slot} -> {dst_slot} is not inside registered memory "
                                 f"({self.src_slots} local, {self.dst_slots} remote slots fit the registered "
                                 f"regions)")


class _RowsRecipe:
    """A rows launch of a prepared write (``_rows_recipe``): ``launch(values)`` checks and lists
    the pages of its parts (the last two items of ``values[i]``, ``i`` in ``which``: source and
    destination pages), the write's table, and with a state slot (``slot``: its index in
    ``values`` and plan) checks its two numbers and passes them to the kernel. Everything else a launch needs (the lists'
    layout, the region tables' halves, the slot's tiles) is taken apart here, once."""

    __slots__ = ("lists", "shape", "start", "end", "slot", "zero", "device", "tables", "slot_tiles", "whole",
                 "shared", "cuda", "bound", "batch_key", "_batched")

    def __init__(self, which: tuple[int, ...], shape: _RowsShape, start: int, end: int,
                 slot: tuple[int, _SlotPlan] | None, zero: Any) -> None:
        self.shape, self.start, self.end, self.slot, self.zero = shape, start, end, slot, zero
        self.shared: tuple[_RowsRecipe, tuple[int, ...]] | None = None
        """Where several plans join: the launch that lists the first plan's pages once for all,
        and the other parts' indices, taken when each of them names the very page lists (the same
        objects) that the first does."""
        self.lists = [(i, side, *listed) for side in (0, 1) for i, listed in zip(which, shape.sides[side])]
        """Per page list of the table, in its order: (part, side, first page used, pages listed,
        page bytes, bytes from a region base to the end of its region)."""
        count = self.lists[0][3]
        self.whole: tuple[int, list[int]] | None = None
        """Where every list is used from its first page and lists as many pages (every group of a
        hybrid write without a window, and every one-group write): (that count, each list's page
        limit). Its lists then become the table in one conversion, checked in one pass
        (``_page_rows``), not list by list."""
        if all(first == 0 and n == count for _, _, first, n, _, _ in self.lists):
            self.whole = count, [room // page_bytes for *_, page_bytes, room in self.lists]
        bases = shape.bases
        self.device = bases.table.device
        self.cuda = self.device.type == "cuda"
        self.tables = bases.table[:bases.regions], bases.table[bases.regions:]
        self.bound: Any = None
        """On the GPU, this launch's ``kvproto.kernels.paged.PagedLaunch`` (plan, tables, lists and slot
        tiles bound), taken at its first write: later writes call it with their pages and slots,
        not ``launch_rows``, ``copy_paged`` and the binding's lookup again."""
        self.slot_tiles: Any = None
        """With a slot: the ``SlotTiles`` of this launch's slot plan (a write names its two slots)."""
        rows = shape.rows
        self.batch_key = (id(bases), id(shape.lists), rows.regions, rows.word, *rows.constants.values())
        """Launches of recipes with one key run as one (``kvproto.kernels.paged.PagedBatch``): the
        same region tables and lists' offsets, the same constexprs; only pages and token ranges differ."""
        self._batched: Any = None
        if slot is not None:
            from kvproto.kernels import paged

            strided = slot[1].strided
            self.slot_tiles = paged.SlotTiles(strided.plan, slot[1].steps, len(strided.plan.tiles), zero)

    def launch(self, values: Sequence[Any]) -> _Launch:
        recipe = self
        if self.shared is not None:  # the launch that lists the pages once, if every part names them
            one, others = self.shared
            named = values[self.lists[0][0]]
            src, dst = named[-2], named[-1]
            for i in others:
                pages = values[i]
                if pages[-2] is not src or pages[-1] is not dst:
                    break
            else:
                recipe = one
        shape, lists, whole = recipe.shape, recipe.lists, recipe.whole
        table = None if whole is None else _page_rows([values[i][side - 2] for i, side, *_ in lists], *whole)
        if table is None:  # the lists one by one: a few pages, lists of their own lengths, or a refusal
            pieces = [_page_list(values[i][side - 2], side, first, count, page_bytes, room, recipe.start, recipe.end)
                      for i, side, first, count, page_bytes, room in lists]
            if any(type(piece) is np.ndarray for piece in pieces):
                table = np.concatenate([np.asarray(piece, dtype=np.int64) for piece in pieces])
            else:  # a few pages per list: one conversion
                table = np.array([p for piece in pieces for p in piece], dtype=np.int64)
        if recipe.slot is None:
            return _Launch(shape.bases, table, recipe._go, shape.rows.nbytes, 0, (), recipe)
        at, plan = recipe.slot
        named = values[at]
        src_slot, dst_slot = named[-2], named[-1]
        if not (0 <= src_slot < plan.src_slots and 0 <= dst_slot < plan.dst_slots):
            plan.check(src_slot, dst_slot)  # raises, naming the slots
        return _Launch(shape.bases, table, recipe._go_fused, shape.rows.nbytes + plan.nbytes, plan.descriptors,
                       (src_slot, dst_slot))

    def batched(self) -> Any:
        """This recipe's ``PagedBatch`` (its shape's launch for several writes), made on first use."""
        if self._batched is None:
            from kvproto.kernels import paged

            self._batched = paged.PagedBatch(self.shape.rows, *self.tables, self.shape.lists)
        return self._batched

    def _bind(self, slots: Any) -> Any:
        """``bound``, made (the GPU's launch of this recipe, with ``slots`` or none)."""
        from kvproto.kernels import paged

        self.bound = paged.PagedLaunch.of(self.shape.rows, *self.tables, self.shape.lists, slots)
        return self.bound

    def _go(self, table: Any, stream: Any = None) -> None:
        shape = self.shape
        src, dst = _split(table, shape.split)
        if self.cuda:
            (self.bound or self._bind(None))(src, dst, 0, 0, stream)
        else:
            kernels.launch_rows(shape.rows, *self.tables, src, dst, lists=shape.lists, stream=stream)

    def _go_fused(self, table: Any, src_slot: int, dst_slot: int, stream: Any = None) -> None:
        global _FUSE_SLOTS
        shape = self.shape
        src, dst = _split(table, shape.split)
        if _FUSE_SLOTS:
            try:
                if self.cuda:
                    (self.bound or self._bind(self.slot_tiles))(src, dst, src_slot, dst_slot, stream)
                else:
                    kernels.launch_rows(shape.rows, *self.tables, src, dst, lists=shape.lists, slots=self.slot_tiles,
                                        src_slot=src_slot, dst_slot=dst_slot, stream=stream)
                return
            except Exception as exc:  # noqa: BLE001 - the kernel variant failed to build: nothing was launched
                _FUSE_SLOTS = False
                log.warning("the rows kernel with a state slot failed (%s: %s); state slots get launches of "
                            "their own from now on", type(exc).__name__, exc)
        import torch

        assert self.slot is not None
        zero, strided = self.zero, self.slot[1].strided
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            kernels.launch_rows(shape.rows, *self.tables, src, dst, lists=shape.lists)
            tiles = torch.from_numpy(strided.tiles(src_slot, dst_slot)).to(zero.device)
            kernels.launch(strided.plan, zero[:1], zero[1:], tiles)


def _split(table: Any, split: int) -> tuple[Any, Any]:
    """A rows launch's table as its source and destination page lists."""
    if isinstance(table, Pointer):
        return table, Pointer(table.address + 8 * split)
    return table[:split], table[split:]


class _SlotRecipe:
    """A state slot's launch of its own in a prepared write (its tiles shifted on the host)."""

    __slots__ = ("at", "plan", "bases", "device")

    def __init__(self, at: int, plan: _SlotPlan, bases: _Bases) -> None:
        self.at, self.plan, self.bases, self.device = at, plan, bases, bases.table.device

    def launch(self, values: Sequence[Any]) -> _Launch:
        named = values[self.at]
        src_slot, dst_slot = named[-2], named[-1]
        plan, table = self.plan, self.bases.table
        plan.check(src_slot, dst_slot)
        return _Launch(self.bases, plan.strided.tiles(src_slot, dst_slot),
                       lambda t, stream=None: kernels.launch(plan.strided.plan, table[:1], table[1:], t, stream=stream),
                       plan.nbytes, plan.descriptors)


class _DescsRecipe:
    """A part of descriptor rows in a prepared write: checked and planned when posted."""

    __slots__ = ("adapter", "mapped", "at", "local_kind", "remote_kind", "device")

    def __init__(self, adapter: CudaIpcTransport, mapped: _Peer, at: int, local_kind: MemKind,
                 remote_kind: MemKind) -> None:
        self.adapter, self.mapped, self.at = adapter, mapped, at
        self.local_kind, self.remote_kind, self.device = local_kind, remote_kind, None

    def launch(self, values: Sequence[Any]) -> _Launch:
        named = values[self.at]
        local, remote = named[-2], named[-1]
        return self.adapter._descs_launch(self.mapped, local, self.local_kind, remote, self.remote_kind, "post_parts")


class PreparedParts:
    """A write of several parts to one peer, planned (``CudaIpcTransport.prepare_parts``):
    ``post(values, tag)`` posts it with the last two items of ``values[i]`` the pages or slots of
    part ``i`` (``part_values``' pair, or any tuple ending with them, as the core's parts do),
    checking only them. A link keeps one per shape of its writes (the ``PostGroups`` of a chunk:
    which groups, token range, layers), so a hybrid write costs its pages' checks and lists, its
    slot numbers' check and the launch, as a one-group write does. Planned again if the peer was
    removed and added since."""

    __slots__ = ("_adapter", "peer", "_mapped", "_parts", "_recipes", "_mixed")

    def __init__(self, adapter: CudaIpcTransport, peer: str, mapped: _Peer, parts: tuple[Any, ...],
                 recipes: tuple[Any, ...], mixed: bool) -> None:
        self._adapter, self.peer, self._mapped, self._parts = adapter, peer, mapped, parts
        self._recipes, self._mixed = recipes, mixed

    def post(self, values: Sequence[Any], tag: bytes) -> KernelXfer:
        adapter = self._adapter
        adapter._check_open()
        if adapter._peers.get(self.peer) is not self._mapped:
            fresh = adapter.prepare_parts(self.peer, self._parts)
            self._mapped, self._recipes, self._mixed = fresh._mapped, fresh._recipes, fresh._mixed
        launches = [recipe.launch(values) for recipe in self._recipes]
        if self._mixed and len({launch.bases.table.device for launch in launches}) != 1:
            raise TransportError("post_parts: the parts are on different devices")
        return adapter._run(self._mapped, launches, tag)




def _page_rows(listed: Sequence[Sequence[int]], count: int, limits: Sequence[int]) -> np.ndarray | None:
    """The page lists of a rows launch as its table (int64, one list after another) in one
    conversion, each list checked to hold ``count`` pages in ``[0, limit)``; None if any does
    not (``_page_list`` then finds which, and says so). A few pages per list are checked as plain
    integers (``max`` per list, one ``min``: cheaper than numpy's reductions there), more as one
    array, one unsigned maximum per list."""
    if count <= _FEW_PAGES:
        flat: list[int] = []
        for pages, limit in zip(listed, limits):
            if len(pages) != count or max(pages) >= limit:
                return None
            flat.extend(pages)
        return np.array(flat, dtype=np.int64) if min(flat) >= 0 else None
    if any(len(pages) != count for pages in listed):
        return None
    table = np.fromiter(itertools.chain.from_iterable(listed), dtype=np.int64, count=count * len(listed))
    # as unsigned, a negative page is huge: one reduction per list checks both ends
    for high, limit in zip(table.view(np.uint64).reshape(len(listed), count).max(axis=1).tolist(), limits):
        if high >= limit:
            return None
    return table


def _page_list(listed: Sequence[int], side: int, first: int, count: int, page_bytes: int, room: int, start: int,
               end: int) -> Sequence[int]:
    """The first ``count`` pages of ``listed``, the used ones (from ``first``) checked to lie in
    registered memory (``room`` bytes from each region base): a few pages as plain integers
    (they cost less than arrays), more as an int64 array."""
    where = ("local", "remote")[side]
    if len(listed) < count:
        raise TransportError(f"post_plan: {len(listed)} {where} pages, tokens [{start}, {end}) need {count}")
    if isinstance(listed, (list, tuple)) and count - first <= _FEW_PAGES:
        used = listed[first:count]
        low, high = min(used), max(used)
        out: Sequence[int] = listed[:count]
    else:
        out = np.asarray(listed, dtype=np.int64)[:count]
        used = out[first:]
        low, high = int(used.min()), int(used.max())
    if low < 0 or (high + 1) * page_bytes > room:
        raise TransportError(f"post_plan: a {where} page of {list(used)} is not inside registered memory "
                             f"({room // page_bytes} pages of {page_bytes} bytes from each region base)")
    return out
