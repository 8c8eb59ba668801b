"""The prefill rank's sans-IO core: rooms that push KV to decode ranks.

Theory of operation
-------------------
Links are registered decode ranks (``SenderLink``); the I/O layer adds them after a REGISTER
is accepted, having computed from the two geometries which decode ranks pair with this
prefill rank and whether this rank writes to the link (``writer``) and its aux slot
(``aux_owner``).

A room waits in BOOTSTRAPPING until every decode rank of one decode instance that pairs with
this prefill rank has sent its TRANSFER_REQUEST. A request for a room the application has not
opened yet is *parked* (bounded, with a deadline) and replayed when the room opens. Every
index in a request is checked against what the link registered before it is recorded
(house rule 7): a bad one fails the room with ``INDEX_OUT_OF_RANGE`` and writes nothing.

The application supplies chunks: new prefill pages and the end token reached; a non-last
chunk ends on a page boundary. Each chunk becomes, per writer link, at most one write of the
tokens ``[max(chunk start, prefix), min(chunk end, num_tokens))``; the aux slot goes as one
more write with the last chunk. Writes of a link are numbered ``seq = 0, 1, ...``; that
number travels in the write's tag. When the last chunk's writes are all DONE, every writer
link gets TRANSFER_DONE with its write count and the room succeeds. A DONE or failure report
counts only for a write still in flight in this room (matched by ``seq`` and, when the I/O layer
passes it, the write's tag): a late report of an earlier room with the same id is stale.

Groups beyond the first (hybrid caches: ``kvproto.core.groups``): each chunk gives its new pages
of every paged group too, and the first chunk with ``last`` gives the request's slot of every
state group; a writer link gets, per chunk, one more write per paged group it writes (tokens
clipped to the group's window) and, with the last token range, one write per state group. They
share the link's ``seq`` numbering, so TRANSFER_DONE counts them and the decode needs nothing new.
On a staged link whose pieces end with a state block (``SenderLink.stage_tail``, minor 3) the
state slots ride in the piece that carries the request's last token instead, so that piece is
asked for only once the last chunk has given them.

*Once per room, not once per rank.* The TP ranks of one decode engine name the same pages and
slots, so each sends the same request body; the codec decodes an equal body to the very lists it
gave the first (``kvproto.wire.codec``, repeated bodies). A request whose lists are those of a
request of the room already checked, against a link holding at least as much, passes the page
and group checks on that identity (``_checked_by``), and a writer link whose request and groups
are alike another's gets that link's parts of a chunk's write (``_alike``): at prefill TP 1,
decode TP 2 every room is checked and described once instead of twice. Anything else takes
every check.

Room holds and refused links (protocol 1.4: the BOOTSTRAPPING deadline as a lease that decode
ranks renew, holds remembered for rooms not opened yet, ABORTs from links whose registration this
rank refused) live in ``kvproto.core.holds``.

Where each part lives: this module is the core (links, the application's calls, messages, write
completions and their drains, the table's effects); ``kvproto.core.sender_requests`` checks,
parks and records the decode ranks' requests; ``kvproto.core.sender_writes`` turns chunks into
writes and runs the staged links' requests, grants and watermarks; ``kvproto.core.sender_room``
holds the records (``SenderLink``, ``SenderRoom``). The three parts are mixins of ``SenderCore``.

Invariants: the sides' token counts must agree exactly (never shifted): a chunk past the
request's ``num_tokens`` or a last chunk short of it fails with TOKEN_COUNT_MISMATCH. A
failure is reported once, sends ABORT to every other link of the room, and frees the room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvproto.core.base import CoreBase, Tombstone, duplicate_page, page_outside
from kvproto.core.events import LinkKey
from kvproto.core.groups import check_chunk_pages
from kvproto.core.holds import SenderHolds
from kvproto.core.sender_requests import SenderRequests
from kvproto.core.sender_room import MAX_PARKED, SenderLink, SenderRoom, _Chunk, _Drain, _Peer, _pages_for
from kvproto.core.sender_writes import SenderWrites
from kvproto.core.state import Effect, Input, Role, RoomState
from kvproto.wire import (
    NO_SLOT,
    Abort,
    ErrorCode,
    LocalProtocolError,
    Message,
    RoomHold,
    StagingGrant,
    StagingWatermark,
    TransferDone,
    TransferRequest,
    decode_tag,
)


class SenderCore(SenderHolds, SenderRequests, SenderWrites, CoreBase):
    ROLE = Role.SENDER

    def __init__(self, *, max_parked: int = MAX_PARKED, num_layers: int = 0, layers: Sequence[int] | None = None,
                 **cache: Any) -> None:
        """``cache``: what every core knows of its cache (``CoreBase``: ``block_size``,
        ``num_blocks``, ``aux_slots``, ``timeouts``, ``groups``); ``num_layers``: the model's
        layers, for layer-wise chunks (0: only whole chunks); ``layers``: the model layer of each of
        the first group's layers (default: the first ``num_layers``)."""
        super().__init__(**cache)
        self.num_layers = num_layers
        self._states = tuple(g for g, spec in enumerate(self.groups) if spec.state)
        """The state groups (by index into ``groups``): what a room's last chunk gives a slot of."""
        self._group_rows = tuple((g, spec.state, spec.window, spec.layers) for g, spec in enumerate(self.groups))
        """Per group beyond the first: what ``_group_parts`` reads of it for every write."""
        self.layers = tuple(range(num_layers) if layers is None else layers)
        self.max_parked = max_parked
        self.links: dict[LinkKey, SenderLink] = {}
        self._parked: dict[int, list[tuple[LinkKey, TransferRequest]]] = {}
        self._parked_count = 0
        self._draining: dict[tuple[int, LinkKey], _Drain] = {}
        self._preaborted: dict[int, tuple[ErrorCode | int, str]] = {}
        """Rooms a decode rank aborted before they were opened here (kept ``timeouts.parked``)."""

    # --- links ----------------------------------------------------------------------------
    def add_link(self, link: SenderLink) -> None:
        self.links[link.key] = link
        self._registered(link.key)

    def remove_link(self, key: LinkKey, now: float, code: ErrorCode = ErrorCode.PEER_GONE, reason: str = "") -> None:
        """The link is gone (closed, dead, restarted): fail every room that needs it."""
        link = self.links.pop(key, None)
        if link is None:
            return
        self._forget_link_holds(key)
        reason = reason or f"decode rank {link.decode_rank} of {link.instance!r} is gone"
        for drain_key in [k for k in self._draining if k[1] == key]:
            del self._draining[drain_key]  # nothing more can land through a dead link
        for room in list(self.rooms.values()):
            if any(p.link.key == key for p in room.peers.values()) or (
                room.instance == link.instance and link.decode_rank in room.expected
            ):
                self.apply(room, Input.PEER_GONE, now, code=code, reason=reason, origin=key)
        for room_id, parked in list(self._parked.items()):
            kept = [(k, m) for k, m in parked if k != key]
            self._parked_count -= len(parked) - len(kept)
            if kept:
                self._parked[room_id] = kept
            else:
                del self._parked[room_id]
                self.timers.cancel(("parked", room_id))

    def close(self, now: float) -> None:
        """Fail every live room and refuse every parked request with ENDPOINT_CLOSED. Idempotent."""
        if self.closed:
            return
        super().close(now)
        for room_id, parked in self._parked.items():
            self.timers.cancel(("parked", room_id))
            for key, msg in parked:
                self.send(key, self._abort_message(room_id, msg.generation, ErrorCode.ENDPOINT_CLOSED,
                                                   "endpoint closed"))
        self._parked.clear()
        self._parked_count = 0
        for room_id in self._preaborted:
            self.timers.cancel(("preaborted", room_id))
        self._preaborted.clear()  # no room can be opened any more
        self._forget_holds()

    def abandon_drains(self) -> None:
        """Send the ABORTs still waiting for writes to finish (the endpoint is going away)."""
        for (room_id, key), drain in self._draining.items():
            self.send(key, self._abort_message(room_id, drain.generation, drain.code, drain.reason))
        self._draining.clear()

    # --- application API --------------------------------------------------------------------
    def open_room(self, room_id: int, now: float) -> SenderRoom:
        ended = self._tombstones.get(room_id)
        self._new_room_check(room_id)
        room = SenderRoom(room_id=room_id, created=now, stale_generations=frozenset() if ended is None else
                          ended.generations | ended.answered, group_pages=[[] for _ in self.groups])
        self._add_room(room)
        self.timers.schedule(room_id, self._deadline(RoomState.BOOTSTRAPPING, now))
        self._open_held(room, now)
        preaborted = self._preaborted.pop(room_id, None)
        if preaborted is not None:
            self.timers.cancel(("preaborted", room_id))
            self.apply(room, Input.PEER_ABORT, now, code=preaborted[0],
                       reason=f"decode aborted before the room opened here: {preaborted[1]}")
        parked = self._parked.pop(room_id, None)
        if parked:
            self._parked_count -= len(parked)
            self.timers.cancel(("parked", room_id))
            for key, msg in parked:
                # Once a replayed request has ended the room, the rest find its tombstone and are
                # refused (UNKNOWN_ROOM) instead of being dropped unanswered.
                self._on_request(key, msg, now)
        return room

    def submit_chunk(
        self,
        room_id: int,
        pages: Sequence[int],
        end_token: int,
        now: float,
        *,
        last: bool,
        aux_slot: int | None = None,
        layers: tuple[int, int] | None = None,
        ready: object | None = None,
        group_pages: Sequence[Sequence[int]] = (),
        state_slots: Sequence[int] | None = None,
        first_token: int = 0,
    ) -> None:
        """The KV of tokens up to ``end_token`` is ready in ``pages`` (this chunk's new pages).

        ``first_token`` (the room's first chunk only, whole blocks): the chunk's pages start at that
        token; the tokens before it are the decode's prefix (``decode_prefix``), never sent, and
        this rank names no page for them. Engines that send only what the decode lacks (SGLang's)
        give the decode's prefix here.

        ``group_pages``: the chunk's new pages of each group beyond the first (a state group's
        entry empty); ``state_slots``: this rank's slot of each such group (a paged group's entry
        ignored), given once, with the first chunk whose ``last`` is set.

        Layer-wise (``layers=(first, end)``): only those layers of the tokens are ready (once
        ``ready``, an opaque handle the I/O layer waits for, has completed). A token range's
        layers come in order from layer 0, each exactly once, its first chunk giving its pages
        and later ones repeating ``end_token`` and ``last`` with no pages; the next token range
        starts after the last layer (see "Layer-wise chunks" above)."""
        room: SenderRoom | None = self.rooms.get(room_id)
        if room is None:
            if room_id in self._tombstones:
                self.stats.late_messages += 1
                return  # the room already ended; its owner learns that from poll()/wait()
            raise LocalProtocolError(f"room {room_id} was never opened", ErrorCode.UNKNOWN_ROOM)
        if room.last_given:
            raise LocalProtocolError(f"room {room_id} already received its last chunk")
        span = self._layer_span(room, layers)
        slots = self._state_slots(room, last, state_slots)
        if room.layer_next:  # a token range is being streamed: this chunk continues it
            if any(group_pages):
                raise LocalProtocolError(f"room {room_id} streams layers: its next layers come with no new pages")
            self._continue_layers(room, pages, end_token, last, aux_slot, span, ready, now)
            return
        start = room.end_token
        skip = 0
        if first_token:
            if room.chunks or first_token < 0 or first_token % self.block_size:
                raise LocalProtocolError(f"first_token {first_token} needs the room's first chunk and whole blocks of "
                                         f"{self.block_size}")
            if any(not g.state and not g.named for g in self.groups):
                raise LocalProtocolError("first_token: a cache with paged groups beyond the first names every page "
                                         "(but those whose window the engine names)")
            start, skip = first_token, first_token // self.block_size
        if end_token < start or (end_token == start and not last):
            raise LocalProtocolError(f"chunk end token {end_token} does not advance past {start}")
        if not last and end_token % self.block_size:
            raise LocalProtocolError(
                f"a non-last chunk must end on a page boundary (block size {self.block_size}), got {end_token}"
            )
        total = len(room.src_pages) + skip + len(pages)
        if total != _pages_for(end_token, self.block_size):
            raise LocalProtocolError(
                f"{end_token} tokens need {_pages_for(end_token, self.block_size)} pages, the room has {total}"
            )
        bad = page_outside(pages, self.num_blocks)
        if bad is not None:
            raise LocalProtocolError(f"page {bad} outside [0, {self.num_blocks})", ErrorCode.INDEX_OUT_OF_RANGE)
        named = room.src_pages[room.first_page:] if room.first_page else room.src_pages
        twice = duplicate_page([*named, *pages] if named else pages)
        if twice is not None:
            raise LocalProtocolError(f"page {twice} is listed twice in room {room_id}: two token ranges would share it",
                                     ErrorCode.INDEX_OUT_OF_RANGE)
        if aux_slot is not None and (not last or not 0 <= aux_slot < self.aux_slots):
            raise LocalProtocolError(f"aux slot {aux_slot} needs the last chunk and a slot in [0, {self.aux_slots})")
        if self.groups:
            problem = check_chunk_pages(self.groups, room.group_pages, group_pages, end_token, last,
                                        checked=(room.src_pages, pages, self.num_blocks))
            if problem is not None:
                raise LocalProtocolError(problem[1], problem[0])
        elif any(group_pages):
            raise LocalProtocolError("the cache has no group beyond the first: no group pages")
        if span is not None and span[0] != 0:
            raise LocalProtocolError(f"tokens [{start}, {end_token}) of room {room_id} must start at layer 0, "
                                     f"got layers [{span[0]}, {span[1]})")
        completes = span is None or span[1] == self.num_layers
        if aux_slot is not None and not completes:
            raise LocalProtocolError("the aux slot goes with the chunk that gives the last layer")
        src = room.src_pages
        if skip:  # placeholders for the prefix's pages: no write reaches them (every peer's prefix covers them)
            room.first_page = skip
            src.extend([0] * skip)
        before = len(src)
        src.extend(pages)
        for g, new in enumerate(group_pages):
            held = room.group_pages[g]
            if self.groups[g].named:  # its last pages, given once (with the last chunk)
                held.extend(new)
                continue
            if new is pages and (held is src or not held and not before):
                room.group_pages[g] = src  # the first group's very list, from token 0: held once (``group_pages``)
            elif held is src:  # it parts ways with the first group's pages: a list of its own from here on
                room.group_pages[g] = [*src[:before], *new]
            else:
                held.extend(new)
        room.state_slots = slots
        room.chunks.append(_Chunk(start, end_token, last, aux_slot, span, ready, completes))
        room.layer_next = 0 if completes else span[1]  # type: ignore[index]
        mismatch = self._token_mismatch(room)
        if mismatch:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.TOKEN_COUNT_MISMATCH, reason=mismatch)
            return
        self.apply(room, Input.CHUNK, now)

    def _state_slots(self, room: SenderRoom, last: bool, slots: Sequence[int] | None) -> tuple[int, ...] | None:
        """The room's state slots once this chunk is taken (checked; nothing is changed here)."""
        if slots is not None:
            if not self._states:
                raise LocalProtocolError("the cache has no state group: no state slots")
            if room.state_slots is not None or not last:
                raise LocalProtocolError(f"room {room.room_id}: state slots are given once, with the first chunk "
                                         f"whose last flag is set")
            if len(slots) != len(self.groups):
                raise LocalProtocolError(f"{len(slots)} state slots for {len(self.groups)} groups beyond the first")
            taken = [NO_SLOT] * len(slots)  # each state group's slot, checked; NO_SLOT for a paged group
            for g in self._states:
                slot, spec = slots[g], self.groups[g]
                if not 0 <= slot < spec.pool:
                    raise LocalProtocolError(f"slot {slot} of group {spec.name!r} outside [0, {spec.pool})",
                                             ErrorCode.INDEX_OUT_OF_RANGE)
                taken[g] = slot
            return tuple(taken)
        if last and self._states and room.state_slots is None:
            raise LocalProtocolError(f"room {room.room_id}: the first chunk whose last flag is set gives the slot of "
                                     f"every state group ({', '.join(repr(self.groups[g].name) for g in self._states)})")
        return room.state_slots

    def _layer_span(self, room: SenderRoom, layers: tuple[int, int] | None) -> tuple[int, int] | None:
        """``layers`` checked against the cache; None for a whole chunk (every layer)."""
        if layers is None:
            if room.layer_next:
                raise LocalProtocolError(f"room {room.room_id} streams layers: layers [{room.layer_next}, "
                                         f"{self.num_layers}) of its tokens are still due")
            return None
        first, end = layers
        if not self.num_layers:
            raise LocalProtocolError("layer-wise chunks need the cache's layer count")
        if not 0 <= first < end <= self.num_layers:
            raise LocalProtocolError(f"layers [{first}, {end}) outside [0, {self.num_layers})")
        return (first, end)

    def _continue_layers(self, room: SenderRoom, pages: Sequence[int], end_token: int, last: bool,
                         aux_slot: int | None, span: tuple[int, int], ready: object | None, now: float) -> None:
        """The next layers of the token range being streamed (``submit_chunk``)."""
        open_chunk = room.chunks[-1]
        if pages or end_token != open_chunk.end or last != open_chunk.last:
            raise LocalProtocolError(
                f"room {room.room_id} streams tokens [{open_chunk.start}, {open_chunk.end}) (last={open_chunk.last}): "
                f"their next layers repeat that end token and last flag, with no new pages")
        if span[0] != room.layer_next:
            raise LocalProtocolError(f"layers [{span[0]}, {span[1]}) of room {room.room_id} out of order: "
                                     f"layer {room.layer_next} is next")
        completes = span[1] == self.num_layers
        if aux_slot is not None and not (completes and last and 0 <= aux_slot < self.aux_slots):
            raise LocalProtocolError(f"aux slot {aux_slot} needs the last chunk's last layer and a slot in "
                                     f"[0, {self.aux_slots})")
        room.chunks.append(_Chunk(open_chunk.start, open_chunk.end, last, aux_slot, span, ready, completes))
        room.layer_next = 0 if completes else span[1]
        self.apply(room, Input.CHUNK, now)

    # --- control plane ---------------------------------------------------------------------
    def on_message(self, key: LinkKey, msg: Message, now: float) -> None:
        """A decoded room message from a link (link-level messages are the I/O layer's)."""
        if self._from_refused(key, msg, now):
            return
        if isinstance(msg, TransferRequest):
            self._on_request(key, msg, now)
        elif isinstance(msg, Abort):
            self._on_abort(key, msg, now)
        elif isinstance(msg, StagingGrant):
            self._on_grant(key, msg, now)
        elif isinstance(msg, StagingWatermark):
            self._on_watermark(key, msg, now)
        elif isinstance(msg, RoomHold):
            self._on_hold(key, msg, now)
        else:
            self.stats.peer_violations += 1
            self.send(key, self._abort_message(
                msg.room_id, msg.generation, ErrorCode.PEER_PROTOCOL_ERROR,
                f"{type(msg).__name__} is not a message a prefill rank accepts",
            ))

    def _answer_late(self, key: LinkKey, room_id: int, generation: int) -> bool:
        """Answer a request (or hold) for a room that ended here, unless it is for a new incarnation
        of the id; True if it was late. Late: its generation was seen, or the room ended before any
        request, or before this decode rank's request reached it. The answer tells decode why the
        room ended (e.g. ABORTED before decode's request arrived)."""
        ended = self._tombstones.get(room_id)
        if ended is None:
            return False
        link = self.links.get(key)
        missed = link is not None and ended.instance == link.instance and link.decode_rank not in ended.ranks
        if not (generation in ended.generations or not ended.generations or missed):
            return False
        self.stats.late_messages += 1
        drain = self._draining.get((room_id, key))
        if drain is not None and drain.generation == generation:
            return True  # the room's ABORT to that rank is held until its writes there are over: that is the answer
        code = ended.code if ended.state is RoomState.FAILED and ended.code is not None else ErrorCode.UNKNOWN_ROOM
        self.send(key, self._abort_message(room_id, generation, code,
                                           f"room {room_id} already ended here ({ended.state.name})"))
        self._tombstones[room_id] = replace(ended, answered=ended.answered | {generation})
        return True

    def _other_timer(self, key: object, now: float) -> None:
        if self._holds_timer(key):
            return
        if isinstance(key, tuple) and key[0] == "preaborted":
            self._preaborted.pop(key[1], None)
        elif isinstance(key, tuple) and key[0] == "parked":
            parked = self._parked.pop(key[1], [])
            self._parked_count -= len(parked)
            for link_key, msg in parked:
                self.stats.unknown_room_messages += 1
                self.send(link_key, self._abort_message(msg.room_id, msg.generation, ErrorCode.UNKNOWN_ROOM,
                                                        f"room {msg.room_id} was not opened within {self.timeouts.parked}s"))

    def _on_abort(self, key: LinkKey, msg: Abort, now: float) -> None:
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        if room is None:
            parked = self._parked.get(msg.room_id)
            if parked:
                kept = [(k, m) for k, m in parked if not (k == key and m.generation == msg.generation)]
                self._parked_count -= len(parked) - len(kept)
                self._parked[msg.room_id] = kept
                if not kept:
                    del self._parked[msg.room_id]
                    self.timers.cancel(("parked", msg.room_id))
                if len(kept) < len(parked):
                    # Decode sent that request, so it drains until we answer: nothing of a room
                    # not opened here can be in flight, answer at once (or it drops the link).
                    self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.coerce(msg.code),
                                                       f"request withdrawn: {msg.reason}"))
            if msg.room_id in self._tombstones:
                self._count_missing_room(msg.room_id)
            elif key in self.links and len(self._preaborted) < self.max_parked:
                # Decode gave up before this rank opened the room: fail it on open, not at its deadline.
                self._preaborted[msg.room_id] = (ErrorCode.coerce(msg.code), msg.reason)
                self.timers.schedule(("preaborted", msg.room_id), now + self.timeouts.parked)
            else:
                self._count_missing_room(msg.room_id)
            return
        link = self.links.get(key)
        peer = room.peers.get(link.decode_rank) if link else None
        if peer is None:
            # Decode may abort before its request reached us: accept it from a paired rank.
            if link is None or room.instance not in (None, link.instance) or link.decode_rank not in link.paired_ranks:
                self.stats.stale_tags += 1
                return
        elif peer.link.key != key or peer.request.generation != msg.generation:
            self.stats.stale_tags += 1
            return
        code = ErrorCode.coerce(msg.code)
        self.apply(room, Input.PEER_ABORT, now, code=code, reason=f"decode aborted: {msg.reason}", origin=key)

    def peer_violation(self, key: LinkKey, room_id: int, generation: int, code: ErrorCode, reason: str,
                       now: float) -> None:
        """A frame from ``key`` naming ``room_id`` could not be accepted (e.g. undecodable).

        The room fails if the link belongs to it (or could: a paired rank of its instance);
        the link is told with an ABORT either way.
        """
        room: SenderRoom | None = self.rooms.get(room_id)
        link = self.links.get(key)
        peer = self._peer_by_key(room, key) if room is not None else None
        if peer is None:
            self.send(key, self._abort_message(room_id, generation, code, reason))
        concerns = room is not None and link is not None and (
            peer is not None or (room.instance in (None, link.instance) and link.decode_rank in link.paired_ranks)
        )
        if concerns:
            self.apply(room, Input.PEER_VIOLATION, now, code=code, reason=reason)
        else:
            self.stats.peer_violations += 1

    # --- data plane ------------------------------------------------------------------------
    def write_done(self, room_id: int, link: LinkKey, seq: int, nbytes: int, now: float, *,
                   tag: bytes | None = None) -> None:
        """Write ``seq`` to ``link`` is DONE. ``tag`` (the write's tag) tells it apart from a write of
        an earlier room with the same id; without it, only ``seq`` is checked."""
        room: SenderRoom | None = self.rooms.get(room_id)
        peer = self._reported_write(room_id, room, link, seq, tag)
        if peer is None:
            return
        peer.inflight.discard(seq)
        peer.done += 1
        peer.nbytes += nbytes
        self.apply(room, Input.ALL_WRITES_DONE if self._all_done(room) else Input.WRITE_DONE, now)

    def write_failed(self, room_id: int, link: LinkKey, seq: int, reason: str, now: float, *,
                     tag: bytes | None = None) -> None:
        room = self.rooms.get(room_id)
        peer = self._reported_write(room_id, room, link, seq, tag)
        if peer is None:
            return
        peer.inflight.discard(seq)
        self.apply(room, Input.WRITE_ERROR, now, code=ErrorCode.TRANSPORT_ERROR,
                   reason=f"write {seq} failed: {reason}")

    def _drain_owns(self, room: SenderRoom, key: LinkKey, seq: int, tag: bytes | None) -> bool:
        """The report is about a write of an earlier, failed incarnation of the (reopened) room id
        whose ABORT still waits for it (without a tag: only if the live room has no such write)."""
        drain = self._draining.get((room.room_id, key))
        if drain is None or seq not in drain.inflight:
            return False
        if tag is not None:
            return decode_tag(tag).generation == drain.generation
        peer = self._peer_by_key(room, key)
        return peer is None or seq not in peer.inflight

    def _drained_write(self, room_id: int, key: LinkKey, seq: int, tag: bytes | None) -> None:
        """A write of an ended room finished; its link's ABORT goes out once none remain."""
        drain = self._draining.get((room_id, key))
        if drain is None or seq not in drain.inflight or (
            tag is not None and decode_tag(tag).generation != drain.generation
        ):
            self._count_missing_room(room_id)
            return
        drain.inflight.discard(seq)
        if not drain.inflight:
            del self._draining[(room_id, key)]
            self.send(key, self._abort_message(room_id, drain.generation, drain.code, drain.reason))

    # --- effects -------------------------------------------------------------------------------
    def _effect(self, room: SenderRoom, effect: Effect, now: float, origin: LinkKey | None) -> Input | None:
        if effect in (Effect.POST_QUEUED, Effect.POST_CHUNK):
            self._post_chunks(room)
            if self._all_done(room):
                return Input.ALL_WRITES_DONE  # nothing to wait for: no bytes, or a replica rank
        elif effect is Effect.EXTEND:
            self._extend(room)
        elif effect is Effect.SEND_DONE:
            for peer in room.peers.values():
                if peer.link.writes_any:
                    self.send(peer.link.key, TransferDone(
                        room_id=room.room_id, generation=peer.request.generation,
                        writes=peer.posted, nbytes=peer.nbytes))
        elif effect is Effect.ABORT_PEERS:
            # Every requester hears the code, the origin too (it waits for this answer before
            # reusing its memory); a link with writes in flight hears it once they are all over.
            for peer in room.peers.values():
                if self.links.get(peer.link.key) is not peer.link:
                    continue  # the link is gone (remove_link): nothing can be told or land through it
                if peer.inflight:
                    self._draining[(room.room_id, peer.link.key)] = _Drain(
                        peer.request.generation, peer.link.link_id, set(peer.inflight), room.code, room.reason)
                else:
                    self.send(peer.link.key, self._abort_message(
                        room.room_id, peer.request.generation, room.code, room.reason))
        return None


    def _reported_write(self, room_id: int, room: SenderRoom | None, key: LinkKey, seq: int,
                        tag: bytes | None) -> _Peer | None:
        """The peer whose in-flight write ``seq`` a DONE or failure report is about. None for any
        other report: one about a write of an earlier, failed incarnation of the room id whose ABORT
        waits for it goes to that drain (``_drained_write``); any other is counted stale (a write
        of an earlier incarnation may still complete late)."""
        if room is None or self._drain_owns(room, key, seq, tag):
            self._drained_write(room_id, key, seq, tag)
            return None
        peer = self._peer_by_key(room, key)
        if peer is None or seq not in peer.inflight or (
            tag is not None and decode_tag(tag).generation != peer.request.generation
        ):
            self.stats.stale_tags += 1
            return None
        return peer

    @staticmethod
    def _all_done(room: SenderRoom) -> bool:
        return (
            room.last_given
            and room.posted_chunks == len(room.chunks)
            and all(p.done == p.posted for p in room.peers.values())
        )

    @staticmethod
    def _peer_by_key(room: SenderRoom, key: LinkKey) -> _Peer | None:
        return next((p for p in room.peers.values() if p.link.key == key), None)

    def _timeout_code(self, room: SenderRoom) -> ErrorCode:
        if room.state is RoomState.TRANSFERRING and any(p.outstanding is not None for p in room.peers.values()):
            return ErrorCode.STAGING_STALLED
        return super()._timeout_code(room)

    def _tombstone(self, room: SenderRoom) -> Tombstone:
        return Tombstone(room.state, room.code, frozenset(p.request.generation for p in room.peers.values()),
                         room.instance, frozenset(room.peers))

    def _moved(self, room: SenderRoom) -> int:
        return sum(p.nbytes for p in room.peers.values())

    def _forget(self, room: SenderRoom) -> None:
        room.peers.clear()
        room.src_pages = []
        room.chunks.clear()
