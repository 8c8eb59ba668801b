"""``CudaIpcTransport``: the kernel path's adapter (the theory note is the package's).

Theory of operation
-------------------
The ``Transport`` calls: a peer mapped or routed to the fallback at ``add_peer`` (``_map``), the
registrations, metadata and checks of the adapter kit (``kvproto.transport.kit``), the writes'
entry points (``post_plan``, ``post_parts``, ``post_pattern``, and rows through
``post_prepared`` / ``post_descs``), polls, tags and removal. What a write's launches are is
planned by ``LaunchPlanner`` (``kvproto.transport.cuda_ipc.planner``, a mixin of this class) and
made from ``kvproto.transport.cuda_ipc.launches``; how posted writes run — waiting for their pass,
launched alone or batched, finished in launch order, their tags sent in order per peer — is
``WriteRunner`` (``kvproto.transport.cuda_ipc.writes``, a mixin too). Every peer or memory kind the
kernels do not serve goes to the fallback adapter, call for call.
"""

from __future__ import annotations

import base64
import collections
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvproto.geometry import PairPlan
from kvproto.kernels import pattern as kernels
from kvproto.transport.base import (
    MemKind,
    MemoryRegion,
    Notification,
    PreparedRows,
    Route,
    TransportError,
    TransportStats,
    XferState,
    as_descs,
    take_rows,
)
from kvproto.transport.cuda import Uploads, driver
from kvproto.transport.cuda_ipc.launches import _Bases, _Launch, _RowsShape, part_values
from kvproto.transport.cuda_ipc.planner import LaunchPlanner, _inside
from kvproto.transport.cuda_ipc.writes import KernelXfer, WriteRunner, _Done
from kvproto.transport.kit import AdapterKit
from kvproto.transport.local import TagChannel, host_id

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
class _Dual:
    """A local list prepared for both routes: rows for kernels, the fallback's list for the rest."""

    rows: np.ndarray
    kind: MemKind
    inner: Any
    released: bool = False

    def __len__(self) -> int:
        return len(self.rows)


class CudaIpcTransport(WriteRunner, LaunchPlanner, AdapterKit):
    """``Transport`` that writes into mapped peers with kernels (the package's note)."""

    KIND = "cuda-ipc"
    FORMAT = "kvproto-cuda-ipc/1"
    KINDS = None  # the fallback's (memory_kinds)

    def __init__(self, name: str, *, fallback: str = "nixl", fallback_options: dict[str, Any] | None = None,
                 device: int | None = None, cpu_kernels: bool = False, fallback_poll_s: float = 1e-3) -> None:
        """``fallback_poll_s``: while the fallback is idle (no write of this agent through it in
        flight, nothing delivered by it in the last second), ``drain_notifications`` drives it
        (its progress engine costs tens of microseconds a call) at most this often; while it is
        busy, on every call. This agent's own tag channel is read on every call."""
        from kvproto.transport import load_transport

        super().__init__(name)  # (the kit's stats are this agent's own kernel writes: ``_stats``)
        self._fallback = load_transport(fallback, name, **(fallback_options or {}))
        self.fallback_name = fallback
        self._cpu_kernels = cpu_kernels
        self._device = device
        self._regions: np.ndarray | None = None
        self._peers: dict[str, _Peer] = {}
        """The mapped peers (the others are the fallback's)."""
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
        self._deferred: list[tuple[_Launch, KernelXfer, tuple[Any, ...]]] = []
        """Writes posted and not yet launched, in posting order, with the events each waits for
        on the device (``_flush``)."""
        self._after: dict[str, tuple[Any, ...]] = {}
        """By peer: the events its next write waits for on the device (``wait_on_device``)."""
        self.launches = 0
        """Kernels this agent launched (a batch of writes counts once): ``stats.writes / launches``
        is how many writes a launch carried."""
        self._tags = TagChannel()
        self._unadded: dict[str, bytes] = {}
        """Mapped peers whose newest fallback metadata the fallback has not loaded (``_fallback_peer``)."""
        self._in_fallback: set[str] = set()
        """Peers the fallback holds (every unmapped one; a mapped one once something went through it)."""
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

    @stats.setter
    def stats(self, own: TransportStats) -> None:
        self._stats = own

    # --- registration and metadata ---------------------------------------------------------------
    def memory_kinds(self) -> frozenset[MemKind]:
        return self._fallback.memory_kinds()

    def _register(self, regions: list[MemoryRegion]) -> _Registration:
        inner = self._fallback.register(regions)
        self._regions = None
        return _Registration(inner, regions)

    def _ready_lane(self) -> None:
        """Make the lane and the tables' upload ring when the first peer is mapped (a link's
        registration), not at the first room's launch: a stream, the driver binding and 4 MiB of
        pinned memory took that launch about 3 ms. Where it fails, the first launch tries again."""
        try:
            import torch

            device = torch.device("cuda", self._device_ordinal())
            self._own_lane(device)
            self._uploads.prepare(device)
        except Exception as exc:  # noqa: BLE001 - only the first launch's cost is at stake
            log.debug("kernel path: lane not made at registration: %s", exc)

    def _deregister(self, registration: _Registration) -> None:
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
        return self._write_metadata(host=host_id(), pid=os.getpid(), regions=regions, tags=self._tags.address,
                                    fallback=base64.b64encode(self._fallback.metadata()).decode())

    def add_peer(self, metadata: bytes) -> str:
        """Map the peer where it can be (``_map``). A mapped peer is added to the fallback only when
        something first goes through it (``_fallback_peer``: host memory, a tag its channel cannot
        carry): loading a NIXL agent's metadata takes tens of milliseconds (UCX), which a new link
        would otherwise pay before its first room, for a fallback its kernel writes never use."""
        self._check_open()
        agent, (doc, inner, regions) = self._read_metadata(metadata, lambda doc: (
            doc, base64.b64decode(doc["fallback"]),
            [(int(r["address"]), int(r["length"]), int(r["kind"])) for r in doc["regions"]]))
        self._forget_peer(agent, f"peer {agent!r} was reloaded by add_peer")
        self._unadded.pop(agent, None)
        peer, why = self._map(agent, doc, regions)
        if peer is not None:
            tags = doc.get("tags")
            peer.tags = tags if isinstance(tags, str) and self._tags.address is not None else None
            self._unadded[agent] = inner
            self._peers[agent] = peer
            self._routes[agent] = Route(name="kernel", pattern=True)
            if self._lane is None:
                self._ready_lane()
            return agent
        name = self._fallback.add_peer(inner)
        if name != agent:
            self._fallback.remove_peer(name)
            raise TransportError(f"add_peer: metadata of {agent!r} carries agent {name!r}")
        self._in_fallback.add(name)
        self._routes[name] = Route(name=self.fallback_name, pattern=False)
        log.info("peer %s goes through %s: %s", name, self.fallback_name, why)
        return name

    def _fallback_peer(self, peer: str) -> None:
        """Add a mapped peer to the fallback before the first thing that goes through it there."""
        inner = self._unadded.pop(peer, None)
        if inner is None:
            return
        name = self._fallback.add_peer(inner)
        if name != peer:
            self._fallback.remove_peer(name)
            raise TransportError(f"{self.fallback_name}: metadata of {peer!r} carries agent {name!r}")
        self._in_fallback.add(name)

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
        self._unadded.pop(peer, None)
        if peer in self._in_fallback or peer not in self._peers:  # (an unknown peer: the fallback says so)
            self._in_fallback.discard(peer)
            self._fallback.remove_peer(peer)
        self._forget_peer(peer, f"peer {peer!r} was removed")
        self._routes.pop(peer, None)

    def _forget_peer(self, peer: str, why: str) -> None:
        self._after.pop(peer, None)
        if peer in self._peers:
            self._flush()
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
            self._fallback_peer(peer)
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
            self._fallback_peer(peer)
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
            self._fallback_peer(peer)
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
            if xfer.event is None:
                self._flush()
            if not xfer.finished and self._running and self._running[0] is xfer:
                self._advance()
            elif xfer.finished:
                mapped = self._peers.get(xfer.peer)
                if mapped is not None:
                    self._send_tags(mapped)
        return xfer.state

    def release(self, xfer: Any) -> None:
        self._check_open()
        if not isinstance(xfer, KernelXfer):
            self._fallback.release(xfer)
            return
        if xfer.released:
            return
        self._check_release(xfer, xfer.peer, xfer.peer in self._peers)
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
        self._check_tag(tag)
        note = KernelXfer(peer, bytes(tag), _Done(), (), finished=True)
        mapped.queue.append(note)
        self._send_tags(mapped)
        if note.state is XferState.ERROR:
            raise TransportError(f"notify {peer!r}: {note.error}")

    def drain_notifications(self) -> list[Notification]:
        """Tags from this agent's channel, then the fallback's (see ``fallback_poll_s``)."""
        self._check_open()
        self._flush()
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

    def completion_event(self) -> Any | None:
        """The event of the oldest kernel still running (``kvproto.transport.base.completion_event``),
        while that is all this agent's writes wait for: none waiting for its pass (``_deferred``),
        for its tag to leave, or for the fallback's progress; and not on CPU memory, where kernels
        ran when launched."""
        if self._closed or self._deferred or not self._running or time.monotonic() < self._fallback_busy_until:
            return None
        if any(mapped.queue for mapped in self._peers.values()):
            return None
        event = self._running[0].event
        return None if isinstance(event, _Done) else event

    def wakeup_fd(self) -> int | None:
        """A file descriptor that turns readable when a tag arrives on this agent's channel (an
        endpoint adds it to its event loop, so that a waiting rank wakes at once); None without one."""
        return self._tags.sock.fileno() if self._tags.sock is not None else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._flush()
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
