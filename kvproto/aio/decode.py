"""``DecodeEndpoint``: one decode rank. Bootstraps prefill clusters, receives KV writes.

Theory of operation
-------------------
Rooms name their prefill instance by its bootstrap address (prefill rank 0). The first room
for an address starts a *bootstrap* task: query the rank table (repeated until every prefill
rank has announced), connect one DEALER to each prefill rank that pairs with this rank (by
geometry: the pairing depends only on the two TP sizes and the head count), REGISTER with each
(geometry, memory table, transport metadata, a fresh ``link_id``), and wait for every accept.
Then ``ReceiverCore.cluster_ready`` releases the waiting rooms; a reject or the bootstrap
deadline fails them with the code. A later room for a failed address bootstraps again.
``connect(address)`` runs the same bootstrap ahead of any room (a decode rank that knows its
prefill instances links to them at start), so that no room pays for a link's setup. A room
that ends while its address still bootstraps leaves its ABORT with the core, which sends it
once the links register (``ReceiverCore``: "Ends that no link can carry yet"); ``close()``
gives such bootstraps a short grace to finish so that those ABORTs go out.

Each link has a reader task (the pump of that socket). Heartbeats go out every
``heartbeat_interval``; a link silent for ``heartbeat_timeout``, or whose peer answers with a
new boot id, is dropped: its rooms fail with PEER_GONE and its address bootstraps again on
the next room. Notifications from the transport go straight to the core, which checks them
against the link that the tag names.

Protocol 1.4 (``kvproto.core.holds``): each link knows its prefill rank's minor (its accept's
header), so that a room waiting for its destination holds its prefill rooms (ROOM_HOLD) only on links
of minor 4 or later; a bootstrap that fails tells the prefill ranks that answered its REGISTERs (a
refusal of minor 4 or later, or an accept) which rooms failed by it, so that they let go of them at
once, then closes those links with a linger so that the frames leave.

A cache of several groups (hybrid models) sends CACHE_GROUPS before each REGISTER and checks the
prefill rank's, which precede its accept: the same groups, or the bootstrap fails naming the group
(a version 1.1 prefill rank sends none). Pairing and writers are decided over every group
(``kvproto.geometry.groups.link_roles``); rooms name each group's pages or slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.monitor

from kvproto.aio.channel import Channel, control_socket
from kvproto.aio.endpoint import EndpointBase, EndpointConfig
from kvproto.aio.memory import (LAYOUT_MINOR, KVCache, geometry_from_wire, geometry_to_wire, groups_from_wire,
                                older_peer_refusal)
from kvproto.aio import trace
from kvproto.aio.room import ReceiverRoomHandle
from kvproto.aio.staging import (
    CacheKernels,
    Copies,
    Piece,
    StagingBuffer,
    pair_piece,
    warm_kernels,
)
from kvproto.core import DropLink, ReceiverCore, ReceiverLink, Scatter
from kvproto.core.holds import HOLD_MINOR
from kvproto.core.staging import StagingRing
from kvproto.transport import TransportError
from kvproto.geometry import (
    IncompatibleGeometry,
    check_compatible,
    writers,
)
from kvproto.geometry.groups import (
    IncompatibleGroups,
    PagedGroup,
    check_groups,
    link_roles,
    paired_ranks_of_decode_cache,
)
from kvproto.wire import (
    MINOR,
    LocalProtocolError,
    Abort,
    BootstrapInfo,
    BootstrapQuery,
    CacheGroups,
    ErrorCode,
    Heartbeat,
    Message,
    RegionKind,
    RegisterAccept,
    RegisterReject,
    Register,
    StagingRequest,
    WireRegion,
    RemoteProtocolError,
    TransferDone,
    UnknownMessage,
    decode_frame,
    peek_header,
    encode,
)

log = logging.getLogger("kvproto")


@dataclass(slots=True)
class _Link:
    """A prefill rank as this decode rank reaches it: its DEALER channel, its handshake (inbox,
    answer, the groups and minor it sent) and its liveness (heartbeats, the socket monitor)."""

    link_id: int
    cluster: str
    prefill_rank: int
    endpoint: str
    channel: Channel | None = None
    inbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    last_seen: float = 0.0
    last_beat: float = 0.0
    boot_id: int = 0
    peer_minor: int = 0
    peer_groups: CacheGroups | None = None
    """The prefill rank's CACHE_GROUPS, received before its accept."""
    registered: bool = False
    answer: type[Message] | None = None
    """RegisterAccept or RegisterReject once the prefill rank answered this link's REGISTER."""
    beats: int = 0
    watcher: asyncio.Task[None] | None = None
    monitor: zmq.asyncio.Socket | None = None
    retired: bool = False
    """Its cluster failed, but a draining room still waits for this writer's answer."""


class _BootstrapFailed(Exception):
    def __init__(self, code: ErrorCode | int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ConnectFailed(Exception):
    """``DecodeEndpoint.connect`` could not link to a prefill instance. ``code`` says why (an
    ``ErrorCode``, or an int from a newer peer); the rooms that were waiting for the same
    bootstrap failed with it too."""

    def __init__(self, bootstrap: str, code: ErrorCode | int, reason: str) -> None:
        name = code.name if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"linking to prefill instance {bootstrap} failed: {name}: {reason}")
        self.bootstrap = bootstrap
        self.code = code
        self.reason = reason


class DecodeEndpoint(EndpointBase):
    """One decode rank."""

    ROLE = "decode"

    def __init__(self, kv: KVCache, *, config: EndpointConfig | None = None) -> None:
        super().__init__(kv, config)
        g = kv.geometry
        self._staging: StagingBuffer | None = None
        if self._staging_bytes():
            self._staging = StagingBuffer(kv, self._staging_bytes(), host=self.config.host_staging)
            self._kernels = CacheKernels(kv)
            self._copies = Copies(kv.tensors[0].device, self._kernels.uploads)
        self.core = ReceiverCore(
            block_size=g.block_size, num_blocks=g.num_blocks, aux_slots=kv.aux.slots if kv.aux else 0,
            timeouts=self.config.timeouts,
            staging=StagingRing(self._staging.capacity) if self._staging is not None else None,
            groups=kv.group_specs(),
        )
        self._cache = kv.cache_geometry
        self._pieces: dict[int, Piece] = {}
        """link_id -> what the pieces of each writer that may stage hold (decode-side heads)."""
        self._links: dict[int, _Link] = {}
        self._bootstraps: dict[str, asyncio.Task[None]] = {}
        self._next_link_id = 1

    # --- application API -------------------------------------------------------------------------
    def open_room(
        self,
        room_id: int,
        bootstrap: str,
        *,
        pages: Sequence[int] | None = None,
        num_tokens: int | None = None,
        prefix_tokens: int = 0,
        aux_slot: int | None = None,
        group_pages: Mapping[str, Sequence[int]] | None = None,
        state_slots: Mapping[str, int] | None = None,
    ) -> ReceiverRoomHandle:
        """Start the decode side of room ``room_id``, fed by the prefill instance at ``bootstrap``.

        Give ``pages`` and ``num_tokens`` now, or later with ``room.set_destination``. A cache of
        several groups also names, by group, the pages of each paged group beyond the first
        (``group_pages``: those holding the tokens needed, a sliding window's last tokens only)
        and the slot of each state group (``state_slots``).
        """
        self._check_open()
        trace.mark("open", room_id, 0)
        now = self._now()
        destination = None
        if pages is not None:
            if num_tokens is None:
                raise LocalProtocolError("num_tokens is required with pages")
            by_group, slots = self.kv.group_args(group_pages, state_slots, need_slots=True)
            destination = self.core.check_destination(pages, num_tokens, prefix_tokens=prefix_tokens,
                                                      aux_slot=aux_slot, group_pages=by_group, state_slots=slots or ())
        self.core.check_new_room(room_id)
        # Every check that can refuse has passed: only now may the call change anything (start a
        # bootstrap, open the room, record its handle), so a refused call leaves all as it was.
        if self.core.cluster_status(bootstrap) in ("unknown", "failed"):
            self._start_bootstrap(bootstrap)
        self.core.open_room(room_id, bootstrap, now, destination=destination)
        handle = ReceiverRoomHandle(self, room_id, self._loop, now)  # type: ignore[arg-type]
        self._handles[room_id] = handle
        self.metrics.room_opened(now)
        self._flush()
        self._kick()
        return handle

    async def connect(self, bootstrap: str) -> None:
        """Link to the prefill instance at ``bootstrap`` now, ahead of its first room: query its
        rank table, connect to and register with each prefill rank that pairs with this rank
        (which maps or loads this rank's memory into their transports). Returns once every link
        is registered, at once if they already are; a room opened for ``bootstrap`` meanwhile
        waits for the same bootstrap. Raises ``ConnectFailed`` with the code and cause where the
        bootstrap fails (the rooms waiting for it fail with the same code); a later call or room
        tries again. Optional: ``open_room`` links on its own, its first room then paying for it."""
        self._check_open()
        if self.core.cluster_status(bootstrap) in ("unknown", "failed"):
            self._start_bootstrap(bootstrap)
            self._kick()
        task = self._bootstraps.get(bootstrap)
        if task is not None:
            try:
                await asyncio.shield(task)  # a cancelled caller leaves the bootstrap to the endpoint
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not task.cancelled() or (current is not None and current.cancelling()):
                    raise  # the caller was cancelled, not the bootstrap (close() cancels that)
        state = self.core.clusters.get(bootstrap)
        if state is not None and state.ready:
            return
        code, reason = state.failure if state is not None and state.failure is not None else (
            ErrorCode.ENDPOINT_CLOSED, "the endpoint closed while linking")
        raise ConnectFailed(bootstrap, code, reason)

    def _set_destination(self, room_id: int, pages: Sequence[int], num_tokens: int, prefix_tokens: int,
                         aux_slot: int | None, group_pages: Any = None, state_slots: Any = None) -> None:
        self._check_open()
        by_group, slots = self.kv.group_args(group_pages, state_slots, need_slots=True)
        try:
            self.core.set_destination(room_id, pages, num_tokens, self._now(), prefix_tokens=prefix_tokens,
                                      aux_slot=aux_slot, group_pages=by_group, state_slots=slots or ())
        finally:
            self._flush()
            self._kick()

    async def _settle(self, grace: float) -> None:
        """Wait for the rooms that close() left draining: each ends once its writers have
        answered the ABORT (or their links are gone) and its scatters are over, or at its drain
        deadline (``Timeouts.drain``), so this wait is bounded by that deadline. Meanwhile, let
        bootstraps that hold ended rooms' ABORTs finish (up to ``grace``), so that the prefill
        ranks hear ENDPOINT_CLOSED at once instead of waiting for their deadline; where the
        handshake cannot finish in time, they fail those rooms at their own deadline."""
        holding = [task for cluster, task in self._bootstraps.items() if self.core.held_ends(cluster)]
        if holding:
            await asyncio.wait(holding, timeout=grace)
        assert self._loop is not None
        deadline = self._loop.time() + self.config.timeouts.drain + grace
        while self.core.draining() and self._loop.time() < deadline:
            self._kick()
            await asyncio.sleep(0.001)

    def _fenced(self) -> None:
        """The transport is closed: nothing from a peer can land any more. Scatters in flight on
        this rank's own stream are waited for (they write the pages); then the rooms still
        draining end FAILED."""
        if self._staging is not None:
            self._copies.finish()
        self.core.fenced(self._now())
        self._flush()

    # --- sockets ------------------------------------------------------------------------------------
    async def _start_io(self) -> None:
        if self._staging is not None:
            assert self.transport is not None
            self.transport.register([self._staging.region()])
            warming = warm_kernels(self.kv, self._kernels, self._staging, gather=False)
            if warming is not None and self.config.warm_up:
                await asyncio.to_thread(warming.join)

    def _close_io(self) -> None:
        for task in self._bootstraps.values():
            task.cancel()
        for link in list(self._links.values()):
            if link.registered:
                self._send_frame(link.channel, [encode(Abort(code=ErrorCode.ENDPOINT_CLOSED, reason="decode closed"))])
            self._discard_link(link, linger=200)

    def _connect(self, cluster: str, prefill_rank: int, endpoint: str) -> _Link:
        assert self._ctx is not None
        sock = control_socket(self._ctx, zmq.DEALER, linger=0)
        monitor = None
        try:
            if self.config.curve is not None:
                self.config.curve.client(sock)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            sock.connect(endpoint)  # refuses a malformed address: nothing is recorded before it
        except Exception:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        link = _Link(self._next_link_id, cluster, prefill_rank, endpoint, last_seen=self._now(), monitor=monitor)
        self._next_link_id += 1
        self._links[link.link_id] = link
        link.channel = self._channel(sock, "frame", self._on_message, link)
        link.watcher = self._spawn(self._watch_handshake(link, monitor), f"monitor-{link.link_id}")
        return link

    async def _watch_handshake(self, link: _Link, monitor: zmq.asyncio.Socket) -> None:
        """A refused CURVE handshake fails the bootstrap at once with AUTH_FAILED; on a registered
        link (ZMQ reconnected it, to a prefill rank that no longer admits this rank's key) it drops
        the link at once, its rooms failing with AUTH_FAILED, instead of at the heartbeat timeout."""
        try:
            while True:
                event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
                reason = "authentication" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "security handshake"
                log.warning("prefill rank %d at %s refused the control connection (%s)",
                            link.prefill_rank, link.endpoint, reason)
                refusal = f"prefill at {link.endpoint} refused the {reason}"
                if link.registered:
                    self._guard("a refused handshake", self._drop_link, link, ErrorCode.AUTH_FAILED, refusal)
                else:
                    link.inbox.put_nowait(Abort(code=ErrorCode.AUTH_FAILED, reason=refusal))
        except zmq.ZMQError:
            pass  # the monitor was closed: the link was discarded

    def _discard_link(self, link: _Link, linger: int = 0) -> None:
        if self._links.pop(link.link_id, None) is None:
            return
        if link.watcher is not None:
            link.watcher.cancel()
        assert link.channel is not None
        link.channel.sock.disable_monitor()
        if link.monitor is not None:
            link.monitor.close(linger=0)
        link.channel.close(linger=linger)

    def _on_message(self, link: _Link, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.core.stats.peer_violations += 1
            return
        self._on_frame(link, frames[0])

    def _send(self, link: Any, message: Message) -> None:
        target = self._links.get(link)
        if target is not None and target.channel is not None:
            self._send_frame(target.channel, [self._encode(message)])
            if trace.ENABLED and getattr(message, "room_id", 0):
                trace.mark(f"sent_{type(message).__name__}", message.room_id, 0)

    # --- incoming frames --------------------------------------------------------------------------
    def _on_frame(self, link: _Link, frame: bytes) -> None:
        now = self._now()
        link.last_seen = now
        try:
            header, msg = decode_frame(frame)
        except RemoteProtocolError as exc:
            if isinstance(exc, UnknownMessage) and exc.header.minor > MINOR:
                return
            header = peek_header(frame)
            if header is not None:
                self.core.peer_violation(link.link_id, header.room_id, header.generation, exc.code, str(exc), now)
            else:
                self.core.stats.peer_violations += 1
            log.warning("bad frame from prefill rank %d: %s", link.prefill_rank, exc)
            return
        if isinstance(msg, (TransferDone, Abort, StagingRequest)) and msg.room_id:
            if trace.ENABLED:
                trace.mark(f"recv_{type(msg).__name__}", msg.room_id, 0)
            self.core.on_message(link.link_id, msg, now)
        elif isinstance(msg, Heartbeat):
            if link.registered and msg.boot_id != link.boot_id:
                self._drop_link(link, ErrorCode.PEER_GONE, "prefill rank restarted")
        elif isinstance(msg, Abort):
            if link.registered:
                code = ErrorCode.coerce(msg.code)
                if code == ErrorCode.NOT_REGISTERED:
                    code = ErrorCode.PEER_GONE  # the prefill rank forgot the link: it restarted
                self._drop_link(link, code, f"prefill closed the link: {msg.reason}")
            else:
                link.inbox.put_nowait(msg)
        elif isinstance(msg, (BootstrapInfo, RegisterAccept, RegisterReject, CacheGroups)):
            if link.registered:
                self.core.stats.peer_violations += 1  # handshake replies after the handshake: dropped
                return
            if isinstance(msg, CacheGroups):
                link.peer_groups = msg if msg.link_id == link.link_id else None
                return
            if isinstance(msg, (RegisterAccept, RegisterReject)) and msg.link_id == link.link_id:
                link.peer_minor = header.minor  # a REGISTER_REJECT's minor too: it says what the refusing rank accepts
                link.answer = type(msg)
            link.inbox.put_nowait(msg)
        else:
            self.core.stats.peer_violations += 1
            log.warning("unexpected %s from prefill rank %d", type(msg).__name__, link.prefill_rank)

    def _drop_link(self, link: _Link, code: ErrorCode | int, reason: str) -> None:
        """The prefill rank behind ``link`` is gone: its rooms fail and, unless the link was
        already retired, its cluster bootstraps again. The cluster's other links close too, except
        those that draining rooms still hold: they stay open (retired) until those rooms have heard
        their writers' ABORT answers (``ReceiverCore``, "Losing one prefill rank")."""
        if link.link_id not in self._links:
            return
        log.info("dropped prefill link %s rank %d: %s", link.cluster, link.prefill_rank, reason)
        self.core.remove_link(link.link_id, self._now(), code=code, reason=reason)  # type: ignore[arg-type]
        self._discard_link(link)
        if not link.retired:
            for other in [lk for lk in self._links.values() if lk.cluster == link.cluster and not lk.retired]:
                if self.core.link_in_use(other.link_id):
                    other.retired = True
                else:
                    self._discard_link(other)

    def _close_retired(self) -> None:
        """Close the retired links that no live room holds any more."""
        for link in [lk for lk in self._links.values() if lk.retired and not self.core.link_in_use(lk.link_id)]:
            self._discard_link(link)

    # --- bootstrap -------------------------------------------------------------------------------------
    def _start_bootstrap(self, cluster: str) -> None:
        task = self._bootstraps.get(cluster)
        if task is not None and not task.done():
            return
        self.core.cluster_pending(cluster)
        self._bootstraps[cluster] = self._spawn(self._bootstrap(cluster), f"bootstrap-{cluster}")

    async def _bootstrap(self, cluster: str) -> None:
        timeout = self.config.timeouts.bootstrap or 30.0
        links: list[_Link] = []
        try:
            try:
                async with asyncio.timeout(timeout):  # unlike wait_for, never swallows a cancel
                    ready = await self._handshake(cluster, links)
            except TimeoutError:
                raise _BootstrapFailed(ErrorCode.BOOTSTRAP_TIMEOUT,
                                       f"prefill instance {cluster} did not complete the handshake in {timeout}s") from None
            self.core.cluster_ready(cluster, ready, self._now())
            for link in links:
                link.registered = True
        except Exception as exc:  # anything a bad peer makes the handshake raise fails the bootstrap
            failure = exc if isinstance(exc, _BootstrapFailed) else _BootstrapFailed(
                ErrorCode.PEER_PROTOCOL_ERROR, f"handshake with {cluster} failed: {type(exc).__name__}: {exc}")
            log.warning("bootstrap of %s failed: %s", cluster, failure.reason)
            self._bootstrap_failed(cluster, links, failure)
        finally:
            self._flush()
            self._bootstraps.pop(cluster, None)

    def _bootstrap_failed(self, cluster: str, links: list[_Link], failure: _BootstrapFailed) -> None:
        """Fail the rooms waiting for ``cluster``, telling the prefill ranks that answered this
        bootstrap's REGISTERs to let go of them: a rank that refused it at minor 4 or later, and a
        rank that accepted it (it registered this rank, which will never use the link). Each gets
        a room ABORT for every room that fails here and every held end (``ReceiverCore.cluster_failed``);
        an accepting rank then a link ABORT. Links that were told close with a linger, so that
        their frames leave."""
        tell = [link for link in links if link.answer is RegisterAccept or (
            link.answer is RegisterReject and link.peer_minor >= HOLD_MINOR)]
        self.core.cluster_failed(cluster, failure.code, failure.reason, self._now(),
                                 tell=[link.link_id for link in tell])
        self._flush()
        for link in links:
            if link.answer is RegisterAccept:
                self._send_frame(link.channel, [encode(Abort(code=failure.code, reason=failure.reason[:1000]))])
            self._discard_link(link, linger=200 if link in tell else 0)

    async def _handshake(self, cluster: str, links: list[_Link]) -> list[ReceiverLink]:
        first = self._connect(cluster, 0, cluster)
        links.append(first)
        info = await self._query(first)
        g = self.kv.geometry
        by_rank = {r.tp_rank: r for r in info.ranks}
        paired = paired_ranks_of_decode_cache(self._cache.with_tp(info.tp_size, 0), self._cache)
        targets: dict[int, _Link] = {}
        for rank in paired:
            if rank == 0:
                targets[0] = first
            else:
                link = self._connect(cluster, rank, by_rank[rank].endpoint)
                links.append(link)
                targets[rank] = link
        for link in targets.values():
            if self.kv.groups:
                self._send_frame(link.channel, [encode(CacheGroups(link_id=link.link_id, groups=self.kv.wire_groups(),
                                                                   layouts=self.kv.wire_layouts()))])
            self._send_frame(link.channel, [encode(self._register_message(link))])
        accepts = await asyncio.gather(*(self._await_accept(link) for link in targets.values()))
        result = []
        prefill_g = None
        roles, caches = {}, {}
        for link, accept in zip(targets.values(), accepts):
            try:
                prefill_g = geometry_from_wire(accept.geometry)
                check_compatible(prefill_g, g)
                peer = link.peer_groups
                prefill_cache = groups_from_wire(PagedGroup(self.kv.name, prefill_g), peer.groups if peer else (),
                                                 peer.layouts if peer else ())
                check_groups(prefill_cache, self._cache)
            except IncompatibleGroups as exc:
                older = f" (it speaks version 1.{link.peer_minor}, before cache groups)" if link.peer_minor < 2 else \
                    f" (it speaks version 1.{link.peer_minor}, before state layouts)" \
                    if link.peer_minor < LAYOUT_MINOR and "sections differ" in exc.reason else ""
                raise _BootstrapFailed(ErrorCode.INCOMPATIBLE_GEOMETRY,
                                       f"prefill rank {link.prefill_rank}{older}: {exc}") from None
            except (ValueError, IncompatibleGeometry) as exc:
                raise _BootstrapFailed(ErrorCode.INCOMPATIBLE_GEOMETRY, f"prefill rank {link.prefill_rank}: {exc}") from None
            refusal = older_peer_refusal(self._cache, link.peer_minor)  # (minor 4) slots it could not address
            if refusal is not None:
                raise _BootstrapFailed(ErrorCode.INCOMPATIBLE_GEOMETRY, f"prefill rank {link.prefill_rank}: {refusal}")
            if prefill_g.tp_size != info.tp_size or prefill_g.tp_rank != link.prefill_rank:
                raise _BootstrapFailed(ErrorCode.PEER_PROTOCOL_ERROR,
                                       f"prefill rank {link.prefill_rank} reports itself as rank {prefill_g.tp_rank} of {prefill_g.tp_size}")
            if self.kv.aux is not None and accept.aux_slot_bytes not in (0, self.kv.aux.slot_bytes):
                raise _BootstrapFailed(ErrorCode.INCOMPATIBLE_GEOMETRY,
                                       f"aux slots of {accept.aux_slot_bytes} bytes, decode uses {self.kv.aux.slot_bytes}")
            link.boot_id = accept.boot_id
            result.append((link, accept))
            roles[link.link_id] = link_roles(prefill_cache, self._cache)
            caches[link.link_id] = prefill_cache
        assert prefill_g is not None
        chosen = writers(prefill_g, g)
        for link, _accept in result:
            if link.prefill_rank in chosen and self._staging is not None and link.peer_minor >= 1:
                self._pieces[link.link_id] = pair_piece(self._kernels, caches[link.link_id], self._cache,
                                                        side="decode", minor=min(link.peer_minor, MINOR),
                                                        buf=self._staging)
        unused = [lk for lk in links if lk not in targets.values()]
        for link in unused:
            self._discard_link(link)
            links.remove(link)
        return [
            ReceiverLink(key=link.link_id, link_id=link.link_id, cluster=cluster, prefill_rank=link.prefill_rank,
                         agent=accept.agent_name, writer=roles[link.link_id].writer,
                         aux_owner=link.prefill_rank == chosen[0],
                         stage_unit=piece.unit if piece is not None else 0,
                         staged_groups=tuple(p.group for p in piece.parts[1:]) if piece is not None else (),
                         stage_tail=piece.tail if piece is not None else 0, minor=link.peer_minor)
            for link, accept in result
            for piece in (self._pieces.get(link.link_id),)
        ]

    async def _query(self, link: _Link) -> BootstrapInfo:
        query = encode(BootstrapQuery(requester=self.agent_name))
        while True:
            self._send_frame(link.channel, [query])
            try:
                async with asyncio.timeout(0.25):
                    msg = await link.inbox.get()
            except TimeoutError:
                continue
            if isinstance(msg, BootstrapInfo) and msg.tp_size == 0:
                raise _BootstrapFailed(ErrorCode.PEER_PROTOCOL_ERROR, "rank table of a prefill instance of TP 0")
            if isinstance(msg, BootstrapInfo) and len(msg.ranks) == msg.tp_size:
                if sorted(r.tp_rank for r in msg.ranks) != list(range(msg.tp_size)):
                    raise _BootstrapFailed(ErrorCode.PEER_PROTOCOL_ERROR, f"malformed rank table {msg.ranks}")
                return msg
            if isinstance(msg, Abort):
                raise _BootstrapFailed(ErrorCode.coerce(msg.code), msg.reason)
            await asyncio.sleep(0.05)  # not every prefill rank has announced yet

    async def _await_accept(self, link: _Link) -> RegisterAccept:
        while True:
            msg = await link.inbox.get()
            if isinstance(msg, RegisterAccept) and msg.link_id == link.link_id:
                return msg
            if isinstance(msg, RegisterReject):
                raise _BootstrapFailed(ErrorCode.coerce(msg.code),
                                       f"prefill rank {link.prefill_rank} rejected registration: {msg.reason}")
            if isinstance(msg, Abort):
                raise _BootstrapFailed(ErrorCode.coerce(msg.code), msg.reason)

    def _register_message(self, link: _Link) -> Register:
        assert self.transport is not None
        aux = self.kv.aux
        return Register(
            boot_id=self.boot_id, instance=self.instance, link_id=link.link_id, agent_name=self.agent_name,
            model_id=self.config.model_id, compat_key=self.config.compat_key,
            geometry=geometry_to_wire(self.kv.geometry), aux_slots=aux.slots if aux else 0,
            aux_slot_bytes=aux.slot_bytes if aux else 0, transport=self.config.transport,
            transport_metadata=self.transport.metadata(), regions=self.kv.wire_regions() + self._staging_row(),
        )

    def _staging_row(self) -> tuple[WireRegion, ...]:
        buf = self._staging
        if buf is None:
            return ()
        return (WireRegion(kind=RegionKind.STAGING, index=0, address=buf.address, length=buf.capacity,
                           device_id=buf.device_id, mem_kind=buf.kind),)

    # --- progress ---------------------------------------------------------------------------------------
    def _perform(self, output: Any) -> None:
        if isinstance(output, DropLink):
            link = self._links.get(output.link)  # type: ignore[arg-type]
            if link is not None:
                self._drop_link(link, output.code, output.reason)
            return
        if not isinstance(output, Scatter):
            raise TypeError(f"unexpected output {output!r}")
        link_id: int = output.link  # type: ignore[assignment]
        piece = self._pieces[link_id]
        slots = dict(enumerate(output.state_slots, start=1)) or None  # by group number: the state block's
        assert self._staging is not None

        def scatter(stream: Any) -> None:
            piece.copy(self._staging, output.offset, output.room_id,  # type: ignore[arg-type]
                       (output.dst_pages, *output.group_pages), start=output.start_token, end=output.end_token,
                       slots=slots,
                       keep=output.room_id in self.core.rooms, stream=stream, gather=False)

        launched = self._now()

        def scattered() -> None:
            trace.mark("scattered", output.room_id, output.seq)
            self._staging_time(output.room_id, launched)
            self.core.scatter_done(output.room_id, link_id, output.seq, self._now())

        trace.mark("tagged", output.room_id, output.seq)
        self._copies.run(scatter, scattered)
        handle = self._handles.get(output.room_id)
        if handle is not None:
            handle.stats.paths.add(f"staged-{self._staging.where}")

    def _busy(self) -> bool:
        return (self._staging is not None and len(self._copies) > 0) or self.core.expecting_data()

    def _room_ended(self, out: Any) -> None:
        super()._room_ended(out)
        if self._staging is not None:
            self._kernels.forget(out.room_id)
        self._close_retired()

    def _transferring(self) -> bool:
        return self.core.transferring > 0

    def _progress_once(self) -> bool:
        assert self.transport is not None
        now = self._now()
        t0 = time.perf_counter() if trace.ENABLED else 0.0
        try:
            notes = self.transport.drain_notifications()
        except TransportError as exc:  # deadlines and liveness go on: rooms fail by them, not hang
            self.errors += 1
            log.error("draining notifications failed: %s", exc)
            notes = []
        t1 = trace.step("drain_us", t0)
        for note in notes:
            if trace.ENABLED:
                trace.mark("tag", int.from_bytes(note.tag[4:12], "little") if len(note.tag) >= 12 else 0, 0)
            self.core.on_notification(note.peer, note.tag, now)
        t2 = trace.step("tags_us", t1)
        scattered = self._copies.poll() if self._staging is not None else 0
        trace.step("copies_us", t2)
        self.core.handle_timer(now)
        interval, limit = self.config.heartbeat_interval, self.config.heartbeat_timeout
        stalled = self._stall(now)
        for link in list(self._links.values()):
            link.last_seen += stalled
            if not link.registered:
                continue
            if now - link.last_seen > limit:
                self._drop_link(link, ErrorCode.PEER_GONE, f"no heartbeat for {limit}s")
            elif now - link.last_beat >= interval:
                link.last_beat = now
                link.beats += 1
                self._send_frame(link.channel, [encode(Heartbeat(boot_id=self.boot_id, seq=link.beats))])
        return bool(notes) or scattered > 0
