"""How one room's bytes go from this prefill rank to one decode rank, over a Transport.

Theory of operation
-------------------
The geometry planner gives a per-region *pattern* of extents; this module expands it over
every region (layer, plane) and posts it as one write:

* ``direct`` (same block size, layout and heads): whole pages. Both sides' memory is
  prepared once as descriptor lists of one page per row (row ``r * num_blocks + page``); a
  write picks rows by index, and the transport merges runs of consecutive pages.
* ``sliced`` (any other pair): one descriptor per extent per region, built for the write.
* ``staged``: the pair's head slice of a token range is gathered into local staging, one bulk
  WRITE carries it into a region the decode rank granted, and decode scatters it
  (``kvproto.aio.staging``): one descriptor per piece instead of thousands.
* a *pattern route* (the adapter's ``route(peer).pattern``, e.g. the kernel path): direct and
  sliced writes go to the adapter as the pattern itself (extents relative to a region's base,
  applied to every region), which it moves in one launch: nothing is expanded into rows here.

The aux slot moves through prepared one-slot-per-row lists. A paged group beyond the first
(hybrid caches) has a ``LinkPath`` of its own, over its own regions; a state group's slot moves
through a ``StatePath``: the byte runs ``plan_state`` gives inside one slot, placed at the two
slots in every region (layer x tensor), each side's slots its own stride apart (slots inside
pages: ``StateGroup.strides``).

*One write of several groups* (``PostGroups``, ``post_parts``): every path gives its part of the
write as a ``Part`` (descriptor rows, or on a pattern route the plan itself) and the parts go to
the transport as one write under one tag: one ``post_descs`` of all rows, or on a pattern route
one ``post_parts`` (a launch per part, one completion, one tag). A hybrid room thus costs a write
per chunk and link, as a one-group room does. A link's ``GroupWrites`` keeps each *shape* of such
a write (groups, token ranges, layers) that it posted prepared by the adapter
(``prepare_parts``), so the next write of that shape names only its pages and slots; the parts
that the core gives several links of one room (its decode TP ranks) are taken apart once. Nothing here
decides anything about rooms; errors surface as ``TransportError`` to the caller.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvproto.aio.memory import KVCache, StateCache
from kvproto.core import events
from kvproto.geometry import KVGeometry, PairPlan
from kvproto.geometry.plan import PageListError
from kvproto.geometry.groups import StateRun
from kvproto.kernels.pattern import pair_extents
from kvproto.transport.base import DescList, MemKind, Route, Transport, Xfer


SMALL_WRITE_PAGES = 8
"""A direct write of at most this many pages is planned with plain integers (``_post_few_pages``)."""


def page_rows(bases: Sequence[int], num_blocks: int, page_bytes: int, device_id: int) -> np.ndarray:
    """One ``(address, page_bytes, device)`` row per page of every region, region-major."""
    base = np.asarray(bases, dtype=np.int64)[:, None]
    addrs = (base + np.arange(num_blocks, dtype=np.int64)[None, :] * page_bytes).reshape(-1)
    rows = np.empty((addrs.size, 3), dtype=np.int64)
    rows[:, 0] = addrs
    rows[:, 1] = page_bytes
    rows[:, 2] = device_id
    return rows


def slot_rows(address: int, slot_bytes: int, slots: int) -> np.ndarray:
    rows = np.empty((slots, 3), dtype=np.int64)
    rows[:, 0] = address + np.arange(slots, dtype=np.int64) * slot_bytes
    rows[:, 1] = slot_bytes
    rows[:, 2] = 0
    return rows


def aux_rows(buffers: Sequence[tuple[int, int]], slots: int) -> np.ndarray:
    """Every slot of every aux buffer ((address, bytes per slot) each): buffer ``b``'s slot ``s`` is
    row ``b * slots + s``."""
    return np.concatenate([slot_rows(a, n, slots) for a, n in buffers])


def aux_indices(slot: int, parts: int, slots: int) -> np.ndarray:
    """The rows of ``aux_rows`` that hold ``slot`` of every buffer."""
    return slot + slots * np.arange(parts, dtype=np.int64)


class LocalLists:
    """This rank's memory, prepared once for direct and aux writes (lazily)."""

    def __init__(self, transport: Transport, kv: KVCache) -> None:
        self.transport = transport
        self.kv = kv
        self._pages: DescList | None = None
        self._aux: DescList | None = None

    def pages(self) -> DescList:
        if self._pages is None:
            g = self.kv.geometry
            rows = page_rows(self.kv.region_addresses, g.num_blocks, g.page_bytes, self.kv.device_id)
            self._pages = self.transport.prepare(None, rows, self.kv.mem_kind)
        return self._pages

    def aux(self) -> DescList:
        if self._aux is None:
            aux = self.kv.aux
            assert aux is not None
            self._aux = self.transport.prepare(None, aux_rows(aux.buffers, aux.slots), MemKind.DRAM)
        return self._aux

    def release(self) -> None:
        for dlist in (self._pages, self._aux):
            if dlist is not None:
                self.transport.release_prepared(dlist)
        self._pages = self._aux = None


@dataclass(frozen=True, slots=True)
class Posted:
    xfer: Xfer
    nbytes: int
    descriptors: int


@dataclass(frozen=True, slots=True, eq=False)
class SlotRows:
    """A state group's rows of slot 0, one per region and run, and how far each row moves per slot
    on each side: slot ``s`` into slot ``d`` is ``src + s * src_stride`` into ``dst + d *
    dst_stride``. A link keeps one for its lifetime, so a pattern route checks it once."""

    src: np.ndarray
    src_stride: np.ndarray
    dst: np.ndarray
    dst_stride: np.ndarray
    length: np.ndarray
    nbytes: int = field(init=False)
    """Bytes one slot moves: every row's length."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", int(self.length.sum()))


@dataclass(slots=True)
class Part:
    """One path's share of a write of several parts: descriptor ``rows`` (local, remote); or on a
    pattern route, ``plan``, the arguments of the adapter's ``post_plan`` after the peer, or a
    state group's ``slots`` with the two slot numbers. (Made for one write and read once, as a
    plain record: it is built on every write of a hybrid room.)"""

    nbytes: int
    local_kind: MemKind
    remote_kind: MemKind
    rows: tuple[np.ndarray, np.ndarray] | None = None
    plan: tuple[Any, ...] | None = None
    slots: SlotRows | None = None
    src_slot: int = 0
    dst_slot: int = 0


def post_parts(transport: Transport, peer: str, route: Route | None, parts: Sequence[Part], tag: bytes) -> Posted:
    """``parts`` as one write tagged ``tag``: on a pattern route, the adapter's ``post_parts``;
    else one ``post_descs`` of every part's rows (all of one memory kind per side, as the groups
    of one cache are: ``KVCache.with_groups``)."""
    if route is not None and route.pattern:
        xfer = transport.post_parts(peer, parts, tag)  # type: ignore[attr-defined]
        return Posted(xfer, *_counts(parts))
    nbytes = sum(p.nbytes for p in parts)
    kinds = {(p.local_kind, p.remote_kind) for p in parts}
    if len(kinds) != 1 or any(p.rows is None for p in parts):
        raise ValueError(f"one write cannot join parts of memory kinds {sorted(kinds)}")
    local = np.concatenate([p.rows[0] for p in parts])  # type: ignore[index]
    remote = np.concatenate([p.rows[1] for p in parts])  # type: ignore[index]
    (local_kind, remote_kind), = kinds
    return Posted(transport.post_descs(peer, local, local_kind, remote, remote_kind, tag), nbytes, len(local))


def _counts(parts: Sequence[Part]) -> tuple[int, int]:
    """(bytes, descriptors) of a pattern route's write of ``parts``."""
    nbytes = descriptors = 0
    for p in parts:
        nbytes += p.nbytes
        if p.rows is not None:
            descriptors += len(p.rows[0])
        elif p.slots is not None:
            descriptors += len(p.slots.length)
    return nbytes, descriptors


class Shapes(dict):  # type: ignore[type-arg]
    """Prepared writes of a link by shape (``PreparedParts``, see ``GroupWrites``): at most
    ``LIMIT``, then forgotten all at once."""

    LIMIT = 256
    """Shapes kept per link: a shape per prompt length in flight, or per token range and layer
    span of a streamed room (as many as the adapter keeps launch shapes)."""

    def keep(self, key: Any, value: Any) -> Any:
        if len(self) >= self.LIMIT:
            self.clear()
        self[key] = value
        return value


def _preparer(transport: Transport, route: Route | None) -> Any:
    """The adapter's ``prepare_parts`` where writes to the peer go over a pattern route and the
    adapter prepares them (the kernel path), else None."""
    return getattr(transport, "prepare_parts", None) if route is not None and route.pattern else None


_LAST_PARTS: list[tuple[Any, Any]] = [((), ())]
"""The last parts posted on any link, with their shape's key: the core gives the links of one
room's TP ranks the very same parts (``SenderCore._alike``), taken apart once. A pair swapped
whole (parts are immutable), kept in a list, not on the class: writing a class attribute for
every write would make Python forget what it had looked up on the class."""

_SHAPE = operator.itemgetter(slice(None, -2))
"""A part's shape: all its fields but the last two (``events.PagedPart``)."""


class GroupWrites:
    """One link's writes of several groups (``PostGroups``), each as one transport write.

    Each write's parts become the paths' ``Part`` s and go to ``post_parts``. Where the route is a
    pattern route and the adapter prepares writes (``prepare_parts``, the kernel path), a write's
    *shape* (which groups, token range and layers each part has) is planned once and kept: the
    next write of that shape (every room of that length) hands the adapter only its pages and
    slot numbers, so a hybrid write costs what a one-group write does plus its lists' checks."""

    def __init__(self, path: LinkPath, groups: Sequence[LinkPath | StatePath]) -> None:
        self.paths: tuple[LinkPath | StatePath, ...] = (path, *groups)
        self._prepare = _preparer(path.transport, path.route)
        self._shapes = Shapes()

    def post(self, parts: Sequence[events.Part], tag: bytes) -> tuple[Posted, tuple[str, ...]]:
        """``parts`` (the core's, of a ``PostGroups``) as one write: what was posted, the paths' names."""
        first = self.paths[0]
        if self._prepare is None:
            made, kinds = self._parts(parts)
            return post_parts(first.transport, first.peer, first.route, made, tag), kinds
        last = _LAST_PARTS[0]
        if last[0] is parts:  # the parts another link's write just took (``SenderCore._alike``)
            key = last[1]
        else:  # each part's shape (``events.PagedPart``: all but its last two fields)
            key = tuple(map(_SHAPE, parts))
            _LAST_PARTS[0] = (parts, key)
        shape = self._shapes.get(key)
        if shape is None:
            made, kinds = self._parts(parts)
            shape = self._shapes.keep(key, (self._prepare(first.peer, made), *_counts(made), kinds))
        # what a write of that shape names: each part's last two fields, read off the parts themselves
        return Posted(shape[0].post(parts, tag), shape[1], shape[2]), shape[3]

    def _parts(self, parts: Sequence[events.Part]) -> tuple[list[Part], tuple[str, ...]]:
        """The paths' shares of one write, and the paths' names."""
        out: list[Part] = []
        kinds: dict[str, None] = {}
        for part in parts:
            path = self.paths[part.group]
            if isinstance(part, events.StatePart):
                out.append(path.part(part.src_slot, part.dst_slot, part.layers))  # type: ignore[call-arg]
            else:
                out.append(path.part(part.src_pages, part.dst_pages,  # type: ignore[call-arg]
                                     part.start_token, part.end_token, part.layers))
            kinds[path.label] = None
        return out, tuple(kinds)

    def release(self) -> None:
        self._shapes.clear()


class LinkPath:
    """The route from this prefill rank to one decode rank (one registered link)."""

    def __init__(
        self,
        *,
        transport: Transport,
        local: LocalLists,
        peer: str,
        plan: PairPlan | None,
        remote: KVGeometry,
        remote_bases: Sequence[int],
        remote_kind: MemKind,
        remote_device: int,
        remote_aux: tuple[tuple[tuple[int, int], ...], int] | None,
        kind: str | None = None,
        remote_staging: tuple[int, int, MemKind, int] | None = None,
        route: Route | None = None,
    ) -> None:
        self.transport = transport
        self.local = local
        self.peer = peer
        self.plan = plan
        self.remote = remote
        self.remote_bases = np.asarray(remote_bases, dtype=np.int64)
        self.local_bases = np.asarray(local.kv.region_addresses, dtype=np.int64)
        self.remote_kind = remote_kind
        self.remote_device = remote_device
        self.remote_aux = remote_aux
        self.kind = kind or ("none" if plan is None else ("direct" if plan.direct else "sliced"))
        self.route = route
        """The adapter's route to the peer (``route_of``); ``pattern`` routes take whole patterns."""
        self.remote_staging = remote_staging
        """(address, length, memory kind, device) of the decode rank's staging region."""
        self._remote_pages: DescList | None = None
        self._remote_aux: DescList | None = None
        self._prepare = _preparer(transport, route)
        self._shapes = Shapes()
        """Its writes on a pattern route, prepared by token range and layers."""
        self._layer_regions: dict[tuple[int, int], tuple[int, np.ndarray, np.ndarray]] = {}

    @property
    def label(self) -> str:
        """The path's name in ``room.stats.paths``: its kind, and the route where a pattern route
        moves it (``direct-kernel``, ``sliced-kernel``)."""
        if self.route is not None and self.route.pattern and self.kind in ("direct", "sliced"):
            return f"{self.kind}-{self.route.name}"
        return self.kind

    def post_kv(self, tag: bytes, src_pages: Sequence[int], dst_pages: Sequence[int], start: int, end: int,
                layers: tuple[int, int] | None = None) -> Posted:
        """One write of tokens ``[start, end)``, of every layer or of ``layers`` (``(first, end)``)."""
        assert self.plan is not None, "post_kv on a link this rank does not write"
        if self.route is not None and self.route.pattern:
            key = (start, end, layers)
            shape = self._shapes.get(key)
            if shape is None:
                part = self.part(src_pages, dst_pages, start, end, layers)
                if self._prepare is None:
                    xfer = self.transport.post_plan(self.peer, *part.plan, tag)  # type: ignore[attr-defined,misc]
                    return Posted(xfer, part.nbytes, 0)
                shape = self._shapes.keep(key, (self._prepare(self.peer, [part]), part.nbytes))
            return Posted(shape[0].post(((src_pages, dst_pages),), tag), shape[1], 0)
        first, local_bases, remote_bases = self._regions(layers)
        if self.plan.direct and end - start <= SMALL_WRITE_PAGES * self.plan.src.block_size:
            return self._post_few_pages(tag, src_pages, dst_pages, start, end, first, len(local_bases))
        pattern = self._pattern(src_pages, dst_pages, start, end)
        regions = len(local_bases)
        nbytes = int(pattern[:, 2].sum()) * regions
        if self.plan.direct:
            return self._post_pages(tag, pattern, nbytes, first, regions)
        local_rows, remote_rows = self._rows(pattern, local_bases, remote_bases)
        xfer = self.transport.post_descs(
            self.peer, local_rows, self.local.kv.mem_kind, remote_rows, self.remote_kind, tag
        )
        return Posted(xfer, nbytes, len(local_rows))

    def part(self, src_pages: Sequence[int], dst_pages: Sequence[int], start: int, end: int,
             layers: tuple[int, int] | None = None) -> Part:
        """Tokens ``[start, end)`` (of ``layers``) as a part of a write of several (``post_parts``)."""
        assert self.plan is not None, "a part on a link this rank does not write"
        _first, local_bases, remote_bases = self._regions(layers)
        kinds = (self.local.kv.mem_kind, self.remote_kind)
        if self.route is not None and self.route.pattern:
            if not start < end:
                raise ValueError(f"tokens [{start}, {end}) move no bytes")
            moved = (end - start) * self.plan.head_count * self.plan.src.head_bytes  # exactly the tokens
            return Part(moved * len(local_bases), *kinds, plan=(
                self.plan, local_bases, kinds[0], remote_bases, kinds[1], src_pages, dst_pages, start, end))
        if self.plan.direct and end - start <= SMALL_WRITE_PAGES * self.plan.src.block_size:
            page = self.plan.src.page_bytes
            runs = self._few_page_runs(src_pages, dst_pages, start, end)
            pattern = np.array([(s * page, d * page, n * page) for s, d, n in runs], dtype=np.int64)
        else:
            pattern = self._pattern(src_pages, dst_pages, start, end)
        return Part(int(pattern[:, 2].sum()) * len(local_bases), *kinds,
                    rows=self._rows(pattern, local_bases, remote_bases))

    def _pattern(self, src_pages: Sequence[int], dst_pages: Sequence[int], start: int, end: int) -> np.ndarray:
        assert self.plan is not None
        pattern = pair_extents(self.plan, src_pages, dst_pages, start, end)  # (E, 3): src_off, dst_off, length
        if not len(pattern):
            raise ValueError(f"tokens [{start}, {end}) move no bytes")
        return pattern

    def _rows(self, pattern: np.ndarray, local_bases: np.ndarray, remote_bases: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        """``pattern`` placed in every region pair: (local rows, remote rows)."""
        local_rows = np.empty((len(local_bases), len(pattern), 3), dtype=np.int64)  # region-major
        remote_rows = np.empty_like(local_rows)
        np.add(local_bases[:, None], pattern[None, :, 0], out=local_rows[:, :, 0])
        np.add(remote_bases[:, None], pattern[None, :, 1], out=remote_rows[:, :, 0])
        local_rows[:, :, 1] = remote_rows[:, :, 1] = pattern[:, 2]
        local_rows[:, :, 2] = self.local.kv.device_id
        remote_rows[:, :, 2] = self.remote_device
        return local_rows.reshape(-1, 3), remote_rows.reshape(-1, 3)

    def _regions(self, layers: tuple[int, int] | None) -> tuple[int, np.ndarray, np.ndarray]:
        """(first region, local bases, remote bases) of ``layers`` (regions ``layer * planes +
        plane``), the same arrays every time for one span (adapters recognise them by identity)."""
        if layers is None:
            return 0, self.local_bases, self.remote_bases
        cached = self._layer_regions.get(layers)
        if cached is None:
            planes = len(self.local_bases) // self.local.kv.geometry.num_layers
            a, b = layers[0] * planes, layers[1] * planes
            cached = self._layer_regions[layers] = (a, self.local_bases[a:b], self.remote_bases[a:b])
        return cached

    def _post_few_pages(self, tag: bytes, src_pages: Sequence[int], dst_pages: Sequence[int], start: int, end: int,
                        region0: int, count: int) -> Posted:
        """``_post_pages`` of a write of a few whole pages, with plain integers: what a small room
        costs the prefill rank is mostly fixed costs, and array operations on a handful of pages
        cost more than the arithmetic (the transport merges consecutive pages as before)."""
        src_g, dst_g = self.local.kv.geometry, self.remote
        runs = self._few_page_runs(src_pages, dst_pages, start, end)
        regions = range(region0, region0 + count)
        local_idx = [r * src_g.num_blocks + s + k for r in regions for s, _, n in runs for k in range(n)]
        remote_idx = [r * dst_g.num_blocks + d + k for r in regions for _, d, n in runs for k in range(n)]
        xfer = self.transport.post_prepared(self.peer, self.local.pages(), np.array(local_idx, dtype=np.int64),
                                            self.prepare(), np.array(remote_idx, dtype=np.int64), tag)
        return Posted(xfer, sum(n for _, _, n in runs) * src_g.page_bytes * count, len(runs) * count)

    def _few_page_runs(self, src_pages: Sequence[int], dst_pages: Sequence[int], start: int, end: int
                       ) -> list[list[int]]:
        """The pages of tokens ``[start, end)`` of a direct pair as runs ``[src page, dst page,
        pages]`` consecutive on both sides, with plain integers, checked as ``pair_extents`` checks
        them (the few pages of a small write: ``_post_few_pages``, ``part``)."""
        src_g, dst_g = self.local.kv.geometry, self.remote
        first, last = start // src_g.block_size, (end - 1) // src_g.block_size
        if last >= len(src_pages) or last >= len(dst_pages):
            side, pages = ("source", src_pages) if last >= len(src_pages) else ("destination", dst_pages)
            raise PageListError(f"{side} page list has {len(pages)} pages, but tokens [{start}, {end}) in blocks "
                                f"of {src_g.block_size} need page index {last}")
        runs: list[list[int]] = []
        for i in range(first, last + 1):
            s, d = int(src_pages[i]), int(dst_pages[i])
            if not 0 <= s < src_g.num_blocks:
                raise PageListError(f"source page {s} at index {i} is outside the pool [0, {src_g.num_blocks})")
            if not 0 <= d < dst_g.num_blocks:
                raise PageListError(f"destination page {d} at index {i} is outside the pool [0, {dst_g.num_blocks})")
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        return runs

    def _post_pages(self, tag: bytes, pattern: np.ndarray, nbytes: int, region0: int = 0,
                    count: int | None = None) -> Posted:
        src_g, dst_g = self.local.kv.geometry, self.remote
        page = src_g.page_bytes
        counts = pattern[:, 2] // page
        first = np.repeat(np.cumsum(counts) - counts, counts)
        step = np.arange(int(counts.sum()), dtype=np.int64) - first
        src_idx = np.repeat(pattern[:, 0] // page, counts) + step
        dst_idx = np.repeat(pattern[:, 1] // page, counts) + step
        count = len(self.local_bases) if count is None else count
        regions = np.arange(region0, region0 + count, dtype=np.int64)[:, None]
        local_idx = (regions * src_g.num_blocks + src_idx[None, :]).reshape(-1)
        remote_idx = (regions * dst_g.num_blocks + dst_idx[None, :]).reshape(-1)
        xfer = self.transport.post_prepared(
            self.peer, self.local.pages(), local_idx, self.prepare(), remote_idx, tag
        )
        return Posted(xfer, nbytes, len(pattern) * count)

    def prepare(self) -> DescList:
        """The peer's pages as a prepared list (one row per page of every region), made once."""
        if self._remote_pages is None:
            dst_g = self.remote
            rows = page_rows(self.remote_bases.tolist(), dst_g.num_blocks, dst_g.page_bytes, self.remote_device)
            self._remote_pages = self.transport.prepare(self.peer, rows, self.remote_kind)
        return self._remote_pages

    def post_staged(self, tag: bytes, local: tuple[int, MemKind, int], remote_offset: int, nbytes: int) -> Posted:
        """One WRITE of ``nbytes`` from local staging ``(address, kind, device)`` into the decode
        rank's staging region at ``remote_offset``: one descriptor."""
        assert self.remote_staging is not None
        address, length, kind, device = self.remote_staging
        if remote_offset + nbytes > length:
            raise ValueError(f"staged write of {nbytes} bytes at {remote_offset} overruns the {length}-byte region")
        local_rows = np.array([[local[0], nbytes, local[2]]], dtype=np.int64)
        remote_rows = np.array([[address + remote_offset, nbytes, device]], dtype=np.int64)
        return Posted(self.transport.post_descs(self.peer, local_rows, local[1], remote_rows, kind, tag), nbytes, 1)

    def post_aux(self, tag: bytes, src_slot: int, dst_slot: int) -> Posted:
        local = self.local.kv.aux
        assert self.remote_aux is not None and local is not None
        buffers, slots = self.remote_aux
        if self._remote_aux is None:
            self._remote_aux = self.transport.prepare(self.peer, aux_rows(buffers, slots), MemKind.DRAM)
        parts = len(buffers)  # one descriptor per buffer, one write (registration matched the buffers)
        xfer = self.transport.post_prepared(
            self.peer, self.local.aux(), aux_indices(src_slot, parts, local.slots), self._remote_aux,
            aux_indices(dst_slot, parts, slots), tag
        )
        return Posted(xfer, local.slot_bytes, parts)

    def release(self) -> None:
        for dlist in (self._remote_pages, self._remote_aux):
            if dlist is not None:
                self.transport.release_prepared(dlist)
        self._remote_pages = self._remote_aux = None
        self._shapes.clear()


class StatePath:
    """One state group's slot from this prefill rank to one decode rank (``plan_state``'s runs)."""

    def __init__(self, *, transport: Transport, peer: str, local: StateCache, runs: Sequence[StateRun],
                 remote_bases: Sequence[int], remote_kind: MemKind, remote_device: int,
                 remote_strides: Sequence[int], route: Route | None = None) -> None:
        """``remote_strides``: per tensor, the bytes between the decode rank's slots (its
        ``StateGroup.strides``, learnt at registration); this rank's are its cache's."""
        self.transport = transport
        self.peer = peer
        self.local = local
        self.remote_kind = remote_kind
        self.remote_device = remote_device
        self.route = route
        self._slot_rows: dict[tuple[int, int] | None, SlotRows] = {}
        tensors = len(local.group.tensors)
        runs_arr = np.asarray([tuple(r) for r in runs], dtype=np.int64).reshape(-1, 4)  # region, src, dst, length
        self._region = runs_arr[:, 0]
        self._layer = self._region // tensors
        self._src = np.asarray(local.region_addresses, dtype=np.int64)[self._region] + runs_arr[:, 1]
        self._dst = np.asarray(remote_bases, dtype=np.int64)[self._region] + runs_arr[:, 2]
        self._length = runs_arr[:, 3]
        self._src_slot = np.asarray(local.slot_strides, dtype=np.int64)[self._region % tensors]
        self._dst_slot = np.asarray(remote_strides, dtype=np.int64)[self._region % tensors]

    @property
    def label(self) -> str:
        return "state"

    def part(self, src_slot: int, dst_slot: int, layers: tuple[int, int] | None = None) -> Part:
        """Slot ``src_slot`` into the decode rank's ``dst_slot``, of the group's ``layers``
        (``(first, end)``, its own) or of all of them, as a part of a write (``post_parts``)."""
        pick = slice(None) if layers is None else (self._layer >= layers[0]) & (self._layer < layers[1])
        if self.route is not None and self.route.pattern:
            rows = self._slot_rows.get(layers)
            if rows is None:
                rows = self._slot_rows[layers] = SlotRows(self._src[pick], self._src_slot[pick], self._dst[pick],
                                                          self._dst_slot[pick], self._length[pick])
            if not rows.nbytes:
                raise ValueError("the state write moves no bytes")
            return Part(rows.nbytes, self.local.mem_kind, self.remote_kind, slots=rows, src_slot=src_slot,
                        dst_slot=dst_slot)
        length = self._length[pick]
        if not len(length):
            raise ValueError("the state write moves no bytes")
        local_rows = np.empty((len(length), 3), dtype=np.int64)
        remote_rows = np.empty_like(local_rows)
        local_rows[:, 0] = self._src[pick] + src_slot * self._src_slot[pick]
        remote_rows[:, 0] = self._dst[pick] + dst_slot * self._dst_slot[pick]
        local_rows[:, 1] = remote_rows[:, 1] = length
        local_rows[:, 2] = self.local.device_id
        remote_rows[:, 2] = self.remote_device
        return Part(int(length.sum()), self.local.mem_kind, self.remote_kind, rows=(local_rows, remote_rows))

    def release(self) -> None:
        pass
