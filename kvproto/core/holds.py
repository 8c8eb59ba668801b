"""Room holds and refused links (protocol 1.4): what the cores do for a decode that waits long.

Theory of operation
-------------------
*Leases.* A prefill room waits in BOOTSTRAPPING for the TRANSFER_REQUESTs of a decode instance,
holding the prefill's pages. A serving engine's decode request may wait in its queue for blocks
far longer than any fixed deadline, while a decode that never comes should pin those pages only
briefly. So the prefill treats the room's BOOTSTRAPPING deadline (``Timeouts.bootstrap``) as a
*lease*, and a decode room that waits for its destination (WAITING_FOR_INPUT: links registered,
no pages yet) renews it: it sends a ROOM_HOLD to each paired prefill rank whose minor is at least
``HOLD_MINOR`` (its REGISTER_ACCEPT's header) as it enters that state and every third of its hold
after (``Timeouts.hold``: the hold each message asks for), and stops the moment it sends its
requests or ends. A prefill room in BOOTSTRAPPING that gets a hold from a decode rank that may
still send the room's request moves its deadline to the hold's end, the hold cut to the prefill's
own maximum (``Timeouts.max_hold``), never earlier than it was. A room nobody holds expires at the
lease it opened with, and is counted (``CoreStats.rooms_expired``).

A hold for a room the prefill has not opened yet is *remembered* (as a parked request is, bounded
by ``MAX_REMEMBERED_HOLDS`` rooms, each until the latest hold's end, and forgotten with the link
that sent it), so the room opened later starts with it. A hold for a room that ended here is
answered as a late request is (ABORT with the room's code), so a decode that waits for blocks
learns at once that the room it waits for has expired.

Both sides go through the transition table: the SENDER's ``HOLD`` input is ``EXTEND`` in
BOOTSTRAPPING and changes nothing later; the RECEIVER's ``HOLD_DUE`` (entering WAITING_FOR_INPUT,
then its hold timer) is ``SEND_HOLD`` in WAITING_FOR_INPUT only. The hold timer of a room is
cancelled when the room sends its requests or ends, so ``HOLD_DUE`` never meets another state.

*Refused links.* When a prefill rank refuses a decode rank's REGISTER (another model, compat key,
geometry...), the decode's rooms for that prefill instance fail at once on the decode, but the
prefill's rooms that decode wanted would wait for their lease: a room ABORT is accepted only from
a registered link. So a prefill rank remembers the socket identities it refused
(``refuse_link``: at most ``MAX_REFUSED`` identities, each for ``REFUSED_FOR`` seconds, forgotten
when the identity registers) and accepts from them exactly one thing: a room ABORT for an open
room that has no request yet, which fails it with the abort's code. Anything else from such a
link is dropped and counted (``CoreStats.refused_messages``). That grants a refused peer no more
than a registered decode rank of any instance already has (it may abort a room nobody has claimed
with a request), and the peer got through the control plane's authentication (CURVE, if
configured) to be refused at all. The decode side sends those aborts (``tell`` of
``cluster_failed``): one per room that fails by the refusal, with the refusal's code, and its
held ends, on every link whose peer is of minor ``HOLD_MINOR`` or later.

Cost: a waiting decode room sends one 28-byte frame per prefill rank every ``hold / 3`` seconds,
and each side keeps one timer per waiting (decode) or remembered (prefill) room.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvproto.core.events import LinkKey
from kvproto.core.state import Input, RoomState
from kvproto.wire import Abort, ErrorCode, Message, RoomHold

HOLD_MINOR = 4
"""The minor version that introduced ROOM_HOLD and the refused-link ABORT."""

MAX_REMEMBERED_HOLDS = 65536
"""Most rooms not opened yet whose holds a prefill rank remembers (a hold beyond is dropped)."""

MAX_REFUSED = 1024
"""Most socket identities whose refused registration a prefill rank remembers (oldest forgotten)."""

REFUSED_FOR = 10.0
"""Seconds a refused identity's room ABORTs are accepted after its REGISTER_REJECT."""

_U32_MAX = 0xFFFFFFFF


def hold_ms(seconds: float) -> int:
    """A hold of ``seconds`` as ROOM_HOLD's ``hold_ms`` (whole milliseconds, at most 2**32-1)."""
    return max(0, min(_U32_MAX, int(seconds * 1000)))


def hold_interval(hold: float) -> float:
    """How often a waiting decode room sends its hold: a third of it, so that the prefill's room
    outlives one lost hold with time to spare (and two in a row, but for the third's delay)."""
    return hold / 3


class SenderHolds:
    """``SenderCore``'s part: leases renewed by holds, remembered holds, refused links."""

    # what ``SenderCore`` (through ``CoreBase``) provides
    rooms: dict[int, Any]
    links: dict[LinkKey, Any]
    timeouts: Any
    timers: Any
    stats: Any
    closed: bool
    send: Any
    _abort_message: Any
    _answer_late: Any

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._remembered: dict[int, dict[LinkKey, float]] = {}
        """Room not opened yet -> the end of the latest hold from each link that held it."""
        self._refused: OrderedDict[LinkKey, float] = OrderedDict()
        """Socket identity whose REGISTER this rank refused -> until when its room ABORTs count."""

    # --- leases --------------------------------------------------------------------------------
    def apply(self, room: Any, inp: Input, now: float, **kw: Any) -> None:
        if inp is Input.TIMEOUT and room.state is RoomState.BOOTSTRAPPING:
            self.stats.rooms_expired += 1  # the lease ran out: no decode requested or held the room in time
        super().apply(room, inp, now, **kw)  # type: ignore[misc]

    def _hold_end(self, msg: RoomHold, now: float) -> float:
        return now + min(msg.hold_ms / 1000, self.timeouts.max_hold)

    def _on_hold(self, key: LinkKey, msg: RoomHold, now: float) -> None:
        """A ROOM_HOLD from a link (messages.md, 15 ROOM_HOLD: checks 2 to 6)."""
        link = self.links.get(key)
        if link is None:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.NOT_REGISTERED,
                                               "room hold before registration"))
            return
        room = self.rooms.get(msg.room_id)
        if room is None:
            if not self._answer_late(key, msg.room_id, msg.generation):
                self._remember(key, msg, now)
            return
        peer = room.peers.get(link.decode_rank)
        if msg.generation in room.stale_generations or room.instance not in (None, link.instance) or \
                link.decode_rank not in link.paired_ranks or (
                    peer is not None and (peer.link.key != key or peer.request.generation != msg.generation)):
            self.stats.stale_tags += 1  # not a decode rank that may still send this room's request
            return
        room.hold_until = max(room.hold_until, self._hold_end(msg, now))
        self.apply(room, Input.HOLD, now)

    def _extend(self, room: Any) -> None:
        """EXTEND: the room's BOOTSTRAPPING deadline moves out to its latest hold's end (never in)."""
        current = self.timers.deadline(room.room_id)
        if current is not None and room.hold_until > current:
            self.timers.schedule(room.room_id, room.hold_until)

    def _remember(self, key: LinkKey, msg: RoomHold, now: float) -> None:
        held = self._remembered.get(msg.room_id)
        if held is None:
            if len(self._remembered) >= MAX_REMEMBERED_HOLDS or self.closed:
                self.stats.unknown_room_messages += 1
                return
            held = self._remembered[msg.room_id] = {}
        held[key] = max(held.get(key, 0.0), self._hold_end(msg, now))
        self.timers.schedule(("held", msg.room_id), max(held.values()))

    def _open_held(self, room: Any, now: float) -> None:
        """A room opens: the holds remembered for it (from links still registered) apply now."""
        held = self._remembered.pop(room.room_id, None)
        if held is None:
            return
        self.timers.cancel(("held", room.room_id))
        ends = [end for key, end in held.items() if key in self.links]
        if ends:
            room.hold_until = max(ends)
            self.apply(room, Input.HOLD, now)

    def _forget_link_holds(self, key: LinkKey) -> None:
        """The link is gone: the holds it sent for rooms not opened yet no longer count."""
        for room_id, held in list(self._remembered.items()):
            if held.pop(key, None) is not None:
                if held:
                    self.timers.schedule(("held", room_id), max(held.values()))
                else:
                    del self._remembered[room_id]
                    self.timers.cancel(("held", room_id))

    def _forget_holds(self) -> None:
        for room_id in self._remembered:
            self.timers.cancel(("held", room_id))
        self._remembered.clear()

    def _holds_timer(self, key: Any) -> bool:
        """A remembered hold ended without its room being opened: forget it."""
        if isinstance(key, tuple) and key[0] == "held":
            self._remembered.pop(key[1], None)
            return True
        return False

    def remembered_holds(self) -> int:
        """Rooms not opened yet for which a hold is remembered."""
        return len(self._remembered)

    # --- refused links ------------------------------------------------------------------------------
    def refuse_link(self, key: LinkKey, now: float) -> None:
        """This rank answered ``key``'s REGISTER with REGISTER_REJECT: for ``REFUSED_FOR`` seconds
        its room ABORTs may fail the open rooms that have no request yet (module docstring)."""
        refused = self._refused
        refused.pop(key, None)
        refused[key] = now + REFUSED_FOR
        while refused and (len(refused) > MAX_REFUSED or next(iter(refused.values())) <= now):
            refused.popitem(last=False)

    def _from_refused(self, key: LinkKey, msg: Message, now: float) -> bool:
        """Handle a room message from a link this rank refused (True), or say it is not one (False)."""
        if key in self.links:
            return False
        until = self._refused.get(key)
        if until is None:
            return False
        if until <= now:
            del self._refused[key]
            return False
        room = self.rooms.get(msg.room_id)
        if isinstance(msg, Abort) and room is not None and room.state is RoomState.BOOTSTRAPPING and \
                room.instance is None:
            self.apply(room, Input.PEER_ABORT, now, code=ErrorCode.coerce(msg.code), origin=key,
                       reason=f"a decode rank whose registration was refused let the room go: {msg.reason}")
        else:
            self.stats.refused_messages += 1
        return True

    def _registered(self, key: LinkKey) -> None:
        self._refused.pop(key, None)


class ReceiverHolds:
    """``ReceiverCore``'s part: a room waiting for its destination holds its prefill rooms."""

    # what ``ReceiverCore`` (through ``CoreBase``) provides
    rooms: dict[int, Any]
    timeouts: Any
    timers: Any
    send: Any
    apply: Any
    _abort_message: Any

    def _first_hold(self, room: Any) -> Input | None:
        """The room enters WAITING_FOR_INPUT: its first hold is due now, if it sends any (holds
        enabled and a link of minor ``HOLD_MINOR`` or later)."""
        hold = self.timeouts.hold
        if hold is None or hold <= 0 or not any(link.minor >= HOLD_MINOR for link in room.links):
            return None
        return Input.HOLD_DUE

    def _send_hold(self, room: Any, now: float) -> None:
        """SEND_HOLD: one ROOM_HOLD to each paired prefill rank that knows it; the next one later."""
        hold = self.timeouts.hold
        msg = RoomHold(room_id=room.room_id, generation=room.generation, hold_ms=hold_ms(hold))
        for link in room.links:
            if link.minor >= HOLD_MINOR:
                self.send(link.key, msg)
        self.timers.schedule(("hold", room.room_id), now + hold_interval(hold))

    def _stop_holds(self, room_id: int) -> None:
        self.timers.cancel(("hold", room_id))

    def _holds_timer(self, key: Any, now: float) -> bool:
        if isinstance(key, tuple) and key[0] == "hold":
            room = self.rooms.get(key[1])
            if room is not None:
                self.apply(room, Input.HOLD_DUE, now)
            return True
        return False

    def _refusal_aborts(self, cluster: Any, state: Any, code: ErrorCode | int, reason: str) -> list[Abort]:
        """The room ABORTs that tell a prefill rank which refused (or could not finish) this rank's
        registration to let go of the rooms failing by it: every room of ``cluster`` still waiting
        for its links, with ``code``, and the cluster's held ends, with theirs."""
        aborts = [self._abort_message(r.room_id, r.generation, code, reason)
                  for r in self.rooms.values() if r.cluster == cluster and not r.links]
        return aborts + list(state.held_ends.values())
