"""The kernel path: writes into a peer's GPU memory by one Triton kernel, over CUDA IPC.

Theory of operation
-------------------
Where prefill and decode share a machine, the decode rank's cache can be *mapped* into the
prefill process (CUDA IPC) and written by a kernel: one launch per write, whatever the number of
extents, instead of one transport descriptor per page (UCX charges microseconds for each). This
adapter does that for the peers it can map and hands every other peer, and every byte that is
not GPU memory, to a *fallback* adapter (``nixl`` by default), which also carries the tags. The
endpoints and cores do not know it exists: it is a ``Transport`` like the others.

What it guarantees (beyond ``kvproto.transport.base``):

* **Per-peer route, decided once at** ``add_peer``: a peer is *mapped* when its metadata comes
  from this host (same boot id) and every GPU region it registered can be opened here: its device
  is this process's device or one it has peer access to (``cuIpcOpenMemHandle`` with lazy peer
  access). A peer in this very process needs no mapping (its addresses are valid here; its regions on
  another GPU get peer access enabled, ``cuCtxEnablePeerAccess``). Anything
  else (another host, no CUDA, an allocation IPC cannot export) goes to the fallback, and the
  reason is logged. ``route(peer)`` tells which; the endpoints report it in ``room.stats`` and
  stop staging for mapped peers (staging exists to save descriptors, which a kernel does not pay).
* **Bounds before launch.** Every row and every pattern extent is checked against the memory
  this agent registered and the regions the peer's metadata listed; a kernel never runs on an
  address outside them (a stray write would corrupt another process silently).
* **One kernel per write.** ``post_plan`` moves tokens ``[start, end)`` as the geometry's
  ``PairPlan`` maps them, row by row, both addresses computed on the GPU from the two page lists
  (``kvproto.kernels.pattern.plan_rows``): head slices, block sizes and layouts convert in the
  kernel, and the host does no work per token. ``post_pattern`` moves given extents in every
  region pair; ``post_descs``/``post_prepared`` take rows, as for any adapter.
* **Tags after bytes.** A kernel write runs on this agent's own CUDA stream (after the work
  already queued on the caller's current stream) and records an event; that stream is a
  ``kvproto.kernels.lane.Lane``, which makes those calls and the table's upload on the driver
  (in the transfer bench on an H100 host a write's ``_run`` took 65-90 us that way, about 190 us
  through torch). Kernels finish in launch
  order, so one event query per pass finds every finished write (``_advance``); each write's tag
  then leaves, in order per peer, over the peer's tag channel (``kvproto.transport.local``: a
  local datagram that also wakes the peer's event loop), or through the fallback's ``notify``
  where that channel cannot reach it. So a tag leaves only once every byte is in the peer's
  memory, and tags to one peer keep their order.
* **Release.** ``remove_peer`` waits for this agent's kernels into that peer (its own stream:
  they always finish), then closes the mappings; writes to it poll ERROR and send no tag. A peer
  that dies keeps its memory alive for as long as it is mapped here (``docs/adapters.md``).

The binding is NVIDIA's ``cuda-bindings`` (``cuda.bindings.driver``; ``pip install
'kvproto[cuda-ipc]'``): the driver API's own, versioned Python binding, where IPC calls are
public and documented. PyTorch's IPC helpers are private (``torch.multiprocessing`` internals)
and may change with any release. Without ``cuda-bindings`` or a GPU, every peer takes the
fallback. The handles travel in this agent's metadata, i.e. in the decode rank's REGISTER, which
the control plane authenticates (CURVE, where on): an unauthenticated peer never receives them.

``cpu_kernels=True`` (tests) runs the kernel path on DRAM too, for peers in this process, with
Triton's interpreter, so that CPU-only CI checks this adapter's logic.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvproto.transport.base import (
    BAD_METADATA,
    MemKind,
    MemoryRegion,
    Notification,
    PreparedRows,
    Route,
    TransportClosed,
    TransportError,
    TransportStats,
    XferState,
    as_descs,
    check_pairs,
    merge_regions,
    take_rows,
)
from kvproto.geometry import PairPlan
from kvproto.transport.cuda import Pointer, Uploads, driver
from kvproto.transport.local import TagChannel, host_id
from kvproto.kernels import pattern as kernels
from kvproto.kernels.lane import Lane
from kvproto.kernels.pattern import alignment as kernels_alignment
from kvproto.kernels.pattern import plan_rows

log = logging.getLogger("kvproto.transport")

_FORMAT = "kvproto-cuda-ipc/1"

# --- state ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Registration:
    inner: Any
    regions: list[MemoryRegion]


@dataclass(eq=False)
class _Peer:
    """A mapped peer: its registered regions (as it knows them) and where they are here."""

    name: str
    regions: np.ndarray
    """``(N, 3)`` int64 (address, length, kind), sorted by address: what the peer registered."""
    local: np.ndarray
    """``(N,)`` int64: the address of each region in this process."""
    opened: list[int] = field(default_factory=list)
    """Mapped allocations to close when the peer goes."""
    tags: str | None = None
    """The peer's tag channel (None: tags go through the fallback's ``notify``)."""
    queue: collections.deque[KernelXfer] = field(default_factory=collections.deque)
    """Finished writes whose tags wait, in order, for room in the peer's tag channel."""
    gone: str = ""


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


@dataclass(eq=False)
class _Dual:
    """A local list prepared for both routes: rows for kernels, the fallback's list for the rest."""

    rows: np.ndarray
    kind: MemKind
    inner: Any
    released: bool = False

    def __len__(self) -> int:
        return len(self.rows)


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


@dataclass(eq=False)
class KernelXfer:
    peer: str
    tag: bytes
    event: Any
    keep: tuple[Any, ...]
    """Tensors the kernel reads (tile table, staging of the tables) until it has run."""
    state: XferState = XferState.PENDING
    released: bool = False
    error: str | None = None
    finished: bool = False
    """The kernel has run; the write is DONE once its tag has left."""


class CudaIpcTransport:
    """``Transport`` that writes into mapped peers with one kernel per write (module docstring)."""

    def __init__(self, name: str, *, fallback: str = "nixl", fallback_options: dict[str, Any] | None = None,
                 device: int | None = None, cpu_kernels: bool = False, fallback_poll_s: float = 1e-3) -> None:
        """``fallback_poll_s``: while the fallback is idle (no write of this agent through it in
        flight, nothing delivered by it in the last second), ``drain_notifications`` drives it
        (its progress engine costs tens of microseconds a call) at most this often; while it is
        busy, on every call. This agent's own tag channel is read on every call."""
        from kvproto.transport import load_transport

        self.name = name
        self._stats = TransportStats()
        self._fallback = load_transport(fallback, name, **(fallback_options or {}))
        self.fallback_name = fallback
        self._cpu_kernels = cpu_kernels
        self._device = device
        self._closed = False
        self._registrations: list[_Registration] = []
        self._regions: np.ndarray | None = None
        self._peers: dict[str, _Peer] = {}
        self._routes: dict[str, Route] = {}
        self._xfers: set[KernelXfer] = set()
        self._lists: set[Any] = set()
        self._lane: Any = None
        """This agent's stream (``kvproto.kernels.lane.Lane``): its writes' kernels, uploads, events."""
        self._bases_cache: dict[tuple[Any, ...], _Bases] = {}
        self._seen_bases: dict[tuple[int, int], tuple[Any, Any, _Bases, MemKind]] = {}
        """Checked bases by the identity of the two arrays a link passes (a hybrid link: one pair
        per group)."""
        self._joined: dict[tuple[Any, ...], tuple[tuple[Any, ...], _Bases]] = {}
        self._shapes: dict[tuple[Any, ...], _RowsShape] = {}
        """Rows launches as planned for a link and token range (``_rows_shape``)."""
        self._slot_rows: dict[int, tuple[Any, ...]] = {}
        """Checked slot rows (``_slot_plan``) by the identity of the link's ``SlotRows``."""
        self._uploads = Uploads()
        self._running: collections.deque[KernelXfer] = collections.deque()
        """Kernel writes not yet seen finished, in launch order (see ``_advance``)."""
        self._tags = TagChannel()
        self._fallback_poll_s = fallback_poll_s
        self._fallback_drained = 0.0
        self._fallback_busy_until = 0.0
        """Until when the fallback counts as busy (drained on every call): a second after it last
        delivered a tag, or was handed a write or a notify."""

    @property
    def stats(self) -> TransportStats:
        """Kernel writes and the fallback's writes together."""
        inner = self._fallback.stats
        own = self._stats
        return TransportStats(writes=own.writes + inner.writes, descriptors=own.descriptors + inner.descriptors,
                              bytes=own.bytes + inner.bytes)

    # --- registration and metadata ---------------------------------------------------------------
    def memory_kinds(self) -> frozenset[MemKind]:
        return self._fallback.memory_kinds()

    def register(self, regions: Sequence[MemoryRegion]) -> _Registration:
        self._check_open()
        regions = merge_regions(regions)  # overlapping ranges once, as their union (transport.base)
        inner = self._fallback.register(regions)
        reg = _Registration(inner, regions)
        self._registrations.append(reg)
        self._regions = None
        return reg

    def deregister(self, registration: _Registration) -> None:
        self._check_open()
        if registration not in self._registrations:
            raise TransportError("deregister: registration is not registered with this agent")
        self._registrations.remove(registration)
        self._regions = None
        self._fallback.deregister(registration.inner)

    def _local_regions(self) -> np.ndarray:
        """``(N, 3)`` (address, length, kind) of the memory this agent registered, sorted."""
        if self._regions is None:
            rows = [(r.address, r.length, int(r.kind)) for reg in self._registrations for r in reg.regions]
            self._regions = np.array(sorted(rows), dtype=np.int64).reshape(-1, 3)
        return self._regions

    def metadata(self) -> bytes:
        self._check_open()
        regions = []
        for reg in self._registrations:
            for r in reg.regions:
                entry: dict[str, Any] = {"address": r.address, "length": r.length, "kind": int(r.kind),
                                         "device": r.device_id}
                if r.kind is MemKind.VRAM and driver().available():
                    try:
                        handle, offset = driver().export(r.address)
                        entry.update(handle=handle.hex(), offset=offset, uuid=driver().uuid(r.device_id))
                    except TransportError as exc:  # e.g. expandable segments: not IPC-exportable
                        entry["why"] = str(exc)
                regions.append(entry)
        doc = {"format": _FORMAT, "agent": self.name, "host": host_id(), "pid": os.getpid(), "regions": regions,
               "tags": self._tags.address, "fallback": base64.b64encode(self._fallback.metadata()).decode()}
        return json.dumps(doc).encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        try:
            doc = json.loads(metadata)
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            inner = base64.b64decode(doc["fallback"])
            regions = [(int(r["address"]), int(r["length"]), int(r["kind"])) for r in doc["regions"]]
        except BAD_METADATA as exc:
            raise TransportError(f"add_peer: not {_FORMAT} metadata ({exc})") from None
        name = self._fallback.add_peer(inner)
        if name != doc.get("agent"):
            self._fallback.remove_peer(name)
            raise TransportError(f"add_peer: metadata of {doc.get('agent')!r} carries agent {name!r}")
        self._forget_peer(name, f"peer {name!r} was reloaded by add_peer")
        peer, why = self._map(name, doc, regions)
        if peer is not None:
            tags = doc.get("tags")
            peer.tags = tags if isinstance(tags, str) and self._tags.address is not None else None
            self._peers[name] = peer
            self._routes[name] = Route(name="kernel", pattern=True)
        else:
            self._routes[name] = Route(name=self.fallback_name, pattern=False)
            log.info("peer %s goes through %s: %s", name, self.fallback_name, why)
        return name

    def _map(self, name: str, doc: dict[str, Any], regions: list[tuple[int, int, int]]) -> tuple[_Peer | None, str]:
        """The peer as a mapped peer, or (None, why not)."""
        if doc.get("host") != host_id():
            return None, "it is on another host"
        order = sorted(range(len(regions)), key=lambda i: regions[i][0])
        table = np.array([regions[i] for i in order], dtype=np.int64).reshape(-1, 3)
        if doc.get("pid") == os.getpid():
            gpu = driver().available() and all(k == MemKind.VRAM for _a, _n, k in regions)
            if not (gpu or self._cpu_kernels):
                return None, "kernels need GPU memory (or cpu_kernels)"
            if gpu:
                here = self._device_ordinal()
                try:  # the peer's regions on another GPU of this process: kernels here need peer access
                    for other in sorted({int(r.get("device", here)) for r in doc["regions"]} - {here}):
                        driver().enable_peer(here, other)
                except TransportError as exc:
                    return None, str(exc)
            return _Peer(name, table, table[:, 0].copy()), ""
        vram = [doc["regions"][i] for i in order]
        if not vram or any(r["kind"] != MemKind.VRAM or "handle" not in r for r in vram):
            reason = next((r.get("why") for r in vram if "why" in r), None)
            return None, reason or "not every region is GPU memory exported for IPC"
        drv = driver()
        if not drv.available():
            return None, "no CUDA driver binding (pip install 'kvproto[cuda-ipc]') or no GPU"
        here = self._device_ordinal()
        try:
            ordinals = {drv.uuid(i): i for i in range(self._device_count())}
            opened: dict[str, int] = {}
            local = np.empty(len(vram), dtype=np.int64)
            for i, r in enumerate(vram):
                ordinal = ordinals.get(r["uuid"])
                if ordinal is None or not drv.can_access(here, ordinal):
                    raise TransportError(f"device {r['uuid']} is not reachable from cuda:{here}")
                if r["handle"] not in opened:
                    opened[r["handle"]] = drv.open(bytes.fromhex(r["handle"]))
                local[i] = opened[r["handle"]] + int(r["offset"])
        except TransportError as exc:
            for address in locals().get("opened", {}).values():
                try:
                    drv.close(address)
                except TransportError:
                    pass
            return None, str(exc)
        return _Peer(name, table, local, opened=list(opened.values())), ""

    def _device_ordinal(self) -> int:
        import torch

        if self._device is None:
            self._device = torch.cuda.current_device()
        torch.cuda.set_device(self._device)
        return self._device

    @staticmethod
    def _device_count() -> int:
        import torch

        return torch.cuda.device_count()

    def here(self, peer: str, address: int, length: int = 1) -> int:
        """Where ``address`` of a mapped peer's registered GPU memory is in this process (tests and
        benchmarks, e.g. the raw copy that ``kvproto bench transfer`` compares against)."""
        self._check_open()
        mapped = self._mapped(peer, "here")
        rows = np.array([[address, length, 0]], dtype=np.int64)
        return int(self._translate(mapped, rows, MemKind.VRAM, "here")[0])

    def route(self, peer: str) -> Route:
        """How writes to ``peer`` move (see the module docstring)."""
        self._check_open()
        route = self._routes.get(peer)
        if route is None:
            raise TransportError(f"route: unknown peer {peer!r}")
        return route

    def remove_peer(self, peer: str) -> None:
        self._check_open()
        self._fallback.remove_peer(peer)
        self._forget_peer(peer, f"peer {peer!r} was removed")
        self._routes.pop(peer, None)

    def _forget_peer(self, peer: str, why: str) -> None:
        mapped = self._peers.pop(peer, None)
        if mapped is None:
            return
        for xfer in [x for x in self._xfers if x.peer == peer and x.state is XferState.PENDING]:
            xfer.event.synchronize()  # this agent's own kernel into the mapping: it always ends
            xfer.state, xfer.error = XferState.ERROR, why
        mapped.queue.clear()
        mapped.gone = why
        kernels.forget_tables([b.table for b in self._bases_cache.values() if b.peer is mapped])
        self._bases_cache = {k: v for k, v in self._bases_cache.items() if v.peer is not mapped}
        self._seen_bases = {k: v for k, v in self._seen_bases.items() if v[2].peer is not mapped}
        self._joined = {k: v for k, v in self._joined.items() if v[1].peer is not mapped}
        self._slot_rows = {k: v for k, v in self._slot_rows.items() if v[1] is not mapped}
        self._shapes = {k: v for k, v in self._shapes.items() if v.peer is not mapped}
        for address in mapped.opened:
            try:
                driver().close(address)
            except TransportError as exc:
                log.warning("closing the mapping of %s: %s", peer, exc)

    # --- descriptor lists --------------------------------------------------------------------------
    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> Any:
        self._check_open()
        arr = as_descs(rows)
        if peer is None:
            checked = self._check_local(arr, kind, "prepare") if len(arr) else arr
            dual = _Dual(checked, kind, self._fallback.prepare(None, rows, kind))
            self._lists.add(dual)
            return dual
        mapped = self._peers.get(peer)
        if mapped is None or not self._kernel_kind(kind):
            return self._fallback.prepare(peer, rows, kind)
        if len(arr) == 0:
            raise TransportError("prepare: cannot prepare an empty descriptor list")
        self._translate(mapped, arr, kind, "prepare")
        dlist = PreparedRows(arr, mapped)
        self._lists.add(dlist)
        return dlist

    def release_prepared(self, dlist: Any) -> None:
        self._check_open()
        if isinstance(dlist, _Dual):
            if dlist.released:
                return
            dlist.released = True
            self._lists.discard(dlist)
            self._fallback.release_prepared(dlist.inner)
        elif isinstance(dlist, PreparedRows):
            dlist.released = True
            self._lists.discard(dlist)
        else:
            self._fallback.release_prepared(dlist)

    # --- writes ------------------------------------------------------------------------------------------
    def post_prepared(self, peer: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                      tag: bytes) -> Any:
        self._check_open()
        if not isinstance(remote, PreparedRows):
            inner = local.inner if isinstance(local, _Dual) else local
            if isinstance(local, _Dual) and local.released:
                raise TransportError("post_prepared: the local list was released")
            self._fallback_busy()
            return self._fallback.post_prepared(peer, inner, local_idx, remote, remote_idx, tag)
        mapped = self._mapped(peer, "post_prepared")
        if not isinstance(local, _Dual) or local.released:
            raise TransportError("post_prepared: the local list was not prepared by this agent, or was released")
        rows = remote.usable(mapped)
        src = take_rows(local.rows, local_idx, "local")
        dst = take_rows(rows, remote_idx, "remote")
        here = self._translate(mapped, dst, local.kind, "post_prepared")
        return self._run(mapped, [self._rows_launch(src, np.stack([here, dst[:, 1], dst[:, 2]], axis=1), local.kind)],
                         tag)

    def post_descs(self, peer: str, local_rows: np.ndarray, local_kind: MemKind, remote_rows: np.ndarray,
                   remote_kind: MemKind, tag: bytes) -> Any:
        self._check_open()
        mapped = self._peers.get(peer)
        if mapped is None or not (self._kernel_kind(local_kind) and self._kernel_kind(remote_kind)):
            self._fallback_busy()
            return self._fallback.post_descs(peer, local_rows, local_kind, remote_rows, remote_kind, tag)
        return self._run(mapped, [self._descs_launch(mapped, local_rows, local_kind, remote_rows, remote_kind,
                                                     "post_descs")], tag)

    def post_pattern(self, peer: str, local_bases: Sequence[int], local_kind: MemKind, remote_bases: Sequence[int],
                     remote_kind: MemKind, pattern: np.ndarray, tag: bytes) -> Any:
        """A write of the same extents ``pattern`` ((E, 3): src_off, dst_off, length) from every
        ``local_bases[r]`` into ``remote_bases[r]``: one kernel. Only for peers whose ``route``
        says ``pattern``. The bases are checked once per (peer, bases) and remembered, so that a
        link's writes cost a few array operations and a launch."""
        self._check_open()
        mapped = self._mapped(peer, "post_pattern")
        bases = self._bases(mapped, local_bases, local_kind, remote_bases, remote_kind)
        pat = np.asarray(pattern, dtype=np.int64).reshape(-1, 3)
        if len(pat) == 0 or pat.min() < 0 or pat[:, 2].min() <= 0:
            raise TransportError("post_pattern: extents need non-negative offsets and positive lengths")
        src_end, dst_end = (pat[:, :2] + pat[:, 2:3]).max(axis=0).tolist()
        for side, end, room in (("local", src_end, bases.src_room), ("remote", dst_end, bases.dst_room)):
            if end > room:
                raise TransportError(f"post_pattern: an extent ends {end} bytes past a {side} region base, but "
                                     f"a {side} region has only {room} bytes from its base: it is not inside "
                                     f"registered memory")
        nbytes = int(pat[:, 2].sum()) * bases.regions
        return self._run(mapped, [self._pattern_launch(pat, bases, nbytes, descriptors=0)], tag)

    def post_plan(self, peer: str, plan: PairPlan, local_bases: Sequence[int], local_kind: MemKind,
                  remote_bases: Sequence[int], remote_kind: MemKind, src_pages: Sequence[int],
                  dst_pages: Sequence[int], start: int, end: int, tag: bytes) -> Any:
        """Tokens ``[start, end)`` of the local cache into the peer's, as ``plan`` maps them (pages
        from token 0 on each side): one kernel, row by row (a token's moved heads, or one head
        where a layout is HND), both addresses computed on the GPU from the two page lists, so
        head slices, block sizes and layouts convert on the way and the host does no work per
        token. Exactly the tokens move, also for a direct plan (whose pages are identical)."""
        self._check_open()
        mapped = self._mapped(peer, "post_plan")
        args = (plan, local_bases, local_kind, remote_bases, remote_kind, src_pages, dst_pages, start, end)
        return self._run(mapped, [self._rows_recipe(mapped, (args,), (0,)).launch(((src_pages, dst_pages),))], tag)

    def post_parts(self, peer: str, parts: Sequence[Any], tag: bytes) -> Any:
        """Several parts as one write (``kvproto.aio.paths.Part``: each the arguments of a
        ``post_plan`` after the peer, descriptor rows, or a state group's slot rows and two slot
        numbers): every part checked first, then a kernel per launch on this agent's stream and one
        completion, after which the one tag leaves. Only for peers whose ``route`` says
        ``pattern``. The same as ``prepare_parts(peer, parts).post(...)`` with the parts' pages and
        slots, which a link that posts the same shape again keeps instead."""
        return self.prepare_parts(peer, parts).post([part_values(p) for p in parts], tag)

    def prepare_parts(self, peer: str, parts: Sequence[Any]) -> PreparedParts:
        """The launches of a write of ``parts``, planned for any pages and slots
        (``PreparedParts``): which paged parts share a rows launch (``_joinable``: one page
        geometry, token range and memory kind per side), each launch's shape (``_rows_shape``),
        and a state slot's checked and uploaded tiles riding in the last rows launch (one launch
        less; other state groups get launches of their own). Only the parts' pages and slot
        numbers may differ when it is posted: their token ranges, layers, plans and bases are
        its own."""
        self._check_open()
        mapped = self._mapped(peer, "post_parts")
        if not parts:
            raise TransportError("post_parts: a write needs at least one part")
        slot_at = [i for i, p in enumerate(parts) if p.slots is not None]
        rest = [i for i, p in enumerate(parts) if p.slots is None]
        recipes: list[Any] = []
        runs: list[list[int]] = []
        k = 0
        while k < len(rest):
            first = parts[rest[k]]
            if first.plan is None:
                recipes.append(_DescsRecipe(self, mapped, rest[k], first.local_kind, first.remote_kind))
                k += 1
                continue
            j = k + 1  # the plans that follow with the same page geometry, token range and kinds join it
            while j < len(rest) and parts[rest[j]].plan is not None and _joinable(first.plan, parts[rest[j]].plan):
                j += 1
            runs.append(rest[k:j])
            k = j
        for n, run in enumerate(runs):
            fuse = _FUSE_SLOTS and n == len(runs) - 1 and slot_at and parts[slot_at[0]].local_kind is parts[run[0]].plan[2]
            slot = slot_at.pop(0) if fuse else None
            recipes.append(self._rows_recipe(mapped, [parts[i].plan for i in run], run,
                                             None if slot is None else (slot, self._slot_plan(mapped, parts[slot]))))
        recipes += [_SlotRecipe(i, self._slot_plan(mapped, parts[i]), self._zero_bases(parts[i].local_kind))
                    for i in slot_at]
        devices = {r.device for r in recipes if r.device is not None}
        if len(devices) > 1:
            raise TransportError("post_parts: the parts are on different devices")
        return PreparedParts(self, peer, mapped, tuple(parts), tuple(recipes),
                             any(r.device is None for r in recipes) and len(recipes) > 1)

    # --- launches: checked and planned first (``_*_launch``, recipes), then run as one write (``_run``) ---
    def _rows_recipe(self, mapped: _Peer, plans: Sequence[tuple[Any, ...]], which: Sequence[int],
                     slot: tuple[int, _SlotPlan] | None = None) -> _RowsRecipe:
        """One rows kernel for ``post_plan`` argument tuples of one page geometry and token range
        (``_joinable``; their pages are not read here): the groups of a hybrid cache whose pages
        look alike move in one launch, their regions side by side, each reading its own group's
        page lists. ``slot``: a state slot's part (its index and ``_slot_plan``), copied in the
        same launch. What does not depend on the pages is planned once per link and token range
        (``_rows_shape``: the regions' offsets into the lists, the slot's tiles, uploaded then)."""
        start, end = plans[0][7], plans[0][8]
        if not 0 <= start < end:
            raise TransportError(f"post_plan: bad token range [{start}, {end})")
        shape = self._rows_shape(mapped, plans, start, end)
        zero = None if slot is None else self._zero_bases(plans[0][2]).table
        recipe = _RowsRecipe(tuple(which), shape, start, end, slot, zero)
        if len(plans) > 1:  # the twin for writes whose plans all name the first plan's page lists
            one = self._rows_shape(mapped, plans, start, end, shared=True)
            recipe.shared = _RowsRecipe((which[0],), one, start, end, slot, zero), tuple(which[1:])
        return recipe

    def _rows_shape(self, mapped: _Peer, plans: Sequence[tuple[Any, ...]], start: int, end: int,
                    shared: bool = False) -> _RowsShape:
        """What a rows launch of these plans over tokens ``[start, end)`` is, whatever its pages:
        each plan's bases checked, the regions side by side, the rows plan, the table's layout.
        ``shared``: every plan reads the first plan's two page lists (groups that name the same
        pages), so the table holds two lists, their limits the tightest of the plans'.
        Remembered by the identity of the plans and base arrays (a link passes the same ones for
        every write), the token range and ``shared``."""
        key = (id(mapped), start, end, shared, tuple((id(p[0]), id(p[1]), id(p[3]), p[2], p[4]) for p in plans))
        hit = self._shapes.get(key)
        if hit is not None and hit.peer is mapped and all(
                a is p[0] and b is p[1] and c is p[3] for (a, b, c), p in zip(hit.refs, plans)):
            return hit
        sides: tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]] = ([], [])
        counts = []
        for plan, local_bases, local_kind, remote_bases, remote_kind, *_ in plans:
            bases = self._bases(mapped, local_bases, local_kind, remote_bases, remote_kind)
            for out, g, room in ((sides[0], plan.src, bases.src_room), (sides[1], plan.dst, bases.dst_room)):
                out.append((start // g.block_size, (end - 1) // g.block_size + 1, g.page_bytes, room))
            counts.append(bases.regions)
        if len(plans) > 1:
            bases = self._joined_bases(mapped, plans)
        if shared:  # one list per side, read by every plan: its pages must lie in every plan's memory
            sides = tuple([(*side[0][:3], side[0][2] * min(room // page for _, _, page, room in side))]
                          for side in sides)  # type: ignore[assignment]
            counts = [sum(counts)]
        n_src = sum(count for _, count, _, _ in sides[0])
        offsets = None
        if len(plans) > 1:  # each region's offsets into the source lists, then into the destination lists
            listed: list[int] = []
            for side in sides:
                at = 0
                for (_, count, _, _), regions in zip(side, counts):
                    listed += [at] * regions
                    at += count
            offsets = self._table(np.array(listed, dtype=np.int64), plans[0][2])
        shape = _RowsShape(mapped, tuple((p[0], p[1], p[3]) for p in plans), bases,
                           plan_rows(plans[0][0], start, end, regions=bases.regions, base_align=bases.align),
                           sides, offsets, n_src)
        if len(self._shapes) >= 256:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    def _joined_bases(self, mapped: _Peer, plans: Sequence[tuple[Any, ...]]) -> _Bases:
        """The region bases of several plans side by side, remembered by the identity of each
        plan's base arrays (a link passes the same arrays for every write)."""
        arrays = tuple(a for p in plans for a in (p[1], p[3]))
        key = (mapped.name, plans[0][2], tuple(map(id, arrays)))
        hit = self._joined.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], arrays)) and hit[1].peer is mapped:
            return hit[1]
        bases = self._bases(mapped, np.concatenate([np.asarray(p[1], dtype=np.int64) for p in plans]), plans[0][2],
                            np.concatenate([np.asarray(p[3], dtype=np.int64) for p in plans]), plans[0][4])
        if len(self._joined) >= 64:
            self._joined.clear()
        self._joined[key] = (arrays, bases)
        return bases

    def _slot_plan(self, mapped: _Peer, part: Any) -> _SlotPlan:
        """A part of slot rows (``kvproto.aio.paths.SlotRows``: a state group's slot in every
        region) as a ``_SlotPlan``: the rows of slot 0 checked against registered memory,
        translated, planned and uploaded once per link (remembered by the identity of the link's
        ``SlotRows``), with how many slots fit each side; a write then checks two integers."""
        rows = part.slots
        kind = part.local_kind
        if mapped.gone:
            raise TransportError(f"post_parts: {mapped.gone}")
        known = self._slot_rows.get(id(rows))
        if known is None or known[0] is not rows or known[1] is not mapped or known[2] is not kind \
                or part.remote_kind is not kind:
            if kind is not part.remote_kind or not self._kernel_kind(kind):
                raise TransportError(f"post_parts: kernels copy {self._kernel_kinds()} to the same kind, not "
                                     f"{kind.name} to {part.remote_kind.name}")
            src_slots, dst_slots, strided = self._check_slot_rows(mapped, rows, kind)
            known = (rows, mapped, kind, _SlotPlan(strided, self._table(strided.stepped(), kind), strided.plan.nbytes,
                                                   len(rows.length), src_slots, dst_slots))
            if len(self._slot_rows) >= 64:
                self._slot_rows.clear()
            self._slot_rows[id(rows)] = known
        return known[3]

    def _check_slot_rows(self, mapped: _Peer, rows: Any, kind: MemKind) -> tuple[Any, ...]:
        """(slots that fit locally, slots that fit remotely, and slot 0's rows into slot 0 as
        ``StridedRows`` of absolute addresses here: one plan serves every slot)."""
        fits = []
        for base, stride, regions, whose in ((rows.src, rows.src_stride, self._local_regions(), "this agent's"),
                                             (rows.dst, rows.dst_stride, mapped.regions, f"peer {mapped.name!r}'s")):
            first = np.stack([base, rows.length, np.zeros_like(base)], axis=1)
            j = _inside(first, regions, kind, "post_parts: state row", whose)
            room = regions[j, 0] + regions[j, 1] - (base + rows.length)  # bytes past each row's end
            fits.append(int((room // np.maximum(stride, 1)).min()) + 1)
            if base is rows.dst:
                here = mapped.local[j] + (base - regions[j, 0])
        strided = kernels.plan_strided_rows(rows.src, rows.src_stride, here, rows.dst_stride, rows.length)
        return fits[0], fits[1], strided

    def _zero_bases(self, kind: MemKind) -> _Bases:
        """One region pair of base 0: rows of absolute addresses as a pattern."""
        key = ("", kind, (0,), (0,))
        bases = self._bases_cache.get(key)
        if bases is None:
            zero = np.zeros(1, np.int64)
            bases = self._bases_cache[key] = _Bases(None, zero, zero, 0, 0, align=16,
                                                    table=self._table(np.zeros(2, np.int64), kind))
        return bases

    def _descs_launch(self, mapped: _Peer, local_rows: np.ndarray, local_kind: MemKind, remote_rows: np.ndarray,
                      remote_kind: MemKind, op: str) -> _Launch:
        src = self._check_local(as_descs(local_rows), local_kind, op)
        dst = as_descs(remote_rows)
        if local_kind is not remote_kind or not self._kernel_kind(local_kind):
            raise TransportError(f"{op}: kernels copy {self._kernel_kinds()} to the same kind, not "
                                 f"{local_kind.name} to {remote_kind.name}")
        here = self._translate(mapped, dst, remote_kind, op)
        return self._rows_launch(src, np.stack([here, dst[:, 1], dst[:, 2]], axis=1), local_kind)

    def _rows_launch(self, src: np.ndarray, dst_here: np.ndarray, kind: MemKind) -> _Launch:
        """Rows as a pattern of absolute addresses over one region of base 0."""
        nbytes = check_pairs(src, dst_here)
        pattern = np.stack([src[:, 0], dst_here[:, 0], src[:, 1]], axis=1)
        return self._pattern_launch(pattern, self._zero_bases(kind), nbytes, descriptors=len(src))

    @staticmethod
    def _pattern_launch(pattern: np.ndarray, bases: _Bases, nbytes: int, descriptors: int) -> _Launch:
        plan = kernels.plan_pattern(pattern, regions=bases.regions, base_align=bases.align)
        src_table, dst_table = bases.table[:bases.regions], bases.table[bases.regions:]
        return _Launch(bases, plan.tiles,
                       lambda tiles, stream=None: kernels.launch(plan, src_table, dst_table, tiles, stream=stream),
                       nbytes, descriptors)

    def _run(self, mapped: _Peer, launches: Sequence[_Launch], tag: bytes) -> KernelXfer:
        """Launch every kernel of one write on this agent's stream (after the work queued on the
        caller's current stream; on CPU memory: at once, in the interpreter), then the one event
        that ``poll`` waits for before it sends the tag. On the GPU the stream is a ``Lane``: its
        wait, the tables' uploads, the launches and the event are driver calls on raw handles
        (``kvproto.kernels.lane``); where the lane has no driver binding, or the caller's current
        device is another, the same calls go through torch with the lane's stream made current."""
        import torch

        nbytes = sum(launch.nbytes for launch in launches)
        descriptors = sum(launch.descriptors for launch in launches)
        device = launches[0].bases.table.device
        if device.type == "cpu":
            for launch in launches:
                launch.go(torch.from_numpy(launch.table), *launch.slots)
            return self._record(mapped, tag, _Done(), (), nbytes, descriptors)
        lane = self._own_lane(device)
        lane.follow()
        keep, slots = [], []
        raw = lane.raw and torch.cuda.current_device() == lane.index
        stream = lane.stream if raw else None  # raw: named to each launch; else made current
        with contextlib.nullcontext() if raw else torch.cuda.stream(lane.stream):
            for launch in launches:
                table, slot = self._uploads.put(launch.table, device, lane if raw else None)
                launch.go(table, *launch.slots, stream=stream)
                keep.append(table)
                slots.append(slot)
        event = lane.record()
        for slot in slots:
            self._uploads.used(slot, event)
        return self._record(mapped, tag, event, tuple(keep), nbytes, descriptors)

    def _record(self, mapped: _Peer, tag: bytes, event: Any, keep: tuple[Any, ...], nbytes: int,
                descriptors: int) -> KernelXfer:
        self._stats.writes += 1
        self._stats.descriptors += descriptors
        self._stats.bytes += nbytes
        xfer = KernelXfer(mapped.name, bytes(tag), event, keep)
        self._xfers.add(xfer)
        self._running.append(xfer)
        return xfer

    def _bases(self, mapped: _Peer, local_bases: Sequence[int], local_kind: MemKind, remote_bases: Sequence[int],
               remote_kind: MemKind) -> _Bases:
        """The checked, translated and uploaded form of a (local, remote) list of region bases.
        A link passes the same two arrays every time: they are recognised by identity first."""
        seen = self._seen_bases.get((id(local_bases), id(remote_bases)))
        if seen is not None and seen[0] is local_bases and seen[1] is remote_bases and seen[2].peer is mapped \
                and seen[3] is local_kind:
            return seen[2]
        key = (mapped.name, local_kind, tuple(np.asarray(local_bases).tolist()), tuple(np.asarray(remote_bases).tolist()))
        bases = self._bases_cache.get(key)
        if bases is not None and bases.peer is mapped:
            self._remember(local_bases, remote_bases, bases, local_kind)
            return bases
        if not (self._kernel_kind(local_kind) and local_kind is remote_kind):
            raise TransportError(f"post_pattern: kernels move {self._kernel_kinds()} memory, not "
                                 f"{local_kind.name} to {remote_kind.name}")
        if len(key[2]) != len(key[3]) or not key[2]:
            raise TransportError(f"post_pattern: {len(key[2])} local and {len(key[3])} remote regions")
        local = np.asarray(key[2], dtype=np.int64)
        remote = np.asarray(key[3], dtype=np.int64)
        ones = np.ones_like(local)
        regions = self._local_regions()
        i = _inside(np.stack([local, ones, 0 * ones], 1), regions, local_kind, "post_pattern: local base",
                    "this agent's")
        src_room = int((regions[i, 0] + regions[i, 1] - local).min())
        j = _inside(np.stack([remote, ones, 0 * ones], 1), mapped.regions, remote_kind, "post_pattern: remote base",
                    f"peer {mapped.name!r}'s")
        dst_room = int((mapped.regions[j, 0] + mapped.regions[j, 1] - remote).min())
        here = mapped.local[j] + (remote - mapped.regions[j, 0])
        bases = _Bases(mapped, local, here, src_room, dst_room, align=kernels_alignment(np.concatenate([local, here])),
                       table=self._table(np.concatenate([local, here]), local_kind))
        if len(self._bases_cache) >= 256:
            self._bases_cache.pop(next(iter(self._bases_cache)))
        self._bases_cache[key] = bases
        self._remember(local_bases, remote_bases, bases, local_kind)
        return bases

    def _remember(self, local_bases: Any, remote_bases: Any, bases: _Bases, kind: MemKind) -> None:
        if len(self._seen_bases) >= 64:
            self._seen_bases.clear()
        self._seen_bases[(id(local_bases), id(remote_bases))] = (local_bases, remote_bases, bases, kind)

    def _table(self, values: np.ndarray, kind: MemKind) -> Any:
        """``values`` as an int64 tensor where the kernel runs (uploaded once, on this agent's stream)."""
        import torch

        host = torch.from_numpy(values.copy())
        if kind is MemKind.DRAM:
            return host
        device = torch.device("cuda", self._device_ordinal())
        with torch.cuda.stream(self._own_lane(device).stream):
            return host.pin_memory().to(device, non_blocking=True)

    def _own_lane(self, device: Any) -> Lane:
        if self._lane is None:
            self._lane = Lane(device)
        return self._lane

    def poll(self, xfer: Any) -> XferState:
        self._check_open()
        if not isinstance(xfer, KernelXfer):
            state = self._fallback.poll(xfer)
            if state is XferState.PENDING:
                self._fallback_busy()
            return state
        if xfer.released:
            raise TransportError("poll: the write was released")
        if xfer.state is XferState.PENDING:
            if not xfer.finished and self._running and self._running[0] is xfer:
                self._advance()
            elif xfer.finished:
                mapped = self._peers.get(xfer.peer)
                if mapped is not None:
                    self._send_tags(mapped)
        return xfer.state

    def _advance(self) -> None:
        """Finish the kernels that have run, oldest first: they run in launch order on this
        agent's one stream, so the first one still running ends the scan (one event query per
        call, however many writes are in flight)."""
        running = self._running
        while running and running[0].event.query():
            xfer = running.popleft()
            xfer.keep = ()
            xfer.finished = True
            if self._lane is not None:
                self._lane.recycle(xfer.event)
            if xfer.state is not XferState.PENDING:
                continue  # its peer was removed meanwhile
            if not xfer.tag:
                xfer.state = XferState.DONE
                continue
            mapped = self._peers.get(xfer.peer)
            if mapped is not None:
                mapped.queue.append(xfer)
                self._send_tags(mapped)

    def _send_tags(self, mapped: _Peer) -> None:
        """Send the queued tags of finished writes to ``mapped``, in order, until its channel is full;
        each write is DONE once its tag has left (ERROR if it cannot be sent at all)."""
        while mapped.queue:
            xfer = mapped.queue[0]
            try:
                if mapped.tags is not None:
                    try:
                        if not self._tags.send(mapped.tags, self.name.encode(), xfer.tag):
                            return  # the peer's queue is full: the next poll tries again, in order
                    except OSError as exc:  # unreachable (e.g. another network namespace)
                        log.info("tags to %s go through %s: %s", mapped.name, self.fallback_name, exc)
                        mapped.tags = None
                        continue
                else:
                    self._fallback_busy()
                    self._fallback.notify(xfer.peer, xfer.tag)
                xfer.state = XferState.DONE
            except TransportError as exc:
                xfer.state, xfer.error = XferState.ERROR, f"the tag could not be sent: {exc}"
            mapped.queue.popleft()

    def release(self, xfer: Any) -> None:
        self._check_open()
        if not isinstance(xfer, KernelXfer):
            self._fallback.release(xfer)
            return
        if xfer.released:
            return
        if xfer.state is XferState.PENDING and xfer.peer in self._peers:
            raise TransportError(f"release: the write to {xfer.peer!r} is still pending and its peer is present")
        xfer.released = True
        self._xfers.discard(xfer)

    def notify(self, peer: str, tag: bytes) -> None:
        """A tag with no bytes: behind the tags of this agent's finished writes to ``peer``."""
        self._check_open()
        mapped = self._peers.get(peer)
        if mapped is None:
            self._fallback_busy()
            self._fallback.notify(peer, tag)
            return
        if not tag:
            raise TransportError("notify: the tag is empty")
        note = KernelXfer(peer, bytes(tag), _Done(), (), finished=True)
        mapped.queue.append(note)
        self._send_tags(mapped)
        if note.state is XferState.ERROR:
            raise TransportError(f"notify {peer!r}: {note.error}")

    def drain_notifications(self) -> list[Notification]:
        """Tags from this agent's channel, then the fallback's (see ``fallback_poll_s``)."""
        self._check_open()
        self._advance()
        notes = self._tags.drain()
        now = time.monotonic()
        if now < self._fallback_busy_until or now - self._fallback_drained >= self._fallback_poll_s:
            self._fallback_drained = now
            delivered = self._fallback.drain_notifications()
            if delivered:
                self._fallback_busy_until = now + 1.0
                notes += delivered
        for mapped in self._peers.values():
            if mapped.queue:
                self._send_tags(mapped)
        return notes

    def _fallback_busy(self) -> None:
        self._fallback_busy_until = time.monotonic() + 1.0

    def wakeup_fd(self) -> int | None:
        """A file descriptor that turns readable when a tag arrives on this agent's channel (an
        endpoint adds it to its event loop, so that a waiting rank wakes at once); None without one."""
        return self._tags.sock.fileno() if self._tags.sock is not None else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for xfer in self._xfers:
                if xfer.state is XferState.PENDING:
                    xfer.event.synchronize()
            for peer in list(self._peers):
                self._forget_peer(peer, "the agent was closed")
            kernels.forget_tables([b.table for b in self._bases_cache.values()])  # (the base-0 pairs)
            self._xfers.clear()
            self._lists.clear()
            if self._lane is not None:
                self._lane.close()
        finally:
            self._tags.close()
            self._fallback.close()

    # --- checks --------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("the agent was closed")

    def _kernel_kinds(self) -> str:
        return "VRAM and DRAM" if self._cpu_kernels else "VRAM"

    def _kernel_kind(self, kind: MemKind) -> bool:
        return kind is MemKind.VRAM or (self._cpu_kernels and kind is MemKind.DRAM)

    def _mapped(self, peer: str, op: str) -> _Peer:
        mapped = self._peers.get(peer)
        if mapped is None:
            route = self._routes.get(peer)
            raise TransportError(f"{op}: peer {peer!r} is " + ("not mapped here (it goes through the fallback)"
                                                               if route else "unknown"))
        return mapped

    def _check_local(self, rows: np.ndarray, kind: MemKind, op: str) -> np.ndarray:
        """Rows inside memory this agent registered as ``kind``."""
        _inside(rows, self._local_regions(), kind, f"{op}: row", "this agent's")
        return rows

    @staticmethod
    def _translate(mapped: _Peer, rows: np.ndarray, kind: MemKind, op: str) -> np.ndarray:
        """The addresses here of ``rows`` of the peer's memory (each checked to lie inside one region
        the peer registered as ``kind``)."""
        if mapped.gone:
            raise TransportError(f"{op}: {mapped.gone}")
        idx = _inside(rows, mapped.regions, kind, f"{op}: row", f"peer {mapped.name!r}'s")
        return mapped.local[idx] + (rows[:, 0] - mapped.regions[idx, 0])


class _Done:
    """The event of a kernel that ran synchronously (the CPU interpreter)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


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
                 "shared", "cuda", "bound")

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
        """On the GPU, this launch's ``triton_kernels.PagedLaunch`` (plan, tables, lists and slot
        tiles bound), taken at its first write: later writes call it with their pages and slots,
        not ``launch_rows``, ``copy_paged`` and the binding's lookup again."""
        self.slot_tiles: Any = None
        """With a slot: the ``SlotTiles`` of this launch's slot plan (a write names its two slots)."""
        if slot is not None:
            from kvproto.kernels import triton_kernels

            strided = slot[1].strided
            self.slot_tiles = triton_kernels.SlotTiles(strided.plan, slot[1].steps, len(strided.plan.tiles), zero)

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
            return _Launch(shape.bases, table, recipe._go, shape.rows.nbytes, 0)
        at, plan = recipe.slot
        named = values[at]
        src_slot, dst_slot = named[-2], named[-1]
        if not (0 <= src_slot < plan.src_slots and 0 <= dst_slot < plan.dst_slots):
            plan.check(src_slot, dst_slot)  # raises, naming the slots
        return _Launch(shape.bases, table, recipe._go_fused, shape.rows.nbytes + plan.nbytes, plan.descriptors,
                       (src_slot, dst_slot))

    def _bind(self, slots: Any) -> Any:
        """``bound``, made (the GPU's launch of this recipe, with ``slots`` or none)."""
        from kvproto.kernels import triton_kernels

        self.bound = triton_kernels.PagedLaunch.of(self.shape.rows, *self.tables, self.shape.lists, slots)
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


def _joinable(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Two ``post_plan`` argument tuples one rows launch can carry: one page geometry (``rows_key``),
    one token range, one memory kind per side."""
    if (a[2], a[4], a[7], a[8]) != (b[2], b[4], b[7], b[8]):
        return False
    return a[0] is b[0] or _rows_key(a[0]) == _rows_key(b[0])


_ROWS_KEYS: dict[int, tuple[Any, Any]] = {}


def _rows_key(plan: PairPlan) -> Any:
    """``rows_key(plan)``, remembered by the plan's identity (a link keeps its plans)."""
    from kvproto.kernels.pattern import rows_key

    hit = _ROWS_KEYS.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    if len(_ROWS_KEYS) >= 1024:
        _ROWS_KEYS.clear()
    key = rows_key(plan)
    _ROWS_KEYS[id(plan)] = (plan, key)
    return key


def _inside(rows: np.ndarray, regions: np.ndarray, kind: MemKind, what: str, whose: str) -> np.ndarray:
    """For each row, the index of the region of ``regions`` ((N, 3): address, length, kind; sorted)
    that holds all of it; raises ``TransportError`` naming the first row that none holds."""
    if len(rows) == 0:
        return np.zeros(0, dtype=np.int64)
    i = np.searchsorted(regions[:, 0], rows[:, 0], side="right") - 1 if len(regions) else np.full(len(rows), -1)
    j = np.clip(i, 0, max(0, len(regions) - 1))
    ok = (i >= 0) & (len(regions) > 0)
    if len(regions):
        ok &= (rows[:, 0] + rows[:, 1] <= regions[j, 0] + regions[j, 1]) & (regions[j, 2] == int(kind))
    bad = np.flatnonzero(~ok)
    if bad.size:
        k = int(bad[0])
        raise TransportError(f"{what} {k} {rows[k].tolist()} is not inside {whose} registered {kind.name}")
    return j
