"""``SenderCore`` (a prefill rank) on its own: hand-made requests in, outputs checked, fake clock."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

import kvproto.core.base as core_base
from kvproto.core import (
    PostAux,
    PostWrite,
    RoomEnded,
    RoomState,
    Send,
    SenderCore,
    SenderLink,
    Timeouts,
)
from kvproto.core.events import PostStaged
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
    decode_tag,
    encode,
)

BLOCK = 16
T0 = 500.0
INSTANCE = "decode-A"


def make_core(**kw) -> SenderCore:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("aux_slots", 4)
    return SenderCore(**kw)


def make_link(d: int = 0, *, paired=(0,), writer: bool = True, aux_owner: bool = True, block: int = BLOCK,
              blocks: int = 32, aux: int = 2, instance: str = INSTANCE, link_id: int | None = None,
              key=None, unit: int = 0, capacity: int = 0, max_units: int = 0) -> SenderLink:
    return SenderLink(key=key if key is not None else f"d{d}", link_id=link_id if link_id is not None else 40 + d,
                      instance=instance, decode_rank=d, num_blocks=blocks, block_size=block, aux_slots=aux,
                      paired_ranks=frozenset(paired), writer=writer, aux_owner=aux_owner, stage_unit=unit,
                      stage_capacity=capacity, stage_max_units=max_units)


def req(room: int, n: int = 40, *, gen: int = 11, prefix: int = 0, aux: int = NO_SLOT, pages=None,
        block: int = BLOCK, writers: int = 1) -> TransferRequest:
    if pages is None:
        pages = tuple(range(-(-n // block)))
    return TransferRequest(room_id=room, generation=gen, num_tokens=n, prefix_tokens=prefix, aux_slot=aux,
                           expected_writers=writers, dst_pages=tuple(pages))


@dataclass
class Out:
    sends: list[Send]
    writes: list[PostWrite]
    aux: list[PostAux]
    ended: list[RoomEnded]
    staged: list[PostStaged]

    def to(self, key) -> list:
        """Messages sent to ``key``, round-tripped through the codec."""
        return [decode(encode(s.message)) for s in self.sends if s.link == key]

    @property
    def posts(self) -> list:
        return [*self.writes, *self.aux, *self.staged]


def pop(core: SenderCore) -> Out:
    outs = core.pop_outputs()
    o = Out([x for x in outs if isinstance(x, Send)], [x for x in outs if isinstance(x, PostWrite)],
            [x for x in outs if isinstance(x, PostAux)], [x for x in outs if isinstance(x, RoomEnded)],
            [x for x in outs if isinstance(x, PostStaged)])
    assert len(o.sends) + len(o.posts) + len(o.ended) == len(outs)
    return o


def assert_clean(core: SenderCore, *, drains: int = 0) -> None:
    """No room, deadline, parked request or pre-abort left; ``drains`` ABORTs still held for writes."""
    assert core.rooms == {}
    assert len(core.timers) == 0 and core.next_deadline() is None
    assert core._parked == {} and core._parked_count == 0
    assert core._preaborted == {}
    assert len(core._draining) == drains, core._draining


def ready_core(room: int = 1, n: int = 40, *, link: SenderLink | None = None, **kw) -> tuple[SenderCore, SenderLink]:
    """A core with one link and ``room`` open with its request accepted (WAITING_FOR_INPUT)."""
    core = make_core()
    link = link or make_link()
    core.add_link(link)
    core.open_room(room, T0)
    core.on_message(link.key, req(room, n, **kw), T0)
    assert core.room_state(room) is RoomState.WAITING_FOR_INPUT
    return core, link


def finish_writes(core: SenderCore, outs: list, now: float = T0) -> None:
    for w in outs:
        core.write_done(w.room_id, w.link, w.seq, 100, now)


# --- happy paths -------------------------------------------------------------------------------


def test_sender_happy_path_one_write_then_transfer_done():
    """Request, one last chunk, write DONE: TRANSFER_DONE(writes=1) and SUCCESS, once."""
    core, link = ready_core(1, 40)
    assert pop(core).sends == []
    core.submit_chunk(1, [5, 6, 7], 40, T0, last=True)
    o = pop(core)
    assert core.room_state(1) is RoomState.TRANSFERRING
    (w,) = o.writes
    assert (w.room_id, w.link, w.seq, w.start_token, w.end_token) == (1, "d0", 0, 0, 40)
    assert list(w.src_pages) == [5, 6, 7] and tuple(w.dst_pages) == (0, 1, 2)
    tag = decode_tag(w.tag)
    assert (tag.kind, tag.room_id, tag.generation, tag.link_id, tag.seq) == (TagKind.KV, 1, 11, 40, 0)
    assert o.sends == [] and o.ended == []
    core.write_done(1, "d0", 0, 1234, T0 + 1)
    o = pop(core)
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=1, nbytes=1234)]
    assert o.ended == [RoomEnded(room_id=1, state=RoomState.SUCCESS)]
    assert core.room_state(1) is RoomState.SUCCESS
    assert core.stats.rooms_succeeded == 1
    assert_clean(core)


def test_sender_chunked_prefill_three_chunks():
    """Three chunks (the last flagged) become three writes, seq 0..2; DONE counts all three."""
    core, _ = ready_core(1, 40)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2], 32, T0, last=False)
    o1 = pop(core)
    assert [(w.seq, w.start_token, w.end_token) for w in o1.writes] == [(0, 0, 16), (1, 16, 32)]
    finish_writes(core, o1.writes)
    assert pop(core).sends == []
    assert core.room_state(1) is RoomState.TRANSFERRING  # all DONE, but the last chunk is missing
    core.submit_chunk(1, [3], 40, T0, last=True)
    o2 = pop(core)
    assert [(w.seq, w.start_token, w.end_token) for w in o2.writes] == [(2, 32, 40)]
    finish_writes(core, o2.writes)
    o = pop(core)
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=3, nbytes=300)]
    assert [e.state for e in o.ended] == [RoomState.SUCCESS]


def test_sender_writes_done_out_of_order_complete():
    """DONE reports may come in any order; completion needs all of them."""
    core, _ = ready_core(1, 48)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2], 32, T0, last=False)
    core.submit_chunk(1, [3], 48, T0, last=True)
    ws = pop(core).writes
    finish_writes(core, [ws[2], ws[0]])
    assert core.room_state(1) is RoomState.TRANSFERRING
    finish_writes(core, [ws[1]])
    assert core.room_state(1) is RoomState.SUCCESS


def test_sender_empty_last_chunk_finishes():
    """A last chunk that adds no tokens (end == previous end) just closes the room's input."""
    core, _ = ready_core(1, 32)
    core.submit_chunk(1, [1, 2], 32, T0, last=False)
    ws = pop(core).writes
    finish_writes(core, ws)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.submit_chunk(1, [], 32, T0, last=True)
    o = pop(core)
    assert o.writes == []
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=1, nbytes=100)]


def test_sender_src_pages_snapshot_per_write():
    """Regression: each PostWrite carries the source pages as they were when it was posted."""
    core, _ = ready_core(1, 40)
    core.submit_chunk(1, [9], 16, T0, last=False)
    (w0,) = pop(core).writes
    core.submit_chunk(1, [8, 7], 40, T0, last=True)
    (w1,) = pop(core).writes
    assert list(w0.src_pages) == [9]
    assert list(w1.src_pages) == [9, 8, 7]


# --- aux ---------------------------------------------------------------------------------------


def test_sender_aux_written_with_last_chunk_only():
    """The aux slot goes as one extra write after the last chunk's KV write, not before."""
    core, _ = ready_core(1, 40, aux=1)
    core.submit_chunk(1, [1], 16, T0, last=False)
    o1 = pop(core)
    assert o1.aux == [] and len(o1.writes) == 1
    core.submit_chunk(1, [2, 3], 40, T0, last=True, aux_slot=3)
    o = pop(core)
    (a,) = o.aux
    assert (a.seq, a.src_slot, a.dst_slot) == (2, 3, 1)
    assert decode_tag(a.tag).seq == 2
    finish_writes(core, [*o1.writes, *o.writes, a])
    assert pop(core).to("d0")[0].writes == 3


@pytest.mark.parametrize(
    "aux_owner, prefill_slot, decode_slot, expect",
    [(True, 0, 1, 1), (False, 0, 1, 0), (True, None, 1, 0), (True, 0, NO_SLOT, 0)],
    ids=["owner", "not-owner", "prefill-gives-none", "decode-wants-none"],
)
def test_sender_aux_needs_owner_and_both_slots(aux_owner, prefill_slot, decode_slot, expect):
    """Only the aux owner writes aux, and only when both sides name a slot."""
    core, _ = ready_core(1, 16, link=make_link(aux_owner=aux_owner), aux=decode_slot)
    core.submit_chunk(1, [1], 16, T0, last=True, aux_slot=prefill_slot)
    o = pop(core)
    assert len(o.aux) == expect
    finish_writes(core, o.posts)
    assert pop(core).to("d0")[0].writes == 1 + expect


def test_sender_aux_slot_on_non_last_chunk_raises():
    """An aux slot with a non-last chunk is API misuse."""
    core, _ = ready_core(1, 40)
    with pytest.raises(LocalProtocolError):
        core.submit_chunk(1, [1], 16, T0, last=False, aux_slot=0)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT


# --- chunk validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunks, code",
    [
        ([([1], 20, False)], ErrorCode.PEER_PROTOCOL_ERROR),  # non-last chunk off a page boundary
        ([([1], 16, False), ([], 16, False)], ErrorCode.PEER_PROTOCOL_ERROR),  # does not advance
        ([([1], 16, False), ([], 10, True)], ErrorCode.PEER_PROTOCOL_ERROR),  # goes backwards
        ([([1, 2], 16, False)], ErrorCode.PEER_PROTOCOL_ERROR),  # too many pages
        ([([], 16, False)], ErrorCode.PEER_PROTOCOL_ERROR),  # too few pages
        ([([64], 16, False)], ErrorCode.INDEX_OUT_OF_RANGE),  # page outside the pool
        ([([-1], 16, False)], ErrorCode.INDEX_OUT_OF_RANGE),
        ([([1, 2, 3], 40, True, 4)], ErrorCode.PEER_PROTOCOL_ERROR),  # aux slot outside [0, 4)
        ([([1, 2, 3], 40, True), ([], 40, True)], ErrorCode.PEER_PROTOCOL_ERROR),  # second last chunk
        ([([1, 2, 1], 40, True)], ErrorCode.INDEX_OUT_OF_RANGE),  # a page twice in one chunk
        ([([1], 16, False), ([2, 1], 40, True)], ErrorCode.INDEX_OUT_OF_RANGE),  # a page twice across chunks
    ],
    ids=["off-boundary", "no-advance", "backwards", "extra-page", "missing-page", "page-oob", "page-neg",
         "aux-oob", "double-last", "page-twice", "page-twice-across-chunks"],
)
def test_sender_submit_chunk_misuse_raises(chunks, code):
    """Misused submit_chunk raises LocalProtocolError (with its code) and changes nothing."""
    core, _ = ready_core(1, 40)
    *good, bad = chunks
    for pages, end, last, *aux in good:
        core.submit_chunk(1, pages, end, T0, last=last, aux_slot=aux[0] if aux else None)
    before = (core.room_state(1), len(core.rooms[1].chunks), list(core.rooms[1].src_pages))
    pop(core)
    pages, end, last, *aux = bad
    with pytest.raises(LocalProtocolError) as info:
        core.submit_chunk(1, pages, end, T0, last=last, aux_slot=aux[0] if aux else None)
    assert info.value.code is code
    assert (core.room_state(1), len(core.rooms[1].chunks), list(core.rooms[1].src_pages)) == before
    o = pop(core)
    assert o.posts == [] and o.sends == [] and o.ended == []


def test_sender_submit_chunk_unknown_room_raises():
    """A chunk for a room never opened raises UNKNOWN_ROOM; for an ended room it is counted."""
    core, _ = ready_core(1, 16)
    with pytest.raises(LocalProtocolError) as info:
        core.submit_chunk(2, [1], 16, T0, last=True)
    assert info.value.code is ErrorCode.UNKNOWN_ROOM
    core.abort(1, T0)
    core.submit_chunk(1, [1], 16, T0, last=True)
    assert core.stats.late_messages == 1


def test_sender_open_room_misuse_raises():
    """Duplicate live room id, id 0 and ids >= 2**64 raise; a room id may be reused after it ends."""
    core = make_core()
    core.open_room(1, T0)
    with pytest.raises(LocalProtocolError) as info:
        core.open_room(1, T0)
    assert info.value.code is ErrorCode.DUPLICATE_ROOM
    for bad in (0, -1, 2**64):
        with pytest.raises(LocalProtocolError):
            core.open_room(bad, T0)
    core.abort(1, T0)
    core.open_room(1, T0)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING


# --- parking -------------------------------------------------------------------------------------


def test_sender_request_before_open_is_parked_and_replayed():
    """A request for an unopened room waits (no reply), then replays when the room opens."""
    core = make_core()
    link = make_link()
    core.add_link(link)
    core.on_message("d0", req(3, 16), T0)
    assert pop(core).sends == []
    assert core.room_state(3) is None and core._parked_count == 1
    assert core.next_deadline() == T0 + 30.0
    core.open_room(3, T0 + 10)
    assert core.room_state(3) is RoomState.WAITING_FOR_INPUT
    assert core._parked == {} and core._parked_count == 0
    assert core.next_deadline() == T0 + 10 + 300.0  # the parked deadline is gone, WAITING's is armed


def test_sender_parked_request_expires_with_unknown_room():
    """A parked request is answered ABORT(UNKNOWN_ROOM) exactly when the parked timeout passes."""
    core = make_core(timeouts=Timeouts(parked=30.0))
    core.add_link(make_link())
    core.on_message("d0", req(3, 16, gen=77), T0)
    core.handle_timer(T0 + 29.999)
    assert pop(core).sends == []
    core.handle_timer(T0 + 30.0)
    (msg,) = pop(core).to("d0")
    assert isinstance(msg, Abort)
    assert (msg.room_id, msg.generation, msg.code) == (3, 77, ErrorCode.UNKNOWN_ROOM)
    assert core.stats.unknown_room_messages == 1
    assert_clean(core)
    core.open_room(3, T0 + 31)  # too late: the room now waits for a request that will not come
    assert core.room_state(3) is RoomState.BOOTSTRAPPING


def test_sender_parked_requests_bounded():
    """Past max_parked, a request for an unopened room is refused at once with UNKNOWN_ROOM."""
    core = make_core(max_parked=2)
    for d in range(3):
        core.add_link(make_link(d, paired=(0, 1, 2)))
    core.on_message("d0", req(1), T0)
    core.on_message("d1", req(1), T0)
    core.on_message("d2", req(2), T0)
    o = pop(core)
    assert o.to("d0") == [] and o.to("d1") == []
    assert [m.code for m in o.to("d2")] == [ErrorCode.UNKNOWN_ROOM]
    assert core._parked_count == 2


def test_sender_abort_withdraws_parked_request():
    """decode's ABORT for a parked request (same link and generation) withdraws it and its parked
    deadline, answers it at once (decode drains until answered), and is remembered as a pre-abort.

    Regression: the withdrawn request went unanswered, so decode dropped the link at its drain
    deadline."""
    core = make_core()
    core.add_link(make_link())
    core.on_message("d0", req(3, gen=5), T0)
    core.on_message("d0", Abort(room_id=3, generation=6, code=ErrorCode.ABORTED, reason="x"), T0)
    assert core._parked_count == 1  # another generation: not this request
    assert pop(core).sends == []  # ... and nothing to answer
    core.on_message("d0", Abort(room_id=3, generation=5, code=ErrorCode.ABORTED, reason="x"), T0)
    assert core._parked == {} and core._parked_count == 0
    assert [(m.room_id, m.generation, m.code) for m in pop(core).to("d0")] == [(3, 5, ErrorCode.ABORTED)]
    assert list(core._preaborted) == [3] and core.next_deadline() == T0 + 30.0
    core.handle_timer(T0 + 30.0)
    assert pop(core).sends == []
    assert_clean(core)


def test_sender_remove_link_drops_its_parked_requests():
    """Removing a link forgets its parked requests (and their deadline) but not other links'."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.on_message("d0", req(3), T0)
    core.on_message("d1", req(3), T0)
    core.on_message("d0", req(4), T0)
    core.remove_link("d0", T0)
    assert core._parked_count == 1 and list(core._parked) == [3]
    core.remove_link("d1", T0)
    assert_clean(core)


def test_sender_chunks_before_request_are_queued_then_posted():
    """Chunks submitted while BOOTSTRAPPING are kept, and posted when the request arrives."""
    core = make_core()
    core.add_link(make_link())
    core.open_room(1, T0)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2, 3], 40, T0, last=True)
    assert pop(core).posts == []
    assert core.room_state(1) is RoomState.BOOTSTRAPPING
    core.on_message("d0", req(1, 40), T0)
    o = pop(core)
    assert [(w.seq, w.start_token, w.end_token) for w in o.writes] == [(0, 0, 16), (1, 16, 40)]
    assert core.room_state(1) is RoomState.TRANSFERRING
    finish_writes(core, o.writes)
    assert core.room_state(1) is RoomState.SUCCESS


# --- prefix hits ---------------------------------------------------------------------------------


def test_sender_prefix_hit_moves_only_tokens_past_prefix():
    """With a 32-token decode prefix, only [32, 40) moves, clipped inside the chunk that holds it."""
    core, _ = ready_core(1, 40, prefix=32)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2], 32, T0, last=False)
    assert pop(core).writes == []
    core.submit_chunk(1, [3], 40, T0, last=True)
    (w,) = pop(core).writes
    assert (w.seq, w.start_token, w.end_token) == (0, 32, 40)


def test_sender_prefix_inside_chunk_clips_write():
    """A prefix inside a chunk clips that chunk's write to start at the prefix."""
    core, _ = ready_core(1, 64, prefix=16)
    core.submit_chunk(1, [1, 2], 32, T0, last=False)
    core.submit_chunk(1, [3, 4], 64, T0, last=True)
    assert [(w.start_token, w.end_token) for w in pop(core).writes] == [(16, 32), (32, 64)]


def test_sender_full_prefix_hit_completes_with_zero_writes():
    """prefix == num_tokens: no write at all, TRANSFER_DONE(writes=0), SUCCESS."""
    core, _ = ready_core(1, 32, prefix=32)
    core.submit_chunk(1, [1, 2], 32, T0, last=True)
    o = pop(core)
    assert o.posts == []
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=0, nbytes=0)]
    assert [e.state for e in o.ended] == [RoomState.SUCCESS]


def test_sender_first_token_skips_the_decode_prefix():
    """A room whose chunks start at the decode's prefix (``first_token``): the prefill names no page
    for the prefix, the decode prefix is known once the request came, only [32, 48) moves."""
    core, _ = ready_core(1, 48, prefix=32)
    assert core.rooms[1].decode_prefix == 32
    core.submit_chunk(1, [7], 48, T0, last=True, first_token=32)
    (w,) = pop(core).writes
    assert (w.start_token, w.end_token) == (32, 48)
    assert list(w.src_pages)[2:] == [7] and len(w.src_pages) == 3


def test_sender_first_token_chunks_then_last():
    """Chunked after a skipped prefix: the page count is reckoned from ``first_token``."""
    core, _ = ready_core(1, 64, prefix=16)
    core.submit_chunk(1, [4], 32, T0, last=False, first_token=16)
    core.submit_chunk(1, [5, 6], 64, T0, last=True)
    assert [(w.start_token, w.end_token) for w in pop(core).writes] == [(16, 32), (32, 64)]


@pytest.mark.parametrize("first, kw, message", [
    (8, {}, "whole blocks"),
    (16, {"later": True}, "first chunk"),
])
def test_sender_first_token_misuse_raises(first, kw, message):
    """``first_token`` must be whole blocks and come with the room's first chunk."""
    core, _ = ready_core(1, 64, prefix=16)
    if kw.get("later"):
        core.submit_chunk(1, [1], 16, T0, last=False)
    with pytest.raises(LocalProtocolError, match=message):
        core.submit_chunk(1, [4], 32, T0, last=False, first_token=first)


def test_sender_first_token_beyond_decode_prefix_fails_room():
    """Skipping more than a decode rank holds would leave tokens unsent: TOKEN_COUNT_MISMATCH."""
    core, _ = ready_core(1, 64, prefix=16)
    core.submit_chunk(1, [4], 48, T0, last=False, first_token=32)
    o = pop(core)
    assert core.room_state(1) is None or o.ended[0].state is RoomState.FAILED
    assert o.ended and o.ended[0].code is ErrorCode.TOKEN_COUNT_MISMATCH


def test_sender_first_token_pages_checked_for_duplicates():
    """The placeholders of the skipped prefix never count as a page named twice."""
    core, _ = ready_core(1, 64, prefix=32)
    core.submit_chunk(1, [0], 48, T0, last=False, first_token=32)
    core.submit_chunk(1, [1], 64, T0, last=True)
    assert [(w.start_token, w.end_token) for w in pop(core).writes] == [(32, 48), (48, 64)]
    with pytest.raises(LocalProtocolError):
        core2, _ = ready_core(2, 64, prefix=32)
        core2.submit_chunk(2, [3], 48, T0, last=False, first_token=32)
        core2.submit_chunk(2, [3], 64, T0, last=True)


def test_sender_non_writer_link_succeeds_without_writes():
    """A paired non-writer rank posts nothing, sends no TRANSFER_DONE, and succeeds."""
    core, _ = ready_core(1, 40, link=make_link(writer=False, aux_owner=False), aux=0)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, aux_slot=1)
    o = pop(core)
    assert o.posts == [] and o.sends == []
    assert [e.state for e in o.ended] == [RoomState.SUCCESS]


# --- token counts ------------------------------------------------------------------------------


def _failed(o: Out, code: ErrorCode) -> None:
    assert [(e.state, e.code) for e in o.ended] == [(RoomState.FAILED, code)]


def test_sender_chunk_beyond_num_tokens_fails_mismatch():
    """A chunk past the request's num_tokens fails the room TOKEN_COUNT_MISMATCH and aborts decode."""
    core, _ = ready_core(1, 20)
    core.submit_chunk(1, [1, 2], 32, T0, last=False)
    o = pop(core)
    assert o.posts == []
    _failed(o, ErrorCode.TOKEN_COUNT_MISMATCH)
    (ab,) = o.to("d0")
    assert isinstance(ab, Abort) and ab.code == ErrorCode.TOKEN_COUNT_MISMATCH and ab.generation == 11
    assert_clean(core)


def test_sender_last_chunk_short_fails_mismatch():
    """A last chunk that ends before num_tokens fails TOKEN_COUNT_MISMATCH (never shifted); decode's
    ABORT waits for the first chunk's write, still in flight, to be reported."""
    core, _ = ready_core(1, 40)
    core.submit_chunk(1, [1], 16, T0, last=False)
    (w0,) = pop(core).writes
    core.submit_chunk(1, [2], 30, T0, last=True)
    o = pop(core)
    assert o.posts == []
    _failed(o, ErrorCode.TOKEN_COUNT_MISMATCH)
    assert o.to("d0") == []
    core.write_done(1, "d0", w0.seq, 100, T0 + 1, tag=w0.tag)
    assert [m.code for m in pop(core).to("d0")] == [ErrorCode.TOKEN_COUNT_MISMATCH]
    assert core._draining == {}
    assert_clean(core)


def test_sender_queued_chunk_beyond_late_request_fails_mismatch():
    """Queued chunks are checked against a request that arrives later."""
    core = make_core()
    core.add_link(make_link())
    core.open_room(1, T0)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    core.on_message("d0", req(1, 48), T0)
    o = pop(core)
    assert o.posts == []
    _failed(o, ErrorCode.TOKEN_COUNT_MISMATCH)
    assert [m.code for m in o.to("d0")] == [ErrorCode.TOKEN_COUNT_MISMATCH]


def test_sender_decode_ranks_disagree_fails_mismatch():
    """Two paired decode ranks asking for different token counts fail the room on both links."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, 40, gen=3), T0)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING
    core.on_message("d1", req(1, 41, gen=4), T0)
    o = pop(core)
    _failed(o, ErrorCode.TOKEN_COUNT_MISMATCH)
    assert [(m.generation, m.code) for m in o.to("d0")] == [(3, ErrorCode.TOKEN_COUNT_MISMATCH)]
    assert [(m.generation, m.code) for m in o.to("d1")] == [(4, ErrorCode.TOKEN_COUNT_MISMATCH)]


# --- request validation (house rule 7) --------------------------------------------------------


@pytest.mark.parametrize(
    "request_kw, code",
    [
        (dict(pages=(0, 1, 32)), ErrorCode.INDEX_OUT_OF_RANGE),  # dst page outside 32 registered
        (dict(aux=2), ErrorCode.INDEX_OUT_OF_RANGE),  # aux slot outside 2 registered
        (dict(prefix=8), ErrorCode.INDEX_OUT_OF_RANGE),  # prefix not a whole decode block
        (dict(n=16, prefix=32, pages=(0,)), ErrorCode.INDEX_OUT_OF_RANGE),  # prefix beyond num_tokens
        (dict(pages=(0, 1)), ErrorCode.TOKEN_COUNT_MISMATCH),  # 40 tokens need 3 pages
        (dict(gen=0), ErrorCode.PEER_PROTOCOL_ERROR),  # no generation
        (dict(pages=(4, 9, 4)), ErrorCode.INDEX_OUT_OF_RANGE),  # dst page listed twice
    ],
    ids=["dst-page", "aux-slot", "prefix-block", "prefix-beyond", "page-count", "generation-0", "dst-page-twice"],
)
@pytest.mark.parametrize("with_chunks", [False, True], ids=["no-input", "input-queued"])
def test_sender_bad_request_fails_room_without_writes(request_kw, code, with_chunks):
    """A request with an out-of-range index fails the room with its code; nothing is posted."""
    core = make_core()
    core.add_link(make_link())
    core.open_room(1, T0)
    if with_chunks:
        core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    kw = dict(n=40) | request_kw
    core.on_message("d0", req(1, kw.pop("n"), **kw), T0)
    o = pop(core)
    assert o.posts == []
    _failed(o, code)
    (ab,) = o.to("d0")
    assert isinstance(ab, Abort) and ab.code == code
    assert_clean(core)


def test_sender_second_request_from_same_rank_fails_room():
    """A second TRANSFER_REQUEST from one decode rank is a peer violation."""
    core, _ = ready_core(1, 40)
    core.on_message("d0", req(1, 40, gen=12), T0)
    o = pop(core)
    _failed(o, ErrorCode.PEER_PROTOCOL_ERROR)
    assert core.stats.peer_violations == 1


def test_sender_request_from_unpaired_rank_fails_room():
    """A request from a decode rank that does not pair with this prefill rank fails the room."""
    core = make_core()
    core.add_link(make_link(3, paired=(0,)))
    core.open_room(1, T0)
    core.on_message("d3", req(1), T0)
    _failed(pop(core), ErrorCode.PEER_PROTOCOL_ERROR)


def test_sender_request_from_other_instance_refused_room_kept():
    """A request from a second decode instance is refused DUPLICATE_ROOM; the room is untouched."""
    core, _ = ready_core(1, 40)
    core.add_link(make_link(0, key="other", instance="decode-B"))
    core.on_message("other", req(1, 40, gen=99), T0)
    o = pop(core)
    assert [(m.generation, m.code) for m in o.to("other")] == [(99, ErrorCode.DUPLICATE_ROOM)]
    assert o.ended == []
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT


def test_sender_request_on_unregistered_link_refused():
    """A request on a link that never registered is answered NOT_REGISTERED and not parked."""
    core = make_core()
    core.on_message("stranger", req(1), T0)
    (m,) = pop(core).to("stranger")
    assert m.code == ErrorCode.NOT_REGISTERED
    assert_clean(core)


def test_sender_unexpected_message_type_answered_with_abort():
    """A message a prefill rank does not accept is answered PEER_PROTOCOL_ERROR and counted."""
    core, _ = ready_core(1, 40)
    core.on_message("d0", TransferDone(room_id=1, generation=11, writes=1, nbytes=0), T0)
    (m,) = pop(core).to("d0")
    assert m.code == ErrorCode.PEER_PROTOCOL_ERROR
    assert core.stats.peer_violations == 1


def test_sender_peer_violation_fails_room_of_that_link():
    """peer_violation() from a link of the room fails it with the code given."""
    core, _ = ready_core(1, 40)
    core.peer_violation("d0", 1, 11, ErrorCode.MALFORMED_FRAME, "bad frame", T0)
    o = pop(core)
    _failed(o, ErrorCode.MALFORMED_FRAME)
    assert core.stats.peer_violations == 1


def test_sender_peer_violation_from_foreign_link_only_answers():
    """peer_violation() from a link of another instance answers it but keeps the room."""
    core, _ = ready_core(1, 40)
    core.add_link(make_link(0, key="other", instance="decode-B"))
    core.peer_violation("other", 1, 5, ErrorCode.MALFORMED_FRAME, "bad frame", T0)
    o = pop(core)
    assert [m.code for m in o.to("other")] == [ErrorCode.MALFORMED_FRAME]
    assert o.ended == [] and core.room_state(1) is RoomState.WAITING_FOR_INPUT


# --- deadlines -----------------------------------------------------------------------------------


def test_sender_bootstrap_deadline_fires_exactly():
    """A room without its requests fails BOOTSTRAP_TIMEOUT exactly 30 s after opening."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0 + 10)  # partial: the deadline is not refreshed
    assert core.next_deadline() == T0 + 30.0
    core.handle_timer(T0 + 29.999999)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING
    core.handle_timer(T0 + 30.0)
    o = pop(core)
    _failed(o, ErrorCode.BOOTSTRAP_TIMEOUT)
    assert [(m.generation, m.code) for m in o.to("d0")] == [(3, ErrorCode.BOOTSTRAP_TIMEOUT)]
    assert o.to("d1") == []
    assert_clean(core)


def test_sender_waiting_deadline_fires_exactly():
    """A room whose chunks never come fails WAITING_TIMEOUT exactly 300 s after its requests."""
    core, _ = ready_core(1, 40)
    core.handle_timer(T0 + 299.0)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    core.handle_timer(T0 + 300.0)
    o = pop(core)
    _failed(o, ErrorCode.WAITING_TIMEOUT)
    assert [m.code for m in o.to("d0")] == [ErrorCode.WAITING_TIMEOUT]


def test_sender_transfer_deadline_refreshes_on_write_done():
    """TRANSFERRING fails TRANSFER_TIMEOUT after 300 s without progress; a DONE re-arms it."""
    core, _ = ready_core(1, 40)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2], 32, T0, last=False)
    ws = pop(core).writes
    assert core.next_deadline() == T0 + 300.0
    core.write_done(1, "d0", 0, 1, T0 + 200.0)
    assert core.next_deadline() == T0 + 500.0
    core.handle_timer(T0 + 300.0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.handle_timer(T0 + 499.9)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.handle_timer(T0 + 500.0)
    o = pop(core)
    _failed(o, ErrorCode.TRANSFER_TIMEOUT)
    assert o.to("d0") == []  # write 1 is still in flight: the ABORT waits for it
    core.write_done(1, "d0", ws[1].seq, 1, T0 + 501)
    assert [m.code for m in pop(core).to("d0")] == [ErrorCode.TRANSFER_TIMEOUT]
    core.write_done(1, "d0", ws[1].seq, 1, T0 + 502)  # a second report is late: absorbed, counted
    assert core.stats.late_messages == 1
    assert pop(core).sends == []
    assert_clean(core)


def test_sender_transfer_deadline_refreshes_on_chunk():
    """Posting a chunk's writes is progress: it re-arms the TRANSFERRING deadline (minor 1)."""
    core, _ = ready_core(1, 48)
    core.submit_chunk(1, [1], 16, T0, last=False)
    assert core.next_deadline() == T0 + 300.0
    core.submit_chunk(1, [2], 32, T0 + 100.0, last=False)
    assert core.next_deadline() == T0 + 400.0
    core.handle_timer(T0 + 399.9)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.handle_timer(T0 + 400.0)
    _failed(pop(core), ErrorCode.TRANSFER_TIMEOUT)


def test_sender_large_clock_step_fires_the_current_deadline():
    """One 30 s step fires BOOTSTRAP_TIMEOUT; a huge step after a state change fires only the new one."""
    core = make_core()
    core.add_link(make_link())
    core.open_room(1, T0)
    core.open_room(2, T0)
    core.on_message("d0", req(2), T0 + 1)
    core.handle_timer(T0 + 30.0)
    assert core.room_state(1) is RoomState.FAILED
    assert core.room_state(2) is RoomState.WAITING_FOR_INPUT
    core.handle_timer(T0 + 1e6)
    ended = pop(core).ended
    assert [(e.room_id, e.code) for e in ended] == [(1, ErrorCode.BOOTSTRAP_TIMEOUT),
                                                   (2, ErrorCode.WAITING_TIMEOUT)]


def test_sender_no_deadline_when_timeouts_none():
    """With every timeout None, nothing ever fires."""
    core = make_core(timeouts=Timeouts(bootstrap=None, waiting=None, transfer=None))
    core.add_link(make_link())
    core.open_room(1, T0)
    assert core.next_deadline() is None
    core.on_message("d0", req(1), T0)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.handle_timer(T0 + 1e9)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert len(core.timers) == 0


# --- failures, aborts, close ----------------------------------------------------------------------


def test_sender_write_failed_is_transport_error():
    """A failed write fails the room TRANSPORT_ERROR and tells decode."""
    core, _ = ready_core(1, 40)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    (w,) = pop(core).writes
    core.write_failed(1, "d0", w.seq, "nic on fire", T0)
    o = pop(core)
    _failed(o, ErrorCode.TRANSPORT_ERROR)
    assert [m.code for m in o.to("d0")] == [ErrorCode.TRANSPORT_ERROR]
    core.write_failed(1, "d0", w.seq, "again", T0)
    core.write_done(77, "d0", 0, 1, T0)
    assert core.stats.late_messages == 1 and core.stats.unknown_room_messages == 1


def _to_state(core: SenderCore, state: RoomState) -> None:
    """Drive room 1 (link d0 of paired (0, 1); d1 registered) to ``state``."""
    core.open_room(1, T0)
    if state is RoomState.BOOTSTRAPPING:
        return
    core.on_message("d0", req(1, 40, gen=3), T0)
    core.on_message("d1", req(1, 40, gen=4), T0)
    if state is RoomState.TRANSFERRING:
        core.submit_chunk(1, [1], 16, T0, last=False)


@pytest.mark.parametrize("state", [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING])
def test_sender_local_abort_in_each_state(state):
    """abort() fails the room ABORTED once and sends ABORT to every peer that has asked; idempotent."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    _to_state(core, state)
    assert core.room_state(1) is state
    pop(core)
    writes = core.rooms[1].peers[0].inflight | core.rooms[1].peers[1].inflight if state is not \
        RoomState.BOOTSTRAPPING else set()
    core.abort(1, T0, "user said so")
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    asked = state is not RoomState.BOOTSTRAPPING
    if state is RoomState.TRANSFERRING:
        # each link's ABORT waits until its own write in flight is reported
        assert writes == {0} and o.sends == []
        core.write_done(1, "d1", 0, 1, T0)
        assert [(m.generation, m.code) for m in pop(core).to("d1")] == [(4, ErrorCode.ABORTED)]
        core.write_failed(1, "d0", 0, "cancelled", T0)
        o = pop(core)
    assert [(m.generation, m.code) for m in o.to("d0")] == ([(3, ErrorCode.ABORTED)] if asked else [])
    if state is not RoomState.TRANSFERRING:
        assert [(m.generation, m.code) for m in o.to("d1")] == ([(4, ErrorCode.ABORTED)] if asked else [])
    core.abort(1, T0)
    core.abort(12345, T0)
    assert pop(core).ended == []
    assert core._draining == {}
    assert_clean(core)


@pytest.mark.parametrize("state", [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING])
def test_sender_peer_abort_in_each_state(state):
    """decode's ABORT fails the room with decode's code; every requester hears it, the aborting
    link too (the ack it waits for), each once its writes in flight are reported (minor 1)."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    if state is RoomState.BOOTSTRAPPING:
        core.open_room(1, T0)
        core.on_message("d0", req(1, 40, gen=3), T0)
    else:
        _to_state(core, state)
    pop(core)
    core.on_message("d0", Abort(room_id=1, generation=3, code=ErrorCode.ABORTED, reason="bye"), T0)
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    if state is RoomState.TRANSFERRING:
        assert o.sends == []  # write 0 to each link is in flight
        core.write_done(1, "d0", 0, 1, T0)
        core.write_done(1, "d1", 0, 1, T0)
        o = pop(core)
    assert [(m.generation, m.code) for m in o.to("d0")] == [(3, ErrorCode.ABORTED)]
    expect_d1 = [] if state is RoomState.BOOTSTRAPPING else [(4, ErrorCode.ABORTED)]
    assert [(m.generation, m.code) for m in o.to("d1")] == expect_d1
    assert_clean(core)
    assert core._draining == {}


def test_sender_peer_abort_from_paired_rank_before_its_request():
    """An ABORT from a paired decode rank of the room's instance that has not asked yet (decode
    failed in WAITING_FOR_INPUT) fails the room with its code; the rank that asked hears it."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.add_link(make_link(0, key="b0", instance="decode-B", paired=(0,)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, 40, gen=3), T0)
    core.on_message("b0", Abort(room_id=1, generation=8, code=ErrorCode.ABORTED, reason="other"), T0)
    assert core.room_state(1) is RoomState.BOOTSTRAPPING and core.stats.stale_tags == 1  # not its instance
    core.on_message("d1", Abort(room_id=1, generation=9, code=ErrorCode.WAITING_TIMEOUT, reason="w"), T0)
    o = pop(core)
    _failed(o, ErrorCode.WAITING_TIMEOUT)
    assert [(m.generation, m.code) for m in o.to("d0")] == [(3, ErrorCode.WAITING_TIMEOUT)]
    assert o.to("d1") == []  # it sent no request: there is no generation to answer under
    assert_clean(core)


def test_sender_peer_abort_before_any_request_fails_open_room():
    """An ABORT from a paired decode rank for an open room no request reached fails it at once."""
    core = make_core()
    core.add_link(make_link())
    core.open_room(1, T0)
    core.on_message("d0", Abort(room_id=1, generation=5, code=ErrorCode.ABORTED, reason="x"), T0)
    o = pop(core)
    _failed(o, ErrorCode.ABORTED)
    assert o.sends == []
    core.on_message("d0", req(1, gen=5), T0)  # its request overtaken by nothing: late, answered
    assert [(m.generation, m.code) for m in pop(core).to("d0")] == [(5, ErrorCode.ABORTED)]
    assert_clean(core)


def test_sender_peer_abort_of_other_generation_is_stale():
    """An ABORT naming another generation (or an unregistered link) does not touch the room."""
    core, _ = ready_core(1, 40)
    core.on_message("d0", Abort(room_id=1, generation=12, code=ErrorCode.ABORTED, reason=""), T0)
    core.on_message("zz", Abort(room_id=1, generation=11, code=ErrorCode.ABORTED, reason=""), T0)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    assert core.stats.stale_tags == 2


def test_sender_peer_abort_with_unknown_code_keeps_raw_code():
    """A code newer than this build is kept as a raw int."""
    core, _ = ready_core(1, 40)
    core.on_message("d0", Abort(room_id=1, generation=11, code=999, reason="future"), T0)
    (e,) = pop(core).ended
    assert e.code == 999 and e.state is RoomState.FAILED


def test_sender_abort_after_end_is_counted_not_raised():
    """ABORT, requests and DONEs for an ended room are absorbed and counted as late."""
    core, _ = ready_core(1, 16)
    core.submit_chunk(1, [1], 16, T0, last=True)
    finish_writes(core, pop(core).writes)
    pop(core)
    core.on_message("d0", Abort(room_id=1, generation=11, code=ErrorCode.ABORTED, reason=""), T0)
    core.write_done(1, "d0", 0, 1, T0)
    core.on_message("d0", req(1, 16, gen=11), T0)
    o = pop(core)
    assert [m.code for m in o.to("d0")] == [ErrorCode.UNKNOWN_ROOM]  # the late request is answered
    assert core.stats.late_messages == 3
    assert o.ended == []
    assert_clean(core)


def test_sender_remove_link_fails_exactly_rooms_using_it():
    """remove_link fails rooms with that peer or expecting its rank (PEER_GONE), not the others;
    the removed link is told nothing.

    Regression (minor 1): ABORT_PEERS used to send ABORT to the removed link too, and to hold
    one for it (a drain) when it had writes in flight."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.add_link(make_link(0, key="b0", instance="decode-B", paired=(0,)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)  # partial, expects d1 too
    core.open_room(2, T0)
    core.on_message("d0", req(2, gen=5), T0)
    core.on_message("d1", req(2, gen=6), T0)
    core.open_room(3, T0)
    core.on_message("b0", req(3, gen=7), T0)
    core.open_room(4, T0)  # no request yet: bound to no instance
    pop(core)
    core.remove_link("d1", T0)
    o = pop(core)
    assert sorted((e.room_id, e.code) for e in o.ended) == [(1, ErrorCode.PEER_GONE), (2, ErrorCode.PEER_GONE)]
    assert sorted((m.room_id, m.generation) for m in o.to("d0")) == [(1, 3), (2, 5)]
    assert o.to("d1") == [] and o.to("b0") == []
    assert core.room_state(3) is RoomState.WAITING_FOR_INPUT
    assert core.room_state(4) is RoomState.BOOTSTRAPPING
    core.remove_link("d1", T0)  # twice: nothing
    assert pop(core).ended == []


def test_sender_remove_link_holds_no_abort_for_the_gone_link():
    """Regression: a room failed by remove_link with writes in flight to the removed link and to
    another link holds the ABORT only for the other link; the gone link's late reports are counted."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)
    core.on_message("d1", req(1, gen=4), T0)
    core.submit_chunk(1, [1], 16, T0, last=False)
    w_d0, w_d1 = sorted(pop(core).writes, key=lambda w: w.link)
    core.remove_link("d1", T0)
    o = pop(core)
    _failed(o, ErrorCode.PEER_GONE)
    assert o.sends == []
    assert list(core._draining) == [(1, "d0")]
    core.write_failed(1, "d1", w_d1.seq, "peer gone", T0, tag=w_d1.tag)
    assert pop(core).sends == [] and core.stats.late_messages == 1
    core.write_done(1, "d0", w_d0.seq, 1, T0, tag=w_d0.tag)
    assert [(m.generation, m.code) for m in pop(core).to("d0")] == [(3, ErrorCode.PEER_GONE)]
    assert core._draining == {}


def test_sender_close_fails_every_live_room_once():
    """close() fails each live room ENDPOINT_CLOSED once, tells peers, is idempotent, then refuses."""
    core, _ = ready_core(1, 40)
    core.open_room(2, T0)
    core.open_room(3, T0)
    core.abort(3, T0)
    pop(core)
    core.close(T0)
    o = pop(core)
    assert sorted((e.room_id, e.code) for e in o.ended) == [(1, ErrorCode.ENDPOINT_CLOSED),
                                                           (2, ErrorCode.ENDPOINT_CLOSED)]
    assert [(m.room_id, m.code) for m in o.to("d0")] == [(1, ErrorCode.ENDPOINT_CLOSED)]
    core.close(T0)
    assert pop(core).ended == []
    with pytest.raises(LocalProtocolError) as info:
        core.open_room(9, T0)
    assert info.value.code is ErrorCode.ENDPOINT_CLOSED
    assert_clean(core)


def test_sender_close_answers_parked_requests():
    """Regression: close() answers parked requests ENDPOINT_CLOSED and forgets them and their deadline."""
    core = make_core()
    core.add_link(make_link())
    core.on_message("d0", req(5, gen=42), T0)
    pop(core)
    core.close(T0)
    o = pop(core)
    assert [(m.room_id, m.generation, m.code) for m in o.to("d0")] == [(5, 42, ErrorCode.ENDPOINT_CLOSED)]
    assert_clean(core)
    core.handle_timer(T0 + 1e6)
    assert pop(core).sends == []
    core.on_message("d0", req(6, gen=43), T0)  # a request after close is refused, not parked
    assert [(m.room_id, m.code) for m in pop(core).to("d0")] == [(6, ErrorCode.ENDPOINT_CLOSED)]
    assert_clean(core)


def test_sender_close_holds_aborts_until_writes_done_then_abandon_flushes():
    """close() fails a TRANSFERRING room but its ABORT waits for the write in flight; a report
    releases it; abandon_drains() sends the ABORTs still held (the endpoint is going away)."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)
    core.on_message("d1", req(1, gen=4), T0)
    core.submit_chunk(1, [1], 16, T0, last=False)
    pop(core)
    core.close(T0)
    o = pop(core)
    _failed(o, ErrorCode.ENDPOINT_CLOSED)
    assert o.sends == [] and sorted(core._draining) == [(1, "d0"), (1, "d1")]
    core.write_done(1, "d0", 0, 1, T0)
    assert [(m.generation, m.code) for m in pop(core).to("d0")] == [(3, ErrorCode.ENDPOINT_CLOSED)]
    core.abandon_drains()
    o = pop(core)
    assert [(m.generation, m.code) for m in o.to("d1")] == [(4, ErrorCode.ENDPOINT_CLOSED)]
    assert o.to("d0") == [] and core._draining == {}
    core.write_done(1, "d1", 0, 1, T0)  # the write ends after all: late
    assert pop(core).sends == [] and core.stats.late_messages == 1
    assert_clean(core)


def test_sender_drain_keeps_write_seqs_per_link():
    """Reports for writes of a failed room count for the link they were posted to: one link's
    report never releases the ABORT held for another link."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)
    core.on_message("d1", req(1, gen=4), T0)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2], 32, T0, last=False)
    pop(core)
    core.abort(1, T0)
    pop(core)
    core.write_done(1, "d0", 0, 1, T0)
    core.write_done(1, "d0", 1, 1, T0)
    core.write_done(1, "d0", 1, 1, T0)  # twice: the second is late
    o = pop(core)
    assert [m.generation for m in o.to("d0")] == [3] and o.to("d1") == []
    assert core.stats.late_messages == 1
    core.write_done(1, "d1", 1, 1, T0)
    assert pop(core).sends == []
    core.write_failed(1, "d1", 0, "x", T0)
    assert [m.generation for m in pop(core).to("d1")] == [4]
    assert core._draining == {}


def test_sender_room_traces_released_on_end():
    """An ended room keeps only a tombstone: no room, deadline, peers, pages or chunks."""
    core, _ = ready_core(1, 40)
    room = core.rooms[1]
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    core.abort(1, T0)
    assert room.peers == {} and list(room.src_pages) == [] and room.chunks == []
    assert core.room_state(1) is RoomState.FAILED
    assert_clean(core, drains=1)  # only the ABORT held for the write in flight remains
    core.write_done(1, "d0", 0, 1, T0)
    assert [m.code for m in pop(core).to("d0")] == [ErrorCode.ABORTED]
    assert_clean(core)


def test_sender_tombstones_are_bounded(monkeypatch):
    """Only the newest TOMBSTONES ended rooms are remembered; older ones read as unknown."""
    monkeypatch.setattr(core_base, "TOMBSTONES", 3)
    core = make_core()
    for room in range(1, 6):
        core.open_room(room, T0)
        core.abort(room, T0)
    assert [core.room_state(r) for r in range(1, 6)] == [None, None] + [RoomState.FAILED] * 3
    core.write_done(1, "d0", 0, 1, T0)
    core.write_done(5, "d0", 0, 1, T0)
    assert core.stats.unknown_room_messages == 1 and core.stats.late_messages == 1


# --- write reports that are not this room's -------------------------------------------------------


def _reopen_with_old_write(state: RoomState, *, abandon: bool = True) -> tuple[SenderCore, PostWrite]:
    """Room 1 fails with write seq 0 in flight, then is opened again and driven to ``state``.
    ``abandon``: the ABORT held for the old write is sent now (abandon_drains), so the old
    write's report belongs to nothing any more."""
    core, _ = ready_core(1, 40, gen=11)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    (old,) = pop(core).writes
    core.on_message("d0", Abort(room_id=1, generation=11, code=ErrorCode.ABORTED, reason=""), T0)
    assert list(core._draining) == [(1, "d0")]
    if abandon:
        core.abandon_drains()
    core.open_room(1, T0)
    if state is not RoomState.BOOTSTRAPPING:
        core.on_message("d0", req(1, 40, gen=12), T0)
    if state is RoomState.TRANSFERRING:
        core.submit_chunk(1, [4, 5, 6], 40, T0, last=True)
    pop(core)
    assert core.room_state(1) is state
    return core, old


@pytest.mark.parametrize("state", [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT])
@pytest.mark.parametrize("report", ["done", "failed"])
def test_sender_old_write_report_does_not_touch_reopened_room(state, report):
    """Regression: a DONE/failure of an earlier room's write, even without its tag, is dropped as stale.

    It used to fail the reopened room INTERNAL_ERROR (a write report while BOOTSTRAPPING/WAITING).
    """
    core, old = _reopen_with_old_write(state)
    if report == "done":
        core.write_done(1, "d0", old.seq, 1, T0)
    else:
        core.write_failed(1, "d0", old.seq, "late failure", T0)
    assert core.room_state(1) is state
    assert pop(core).ended == []
    assert core.stats.stale_tags == 1


@pytest.mark.parametrize("report", ["done", "failed"])
def test_sender_old_write_report_with_tag_does_not_complete_reopened_room(report):
    """Regression: with the write's tag, an earlier room's report of the same seq is told apart.

    It used to complete the new room (TRANSFER_DONE, SUCCESS) while its own write was in flight.
    """
    core, old = _reopen_with_old_write(RoomState.TRANSFERRING)
    new = core.rooms[1].peers[0].inflight
    assert new == {old.seq}  # the same (room, link, seq): only the tag differs
    if report == "done":
        core.write_done(1, "d0", old.seq, 1, T0, tag=old.tag)
    else:
        core.write_failed(1, "d0", old.seq, "late failure", T0, tag=old.tag)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert pop(core).sends == []
    assert core.stats.stale_tags == 1
    new_tag = Tag(kind=TagKind.KV, room_id=1, generation=12, link_id=40, seq=old.seq).encode()
    core.write_done(1, "d0", old.seq, 1, T0, tag=new_tag)
    assert core.room_state(1) is RoomState.SUCCESS


@pytest.mark.parametrize("state", [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING])
@pytest.mark.parametrize("report", ["done", "failed"])
def test_sender_old_write_report_releases_held_abort_of_reopened_room(state, report):
    """Regression: the room id is reopened while the failed incarnation's ABORT still waits for its
    write: that write's report (told apart by its tag) releases the old ABORT, never touches the
    new room. It used to be counted stale for the new room, and the old ABORT was held forever."""
    core, old = _reopen_with_old_write(state, abandon=False)
    if report == "done":
        core.write_done(1, "d0", old.seq, 1, T0, tag=old.tag)
    else:
        core.write_failed(1, "d0", old.seq, "late failure", T0, tag=old.tag)
    o = pop(core)
    assert [(m.generation, m.code) for m in o.to("d0")] == [(11, ErrorCode.ABORTED)]
    assert o.ended == [] and o.posts == []
    assert core.room_state(1) is state and core._draining == {}
    if state is RoomState.TRANSFERRING:
        assert core.rooms[1].peers[0].inflight == {old.seq}  # the new write is still awaited
        new_tag = Tag(kind=TagKind.KV, room_id=1, generation=12, link_id=40, seq=old.seq).encode()
        core.write_done(1, "d0", old.seq, 1, T0, tag=new_tag)
        assert core.room_state(1) is RoomState.SUCCESS


def test_sender_old_write_report_without_tag_prefers_live_write():
    """Without a tag, a report whose seq the reopened room has in flight counts for the live room
    (the documented limit of tagless reports); one it has not releases the old ABORT."""
    core, old = _reopen_with_old_write(RoomState.WAITING_FOR_INPUT, abandon=False)
    core.write_done(1, "d0", old.seq, 1, T0)  # the live room posted nothing: the old write's
    assert [m.generation for m in pop(core).to("d0")] == [11]
    core, old = _reopen_with_old_write(RoomState.TRANSFERRING, abandon=False)
    core.write_done(1, "d0", old.seq, 1, T0)
    o = pop(core)
    assert core.room_state(1) is RoomState.SUCCESS and o.to("d0")[0].generation == 12
    assert list(core._draining) == [(1, "d0")]


def test_sender_duplicate_or_unknown_write_done_ignored():
    """A second DONE for one write, or a DONE for a seq never posted, neither counts nor completes."""
    core, _ = ready_core(1, 40)
    core.submit_chunk(1, [1], 16, T0, last=False)
    core.submit_chunk(1, [2, 3], 40, T0, last=True)
    w0, w1 = pop(core).writes
    core.write_done(1, "d0", w0.seq, 1, T0, tag=w0.tag)
    core.write_done(1, "d0", w0.seq, 1, T0, tag=w0.tag)
    core.write_done(1, "d0", 7, 1, T0)
    core.write_done(1, "elsewhere", w1.seq, 1, T0)
    assert core.room_state(1) is RoomState.TRANSFERRING
    assert core.stats.stale_tags == 3
    core.write_done(1, "d0", w1.seq, 1, T0)
    o = pop(core)
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=2, nbytes=2)]


def test_sender_late_request_for_failed_room_answered_with_its_code():
    """A request for a room that failed here before any request reached it is answered at once with
    the room's code (ABORTED), and counted late (minor 1; 1.0 said UNKNOWN_ROOM)."""
    core = make_core()
    core.add_link(make_link())
    core.open_room(1, T0)
    core.abort(1, T0)
    pop(core)
    core.on_message("d0", req(1, gen=5), T0 + 1)
    assert [(m.room_id, m.generation, m.code) for m in pop(core).to("d0")] == [(1, 5, ErrorCode.ABORTED)]
    assert core.stats.late_messages == 1
    assert_clean(core)


@pytest.mark.parametrize("ended", ["failed", "succeeded"])
def test_sender_late_request_of_ended_generation_answered(ended):
    """A request carrying a generation the ended room knew (a duplicate) is answered at once: with the
    room's code when it FAILED, UNKNOWN_ROOM when it succeeded."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, 16, gen=3), T0)
    core.on_message("d1", req(1, 16, gen=4), T0)
    if ended == "failed":
        core.peer_violation("d1", 1, 4, ErrorCode.MALFORMED_FRAME, "x", T0)
    else:
        core.submit_chunk(1, [1], 16, T0, last=True)
        finish_writes(core, pop(core).writes)
    pop(core)
    core.on_message("d0", req(1, 16, gen=3), T0)
    code = ErrorCode.MALFORMED_FRAME if ended == "failed" else ErrorCode.UNKNOWN_ROOM
    assert [(m.generation, m.code) for m in pop(core).to("d0")] == [(3, code)]
    assert core._parked == {} and core.stats.late_messages == 1


def test_sender_reused_room_id_new_generation_is_parked():
    """A request with a generation the ended room never saw is a new incarnation of the id: it is
    parked (not refused) and replayed when the application opens the room again."""
    core, _ = ready_core(1, 16, gen=11)
    core.abort(1, T0)
    pop(core)
    core.on_message("d0", req(1, 16, gen=12), T0 + 1)
    assert pop(core).sends == []
    assert core._parked_count == 1 and core.stats.late_messages == 0
    core.open_room(1, T0 + 2)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    core.submit_chunk(1, [1], 16, T0 + 2, last=True)
    finish_writes(core, pop(core).writes)
    assert pop(core).to("d0") == [TransferDone(room_id=1, generation=12, writes=1, nbytes=100)]
    assert_clean(core)


def test_sender_parked_replay_answers_every_request_when_room_fails():
    """Regression: if a replayed parked request fails the room, the requests parked after it are
    answered at once with the room's code (no request was accepted: they are late for the ended
    room, minor 1) instead of being dropped unanswered."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.on_message("d0", req(1, gen=3, pages=(0, 1, 99)), T0)
    core.on_message("d1", req(1, gen=4), T0)
    core.open_room(1, T0)
    o = pop(core)
    _failed(o, ErrorCode.INDEX_OUT_OF_RANGE)
    assert [(m.generation, m.code) for m in o.to("d0")] == [(3, ErrorCode.INDEX_OUT_OF_RANGE)]
    assert [(m.generation, m.code) for m in o.to("d1")] == [(4, ErrorCode.INDEX_OUT_OF_RANGE)]
    assert_clean(core)


def test_sender_peer_violation_from_paired_rank_before_its_request_fails_room():
    """peer_violation() from a paired rank of the room's instance that has not asked yet fails the room
    and answers that link."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)
    core.peer_violation("d1", 1, 9, ErrorCode.MALFORMED_FRAME, "garbled", T0)
    o = pop(core)
    _failed(o, ErrorCode.MALFORMED_FRAME)
    assert [(m.generation, m.code) for m in o.to("d1")] == [(9, ErrorCode.MALFORMED_FRAME)]
    assert [(m.generation, m.code) for m in o.to("d0")] == [(3, ErrorCode.MALFORMED_FRAME)]


# --- staging (minor 1) -----------------------------------------------------------------------------

UNIT, CAP = 64, 4096  # 64 tokens


def staged_core(room: int = 1, n: int = 40, *, max_units: int = 0, **kw) -> SenderCore:
    core, _ = ready_core(room, n, link=make_link(unit=UNIT, capacity=CAP, max_units=max_units), **kw)
    return core


def grant(room: int, seq: int, start: int, end: int, offset: int = 0, gen: int = 11) -> StagingGrant:
    return StagingGrant(room_id=room, generation=gen, seq=seq, start_token=start, end_token=end, offset=offset)


def test_sender_staged_link_asks_grant_then_posts_staged_write():
    """A staged link sends STAGING_REQUEST (seq reserved) instead of writing; each grant becomes one
    PostStaged at the granted offset, tagged STAGED; a partial grant is followed by a request for
    the rest under a new seq; the aux write takes the next seq; TRANSFER_DONE counts every write."""
    core = staged_core(1, 40, aux=1)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, aux_slot=0)
    o = pop(core)
    assert o.writes == [] and o.staged == [] and len(o.aux) == 1
    assert o.to("d0") == [StagingRequest(room_id=1, generation=11, seq=0, start_token=0, end_token=40)]
    (aux,) = o.aux
    assert aux.seq == 1  # seq 0 is reserved by the staging request
    core.on_message("d0", grant(1, 0, 0, 16, offset=128), T0)
    o = pop(core)
    (w,) = o.staged
    assert (w.seq, w.start_token, w.end_token, w.remote_offset, tuple(w.src_pages)) == (0, 0, 16, 128, (1, 2, 3))
    t = decode_tag(w.tag)
    assert (t.kind, t.room_id, t.generation, t.link_id, t.seq) == (TagKind.STAGED, 1, 11, 40, 0)
    assert o.to("d0") == [StagingRequest(room_id=1, generation=11, seq=2, start_token=16, end_token=40)]
    core.on_message("d0", grant(1, 2, 16, 40, offset=0), T0)
    (w2,) = pop(core).staged
    assert (w2.seq, w2.start_token, w2.end_token) == (2, 16, 40)
    core.on_message("d0", StagingWatermark(room_id=1, generation=11, seq=0, watermark=4096), T0)
    assert core.rooms[1].peers[0].consumed == 1
    for x in (w, aux):
        core.write_done(1, "d0", x.seq, 10, T0, tag=x.tag)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.write_done(1, "d0", w2.seq, 10, T0, tag=w2.tag)
    o = pop(core)
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=3, nbytes=30)]
    assert [e.state for e in o.ended] == [RoomState.SUCCESS]
    core.on_message("d0", StagingWatermark(room_id=1, generation=11, seq=2, watermark=8192), T0)  # late
    assert core.stats.late_messages == 1
    assert_clean(core)


def test_sender_staging_requests_follow_chunks_prefix_and_max_units():
    """Requests start at the prefix, cover only tokens already given, at most one outstanding, and
    at most stage_max_units tokens each."""
    core = staged_core(1, 64, prefix=16, max_units=20)
    core.submit_chunk(1, [1], 16, T0, last=False)
    assert pop(core).sends == []  # all of it is prefix
    core.submit_chunk(1, [2], 32, T0, last=False)
    assert [(m.seq, m.start_token, m.end_token) for m in pop(core).to("d0")] == [(0, 16, 32)]
    core.submit_chunk(1, [3, 4], 64, T0, last=True)
    assert pop(core).to("d0") == []  # one request outstanding at a time
    core.on_message("d0", grant(1, 0, 16, 32), T0)
    assert [(m.seq, m.start_token, m.end_token) for m in pop(core).to("d0")] == [(1, 32, 52)]
    core.on_message("d0", grant(1, 1, 32, 40), T0)
    assert [(m.seq, m.start_token, m.end_token) for m in pop(core).to("d0")] == [(2, 40, 60)]
    core.on_message("d0", grant(1, 2, 40, 60), T0)
    assert [(m.seq, m.start_token, m.end_token) for m in pop(core).to("d0")] == [(3, 60, 64)]
    core.on_message("d0", grant(1, 3, 60, 64), T0)
    assert pop(core).to("d0") == []
    for seq in range(4):
        core.write_done(1, "d0", seq, 1, T0)
    assert pop(core).to("d0")[0].writes == 4


def _two_staged_rooms() -> SenderCore:
    core = make_core()
    core.add_link(make_link(unit=UNIT, capacity=CAP))
    for room, gen in ((1, 11), (2, 12)):
        core.open_room(room, T0)
        core.on_message("d0", req(room, 40, gen=gen), T0)
        core.submit_chunk(room, [1, 2, 3], 40, T0, last=True)
    pop(core)
    return core


@pytest.mark.parametrize(
    "bad, code",
    [
        (dict(seq=5), ErrorCode.PEER_PROTOCOL_ERROR),
        (dict(start_token=8), ErrorCode.PEER_PROTOCOL_ERROR),
        (dict(end_token=0), ErrorCode.INDEX_OUT_OF_RANGE),
        (dict(end_token=41), ErrorCode.INDEX_OUT_OF_RANGE),
        (dict(offset=CAP - 16 * UNIT + 64), ErrorCode.INDEX_OUT_OF_RANGE),
        ("twice", ErrorCode.PEER_PROTOCOL_ERROR),
    ],
    ids=["seq", "start", "empty", "beyond-request", "overruns-region", "not-outstanding"],
)
def test_sender_grant_mismatch_fails_only_that_room(bad, code):
    """A STAGING_GRANT that does not answer the outstanding request (seq, start), grants nothing or
    more than asked, or overruns the staging region fails its room with the code, posts nothing,
    tells decode; the other room on the same link carries on."""
    core = _two_staged_rooms()
    if bad == "twice":
        core.on_message("d0", grant(1, 0, 0, 16), T0)
        (w,) = pop(core).staged
        msg = grant(1, 0, 0, 16)  # the request now outstanding is seq 1 at token 16
    else:
        w = None
        msg = replace(grant(1, 0, 0, 16), **bad)
    core.on_message("d0", msg, T0)
    o = pop(core)
    _failed(o, code)
    assert o.staged == []
    if w is None:
        assert [(m.room_id, m.code) for m in o.to("d0")] == [(1, code)]
    else:  # its staged write is in flight: the ABORT waits for it
        assert o.to("d0") == []
        core.write_done(1, "d0", w.seq, 1, T0, tag=w.tag)
        assert [(m.room_id, m.code) for m in pop(core).to("d0")] == [(1, code)]
    core.on_message("d0", grant(2, 0, 0, 40, gen=12), T0)
    (w2,) = pop(core).staged
    core.write_done(2, "d0", w2.seq, 1, T0, tag=w2.tag)
    assert core.room_state(2) is RoomState.SUCCESS
    assert_clean(core)


def test_sender_stale_and_late_grants_touch_nothing():
    """A grant of another generation is stale; a grant for an ended room is late; neither posts."""
    core = _two_staged_rooms()
    core.on_message("d0", grant(1, 0, 0, 40, gen=99), T0)
    assert core.stats.stale_tags == 1 and core.room_state(1) is RoomState.TRANSFERRING
    core.abort(1, T0)
    pop(core)
    core.on_message("d0", grant(1, 0, 0, 40), T0)
    o = pop(core)
    assert o.posts == [] and o.sends == [] and core.stats.late_messages == 1


def test_sender_failure_with_staging_request_outstanding_aborts_at_once():
    """A staging request that was not granted is no write: the ABORT goes at once; a posted staged
    write holds it until reported."""
    core = _two_staged_rooms()
    core.abort(1, T0)
    assert [(m.room_id, m.code) for m in pop(core).to("d0")] == [(1, ErrorCode.ABORTED)]
    core.on_message("d0", grant(2, 0, 0, 40, gen=12), T0)
    (w,) = pop(core).staged
    core.abort(2, T0)
    assert pop(core).sends == []
    core.write_failed(2, "d0", w.seq, "cancelled", T0, tag=w.tag)
    assert [(m.room_id, m.code) for m in pop(core).to("d0")] == [(2, ErrorCode.ABORTED)]
    assert_clean(core)


@pytest.mark.parametrize("state", ["outstanding", "granted", "two-peers"])
def test_sender_transfer_timeout_with_request_awaiting_grant_is_staging_stalled(state):
    """A TRANSFERRING room that times out while a staging request of any of its peers awaits its
    grant fails STAGING_STALLED (decode's ring is not serving it); once granted (the staged write in
    flight, nothing awaiting a grant) it is a plain TRANSFER_TIMEOUT."""
    core = make_core()
    paired = (0, 1) if state == "two-peers" else (0,)
    core.add_link(make_link(0, paired=paired, unit=UNIT, capacity=CAP))
    if state == "two-peers":  # a second, direct peer with its write in flight
        core.add_link(make_link(1, paired=paired, aux_owner=False))
    core.open_room(1, T0)
    core.on_message("d0", req(1, 40, gen=11), T0)
    if state == "two-peers":
        core.on_message("d1", req(1, 40, gen=21), T0)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    pop(core)
    if state == "granted":
        core.on_message("d0", grant(1, 0, 0, 40), T0 + 1)
        (w,) = pop(core).staged
    core.handle_timer(T0 + 299.9)
    assert core.room_state(1) is RoomState.TRANSFERRING
    core.handle_timer(T0 + 300.0)
    o = pop(core)
    code = ErrorCode.TRANSFER_TIMEOUT if state == "granted" else ErrorCode.STAGING_STALLED
    _failed(o, code)
    if state == "granted":
        assert o.to("d0") == []  # the staged write is in flight: the ABORT waits for it
        core.write_done(1, "d0", w.seq, 1, T0 + 302, tag=w.tag)
        assert [m.code for m in pop(core).to("d0")] == [code]
    else:
        assert [m.code for m in o.to("d0")] == [code]  # a request awaiting its grant is no write
    assert_clean(core, drains=1 if state == "two-peers" else 0)


def test_sender_staging_stalled_only_for_the_room_awaiting_its_grant():
    """Two staged rooms on one link, both timing out: the one whose request awaits its grant fails
    STAGING_STALLED, the one whose grant came (write in flight) TRANSFER_TIMEOUT."""
    core = _two_staged_rooms()
    core.on_message("d0", grant(2, 0, 0, 40, gen=12), T0)
    (w2,) = pop(core).staged
    core.handle_timer(T0 + 300.0)
    assert {e.room_id: e.code for e in pop(core).ended} == {1: ErrorCode.STAGING_STALLED,
                                                           2: ErrorCode.TRANSFER_TIMEOUT}
    core.write_done(2, "d0", w2.seq, 1, T0 + 301, tag=w2.tag)
    assert [(m.room_id, m.code) for m in pop(core).to("d0")] == [(2, ErrorCode.TRANSFER_TIMEOUT)]
    assert_clean(core)


def test_sender_waiting_timeout_of_staged_link_is_not_staging_stalled():
    """STAGING_STALLED is only a TRANSFERRING verdict: a staged room waiting for its KV times out
    WAITING_TIMEOUT."""
    core = staged_core()
    core.handle_timer(T0 + 300.0)
    _failed(pop(core), ErrorCode.WAITING_TIMEOUT)
    assert_clean(core)


@pytest.mark.parametrize("case", ["never-granted", "reserved-not-granted", "aux-write", "twice"])
def test_sender_watermark_for_write_not_staged_is_violation(case):
    """A STAGING_WATERMARK must name a seq granted as staged and not yet watermarked: one for a seq
    never used, a seq reserved by a request still awaiting its grant, a direct (aux) write, or a
    second one for the same seq fails the room PEER_PROTOCOL_ERROR; the ABORT waits for the writes
    in flight; the other room on the link carries on."""
    core = make_core()
    core.add_link(make_link(unit=UNIT, capacity=CAP, max_units=16))
    core.open_room(1, T0)
    core.on_message("d0", req(1, 40, gen=11, aux=1), T0)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, aux_slot=0)
    (aux,) = pop(core).aux  # seq 1 (seq 0 is reserved by the staging request)
    core.on_message("d0", grant(1, 0, 0, 16), T0)
    o = pop(core)
    (w,) = o.staged
    (nxt,) = o.to("d0")  # seq 2 asked for [16, 32)
    core.on_message("d0", StagingWatermark(room_id=1, generation=11, seq=0, watermark=CAP), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING and core.rooms[1].peers[0].consumed == 1
    core.open_room(2, T0)
    core.on_message("d0", req(2, 16, gen=12), T0)
    seq = {"never-granted": 7, "reserved-not-granted": nxt.seq, "aux-write": aux.seq, "twice": 0}[case]
    core.on_message("d0", StagingWatermark(room_id=1, generation=11, seq=seq, watermark=CAP), T0)
    o = pop(core)
    _failed(o, ErrorCode.PEER_PROTOCOL_ERROR)
    assert core.stats.peer_violations == 1
    assert o.to("d0") == []  # the staged write and the aux write are in flight
    core.write_done(1, "d0", w.seq, 1, T0, tag=w.tag)
    core.write_done(1, "d0", aux.seq, 1, T0, tag=aux.tag)
    assert [(m.room_id, m.code) for m in pop(core).to("d0")] == [(1, ErrorCode.PEER_PROTOCOL_ERROR)]
    core.on_message("d0", StagingWatermark(room_id=1, generation=11, seq=0, watermark=CAP), T0)
    assert core.stats.late_messages == 1 and pop(core).ended == []  # after the end: late
    core.submit_chunk(2, [4], 16, T0, last=True)
    (rq,) = pop(core).to("d0")
    core.on_message("d0", grant(2, rq.seq, 0, 16, gen=12), T0)
    (w2,) = pop(core).staged
    core.on_message("d0", StagingWatermark(room_id=2, generation=12, seq=w2.seq, watermark=CAP), T0)
    core.write_done(2, "d0", w2.seq, 1, T0, tag=w2.tag)
    assert [e.state for e in pop(core).ended] == [RoomState.SUCCESS]
    assert_clean(core)


def test_sender_watermark_of_other_generation_is_not_violation():
    """A watermark naming another generation of the room is not this incarnation's: it is counted,
    the room carries on."""
    core = staged_core()
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True)
    pop(core)
    core.on_message("d0", StagingWatermark(room_id=1, generation=99, seq=0, watermark=CAP), T0)
    assert core.room_state(1) is RoomState.TRANSFERRING and core.stats.peer_violations == 0


# --- pre-abort: decode gave up before the room opened here (minor 1) ----------------------------------


@pytest.mark.parametrize("code", [ErrorCode.ABORTED, ErrorCode.WAITING_TIMEOUT])
def test_sender_abort_before_open_fails_room_on_open(code):
    """An ABORT from a registered decode link for a room not open here (and not ended here) is
    remembered; opening the room within the parked timeout fails it at once with the ABORT's code
    (nothing to tell: no request reached it), instead of at its bootstrap deadline."""
    core = make_core()
    core.add_link(make_link())
    core.on_message("d0", Abort(room_id=4, generation=5, code=code, reason="gave up"), T0)
    assert pop(core).sends == [] and core.stats.unknown_room_messages == 0
    assert core.next_deadline() == T0 + 30.0
    core.open_room(4, T0 + 29.5)
    o = pop(core)
    _failed(o, code)
    assert "gave up" in o.ended[0].reason and o.sends == []
    core.on_message("d0", req(4, gen=5), T0 + 29.6)  # its request, if it still comes, is answered
    assert [(m.generation, m.code) for m in pop(core).to("d0")] == [(5, code)]
    assert_clean(core)


def test_sender_abort_before_open_forgotten_after_parked_timeout():
    """The pre-abort is kept ``timeouts.parked``: a room opened later waits for its requests as
    usual and fails BOOTSTRAP_TIMEOUT at its own deadline."""
    core = make_core(timeouts=Timeouts(parked=20.0))
    core.add_link(make_link())
    core.on_message("d0", Abort(room_id=4, generation=5, code=ErrorCode.ABORTED, reason=""), T0)
    core.handle_timer(T0 + 20.0)
    assert core._preaborted == {} and core.next_deadline() is None
    core.open_room(4, T0 + 21)
    assert core.room_state(4) is RoomState.BOOTSTRAPPING and pop(core).ended == []
    core.handle_timer(T0 + 51)
    _failed(pop(core), ErrorCode.BOOTSTRAP_TIMEOUT)
    assert_clean(core)


@pytest.mark.parametrize("source", ["unregistered-link", "ended-room", "bound-full"])
def test_sender_abort_before_open_not_remembered(source):
    """No pre-abort from an unregistered link, for a room that already ended here (the ABORT is
    late), or past max_parked remembered ones: the ABORT is only counted."""
    core = make_core(max_parked=1)
    core.add_link(make_link())
    if source == "ended-room":
        core.open_room(4, T0)
        core.abort(4, T0)
        pop(core)
    if source == "bound-full":
        core.on_message("d0", Abort(room_id=9, generation=1, code=ErrorCode.ABORTED, reason=""), T0)
    key = "zz" if source == "unregistered-link" else "d0"
    core.on_message(key, Abort(room_id=4, generation=5, code=ErrorCode.ABORTED, reason=""), T0)
    assert 4 not in core._preaborted and pop(core).sends == []
    counted = core.stats.late_messages if source == "ended-room" else core.stats.unknown_room_messages
    assert counted == 1
    if source != "ended-room":
        core.open_room(4, T0 + 1)
        assert core.room_state(4) is RoomState.BOOTSTRAPPING


def test_sender_abort_before_open_answers_parked_requests_of_other_ranks():
    """P1->D2: D1's request is parked, D0 aborts (WAITING_FOR_INPUT, it sent none): on open the
    room fails at once with D0's code and D1's replayed request is answered with it."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1), writer=False, aux_owner=False))
    core.on_message("d1", req(2, gen=21), T0)
    core.on_message("d0", Abort(room_id=2, generation=20, code=ErrorCode.WAITING_TIMEOUT, reason="w"), T0)
    assert core._parked_count == 1 and pop(core).sends == []  # D1's request is not D0's to withdraw
    core.open_room(2, T0 + 1)
    o = pop(core)
    _failed(o, ErrorCode.WAITING_TIMEOUT)
    assert [(m.generation, m.code) for m in o.to("d1")] == [(21, ErrorCode.WAITING_TIMEOUT)]
    assert o.to("d0") == []
    assert_clean(core)


def test_sender_close_forgets_pre_aborts():
    """Regression: close() left pre-abort memories (and their deadlines) behind; now nothing is
    left once the endpoint is closed."""
    core = make_core()
    core.add_link(make_link())
    core.on_message("d0", Abort(room_id=4, generation=5, code=ErrorCode.ABORTED, reason=""), T0)
    core.close(T0)
    assert pop(core).sends == []
    assert_clean(core)


# --- tombstones: ranks that had not asked before the room ended (minor 1) -------------------------------


@pytest.mark.parametrize("how", ["abort", "bootstrap-timeout"])
def test_sender_late_request_from_rank_that_had_not_asked_is_answered(how):
    """Two paired decode ranks; the room ends with only d0's request in. d1's later request (a
    generation the room never saw) comes from a rank of the room's instance that had not asked: it
    is answered at once with the room's code and counted late, never parked."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)
    if how == "abort":
        core.abort(1, T0)
        code = ErrorCode.ABORTED
    else:
        core.handle_timer(T0 + 30.0)
        code = ErrorCode.BOOTSTRAP_TIMEOUT
    assert [(m.generation, m.code) for m in pop(core).to("d0")] == [(3, code)]
    core.on_message("d1", req(1, gen=4), T0 + 31)
    assert [(m.generation, m.code) for m in pop(core).to("d1")] == [(4, code)]
    assert core._parked == {} and core.stats.late_messages == 1
    assert_clean(core)


@pytest.mark.parametrize("who", ["rank-that-asked", "other-instance"])
def test_sender_late_request_of_new_generation_still_parked(who):
    """The tombstone rule is narrow: a new generation from a rank that had asked (a new incarnation
    of the room id), or from a rank of another decode instance, is parked as before."""
    core = make_core()
    core.add_link(make_link(0, paired=(0, 1)))
    core.add_link(make_link(1, paired=(0, 1)))
    core.add_link(make_link(1, key="b1", instance="decode-B", paired=(0, 1)))
    core.open_room(1, T0)
    core.on_message("d0", req(1, gen=3), T0)
    core.abort(1, T0)
    pop(core)
    key = "d0" if who == "rank-that-asked" else "b1"
    core.on_message(key, req(1, gen=9), T0 + 1)
    assert pop(core).sends == []
    assert core._parked_count == 1 and core.stats.late_messages == 0


def test_sender_duplicate_pages_vector_is_refused_with_its_abort_vector():
    """The golden TRANSFER_REQUEST that lists a page twice fails the room before anything is
    written, and the answer is byte for byte the golden ABORT (INDEX_OUT_OF_RANGE)."""
    from tests.wire.test_vectors import read_vector

    request = decode(read_vector("transfer_request_duplicate_pages.hex"))
    core = make_core()
    core.add_link(make_link(blocks=64, aux=8, paired=(0,)))
    core.open_room(request.room_id, T0)
    core.submit_chunk(request.room_id, list(range(7)), 100, T0, last=True)
    core.on_message("d0", request, T0)
    o = pop(core)
    assert o.posts == []
    _failed(o, ErrorCode.INDEX_OUT_OF_RANGE)
    (sent,) = [s.message for s in o.sends]
    assert encode(sent, minor=1) == read_vector("abort_duplicate_pages.hex")
    assert_clean(core)


# --- direct or staged, per room, by cost ------------------------------------------------------------


@pytest.mark.parametrize("dst, stages", [((0, 1, 2, 3), False), ((9, 2, 30, 17), True)],
                         ids=["contiguous-direct", "fragmented-staged"])
def test_sender_cost_chooses_direct_or_staged_per_room(dst, stages):
    """A link whose pages match and that can stage prices each room: four pages consecutive on
    both sides are one run (direct is cheaper); four scattered runs of 8 regions cost more than
    staging (staged). Later chunks of the room keep its path."""
    from kvproto.core import PathCost

    cost = PathCost(per_descriptor_s=1e-5, copy_bytes_per_s=1e9, staged_fixed_s=1e-4)
    link = replace(make_link(unit=100, capacity=1 << 20, max_units=1 << 10), cost=cost, regions=8)
    core = make_core()
    core.add_link(link)
    core.open_room(1, T0)
    core.on_message("d0", req(1, 64, pages=dst), T0)
    core.submit_chunk(1, [4, 5], 32, T0, last=False)
    o = pop(core)
    if stages:
        assert o.writes == [] and [type(m).__name__ for m in o.to("d0")] == ["StagingRequest"]
    else:
        assert len(o.writes) == 1 and o.sends == []
    core.submit_chunk(1, [6, 7], 64, T0, last=True)
    o = pop(core)
    assert (o.writes == []) is stages, "the room switched paths between chunks"


def test_sender_page_runs_counts_runs_consecutive_on_both_sides():
    """page_runs merges only pages consecutive on both sides."""
    from kvproto.core.cost import page_runs

    assert page_runs([1, 2, 3, 4], [7, 8, 9, 10], 0, 4) == 1
    assert page_runs([1, 2, 3, 4], [7, 8, 20, 21], 0, 4) == 2
    assert page_runs([1, 5, 6, 9], [1, 2, 3, 4], 0, 4) == 3
    assert page_runs([1, 2, 3, 4], [1, 2, 3, 4], 2, 2) == 0


# --- layer-wise chunks -------------------------------------------------------------------------------

LAYERS = 4


def layered_core(room: int = 1, n: int = 40, *, link: SenderLink | None = None, **kw) -> SenderCore:
    core = make_core(num_layers=LAYERS)
    link = link or make_link()
    core.add_link(link)
    core.open_room(room, T0)
    core.on_message(link.key, req(room, n, **kw), T0)
    return core


def test_sender_layer_chunks_write_each_layer_as_it_is_ready():
    """Two token ranges streamed layer by layer: one write per (range, layer span) with its layers
    and readiness handle, seqs in order; the aux slot goes with the last range's last layer;
    TRANSFER_DONE (all writes) only after the last layer's write is DONE."""
    core = layered_core(1, 40, aux=1)
    core.submit_chunk(1, [1, 2], 32, T0, last=False, layers=(0, 1), ready="e0")
    core.submit_chunk(1, [], 32, T0, last=False, layers=(1, 4), ready="e1")
    core.submit_chunk(1, [3], 40, T0, last=True, layers=(0, 2), ready="e2")
    core.submit_chunk(1, [], 40, T0, last=True, layers=(2, 4), ready="e3", aux_slot=0)
    o = pop(core)
    got = [(w.seq, w.start_token, w.end_token, w.layers, w.ready) for w in o.writes]
    assert got == [(0, 0, 32, (0, 1), ("e0",)), (1, 0, 32, (1, 4), ("e1",)), (2, 32, 40, (0, 2), ("e2",)),
                   (3, 32, 40, (2, 4), ("e3",))]
    assert [a.seq for a in o.aux] == [4]
    finish_writes(core, o.writes[:3] + o.aux)
    assert core.room_state(1) is RoomState.TRANSFERRING
    finish_writes(core, o.writes[3:])
    o = pop(core)
    assert o.to("d0")[0].writes == 5 and [e.state for e in o.ended] == [RoomState.SUCCESS]
    assert_clean(core)


@pytest.mark.parametrize("case, calls, match", [
    ("not from layer 0", [([1, 2], 32, False, (1, 4))], "must start at layer 0"),
    ("out of order", [([1, 2], 32, False, (0, 1)), ([], 32, False, (2, 4))], "out of order"),
    ("twice", [([1, 2], 32, False, (0, 2)), ([], 32, False, (1, 2))], "out of order"),
    ("new pages mid-range", [([1, 2], 32, False, (0, 1)), ([3], 40, True, (1, 4))], "repeat that end token"),
    ("whole chunk mid-range", [([1, 2], 32, False, (0, 1)), ([3], 40, True, None)], "still due"),
    ("past the last layer", [([1, 2], 32, False, (0, 5))], "outside"),
    ("aux before the last layer", [([1, 2, 3], 40, True, (0, 1), 0)], "last layer"),
])
def test_sender_layer_chunk_misuse_is_a_local_error_and_changes_nothing(case, calls, match):
    """Layers out of order, twice, not from 0, past the cache, new pages or a whole chunk while a
    range streams, or the aux slot before the last layer: LocalProtocolError, no write posted."""
    core = layered_core(1, 40, aux=1)
    *ok, bad = calls
    for pages, end, last, layers in ok:
        core.submit_chunk(1, pages, end, T0, last=last, layers=layers)
    before = len(pop(core).writes)
    room = core.rooms[1]
    state = (len(room.chunks), list(room.src_pages), room.layer_next)
    pages, end, last, layers, *aux = bad
    with pytest.raises(LocalProtocolError, match=match):
        core.submit_chunk(1, pages, end, T0, last=last, layers=layers, aux_slot=aux[0] if aux else None)
    assert pop(core).posts == [] and before == len(ok)
    assert (len(room.chunks), list(room.src_pages), room.layer_next) == state


def test_sender_layer_chunks_last_range_incomplete_sends_no_transfer_done():
    """The last token range with layers missing is not the room's end: no TRANSFER_DONE until the
    last layer comes, however many writes are DONE."""
    core = layered_core(1, 16)
    core.submit_chunk(1, [1], 16, T0, last=True, layers=(0, 3))
    finish_writes(core, pop(core).writes)
    assert pop(core).sends == [] and core.room_state(1) is RoomState.TRANSFERRING
    core.submit_chunk(1, [], 16, T0, last=True, layers=(3, 4))
    finish_writes(core, pop(core).writes)
    assert pop(core).to("d0") == [TransferDone(room_id=1, generation=11, writes=2, nbytes=200)]


def test_sender_layer_chunks_on_a_staged_link_stage_each_range_after_its_last_layer():
    """Staged pieces carry every layer: a staged link asks for a range's staging only once its last
    layer is given, and the piece waits for the readiness handles of every chunk it reads."""
    core = make_core(num_layers=LAYERS)
    link = make_link(unit=UNIT, capacity=CAP)
    core.add_link(link)
    core.open_room(1, T0)
    core.on_message(link.key, req(1, 40), T0)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, layers=(0, 2), ready="a")
    assert pop(core).sends == []
    core.submit_chunk(1, [], 40, T0, last=True, layers=(2, 4), ready="b")
    assert pop(core).to("d0") == [StagingRequest(room_id=1, generation=11, seq=0, start_token=0, end_token=40)]
    core.on_message("d0", grant(1, 0, 0, 40), T0)
    (w,) = pop(core).staged
    assert w.ready == ("a", "b")


def test_sender_layer_chunks_need_the_layer_count():
    """A core made without ``num_layers`` refuses layer-wise chunks."""
    core, _ = ready_core(1, 16)
    with pytest.raises(LocalProtocolError, match="layer count"):
        core.submit_chunk(1, [1], 16, T0, last=True, layers=(0, 1))


# --- the state block (staging.md, minor 3) -----------------------------------------------------------
TAIL = 96


def state_block_core(n: int = 40, tail: int = TAIL, **kw) -> tuple[SenderCore, SenderLink]:
    """A core whose cache has one state group beyond the first, on a staged link whose pieces end
    with a state block of ``tail`` bytes; room 1 open with its request (decode slot 5)."""
    from kvproto.core import GroupSpec, LinkGroup
    from kvproto.wire import GroupDestination

    core = make_core(groups=[GroupSpec("gdn", state=True, pool=8)])
    link = replace(make_link(unit=UNIT, capacity=CAP, **kw), groups=(LinkGroup(True, 8),), stage_tail=tail)
    core.add_link(link)
    core.open_room(1, T0)
    core.on_message(link.key, replace(req(1, n), groups=(GroupDestination(first_page=0, pages=(), slot=5),)), T0)
    return core, link


def test_sender_state_block_rides_in_the_piece_that_ends_the_request():
    """On a link with a state block, the state slot gets no write of its own: the grant of the piece
    that carries the last token counts the block's bytes (an offset that leaves room for the units
    but not the block is refused) and its PostStaged names the slots to gather; earlier pieces carry
    none; TRANSFER_DONE counts the pieces only."""
    core, _link = state_block_core(40, max_units=16)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, state_slots=[2])
    o = pop(core)
    assert o.staged == [] and o.posts == []
    core.on_message("d0", grant(1, 0, 0, 16), T0)
    (w0,) = pop(core).staged
    assert w0.states == ()
    core.on_message("d0", grant(1, 1, 16, 32), T0)
    (w1,) = pop(core).staged
    core.on_message("d0", grant(1, 2, 32, 40, offset=CAP - 8 * UNIT - TAIL), T0)  # exactly fits, block and all
    (w2,) = pop(core).staged
    assert [(p.group, p.src_slot, p.dst_slot) for p in w2.states] == [(1, 2, 5)]
    for w in (w0, w1, w2):
        core.write_done(1, "d0", w.seq, 10, T0, tag=w.tag)
    o = pop(core)
    assert o.to("d0") == [TransferDone(room_id=1, generation=11, writes=3, nbytes=30)]
    assert [e.state for e in o.ended] == [RoomState.SUCCESS]

    core, _link = state_block_core(40)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, state_slots=[2])
    pop(core)
    core.on_message("d0", grant(1, 0, 0, 40, offset=CAP - 40 * UNIT - TAIL + 1), T0)  # the block would overrun
    o = pop(core)
    assert o.staged == [] and [e.code for e in o.ended] == [ErrorCode.INDEX_OUT_OF_RANGE]


def test_sender_state_block_last_token_waits_for_the_slots_of_an_empty_last_chunk():
    """A non-last chunk may end exactly at the request's last token, the slots coming with an empty
    last chunk after it: the piece that ends the request (and carries the block) is asked for only
    once they are known, so every token but the last is requested first."""
    core, _link = state_block_core(32)
    core.submit_chunk(1, [1, 2], 32, T0, last=False)
    o = pop(core)
    assert o.to("d0") == [StagingRequest(room_id=1, generation=11, seq=0, start_token=0, end_token=31)]
    core.on_message("d0", grant(1, 0, 0, 31), T0)
    (w0,) = pop(core).staged
    assert w0.states == ()
    core.submit_chunk(1, [], 32, T0, last=True, state_slots=[7])
    o = pop(core)
    assert o.to("d0") == [StagingRequest(room_id=1, generation=11, seq=1, start_token=31, end_token=32)]
    assert o.posts == []  # no write of the state's own
    core.on_message("d0", grant(1, 1, 31, 32, offset=2048), T0)
    (w1,) = pop(core).staged
    assert [(p.src_slot, p.dst_slot) for p in w1.states] == [(7, 5)]


def test_sender_without_a_state_block_the_slot_has_a_write_of_its_own():
    """On a staged link without a state block (a peer of minor 2), the slot moves in a write of its
    own with the last chunk and the pieces carry none."""
    from kvproto.core import PostGroups

    core, _link = state_block_core(40, tail=0)
    core.submit_chunk(1, [1, 2, 3], 40, T0, last=True, state_slots=[2])
    outs = core.pop_outputs()
    (groups,) = [x for x in outs if isinstance(x, PostGroups)]
    assert [(p.group, p.src_slot, p.dst_slot) for p in groups.parts] == [(1, 2, 5)]
    core.on_message("d0", grant(1, 0, 0, 40), T0)
    (w,) = pop(core).staged
    assert w.states == ()


@pytest.mark.parametrize("same", [True, False], ids=["same-pages", "own-pages"])
def test_sender_group_on_the_first_groups_pages_names_the_same_lists(same: bool):
    """A paged group whose pages (source and destination) equal the first group's: its part names
    the first part's very lists, so a transport can list them once; a group with pages of its own
    keeps them. Either way each part's pages are the group's."""
    from kvproto.core import GroupSpec, LinkGroup, PostGroups
    from kvproto.wire import GroupDestination

    core = make_core(groups=[GroupSpec("idx", state=False, pool=64, block_size=BLOCK)])
    link = replace(make_link(), groups=(LinkGroup(True, 32, BLOCK),))
    core.add_link(link)
    core.open_room(1, T0)
    src, dst = [9, 4, 7], (3, 1, 2)
    src_g, dst_g = (src, dst) if same else ([5, 6, 8], (0, 4, 5))
    core.on_message(link.key, replace(req(1, 40, pages=dst), groups=(
        GroupDestination(first_page=0, pages=tuple(list(dst_g)), slot=NO_SLOT),)), T0)  # equal, not the same
    core.submit_chunk(1, list(src), 40, T0, last=True, group_pages=[list(src_g)])
    (write,) = [x for x in core.pop_outputs() if isinstance(x, PostGroups)]
    first, group = write.parts
    assert (first.src_pages, first.dst_pages) == (tuple(src), dst)
    assert (group.src_pages, group.dst_pages) == (tuple(src_g), tuple(dst_g))
    assert (group.src_pages is first.src_pages and group.dst_pages is first.dst_pages) == same


def test_sender_group_holds_the_first_groups_list_until_a_chunk_names_pages_of_its_own():
    """Chunks that give a group the first group's very list leave the room holding one list for
    both (no copy); a chunk that names other pages for the group gives it a list of its own from
    then on, the first group's pages untouched. Every write names each group's pages from token 0."""
    from kvproto.core import GroupSpec, LinkGroup, PostGroups
    from kvproto.wire import GroupDestination

    core = make_core(groups=[GroupSpec("idx", state=False, pool=64, block_size=BLOCK)])
    link = replace(make_link(), groups=(LinkGroup(True, 32, BLOCK),))
    core.add_link(link)
    core.open_room(1, T0)
    dst = (3, 1, 2, 6)
    core.on_message(link.key, replace(req(1, 64, pages=dst), groups=(
        GroupDestination(first_page=0, pages=dst, slot=NO_SLOT),)), T0)
    room = core.rooms[1]
    written = []
    for pages, group, end in (([9], None, 16), ([4], None, 32), ([7], [5], 48), ([8], None, 64)):
        pages = list(pages)
        core.submit_chunk(1, pages, end, T0, last=end == 64, group_pages=[pages if group is None else group])
        (write,) = [x for x in core.pop_outputs() if isinstance(x, PostGroups)]
        written.append([(p.group, p.start_token, p.end_token, tuple(p.src_pages)) for p in write.parts])
        if end <= 32:
            assert room.group_pages[0] is room.src_pages  # one list while the group names the first's
    assert room.src_pages == [9, 4, 7, 8] and room.group_pages[0] == [9, 4, 5, 8]
    assert room.group_pages[0] is not room.src_pages
    assert written == [[(0, 0, 16, (9,)), (1, 0, 16, (9,))],
                       [(0, 16, 32, (9, 4)), (1, 16, 32, (9, 4))],
                       [(0, 32, 48, (9, 4, 7)), (1, 32, 48, (9, 4, 5))],
                       [(0, 48, 64, (9, 4, 7, 8)), (1, 48, 64, (9, 4, 5, 8))]]


def _two_rank_core(blocks1: int = 32, pool1: int = 32):
    """A hybrid core (an indexer-like paged group, a state group) with decode ranks 0 and 1 of one
    engine; rank 1's link registered ``blocks1`` pages and a paged group pool of ``pool1``."""
    from kvproto.core import GroupSpec, LinkGroup

    core = make_core(groups=[GroupSpec("idx", state=False, pool=64, block_size=BLOCK),
                             GroupSpec("ssm", state=True, pool=8)])
    links = [replace(make_link(d, paired=(0, 1), blocks=(32, blocks1)[d], aux_owner=d == 0),
                     groups=(LinkGroup(True, (32, pool1)[d], BLOCK), LinkGroup(True, 8)))
             for d in (0, 1)]
    for link in links:
        core.add_link(link)
    core.open_room(1, T0)
    return core, links


def _hybrid_request(pages: tuple[int, ...], n: int = 40) -> TransferRequest:
    from kvproto.wire import GroupDestination

    return replace(req(1, n, pages=pages), groups=(GroupDestination(first_page=0, pages=pages, slot=NO_SLOT),
                                                   GroupDestination(first_page=0, pages=(), slot=5)))


def test_sender_tp_ranks_naming_the_same_lists_are_checked_and_described_once(monkeypatch):
    """Decode ranks of one engine send equal requests, which the codec decodes to the very same
    lists: the second is taken on the first's checks (the group check runs once) and its write
    carries the first's very parts; both writes move the same groups, pages and slots."""
    import kvproto.core.sender_requests as sender_module  # where requests are checked
    from kvproto.core import PostGroups

    calls = []
    check = sender_module.check_destinations
    monkeypatch.setattr(sender_module, "check_destinations", lambda *a, **k: calls.append(a) or check(*a, **k))
    core, links = _two_rank_core()
    first = _hybrid_request((3, 1, 2))
    core.on_message("d0", first, T0)
    core.on_message("d1", replace(first, generation=12), T0)  # what the codec gives: a copy, the same lists
    assert len(calls) == 1
    core.submit_chunk(1, [9, 4, 7], 40, T0, last=True, group_pages=[[9, 4, 7], []], state_slots=[0, 2])
    w0, w1 = [x for x in core.pop_outputs() if isinstance(x, PostGroups)]
    assert (w0.link, w1.link) == ("d0", "d1") and w1.parts is w0.parts
    assert [(p.group, getattr(p, "dst_pages", None), getattr(p, "dst_slot", None)) for p in w0.parts] == [
        (0, (3, 1, 2), None), (1, (3, 1, 2), None), (2, None, 5)]
    finish_writes(core, [w0, w1])
    assert core.room_state(1) is RoomState.SUCCESS


@pytest.mark.parametrize("smaller", ["pages", "group-pool"])
def test_sender_the_same_lists_are_checked_again_against_a_smaller_link(smaller: str):
    """The very lists that rank 0's request passed are still refused for a rank whose link holds
    fewer pages (or a smaller pool of the group) than one of them needs: nothing is written."""
    core, _links = _two_rank_core(**({"blocks1": 8} if smaller == "pages" else {"pool1": 8}))
    first = _hybrid_request((3, 1, 20))
    core.on_message("d0", first, T0)
    core.on_message("d1", replace(first, generation=12), T0)
    o = pop(core)
    assert o.posts == [] and len(o.ended) == 1 and o.ended[0].code is ErrorCode.INDEX_OUT_OF_RANGE
    assert "20" in o.ended[0].reason


def test_sender_equal_lists_of_other_objects_take_every_check_and_parts_of_their_own(monkeypatch):
    """Requests that are equal but name lists of their own (not through the codec's kept bodies)
    are checked one by one and described one by one: the same bytes, nothing shared."""
    import kvproto.core.sender_requests as sender_module  # where requests are checked
    from kvproto.core import PostGroups

    calls = []
    check = sender_module.check_destinations
    monkeypatch.setattr(sender_module, "check_destinations", lambda *a, **k: calls.append(a) or check(*a, **k))
    core, _links = _two_rank_core()
    core.on_message("d0", _hybrid_request((3, 1, 2)), T0)
    core.on_message("d1", _hybrid_request(tuple([3, 1, 2])), T0)
    assert len(calls) == 2
    core.submit_chunk(1, [9, 4, 7], 40, T0, last=True, group_pages=[[9, 4, 7], []], state_slots=[0, 2])
    w0, w1 = [x for x in core.pop_outputs() if isinstance(x, PostGroups)]
    assert w1.parts is not w0.parts and w1.parts == w0.parts
