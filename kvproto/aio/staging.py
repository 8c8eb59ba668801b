"""The staged path's I/O half: staging buffers, gathers and scatters, CUDA events polled.

Theory of operation
-------------------
A ``StagingBuffer`` is one contiguous byte tensor registered with the transport: on the decode
rank it is the region its ``StagingRing`` grants from; on the prefill rank it is where pieces
are gathered before their one bulk WRITE. It lives in device memory (GPU staging) or in pinned
host memory (host staging: for memory the transport cannot register, or where PCIe beats the
fabric); CPU caches use plain host memory.

Copies are asynchronous on CUDA: a gather or scatter is enqueued on a side stream (a
``kvproto.kernels.lane.Lane``, as the kernel path's) that first waits for the current stream, an
event is recorded after it, and ``Copies.poll()`` (called
by the endpoint's progress task) runs the continuation once ``event.query()`` is true. Nothing
waits on the device and the event loop never blocks. On the CPU the copy runs at once and the
continuation is called from ``poll`` as well, so both look the same to the endpoint.

The prefill side keeps its own ``StagingRing`` over its buffer: a piece's region is reused only
after the WRITE from it is DONE (``Stager.release``).

A piece of a cache of several groups is a block per group (``PiecePart``): the first group's, then
each group beyond it that the pair stages (``kvproto.geometry.groups.staged_groups``), back to back,
each ``tokens x unit`` bytes; ``Piece.copy`` gathers or scatters every block of a piece, on both
endpoints the same way. Consecutive blocks whose pages look alike (a hybrid model's
full-attention and linear-attention layers often share a page shape) are one block of their
regions side by side, so on a CUDA cache they move in one kernel launch reading one page table
per room (``JointTables``: every group's pages, then each region's offset into them).

The piece that carries a request's last token ends, between peers of minor 3, with the pair's
*state block* (``StateBlock``): the state slots the prefill rank writes into the decode rank,
gathered after the token blocks and scattered from there, so that a hybrid room's last piece is
still one descriptor (a state slot is one run per layer and tensor on both sides: as descriptors
of their own, a GDN model's slot costs a write of dozens). On a CUDA cache with device staging
the block rides in the piece's last staging launch (the rows kernel's ``SLOTS`` variant, its tiles
planned once per link as ``kvproto.kernels.pattern.StridedRows`` and put on the device once per
direction; a piece passes only each group's slot and the block's place, from which the kernel
finds every tile's two ends: ``StateBlock.fused``), so that piece costs the launches and uploads
a one-group piece does; elsewhere it moves run by run. The block itself is
``kvproto.aio.state_block``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvproto import kernels
from kvproto.aio import trace
from kvproto.aio.memory import KVCache, StateCache
from kvproto.aio.state_block import StateBlock
from kvproto.kernels.lane import Lane
from kvproto.kernels.uploads import Uploads
from kvproto.core.staging import ALIGN as STAGING_ALIGN, StagingRing
from kvproto.geometry import plan_pair
from kvproto.geometry.groups import CacheGeometry, PagedGroup, staged_groups, state_block
from kvproto.transport.base import MemKind, MemoryRegion

log = logging.getLogger("kvproto")


STAGING_DEPTH = 8
"""Staged pieces are at most 1/STAGING_DEPTH of the smaller of the two staging buffers, so that
several are in flight at once (gathered, on the wire, scattered, granted ahead): what a pair moves
per second is the bytes in flight over the few milliseconds a piece takes from grant to scatter."""
STATE_ROOM_MAX = 256 << 20
"""Most bytes a default staging buffer adds for the state blocks of its pieces (``state_room``)."""


def piece_tokens(capacity: int, unit: int, tail: int) -> int:
    """Most tokens of a pair's staged piece: STAGING_DEPTH pieces of that many tokens (``unit``
    bytes each), each ending with the pair's state block (``tail`` bytes) and taking a multiple of
    ``STAGING_ALIGN`` bytes of the ring, fit in ``capacity``; at least one."""
    share = capacity // STAGING_DEPTH // STAGING_ALIGN * STAGING_ALIGN
    return max(1, (share - tail) // unit)


def state_room(kv: KVCache) -> int:
    """What a default staging buffer adds so that its STAGING_DEPTH pieces keep their tokens when
    each ends with a state block: STAGING_DEPTH times this rank's state bytes of one request (a
    pair's block carries at most those: its share of every state group), at most STATE_ROOM_MAX.
    Without it a buffer sized for STAGING_DEPTH whole pieces holds one fewer of them in flight."""
    per_request = sum(state.group.num_layers * sum(state.group.slot_bytes(state.tp_size))
                      for state in kv.groups if isinstance(state, StateCache))
    per_piece = -(-per_request // STAGING_ALIGN) * STAGING_ALIGN
    return min(STAGING_DEPTH * per_piece, STATE_ROOM_MAX)


class StagingBuffer:
    """``capacity`` bytes for staged pieces, on ``kv``'s device or in (pinned) host memory."""

    def __init__(self, kv: KVCache, capacity: int, *, host: bool = False) -> None:
        if not kv.tensors:
            raise ValueError("the staged path needs the cache's tensors (KVCache.from_tensors)")
        device = kv.tensors[0].device
        on_host = host or device.type == "cpu"
        pin = on_host and device.type == "cuda"
        self.tensor = torch.empty(capacity, dtype=torch.uint8, device="cpu" if on_host else device, pin_memory=pin)
        self.capacity = capacity
        self.address = self.tensor.data_ptr()
        self.kind = MemKind.DRAM if on_host else MemKind.VRAM
        self.device_id = 0 if on_host else (device.index or 0)
        self.where = "host" if on_host and device.type == "cuda" else ("cpu" if on_host else "device")
        self.on_gpu = not on_host
        """Whether the buffer is device memory (what each piece's copy asks)."""

    def region(self) -> MemoryRegion:
        return MemoryRegion(self.address, self.capacity, self.device_id, self.kind)

    def view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        return self.tensor[offset:offset + nbytes].view(dtype).view(shape)


class Copies:
    """Gathers and scatters in flight, each with the continuation to run when it is done.

    On a GPU a copy is launched on the copies' stream at once and its continuation runs once its
    event has fired. In host memory a copy is work of this thread (hundreds of milliseconds for a
    large piece on a slow host): it is queued and ``poll`` runs queued copies for at most
    ``HOST_SLICE_S`` per progress pass, the first always, so that the event loop answers peers
    (heartbeats above all) between copies however many pieces arrive at once."""

    HOST_SLICE_S = 0.005

    def __init__(self, device: torch.device, uploads: Uploads | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.lane = Lane(device) if self.cuda else None
        """The copies' stream (``kvproto.kernels.lane``): its wait for the caller's stream and its
        events are driver calls; the copies themselves run with its stream current."""
        self.stream = self.lane.stream if self.lane is not None else None
        self.uploads = uploads
        """Where the copies' launches find their tables: each copy's slots are sealed with its event."""
        self._pending: deque[tuple[Any, Callable[[], None]]] = deque()
        self._host: deque[tuple[Callable[[Any], None], Callable[[], None], Callable[[Exception], None] | None]] = deque()
        """Host-memory copies not run yet (class docstring)."""

    def run(self, copy: Callable[[Any], None], then: Callable[[], None],
            failed: Callable[[Exception], None] | None = None) -> None:
        """Enqueue ``copy(stream)``; ``then()`` runs from ``poll`` once it has completed. A host copy
        that raises calls ``failed(exc)`` instead (None: the exception leaves ``poll``); a GPU copy
        that raises while it is launched raises here."""
        if not self.cuda:
            self._host.append((copy, then, failed))
            return
        assert self.stream is not None and self.lane is not None
        self.lane.follow()
        with torch.cuda.stream(self.stream):
            began = None
            if trace.ENABLED:
                began = torch.cuda.Event(enable_timing=True)
                began.record(self.stream)
            try:
                copy(self.stream)
            finally:  # the tables put for it are free once what was launched has run
                if began is not None:
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(self.stream)
                else:
                    event = self.lane.record()
                if self.uploads is not None:
                    self.uploads.seal(event)
        if began is not None:
            then = self._timed(began, event, then)
        self._pending.append((event, then))

    @staticmethod
    def _timed(began: Any, ended: Any, then: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            trace.mark("copy_gpu_us", int(began.elapsed_time(ended) * 1000), 0)
            then()

        return timed

    def poll(self) -> int:
        """Run the continuations of finished copies, in order (and queued host copies, for a slice
        of time); returns how many ran."""
        ran = 0
        if self._host:
            ran += self._run_host(time.perf_counter() + self.HOST_SLICE_S)
        while self._pending:
            event, then = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            if self.lane is not None:
                self.lane.recycle(event)
            then()
            ran += 1
        return ran

    def _run_host(self, until: float | None) -> int:
        """Queued host copies and their continuations, in order, until ``until`` (None: all)."""
        ran = 0
        while self._host:
            copy, then, failed = self._host.popleft()
            try:
                copy(None)
            except Exception as exc:
                if failed is None:
                    raise
                failed(exc)
            else:
                then()
            ran += 1
            if until is not None and time.perf_counter() >= until:
                break
        return ran

    def finish(self) -> int:
        """Wait for every copy in flight (on this object's own stream), then run their
        continuations (close: nothing may still write the pages once their rooms end)."""
        if self.stream is not None and self._pending:
            self.stream.synchronize()
        return self._run_host(None) + self.poll()

    def __len__(self) -> int:
        return len(self._pending) + len(self._host)


@dataclass(frozen=True, slots=True)
class PieceShape:
    """What one staged token of a peer pair holds: regions x heads x head_dim elements."""

    regions: int
    head_count: int
    head_dim: int
    itemsize: int

    @property
    def unit(self) -> int:
        return self.regions * self.head_count * self.head_dim * self.itemsize

    def shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (self.regions, tokens, self.head_count, self.head_dim)


def gather_piece(kv: KVCache, regions: kernels.Regions, buf: StagingBuffer, offset: int, piece: PieceShape,
                 *, pages: torch.Tensor, start: int, end: int, head_offset: int, stream: Any,
                 slots: Any = None) -> None:
    out = buf.view(offset, piece.shape(end - start), kv.torch_dtype)
    kernels.gather(regions, layout=kv.geometry.layout, pages=pages, start_token=start, end_token=end,
                   head_offset=head_offset, head_count=piece.head_count, out=out, stream=stream, slots=slots)


def scatter_piece(kv: KVCache, regions: kernels.Regions, buf: StagingBuffer, offset: int, piece: PieceShape,
                  *, pages: torch.Tensor, start: int, end: int, head_offset: int, stream: Any,
                  slots: Any = None) -> None:
    staging = buf.view(offset, piece.shape(end - start), kv.torch_dtype)
    kernels.scatter(staging, regions, layout=kv.geometry.layout, pages=pages, start_token=start,
                    end_token=end, head_offset=head_offset, stream=stream, slots=slots)


class PageTables:
    """Each room's page table, made once and reused by every piece of the room.

    A room of a few GiB moves in a dozen or more pieces, all reading the same table. On a CUDA
    cache each piece's launch reads it from the endpoint's ring (``kvproto.kernels.uploads.Uploads``:
    a copy into pinned memory and one small copy to its device mirror, no allocation),
    so a piece enqueues its kernel and little else. The pages were range-checked when they
    entered the core (the application's by the core's own checks, a peer's against what it
    registered), which is why such a table may skip the kernels' checks. ``forget`` drops a
    room's table when the room ends.
    """

    def __init__(self, kv: KVCache, uploads: Uploads | None = None) -> None:
        self.kv = kv
        self.uploads = uploads
        self._tables: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}

    def get(self, room_id: int, pages: Sequence[int], *, keep: bool = True) -> Any:
        """The table of ``pages`` (a room's pages from token 0); call inside the copy's stream.
        ``keep=False`` (the room has ended: a piece queued before its end) keeps nothing."""
        known = self._tables.get(room_id)
        if known is not None and known[0] == tuple(pages):
            values = known[1]
        else:
            values = np.array(pages, dtype=np.int64)
            if keep:
                self._tables[room_id] = (tuple(pages), values)
        return _upload(values, self.kv, self.uploads)

    def forget(self, room_id: int) -> None:
        self._tables.pop(room_id, None)

    def __len__(self) -> int:
        return len(self._tables)


WARM_PEER_TP = (1, 2, 4, 8, 16, 32)
"""The peer TP sizes whose state-block launches a rank compiles at start (``warm_kernels``)."""


def warm_kernels(kv: KVCache, kernels_: CacheKernels, buf: StagingBuffer, *, gather: bool) -> threading.Thread | None:
    """Compile, in a background thread, the staging kernels this rank will launch: for every
    head count a pair can move (the local heads and their divisors, which is what other TP
    sizes take), so that the first room of a new link does not wait for compilation; and, for a
    cache with state groups, the launches that carry a pair's state block (``state_launches``)."""
    if not kv.tensors or kv.tensors[0].device.type != "cuda":
        return None
    heads = kv.geometry.local_heads
    counts = [n for n in range(heads, 0, -1) if heads % n == 0]
    host = buf.where == "host"
    with_state = [] if host else state_launches(kernels_, kv.cache_geometry, buf, gather=gather)

    def run() -> None:
        try:
            kernels.warm_up(kernels_.regions, layout=kv.geometry.layout, head_counts=counts, to_staging=gather,
                            host_staging=host, joined=any(isinstance(g, KVCache) for g in kv.groups),
                            slot_launches=with_state)
        except Exception:  # noqa: BLE001 - a failed warm-up only means the first room compiles
            log.warning("staging kernel warm-up failed; the first staged room will compile", exc_info=True)

    thread = threading.Thread(target=run, name="kvproto-kernel-warm-up", daemon=True)
    thread.start()
    return thread


def warm_rows_kernels(kv: KVCache) -> threading.Thread | None:
    """Compile, in a background thread, the kernel path's rows kernels (``kvproto.kernels.paged``)
    that this prefill rank will launch into a decode rank of the same model at any TP size of
    ``WARM_PEER_TP`` (the cache's own block size and layout on both sides): for each pair, the
    variant of long rooms and that of short ones and single layers (the kernel's rows per
    program, ``ROWS``, is the one constexpr that follows a write's size), each alone and batched.
    So the first room of a new link loads nothing; a pair of other block sizes or layouts
    compiles at its first room. None where the cache is not on a GPU or Triton is missing."""
    if not kv.tensors or kv.tensors[0].device.type != "cuda" or not kernels._have_triton():
        return None
    import dataclasses

    from kvproto.kernels import paged
    from kvproto.kernels.pattern import plan_rows

    own = kv.geometry
    regions = len(kv.region_addresses)
    plans = []
    for tp in WARM_PEER_TP:
        for rank in range(tp):
            try:
                pair = plan_pair(own, dataclasses.replace(own, tp_size=tp, tp_rank=rank))
                if pair.head_count == 0:
                    continue
                long = plan_rows(pair, 0, 4096, regions=regions)
            except Exception:  # noqa: BLE001 - a TP size this model cannot pair with
                continue
            plans += [long, dataclasses.replace(long, constants={**long.constants, "ROWS": 1})]
    device = kv.tensors[0].device

    def run() -> None:
        try:
            paged.warm_up_rows(plans, device)
        except Exception:  # noqa: BLE001 - a failed warm-up only means the first room compiles
            log.warning("rows kernel warm-up failed; the first room of a link will compile", exc_info=True)

    thread = threading.Thread(target=run, name="kvproto-rows-warm-up", daemon=True)
    thread.start()
    return thread


def state_launches(kernels_: CacheKernels, own: CacheGeometry, buf: StagingBuffer, *, gather: bool
                   ) -> list[tuple[Any, int, bool]]:
    """The launches that carry a state block which this rank's pieces make (``gather``: as the
    prefill rank, else as the decode rank) with a peer of the same model at any TP size of
    ``WARM_PEER_TP``, each once: ``(the block's pattern plan, head count, joined)``, what the kernel
    specialises on beyond the rank's own cache. The block's plan depends on the peer (which rows
    of a slot move, and where), so the pairs are planned here as a link would plan them."""
    if not kernels_.states:
        return []
    side = "prefill" if gather else "decode"
    seen: dict[tuple[Any, ...], tuple[Any, int, bool]] = {}
    for tp in sorted({*WARM_PEER_TP, own.tp_size}):
        for rank in range(tp):
            try:
                peer = own.with_tp(tp, rank)
                pair = (own, peer) if gather else (peer, own)
                piece = pair_piece(kernels_, *pair, side=side, minor=STATE_BLOCK_MINOR, buf=buf)
            except (ValueError, KeyError):  # the model does not split over tp ranks
                continue
            plan = piece.block.plan(gather) if piece.block is not None else None
            if plan is None:
                continue
            last = _blocks(piece.parts, 0, 1, joint=_joins(buf))[-1][0]
            launch = (plan, last[0].piece.head_count, len(last) > 1)
            seen.setdefault((plan.word, plan.vec, plan.tile_words, *launch[1:]), launch)
    return list(seen.values())


def _upload(values: np.ndarray, kv: KVCache, uploads: Uploads | None = None) -> Any:
    """``values`` (an int64 page table, range-checked by the kernels' plan, as by the core) where the
    kernels read it. On a CUDA cache it goes into ``uploads`` (the kernel reads its copy on the
    device; the copy's event frees it); without a ring it goes up as a pinned tensor, so that the
    upload is truly asynchronous: a copy from pageable memory makes the host wait for the stream."""
    cuda = bool(kv.tensors) and kv.tensors[0].device.type == "cuda"
    if cuda and uploads is not None:
        return uploads.put(values, kv.tensors[0].device)[0]
    table = torch.from_numpy(values)
    if cuda:
        table = table.pin_memory().to(kv.tensors[0].device, non_blocking=True)
    return table


class Stager:
    """Prefill side: local staging regions for pieces, reused only after their WRITE is DONE."""

    def __init__(self, buf: StagingBuffer) -> None:
        self.buf = buf
        self.ring = StagingRing(buf.capacity)
        self._waiting: deque[tuple[Any, Callable[[int, Any], None]]] = deque()
        self._keys = 0

    def acquire(self, nbytes: int, start: Callable[[int, Any], None]) -> None:
        """Reserve ``nbytes``; ``start(offset, key)`` runs once the region is free (maybe at once);
        ``release(key)`` returns it."""
        self._keys += 1
        key = ("piece", self._keys)
        self.ring.request(key, key, unit=nbytes, units=1)
        self._waiting.append((key, start))
        self._pump()

    def release(self, key: Any) -> None:
        self.ring.release(key)
        self._pump()

    def _pump(self) -> None:
        for grant in self.ring.take_grants():
            key, start = self._waiting.popleft()
            assert key == grant.key
            start(grant.offset, key)


class JointTables:
    """Each room's page table for blocks that move in one launch (``Piece.copy``): the groups'
    pages from token 0 back to back, read from the ring as ``PageTables``' are, with where each
    group's pages start in it (the launch's arguments). A room's long tables (more than
    ``KEEP_FROM`` pages) are made once per set of groups and kept until the room ends, as its
    chunks' pieces read them again; a short one costs less to make than to look up, and is made
    per piece."""

    KEEP_FROM = 64

    def __init__(self, uploads: Uploads | None = None) -> None:
        self.uploads = uploads
        self._tables: dict[int, dict[tuple[int, ...], tuple[tuple[tuple[int, ...], ...], np.ndarray,
                                                             tuple[int, ...]]]] = {}
        """By room: by the groups a launch joins, (their pages, the table, where each starts in it)."""

    def get(self, room_id: int, parts: Sequence[PiecePart], pages: Sequence[Sequence[int]], *,
            keep: bool = True) -> tuple[Any, tuple[int, ...]]:
        """The joined table where the kernel reads it (as ``PageTables.get``), and where each
        group's pages start in it."""
        lists = [pages[part.group] for part in parts]
        long = sum(map(len, lists)) > self.KEEP_FROM
        if long:
            groups = tuple(part.group for part in parts)
            snapshot = tuple(tuple(listed) for listed in lists)
            room = self._tables.get(room_id)
            known = None if room is None else room.get(groups)
            if known is not None and known[0] == snapshot:
                return _upload(known[1], parts[0].kv, self.uploads), known[2]
        flat: list[int] = []
        begins = []
        for listed in lists:
            begins.append(len(flat))
            flat += listed
        values, starts = np.array(flat, dtype=np.int64), tuple(begins)
        if long and keep:
            self._tables.setdefault(room_id, {})[groups] = (snapshot, values, starts)
        return _upload(values, parts[0].kv, self.uploads), starts

    def forget(self, room_id: int) -> None:
        self._tables.pop(room_id, None)

    def __len__(self) -> int:
        return sum(len(room) for room in self._tables.values())


class CacheKernels:
    """The staging kernels' view of a rank's groups: per paged group (0: the first) its cache, its
    regions and its page tables (``part`` makes a pair's block of one group); its state groups by
    group number (``states``, for a pair's state block)."""

    def __init__(self, kv: KVCache) -> None:
        cuda = bool(kv.tensors) and kv.tensors[0].device.type == "cuda"
        self.uploads = Uploads() if cuda else None
        """The ring every launch of this rank's pieces reads its tables from (``Copies`` seals it)."""
        self.joint = JointTables(self.uploads)
        self.states = {g: extra for g, extra in enumerate(kv.groups, start=1) if isinstance(extra, StateCache)}
        self.groups: dict[int, tuple[KVCache, kernels.Regions, PageTables]] = {
            0: (kv, kernels.Regions(kv.tensors), PageTables(kv, self.uploads))}
        for g, extra in enumerate(kv.groups, start=1):
            if isinstance(extra, KVCache):
                if not extra.tensors:
                    raise ValueError(f"group {extra.name!r}: the staged path needs every paged group's tensors "
                                     f"(KVCache.from_tensors)")
                self.groups[g] = (extra, kernels.Regions(extra.tensors), PageTables(extra, self.uploads))

    @property
    def regions(self) -> kernels.Regions:
        """The first group's regions."""
        return self.groups[0][1]

    def part(self, group: int, piece: PieceShape, head_offset: int) -> PiecePart:
        kv, regions, tables = self.groups[group]
        return PiecePart(group, kv, regions, tables, piece, head_offset, self.joint)

    def forget(self, room_id: int) -> None:
        for _kv, _regions, tables in self.groups.values():
            tables.forget(room_id)
        self.joint.forget(room_id)

    def __len__(self) -> int:
        return sum(len(tables) for _kv, _regions, tables in self.groups.values()) + len(self.joint)


@dataclass(frozen=True, slots=True)
class PiecePart:
    """One group's block of a pair's staged pieces: the group's cache, its kernels' view of its
    regions, its page tables, the block's shape and the pair's first head on this side."""

    group: int
    """0: the first group; ``g``: the ``g``-th group beyond it."""
    kv: KVCache
    regions: kernels.Regions
    tables: PageTables
    piece: PieceShape
    head_offset: int
    joint: JointTables | None = None
    """The rank's tables for blocks that move in one launch with their neighbours."""

    def joins(self, other: PiecePart) -> bool:
        """Whether ``other``'s block can move in one launch with this one's (``Piece.copy``)."""
        a, b = self.regions, other.regions
        return (a.shape[1:], a.page_stride, a.dtype, a.device, self.kv.geometry.layout, self.piece.head_count,
                self.head_offset) == (b.shape[1:], b.page_stride, b.dtype, b.device, other.kv.geometry.layout,
                                      other.piece.head_count, other.head_offset)


def piece_parts(kernels_: CacheKernels, prefill: CacheGeometry, decode: CacheGeometry, *,
                side: str) -> tuple[PiecePart, ...]:
    """The blocks of the pieces prefill rank ``prefill`` stages into decode rank ``decode``
    (staging.md): the first group's, then each group ``staged_groups`` names, with the pair's first
    head on ``side`` ("prefill" or "decode"); the prefill rank writes the first group there."""
    parts = []
    for i in (0, *staged_groups(prefill, decode)):
        p, d = prefill.groups[i], decode.groups[i]
        assert isinstance(p, PagedGroup) and isinstance(d, PagedGroup)
        plan = plan_pair(p.geometry, d.geometry)
        shape = PieceShape(p.geometry.num_regions, plan.head_count, p.geometry.head_dim, p.geometry.itemsize)
        parts.append(kernels_.part(i, shape, plan.src_head_offset if side == "prefill" else plan.dst_head_offset))
    return tuple(parts)


def piece_unit(parts: Sequence[PiecePart]) -> int:
    """Bytes per token of a piece of ``parts``."""
    return sum(part.piece.unit for part in parts)


STATE_BLOCK_MINOR = 3
"""The first minor version whose staged pieces end with the state block (staging.md)."""


@dataclass(frozen=True, slots=True, eq=False)
class Piece:
    """What one pair's staged pieces hold, on one side: the token blocks (``parts``) and, where
    both peers speak minor 3 and the prefill rank writes state into the decode rank, the state
    block that ends the piece carrying a request's last token."""

    parts: tuple[PiecePart, ...]
    block: StateBlock | None = None
    launches: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    """Where the cache and the staging share a GPU: each launch this pair's pieces make, by shape
    (run of blocks, direction, tokens, staging alignment, state block), made and checked by the
    first piece of that shape and run again for the later ones (``_copy_parts``)."""
    runs: dict[bool, Any] = field(default_factory=dict, repr=False)
    """The pieces' runs of blocks (``_blocks`` at one token: each run's bytes per token before
    it), planned once per way of joining them."""

    unit: int = field(init=False)
    """Bytes per token of the pair's pieces."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit", piece_unit(self.parts))

    @property
    def tail(self) -> int:
        """Bytes of the state block (0: none)."""
        return self.block.nbytes if self.block is not None else 0

    def copy(self, buf: StagingBuffer, offset: int, room_id: int, pages: Sequence[Sequence[int]], *, start: int,
             end: int, slots: dict[int, int] | None, keep: bool, stream: Any, gather: bool) -> None:
        """Gather (``gather``) or scatter the piece of tokens ``[start, end)`` at ``offset``: every
        token block, then the state block where ``slots`` (this side's slot by group number) are
        given: in the token blocks' last launch where the block has a kernel, else on its own."""
        fused = None
        if slots:
            assert self.block is not None, "state slots for a piece without a state block"
            at = offset + (end - start) * self.unit
            # the last launch is Triton's where the cache is on a GPU, or where it joins blocks
            triton = buf.on_gpu or len(_planned(self.parts, _joins(buf), self.runs)[-1][0]) > 1
            fused = self.block.fused(buf, at, slots, gather=gather) if triton else None
            if fused is None:
                self.block.copy(buf, at, slots, gather=gather, stream=stream)
        _copy_parts(self.parts, buf, offset, room_id, pages, start=start, end=end, keep=keep, stream=stream,
                    gather=gather, block=fused, launches=self.launches, runs=self.runs)


def pair_piece(kernels_: CacheKernels, prefill: CacheGeometry, decode: CacheGeometry, *, side: str, minor: int,
               buf: StagingBuffer) -> Piece:
    """The pieces prefill rank ``prefill`` stages into decode rank ``decode``, seen from ``side``
    ("prefill" or "decode"); ``minor``: the lower of the two peers' minor versions."""
    parts = piece_parts(kernels_, prefill, decode, side=side)
    runs = state_block(prefill, decode) if minor >= STATE_BLOCK_MINOR else ()
    block = StateBlock(runs, kernels_.states, side=side, unit=piece_unit(parts), buf=buf) if runs else None
    return Piece(parts, block)


def _copy_parts(parts: Sequence[PiecePart], buf: StagingBuffer, offset: int, room_id: int,
                pages: Sequence[Sequence[int]], *, start: int, end: int, keep: bool, stream: Any,
                gather: bool, block: Any = None,
                launches: dict[tuple[Any, ...], Any] | None = None, runs: dict[bool, Any] | None = None) -> None:
    """Every block of the piece, a launch per run of blocks that join; ``block``: a state block
    (``triton_kernels.Slots``) that rides in the last launch. Where the staging is on the cache's
    GPU, ``launches`` keeps each launch by shape: a piece of a shape seen before runs it again with
    its own pointers, unchecked (its pages are the core's; its staging is checked to lie in the
    buffer here)."""
    joint = _joins(buf)
    planned = _planned(parts, joint, runs)
    prepared = launches is not None and joint and buf.on_gpu
    for k, (run, before) in enumerate(planned):
        at = offset + (end - start) * before
        fused = block if k == len(planned) - 1 else None
        first = run[0]
        starts = None
        if len(run) > 1:
            assert first.joint is not None
            table, starts = first.joint.get(room_id, run, pages, keep=keep)
        else:
            table = first.tables.get(room_id, pages[first.group], keep=keep)
        if prepared:
            assert launches is not None
            with kernels.on(buf.tensor.device, stream):
                _launch_run(launches, k, run, buf, at, table, starts, fused, start=start, end=end, gather=gather)
            continue
        if len(run) > 1:
            regions = sum(len(part.regions) for part in run)
            staging = buf.view(at, (regions, end - start, first.piece.head_count, first.piece.head_dim),
                               first.kv.torch_dtype)
            kernels.copy_joined([part.regions for part in run], staging, table, layout=first.kv.geometry.layout,
                                start_token=start, end_token=end, head_offset=first.head_offset, to_staging=gather,
                                stream=stream, slots=fused, starts=starts)
            continue
        copy = gather_piece if gather else scatter_piece
        copy(first.kv, first.regions, buf, at, first.piece, pages=table, start=start, end=end,
             head_offset=first.head_offset, stream=stream, slots=fused)


def _planned(parts: Sequence[PiecePart], joint: bool, runs: dict[bool, Any] | None
             ) -> list[tuple[tuple[PiecePart, ...], int]]:
    """The runs of blocks of ``parts`` with each run's bytes per token before it (``_blocks`` at
    one token), kept in ``runs`` (a pair's ``Piece.runs``) once planned."""
    planned = None if runs is None else runs.get(joint)
    if planned is None:
        planned = _blocks(parts, 0, 1, joint=joint)
        if runs is not None:
            runs[joint] = planned
    return planned


def _launch_run(launches: dict[tuple[Any, ...], Any], k: int, run: Sequence[PiecePart], buf: StagingBuffer, at: int,
                table: Any, starts: Sequence[int] | None, fused: Any, *, start: int, end: int, gather: bool) -> None:
    """Run ``k``-th run of a piece's blocks on the GPU: the launch of its shape again, or, the
    first time, the checked launch, kept for the next piece of that shape."""
    from kvproto.kernels import triton_kernels

    first = run[0]
    tokens = end - start
    nbytes = tokens * sum(part.piece.unit for part in run)
    if at < 0 or at + nbytes > buf.capacity:
        raise kernels.StagingError(f"a staged block of {nbytes} bytes at {at} overruns the {buf.capacity}-byte buffer")
    address = buf.address + at
    key = (k, gather, tokens, address & 15, 0 if fused is None else fused.tiles.shape[0])
    launch = launches.get(key)
    if launch is not None:
        launch.again(address, table, starts, fused, start)
        return
    regions = sum(len(part.regions) for part in run)
    staging = buf.view(at, (regions, tokens, first.piece.head_count, first.piece.head_dim), first.kv.torch_dtype)
    launch = triton_kernels.prepare([part.regions for part in run], staging, table, layout=first.kv.geometry.layout,
                                    start_token=start, end_token=end, head_offset=first.head_offset,
                                    to_staging=gather, slots=fused, starts=starts)
    if launch is not None:
        launch.run(0, launch.regions)
        launches[key] = launch


def _joins(buf: StagingBuffer) -> bool:
    """Whether blocks that look alike move in one launch: Triton kernels on a CUDA cache, the
    staging on its device (host staging copies region by region: ``kernels.gather``)."""
    return buf.on_gpu and kernels.triton_available()


def _blocks(parts: Sequence[PiecePart], offset: int, tokens: int, *, joint: bool = False
            ) -> list[tuple[tuple[PiecePart, ...], int]]:
    """The piece's blocks at their offsets, runs of consecutive blocks that one launch moves
    joined (``joint``: runs of one block otherwise; at most ``JOIN_MAX`` blocks a run)."""
    out: list[tuple[tuple[PiecePart, ...], int]] = []
    for part in parts:
        if joint and out and part.joint is not None and len(out[-1][0]) < kernels.JOIN_MAX \
                and out[-1][0][-1].joins(part):
            out[-1] = (out[-1][0] + (part,), out[-1][1])
        else:
            out.append(((part,), offset))
        offset += tokens * part.piece.unit
    return out
