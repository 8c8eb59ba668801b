"""``ReceiverCore`` (a decode rank) on its own: hand-made messages and tags in, outputs checked."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvproto.core.base as core_base
from kvproto.core import Input, ReceiverCore, ReceiverLink, RoomEnded, RoomState, Send, Timeouts
from kvproto.core.events import DropLink, Scatter
from kvproto.core.staging import StagingRing
from kvproto.wire import (
    NO_SLOT,
    Abort,
    ErrorCode,
    LocalProtocolError,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    Tag,
    TagKind,
    TransferDone,
    TransferRequest,
    decode,
    encode,
)

BLOCK = 16
T0 = 500.0
C = "tcp://prefill:1"


def make_core(**kw) -> ReceiverCore:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("aux_slots", 4)
    kw.setdefault("seed", 1)
    return ReceiverCore(**kw)


def rlink(p: int = 0, *, writer: bool = True, aux_owner: bool | None = None, cluster=C,
          unit: int = 0) -> ReceiverLink:
    return ReceiverLink(key=f"p{p}", link_id=10 + p, cluster=cluster, prefill_rank=p, agent=f"agent-{p}",
                        writer=writer, aux_owner=(p == 0) if aux_owner is None else aux_owner, stage_unit=unit)


@dataclass
class Out:
    sends: list[Send]
    ended: list[RoomEnded]
    scatters: list[Scatter]
    drops: list[DropLink]

    def to(self, key) -> list:
        return [decode(encode(s.message)) for s in self.sends if s.link == key]


def pop(core: ReceiverCore) -> Out:
    outs = core.pop_outputs()
    o = Out([x for x in outs if isinstance(x, Send)], [x for x in outs if isinstance(x, RoomEnded)],
            [x for x in outs if isinstance(x, Scatter)], [x for x in outs if isinstance(x, DropLink)])
    assert len(o.sends) + len(o.ended) + len(o.scatters) + len(o.drops) == len(outs), "a receiver posts no writes"
    return o


def assert_clean(core: ReceiverCore) -> None:
    assert core.rooms == {}
    assert len(core.timers) == 0 and core.next_deadline() is None
    if core.ring is not None:
        assert (core.ring.used, core.ring.queued, core.ring.live_grants()) == (0, 0, [])


def tag(room: int, gen: int, seq: int, p: int = 0, *, link_id: int | None = None) -> bytes:
    return Tag(kind=TagKind.KV, room_id=room, generation=gen, link_id=10 + p if link_id is None else link_id,
               seq=seq).encode()


def done(room: int, gen: int, writes: int, nbytes: int = 0) -> TransferDone:
    return TransferDone(room_id=room, generation=gen, writes=writes, nbytes=nbytes)


def transferring(room: int = 1, n: int = 40, *, links=None, core: ReceiverCore | None = None,
                 **dest) -> tuple[ReceiverCore, int]:
    """A core with ``links`` ready and ``room`` TRANSFERRING; returns it and the room's generation."""
    core = core or make_core()
    if C not in core.clusters or not core.clusters[C].ready:
        core.cluster_ready(C, links or [rlink(0)], T0)
    core.open_room(room, C, T0)
    core.set_destination(room, list(range(-(-n // BLOCK))), n, T0, **dest)
    assert core.room_state(room) is RoomState.TRANSFERRING
    return core, core.rooms[room].generation


def _failed(o: Out, code) -> None:
    assert [(e.state, e.code) for e in o.ended] == [(RoomState.FAILED, code)]


def answer(core: ReceiverCore, room: int, gen: int, *keys: str, code=ErrorCode.ABORTED, now: float = T0) -> None:
    """The prefill ranks on ``keys`` answer with their ABORT: none of their writes is in flight."""
    for key in keys:
        core.on_message(key, Abort(room_id=room, generation=gen, code=code, reason="answer"), now)


def _drains_then_fails(core: ReceiverCore, room: int, gen: int, code, writers=("p0",)) -> Out:
    """The room failed while ``writers`` may still write: it stays TRANSFERRING (draining), reports
    nothing, and told them; once every one answers with ABORT it reports FAILED with ``code``
    (the original code, not the answers'). Returns what the failure sent."""
    o = pop(core)
    assert o.ended == []
    assert core.room_state(room) is RoomState.TRANSFERRING and core.rooms[room].failing
    for key in writers:
        assert [(m.generation, m.code) for m in o.to(key) if isinstance(m, Abort)] == [(gen, code)]
    for i, key in enumerate(writers):
        answer(core, room, gen, key, code=ErrorCode.TRANSPORT_ERROR if code != ErrorCode.TRANSPORT_ERROR
               else ErrorCode.ABORTED)
        if i < len(writers) - 1:
            assert pop(core).ended == [] and core.room_state(room) is RoomState.TRANSFERRING
    _failed(pop(core), code)
    assert room not in core.rooms
    return o


def _fails_at_once(core: ReceiverCore, room: int, gen: int, code, links=("p0",)) -> Out:
    """The room failed with no writer left that could still write (each completed, sent its
    TRANSFER_DONE, or answered): it reports FAILED with ``code`` at once, no drain, and tells
    ``links`` with an ABORT under its generation. Returns what the failure sent."""
    o = pop(core)
    _failed(o, code)
    assert room not in core.rooms and o.drops == []
    for key in links:
        assert [(m.generation, m.code) for m in o.to(key) if isinstance(m, Abort)] == [(gen, code)]
    return o


# --- happy paths ----------------------------------------------------------------------------------


def test_receiver_happy_path_request_then_tag_then_done():
    """Destination sends one TRANSFER_REQUEST per paired link; tag + TRANSFER_DONE complete the room."""
    core = make_core()
    core.cluster_ready(C, [rlink(0)], T0)
    core.open_room(1, C, T0)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    core.set_destination(1, [4, 5, 6], 40, T0, aux_slot=2)
    (rq,) = pop(core).to("p0")
    gen = core.rooms[1].generation
    assert gen != 0
    assert rq == TransferRequest(room_id=1, generation=gen, num_tokens=40, prefix_tokens=0, aux_slot=2,
                                 expected_writers=1, dst_pages=(4, 5, 6))
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_message("p0", done(1, gen, 1, 640), T0)
    o = pop(core)
    assert o.ended == [RoomEnded(room_id=1, state=RoomState.SUCCESS)]
    assert o.sends == []
    assert core.stats.rooms_succeeded == 1
    assert_clean(core)


def test_receiver_done_before_tags_completes_on_last_tag():
    """TRANSFER_DONE may overtake the tags; the room completes when the last seq lands."""
    core, gen = transferring()
    core.on_message("p0", done(1, gen, 3), T0)
    core.on_notification("agent-0", tag(1, gen, 2), T0)
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_notification("agent-0", tag(1, gen, 1), T0)
    assert core.room_state(1) is RoomState.SUCCESS


def test_receiver_no_aux_slot_is_sent_as_no_slot():
    """A destination without an aux slot sends NO_SLOT; a prefix travels as given."""
    core = make_core()
    core.cluster_ready(C, [rlink(0)], T0)
    core.open_room(1, C, T0)
    core.set_destination(1, [1, 2, 3], 40, T0, prefix_tokens=32)
    (rq,) = pop(core).to("p0")
    assert rq.aux_slot == NO_SLOT and rq.prefix_tokens == 32


def test_receiver_full_prefix_hit_completes_on_zero_writes():
    """TRANSFER_DONE(writes=0) completes a writer without any tag."""
    core, gen = transferring(n=32, prefix_tokens=32)
    core.on_message("p0", done(1, gen, 0), T0)
    assert [e.state for e in pop(core).ended] == [RoomState.SUCCESS]


def test_receiver_destination_before_cluster_ready_is_queued():
    """A destination given while BOOTSTRAPPING is kept and sent when the cluster becomes ready."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.set_destination(1, [1], 16, T0)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING
    assert pop(core).sends == []
    core.cluster_ready(C, [rlink(0), rlink(1, writer=False)], T0)
    o = pop(core)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert len(o.to("p0")) == 1 and len(o.to("p1")) == 1
    assert o.to("p0")[0].expected_writers == 1


def test_receiver_open_on_pending_then_ready_without_destination_waits():
    """A room opened while bootstrapping moves to WAITING_FOR_INPUT when the cluster is ready."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.cluster_ready(C, [rlink(0)], T0)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    assert pop(core).sends == []


# --- clusters -------------------------------------------------------------------------------------


def test_receiver_cluster_failed_fails_bootstrapping_rooms_and_later_opens():
    """cluster_failed fails waiting rooms with its code; new rooms fail at once until pending again."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.cluster_failed(C, ErrorCode.MODEL_MISMATCH, "nope", T0)
    _failed(pop(core), ErrorCode.MODEL_MISMATCH)
    assert core.cluster_status(C) == "failed"
    core.open_room(2, C, T0)
    _failed(pop(core), ErrorCode.MODEL_MISMATCH)
    core.cluster_pending(C)
    assert core.cluster_status(C) == "pending"
    core.open_room(3, C, T0)
    assert core.room_state(3) is RoomState.BOOTSTRAPPING
    assert core.cluster_status("elsewhere") == "unknown"


def test_receiver_cluster_ready_without_writer_fails_incompatible():
    """A cluster with no writer for this rank is INCOMPATIBLE_GEOMETRY."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.cluster_ready(C, [rlink(0, writer=False)], T0)
    _failed(pop(core), ErrorCode.INCOMPATIBLE_GEOMETRY)
    assert core.cluster_status(C) == "failed"


def test_receiver_remove_link_fails_rooms_of_its_cluster():
    """remove_link fails the cluster's rooms PEER_GONE, tells the other links, spares other clusters."""
    core = make_core()
    core.cluster_ready(C, [rlink(0), rlink(1)], T0)
    other = [ReceiverLink(key="q0", link_id=99, cluster="other", prefill_rank=0, agent="q", writer=True,
                          aux_owner=True)]
    core.cluster_ready("other", other, T0)
    core.open_room(1, C, T0)  # WAITING: links known, the generation chosen at open
    gen1 = core.rooms[1].generation
    core.open_room(2, C, T0)
    core.set_destination(2, [1], 16, T0)
    gen2 = core.rooms[2].generation
    core.open_room(3, "other", T0)
    core.set_destination(3, [1], 16, T0)
    pop(core)
    core.remove_link("p1", T0)
    o = pop(core)
    # room 2's other writer p0 may still write: it drains until p0 answers
    assert [(e.room_id, e.code) for e in o.ended] == [(1, ErrorCode.PEER_GONE)]
    assert sorted((m.room_id, m.generation, m.code) for m in o.to("p0")) == [
        (1, gen1, ErrorCode.PEER_GONE), (2, gen2, ErrorCode.PEER_GONE)]
    assert o.to("p1") == [] and o.to("q0") == []
    assert core.rooms[2].failing and core.rooms[2].settled == {11}
    answer(core, 2, gen2, "p0")
    _failed(pop(core), ErrorCode.PEER_GONE)
    assert core.room_state(3) is RoomState.TRANSFERRING
    assert core.cluster_status(C) == "failed"
    assert 10 not in core.links_by_id and 11 not in core.links_by_id and 99 in core.links_by_id
    core.remove_link("p1", T0)  # unknown now: nothing
    assert pop(core).ended == []


# --- destination validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pages, n, kw, code",
    [
        ([1, 2], 40, {}, ErrorCode.TOKEN_COUNT_MISMATCH),
        ([1, 2, 3, 4], 40, {}, ErrorCode.TOKEN_COUNT_MISMATCH),
        ([], 0, {}, ErrorCode.TOKEN_COUNT_MISMATCH),
        ([1, 2, 64], 40, {}, ErrorCode.INDEX_OUT_OF_RANGE),
        ([1, -1, 2], 40, {}, ErrorCode.INDEX_OUT_OF_RANGE),
        ([1, 2, 3], 40, dict(prefix_tokens=8), ErrorCode.PEER_PROTOCOL_ERROR),
        ([1, 2, 3], 40, dict(prefix_tokens=48), ErrorCode.PEER_PROTOCOL_ERROR),
        ([1, 2, 3], 40, dict(aux_slot=4), ErrorCode.INDEX_OUT_OF_RANGE),
        ([1, 2, 1], 40, {}, ErrorCode.INDEX_OUT_OF_RANGE),
    ],
    ids=["few-pages", "many-pages", "zero-tokens", "page-oob", "page-neg", "prefix-block", "prefix-beyond",
         "aux-oob", "page-twice"],
)
def test_receiver_set_destination_misuse_raises(pages, n, kw, code):
    """A bad destination raises LocalProtocolError with its code and sends nothing."""
    core = make_core()
    core.cluster_ready(C, [rlink(0)], T0)
    core.open_room(1, C, T0)
    with pytest.raises(LocalProtocolError) as info:
        core.set_destination(1, pages, n, T0, **kw)
    assert info.value.code is code
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT and core.rooms[1].destination is None
    assert pop(core).sends == []


@pytest.mark.parametrize("ready", [False, True], ids=["bootstrapping", "transferring"])
def test_receiver_destination_twice_raises(ready):
    """A second destination is API misuse, whatever the state."""
    core = make_core()
    if ready:
        core.cluster_ready(C, [rlink(0)], T0)
    else:
        core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.set_destination(1, [1], 16, T0)
    with pytest.raises(LocalProtocolError):
        core.set_destination(1, [1], 16, T0)


def test_receiver_destination_for_unknown_or_ended_room():
    """A destination for a room never opened raises UNKNOWN_ROOM; for an ended room it is counted."""
    core = make_core()
    with pytest.raises(LocalProtocolError) as info:
        core.set_destination(1, [1], 16, T0)
    assert info.value.code is ErrorCode.UNKNOWN_ROOM
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.abort(1, T0)
    core.set_destination(1, [1], 16, T0)
    assert core.stats.late_messages == 1


def test_receiver_open_room_misuse_raises():
    """A live room id cannot be opened twice; ids must lie in [1, 2**64)."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    with pytest.raises(LocalProtocolError) as info:
        core.open_room(1, C, T0)
    assert info.value.code is ErrorCode.DUPLICATE_ROOM
    for bad in (0, 2**64):
        with pytest.raises(LocalProtocolError):
            core.open_room(bad, C, T0)


# --- generations --------------------------------------------------------------------------------------


def test_receiver_generations_are_fresh_and_nonzero():
    """Every request round of every room gets a new non-zero generation, wrapping past 2**32 - 1."""
    core = make_core()
    core.cluster_ready(C, [rlink(0)], T0)
    core._generation = 0xFFFFFFFF - 1
    gens = []
    for room in (1, 2, 3):
        core.open_room(room, C, T0)
        core.set_destination(room, [1], 16, T0)
        gens.append(core.rooms[room].generation)
    assert gens == [0xFFFFFFFF, 1, 2]


def test_receiver_reused_room_id_ignores_old_generation():
    """A room id reused after failure never completes from the old generation's tags or DONE."""
    core, old = transferring(1, 16)
    core.abort(1, T0)
    with pytest.raises(LocalProtocolError):  # still draining: the id is live until prefill answers
        core.open_room(1, C, T0)
    answer(core, 1, old, "p0")
    pop(core)
    core.open_room(1, C, T0)
    core.set_destination(1, [2], 16, T0)
    new = core.rooms[1].generation
    assert new != old
    core.on_notification("agent-0", tag(1, old, 0), T0)
    core.on_message("p0", done(1, old, 1), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert core.stats.stale_tags == 2
    core.on_message("p0", Abort(room_id=1, generation=old, code=ErrorCode.ABORTED, reason="old"), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_notification("agent-0", tag(1, new, 0), T0)
    core.on_message("p0", done(1, new, 1), T0)
    assert core.room_state(1) is RoomState.SUCCESS


# --- tags ---------------------------------------------------------------------------------------------


def test_receiver_duplicate_tags_are_idempotent():
    """The same tag any number of times counts once."""
    core, gen = transferring()
    for _ in range(5):
        core.on_notification("agent-0", tag(1, gen, 0), T0)
    core.on_message("p0", done(1, gen, 2), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_notification("agent-0", tag(1, gen, 1), T0)
    assert core.room_state(1) is RoomState.SUCCESS
    core.on_notification("agent-0", tag(1, gen, 1), T0)  # after the end: late
    assert core.stats.late_messages == 1


@pytest.mark.parametrize("data", [b"", b"KT", b"XX" + bytes(22), tag(1, 1, 0)[:-1] + b"\x00\x00",
                                  b"KT\x02" + bytes(21), b"KT\x01\x09" + bytes(20)],
                         ids=["empty", "short", "magic", "long", "version", "kind"])
def test_receiver_malformed_tag_counted(data):
    """A notification that is not a tag is counted, never raised, and touches no room."""
    core, _ = transferring()
    core.on_notification("agent-0", data, T0)
    assert core.stats.peer_violations == 1
    assert core.room_state(1) is RoomState.TRANSFERRING


def test_receiver_spoofed_agent_tag_ignored():
    """A tag naming link 10 but reported from another agent is ignored (counted), room untouched."""
    core, gen = transferring()
    core.on_message("p0", done(1, gen, 1), T0)
    core.on_notification("mallory", tag(1, gen, 0), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert core.stats.peer_violations == 1
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    assert core.room_state(1) is RoomState.SUCCESS


def test_receiver_tag_of_unknown_link_id_ignored():
    """A tag naming a link id this rank never assigned is counted and ignored."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(1, gen, 0, link_id=77), T0)
    assert core.stats.peer_violations == 1
    assert core.room_state(1) is RoomState.TRANSFERRING


def test_receiver_stale_generation_tag_dropped():
    """A tag of another generation of a live room is stale: dropped and counted."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(1, gen + 1, 0), T0)
    assert core.stats.stale_tags == 1
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert core.rooms[1].writers[10].seqs == set()


def test_receiver_tag_for_unknown_room_counted():
    """A tag for a room never seen counts as unknown; for an ended room as late."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(99, gen, 0), T0)
    assert core.stats.unknown_room_messages == 1
    core.abort(1, T0)
    answer(core, 1, gen, "p0")
    assert core.room_state(1) is RoomState.FAILED
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    assert core.stats.late_messages == 1


def test_receiver_tag_from_non_writer_link_is_violation():
    """A tag from a paired link that is not a writer fails the room PEER_PROTOCOL_ERROR."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    pop(core)
    core.on_notification("agent-1", tag(1, gen, 0, p=1), T0)
    o = _drains_then_fails(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)
    assert [m.code for m in o.to("p0")] == [ErrorCode.PEER_PROTOCOL_ERROR]
    assert [m.code for m in o.to("p1")] == [ErrorCode.PEER_PROTOCOL_ERROR]
    assert core.stats.peer_violations == 1


def test_receiver_tag_seq_beyond_writes_is_violation():
    """After TRANSFER_DONE(writes=n), a tag with seq >= n fails the room, at once: the writer sent
    TRANSFER_DONE after all its writes, so nothing of it can still land (no drain)."""
    core, gen = transferring()
    core.on_message("p0", done(1, gen, 2), T0)
    core.on_notification("agent-0", tag(1, gen, 2), T0)
    _fails_at_once(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)
    assert core.stats.peer_violations == 1
    assert_clean(core)


def test_receiver_done_fewer_than_seen_tags_is_violation():
    """TRANSFER_DONE(writes=n) after a tag with seq >= n fails the room."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(1, gen, 3), T0)
    core.on_message("p0", done(1, gen, 3), T0)
    _drains_then_fails(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_second_transfer_done_is_violation():
    """Two TRANSFER_DONEs from one writer fail the room (at once: the first one settled the writer)."""
    core, gen = transferring()
    core.on_message("p0", done(1, gen, 2), T0)
    core.on_message("p0", done(1, gen, 2), T0)
    _fails_at_once(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)
    assert core.stats.peer_violations == 1
    assert_clean(core)


def test_receiver_transfer_done_from_non_writer_is_violation():
    """TRANSFER_DONE from a paired non-writer fails the room."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    core.on_message("p1", done(1, gen, 0), T0)
    _drains_then_fails(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_unexpected_message_is_violation():
    """A TRANSFER_REQUEST sent to a decode rank fails the room PEER_PROTOCOL_ERROR."""
    core, gen = transferring()
    core.on_message("p0", TransferRequest(room_id=1, generation=gen, num_tokens=1, prefix_tokens=0,
                                          aux_slot=NO_SLOT, expected_writers=1, dst_pages=(1,)), T0)
    _drains_then_fails(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_message_from_foreign_link_is_stale():
    """A message for the room from a link that is not the room's is dropped as stale."""
    core, gen = transferring()
    core.on_message("stranger", done(1, gen, 0), T0)
    core.on_message("p0", done(1, gen + 5, 0), T0)
    assert core.stats.stale_tags == 2
    assert core.room_state(1) is RoomState.TRANSFERRING


def test_receiver_completion_counted_per_writer():
    """Two writers: the room completes only when both writers' DONE and every seq arrived."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    for _ in range(2):  # the same number of tags from one writer, twice
        core.on_notification("agent-0", tag(1, gen, 0), T0)
        core.on_notification("agent-0", tag(1, gen, 1), T0)
    core.on_message("p0", done(1, gen, 2), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_message("p1", done(1, gen, 2), T0)
    core.on_notification("agent-1", tag(1, gen, 1, p=1), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_notification("agent-1", tag(1, gen, 0, p=1), T0)
    assert core.room_state(1) is RoomState.SUCCESS


def test_receiver_peer_violation_api():
    """peer_violation() fails the room for its own link and generation; otherwise only counts."""
    core, gen = transferring()
    core.peer_violation("p0", 1, gen + 1, ErrorCode.MALFORMED_FRAME, "x", T0)
    core.peer_violation("zz", 1, gen, ErrorCode.MALFORMED_FRAME, "x", T0)
    core.peer_violation("p0", 2, gen, ErrorCode.MALFORMED_FRAME, "x", T0)
    assert core.stats.peer_violations == 3
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.peer_violation("p0", 1, gen, ErrorCode.MALFORMED_FRAME, "x", T0)
    _drains_then_fails(core, 1, gen, ErrorCode.MALFORMED_FRAME)
    assert core.stats.peer_violations == 4


# --- aborts and deadlines ---------------------------------------------------------------------------


def test_receiver_peer_abort_fails_room_with_its_code():
    """prefill's ABORT fails the room with prefill's code; the other links hear, the sender does not;
    the room reports FAILED once the other writer answers too (it may still be writing)."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    pop(core)
    core.on_message("p1", Abort(room_id=1, generation=gen, code=ErrorCode.TRANSPORT_ERROR, reason="x"), T0)
    o = _drains_then_fails(core, 1, gen, ErrorCode.TRANSPORT_ERROR, writers=("p0",))
    assert o.to("p1") == []


def test_receiver_peer_abort_from_only_writer_fails_at_once():
    """An ABORT from the only writer settles it: nothing can land any more, the room fails at once."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    pop(core)
    answer(core, 1, gen, "p0", code=ErrorCode.TRANSPORT_ERROR)
    o = pop(core)
    _failed(o, ErrorCode.TRANSPORT_ERROR)
    assert o.to("p0") == [] and [m.code for m in o.to("p1")] == [ErrorCode.TRANSPORT_ERROR]
    assert_clean(core)


@pytest.mark.parametrize("state", [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING])
def test_receiver_local_abort_in_each_state(state):
    """abort() fails the room ABORTED once; only a room that has sent requests tells prefill."""
    core = make_core()
    if state is RoomState.BOOTSTRAPPING:
        core.cluster_pending(C)
        core.open_room(1, C, T0)
    elif state is RoomState.WAITING_FOR_INPUT:
        core.cluster_ready(C, [rlink(0)], T0)
        core.open_room(1, C, T0)
    else:
        transferring(core=core)
    assert core.room_state(1) is state
    gen = core.rooms[1].generation
    assert gen != 0  # chosen when the room opened (minor 1)
    pop(core)
    core.abort(1, T0)
    core.abort(1, T0)
    if state is RoomState.TRANSFERRING:  # the writer may still write: drain first
        _drains_then_fails(core, 1, gen, ErrorCode.ABORTED)
        assert_clean(core)
        return
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    expect = [(gen, ErrorCode.ABORTED)] if state is RoomState.WAITING_FOR_INPUT else []  # links known
    assert [(m.generation, m.code) for m in o.to("p0")] == expect
    assert_clean(core)


def test_receiver_bootstrap_deadline_fires_exactly():
    """A room whose cluster never becomes ready fails BOOTSTRAP_TIMEOUT exactly 30 s after opening."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.set_destination(1, [1], 16, T0 + 5)  # queued: not progress
    assert core.next_deadline() == T0 + 30
    core.handle_timer(T0 + 29.9999)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING
    core.handle_timer(T0 + 30)
    o = pop(core)
    _failed(o, ErrorCode.BOOTSTRAP_TIMEOUT)
    assert o.sends == []
    assert_clean(core)


def test_receiver_waiting_deadline_fires_exactly():
    """A room without a destination fails WAITING_TIMEOUT exactly 300 s after its links were ready."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.cluster_ready(C, [rlink(0)], T0 + 10)
    core.handle_timer(T0 + 309.99)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    core.handle_timer(T0 + 310)
    _failed(pop(core), ErrorCode.WAITING_TIMEOUT)


def test_receiver_transfer_deadline_refreshes_on_progress():
    """TRANSFER_TIMEOUT fires 300 s after the last arrival or DONE, and tells every link."""
    core, gen = transferring()
    pop(core)
    assert core.next_deadline() == T0 + 300
    core.on_notification("agent-0", tag(1, gen, 0), T0 + 100)
    assert core.next_deadline() == T0 + 400
    core.on_message("p0", done(1, gen, 2), T0 + 200)
    assert core.next_deadline() == T0 + 500
    core.on_notification("agent-0", tag(1, gen, 0), T0 + 300)  # a duplicate is still a sign of life
    core.handle_timer(T0 + 599.999)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.handle_timer(T0 + 600)
    # tag 1 never came, but the writer's TRANSFER_DONE settled it: no drain
    _fails_at_once(core, 1, gen, ErrorCode.TRANSFER_TIMEOUT)
    assert_clean(core)


def test_receiver_transfer_deadline_without_transfer_done_drains():
    """TRANSFER_TIMEOUT with the writer's TRANSFER_DONE not in yet: the writer may still write, so
    the room drains until it answers (the timeout's twin of the test above)."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(1, gen, 0), T0 + 100)
    core.handle_timer(T0 + 400)
    _drains_then_fails(core, 1, gen, ErrorCode.TRANSFER_TIMEOUT)
    assert_clean(core)


def test_receiver_close_fails_every_live_room_once():
    """close() fails every live room ENDPOINT_CLOSED once (a TRANSFERRING one once its writer has
    answered), tells prefill for sent requests, is idempotent, and refuses new rooms."""
    core, gen = transferring(1)
    core.open_room(2, C, T0)
    gen2 = core.rooms[2].generation
    pop(core)
    core.close(T0)
    o = pop(core)
    assert [(e.room_id, e.code) for e in o.ended] == [(2, ErrorCode.ENDPOINT_CLOSED)]  # 1 drains
    assert sorted((m.room_id, m.generation) for m in o.to("p0")) == [(1, gen), (2, gen2)]
    core.close(T0)
    assert pop(core).ended == []
    with pytest.raises(LocalProtocolError):
        core.open_room(3, C, T0)
    answer(core, 1, gen, "p0", code=ErrorCode.ENDPOINT_CLOSED)
    _failed(pop(core), ErrorCode.ENDPOINT_CLOSED)
    assert_clean(core)


def test_receiver_room_traces_released_on_end():
    """An ended room drops its writers' progress and its links."""
    core, gen = transferring()
    room = core.rooms[1]
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    core.on_message("p0", done(1, gen, 1), T0)
    assert room.writers == {} and room.links == ()
    assert_clean(core)


def test_receiver_no_deadline_when_timeouts_none():
    """With every timeout None, a transferring room waits forever."""
    core, _ = transferring(core=make_core(timeouts=Timeouts(bootstrap=None, waiting=None, transfer=None)))
    core.handle_timer(T0 + 1e9)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert core.next_deadline() is None


# --- drain: failing while writers may still write (minor 1) ------------------------------------------


def test_receiver_generation_chosen_when_room_opens():
    """A room has its generation from open_room on; its TRANSFER_REQUESTs carry that generation."""
    core = make_core()
    core.cluster_ready(C, [rlink(0)], T0)
    core.open_room(1, C, T0)
    gen = core.rooms[1].generation
    assert gen != 0 and core.room_state(1) is RoomState.WAITING_FOR_INPUT
    core.set_destination(1, [1], 16, T0)
    assert [m.generation for m in pop(core).to("p0")] == [gen]


def test_receiver_waiting_failure_tells_every_paired_link():
    """A room failing in WAITING_FOR_INPUT (no request sent yet) sends ABORT with its generation to
    every paired prefill rank, writer or not, and fails at once: nothing can be writing into it."""
    core = make_core()
    core.cluster_ready(C, [rlink(0), rlink(1, writer=False)], T0)
    core.open_room(1, C, T0)
    gen = core.rooms[1].generation
    core.handle_timer(T0 + 300)
    o = pop(core)
    _failed(o, ErrorCode.WAITING_TIMEOUT)
    for key in ("p0", "p1"):
        assert [(m.generation, m.code) for m in o.to(key)] == [(gen, ErrorCode.WAITING_TIMEOUT)]
    assert_clean(core)


def test_receiver_drain_never_reports_failed_while_a_writer_may_write():
    """Aborted while TRANSFERRING with a writer that has neither completed nor answered: the room
    stays TRANSFERRING (its pages out of reuse) through any number of events; the writer's
    ABORT (sent only when none of its writes is in flight) ends it FAILED, once, with ABORTED."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    pop(core)
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    core.abort(1, T0 + 1)
    o = pop(core)
    assert o.ended == [] and core.room_state(1) is RoomState.TRANSFERRING
    assert [(m.generation, m.code) for m in o.to("p0")] == [(gen, ErrorCode.ABORTED)]
    assert [(m.generation, m.code) for m in o.to("p1")] == [(gen, ErrorCode.ABORTED)]
    core.abort(1, T0 + 2)  # again: still draining, nothing new
    core.on_notification("agent-0", tag(1, gen, 1), T0 + 2)  # a write that was in flight lands
    core.on_message("p1", Abort(room_id=1, generation=gen, code=ErrorCode.ABORTED, reason="non-writer"), T0 + 3)
    with pytest.raises(LocalProtocolError):
        core.set_destination(1, [1, 2, 3], 40, T0 + 3)
    o = pop(core)
    assert o.ended == [] and o.sends == [] and core.room_state(1) is RoomState.TRANSFERRING
    answer(core, 1, gen, "p0", code=ErrorCode.ABORTED, now=T0 + 4)
    o = pop(core)
    assert o.ended == [RoomEnded(room_id=1, state=RoomState.FAILED, code=ErrorCode.ABORTED,
                                 reason="aborted by the application")]
    assert o.sends == []
    assert core.stats.rooms_failed == 1
    answer(core, 1, gen, "p0")  # a second answer is late
    assert core.stats.late_messages == 1 and pop(core).ended == []
    assert_clean(core)


def test_receiver_drain_classifies_every_input(monkeypatch):
    """Every input of a draining room is DRAIN_PROGRESS or DRAINED (the first failure DRAIN)."""
    seen: list[tuple[RoomState, Input]] = []
    real = core_base.transition

    def spy(role, state, inp):
        seen.append((state, inp))
        return real(role, state, inp)

    monkeypatch.setattr(core_base, "transition", spy)
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    seen.clear()
    core.on_message("p0", Abort(room_id=1, generation=gen, code=ErrorCode.TRANSPORT_ERROR, reason=""), T0)
    core.on_notification("agent-1", tag(1, gen, 0, p=1), T0)
    core.abort(1, T0)
    core.peer_violation("p1", 1, gen, ErrorCode.MALFORMED_FRAME, "x", T0)
    core.on_notification("agent-1", tag(1, gen, 2, p=1), T0)
    core.on_notification("agent-1", tag(1, gen, 1, p=1), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.on_message("p1", done(1, gen, 3), T0)  # p1 settles: the last unsettled writer
    assert len(seen) == 7
    assert seen[0] == (RoomState.TRANSFERRING, Input.DRAIN)
    assert {inp for _, inp in seen[1:-1]} == {Input.DRAIN_PROGRESS}
    assert seen[-1] == (RoomState.TRANSFERRING, Input.DRAINED)
    _failed(pop(core), ErrorCode.TRANSPORT_ERROR)  # completing while draining is not SUCCESS


def test_receiver_drain_waits_for_every_writer():
    """Two writers: the room fails only when the second one has answered as well."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    core.handle_timer(T0 + 300)
    _drains_then_fails(core, 1, gen, ErrorCode.TRANSFER_TIMEOUT, writers=("p1", "p0"))
    assert_clean(core)


def test_receiver_drain_settles_when_writer_sends_transfer_done():
    """A writer whose TRANSFER_DONE arrives while the room drains is settled at once, even though
    some of its tags never came: it sent TRANSFER_DONE only after all its writes were over. The
    room reports FAILED (never SUCCESS) without waiting for the tags or the drain deadline; a tag
    that comes after is late."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(1, gen, 1), T0)
    core.abort(1, T0)
    assert pop(core).ended == []
    core.on_message("p0", done(1, gen, 3), T0 + 1)  # tags 0 and 2 are lost
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    assert o.sends == [] and o.drops == []
    assert core.stats.rooms_succeeded == 0
    core.on_notification("agent-0", tag(1, gen, 0), T0 + 2)
    assert core.stats.late_messages == 1
    assert_clean(core)


def test_receiver_failure_after_transfer_done_with_lost_tag_fails_at_once():
    """The room fails after its only writer's TRANSFER_DONE while a tag is still missing (lost): it
    reports FAILED at once (ABORT_PEERS), without draining or waiting for the drain deadline."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    core.on_message("p0", done(1, gen, 2), T0)  # tag 1 is lost
    pop(core)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.abort(1, T0 + 1)
    _fails_at_once(core, 1, gen, ErrorCode.ABORTED, links=("p0", "p1"))
    assert core.next_deadline() is None
    assert_clean(core)


def test_receiver_transfer_done_settles_only_its_writer():
    """Two writers, p0's TRANSFER_DONE in (one tag lost), p1 silent: a failure drains for p1 only;
    p1's answer ends the room, p0's missing tag is never waited for."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    core.on_message("p0", done(1, gen, 2), T0)
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    pop(core)
    core.abort(1, T0)
    o = pop(core)
    assert o.ended == [] and core.rooms[1].failing
    assert [m.code for m in o.to("p0")] == [ErrorCode.ABORTED] == [m.code for m in o.to("p1")]
    answer(core, 1, gen, "p1")
    _failed(pop(core), ErrorCode.ABORTED)
    assert_clean(core)


def test_receiver_drain_settles_when_writer_link_removed():
    """A draining room whose unanswered writer's link is removed fails with its original code."""
    core, gen = transferring()
    core.abort(1, T0)
    pop(core)
    core.remove_link("p0", T0)
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    assert o.sends == []
    assert_clean(core)


@pytest.mark.parametrize("how", ["abort", "link-removed"])
def test_receiver_failure_settling_the_last_writer_does_not_drain(how):
    """Two writers, p0 complete: p1's ABORT (or its link's loss) settles the last writer that could
    still write, so the room fails at once (ABORT_PEERS), without a drain."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    core.on_message("p0", done(1, gen, 1), T0)
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    pop(core)
    if how == "abort":
        answer(core, 1, gen, "p1", code=ErrorCode.TRANSPORT_ERROR)
        code = ErrorCode.TRANSPORT_ERROR
    else:
        core.remove_link("p1", T0)
        code = ErrorCode.PEER_GONE
    o = pop(core)
    _failed(o, code)
    assert [m.code for m in o.to("p0")] == [code] and o.to("p1") == []
    assert_clean(core)


@pytest.mark.parametrize("steps", [(10.0,), (10 - 2**-10, 2**-10)], ids=["one-step", "two-steps"])
def test_receiver_drain_deadline_forces_report(steps):
    """Nobody answers: the drain deadline (Timeouts.drain, 10 s from the failure, not re-armed by
    progress) forces the report, with the original code, after a DropLink (PEER_GONE) of the
    writer that did not answer; the staging regions are released then."""
    core, gen = transferring(core=make_core(staging=StagingRing(4096)), links=[rlink(0, unit=256)])
    core.on_message("p0", StagingRequest(room_id=1, generation=gen, seq=0, start_token=0, end_token=16), T0)
    assert core.ring.live_grants() != []
    core.abort(1, T0 + 1)
    pop(core)
    assert core.next_deadline() == T0 + 11
    core.on_notification("agent-0", tag(1, gen, 1), T0 + 5)  # progress while draining: no re-arm
    assert core.next_deadline() == T0 + 11
    now = T0 + 1
    for dt in steps[:-1]:
        now += dt
        core.handle_timer(now)
        assert core.room_state(1) is RoomState.TRANSFERRING and core.ring.live_grants() != []
    core.handle_timer(now + steps[-1])
    outs = core.pop_outputs()
    assert [type(x) for x in outs] == [DropLink, RoomEnded]  # the link is dropped before the report
    assert outs[0] == DropLink(link="p0", code=ErrorCode.PEER_GONE,
                               reason="prefill rank 0 did not answer an ABORT within 10.0s")
    assert (outs[1].state, outs[1].code) == (RoomState.FAILED, ErrorCode.ABORTED)
    assert_clean(core)


def test_receiver_drain_deadline_drops_only_unsettled_writers():
    """Three writers: p0 answered, p1 sent TRANSFER_DONE (a tag lost), p2 silent: at the drain
    deadline only p2's link is dropped, then FAILED is reported with the original code."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False), rlink(2, aux_owner=False)])
    core.on_message("p1", done(1, gen, 2), T0)
    core.on_notification("agent-1", tag(1, gen, 1, p=1), T0)
    core.handle_timer(T0 + 300)
    o = pop(core)
    assert o.ended == [] and o.drops == []
    answer(core, 1, gen, "p0", code=ErrorCode.TRANSFER_TIMEOUT)
    assert pop(core).ended == []
    core.handle_timer(T0 + 310)
    o = pop(core)
    assert [(d.link, d.code) for d in o.drops] == [("p2", ErrorCode.PEER_GONE)]
    _failed(o, ErrorCode.TRANSFER_TIMEOUT)
    assert_clean(core)


def test_receiver_drain_deadline_with_only_a_scatter_running_drops_no_link():
    """The writer settled (its ABORT came) but a scatter of the room still runs: the drain deadline
    drops no link (no peer failed to answer) and the room reports once the scatter, which writes
    its pages, is over (a local copy always ends)."""
    core = staging_core()
    core.open_room(1, C, T0)
    core.set_destination(1, [1], 16, T0)
    gen = core.rooms[1].generation
    core.on_message("p0", sreq(1, gen, 0, 0, 16), T0)
    core.on_notification("agent-0", staged(1, gen, 0), T0)
    core.abort(1, T0)
    answer(core, 1, gen, "p0")
    assert pop(core).ended == [] and core.room_state(1) is RoomState.TRANSFERRING
    core.handle_timer(T0 + 10)
    o = pop(core)
    assert o.drops == [] and o.ended == []
    core.scatter_done(1, 10, 0, T0 + 11)
    _failed(pop(core), ErrorCode.ABORTED)
    assert_clean(core)


def test_receiver_drop_link_performed_fails_the_links_other_rooms():
    """The I/O layer performs a DropLink with remove_link(PEER_GONE): every other room of the link
    fails PEER_GONE (one waiting, one transferring), the cluster fails, and a room opened on it then
    fails at once until the cluster bootstraps again."""
    core, gen = transferring(1)
    core.open_room(2, C, T0)  # WAITING_FOR_INPUT
    core, gen3 = transferring(3, core=core)
    core.on_notification("agent-0", tag(3, gen3, 0), T0)
    pop(core)
    core.abort(1, T0)
    pop(core)
    core.handle_timer(T0 + 10)
    o = pop(core)
    (drop,) = o.drops
    _failed(o, ErrorCode.ABORTED)
    core.remove_link(drop.link, T0 + 10, code=drop.code, reason=drop.reason)
    o = pop(core)
    assert sorted((e.room_id, e.state, e.code) for e in o.ended) == [
        (2, RoomState.FAILED, ErrorCode.PEER_GONE), (3, RoomState.FAILED, ErrorCode.PEER_GONE)]
    assert o.to("p0") == []  # nothing is said to a dropped link
    assert core.cluster_status(C) == "failed"
    core.open_room(4, C, T0 + 11)
    _failed(pop(core), ErrorCode.PEER_GONE)
    core.cluster_pending(C)
    core.cluster_ready(C, [rlink(0)], T0 + 12)
    core, gen5 = transferring(5, core=core)
    core.on_notification("agent-0", tag(5, gen5, 0), T0 + 12)
    core.on_message("p0", done(5, gen5, 1), T0 + 12)
    assert [e.state for e in pop(core).ended] == [RoomState.SUCCESS]
    assert_clean(core)


def test_receiver_close_drains():
    """close() with a writer unsettled drains like any failure (the cache outlives the endpoint, so
    a late write would land in pages the application reused): ABORT, then FAILED ENDPOINT_CLOSED
    only once the writer answered; its staging regions are released then."""
    core, gen = transferring(core=make_core(staging=StagingRing(4096)), links=[rlink(0, unit=256)])
    core.on_message("p0", StagingRequest(room_id=1, generation=gen, seq=0, start_token=0, end_token=16), T0)
    pop(core)
    core.close(T0)
    _drains_then_fails(core, 1, gen, ErrorCode.ENDPOINT_CLOSED)
    assert_clean(core)


def test_receiver_close_drain_ends_at_its_deadline_or_when_fenced():
    """A drain left by close() ends at its drain deadline (dropping the silent writer's link), or
    earlier when the endpoint has fenced the data plane (``fenced``: transport closed)."""
    core, gen = transferring()
    pop(core)
    core.close(T0)
    pop(core)
    core.handle_timer(T0 + core.timeouts.drain)
    o = pop(core)
    _failed(o, ErrorCode.ENDPOINT_CLOSED)
    assert [d.link for d in o.drops] == ["p0"]
    core, gen = transferring()
    core.close(T0)
    pop(core)
    core.fenced(T0 + 1)
    o = pop(core)
    _failed(o, ErrorCode.ENDPOINT_CLOSED)
    assert o.drops == [] and o.sends == []
    assert_clean(core)


def test_receiver_close_while_draining_keeps_draining_with_original_code():
    """close() during a drain does not cut it short; the room reports the failure's own code."""
    core, gen = transferring()
    core.handle_timer(T0 + 300)
    pop(core)
    core.close(T0 + 301)
    o = pop(core)
    assert o.ended == [] and o.sends == []
    answer(core, 1, gen, "p0")
    _failed(pop(core), ErrorCode.TRANSFER_TIMEOUT)
    assert_clean(core)


def test_receiver_transfer_done_with_zero_writes_but_tokens_to_move_is_violation():
    """TRANSFER_DONE(writes=0) while tokens past the prefix must move is PEER_PROTOCOL_ERROR."""
    core, gen = transferring(n=40, prefix_tokens=16)
    core.on_message("p0", done(1, gen, 0), T0)
    _drains_then_fails(core, 1, gen, ErrorCode.PEER_PROTOCOL_ERROR)
    assert core.stats.rooms_succeeded == 0


# --- staging (minor 1) ---------------------------------------------------------------------------------

UNIT = 256
RING = 4096  # 16 units


def staging_core(*, ring: int | None = RING, links=None, **kw) -> ReceiverCore:
    core = make_core(staging=StagingRing(ring) if ring is not None else None, **kw)
    core.cluster_ready(C, links or [rlink(0, unit=UNIT)], T0)
    return core


def sreq(room: int, gen: int, seq: int, start: int, end: int) -> StagingRequest:
    return StagingRequest(room_id=room, generation=gen, seq=seq, start_token=start, end_token=end)


def staged(room: int, gen: int, seq: int, p: int = 0) -> bytes:
    return Tag(kind=TagKind.STAGED, room_id=room, generation=gen, link_id=10 + p, seq=seq).encode()


def stage(core: ReceiverCore, room: int, gen: int, seq: int, start: int, end: int, p: int = 0,
          now: float = T0) -> int:
    """Writer ``p`` moves tokens [start, end) through the ring (as many pieces as grants allow),
    each piece scattered at once. Returns the next seq."""
    key, agent = f"p{p}", f"agent-{p}"
    while start < end:
        core.on_message(key, sreq(room, gen, seq, start, end), now)
        (g,) = [m for m in pop(core).to(key) if isinstance(m, StagingGrant)]
        assert (g.seq, g.start_token) == (seq, start) and start < g.end_token <= end
        core.on_notification(agent, staged(room, gen, seq, p), now)
        (sc,) = pop(core).scatters
        assert (sc.seq, sc.offset, sc.start_token, sc.end_token) == (seq, g.offset, start, g.end_token)
        core.scatter_done(room, 10 + p, seq, now)
        (wm,) = [m for m in pop(core).to(key) if isinstance(m, StagingWatermark)]
        assert wm.seq == seq
        start, seq = g.end_token, seq + 1
    return seq


def staging_room() -> tuple[ReceiverCore, int]:
    """A staging core with room 1 TRANSFERRING into pages [4, 5, 6] for 40 tokens; its generation."""
    core = staging_core()
    core.open_room(1, C, T0)
    core.set_destination(1, [4, 5, 6], 40, T0)
    gen = core.rooms[1].generation
    pop(core)
    return core, gen


def test_receiver_staging_happy_path_partial_grants():
    """A request larger than the ring is granted in pieces (FIFO); each STAGED tag becomes a Scatter
    output; a piece counts as arrived only at scatter_done, which releases the region and answers
    with a watermark; TRANSFER_DONE completes the room; the ring ends empty."""
    core, gen = staging_room()
    core.on_message("p0", sreq(1, gen, 0, 0, 40), T0)
    (g,) = pop(core).to("p0")
    assert g == StagingGrant(room_id=1, generation=gen, seq=0, start_token=0, end_token=16, offset=0)
    core.on_notification("agent-0", staged(1, gen, 0), T0)
    core.on_notification("agent-0", staged(1, gen, 0), T0)  # a duplicate tag: one scatter
    (sc,) = pop(core).scatters
    assert sc == Scatter(room_id=1, link="p0", seq=0, offset=0, start_token=0, end_token=16, dst_pages=(4, 5, 6))
    assert core.rooms[1].writers[10].seqs == set()  # not arrived before its scatter
    core.scatter_done(1, 10, 0, T0)
    (wm,) = pop(core).to("p0")
    assert (wm.seq, wm.watermark) == (0, RING)
    assert core.rooms[1].writers[10].seqs == {0}
    nxt = stage(core, 1, gen, 1, 16, 40)
    assert nxt == 3 and core.room_state(1) is RoomState.TRANSFERRING
    core.on_message("p0", done(1, gen, 3), T0)
    assert core.room_state(1) is RoomState.SUCCESS
    assert_clean(core)


@pytest.mark.parametrize("done_first", [False, True])
def test_receiver_staging_writer_that_stops_short_fails_the_room(done_first):
    """A writer that staged tokens [0, 16) of 40 and reports its one write done is complete by
    count, yet tokens 16-39 were never granted, so they cannot have landed: the room fails with
    TOKEN_COUNT_MISMATCH (naming the gap), whether TRANSFER_DONE comes before the piece's scatter or
    after it, and never succeeds; the ring ends empty. A writer that staged all 40 succeeds (the
    happy path above)."""
    core, gen = staging_room()
    core.on_message("p0", sreq(1, gen, 0, 0, 16), T0)
    pop(core)
    core.on_notification("agent-0", staged(1, gen, 0), T0)
    pop(core)
    if done_first:
        core.on_message("p0", done(1, gen, 1), T0)
        assert core.room_state(1) is RoomState.TRANSFERRING  # the piece is still being scattered
        core.scatter_done(1, 10, 0, T0)
    else:
        core.scatter_done(1, 10, 0, T0)
        pop(core)
        core.on_message("p0", done(1, gen, 1), T0)
    o = pop(core)
    _failed(o, ErrorCode.TOKEN_COUNT_MISMATCH)
    assert "staged tokens [0, 16) only, of [0, 40)" in o.ended[0].reason
    assert core.stats.rooms_succeeded == 0
    assert_clean(core)


def test_receiver_staging_grants_fifo_across_rooms():
    """Two rooms share the ring: the second waits (queued) until the first's region is released."""
    core = staging_core()
    gens = {}
    for room in (1, 2):
        core.open_room(room, C, T0)
        core.set_destination(room, [1], 16, T0)
        gens[room] = core.rooms[room].generation
    pop(core)
    core.on_message("p0", sreq(1, gens[1], 0, 0, 16), T0)
    core.on_message("p0", sreq(2, gens[2], 0, 0, 16), T0)
    assert [m.room_id for m in pop(core).to("p0")] == [1]
    assert core.ring.queued == 1
    core.on_notification("agent-0", staged(1, gens[1], 0), T0)
    core.scatter_done(1, 10, 0, T0)
    grants = [m for m in pop(core).to("p0") if isinstance(m, StagingGrant)]
    assert [(m.room_id, m.start_token, m.end_token) for m in grants] == [(2, 0, 16)]


def _two_rooms(core: ReceiverCore) -> tuple[int, int]:
    gens = []
    for room in (1, 2):
        core.open_room(room, C, T0)
        core.set_destination(room, [1, 2, 3], 40, T0)
        gens.append(core.rooms[room].generation)
    pop(core)
    return gens[0], gens[1]


@pytest.mark.parametrize(
    "case, code",
    [
        ("no-ring", ErrorCode.PEER_PROTOCOL_ERROR),
        ("link-not-staging", ErrorCode.PEER_PROTOCOL_ERROR),
        ("not-a-writer", ErrorCode.PEER_PROTOCOL_ERROR),
        ("out-of-order", ErrorCode.INDEX_OUT_OF_RANGE),
        ("beyond-num-tokens", ErrorCode.INDEX_OUT_OF_RANGE),
        ("empty", ErrorCode.INDEX_OUT_OF_RANGE),
        ("second-outstanding", ErrorCode.PEER_PROTOCOL_ERROR),
        ("seq-reused", ErrorCode.PEER_PROTOCOL_ERROR),
        ("after-transfer-done", ErrorCode.PEER_PROTOCOL_ERROR),
        ("unit-exceeds-ring", ErrorCode.INDEX_OUT_OF_RANGE),
        ("staged-tag-not-granted", ErrorCode.PEER_PROTOCOL_ERROR),
    ],
)
def test_receiver_staging_violation_fails_only_that_room(case, code):
    """A staging message or STAGED tag that breaks a rule fails its room with the code (after the
    drain), grants nothing for it, and leaves the other room on the same link and ring unharmed.

    Regressions: a request after TRANSFER_DONE was queued; a unit larger than the ring raised
    ValueError out of on_message (spec: INDEX_OUT_OF_RANGE)."""
    unit = {"link-not-staging": 0, "unit-exceeds-ring": RING + 64}.get(case, UNIT)
    links = [rlink(0, unit=unit), rlink(1, writer=False, unit=UNIT)]
    core = staging_core(ring=None if case == "no-ring" else RING, links=links)
    gen, gen2 = _two_rooms(core)
    staging_ok = case not in ("no-ring", "link-not-staging", "unit-exceeds-ring")
    if case == "second-outstanding":
        core.on_message("p0", sreq(2, gen2, 0, 0, 16), T0)  # room 2 fills the ring
        core.on_message("p0", sreq(1, gen, 0, 0, 8), T0)  # queued, not granted
        pop(core)
    if case == "seq-reused":
        core.on_message("p0", sreq(1, gen, 0, 0, 8), T0)
        pop(core)
    if case == "after-transfer-done":
        core.on_message("p0", done(1, gen, 1), T0)
    live = core.ring.live_grants() if core.ring is not None else []
    key, msg = {
        "not-a-writer": ("p1", sreq(1, gen, 0, 0, 16)),
        "out-of-order": ("p0", sreq(1, gen, 0, 16, 32)),
        "beyond-num-tokens": ("p0", sreq(1, gen, 0, 0, 41)),
        "empty": ("p0", sreq(1, gen, 0, 0, 0)),
        "second-outstanding": ("p0", sreq(1, gen, 1, 0, 8)),
        "seq-reused": ("p0", sreq(1, gen, 0, 8, 16)),
    }.get(case, ("p0", sreq(1, gen, 0, 0, 16)))
    if case == "staged-tag-not-granted":
        core.on_notification("agent-0", staged(1, gen, 0), T0)
    else:
        core.on_message(key, msg, T0)
    if case == "after-transfer-done":  # the writer's TRANSFER_DONE settled it: no drain
        o = _fails_at_once(core, 1, gen, code)
    else:
        o = _drains_then_fails(core, 1, gen, code)
    assert not any(isinstance(m, StagingGrant) for m in o.to("p0")) and o.scatters == []
    assert core.ring is None or core.ring.live_grants() == [g for g in live if g[0][0] != 1]
    assert core.room_state(2) is RoomState.TRANSFERRING
    if case == "second-outstanding":  # room 2 already holds its first grant
        core.on_notification("agent-0", staged(2, gen2, 0), T0)
        core.scatter_done(2, 10, 0, T0)
        pop(core)
        seq = stage(core, 2, gen2, 1, 16, 40)
    elif staging_ok:
        seq = stage(core, 2, gen2, 0, 0, 40)
    else:
        core.on_notification("agent-0", tag(2, gen2, 0), T0)
        seq = 1
    core.on_message("p0", done(2, gen2, seq), T0)
    assert [e.state for e in pop(core).ended] == [RoomState.SUCCESS]
    assert_clean(core)


def test_receiver_staging_request_while_draining_is_dropped():
    """Regression: a STAGING_REQUEST that crossed our ABORT is dropped (counted late), not queued or
    granted: it would only hold ring space for a room that is draining."""
    core = staging_core()
    gen, gen2 = _two_rooms(core)
    core.abort(1, T0)
    pop(core)
    core.on_message("p0", sreq(1, gen, 0, 0, 16), T0)
    assert pop(core).sends == [] and core.ring.queued == 0 and core.ring.live_grants() == []
    assert core.stats.late_messages == 1
    stage(core, 2, gen2, 0, 0, 40)  # the ring serves the other room in full


@pytest.mark.parametrize("holding", ["grant", "queued"])
def test_receiver_timeout_holding_staging_is_staging_stalled(holding):
    """A TRANSFERRING room that times out holding a grant (or a queued request) fails
    STAGING_STALLED; a room without staging state fails TRANSFER_TIMEOUT as before."""
    core = staging_core()
    gen, gen2 = _two_rooms(core)
    core.on_message("p0", sreq(1, gen, 0, 0, 16), T0)  # room 1 holds the whole ring
    if holding == "queued":
        core.on_message("p0", sreq(2, gen2, 0, 0, 16), T0)  # room 2 waits behind it
    pop(core)
    core.handle_timer(T0 + 300)
    o = pop(core)
    assert o.ended == []
    assert {m.room_id: m.code for m in o.to("p0")} == {
        1: ErrorCode.STAGING_STALLED,
        2: ErrorCode.STAGING_STALLED if holding == "queued" else ErrorCode.TRANSFER_TIMEOUT}
    answer(core, 1, gen, "p0")
    answer(core, 2, gen2, "p0")
    ends = {e.room_id: e.code for e in pop(core).ended}
    assert ends == {1: ErrorCode.STAGING_STALLED,
                    2: ErrorCode.STAGING_STALLED if holding == "queued" else ErrorCode.TRANSFER_TIMEOUT}
    assert_clean(core)


def test_receiver_drain_keeps_staging_region_until_writer_settles():
    """A failing room's granted region stays reserved (the writer may be writing into it) until the
    writer answers; its queued requests are dropped at once."""
    core = staging_core()
    gen, gen2 = _two_rooms(core)
    core.on_message("p0", sreq(1, gen, 0, 0, 16), T0)
    core.on_message("p0", sreq(2, gen2, 0, 0, 16), T0)  # queued behind room 1
    pop(core)
    core.abort(2, T0)
    assert core.ring.queued == 0  # room 2's queued request is dropped at once
    core.abort(1, T0)
    pop(core)
    assert [k for k, _, _ in core.ring.live_grants()] == [(1, 10, 0)]
    answer(core, 1, gen, "p0")
    answer(core, 2, gen2, "p0")
    assert sorted(e.room_id for e in pop(core).ended) == [1, 2]
    assert_clean(core)


def test_receiver_drain_waits_for_running_scatter():
    """A STAGED tag of a draining room is still scattered; the room fails only after the writer
    answered and the scatter finished (the scatter writes into its pages)."""
    core = staging_core()
    core.open_room(1, C, T0)
    core.set_destination(1, [1], 16, T0)
    gen = core.rooms[1].generation
    core.on_message("p0", sreq(1, gen, 0, 0, 16), T0)
    core.abort(1, T0)
    core.on_notification("agent-0", staged(1, gen, 0), T0)
    (sc,) = pop(core).scatters
    answer(core, 1, gen, "p0")
    assert pop(core).ended == [] and core.room_state(1) is RoomState.TRANSFERRING
    core.scatter_done(1, 10, sc.seq, T0)
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    assert_clean(core)


# --- rooms that end while their cluster bootstraps (held ends) ------------------------------------


def _end(core: ReceiverCore, room: int, how: str, now: float = T0) -> None:
    if how == "abort":
        core.abort(room, now)
    elif how == "deadline":
        core.handle_timer(now + core.timeouts.bootstrap)
    else:
        core.close(now)


@pytest.mark.parametrize("how, code", [("abort", ErrorCode.ABORTED), ("deadline", ErrorCode.BOOTSTRAP_TIMEOUT),
                                       ("close", ErrorCode.ENDPOINT_CLOSED)])
def test_receiver_end_while_bootstrapping_is_held_until_links_register(how, code):
    """A room that ends before its cluster's links exist fails at once; its ABORT (its code, its
    generation) reaches every paired prefill rank as soon as the cluster becomes ready, before
    the requests of any room that was waiting for the same links."""
    core = make_core(timeouts=Timeouts(bootstrap=30.0))
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    gen = core.rooms[1].generation
    if how != "close":
        core.open_room(2, C, T0 + 1)  # still waiting when room 1 ends (its deadline is 1 s later)
        core.set_destination(2, [5], 16, T0 + 1)
    _end(core, 1, how)
    o = pop(core)
    assert [(e.room_id, e.state, e.code) for e in o.ended] == [(1, RoomState.FAILED, code)]
    assert o.sends == [] and core.held_ends(C) == 1
    core.cluster_ready(C, [rlink(0), rlink(1, writer=False)], T0 + 0.5)
    o = pop(core)
    for key in ("p0", "p1"):
        msgs = o.to(key)
        assert isinstance(msgs[0], Abort) and (msgs[0].room_id, msgs[0].generation, msgs[0].code) == (1, gen, code)
        assert [m.room_id for m in msgs[1:]] == ([] if how == "close" else [2])
    assert core.held_ends(C) == 0


def test_receiver_held_end_dropped_when_bootstrap_fails():
    """No prefill rank registered this rank: a failed bootstrap drops the held ABORTs, and a later
    bootstrap of the same address does not send them."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.abort(1, T0)
    assert core.held_ends(C) == 1
    core.cluster_failed(C, ErrorCode.BOOTSTRAP_TIMEOUT, "slow", T0)
    assert core.held_ends(C) == 0
    core.cluster_pending(C)
    core.cluster_ready(C, [rlink(0)], T0)
    assert pop(core).sends == []


def test_receiver_held_end_superseded_by_a_new_incarnation():
    """Reopening a room id whose end is held drops that end: the new room is the one the prefill
    side will serve; only its request goes out."""
    core = make_core()
    core.cluster_pending(C)
    core.open_room(1, C, T0)
    core.abort(1, T0)
    core.open_room(1, C, T0)
    core.set_destination(1, [3], 16, T0)
    assert core.held_ends(C) == 0
    pop(core)
    core.cluster_ready(C, [rlink(0)], T0)
    msgs = pop(core).to("p0")
    assert [type(m).__name__ for m in msgs] == ["TransferRequest"]
    assert core.room_state(1) is RoomState.TRANSFERRING


def test_receiver_held_ends_are_bounded(monkeypatch):
    """At most MAX_HELD_ENDS per cluster are held, the oldest dropped first."""
    import kvproto.core.receiver as receiver

    monkeypatch.setattr(receiver, "MAX_HELD_ENDS", 3)
    core = make_core()
    core.cluster_pending(C)
    for room in range(1, 6):
        core.open_room(room, C, T0)
        core.abort(room, T0)
    assert core.held_ends(C) == 3
    core.cluster_ready(C, [rlink(0)], T0)
    assert [m.room_id for m in pop(core).to("p0")] == [3, 4, 5]


def test_receiver_open_room_with_destination_refused_changes_nothing():
    """open_room(..., destination=...) on a live id raises DUPLICATE_ROOM and leaves the live room,
    its destination and its deadline as they were."""
    core = make_core()
    core.cluster_ready(C, [rlink(0)], T0)
    core.open_room(1, C, T0)
    dest = core.check_destination([2], 16)
    before = (core.rooms[1].generation, core.room_state(1), core.next_deadline())
    with pytest.raises(LocalProtocolError) as info:
        core.open_room(1, C, T0 + 5, destination=dest)
    assert info.value.code is ErrorCode.DUPLICATE_ROOM
    assert (core.rooms[1].generation, core.room_state(1), core.next_deadline()) == before
    assert core.rooms[1].destination is None and pop(core).sends == []


def test_receiver_state_block_reserved_and_scattered_with_the_piece_that_ends_the_room():
    """On a writer link whose pieces end with a state block (minor 3), a grant that reaches the
    room's last token reserves its units and the block, a partial grant units only (the rest is
    asked again, block and all); only the Scatter of the piece that ends the room names this rank's
    state slots; a request whose units and block can never fit in the ring is refused."""
    from dataclasses import replace as _replace

    from kvproto.core import GroupSpec

    tail = 200
    link = _replace(rlink(0, unit=UNIT), stage_tail=tail)
    core = make_core(staging=StagingRing(RING), groups=[GroupSpec("gdn", state=True, pool=8)])
    core.cluster_ready(C, [link], T0)
    core.open_room(1, C, T0)
    core.set_destination(1, [0, 1, 2], 40, T0, group_pages=[()], state_slots=[6])
    gen = core.rooms[1].generation
    seq, start = 0, 0
    while start < 40:  # the ring holds 16 units: [0, 16), [16, 32), then [32, 40) and the block
        core.on_message("p0", sreq(1, gen, seq, start, 40), T0)
        (g,) = [m for m in pop(core).to("p0") if isinstance(m, StagingGrant)]
        ((_key, _offset, size),) = core.ring.live_grants()
        assert size == -(-((g.end_token - start) * UNIT + (tail if g.end_token == 40 else 0)) // 64) * 64
        core.on_notification("agent-0", staged(1, gen, seq), T0)
        (sc,) = pop(core).scatters
        assert sc.state_slots == ((6,) if g.end_token == 40 else ())
        core.scatter_done(1, 10, seq, T0)
        pop(core)
        seq, start = seq + 1, g.end_token
    assert seq == 3
    core.on_message("p0", done(1, gen, 3), T0)
    assert [e.state for e in pop(core).ended] == [RoomState.SUCCESS]
    assert_clean(core)

    core = make_core(staging=StagingRing(RING), groups=[GroupSpec("gdn", state=True, pool=8)])
    core.cluster_ready(C, [_replace(rlink(0, unit=UNIT), stage_tail=RING - UNIT + 1)], T0)
    core.open_room(1, C, T0)
    core.set_destination(1, [0, 1, 2], 40, T0, group_pages=[()], state_slots=[6])
    gen = core.rooms[1].generation
    core.on_message("p0", sreq(1, gen, 0, 0, 40), T0)
    o = _drains_then_fails(core, 1, gen, ErrorCode.INDEX_OUT_OF_RANGE)
    assert any("state block of 3841" in m.reason for m in o.to("p0") if isinstance(m, Abort))
