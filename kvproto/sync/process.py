"""The process face of the synchronous facade: the endpoint in a process of its own.

Theory of operation
-------------------
``kvproto.sync.SyncDecode`` (the thread face) runs the endpoint on a thread of the engine's process. Both threads
then share one interpreter lock: while rooms move, the endpoint's Python (protocol, NIXL calls,
garbage) takes the lock from the engine's scheduler thread, and an engine whose step is Python
launching kernels feels it in every step (``kvproto bench sync``'s engine loop: +5 ms at p50 and
+10 to +20 ms at p99 on a 23 ms step with 512 rooms in flight, on an H100 host). ``ProcessDecode``
(and ``ProcessPrefill`` for ``SyncPrefill``) has the same calls and handles, and runs the
endpoint in a child process instead, so that the engine's thread never waits for the endpoint's
work. One mechanism joins the two processes:

* **calls go down a pipe.** ``receiver``/``sender``, ``init``, ``send`` and ``abort`` append one
  small tuple to a batch and return; the batch goes down the pipe to the child as one message at
  the engine's next ``poll`` or ``get_finished`` (every step makes one; a system call per step,
  not per call), once it holds 64 calls, or 0.5 ms after its first call whatever the engine does
  (a helper thread, which looks every 0.5 ms while calls keep coming and sleeps once they stop
  for 50 ms: waking a sleeping thread costs the caller 5-50 us, so a call wakes it only after such
  a pause, never step after step). A call never waits for the child either: the pipe is
  non-blocking, and what it cannot take now (a child behind by a pipe's worth of calls) waits in
  order in the engine's process, written by the helper thread as the child reads. The child's
  main thread reads the calls in order and
  makes the same calls on a ``SyncDecode``/``SyncPrefill`` of its own (refusals behave exactly as
  there). A layer's ``ready`` event crosses as a CUDA IPC event handle
  (``torch.cuda.Event(interprocess=True)``);
* **room events come up a pipe, raw.** The child writes every state a room enters and every
  end (room id, state, code) as 17-byte records, never blocking (what the pipe cannot take now
  waits in the child until it can), and counts the bytes in a shared counter. The engine reads
  the counter (no system call) and drains the pipe only when it moved, inside ``poll`` and
  ``get_finished``. Why a room failed travels beside, as text up a third pipe, written the
  same way (never blocking: an engine that never asks why must not stall the child) and read
  with the events, kept for ``failure_exception`` (the newest 65536);
* **the cache is shared, not copied.** The child builds its ``KVCache`` from the engine's own
  tensors, passed through ``torch.multiprocessing``: CUDA tensors arrive as CUDA IPC mappings of
  the same memory; CPU tensors are moved into shared memory first (their storage is replaced in
  place, contents kept: the engine's tensors keep working, at a new address). A hybrid model's
  cache crosses the same way, group by group (``_recipe``: each group's tensors and the
  arguments of its ``from_tensors``), and is joined again in the child (``with_groups``).

What the facade promises holds unchanged: calls never block, ``get_finished()`` lists each room
once, and FAILED means no write can land, because the child's endpoint reports it. If the child
dies, every live room is reported FAILED (``INTERNAL_ERROR``), but only ``Timeouts.drain`` after
the death is seen: by then the prefill ranks have dropped the link (heartbeat silence) and
stopped writing into the shared memory, which outlives the child.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

from kvproto.aio import EndpointConfig, KVCache, StateCache, TransferFailed
from kvproto.core import RoomState
from kvproto.sync.calls import FinishedRooms, group_lists, slot_dict
from kvproto.wire import ErrorCode, LocalProtocolError

_FRAME = struct.Struct("!i")
"""A message's length ahead of its pickle, as ``multiprocessing.Connection`` frames it (the child
reads calls with ``Connection.recv``)."""
_REASON = struct.Struct("<QBI")
"""Why a room failed, ahead of its end event: room id, kind (index in ``_KINDS``), text length;
the text (UTF-8) follows."""
_KINDS = ("TransferFailed", "LocalProtocolError")
_REASONS_KEPT = 1 << 16
"""Failure reasons the engine's process keeps for ``failure_exception`` (the newest)."""
_EVENT = struct.Struct("<QBq")
"""One room event: room id, state (``RoomState``), code (-1: none)."""
_NO_CODE = -1
_FAILED, _SUCCESS = RoomState.FAILED, RoomState.SUCCESS
_STATES = tuple(sorted(RoomState, key=int))
"""``RoomState`` by value (their values are 0..4)."""
_BATCH = 64
_LINGER_S = 0.0005
"""Calls wait in the engine's process until its next ``poll``/``get_finished`` (every step makes
one), until ``_BATCH`` are pending, or ``_LINGER_S`` at most, then go down the pipe as one message."""
_AWAKE_S = 0.05
"""The helper thread looks for waiting calls every ``_LINGER_S`` for this long after the last
call, then sleeps until a call wakes it: an engine that makes calls every step never wakes it."""


def _code(value: int) -> ErrorCode | int | None:
    if value == _NO_CODE:
        return None
    try:
        return ErrorCode(value)
    except ValueError:
        return value


class _ProcessRoom:
    """What both handles share: the state the child reported, and the calls every room has."""

    def __init__(self, facade: _ProcessFacade, room_id: int) -> None:
        self._facade = facade
        self.room_id = room_id
        self._state = RoomState.BOOTSTRAPPING
        self._code: ErrorCode | int | None = None

    def poll(self) -> RoomState:
        """The room's state, without waiting (one shared-counter read when nothing changed: an
        engine polls every live room every step, so this path is kept to a few attribute reads)."""
        state = self._state
        if state is _FAILED or state is _SUCCESS:
            return state
        facade = self._facade
        if facade._pending or facade._written.value != facade._read or \
                time.monotonic() >= facade._next_alive_check:
            facade._drain()
        return self._state

    def failure_exception(self) -> None:
        """Raise why the room failed (``TransferFailed``, or the ``LocalProtocolError`` that
        refused a call); return if it has not failed (yet)."""
        if self.poll() is RoomState.FAILED:
            raise self._facade._why(self.room_id, self._code)

    @property
    def code(self) -> ErrorCode | int | None:
        return self._code

    def abort(self) -> None:
        """Stop the room and tell the peer (posted; idempotent)."""
        self._facade._call(("abort", self.room_id))


class ProcessReceiver(_ProcessRoom):
    """A decode room, shaped like SGLang's ``KVReceiver`` (as ``kvproto.sync.KVReceiver``)."""

    def init(self, pages: Sequence[int], num_tokens: int, *, prefix_tokens: int = 0,
             aux_slot: int | None = None, group_pages: Mapping[str, Sequence[int]] | None = None,
             state_slots: Mapping[str, int] | None = None) -> None:
        """Where the room's KV goes (see ``ReceiverRoomHandle.set_destination``); a hybrid cache's
        ``group_pages`` and ``state_slots`` as for ``kvproto.sync.KVReceiver.init``."""
        self._facade._call(("init", self.room_id, list(pages), num_tokens, prefix_tokens, aux_slot,
                            group_lists(group_pages), slot_dict(state_slots)))


class ProcessSender(_ProcessRoom):
    """A prefill room, shaped like SGLang's ``KVSender`` (as ``kvproto.sync.KVSender``)."""

    def init(self, num_tokens: int, aux_slot: int | None = None, *,
             state_slots: Mapping[str, int] | None = None) -> None:
        self._facade._call(("init", self.room_id, num_tokens, aux_slot, slot_dict(state_slots)))

    def send(self, pages: Sequence[int], end_token: int | None = None, *, layers: range | None = None,
             ready: Any = None, group_pages: Mapping[str, Sequence[int]] | None = None) -> None:
        """As ``kvproto.sync.KVSender.send``. ``ready`` must be a CUDA event made with
        ``torch.cuda.Event(interprocess=True)``: the endpoint's process opens it by its IPC handle."""
        event = None
        if ready is not None:
            try:
                event = (ready.device.index if ready.device.index is not None else 0, bytes(ready.ipc_handle()))
            except (RuntimeError, AttributeError) as exc:
                raise LocalProtocolError(f"ready must be torch.cuda.Event(interprocess=True) with the endpoint in "
                                         f"another process ({exc})") from None
        span = None if layers is None else (layers.start, layers.stop)
        self._facade._call(("send", self.room_id, list(pages), end_token, span, event, group_lists(group_pages)))


class _ProcessFacade(FinishedRooms):
    """A rank's endpoint in a child process, driven from the engine's threads (see above).
    ``kv`` must come from ``KVCache.from_tensors``: the child rebuilds it from those tensors."""

    ROLE = ""

    def __init__(self, kv: KVCache, *, config: EndpointConfig | None = None, bootstrap: str | None = None,
                 loop_factory: Any = None, start_timeout: float = 120.0) -> None:
        """``loop_factory`` makes the child's event loop (e.g. ``uvloop.new_event_loop``; picklable)."""
        import torch.multiprocessing as tmp

        recipe = [_recipe(kv, f"Process{self.ROLE.title()}")]
        recipe += [_recipe(group, f"Process{self.ROLE.title()}") for group in kv.groups]
        self.config = config or EndpointConfig()
        ctx = tmp.get_context("spawn")
        calls_r, self._calls = ctx.Pipe(duplex=False)
        self._events, events_w = ctx.Pipe(duplex=False)
        self._reasons, reasons_w = ctx.Pipe(duplex=False)
        ready_r, ready_w = ctx.Pipe(duplex=False)
        self._written = ctx.RawValue("Q", 0)
        self._expired = ctx.RawValue("Q", 0)
        """The child core's ``rooms_expired``, set before each room end is written up the pipe."""
        self._read = 0
        self._buffer = b""
        self._proc = ctx.Process(target=_child, name=f"kvproto-{self.ROLE}",
                                 args=(self.ROLE, recipe, self.config, bootstrap, loop_factory, calls_r,
                                       events_w, reasons_w, ready_w, self._written, self._expired), daemon=True)
        self._proc.start()
        for end in (calls_r, events_w, reasons_w, ready_w):
            end.close()
        if not ready_r.poll(start_timeout):
            self._proc.kill()
            raise LocalProtocolError(f"the {self.ROLE} endpoint's process did not start in time")
        status = ready_r.recv()
        if not isinstance(status, tuple):
            self._proc.join(5)
            raise LocalProtocolError(f"the {self.ROLE} endpoint's process failed to start: {status}")
        self.address, self.bootstrap_address = status
        self._rooms: dict[int, _ProcessRoom] = {}
        self._finished: collections.deque[tuple[int, RoomState, Any]] = collections.deque()
        self._why_text: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
        self._reason_fd = self._reasons.fileno()
        os.set_blocking(self._reason_fd, False)
        self._reason_buffer = b""
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, ...]] = []
        self._send_lock = threading.Lock()
        self._calls_fd = self._calls.fileno()
        os.set_blocking(self._calls_fd, False)
        self._out = bytearray()
        """Framed call batches the pipe could not take yet (``Connection.recv``'s framing)."""
        self._broken = False
        self._kick = threading.Event()
        self._parked = True
        """The helper thread sleeps on ``_kick`` (else it looks for waiting calls by itself)."""
        self._called = 0
        self._closed = False
        self._dead_since: float | None = None
        self._next_alive_check = 0.0
        threading.Thread(target=self._flush_later, name=f"kvproto-{self.ROLE}-calls", daemon=True).start()

    # --- the engine's calls ---------------------------------------------------------------------
    def _open(self, room: _ProcessRoom, message: tuple[Any, ...]) -> None:
        with self._lock:
            if room.room_id in self._rooms:  # refused here, as the endpoint would: the live room goes on
                room._state, room._code = RoomState.FAILED, ErrorCode.DUPLICATE_ROOM
                self._why_text[room.room_id] = ("LocalProtocolError", f"room {room.room_id} is already live")
                self._finished.append((room.room_id, RoomState.FAILED, ErrorCode.DUPLICATE_ROOM))
                return
            self._rooms[room.room_id] = room
        self._call(message)

    def get_finished(self) -> list[tuple[int, RoomState, ErrorCode | int | None]]:
        """(room id, final state, code) of every room that ended since the last call, in order."""
        self._drain()
        return self._take_finished()

    def close(self, timeout: float = 60.0) -> None:
        """Close the endpoint (live rooms fail ENDPOINT_CLOSED after their drain) and its process.
        Blocks until done; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._kick.set()
        with self._send_lock:  # the helper thread may be taking the batch right now
            self._pending.append(("close",))
        deadline = time.monotonic() + timeout
        self._flush()
        while self._out and not self._broken and time.monotonic() < deadline and self._proc.is_alive():
            select.select([], [self._calls_fd], [], 0.05)
            self._flush()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._drain(final=True)
        if self._rooms:  # the child died with rooms live: they fail once writes can no longer land
            if self._dead_since is None:
                self._dead_since = time.monotonic()
            time.sleep(max(0.0, self._dead_since + self.config.timeouts.drain - time.monotonic()))
            self._fail_live()

    def child_cpu_seconds(self) -> float:
        """CPU seconds the endpoint's process has used (Linux ``/proc``; 0.0 where unavailable)."""
        try:
            with open(f"/proc/{self._proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0

    # --- plumbing -----------------------------------------------------------------------------------
    def _call(self, message: tuple[Any, ...]) -> None:
        if self._closed:
            raise LocalProtocolError("the endpoint is closed", ErrorCode.ENDPOINT_CLOSED)
        with self._send_lock:
            self._pending.append(message)
            self._called += 1
            first, full = len(self._pending) == 1, len(self._pending) >= _BATCH
        if full:
            self._flush()
        elif first and self._parked:
            self._parked = False
            self._kick.set()  # nothing may wait longer than _LINGER_S, whatever the engine does next

    def _flush(self) -> None:
        """Send the calls made since the last flush as one message, without waiting: the bytes the
        pipe cannot take now wait in ``_out`` (in order, ahead of any later batch) and the helper
        thread writes them once the child has read enough."""
        with self._send_lock:
            if self._pending:
                batch, self._pending = self._pending, []
                data = ForkingPickler.dumps(batch)
                self._out += _FRAME.pack(len(data))
                self._out += data
            if self._out and not self._broken:
                self._write_some()
            stuck = bool(self._out) and not self._broken
        if stuck and self._parked:
            self._parked = False
            self._kick.set()

    def _write_some(self) -> None:
        """Write what the calls pipe takes now (``_send_lock`` held); never waits."""
        try:
            while self._out:
                n = os.write(self._calls_fd, self._out)
                del self._out[:n]
        except BlockingIOError:
            pass
        except OSError:  # the child has died: its rooms fail through _drain
            self._broken = True
            self._out.clear()

    def _flush_later(self) -> None:
        """A thread that sends the calls the engine left waiting for ``_LINGER_S``: it looks every
        ``_LINGER_S`` until no call came for ``_AWAKE_S``, then sleeps until a call wakes it."""
        while not self._closed:
            self._kick.wait()
            self._kick.clear()
            quiet, seen = 0.0, -1
            while not self._closed and (quiet < _AWAKE_S or self._out):
                if self._out:  # the pipe was full: wait (up to _LINGER_S) until the child reads
                    select.select([], [self._calls_fd], [], _LINGER_S)
                else:
                    time.sleep(_LINGER_S)
                if self._pending or self._out:
                    self._flush()
                quiet = 0.0 if self._called != seen else quiet + _LINGER_S
                seen = self._called
            self._parked = True
            if self._pending or self._out:  # a call came as it parked, and saw it awake: look once more
                self._parked = False
                self._kick.set()

    def _drain(self, final: bool = False) -> None:
        """Send the calls waiting, then apply the room events the child wrote since the last drain
        (cheap when none)."""
        if self._pending:
            self._flush()
        if self._written.value != self._read or final:
            with self._lock:
                self._read_events(final)
        if not final and not self._closed:
            self._check_alive()

    def _read_events(self, final: bool) -> None:
        fd = self._events.fileno()
        want = self._written.value
        os.set_blocking(fd, False)
        while self._read < want or final:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EPIPE):
                    break
                raise
            if not chunk:
                break
            self._read += len(chunk)
            self._buffer += chunk
        self._read_reasons()  # a room's reason is written before its end: read it with the end
        usable = len(self._buffer) - len(self._buffer) % _EVENT.size
        for room_id, value, code in _EVENT.iter_unpack(self._buffer[:usable]):
            self._event(room_id, _STATES[value], _code(code))
        self._buffer = self._buffer[usable:]

    def _read_reasons(self) -> None:
        """Read the failure reasons the child wrote (never waits; ``_lock`` held)."""
        while True:
            try:
                chunk = os.read(self._reason_fd, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._reason_buffer += chunk
        buf, at = self._reason_buffer, 0
        while len(buf) - at >= _REASON.size:
            room_id, kind, size = _REASON.unpack_from(buf, at)
            if len(buf) - at - _REASON.size < size:
                break
            text = buf[at + _REASON.size:at + _REASON.size + size].decode("utf-8", "replace")
            at += _REASON.size + size
            self._why_text[room_id] = (_KINDS[kind], text)
            if len(self._why_text) > _REASONS_KEPT:
                self._why_text.popitem(last=False)
        self._reason_buffer = buf[at:]

    def _event(self, room_id: int, state: RoomState, code: ErrorCode | int | None) -> None:
        """Apply one room event (a drain may bring hundreds: kept to a few operations)."""
        if state is _FAILED or state is _SUCCESS:
            self._finished.append((room_id, state, code))
            room = self._rooms.pop(room_id, None)
            if room is not None:
                room._code, room._state = code, state
        else:
            room = self._rooms.get(room_id)
            if room is not None:
                room._state = state

    def _check_alive(self) -> None:
        now = time.monotonic()
        if now < self._next_alive_check:
            return
        self._next_alive_check = now + 0.01
        if self._proc.is_alive():
            return
        if self._dead_since is None:
            self._dead_since = now
        if now - self._dead_since < self.config.timeouts.drain:
            return
        self._fail_live()

    def _fail_live(self) -> None:
        with self._lock:
            self._read_events(final=True)
            for room_id in list(self._rooms):
                self._why_text[room_id] = ("TransferFailed", f"the {self.ROLE} endpoint's process died")
                self._event(room_id, RoomState.FAILED, ErrorCode.INTERNAL_ERROR)

    def _why(self, room_id: int, code: ErrorCode | int | None) -> BaseException:  # noqa: D401
        with self._lock:
            self._read_reasons()
        kind, text = self._why_text.get(room_id, ("TransferFailed", ""))
        if kind == "LocalProtocolError":
            return LocalProtocolError(text, code if isinstance(code, ErrorCode) else ErrorCode.INTERNAL_ERROR)
        return TransferFailed(room_id, code, text)


def _recipe(group: KVCache | StateCache, who: str) -> tuple[str, Any, dict[str, Any]]:
    """What the child needs to build ``group`` again over the same memory: its kind, the tensors
    its ``from_tensors`` was given, and that call's other arguments."""
    if isinstance(group, StateCache):
        if not group.owner:
            raise LocalProtocolError(f"{who} needs state group {group.name!r} built by StateCache.from_tensors (its "
                                     f"tensors are shared with the endpoint's process)")
        tensors = group.group.tensors
        return "state", group.owner, dict(name=group.name, shard_dims=[t.shard_dim for t in tensors],
                                          sections=[t.sections or None for t in tensors], tp_size=group.tp_size,
                                          tp_rank=group.tp_rank, model_layers=group.layers)
    planes, aux = group.owner if isinstance(group.owner, tuple) and len(group.owner) == 2 else (None, None)
    if planes is None:
        raise LocalProtocolError(f"{who} needs a cache built by KVCache.from_tensors (its tensors are shared with "
                                 f"the endpoint's process)")
    g = group.geometry
    return "paged", planes, dict(aux=aux, tp_size=g.tp_size, tp_rank=g.tp_rank,
                                 num_kv_heads=None if g.mla else g.num_kv_heads, layout=g.layout, mla=g.mla,
                                 kv_fused=g.kv_fused, name=group.name, window=group.window, model_layers=group.layers)


def _rebuild(recipe: Sequence[tuple[str, Any, dict[str, Any]]]) -> KVCache:
    """The cache ``_recipe`` described, group by group, in the endpoint's process."""
    built: list[Any] = []
    for kind, tensors, kwargs in recipe:
        if kind == "state":
            kwargs = dict(kwargs)
            built.append(StateCache.from_tensors(kwargs.pop("name"), tensors, **kwargs))
        else:
            built.append(KVCache.from_tensors(tensors, **kwargs))
    first, *groups = built
    return first.with_groups(*groups) if groups else first


class ProcessDecode(_ProcessFacade):
    """A decode rank for a synchronous scheduler, its endpoint in a child process."""

    ROLE = "decode"

    def __init__(self, kv: KVCache, *, config: EndpointConfig | None = None, loop_factory: Any = None,
                 start_timeout: float = 120.0) -> None:
        super().__init__(kv, config=config, loop_factory=loop_factory, start_timeout=start_timeout)

    def connect(self, bootstrap: str) -> None:
        """Start linking to the prefill instance at ``bootstrap`` ahead of its first room (as
        ``DecodeEndpoint.connect``); returns at once. A failure is logged by the child and
        fails the rooms that were waiting for it; a later room links again."""
        self._call(("connect", bootstrap))

    def receiver(self, room_id: int, bootstrap: str, *, pages: Sequence[int] | None = None,
                 num_tokens: int | None = None, prefix_tokens: int = 0, aux_slot: int | None = None,
                 group_pages: Mapping[str, Sequence[int]] | None = None,
                 state_slots: Mapping[str, int] | None = None) -> ProcessReceiver:
        """Open the decode side of ``room_id`` (as ``SyncDecode.receiver``); returns at once."""
        room = ProcessReceiver(self, room_id)
        self._open(room, ("open", room_id, bootstrap, None if pages is None else list(pages), num_tokens,
                          prefix_tokens, aux_slot, group_lists(group_pages), slot_dict(state_slots)))
        return room


class ProcessPrefill(_ProcessFacade):
    """A prefill rank for a synchronous scheduler, its endpoint in a child process
    (``bootstrap``: prefill rank 0's address, for the other ranks)."""

    ROLE = "prefill"

    @property
    def rooms_expired(self) -> int:
        """Rooms whose lease ran out (as ``SyncPrefill.rooms_expired``), as of the last room end
        the child reported; a shared counter's read, never waits."""
        return int(self._expired.value)

    def sender(self, room_id: int) -> ProcessSender:
        """Open the prefill side of ``room_id`` (as ``SyncPrefill.sender``); returns at once."""
        room = ProcessSender(self, room_id)
        self._open(room, ("open", room_id))
        return room


# --- the child --------------------------------------------------------------------------------------
class _Sink:
    """The child's ended-room queue: every end the facade records is written up the events pipe
    (and why a room failed, up the reasons pipe, first). An open refused on the endpoint's loop may
    end before ``_perform`` holds the room's handle: that end waits for it (``opened``)."""

    def __init__(self, writer: _Writer, rooms: dict[int, Any], reasons: _Writer, stats: Any = None,
                 expired: Any = None) -> None:
        self.writer, self.rooms, self.reasons = writer, rooms, reasons
        self.stats, self.expired = stats, expired
        """The core's counters and the shared value its ``rooms_expired`` is copied to per end."""
        self.lock = threading.Lock()
        self.opening: set[int] = set()
        self.early: dict[int, tuple[int, RoomState, Any]] = {}

    def append(self, item: tuple[int, RoomState, Any]) -> None:
        with self.lock:
            if item[0] in self.opening:
                self.early[item[0]] = item
                return
            self._emit(item)

    def opened(self, room_id: int, room: Any) -> None:
        """``_perform`` holds the handle of ``room_id``: its end, if it came first, goes up now."""
        with self.lock:
            self.opening.discard(room_id)
            self.rooms[room_id] = room
            early = self.early.pop(room_id, None)
            if early is not None:
                self._emit(early)

    def _emit(self, item: tuple[int, RoomState, Any]) -> None:
        room_id, state, code = item
        if state is RoomState.FAILED:
            room = self.rooms.get(room_id)
            try:
                if room is not None:
                    room.failure_exception()
                why: tuple[str, str] = ("TransferFailed", "")
            except LocalProtocolError as exc:
                why = ("LocalProtocolError", str(exc))
            except TransferFailed as exc:
                why = ("TransferFailed", exc.reason)
            text = why[1].encode("utf-8")
            self.reasons.write_bytes(_REASON.pack(room_id, _KINDS.index(why[0]), len(text)) + text)
        self.rooms.pop(room_id, None)
        if self.expired is not None:
            self.expired.value = self.stats.rooms_expired
        self.writer.write(room_id, state, code)

    def __bool__(self) -> bool:
        return False  # nobody drains it in the child: get_finished() is the engine's, in the parent


class _Writer:
    """Writes records up a pipe (room events; failure reasons) without ever blocking the endpoint's
    loop: what the pipe cannot take now waits here, and the loop writes it once the pipe drains.
    ``written`` (if given) counts the bytes written, for the engine's cheap look."""

    def __init__(self, conn: Any, written: Any, loop: Any) -> None:
        self.fd = conn.fileno()
        self.conn = conn  # keeps the descriptor open
        os.set_blocking(self.fd, False)
        self.written = written
        self.pending = bytearray()
        self.loop = loop
        self.watching = False
        self.lock = threading.Lock()

    def write(self, room_id: int, state: RoomState, code: Any) -> None:
        value = _NO_CODE if code is None else int(code)
        self.write_bytes(_EVENT.pack(room_id, int(state), value))

    def write_bytes(self, data: bytes) -> None:
        with self.lock:
            self.pending += data
            self._flush()

    def _flush(self) -> None:
        while self.pending:
            try:
                n = os.write(self.fd, self.pending)
            except BlockingIOError:
                n = 0
            except OSError:
                self.pending.clear()  # the engine has gone
                return
            if n == 0:
                if not self.watching:  # the pipe is full: write the rest once it drains
                    self.watching = True
                    self.loop.call_soon_threadsafe(self.loop.add_writer, self.fd, self._writable)
                return
            del self.pending[:n]
            if self.written is not None:
                self.written.value += n

    def _writable(self) -> None:
        with self.lock:
            self._flush()
            if not self.pending and self.watching:
                self.watching = False
                self.loop.remove_writer(self.fd)


def _child(role: str, recipe: Any, config: EndpointConfig, bootstrap: str | None, loop_factory: Any, calls: Any,
           events: Any, reasons: Any, ready: Any, written: Any, expired: Any) -> None:
    from kvproto.sync import EngineLoop, SyncDecode, SyncPrefill

    try:
        kv = _rebuild(recipe)
        loop = EngineLoop(loop_factory=loop_factory)
        facade: Any = (SyncPrefill(kv, bootstrap=bootstrap, config=config, loop=loop) if role == "prefill"
                       else SyncDecode(kv, config=config, loop=loop))
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
        ready.send(f"{type(exc).__name__}: {exc}")
        return
    rooms: dict[int, Any] = {}
    writer = _Writer(events, written, facade.loop.loop)
    core = facade._endpoint.core
    sink = facade._finished = _Sink(writer, rooms, _Writer(reasons, None, facade.loop.loop), core.stats, expired)

    def entered(room_id: int, state: RoomState) -> None:
        writer.write(room_id, state, None)

    facade.loop.run(_set_hook(core, entered))
    ready.send((getattr(facade, "address", None), getattr(facade, "bootstrap_address", None)))
    try:
        while True:
            try:
                batch = calls.recv()
            except (EOFError, OSError):
                break  # the engine has gone: close
            if not _perform(role, facade, rooms, batch, sink):
                break
    finally:
        facade.close()
        loop.close()


def _perform(role: str, facade: Any, rooms: dict[int, Any], batch: list[tuple[Any, ...]], sink: _Sink) -> bool:
    """Make the engine's calls of one batch, in order; False once told to close."""
    for message in batch:
        kind = message[0]
        if kind == "close":
            return False
        if kind == "connect":
            facade.connect(message[1], wait=False)
            continue
        room = rooms.get(message[1])
        if kind == "open":
            room_id = message[1]
            with sink.lock:
                sink.opening.add(room_id)
            if role == "decode":
                _, _, peer, pages, num_tokens, prefix, aux_slot, groups, slots = message
                opened = facade.receiver(room_id, peer, pages=pages, num_tokens=num_tokens, prefix_tokens=prefix,
                                         aux_slot=aux_slot, group_pages=groups, state_slots=slots)
            else:
                opened = facade.sender(room_id)
            sink.opened(room_id, opened)
        elif room is None:
            continue  # the room has ended (or was refused): later calls are moot
        elif kind == "abort":
            room.abort()
        elif kind == "init" and role == "decode":
            _, _, pages, num_tokens, prefix, aux_slot, groups, slots = message
            room.init(pages, num_tokens, prefix_tokens=prefix, aux_slot=aux_slot, group_pages=groups,
                      state_slots=slots)
        elif kind == "init":
            _, _, num_tokens, aux_slot, slots = message
            room.init(num_tokens, aux_slot, state_slots=slots)
        elif kind == "send":
            _, _, pages, end_token, span, event, groups = message
            ready_event = None
            if event is not None:
                import torch

                ready_event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", event[0]), event[1])
            room.send(pages, end_token, layers=None if span is None else range(*span), ready=ready_event,
                      group_pages=groups)
    return True


async def _set_hook(core: Any, entered: Any) -> None:
    core.on_state = entered


__all__ = ["ProcessDecode", "ProcessPrefill", "ProcessReceiver", "ProcessSender"]
