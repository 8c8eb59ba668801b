"""``ReceiverCore`` (a decode rank) on its own: hand-made messages and tags in, outputs checked."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvproto.core import ReceiverCore, ReceiverLink, RoomEnded, RoomState, Send, Timeouts
from kvproto.wire import (
    NO_SLOT,
    Abort,
    ErrorCode,
    LocalProtocolError,
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


def rlink(p: int = 0, *, writer: bool = True, aux_owner: bool | None = None, cluster=C) -> ReceiverLink:
    return ReceiverLink(key=f"p{p}", link_id=10 + p, cluster=cluster, prefill_rank=p, agent=f"agent-{p}",
                        writer=writer, aux_owner=(p == 0) if aux_owner is None else aux_owner)


@dataclass
class Out:
    sends: list[Send]
    ended: list[RoomEnded]

    def to(self, key) -> list:
        return [decode(encode(s.message)) for s in self.sends if s.link == key]


def pop(core: ReceiverCore) -> Out:
    outs = core.pop_outputs()
    o = Out([x for x in outs if isinstance(x, Send)], [x for x in outs if isinstance(x, RoomEnded)])
    assert len(o.sends) + len(o.ended) == len(outs), "a receiver posts no writes"
    return o


def assert_clean(core: ReceiverCore) -> None:
    assert core.rooms == {}
    assert len(core.timers) == 0 and core.next_deadline() is None


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
    core.open_room(1, C, T0)  # WAITING: no generation, nothing to tell
    core.open_room(2, C, T0)
    core.set_destination(2, [1], 16, T0)
    gen2 = core.rooms[2].generation
    core.open_room(3, "other", T0)
    core.set_destination(3, [1], 16, T0)
    pop(core)
    core.remove_link("p1", T0)
    o = pop(core)
    assert sorted((e.room_id, e.code) for e in o.ended) == [(1, ErrorCode.PEER_GONE), (2, ErrorCode.PEER_GONE)]
    assert [(m.room_id, m.generation, m.code) for m in o.to("p0")] == [(2, gen2, ErrorCode.PEER_GONE)]
    assert o.to("p1") == [] and o.to("q0") == []
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
    ],
    ids=["few-pages", "many-pages", "zero-tokens", "page-oob", "page-neg", "prefix-block", "prefix-beyond",
         "aux-oob"],
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
    core.on_notification("agent-0", tag(1, gen, 0), T0)
    assert core.stats.late_messages == 1


def test_receiver_tag_from_non_writer_link_is_violation():
    """A tag from a paired link that is not a writer fails the room PEER_PROTOCOL_ERROR."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    pop(core)
    core.on_notification("agent-1", tag(1, gen, 0, p=1), T0)
    o = pop(core)
    _failed(o, ErrorCode.PEER_PROTOCOL_ERROR)
    assert [m.code for m in o.to("p0")] == [ErrorCode.PEER_PROTOCOL_ERROR]
    assert [m.code for m in o.to("p1")] == [ErrorCode.PEER_PROTOCOL_ERROR]
    assert core.stats.peer_violations == 1


def test_receiver_tag_seq_beyond_writes_is_violation():
    """After TRANSFER_DONE(writes=n), a tag with seq >= n fails the room."""
    core, gen = transferring()
    core.on_message("p0", done(1, gen, 2), T0)
    core.on_notification("agent-0", tag(1, gen, 2), T0)
    _failed(pop(core), ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_done_fewer_than_seen_tags_is_violation():
    """TRANSFER_DONE(writes=n) after a tag with seq >= n fails the room."""
    core, gen = transferring()
    core.on_notification("agent-0", tag(1, gen, 3), T0)
    core.on_message("p0", done(1, gen, 3), T0)
    _failed(pop(core), ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_second_transfer_done_is_violation():
    """Two TRANSFER_DONEs from one writer fail the room."""
    core, gen = transferring()
    core.on_message("p0", done(1, gen, 2), T0)
    core.on_message("p0", done(1, gen, 2), T0)
    _failed(pop(core), ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_transfer_done_from_non_writer_is_violation():
    """TRANSFER_DONE from a paired non-writer fails the room."""
    core, gen = transferring(links=[rlink(0), rlink(1, writer=False)])
    core.on_message("p1", done(1, gen, 0), T0)
    _failed(pop(core), ErrorCode.PEER_PROTOCOL_ERROR)


def test_receiver_unexpected_message_is_violation():
    """A TRANSFER_REQUEST sent to a decode rank fails the room PEER_PROTOCOL_ERROR."""
    core, gen = transferring()
    core.on_message("p0", TransferRequest(room_id=1, generation=gen, num_tokens=1, prefix_tokens=0,
                                          aux_slot=NO_SLOT, expected_writers=1, dst_pages=(1,)), T0)
    _failed(pop(core), ErrorCode.PEER_PROTOCOL_ERROR)


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
    _failed(pop(core), ErrorCode.MALFORMED_FRAME)


# --- aborts and deadlines ---------------------------------------------------------------------------


def test_receiver_peer_abort_fails_room_with_its_code():
    """prefill's ABORT fails the room with prefill's code; the other links hear, the sender does not."""
    core, gen = transferring(links=[rlink(0), rlink(1, aux_owner=False)])
    pop(core)
    core.on_message("p1", Abort(room_id=1, generation=gen, code=ErrorCode.TRANSPORT_ERROR, reason="x"), T0)
    o = pop(core)
    _failed(o, ErrorCode.TRANSPORT_ERROR)
    assert [m.code for m in o.to("p0")] == [ErrorCode.TRANSPORT_ERROR]
    assert o.to("p1") == []


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
    pop(core)
    core.abort(1, T0)
    core.abort(1, T0)
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    expect = [(gen, ErrorCode.ABORTED)] if state is RoomState.TRANSFERRING else []
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
    o = pop(core)
    _failed(o, ErrorCode.TRANSFER_TIMEOUT)
    assert [(m.generation, m.code) for m in o.to("p0")] == [(gen, ErrorCode.TRANSFER_TIMEOUT)]


def test_receiver_close_fails_every_live_room_once():
    """close() fails every live room ENDPOINT_CLOSED once, tells prefill for sent requests, idempotent."""
    core, gen = transferring(1)
    core.open_room(2, C, T0)
    pop(core)
    core.close(T0)
    o = pop(core)
    assert sorted((e.room_id, e.code) for e in o.ended) == [(1, ErrorCode.ENDPOINT_CLOSED),
                                                           (2, ErrorCode.ENDPOINT_CLOSED)]
    assert [(m.room_id, m.generation) for m in o.to("p0")] == [(1, gen)]
    core.close(T0)
    assert pop(core).ended == []
    with pytest.raises(LocalProtocolError):
        core.open_room(3, C, T0)
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
