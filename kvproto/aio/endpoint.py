"""What prefill and decode endpoints share: lifecycle, the progress task, output execution.

Theory of operation
-------------------
An endpoint wraps one sans-IO core (``SenderCore`` or ``ReceiverCore``), one transport and its
ZMQ sockets, all owned by the event loop's thread: every core, transport and socket call
happens there, so nothing needs a lock (NIXL agents are not thread-safe).

Two kinds of task drive it. Socket reader tasks (the *pump*) decode frames and hand room
messages to the core. The *progress* task drains transport notifications, polls posted
writes to DONE (a NIXL write's notification leaves only from that poll), fires the core's
deadlines, and runs liveness; it spins with ``sleep(0)`` while transfers are in flight and
backs off to ``idle_poll_s`` when there are none. After every core call the endpoint
performs the core's outputs in order (``_flush``).

Closing keeps the promise that a decode room reports FAILED only once nothing can land in its
pages, because the cache outlives the endpoint (the application reuses those pages). In order:
the core fails every live room with ENDPOINT_CLOSED, by the same rules as any failure (a decode
room with writes that may still land drains: ABORT, then it waits for its writers' answers and
its scatters); ``_settle`` waits for that (decode: until the drains end, at most their drain
deadline; prefill: for its writes in flight, up to ``CLOSE_GRACE_S``, each room's held ABORT
going out as they end); the tasks stop; ``_close_io`` says the last words (a prefill rank with
writes still in flight first removes the peer from the transport, which ends them, and only then
tells the decode rank); the transport closes (memory deregistered, peers removed: the data
plane is fenced); only then does ``_fenced`` end what still waited for it.

Nothing a peer sends can end a task: every frame is handled inside a guard that turns an
unexpected exception into a logged, counted event (and a failed room when the frame named
one), and the tasks keep serving the other rooms.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from kvproto.aio import trace
from kvproto.aio.channel import Channel
from kvproto.aio.memory import KVCache
from kvproto.aio.room import _Handle
from kvproto.core import PathCost, RoomEnded, RoomState, Send, Timeouts
from kvproto.metrics import EndpointMetrics, room_phases
from kvproto.transport import Transport, load_transport
from kvproto.transport.base import wakeup_fd
from kvproto.wire import ErrorCode, LocalProtocolError, Message, encode
from kvproto.wire.messages import compile_messages

log = logging.getLogger("kvproto")

CLOSE_GRACE_S = 2.0
"""How long ``close()`` lets a prefill rank's writes in flight finish (and a decode rank's
bootstraps that carry held ABORTs) before it fences them."""


class ControlFaults(Protocol):
    """Decides the fate of each outgoing control frame (see ``kvproto.testing.SeededFaults``)."""

    def plan(self, frames: list[bytes]) -> list[tuple[float, list[bytes]]]:
        """(delay in seconds, frames) for every copy to send: [] drops, two entries duplicate."""
        ...


class EndpointClosed(LocalProtocolError):
    """The endpoint is closed; only ``close()`` may be called again."""

    def __init__(self) -> None:
        super().__init__("endpoint is closed", ErrorCode.ENDPOINT_CLOSED)


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveAuth:
    """ZMQ CURVE keys for control-plane authentication and encryption (Z85-encoded bytes).

    Every prefill rank of one instance serves with the same ``public_key``/``secret_key`` pair;
    ``allowed`` lists the public keys of the decode ranks (and announcing prefill ranks, whose
    own key is always allowed) that may connect: any other peer is refused and logged. A decode
    rank sets its own pair and ``server_key``, the prefill instance's public key.
    """

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None
    allowed: frozenset[bytes] = frozenset()

    @staticmethod
    def keypair() -> tuple[bytes, bytes]:
        """A new (public, secret) Z85 key pair."""
        return zmq.curve_keypair()

    def client(self, sock: zmq.Socket, server_key: bytes | None = None) -> None:
        key = server_key or self.server_key
        if key is None:
            raise ValueError("CurveAuth.server_key (the prefill instance's public key) is required to connect")
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_serverkey = key

    def server(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_server = True


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointConfig:
    host: str = "127.0.0.1"
    """Interface the prefill endpoint binds (decode endpoints only connect); ``0.0.0.0`` binds all."""
    advertise_host: str | None = None
    """Host name or address peers use to reach this prefill rank: its bootstrap address and
    rank announcements carry it. Default: ``host``, which must then not be a wildcard. Set it
    when binding ``0.0.0.0`` or behind an address translation. (The data plane advertises its
    own addresses in its metadata: for NIXL, UCX's interfaces, chosen with ``UCX_NET_DEVICES``.)"""
    port: int = 0
    """Port of the prefill endpoint; 0 picks a free one."""
    transport: str = "nixl"
    transport_options: dict[str, Any] = field(default_factory=dict)
    agent_name: str | None = None
    """Data-plane agent name; unique among peers. Default: role, rank and a random suffix."""
    instance: str | None = None
    """Name of the engine instance this rank belongs to. Every TP rank of one decode engine must
    use the same name (a prefill room serves one decode instance). Default: unique per endpoint,
    which is right only for TP 1."""
    model_id: str = ""
    compat_key: str = ""
    """Free-form key that must match between sides (e.g. a hash of quantization settings)."""
    timeouts: Timeouts = Timeouts()
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    """A peer silent for this long is gone: its rooms fail with PEER_GONE."""
    idle_poll_s: float = 0.001
    """Longest pause of the progress task while nothing is in flight."""
    transfer_poll_s: float = 0.0002
    """Longest pause while this rank has rooms TRANSFERRING (a decode rank waiting for writes it
    cannot see yet: transports such as UCX over shared memory advance a write only while its
    target polls). The progress task's pauses last a millisecond at least, under asyncio (whose
    epoll counts whole milliseconds, rounded up) and uvloop alike (which would make a timer of
    0.2 ms one of 0 ms: a loop spinning a core while its rooms wait)."""
    curve: CurveAuth | None = None
    """Authenticate and encrypt the control plane with CURVE (see ``CurveAuth``)."""
    path: str = "auto"
    """How a prefill rank moves bytes to a decode rank: ``auto`` (where both sides' pages are
    byte-identical, direct or staged per room, whichever ``path_cost`` prices lower; else staged
    where the decode offers staging; else sliced), ``direct`` (where pages are byte-identical,
    else as ``auto``), ``staged`` (where possible, else as ``auto``) or ``sliced``."""
    path_cost: PathCost | None = None
    """Constants of the direct-or-staged choice (``kvproto.core.cost``); None: the defaults for
    the cache's memory kind. ``kvproto bench transfer`` measures them."""
    staging_bytes: int | None = None
    """Size of this rank's staging buffer (0: no staging; None: 1 GiB for GPU caches, 64 MiB for
    host caches, plus, for a cache with state groups, room for the state blocks its pieces end with:
    ``kvproto.aio.staging.state_room``). A staged piece spends a few milliseconds between its grant
    and its scatter, so the bytes a pair moves per second are bounded by this size over that time:
    1 GiB keeps an NVLink busy. Needs the cache's tensors."""
    host_staging: bool = False
    """Stage GPU caches through pinned host memory instead of device memory."""
    warm_up: bool = True
    """``start()`` returns once the staging kernels this rank will launch are compiled (GPU caches
    with Triton), so that no room waits for compilation."""
    ready_thread: bool = True
    """A prefill rank waits for the engine's readiness events (``send(ready=...)``) in a thread of
    its own, which wakes its loop as each fires (``kvproto.aio.ready``: one CPU core spinning in
    CUDA's wait while a forward computes); False: the loop polls them every ``transfer_poll_s``
    (which its selector rounds up to a millisecond). With it, a prefill rank whose writes are in
    flight waits for them in a second thread once ``busy_spin_s`` passed with nothing to do
    (adapters that offer an event to wait for: the kernel path), instead of polling in a spin."""
    busy_spin_s: float = 50e-6
    """How long the progress task keeps polling, pass after pass, after the last pass that found
    work while writes are in flight, before it waits for them in a thread (``ready_thread``): a
    write about to end is noticed at once, a long one costs no core while it runs."""
    clock: Callable[[], float] | None = None
    """Where the core's time comes from (default: the event loop's clock). Tests jump it."""
    control_faults: ControlFaults | None = None
    """Fault injection on outgoing control frames (``kvproto.testing``); never set in production."""


class EndpointBase:
    ROLE = ""

    def __init__(self, kv: KVCache, config: EndpointConfig | None = None) -> None:
        self.kv = kv
        self.config = config or EndpointConfig()
        g = kv.geometry
        self.instance = self.config.instance or f"{self.ROLE}-{uuid.uuid4().hex[:12]}"
        self.agent_name = self.config.agent_name or f"kvproto-{self.ROLE}-{g.tp_rank}-{uuid.uuid4().hex[:12]}"
        self.boot_id = int.from_bytes(os.urandom(8), "little") or 1
        self.transport: Transport | None = None
        self._registration: Any = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handles: dict[int, _Handle] = {}
        self._wake = asyncio.Event()
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        """The event loop's thread: the only one allowed to call in."""
        self.core: Any = None
        self.errors = 0
        """Unexpected exceptions absorbed by the guards (each logged)."""
        self.metrics = EndpointMetrics(role=self.ROLE)
        """Rooms, bytes, phase times (``kvproto.metrics``)."""
        self._last_tick: float | None = None
        self._wakeup_fd: int | None = None
        self._last_encoded: tuple[Any, bytes] = (None, b"")
        """The last message ``_encode`` encoded, and its frame."""

    # --- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Any:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._closed:
            raise EndpointClosed()
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        compile_messages()  # the codec's per-type code, here rather than in the first room
        self.transport = load_transport(self.config.transport, self.agent_name, **self.config.transport_options)
        self._registration = self.transport.register(self.kv.memory_regions())
        self._ctx = zmq.asyncio.Context()
        self.metrics.core = self.core
        await self._start_io()
        self._wakeup_fd = wakeup_fd(self.transport)
        if self._wakeup_fd is not None:  # the adapter's "a tag arrived" signal wakes the progress task
            self._loop.add_reader(self._wakeup_fd, self._kick)
        self._spawn(self._progress_loop(), "progress")
        self._started = True

    async def close(self) -> None:
        """Fail live rooms (telling peers), let writes in flight end, fence the data plane, release
        everything. Idempotent. The order is the promise (see "Closing" above): a decode room
        reports FAILED only once nothing can land in its pages any more, and close() returns
        once every room has ended (within ``Timeouts.drain`` even if a peer never answers)."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        self.core.close(self._now())
        self._flush()
        await self._settle(grace=CLOSE_GRACE_S)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _done, stuck = await asyncio.wait(tasks, timeout=5.0)
            for task in stuck:  # a task that ignores its cancel must not hold close() forever
                log.error("%s task %s did not stop at close", self.ROLE, task.get_name())
        self._close_io()
        assert self.transport is not None
        if self._wakeup_fd is not None:
            self._loop.remove_reader(self._wakeup_fd)  # type: ignore[union-attr]
            self._wakeup_fd = None
        try:
            self.transport.close()  # deregisters the memory, removes the peers: the data plane is fenced
        finally:
            self._fenced()
            trace.dump(self.ROLE)
            assert self._ctx is not None
            self._ctx.destroy(linger=0)  # sockets closed above keep their own linger; nothing else may block

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        self._check_thread()
        if self._closed:
            raise EndpointClosed()
        if not self._started:
            raise LocalProtocolError("endpoint not started: use 'async with' or await start()")

    def _check_thread(self) -> None:
        """Every call comes from the event loop's thread (the cores, sockets and transport have
        one owner); a synchronous scheduler's thread uses ``kvproto.sync`` instead."""
        if self._thread is not None and threading.get_ident() != self._thread:
            raise LocalProtocolError(
                f"{type(self).__name__} called from a thread other than its event loop's: from a "
                f"synchronous scheduler use kvproto.sync (SyncPrefill / SyncDecode), which posts calls to the loop")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=f"kvproto-{self.ROLE}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s task %s died: %r", self.ROLE, task.get_name(), task.exception())

    def _staging_bytes(self) -> int:
        """This rank's staging buffer size (``EndpointConfig.staging_bytes``); 0 without tensors."""
        size = self.config.staging_bytes
        if not self.kv.tensors:
            return 0
        if size is None:
            from kvproto.aio.staging import state_room

            size = ((1 << 30) if self.kv.tensors[0].device.type == "cuda" else (64 << 20)) + state_room(self.kv)
        return size

    def _now(self) -> float:
        assert self._loop is not None
        clock = self.config.clock
        return clock() if clock is not None else self._loop.time()

    # --- outputs ------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Perform the core's outputs, in order, until it has none."""
        while True:
            outputs = self.core.pop_outputs()
            if not outputs:
                return
            for out in outputs:
                if isinstance(out, Send):
                    self._send(out.link, out.message)
                elif isinstance(out, RoomEnded):
                    self._room_ended(out)
                else:
                    self._perform(out)

    def _room_ended(self, out: RoomEnded) -> None:
        trace.mark("ended", out.room_id, int(out.state))
        handle = self._handles.pop(out.room_id, None)
        now = self._now()
        phases = room_phases(out.timeline)
        if handle is not None:
            handle._finish(out.state, out.code, out.reason, now, phases, out.nbytes)
            self.metrics.room_ended(now, out.state, out.code, out.timeline, out.nbytes, handle.stats.staging_s)
        if out.state is RoomState.FAILED:
            log.info("%s room %d failed: %s %s", self.ROLE, out.room_id, out.code, out.reason)

    def _staging_time(self, room_id: int, launched: float) -> None:
        handle = self._handles.get(room_id)
        if handle is not None:
            handle.stats.staging_s += self._now() - launched

    def _room_state(self, room_id: int) -> RoomState:
        state = self.core.room_state(room_id)
        if state is None:
            raise LocalProtocolError(f"room {room_id} is unknown", ErrorCode.UNKNOWN_ROOM)
        return state

    def _abort(self, room_id: int) -> None:
        self._check_thread()
        if self._closed:
            return
        self.core.abort(room_id, self._now())
        self._flush()

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
        """Run a handler; an unexpected exception is logged and counted, never propagated."""
        try:
            fn(*args)
        except Exception:
            self.errors += 1
            log.exception("%s: unexpected error while handling %s", self.ROLE, what)
        finally:
            try:
                self._flush()
            except Exception:
                self.errors += 1
                log.exception("%s: unexpected error while performing outputs", self.ROLE)

    def _send_frame(self, channel: Channel, frames: list[bytes]) -> None:
        faults = self.config.control_faults
        if faults is None:
            channel.send(frames)
            return
        assert self._loop is not None
        for delay, copy in faults.plan(frames):  # drop, duplicate, delay or reorder (tests only)
            if delay <= 0:
                channel.send(copy)
            else:
                self._loop.call_later(delay, channel.send, copy)

    def _channel(self, sock: zmq.asyncio.Socket, what: str, handler: Callable[..., None], *args: Any) -> Channel:
        """Serve ``sock`` from the loop's reader callbacks: ``handler(*args, frames)`` per message,
        inside the guard, the progress task woken after each."""

        def on_message(frames: list[bytes]) -> None:
            self._guard(what, handler, *args, frames)
            self._kick()

        assert self._loop is not None
        return Channel(sock, self._loop, on_message)

    def _encode(self, message: Message) -> bytes:
        """``message``'s frame. The core sends one message object to every link it concerns (a
        decode rank's request to each prefill rank of the room, an abort to each peer): the last
        object encoded is kept with its frame, so that the others send the same bytes unencoded."""
        last = self._last_encoded
        if last[0] is message:
            return last[1]
        frame = encode(message)
        self._last_encoded = (message, frame)
        return frame

    # --- progress -----------------------------------------------------------------------------
    async def _progress_loop(self) -> None:
        """Spin (yielding to the loop between passes) while the data plane is active or work this
        endpoint drives is in flight (``_busy``: writes to poll, copies to finish, staged writes
        or tags known to be on their way), but sleep once ``busy_spin_s`` passed without work where
        a thread waits for that work and wakes it (``_wait_in_thread``); otherwise back off (50 us
        doubling to ``idle_poll_s``), so a rank waiting for its peer's compute leaves the CPU to it.
        Every control message wakes it at once (``_kick``), so an ending announced on the control
        plane is acted on without back-off latency."""
        delay = 0.0
        quiet_from = 0.0
        while True:
            active = False
            try:
                began = time.perf_counter() if trace.ENABLED else 0.0
                active = self._progress_once()
                if trace.ENABLED and time.perf_counter() - began > 1e-4:
                    trace.mark("slow_pass_us", int((time.perf_counter() - began) * 1e6), len(getattr(self, "_pending", ())))
            except Exception:
                self.errors += 1
                log.exception("%s: unexpected error in progress", self.ROLE)
            self._flush()
            if active or self._busy():
                delay = 0.0
                if active or self._wake.is_set():  # work found, or new work since (a message, a post)
                    self._wake.clear()
                    quiet_from = time.perf_counter() + self.config.busy_spin_s
                if active or time.perf_counter() < quiet_from or not self._wait_in_thread():
                    await asyncio.sleep(0)
                    continue
                wait = self.config.idle_poll_s  # the waiting thread wakes the loop: this bounds a late one
            else:
                if self._transferring():
                    idle = self.config.transfer_poll_s
                elif self.core.rooms:
                    idle = self.config.idle_poll_s
                else:  # no room at all: wake for deadlines, heartbeats and control messages only
                    idle = min(self.config.heartbeat_interval / 4, 0.05)
                delay = min(idle, max(50e-6, delay * 2))
                wait = delay
            deadline = self.core.next_deadline()
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - self._now()))
            if 0.0 < wait < 1e-3:  # a pause is a millisecond at least, on every loop: asyncio's epoll
                wait = 1e-3  # rounds it up to one, uvloop rounded 0.2 ms down to 0 (a spin of a core)
            self._wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
            else:
                delay = 0.0

    def _stall(self, now: float) -> float:
        """Seconds this endpoint itself was stalled (or its clock jumped) since the last progress
        pass, beyond a heartbeat interval: peers are not blamed for silence during that time."""
        last, self._last_tick = self._last_tick, now
        gap = now - last if last is not None else 0.0
        return gap if gap > self.config.heartbeat_interval else 0.0

    def _kick(self) -> None:
        """Wake the progress task (new writes to poll, new deadlines)."""
        self._wake.set()

    # --- hooks ------------------------------------------------------------------------------------
    async def _start_io(self) -> None:
        raise NotImplementedError

    def _close_io(self) -> None:
        raise NotImplementedError

    def _send(self, link: Any, message: Message) -> None:
        raise NotImplementedError

    def _perform(self, output: Any) -> None:
        raise NotImplementedError

    def _progress_once(self) -> bool:
        """One pass of transport progress, timers and liveness; True if it saw data-plane
        activity (a notification, a finished write), so the next pass should come at once."""
        raise NotImplementedError

    def _busy(self) -> bool:
        """Work in flight that this endpoint must drive to completion (see ``_progress_loop``)."""
        return False

    def _wait_in_thread(self) -> bool:
        """Whether a thread now waits for this endpoint's work in flight and will wake the loop
        when it may have progressed (``kvproto.aio.ready``), so that the progress task may sleep
        instead of spinning; False: keep polling."""
        return False

    def _transferring(self) -> bool:
        """Rooms wait for bytes this endpoint cannot see coming (see ``transfer_poll_s``)."""
        return False

    async def _settle(self, grace: float) -> None:
        """At close, before the tasks stop: wait for what peers must still hear to go out and
        for writes in flight to end (prefill: up to ``grace`` for its writes and the ABORTs held
        behind them; decode: up to the drain deadline for its draining rooms, up to ``grace`` for
        the ends of rooms whose prefill links are still bootstrapping)."""

    def _fenced(self) -> None:
        """At close, once the transport is closed: end what waited for the data plane."""
