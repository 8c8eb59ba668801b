"""What the sender and receiver cores share: the room skeleton, transitions, endings, timers.

Theory of operation
-------------------
``CoreBase.apply(room, input)`` is the only place that assigns ``room.state``: it looks up the
table, performs the effect through the subclass's ``_effect`` hook, sets the next state, arms
that state's deadline, and, when the state is terminal, emits exactly one ``RoomEnded`` and
forgets the room (its maps, timers and progress), leaving only a bounded tombstone so that
late messages are counted as late rather than unknown.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvproto.core.events import CoreStats, LinkKey, Output, RoomEnded, Send, Timeouts
from kvproto.core.state import Effect, Input, Role, RoomState, transition
from kvproto.core.timers import Timers
from kvproto.wire import Abort, ErrorCode, LocalProtocolError

if TYPE_CHECKING:
    from kvproto.core.groups import GroupSpec

TOMBSTONES = 4096
"""How many ended room ids are remembered to tell late messages from unknown ones."""

_TIMEOUT_CODE = {
    RoomState.BOOTSTRAPPING: ErrorCode.BOOTSTRAP_TIMEOUT,
    RoomState.WAITING_FOR_INPUT: ErrorCode.WAITING_TIMEOUT,
    RoomState.TRANSFERRING: ErrorCode.TRANSFER_TIMEOUT,
}


def page_outside(pages: Sequence[int], limit: int) -> int | None:
    """The first page of ``pages`` outside ``[0, limit)``, or None. One comprehension: on CPython
    3.11 it is faster than ``min`` and ``max`` (two passes) at every length measured (4-256)."""
    bad = [page for page in pages if not 0 <= page < limit]
    return bad[0] if bad else None


def duplicate_page(pages: Sequence[int]) -> int | None:
    """The first page that ``pages`` lists twice, or None. Two token ranges of one room must
    never share a page: one would silently overwrite the other."""
    if len(set(pages)) == len(pages):
        return None
    seen: set[int] = set()
    for page in pages:
        if page in seen:
            return page
        seen.add(page)
    return None  # pragma: no cover - unreachable: the set was smaller than the list


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What is remembered of an ended room: enough to answer late messages with its code."""

    state: RoomState
    code: ErrorCode | int | None
    generations: frozenset[int]
    instance: str | None = None
    """Sender: the decode instance the room served, and the ranks that had sent requests."""
    ranks: frozenset[int] = frozenset()
    answered: frozenset[int] = frozenset()
    """Sender: generations of late requests answered with the room's ABORT after it ended."""


@dataclass(slots=True, kw_only=True)
class RoomBase:
    room_id: int
    state: RoomState = RoomState.BOOTSTRAPPING
    code: ErrorCode | int | None = None
    reason: str = ""
    created: float = 0.0
    ended: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    entered: dict[RoomState, float] = field(default_factory=dict)
    """When the room entered each state it went through (BOOTSTRAPPING: when it opened)."""


class CoreBase:
    ROLE: Role

    def __init__(self, *, block_size: int, num_blocks: int, aux_slots: int = 0, timeouts: Timeouts | None = None,
                 groups: Sequence[GroupSpec] = ()) -> None:
        """What every core knows of its cache: the first group's tokens per page (``block_size``)
        and pages (``num_blocks``), its aux slots, the cache's groups beyond the first, and the
        room deadlines (``timeouts``)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.aux_slots = aux_slots
        self.groups = tuple(groups)
        self.timeouts = timeouts or Timeouts()
        self.rooms: dict[int, Any] = {}
        self.live_states: Counter[RoomState] = Counter()
        """How many live rooms are in each state (kept by ``_add_room``, ``apply`` and ``_end``)."""
        self.timers = Timers()
        self.stats = CoreStats()
        self._outputs: list[Output] = []
        self._tombstones: OrderedDict[int, Tombstone] = OrderedDict()
        self.closed = False
        self.on_state: Callable[[int, RoomState], None] | None = None
        """Called with (room id, state) whenever a live room enters a non-terminal state (its end
        is the ``RoomEnded`` output); ``kvproto.sync.process`` forwards these to its engine."""

    # --- outputs -----------------------------------------------------------------------------
    def pop_outputs(self) -> list[Output]:
        out, self._outputs = self._outputs, []
        return out

    def send(self, link: LinkKey, message: Any) -> None:
        self._outputs.append(Send(link, message))

    # --- lookups ------------------------------------------------------------------------------
    def room_state(self, room_id: int) -> RoomState | None:
        room = self.rooms.get(room_id)
        if room is not None:
            return room.state
        ended = self._tombstones.get(room_id)
        return None if ended is None else ended.state

    def next_deadline(self) -> float | None:
        return self.timers.next_deadline()

    def _count_missing_room(self, room_id: int) -> None:
        if room_id in self._tombstones:
            self.stats.late_messages += 1
        else:
            self.stats.unknown_room_messages += 1

    def _check_open(self) -> None:
        if self.closed:
            raise LocalProtocolError("endpoint is closed", ErrorCode.ENDPOINT_CLOSED)

    def check_new_room(self, room_id: int) -> None:
        """Raise ``LocalProtocolError`` if ``open_room(room_id)`` would be refused; change nothing."""
        self._check_open()
        if not 0 < room_id < 2**64:
            raise LocalProtocolError(f"room id {room_id} outside [1, 2**64)")
        if room_id in self.rooms:
            raise LocalProtocolError(f"room {room_id} is already live", ErrorCode.DUPLICATE_ROOM)

    def _new_room_check(self, room_id: int) -> None:
        self.check_new_room(room_id)
        self._tombstones.pop(room_id, None)

    # --- the one place that assigns state -----------------------------------------------------
    def apply(
        self,
        room: Any,
        inp: Input,
        now: float,
        *,
        code: ErrorCode | int | None = None,
        reason: str = "",
        origin: LinkKey | None = None,
    ) -> None:
        effect, nxt = transition(self.ROLE, room.state, inp)
        if effect is Effect.ABSORB:
            self.stats.late_messages += 1
            return
        if effect is Effect.LOCAL_ERROR:
            raise LocalProtocolError(f"{inp.value} is not allowed in room {room.room_id} while {room.state.name}")
        if effect is Effect.INTERNAL_ERROR:
            code, reason = ErrorCode.INTERNAL_ERROR, f"unexpected {inp.value} while {room.state.name}"
            effect = Effect.ABORT_PEERS
        if inp is Input.TIMEOUT and code is None:
            code = self._timeout_code(room)
            reason = reason or f"room {room.room_id} timed out while {room.state.name}"
        if effect in (Effect.ABORT_PEERS, Effect.ABORT_AND_DRAIN):
            room.code = code if code is not None else ErrorCode.INTERNAL_ERROR
            room.reason = reason
            if inp is Input.PEER_VIOLATION:
                self.stats.peer_violations += 1
        follow = self._effect(room, effect, now, origin)
        entered = nxt is not room.state
        if entered:
            self.live_states[room.state] -= 1
            self.live_states[nxt] += 1
            room.entered[nxt] = now
        room.state = nxt
        if nxt.terminal:
            self._end(room, now)
            return
        if entered and self.on_state is not None:
            self.on_state(room.room_id, nxt)
        progress = effect in (Effect.RECORD, Effect.POST_CHUNK) and nxt is RoomState.TRANSFERRING
        if effect is Effect.ABORT_AND_DRAIN:
            self.timers.schedule(room.room_id, now + self.timeouts.drain)
        elif (entered or progress) and not getattr(room, "failing", False):
            self.timers.schedule(room.room_id, self._deadline(nxt, now))
        if follow is not None:
            self.apply(room, follow, now)

    def _deadline(self, state: RoomState, now: float) -> float | None:
        limit = {
            RoomState.BOOTSTRAPPING: self.timeouts.bootstrap,
            RoomState.WAITING_FOR_INPUT: self.timeouts.waiting,
            RoomState.TRANSFERRING: self.timeouts.transfer,
        }[state]
        return None if limit is None else now + limit

    @property
    def transferring(self) -> int:
        """Live rooms in TRANSFERRING."""
        return self.live_states[RoomState.TRANSFERRING]

    def _add_room(self, room: Any) -> None:
        self.rooms[room.room_id] = room
        self.live_states[room.state] += 1
        room.entered[room.state] = room.created

    def _end(self, room: Any, now: float) -> None:
        room.ended = now
        nbytes = self._moved(room)
        self.live_states[room.state] -= 1  # the terminal state just entered: live rooms only
        self.rooms.pop(room.room_id, None)
        self.timers.cancel(room.room_id)
        tombstone = self._tombstone(room)
        self._forget(room)
        self._tombstones[room.room_id] = tombstone
        if len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        if room.state is RoomState.SUCCESS:
            self.stats.rooms_succeeded += 1
        else:
            self.stats.rooms_failed += 1
        self._outputs.append(RoomEnded(room_id=room.room_id, state=room.state, code=room.code, reason=room.reason,
                                       timeline=tuple(room.entered.items()), nbytes=nbytes))

    def _abort_message(self, room_id: int, generation: int, code: ErrorCode | int | None, reason: str) -> Abort:
        return Abort(room_id=room_id, generation=generation, code=int(code or ErrorCode.INTERNAL_ERROR), reason=reason[:1000])

    # --- timers, abort, close ------------------------------------------------------------------
    def handle_timer(self, now: float) -> None:
        for key in self.timers.pop_due(now):
            room = self.rooms.get(key) if isinstance(key, int) else None
            if room is not None:
                self.apply(room, Input.TIMEOUT, now)
            else:
                self._other_timer(key, now)

    def abort(self, room_id: int, now: float, reason: str = "aborted by the application") -> None:
        room = self.rooms.get(room_id)
        if room is None:
            return  # already ended: abort is idempotent
        self.apply(room, Input.LOCAL_ABORT, now, code=ErrorCode.ABORTED, reason=reason)

    def close(self, now: float) -> None:
        """Fail every live room with ENDPOINT_CLOSED (telling peers). Idempotent."""
        if self.closed:
            return
        for room in list(self.rooms.values()):
            self.apply(room, Input.CLOSE, now, code=ErrorCode.ENDPOINT_CLOSED, reason="endpoint closed")
        self.closed = True

    # --- hooks ------------------------------------------------------------------------------
    def _effect(self, room: Any, effect: Effect, now: float, origin: LinkKey | None) -> Input | None:
        """Perform ``effect``; may return an input to apply once the new state is set."""
        raise NotImplementedError

    def _timeout_code(self, room: Any) -> ErrorCode:
        return _TIMEOUT_CODE[room.state]

    def _moved(self, room: Any) -> int:
        """KV bytes the room moved (read before ``_forget``)."""
        return 0

    def _forget(self, room: Any) -> None:
        """Drop every trace of an ended room from the subclass's maps."""

    def _tombstone(self, room: Any) -> Tombstone:
        """What to remember of an ended room (to tell late messages from a new incarnation)."""
        return Tombstone(room.state, room.code, frozenset())

    def _other_timer(self, key: Any, now: float) -> None:
        """A timer that is not a room's deadline fired."""
