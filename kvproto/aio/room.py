"""Room handles: what the serving loop holds for one request's transfer.

A handle is a future (house rule 8): ``await room.wait()`` awaits a shielded per-room future,
so cancelling the caller leaves the room running; ``room.abort()`` is the way to stop it.
``room.poll()`` never blocks and returns the ``RoomState`` (SGLang's ``KVPoll`` values).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvproto.core import RoomState
from kvproto.wire import ErrorCode, LocalProtocolError

if TYPE_CHECKING:
    from kvproto.aio.decode import DecodeEndpoint
    from kvproto.aio.prefill import PrefillEndpoint


class TransferFailed(Exception):
    """The room ended FAILED. ``code`` says why (an ``ErrorCode``, or an int from a newer peer)."""

    def __init__(self, room_id: int, code: ErrorCode | int | None, reason: str) -> None:
        name = code.name if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"room {room_id} failed: {name}: {reason}")
        self.room_id = room_id
        self.code = code
        self.reason = reason


@dataclass(slots=True)
class RoomStats:
    """What a room moved, as seen from this rank."""

    nbytes: int = 0
    writes: int = 0
    descriptors: int = 0
    paths: set[str] = field(default_factory=set)
    started: float = 0.0
    ended: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds in bootstrap, waiting (for the application's input) and transfer."""
    staging_s: float = 0.0
    """Seconds of staging copies (gathers on prefill, scatters on decode), launch to completion."""

    @property
    def elapsed(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class _Handle:
    """What both sides' room handles are: the room's future, its end, and its endpoint's calls."""

    def __init__(self, endpoint: PrefillEndpoint | DecodeEndpoint, room_id: int, loop: asyncio.AbstractEventLoop,
                 started: float) -> None:
        self._endpoint: Any = endpoint
        self.room_id = room_id
        self._future: asyncio.Future[None] = loop.create_future()
        self._final: RoomState | None = None
        self.code: ErrorCode | int | None = None
        self.reason = ""
        self.stats = RoomStats(started=started)

    def _finish(self, state: RoomState, code: ErrorCode | int | None, reason: str, now: float,
                phases: dict[str, float] | None = None, nbytes: int = 0) -> None:
        self.code, self.reason = code, reason
        self.stats.ended = now
        self.stats.phases = phases or {}
        self.stats.nbytes = self.stats.nbytes or nbytes
        self._final = state  # last: a reader in another thread that sees it sees the code too
        if not self._future.done():
            if state is RoomState.SUCCESS:
                self._future.set_result(None)
            else:
                self._future.set_exception(TransferFailed(self.room_id, code, reason))
                self._future.exception()  # retrieved here: a room nobody awaits is not an error

    @property
    def done(self) -> bool:
        return self._final is not None

    async def wait(self) -> None:
        """Return when the room succeeds; raise ``TransferFailed`` when it fails."""
        await asyncio.shield(self._future)

    def poll(self) -> RoomState:
        return self._final if self._final is not None else self._endpoint._room_state(self.room_id)

    def abort(self) -> None:
        self._endpoint._abort(self.room_id)


class SenderRoomHandle(_Handle):
    """A prefill-side room."""

    def send(self, pages: Sequence[int], end_token: int, *, last: bool = True, aux_slot: int | None = None,
             layers: range | tuple[int, int] | None = None, ready: Any = None,
             group_pages: Mapping[str, Sequence[int]] | None = None,
             state_slots: Mapping[str, int] | None = None, first_token: int = 0) -> None:
        """The KV of tokens up to ``end_token`` is ready in ``pages`` (this chunk's new pages).

        Call once per prefill chunk; ``last=True`` on the final one, whose ``end_token`` must
        equal the prompt's token count. ``aux_slot`` (last chunk only) is this rank's aux slot
        to copy to the decode rank's.

        Layer-wise streaming: ``layers`` (a ``range`` of consecutive layers) says that only those
        layers of the chunk's tokens are ready, once ``ready`` has completed: a CUDA event the
        engine recorded on its stream after writing them (None: ready now; a CPU cache passes
        none). kvproto never synchronizes the engine's stream: it polls the event and posts the
        layers' writes once it has fired, so layer ``l`` moves while the engine computes layer
        ``l + 1``. A token range's layers come in order from layer 0, each once: the first call
        gives the range's new pages, the following ones repeat ``end_token`` and ``last`` with
        ``pages=[]``; the aux slot goes with the last range's last layer.

        A cache of several groups (``KVCache.with_groups``): ``group_pages`` gives, by group name,
        the chunk's new pages of each paged group beyond the first (every page of the prompt, as
        ``pages`` does); ``state_slots`` gives this rank's slot of each state group, once, with the
        first call whose ``last`` is set. ``layers`` then counts the model's layers, each group
        moving those of its layers that lie in the range.

        ``first_token`` (first call only, whole blocks): ``pages`` start at that token; the tokens
        before it are the decode's prefix (``decode_prefix``), which this rank neither sends nor
        names pages for.
        """
        span = None
        if layers is not None:
            span = (layers.start, layers.stop) if isinstance(layers, range) else (int(layers[0]), int(layers[1]))
            if isinstance(layers, range) and layers.step != 1:
                raise LocalProtocolError(f"layers {layers} must be consecutive")
        self._endpoint._submit_chunk(self.room_id, pages, end_token, last, aux_slot, span, ready, group_pages,
                                     state_slots, first_token)

    @property
    def decode_prefix(self) -> int | None:
        """Tokens the decode already holds (the least prefix its paired ranks named), once every
        paired decode rank's request has come (WAITING_FOR_INPUT); None before that or once the
        room has ended."""
        room = self._endpoint.core.rooms.get(self.room_id)
        return None if room is None else room.decode_prefix


class ReceiverRoomHandle(_Handle):
    """A decode-side room."""

    def set_destination(
        self, pages: Sequence[int], num_tokens: int, *, prefix_tokens: int = 0, aux_slot: int | None = None,
        group_pages: Mapping[str, Sequence[int]] | None = None, state_slots: Mapping[str, int] | None = None,
    ) -> None:
        """Where the room's KV goes: decode pages for tokens from 0, of which the first
        ``prefix_tokens`` are already held here (a prefix hit) and are not moved; for a cache of
        several groups, the pages or slot of each group beyond the first (``DecodeEndpoint.open_room``)."""
        self._endpoint._set_destination(self.room_id, pages, num_tokens, prefix_tokens, aux_slot, group_pages,
                                        state_slots)
