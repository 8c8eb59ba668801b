"""Room holds and refused links (protocol 1.4, ``kvproto.core.holds``) on the cores, fake clock."""

from __future__ import annotations

import pytest

import kvproto.core.holds as holds_module
from kvproto.core import ReceiverCore, RoomEnded, RoomState, SenderCore, Timeouts
from kvproto.core.holds import HOLD_MINOR, REFUSED_FOR, hold_ms
from kvproto.wire import Abort, ErrorCode, RoomHold, TransferRequest

from .test_receiver import C, rlink
from .test_receiver import pop as rpop
from .test_sender import T0, make_link, req
from .test_sender import assert_clean as sender_clean
from .test_sender import pop as spop

LEASE = 2.0


def sender(**timeouts: float) -> SenderCore:
    timeouts.setdefault("bootstrap", LEASE)
    core = SenderCore(block_size=16, num_blocks=64, aux_slots=4, timeouts=Timeouts(**timeouts))
    core.add_link(make_link())
    return core


def hold(room: int, seconds: float, gen: int = 11) -> RoomHold:
    return RoomHold(room_id=room, generation=gen, hold_ms=hold_ms(seconds))


def ended(core: SenderCore | ReceiverCore, now: float) -> list[tuple[int, RoomState, object]]:
    core.handle_timer(now)
    return [(e.room_id, e.state, e.code) for e in core.pop_outputs() if isinstance(e, RoomEnded)]


# --- the prefill's lease -------------------------------------------------------------------------------


def test_holds_a_hold_extends_the_prefill_deadline():
    """A hold in BOOTSTRAPPING moves the deadline to the hold's end: the room outlives its 2 s lease
    and expires (counted) only when the hold runs out."""
    core = sender()
    core.open_room(1, T0)
    core.on_message("d0", hold(1, 10.0), T0 + 1)
    assert core.next_deadline() == T0 + 11
    assert ended(core, T0 + LEASE + 0.5) == [] and core.room_state(1) is RoomState.BOOTSTRAPPING
    assert ended(core, T0 + 11) == [(1, RoomState.FAILED, ErrorCode.BOOTSTRAP_TIMEOUT)]
    assert (core.stats.rooms_expired, core.stats.rooms_failed) == (1, 1)
    sender_clean(core)


def test_holds_no_hold_expires_at_the_lease_and_is_counted():
    """Without a hold the room fails BOOTSTRAP_TIMEOUT at its lease and counts as expired; a room
    that fails otherwise (an abort) does not."""
    core = sender()
    core.open_room(1, T0)
    core.open_room(2, T0)
    core.abort(2, T0 + 1)
    assert ended(core, T0 + LEASE - 0.01) == [(2, RoomState.FAILED, ErrorCode.ABORTED)]
    assert ended(core, T0 + LEASE) == [(1, RoomState.FAILED, ErrorCode.BOOTSTRAP_TIMEOUT)]
    assert (core.stats.rooms_expired, core.stats.rooms_failed) == (1, 2)
    sender_clean(core)


def test_holds_periodic_holds_keep_the_room_until_the_request():
    """Holds every second keep a room with a 2 s lease alive for 10 s; then the request comes and
    the room goes on as usual (no expiry counted)."""
    core = sender()
    core.open_room(1, T0)
    for t in range(1, 11):
        core.on_message("d0", hold(1, 3.0), T0 + t)
        assert ended(core, T0 + t + 0.5) == []
    core.on_message("d0", req(1), T0 + 10.5)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    assert core.stats.rooms_expired == 0


def test_holds_a_hold_is_cut_to_max_hold_and_never_shortens_the_deadline():
    """The prefill cuts a hold to ``max_hold``; a hold ending before the current deadline changes
    nothing; ``max_hold`` 0 ignores holds."""
    core = sender(max_hold=3.0)
    core.open_room(1, T0)
    core.on_message("d0", hold(1, 3600.0), T0 + 1)
    assert core.next_deadline() == T0 + 4
    core = sender(bootstrap=30.0)
    core.open_room(1, T0)
    core.on_message("d0", hold(1, 1.0), T0 + 1)
    assert core.next_deadline() == T0 + 30
    core = sender(max_hold=0.0)
    core.open_room(1, T0)
    core.on_message("d0", hold(1, 10.0), T0 + 1)
    assert core.next_deadline() == T0 + LEASE


def test_holds_a_hold_after_the_requests_changes_nothing():
    """Past BOOTSTRAPPING a hold has no deadline to move (HOLD is NONE): the WAITING_FOR_INPUT deadline
    stays."""
    core = sender(waiting=5.0)
    core.open_room(1, T0)
    core.on_message("d0", req(1), T0)
    core.on_message("d0", hold(1, 60.0), T0 + 1)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT and core.next_deadline() == T0 + 5


def test_holds_a_hold_for_a_room_not_opened_yet_is_remembered():
    """A hold for a room the application has not opened is remembered: the room opened later starts
    with it (past its own lease); once the hold runs out nothing is left of it."""
    core = sender()
    core.on_message("d0", hold(1, 10.0), T0)
    assert core.remembered_holds() == 1 and spop(core).sends == []
    core.open_room(1, T0 + 1)
    assert core.remembered_holds() == 0
    assert ended(core, T0 + 1 + LEASE + 1) == [] and core.room_state(1) is RoomState.BOOTSTRAPPING
    assert ended(core, T0 + 10) == [(1, RoomState.FAILED, ErrorCode.BOOTSTRAP_TIMEOUT)]
    sender_clean(core)
    core.on_message("d0", hold(2, 5.0), T0 + 20)
    assert ended(core, T0 + 25) == [] and core.remembered_holds() == 0  # forgotten at its end
    core.open_room(2, T0 + 26)
    assert core.next_deadline() == T0 + 26 + LEASE
    assert ended(core, T0 + 26 + LEASE) == [(2, RoomState.FAILED, ErrorCode.BOOTSTRAP_TIMEOUT)]
    sender_clean(core)


def test_holds_a_remembered_hold_dies_with_its_link_and_is_bounded(monkeypatch: pytest.MonkeyPatch):
    """A remembered hold whose link is gone no longer counts; beyond the bound a hold is dropped."""
    core = sender()
    core.on_message("d0", hold(1, 10.0), T0)
    core.remove_link("d0", T0)
    assert core.remembered_holds() == 0 and len(core.timers) == 0
    core.add_link(make_link())
    monkeypatch.setattr(holds_module, "MAX_REMEMBERED_HOLDS", 2)
    for room in (1, 2, 3):
        core.on_message("d0", hold(room, 10.0), T0)
    assert core.remembered_holds() == 2 and core.stats.unknown_room_messages == 1
    core.open_room(3, T0)
    assert core.next_deadline() == T0 + LEASE
    core.close(T0)
    assert core.remembered_holds() == 0


def test_holds_a_hold_for_an_ended_room_is_answered_with_its_code():
    """A hold for a room that expired here is late: answered with ABORT(BOOTSTRAP_TIMEOUT), so the
    decode room waiting for blocks learns it at once."""
    core = sender()
    core.open_room(1, T0)
    ended(core, T0 + LEASE)
    core.on_message("d0", hold(1, 10.0), T0 + 3)
    (abort,) = spop(core).to("d0")
    assert (abort.room_id, abort.generation, abort.code) == (1, 11, ErrorCode.BOOTSTRAP_TIMEOUT)
    assert core.remembered_holds() == 0


def test_holds_a_hold_from_a_link_that_may_not_request_the_room_is_stale():
    """A hold from an unregistered link is refused (NOT_REGISTERED); from another decode instance, a
    rank that does not pair, or with another generation than the rank's request, it is stale; from
    the paired rank whose request is still missing, it counts."""
    core = SenderCore(block_size=16, num_blocks=64, aux_slots=4, timeouts=Timeouts(bootstrap=LEASE))
    core.add_link(make_link(0, paired=(0, 3)))
    core.add_link(make_link(3, paired=(0, 3), key="d3"))
    core.add_link(make_link(1, paired=(1,), instance="decode-B", key="other"))
    core.add_link(make_link(2, paired=(0,), key="unpaired"))
    core.open_room(1, T0)
    core.on_message("nobody", hold(1, 10.0), T0)
    (abort,) = spop(core).to("nobody")
    assert abort.code == ErrorCode.NOT_REGISTERED
    core.on_message("d0", req(1, gen=11), T0)  # rank 0's request: the room waits for rank 3's
    assert core.room_state(1) is RoomState.BOOTSTRAPPING
    for key, gen in (("other", 11), ("unpaired", 11), ("d0", 99)):
        core.on_message(key, hold(1, 30.0, gen), T0 + 1)
    assert core.next_deadline() == T0 + LEASE and core.stats.stale_tags == 3
    core.on_message("d3", hold(1, 30.0, gen=5), T0 + 1)
    assert core.next_deadline() == T0 + 31


# --- the decode's holds -------------------------------------------------------------------------------


def receiver(**timeouts: float) -> ReceiverCore:
    timeouts.setdefault("hold", 3.0)
    return ReceiverCore(block_size=16, num_blocks=64, aux_slots=4, seed=1, timeouts=Timeouts(**timeouts))


def link(p: int, minor: int):
    from dataclasses import replace
    return replace(rlink(p), minor=minor)


def test_holds_a_waiting_decode_room_holds_its_prefill_ranks_of_minor_4():
    """Entering WAITING_FOR_INPUT, a room sends ROOM_HOLD (its generation, its hold) to each prefill
    rank of minor >= 4 and again every hold / 3; a rank of minor 3 gets none; the destination stops
    the holds (requests go to both)."""
    core = receiver()
    core.cluster_ready(C, [link(0, HOLD_MINOR), link(1, 3)], T0)
    room = core.open_room(1, C, T0)
    gen = room.generation
    o = rpop(core)
    assert o.to("p0") == [RoomHold(room_id=1, generation=gen, hold_ms=3000)] and o.to("p1") == []
    for k in (1, 2, 3):
        core.handle_timer(T0 + k * 1.0)
        assert rpop(core).to("p0") == [RoomHold(room_id=1, generation=gen, hold_ms=3000)]
    core.set_destination(1, [0, 1, 2], 40, T0 + 3.5)
    o = rpop(core)
    assert [type(m) for m in o.to("p0")] == [TransferRequest] and [type(m) for m in o.to("p1")] == [TransferRequest]
    core.handle_timer(T0 + 10)
    assert rpop(core).to("p0") == [] and ("hold", 1) not in core.timers._due


def test_holds_a_decode_room_sends_no_hold_to_old_peers_or_when_disabled():
    """With prefill ranks of minor < 4 only, or ``Timeouts.hold`` None, a waiting room sends no hold and
    arms no hold timer: the prefill's lease alone bounds the wait, as in version 1.3."""
    for core, minor in ((receiver(), 3), (receiver(hold=None), HOLD_MINOR)):
        core.cluster_ready(C, [link(0, minor)], T0)
        core.open_room(1, C, T0)
        assert rpop(core).sends == [] and list(core.timers._due) == [1]
        core.handle_timer(T0 + 60)
        assert rpop(core).sends == []


def test_holds_a_waiting_room_that_ends_stops_holding():
    """A waiting room that ends (aborted here, or answered ABORT for its hold: the prefill's room
    expired) sends no more holds and leaves no timer."""
    core = receiver()
    core.cluster_ready(C, [link(0, HOLD_MINOR)], T0)
    gen = core.open_room(1, C, T0).generation
    core.open_room(2, C, T0)
    core.on_message("p0", Abort(room_id=1, generation=gen, code=ErrorCode.BOOTSTRAP_TIMEOUT, reason="expired"), T0)
    core.abort(2, T0)
    o = rpop(core)
    assert sorted((e.room_id, e.code) for e in o.ended) == [(1, ErrorCode.BOOTSTRAP_TIMEOUT), (2, ErrorCode.ABORTED)]
    core.handle_timer(T0 + 60)
    assert rpop(core).sends == [] and core.rooms == {} and len(core.timers) == 0


# --- the pair: a decode that waits long, one that never comes --------------------------------------------


def test_holds_pair_keeps_the_prefill_room_while_the_decode_waits():
    """Decode room waiting 20 s for blocks (hold 3 s, every 1 s) keeps a prefill room with a 2 s lease
    alive, then its request arrives and the prefill room goes on; the decode that never sends a
    destination and goes away lets the prefill room expire a hold after its last hold."""
    s, r = sender(), receiver(waiting=100.0)
    r.cluster_ready(C, [link(0, HOLD_MINOR)], T0)
    s.open_room(1, T0)
    s.open_room(2, T0)
    r.open_room(1, C, T0)
    r.open_room(2, C, T0)
    now = T0

    def deliver() -> None:
        for out in r.pop_outputs():
            if hasattr(out, "message"):
                s.on_message("d0", out.message, now)

    deliver()
    while now < T0 + 20:
        now += 0.25
        r.handle_timer(now)
        deliver()
        s.handle_timer(now)
        if now == T0 + 10:
            r.abort(2, now)  # the decode of room 2 gives up silently: its ABORT is lost
            r.pop_outputs()
    ends = [(e.room_id, e.state, e.code) for e in s.pop_outputs() if isinstance(e, RoomEnded)]
    assert ends == [(2, RoomState.FAILED, ErrorCode.BOOTSTRAP_TIMEOUT)]
    assert s.room_state(1) is RoomState.BOOTSTRAPPING
    r.set_destination(1, [0, 1, 2], 40, now)
    deliver()
    assert s.room_state(1) is RoomState.WAITING_FOR_INPUT
    assert s.stats.rooms_expired == 1


# --- refused registrations ----------------------------------------------------------------------------------


def test_holds_a_refused_link_aborts_an_open_room_without_request():
    """A room ABORT from a socket whose REGISTER was refused fails an open room that has no request
    yet, with the abort's code, telling nobody."""
    core = sender(bootstrap=30.0)
    core.open_room(1, T0)
    core.refuse_link("refused", T0)
    core.on_message("refused", Abort(room_id=1, generation=77, code=ErrorCode.MODEL_MISMATCH, reason="x"), T0 + 1)
    o = spop(core)
    assert [(e.room_id, e.state, e.code) for e in o.ended] == [(1, RoomState.FAILED, ErrorCode.MODEL_MISMATCH)]
    assert o.sends == [] and core.stats.rooms_expired == 0 and core.stats.refused_messages == 0


def test_holds_a_refused_link_cannot_touch_requested_or_unopened_rooms():
    """From a refused socket: an ABORT for a room with a request, for a room not opened (no pre-abort
    is remembered), and any other room message are dropped and counted, never answered."""
    core = sender(bootstrap=30.0)
    core.open_room(1, T0)
    core.on_message("d0", req(1), T0)
    core.refuse_link("refused", T0)
    for msg in (Abort(room_id=1, generation=11, code=ErrorCode.ABORTED, reason=""),
                Abort(room_id=2, generation=5, code=ErrorCode.ABORTED, reason=""),
                req(3), hold(4, 10.0)):
        core.on_message("refused", msg, T0 + 1)
    assert spop(core).sends == [] and core.stats.refused_messages == 4
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    core.open_room(2, T0 + 2)
    assert core.room_state(2) is RoomState.BOOTSTRAPPING and core._preaborted == {}
    assert core.remembered_holds() == 0 and core._parked == {}


def test_holds_a_refusal_is_remembered_for_a_while_and_a_bounded_number(monkeypatch: pytest.MonkeyPatch):
    """A refused identity's ABORTs count for REFUSED_FOR seconds, until it registers, and for the last
    MAX_REFUSED identities only; after that the socket is an unregistered one again."""
    core = sender(bootstrap=300.0, max_hold=1000.0)
    core.open_room(1, T0)
    core.refuse_link("late", T0)
    core.on_message("late", Abort(room_id=1, generation=1, code=ErrorCode.ABORTED, reason=""), T0 + REFUSED_FOR)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING and core.stats.refused_messages == 0
    core.refuse_link("again", T0)
    core.add_link(make_link(5, paired=(5,), key="again"))  # it registered after all: an ordinary link now
    core.on_message("again", hold(1, 600.0, gen=3), T0 + 1)
    assert core.next_deadline() == T0 + 601
    monkeypatch.setattr(holds_module, "MAX_REFUSED", 2)
    for key in ("a", "b", "c"):
        core.refuse_link(key, T0 + 2)
    core.on_message("a", Abort(room_id=1, generation=1, code=ErrorCode.ABORTED, reason=""), T0 + 3)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING  # "a" was forgotten: stale, as from any stranger
    core.on_message("c", Abort(room_id=1, generation=1, code=ErrorCode.ABORTED, reason=""), T0 + 3)
    assert core.room_state(1) is RoomState.FAILED


def test_holds_a_failed_bootstrap_tells_the_refusing_ranks():
    """``cluster_failed(tell=...)`` sends, on each told link, one ABORT per room that fails by it (the
    refusal's code, the room's generation) and every held end (its own code); without ``tell``
    nothing is sent."""
    core = receiver()
    core.cluster_pending(C)
    g1 = core.open_room(1, C, T0).generation
    g2 = core.open_room(2, C, T0).generation
    core.abort(2, T0)  # held until the bootstrap settles
    rpop(core)
    core.cluster_failed(C, ErrorCode.MODEL_MISMATCH, "refused", T0, tell=["p0"])
    o = rpop(core)
    assert sorted((m.room_id, m.generation, m.code) for m in o.to("p0")) == [
        (1, g1, ErrorCode.MODEL_MISMATCH), (2, g2, ErrorCode.ABORTED)]
    assert [(e.room_id, e.code) for e in o.ended] == [(1, ErrorCode.MODEL_MISMATCH)]
    core.cluster_pending(C)
    core.open_room(3, C, T0)
    core.cluster_failed(C, ErrorCode.MODEL_MISMATCH, "refused", T0)
    assert rpop(core).sends == []


def test_holds_pair_a_refusal_frees_the_prefill_room_at_once():
    """End to end on the cores: the decode's bootstrap is refused (MODEL_MISMATCH); its aborts on the
    refused link fail the prefill's open room at once, while a room another decode requested is
    untouched."""
    s, r = sender(bootstrap=30.0), receiver()
    s.open_room(1, T0)
    s.open_room(2, T0)
    s.on_message("d0", req(2), T0)  # the compatible decode's room
    r.cluster_pending(C)
    r.open_room(1, C, T0)
    r.open_room(2, C, T0)  # the refused decode wanted the same id: it must not touch the other's room
    s.refuse_link("refused", T0)
    r.cluster_failed(C, ErrorCode.MODEL_MISMATCH, "prefill rank 0 rejected registration", T0, tell=["refused"])
    for out in r.pop_outputs():
        if hasattr(out, "message"):
            s.on_message("refused", out.message, T0 + 0.001)
    ends = [(e.room_id, e.code) for e in s.pop_outputs() if isinstance(e, RoomEnded)]
    assert ends == [(1, ErrorCode.MODEL_MISMATCH)]
    assert s.room_state(2) is RoomState.WAITING_FOR_INPUT and s.stats.refused_messages == 1
