"""The thread face of the synchronous facade: the endpoint on an event loop in a thread of the engine.

Theory of operation
-------------------
A serving engine's scheduler is a synchronous loop that calls its KV-transfer layer every step
and must never block. kvproto's endpoints live on an asyncio event loop, and their calls are
only allowed on that loop's thread. This module joins the two with one mechanism:

* an ``EngineLoop`` owns one event loop in a daemon thread (one per process is enough; several
  endpoints share it) and starts and closes endpoints on it (those calls block, once);
* every call of the engine's threads (open a room, give a chunk or the destination, abort) is
  *posted* to that loop with ``call_soon_threadsafe`` and returns at once: it never waits for
  the loop, the network or the peer. A call the endpoint refuses (a page listed twice, a live
  room id) does not raise in the engine thread, which has moved on: the room reports FAILED
  and ``failure_exception()`` raises the ``LocalProtocolError`` with its code;
* ``poll()`` answers from what the room's handle holds, without a round trip: BOOTSTRAPPING
  until the loop has opened the room, then the state the endpoint's core keeps for it (a
  dictionary read, atomic under the GIL), then the final state;
* each endpoint keeps a queue of ended rooms that ``get_finished()`` drains, for engines that
  learn of finished transfers once per step (vLLM's ``get_finished``).

Calls from one engine thread are performed in the order they were made. The handles'
``init``/``send``/``poll``/``failure_exception`` mirror SGLang's ``KVSender`` and
``KVReceiver``; ``examples/README.md`` maps every engine call to kvproto's.

The endpoint's thread shares the interpreter lock with the engine's: an engine whose step is
Python (launching kernels) waits for it while rooms move. ``kvproto.sync.process`` has the same
facade with the endpoint in a child process, for engines that cannot afford that; the calls both
faces share are in ``kvproto.sync.calls``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kvproto.aio import DecodeEndpoint, EndpointConfig, KVCache, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState
from kvproto.sync.calls import KVPoll, FinishedRooms, group_lists, slot_dict
from kvproto.wire import ErrorCode, LocalProtocolError

log = logging.getLogger("kvproto.sync")

__all__ = ["EngineLoop", "KVPoll", "KVReceiver", "KVSender", "SyncDecode", "SyncPrefill"]


class EngineLoop:
    """One asyncio event loop in a daemon thread, hosting endpoints for synchronous callers."""

    def __init__(self, *, name: str = "kvproto-loop", loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
                 switch_interval: float | None = 2e-4):
        """``loop_factory`` makes the loop (e.g. ``uvloop.new_event_loop``). ``switch_interval``
        lowers Python's thread switch interval to at most this many seconds (None: leave it):
        with the default 5 ms, an engine thread's call can wait that long for the interpreter
        lock while the loop thread works, which no scheduler step can afford."""
        if switch_interval is not None and sys.getswitchinterval() > switch_interval:
            sys.setswitchinterval(switch_interval)
        self._loop = (loop_factory or asyncio.new_event_loop)()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, soon; returns at once."""
        if self._closed:
            raise LocalProtocolError("the engine loop is closed", ErrorCode.ENDPOINT_CLOSED)
        self._loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Any, timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the loop and wait for its result (start and close only)."""
        if threading.current_thread() is self._thread:
            raise LocalProtocolError("EngineLoop.run() from the loop's own thread would deadlock")
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def close(self) -> None:
        """Stop the loop and join its thread (close the endpoints first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


class _Room:
    """What the facade's handles share: the async handle once the loop opened the room, or the
    error that refused it."""

    def __init__(self, facade: _Facade, room_id: int) -> None:
        self._facade = facade
        self.room_id = room_id
        self._handle: Any = None
        self._error: BaseException | None = None

    def poll(self) -> RoomState:
        """The room's state, without waiting (SGLang's ``KVPoll`` values). A room whose call was
        refused reports FAILED once the room has ended: it may drain first, like any failure, so
        that FAILED still means no write can land in its pages."""
        handle = self._handle
        if self._error is not None and (handle is None or handle._final is not None):
            return RoomState.FAILED  # refused at open (it never existed), or refused and ended
        if handle is None:
            return RoomState.BOOTSTRAPPING  # the loop has not opened the room yet
        final = handle._final
        if final is not None:
            return final
        state = self._facade._endpoint.core.room_state(self.room_id)
        if state is None or state.terminal:
            # Ended in the core, not yet reported to the handle (with its code): a moment later.
            return handle._final or RoomState.TRANSFERRING
        return state

    def failure_exception(self) -> None:
        """Raise why the room failed (``TransferFailed`` with its code, or the
        ``LocalProtocolError`` that refused a call); return if it has not failed (yet: see ``poll``)."""
        handle = self._handle
        if self._error is not None and (handle is None or handle._final is not None):
            raise self._error
        if handle is not None and handle._final is RoomState.FAILED:
            raise TransferFailed(self.room_id, handle.code, handle.reason)

    @property
    def stats(self) -> Any:
        """What the room moved (``kvproto.aio.RoomStats``: bytes, writes, phase seconds), final once
        ``get_finished()`` has listed the room; None before the loop opened it or if it was refused."""
        handle = self._handle
        return None if handle is None else handle.stats

    @property
    def code(self) -> ErrorCode | int | None:
        if isinstance(self._error, LocalProtocolError):
            return self._error.code
        return None if self._handle is None else self._handle.code

    def abort(self) -> None:
        """Stop the room and tell the peer (posted; idempotent)."""
        self._facade._post(self._do, lambda: self._handle.abort())

    # --- on the loop ---------------------------------------------------------------------------
    def _do(self, call: Callable[[], None]) -> None:
        if self._error is not None:
            return  # refused earlier: later calls of this room are moot
        if self._handle is None:  # pragma: no cover - the open is posted before any other call
            self._error = LocalProtocolError(f"room {self.room_id} was not opened")
            return
        try:
            call()
        except LocalProtocolError as exc:
            self._fail(exc)

    def _fail(self, exc: LocalProtocolError) -> None:
        self._error = exc
        if self._handle is not None and not self._handle.done:
            self._handle.abort()  # the engine has moved on: nothing may be left half-done
        else:
            self._facade._finished.append((self.room_id, RoomState.FAILED, exc.code))


class KVSender(_Room):
    """A prefill room, shaped like SGLang's ``KVSender``: ``init`` then ``send`` per chunk."""

    def __init__(self, facade: SyncPrefill, room_id: int) -> None:
        super().__init__(facade, room_id)
        self._num_tokens: int | None = None
        self._aux_slot: int | None = None
        self._pages_given = 0
        self._block = facade._endpoint.kv.geometry.block_size
        self._num_layers = facade._endpoint.core.num_layers  # the model's layers (every group's)
        self._state_slots: dict[str, int] | None = None
        self._slots_sent = False
        self._start_token = 0
        self._start_token_sent = False

    def init(self, num_tokens: int, aux_slot: int | None = None, *, state_slots: Mapping[str, int] | None = None,
             start_token: int = 0) -> None:
        """The room's prompt length in tokens, this rank's aux slot to copy with the last chunk, and
        (a hybrid cache) its slot of each state group, sent with the first last chunk.

        ``start_token`` (whole blocks): the chunks' pages start there; the tokens before it are the
        decode's prefix (``decode_prefix``), neither sent nor named. An engine that knows a room by
        its page count gives ``num_tokens = start_token + pages * block_size``."""
        self._num_tokens, self._aux_slot = num_tokens, aux_slot
        self._state_slots = slot_dict(state_slots)
        self._start_token = start_token

    @property
    def decode_prefix(self) -> int | None:
        """Tokens the decode holds already (``SenderRoomHandle.decode_prefix``): known once the room
        is WAITING_FOR_INPUT, None before (read without waiting, like ``poll``)."""
        handle = self._handle
        return None if handle is None else handle.decode_prefix

    def send(self, pages: Sequence[int], end_token: int | None = None, *, layers: range | None = None,
             ready: Any = None, group_pages: Mapping[str, Sequence[int]] | None = None,
             state_slots: Mapping[str, int] | None = None) -> None:
        """The KV of the next chunk is in ``pages``; ``end_token`` defaults to where those pages
        end (the prompt's end for the last chunk). The chunk that reaches the prompt's end is the
        last: the aux slot goes with it (with its last layer, when streaming layers).

        ``layers``/``ready``: only those layers are written, once the CUDA event ``ready`` has
        fired (``SenderRoomHandle.send``); the next layers of the same tokens come with
        ``pages=[]``. ``group_pages``: a hybrid cache's new pages of each paged group beyond the
        first, by name (``SenderRoomHandle.send``). ``state_slots``: the state groups' slots, for an
        engine that knows them only with the last chunk (else given to ``init``)."""
        if state_slots is not None:
            self._state_slots = slot_dict(state_slots)
        if self._num_tokens is None:
            raise LocalProtocolError("KVSender.send() before init(num_tokens)")
        first, self._start_token_sent = (0 if self._start_token_sent else self._start_token), True
        self._pages_given += len(pages)
        end = end_token if end_token is not None else \
            min(self._num_tokens, self._start_token + self._pages_given * self._block)
        last = end >= self._num_tokens
        completes = layers is None or layers.stop >= self._num_layers
        aux = self._aux_slot if last and completes else None
        chunk = list(pages)
        groups = group_lists(group_pages)
        slots = self._state_slots if last and not self._slots_sent else None
        self._slots_sent = self._slots_sent or last
        self._facade._post(self._do, lambda: self._handle.send(chunk, end, last=last, aux_slot=aux, layers=layers,
                                                               ready=ready, group_pages=groups, state_slots=slots,
                                                               first_token=first))


class KVReceiver(_Room):
    """A decode room, shaped like SGLang's ``KVReceiver``: ``init`` with the destination."""

    def init(self, pages: Sequence[int], num_tokens: int, *, prefix_tokens: int = 0,
             aux_slot: int | None = None, group_pages: Mapping[str, Sequence[int]] | None = None,
             state_slots: Mapping[str, int] | None = None) -> None:
        """Where the room's KV goes (see ``ReceiverRoomHandle.set_destination``)."""
        page_list = list(pages)
        groups = group_lists(group_pages)
        slots = slot_dict(state_slots)
        self._facade._post(self._do, lambda: self._handle.set_destination(
            page_list, num_tokens, prefix_tokens=prefix_tokens, aux_slot=aux_slot, group_pages=groups,
            state_slots=slots))


class _Facade(FinishedRooms):
    """A started endpoint on an ``EngineLoop``, driven from other threads."""

    _endpoint: Any

    def __init__(self, loop: EngineLoop | None) -> None:
        self._own_loop = loop is None
        self.loop = loop or EngineLoop()
        self._finished: collections.deque[tuple[int, RoomState, Any]] = collections.deque()
        self._closed = False

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._closed:
            raise LocalProtocolError("the endpoint is closed", ErrorCode.ENDPOINT_CLOSED)
        self.loop.post(fn, *args)

    def _start(self, endpoint: Any) -> None:
        self._endpoint = endpoint
        original = endpoint._room_ended

        def room_ended(out: Any) -> None:  # on the loop: remember the end for get_finished()
            original(out)
            self._finished.append((out.room_id, out.state, out.code))

        endpoint._room_ended = room_ended
        self.loop.run(endpoint.start())

    def _open(self, room: _Room, opener: Callable[[], Any]) -> None:
        def open_on_loop() -> None:
            try:
                room._handle = opener()
            except LocalProtocolError as exc:
                room._error = exc
                self._finished.append((room.room_id, RoomState.FAILED, exc.code))

        self._post(open_on_loop)

    def get_finished(self) -> list[tuple[int, RoomState, ErrorCode | int | None]]:
        """(room id, final state, code) of every room that ended since the last call, in order."""
        return self._take_finished()

    def close(self) -> None:
        """Close the endpoint (its live rooms fail ENDPOINT_CLOSED, peers are told), and the
        engine loop if this facade made it. Blocks until done; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.loop.run(self._endpoint.close())
        if self._own_loop:
            self.loop.close()


class SyncPrefill(_Facade):
    """A prefill rank for a synchronous scheduler (see the module docstring)."""

    def __init__(self, kv: KVCache, *, bootstrap: str | None = None, config: EndpointConfig | None = None,
                 loop: EngineLoop | None = None) -> None:
        super().__init__(loop)
        self._start(PrefillEndpoint(kv, bootstrap=bootstrap, config=config))
        self.address: str = self._endpoint.address
        self.bootstrap_address: str = self._endpoint.bootstrap_address

    @property
    def rooms_expired(self) -> int:
        """Rooms whose lease ran out: no decode rank requested or held them before their
        BOOTSTRAPPING deadline (``EndpointMetrics.rooms_expired``); a plain read, never waits."""
        return self._endpoint.metrics.rooms_expired

    def sender(self, room_id: int) -> KVSender:
        """Open the prefill side of ``room_id``; returns at once."""
        room = KVSender(self, room_id)
        self._open(room, lambda: self._endpoint.open_room(room_id))
        return room


def _log_connect(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s", task.exception())


class SyncDecode(_Facade):
    """A decode rank for a synchronous scheduler (see the module docstring)."""

    def __init__(self, kv: KVCache, *, config: EndpointConfig | None = None, loop: EngineLoop | None = None) -> None:
        super().__init__(loop)
        self._start(DecodeEndpoint(kv, config=config))

    def connect(self, bootstrap: str, *, wait: bool = True, timeout: float | None = 60.0) -> None:
        """Link to the prefill instance at ``bootstrap`` now, ahead of its first room (as
        ``DecodeEndpoint.connect``). With ``wait``, block until every link is registered: raises
        ``ConnectFailed`` naming the cause, ``TimeoutError`` after ``timeout`` seconds (the link
        goes on being made: a room opened later waits for it). Without, return at once: a
        failure is logged and fails the rooms waiting for it; a later room links again."""
        if self._closed:
            raise LocalProtocolError("the endpoint is closed", ErrorCode.ENDPOINT_CLOSED)
        if wait:
            self.loop.run(self._endpoint.connect(bootstrap), timeout)
            return
        endpoint = self._endpoint

        def start() -> None:
            task = asyncio.ensure_future(endpoint.connect(bootstrap))
            task.add_done_callback(_log_connect)

        self._post(start)

    def receiver(self, room_id: int, bootstrap: str, *, pages: Sequence[int] | None = None,
                 num_tokens: int | None = None, prefix_tokens: int = 0, aux_slot: int | None = None,
                 group_pages: Mapping[str, Sequence[int]] | None = None,
                 state_slots: Mapping[str, int] | None = None) -> KVReceiver:
        """Open the decode side of ``room_id`` fed by the prefill instance at ``bootstrap``; with
        ``pages`` and ``num_tokens`` the destination goes at once (else ``init`` later); a hybrid
        cache's ``group_pages`` and ``state_slots`` as for ``DecodeEndpoint.open_room``."""
        room = KVReceiver(self, room_id)
        page_list = None if pages is None else list(pages)
        groups = group_lists(group_pages)
        slots = slot_dict(state_slots)
        self._open(room, lambda: self._endpoint.open_room(room_id, bootstrap, pages=page_list, num_tokens=num_tokens,
                                                          prefix_tokens=prefix_tokens, aux_slot=aux_slot,
                                                          group_pages=groups, state_slots=slots))
        return room
