"""``PrefillEndpoint``: one prefill rank. Serves its ROUTER socket, pushes KV writes.

Theory of operation
-------------------
The rank binds one ROUTER socket. Decode ranks connect a DEALER to it and REGISTER; the
registration is checked (version, model, compatibility key, geometry, memory table, transport)
before the decode agent's metadata is loaded, and answered with REGISTER_ACCEPT or
REGISTER_REJECT and a code. Prefill rank 0 is also the *bootstrap* service: the other ranks
announce their addresses to it (RANK_ANNOUNCE, repeated every heartbeat interval) and decode
ranks query the rank table (BOOTSTRAP_QUERY / BOOTSTRAP_INFO).

Room messages go to the ``SenderCore``; its ``PostWrite``/``PostAux`` outputs are planned
against the link's geometry (``LinkPath``) and posted on the transport; the progress task polls
them to DONE and reports back. A decode link silent for ``heartbeat_timeout`` is dropped and its
rooms fail with PEER_GONE.

A socket whose REGISTER this rank refuses is remembered for a short while (``SenderCore.refuse_link``),
so that the room ABORTs that decode rank sends for the rooms it wanted fail them at once
(protocol 1.4, ``kvproto.core.holds``). With CURVE, the context's ZAP handler (``kvproto.aio.auth``)
is served on a channel of this endpoint's loop like the ROUTER.

A cache of several groups (hybrid models): the decode rank's CACHE_GROUPS, kept per socket until
its REGISTER comes, is checked with it (the same groups, or the registration is refused naming the
group); the link gets one path per group beyond the first (a ``LinkPath`` of the group's own
geometry, or a ``StatePath``), and the accept is preceded by this rank's own CACHE_GROUPS.

How a REGISTER becomes a link (checks, paths, the core's ``SenderLink``) is
``kvproto.aio.prefill_links`` (a mixin of ``PrefillEndpoint``); this module is the rank's sockets,
frames, bootstrap service and writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvproto.aio.auth import KeyAuthenticator
from kvproto.aio.channel import Channel, control_socket
from kvproto.aio.endpoint import EndpointBase, EndpointConfig
from kvproto.aio.memory import KVCache
from kvproto.aio.paths import LocalLists, Posted
from kvproto.aio.prefill_links import PrefillLinks, _DecodeLink
from kvproto.aio import trace
from kvproto.aio.ready import ReadyWaiter
from kvproto.aio.room import SenderRoomHandle
from kvproto.aio.staging import CacheKernels, Copies, Piece, StagingBuffer, Stager, warm_kernels, warm_rows_kernels
from kvproto.core import PostAux, PostGroups, PostStaged, PostWrite, RoomState, SenderCore
from kvproto.transport import TransportError, XferState
from kvproto.transport.base import completion_event, wait_on_device
from kvproto.wire import (
    MINOR,
    Abort,
    BootstrapInfo,
    BootstrapQuery,
    CacheGroups,
    ErrorCode,
    Heartbeat,
    Message,
    MsgType,
    RankAddress,
    RankAnnounce,
    Register,
    RegisterReject,
    RemoteProtocolError,
    RoomHold,
    StagingGrant,
    StagingWatermark,
    TransferRequest,
    UnknownMessage,
    UnsupportedVersion,
    decode_frame,
    peek_header,
    encode,
)

log = logging.getLogger("kvproto")

MAX_PENDING_GROUPS = 1024
"""Most sockets whose CACHE_GROUPS waits for their REGISTER (the oldest are forgotten first)."""


_WILDCARDS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


def _bracketed(host: str) -> str:
    """``host`` as it goes into a ZMQ tcp:// address (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(slots=True)
class _Pending:
    room_id: int
    link: bytes
    seq: int
    tag: bytes
    posted: Posted
    local_key: Any = None
    """The local staging region the write reads from, released when it finishes."""


class PrefillEndpoint(PrefillLinks, EndpointBase):
    """One prefill rank. ``bootstrap`` is prefill rank 0's address (ranks other than 0)."""

    ROLE = "prefill"

    def __init__(self, kv: KVCache, *, bootstrap: str | None = None, config: EndpointConfig | None = None) -> None:
        super().__init__(kv, config)
        g = kv.geometry
        if g.tp_rank != 0 and bootstrap is None:
            raise ValueError("prefill ranks other than 0 need bootstrap=<address of rank 0>")
        if (self.config.advertise_host or self.config.host) in _WILDCARDS:
            raise ValueError(f"EndpointConfig.host={self.config.host!r} binds every interface: set "
                             "EndpointConfig.advertise_host to the address decode ranks can reach")
        self._bootstrap_target = bootstrap
        aux = kv.aux
        self._cache = kv.cache_geometry
        layer_map = kv.layer_map()
        self.core = SenderCore(
            block_size=g.block_size, num_blocks=g.num_blocks, aux_slots=aux.slots if aux else 0,
            timeouts=self.config.timeouts, num_layers=kv.model_layers, groups=kv.group_specs(), layers=layer_map[0],
        )
        self._pending_groups: dict[bytes, CacheGroups] = {}
        """CACHE_GROUPS of sockets whose REGISTER has not come yet (insertion order: oldest first)."""
        self._group_locals: list[LocalLists | None] = []
        self._router: Channel | None = None
        self._announcer: Channel | None = None
        self.address = ""
        self._links: dict[bytes, _DecodeLink] = {}
        self._pending: dict[Any, _Pending] = {}
        self._held: dict[tuple[int, ...], list[Any]] = {}
        """Writes waiting for the readiness events of the layers they carry (layer-wise chunks), by
        the identity of those events: the rooms of one forward share a layer's event, which is
        then queried once a pass for all of them (``_release_held``), in the order they were held."""
        self._ready: ReadyWaiter | None = None
        """Wakes the loop as the held writes' events fire (``kvproto.aio.ready``)."""
        self._written: ReadyWaiter | None = None
        """Waits for the oldest write in flight, while the loop sleeps (``_wait_in_thread``)."""
        self._local: LocalLists | None = None
        self._rank_table: dict[int, RankAddress] = {}
        self._auth: KeyAuthenticator | None = None
        self._zap: Channel | None = None
        self._pieces: dict[bytes, Piece] = {}
        """What each staging link's pieces hold: the first group's block, the staged groups', and
        the state block where there is one."""
        self._staging: StagingBuffer | None = None
        if self._staging_bytes():
            self._staging = StagingBuffer(kv, self._staging_bytes(), host=self.config.host_staging)
            self._stager = Stager(self._staging)
            self._kernels = CacheKernels(kv)
            self._copies = Copies(kv.tensors[0].device, self._kernels.uploads)

    @property
    def bootstrap_address(self) -> str:
        """Where decode ranks find this prefill instance (rank 0's address)."""
        return self._bootstrap_target or self.address

    # --- application API ----------------------------------------------------------------------
    def open_room(self, room_id: int) -> SenderRoomHandle:
        """Start the prefill side of room ``room_id``; decode's request may come before or after."""
        self._check_open()
        now = self._now()
        self.core.open_room(room_id, now)  # refuses (a live id...) before it changes anything
        handle = SenderRoomHandle(self, room_id, self._loop, now)  # type: ignore[arg-type]
        self._handles[room_id] = handle  # before the flush: the room may already have ended
        self.metrics.room_opened(now)
        self._flush()
        return handle

    def _submit_chunk(self, room_id: int, pages: Sequence[int], end_token: int, last: bool, aux_slot: int | None,
                      layers: tuple[int, int] | None = None, ready: Any = None,
                      group_pages: Any = None, state_slots: Any = None, first_token: int = 0) -> None:
        self._check_open()
        first = list(pages)
        # a group given the first group's very list gets ``first``: the core takes it by identity
        pages_by_group, slots = self.kv.group_args(group_pages, state_slots, first=(pages, first))
        try:
            self.core.submit_chunk(room_id, first, end_token, self._now(), last=last, aux_slot=aux_slot,
                                   layers=layers, ready=ready, group_pages=pages_by_group, state_slots=slots,
                                   first_token=first_token)
        finally:
            self._flush()
            self._kick()

    # --- sockets ----------------------------------------------------------------------------------
    async def _start_io(self) -> None:
        assert self._ctx is not None and self.transport is not None
        self._local = LocalLists(self.transport, self.kv)
        self._local.pages()  # prepared now, not by the first room
        self._group_locals = [LocalLists(self.transport, extra) if isinstance(extra, KVCache) else None
                              for extra in self.kv.groups]
        if self._staging is not None:
            self._staging_registration = self.transport.register([self._staging.region()])
            warming = warm_kernels(self.kv, self._kernels, self._staging, gather=True)
            if warming is not None and self.config.warm_up:
                await asyncio.to_thread(warming.join)
        if self.config.warm_up and hasattr(self.transport, "post_plan"):  # the kernel path's rows kernels
            rows = warm_rows_kernels(self.kv)
            if rows is not None:
                await asyncio.to_thread(rows.join)
        advertised = self.config.advertise_host or self.config.host
        router = control_socket(self._ctx, zmq.ROUTER, linger=500)
        curve = self.config.curve
        if curve is not None:
            self._auth = KeyAuthenticator(allowed=curve.allowed | {curve.public_key})
            self._zap = self._channel(self._auth.socket(self._ctx), "ZAP request", self._on_zap)
            curve.server(router)
        if self.config.port:
            router.bind(f"tcp://{self.config.host}:{self.config.port}")
            port = self.config.port
        else:
            port = router.bind_to_random_port(f"tcp://{self.config.host}")
        self._router = self._channel(router, "frame", self._on_message)
        self.address = f"tcp://{_bracketed(advertised)}:{port}"
        g = self.kv.geometry
        self._rank_table[g.tp_rank] = RankAddress(tp_rank=g.tp_rank, endpoint=self.address, boot_id=self.boot_id)
        if g.tp_rank != 0:
            announcer = control_socket(self._ctx, zmq.DEALER, linger=0)
            if curve is not None:
                curve.client(announcer, curve.server_key or curve.public_key)
            announcer.connect(self._bootstrap_target)  # type: ignore[arg-type]
            self._announcer = self._channel(announcer, "announce ack", lambda frames: None)  # acks: drained
            self._spawn(self._announce_loop(), "announce")

    def _close_io(self) -> None:
        for waiter in (self._ready, self._written):
            if waiter is not None:
                waiter.close()
        for link in list(self._links.values()):
            self._close_link(link)
        if self._router is not None:
            self._router.close(linger=500)
        if self._announcer is not None:
            self._announcer.close()
        if self._zap is not None:
            self._zap.close()
        if self._local is not None:
            self._local.release()
        for local in self._group_locals:
            if local is not None:
                local.release()

    async def _announce_loop(self) -> None:
        g = self.kv.geometry
        msg = encode(RankAnnounce(tp_rank=g.tp_rank, tp_size=g.tp_size, endpoint=self.address, boot_id=self.boot_id))
        assert self._announcer is not None
        while True:
            self._send_frame(self._announcer, [msg])
            await asyncio.sleep(self.config.heartbeat_interval)

    def _on_zap(self, frames: list[bytes]) -> None:
        assert self._auth is not None and self._zap is not None
        self._zap.send(self._auth.reply(frames))

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.errors += 1
            return
        self._on_frame(*frames)

    def _send(self, link: Any, message: Message) -> None:
        assert self._router is not None
        self._send_frame(self._router, [link, self._encode(message)])
        if trace.ENABLED and getattr(message, "room_id", 0):
            trace.mark(f"sent_{type(message).__name__}", message.room_id, 0)

    # --- incoming frames -----------------------------------------------------------------------
    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        now = self._now()
        link = self._links.get(ident)
        if link is not None:
            link.last_seen = now
        try:
            header, msg = decode_frame(frame)
        except RemoteProtocolError as exc:
            self._bad_frame(ident, frame, exc)
            return
        if isinstance(msg, (TransferRequest, Abort, StagingGrant, StagingWatermark, RoomHold)) and msg.room_id:
            if trace.ENABLED:
                trace.mark(f"recv_{type(msg).__name__}", msg.room_id, 0)
            self.core.on_message(ident, msg, now)
        elif isinstance(msg, Register):
            self._on_register(ident, header.minor, msg)
        elif isinstance(msg, CacheGroups):
            self._pending_groups.pop(ident, None)
            self._pending_groups[ident] = msg  # applied to this socket's next REGISTER of the same link id
            while len(self._pending_groups) > MAX_PENDING_GROUPS:
                del self._pending_groups[next(iter(self._pending_groups))]
        elif isinstance(msg, Heartbeat):
            if link is None:
                self._send(ident, Abort(code=ErrorCode.NOT_REGISTERED, reason="heartbeat from an unregistered link"))
            elif msg.boot_id != link.boot_id:
                self._drop_link(link, ErrorCode.PEER_GONE, "decode rank restarted")
            else:
                self._send(ident, Heartbeat(boot_id=self.boot_id, seq=msg.seq))
        elif isinstance(msg, Abort):
            if link is not None:
                self._drop_link(link, ErrorCode.coerce(msg.code), f"decode closed the link: {msg.reason}")
        elif isinstance(msg, BootstrapQuery) and self.kv.geometry.tp_rank == 0:
            self._send(ident, self._bootstrap_info())
        elif isinstance(msg, RankAnnounce) and self.kv.geometry.tp_rank == 0:
            self._on_announce(ident, msg)
        else:
            self._send(ident, Abort(room_id=msg.room_id, generation=msg.generation,
                                    code=ErrorCode.PEER_PROTOCOL_ERROR,
                                    reason=f"{type(msg).__name__} is not accepted by a prefill rank"))

    def _bad_frame(self, ident: bytes, frame: bytes, exc: RemoteProtocolError) -> None:
        """Answer an undecodable frame with its code; fail the room it names, if any."""
        if isinstance(exc, UnknownMessage) and exc.header.minor > MINOR:
            return  # a newer minor version's message: ignorable by the spec
        header = peek_header(frame)
        room_id, generation, msg_type = (header.room_id, header.generation, header.msg_type) if header else (0, 0, 0)
        reason = str(exc)
        if isinstance(exc, UnsupportedVersion) or msg_type == MsgType.REGISTER:
            self._send(ident, RegisterReject(link_id=0, code=exc.code, reason=reason))
            return
        self.core.stats.peer_violations += 1
        if room_id and room_id in self.core.rooms:
            self.core.peer_violation(ident, room_id, generation, exc.code, reason, self._now())
        else:
            self._send(ident, Abort(room_id=room_id, generation=generation, code=exc.code, reason=reason))

    # --- bootstrap service (rank 0) --------------------------------------------------------------
    def _bootstrap_info(self) -> BootstrapInfo:
        ranks = tuple(self._rank_table[r] for r in sorted(self._rank_table))
        return BootstrapInfo(tp_size=self.kv.geometry.tp_size, ranks=ranks)

    def _on_announce(self, ident: bytes, msg: RankAnnounce) -> None:
        g = self.kv.geometry
        if msg.tp_size != g.tp_size or not 0 < msg.tp_rank < g.tp_size:
            self._send(ident, Abort(code=ErrorCode.INCOMPATIBLE_GEOMETRY,
                                    reason=f"rank {msg.tp_rank} of TP {msg.tp_size} does not fit TP {g.tp_size}"))
            return
        self._rank_table[msg.tp_rank] = RankAddress(tp_rank=msg.tp_rank, endpoint=msg.endpoint, boot_id=msg.boot_id)
        self._send(ident, self._bootstrap_info())

    def _drop_link(self, link: _DecodeLink, code: ErrorCode | int, reason: str) -> None:
        if self._links.get(link.ident) is not link:
            return
        del self._links[link.ident]
        self.core.remove_link(link.ident, self._now(), code=code, reason=reason)  # type: ignore[arg-type]
        link.release()
        assert self.transport is not None
        if not any(other.agent == link.agent for other in self._links.values()):
            try:
                self.transport.remove_peer(link.agent)
            except TransportError as exc:
                log.warning("removing peer %s: %s", link.agent, exc)
        log.info("dropped decode link %s rank %d: %s", link.link.instance, link.link.decode_rank, reason)

    # --- writes --------------------------------------------------------------------------------------
    def _perform(self, out: Any) -> None:
        if not isinstance(out, (PostWrite, PostAux, PostStaged, PostGroups)):
            raise TypeError(f"unexpected output {out!r}")
        ready = getattr(out, "ready", ())
        if ready and not _fired(ready) and not self._waits_on_device(out, ready):
            # its layers are not written yet: posted once the events fire
            self._held.setdefault(tuple(map(id, ready)), []).append(out)
            if self.config.ready_thread:
                if self._ready is None:
                    assert self._loop is not None
                    self._ready = ReadyWaiter(self._loop, self._kick)
                self._ready.watch(ready)
            return
        self._post(out)

    def _waits_on_device(self, out: Any, ready: tuple[Any, ...]) -> bool:
        """Whether ``out``, whose KV is still being computed, may be posted now because its
        adapter orders it after ``ready`` on the device (``wait_on_device``: a kernel write of a
        GPU cache into a mapped peer). Then its kernel is queued behind the engine's events and
        runs the moment the layer is, where a held write waited for the loop to see the events
        fire and post it: a layer's posts, done during its compute, leave the tail after the
        last layer."""
        if not isinstance(out, PostWrite) or not self.kv.tensors or self.kv.tensors[0].device.type != "cuda":
            return False
        link = self._links.get(out.link)  # type: ignore[arg-type]
        assert self.transport is not None
        return link is not None and wait_on_device(self.transport, link.path.peer, ready)

    def _release_held(self) -> int:
        """Post the held writes whose readiness events have fired (each distinct set of events
        queried once); a held write whose room has ended is reported failed (nothing was
        posted), so that the room's drain completes."""
        if not self._held:
            return 0
        released = 0
        ended = (None, RoomState.FAILED, RoomState.SUCCESS)
        for key, outs in list(self._held.items()):
            fired = _fired(outs[0].ready)
            kept = []
            for out in outs:
                if self.core.room_state(out.room_id) in ended:
                    self.core.write_failed(out.room_id, out.link, out.seq, "the room ended before its KV was ready",
                                           self._now(), tag=out.tag)
                elif fired:
                    self._post(out)
                    released += 1
                else:
                    kept.append(out)
            if kept:
                self._held[key] = kept
            else:
                del self._held[key]
        return released

    def _post(self, out: Any) -> None:
        link = self._links.get(out.link)  # type: ignore[arg-type]
        if link is None:
            self.core.write_failed(out.room_id, out.link, out.seq, "link is gone", self._now(), tag=out.tag)
            return
        if isinstance(out, PostStaged):
            self._stage(out, link)
            return
        trace.mark("post", out.room_id, out.seq)
        try:
            if isinstance(out, PostWrite):
                posted = link.path.post_kv(out.tag, out.src_pages, out.dst_pages, out.start_token, out.end_token,
                                           out.layers)
                kinds: tuple[str, ...] = (link.path.label,)
            elif isinstance(out, PostGroups):
                posted, kinds = link.writes.post(out.parts, out.tag)
            else:
                posted, kinds = link.path.post_aux(out.tag, out.src_slot, out.dst_slot), ("aux",)
        except (TransportError, ValueError) as exc:
            self.core.write_failed(out.room_id, out.link, out.seq, str(exc), self._now(), tag=out.tag)
            return
        except Exception as exc:  # noqa: BLE001 - a bug, or a kernel that failed to build: this room fails now
            self._internal_error(out, exc, "posting a write")
            return
        trace.mark("posted", out.room_id, out.seq)
        self._posted(out, link, posted, kinds)

    def _internal_error(self, out: Any, exc: Exception, what: str) -> None:
        """An unexpected exception while moving one write of ``out``'s room: logged and counted as
        the endpoint's error, and the write fails, so that its room fails at once with the cause
        (instead of at its deadline) and the other rooms go on."""
        self.errors += 1
        log.exception("prefill: unexpected error %s of room %d", what, out.room_id)
        self.core.write_failed(out.room_id, out.link, out.seq, f"internal error {what}: {type(exc).__name__}: {exc}",
                               self._now(), tag=out.tag)

    def _posted(self, out: Any, link: _DecodeLink, posted: Posted, kinds: tuple[str, ...],
                local_key: Any = None) -> None:
        self._pending[posted.xfer] = _Pending(out.room_id, link.ident, out.seq, out.tag, posted, local_key)
        handle = self._handles.get(out.room_id)
        if handle is not None:
            handle.stats.writes += 1
            handle.stats.nbytes += posted.nbytes
            handle.stats.descriptors += posted.descriptors
            handle.stats.paths.update(kinds)
        self._kick()

    def _stage(self, out: PostStaged, link: _DecodeLink) -> None:
        """Gather the piece into a free local staging region, then WRITE it (when the gather is done)."""
        piece = self._pieces[link.ident]
        nbytes = (out.end_token - out.start_token) * piece.unit + (piece.tail if out.states else 0)
        slots = {part.group: part.src_slot for part in out.states}
        assert self._staging is not None

        trace.mark("granted", out.room_id, out.seq)

        def start(offset: int, key: Any) -> None:
            trace.mark("gather", out.room_id, out.seq)

            def gather(stream: Any) -> None:
                piece.copy(self._staging, offset, out.room_id, (out.src_pages, *out.group_pages),  # type: ignore[arg-type]
                           start=out.start_token, end=out.end_token, slots=slots, keep=out.room_id in self.core.rooms,
                           stream=stream, gather=True)

            launched = self._now()

            def gathered() -> None:
                self._staging_time(out.room_id, launched)
                self._write_piece(out, offset, key, nbytes)

            def failed(exc: Exception) -> None:  # nothing was gathered: the region is free again
                self._stager.release(key)
                self._internal_error(out, exc, "gathering a staged piece")

            try:
                self._copies.run(gather, gathered, failed)
            except Exception as exc:  # noqa: BLE001 - a GPU launch refused at once
                failed(exc)

        self._stager.acquire(nbytes, start)

    def _write_piece(self, out: PostStaged, offset: int, key: Any, nbytes: int) -> None:
        trace.mark("gathered", out.room_id, out.seq)
        link = self._links.get(out.link)  # type: ignore[arg-type]
        buf = self._staging
        assert buf is not None
        try:
            if link is None:
                raise TransportError("link is gone")
            posted = link.path.post_staged(out.tag, (buf.address + offset, buf.kind, buf.device_id),
                                           out.remote_offset, nbytes)
        except (TransportError, ValueError) as exc:
            self._stager.release(key)
            self.core.write_failed(out.room_id, out.link, out.seq, str(exc), self._now(), tag=out.tag)
            return
        except Exception as exc:  # noqa: BLE001 - as in _post
            self._stager.release(key)
            self._internal_error(out, exc, "writing a staged piece")
            return
        self._posted(out, link, posted, (f"staged-{buf.where}", *(("state",) if out.states else ())), key)

    def _progress_once(self) -> bool:
        assert self.transport is not None
        now = self._now()
        t0 = time.perf_counter() if trace.ENABLED else 0.0
        self.transport.drain_notifications()  # drives the data plane; prefill expects no tags
        t1 = trace.step("drain_us", t0)
        finished = self._copies.poll() if self._staging is not None else 0
        t2 = trace.step("copies_us", t1)
        finished += self._release_held()
        finished += self._poll_writes(now)
        trace.step("writes_us", t2)
        self.core.handle_timer(now)
        limit = self.config.heartbeat_timeout
        stalled = self._stall(now)
        for link in self._links.values():
            link.last_seen += stalled
        for link in [lk for lk in self._links.values() if now - lk.last_seen > limit]:
            self._drop_link(link, ErrorCode.PEER_GONE, f"no heartbeat for {limit}s")
        return finished > 0

    def _poll_writes(self, now: float) -> int:
        """Poll every write in flight; finish those that ended, each one's consequences acted on
        before the next is finished (``_flush``): a room's TRANSFER_DONE leaves as its last write
        ends, so the decode rank ends that room while this rank finishes the others (a layer's
        writes to a batch of rooms end together). A poll the transport refuses
        (``TransportError``) ends that write as failed: its room fails, the others go on."""
        assert self.transport is not None
        finished = 0
        for xfer, pending in list(self._pending.items()):
            if xfer not in self._pending:  # ended meanwhile (its link dropped by a flush)
                continue
            why = None
            try:
                state = self.transport.poll(xfer)
            except TransportError as exc:
                log.warning("polling a write of room %d failed: %s", pending.room_id, exc)
                state, why = XferState.ERROR, f"poll failed: {exc}"
            if state is XferState.PENDING:
                continue
            finished += 1
            self._finish(xfer, pending, state is XferState.DONE, now, why)
            self._flush()
        return finished

    def _busy(self) -> bool:
        return bool(self._pending) or (self._staging is not None and len(self._copies) > 0)

    def _wait_in_thread(self) -> bool:
        """Writes in flight and nothing else to drive: wait for the oldest in a thread where the
        adapter offers its event (``kvproto.aio.ready``, ``completion_event``)."""
        if not self.config.ready_thread or (self._staging is not None and len(self._copies) > 0):
            return False
        event = completion_event(self.transport)
        if event is None:
            return False
        if self._written is None:
            assert self._loop is not None
            self._written = ReadyWaiter(self._loop, self._kick, name="kvproto-written")
        self._written.watch((event,))
        return True

    def _transferring(self) -> bool:
        """Writes wait for the engine's events: poll them at ``transfer_poll_s``, not spinning
        (the engine may compute for a long time, and its thread may need the interpreter)."""
        return bool(self._held)

    def _room_ended(self, out: Any) -> None:
        super()._room_ended(out)
        if self._staging is not None:
            self._kernels.forget(out.room_id)

    def _finish(self, xfer: Any, pending: _Pending, ok: bool, now: float, why: str | None = None) -> None:
        assert self.transport is not None
        del self._pending[xfer]
        try:
            self.transport.release(xfer)
        except TransportError as exc:
            log.warning("releasing a finished write of room %d: %s", pending.room_id, exc)
        trace.mark("written", pending.room_id, pending.seq)
        if pending.local_key is not None:
            self._stager.release(pending.local_key)  # the staging region is free only now
        if ok:
            self.core.write_done(pending.room_id, pending.link, pending.seq, pending.posted.nbytes, now,
                                 tag=pending.tag)
        else:
            why = why or getattr(xfer, "error", None) or "transport reported ERR"
            self.core.write_failed(pending.room_id, pending.link, pending.seq, why, now, tag=pending.tag)

    async def _settle(self, grace: float) -> None:
        """At close: let posted writes finish (their rooms' ABORTs go out as they do). A write
        still in flight after ``grace`` must not land once its decode rank is told the room or
        the link is over (it would free the pages): its link is closed *data plane first* — the
        transport forgets the peer, which ends the writes to it — and only then told."""
        assert self.transport is not None
        self._release_held()  # close() failed every room: their held writes are reported failed
        deadline = self._now() + grace
        while self._pending and self._now() < deadline:
            with contextlib.suppress(TransportError):
                self.transport.drain_notifications()
            self._poll_writes(self._now())
            self._flush()
            await asyncio.sleep(0.001)
        stuck = [link for link in self._links.values() if any(p.link == link.ident for p in self._pending.values())]
        for link in stuck:
            log.warning("closing with writes to decode rank %d still in flight after %.1fs: its link is "
                        "closed before it is told", link.link.decode_rank, grace)
            self._drop_link(link, ErrorCode.ENDPOINT_CLOSED, "endpoint closed")  # removes the peer
        for xfer in list(self._pending):
            try:
                self.transport.release(xfer)
            except TransportError as exc:
                log.warning("releasing an unfinished write at close: %s", exc)
        self._pending.clear()
        for link in stuck:
            self._tell_closed(link)
        self.core.abandon_drains()  # ABORTs held behind writes that were never posted
        self._flush()

    def _close_link(self, link: _DecodeLink) -> None:
        """Close a link at close(): the data plane first (the peer is removed from the transport,
        so none of its writes can land any more), then the link ABORT that tells the decode rank."""
        self._drop_link(link, ErrorCode.ENDPOINT_CLOSED, "endpoint closed")
        self._tell_closed(link)

    def _tell_closed(self, link: _DecodeLink) -> None:
        self._send(link.ident, Abort(code=ErrorCode.ENDPOINT_CLOSED, reason="prefill closed"))


def _fired(ready: tuple[Any, ...]) -> bool:
    """Every readiness handle has completed (``query()``: a CUDA event's, without waiting)."""
    return all(event.query() for event in ready)
