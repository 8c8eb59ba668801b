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

Invariants: the sides' token counts must agree exactly (never shifted): a chunk past the
request's ``num_tokens`` or a last chunk short of it fails with TOKEN_COUNT_MISMATCH. A
failure is reported once, sends ABORT to every other link of the room, and frees the room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvproto.core.base import CoreBase, RoomBase, Tombstone, duplicate_page, page_outside
from kvproto.core.cost import PathCost, page_runs
from kvproto.core.events import (
    LinkKey,
    PagedPart,
    Part,
    PostAux,
    PostGroups,
    PostStaged,
    PostWrite,
    StatePart,
    Timeouts,
    new_part,
)
from kvproto.core.holds import SenderHolds
from kvproto.core.groups import (
    GroupSpec,
    LinkGroup,
    check_chunk_pages,
    check_destinations,
    local_span,
    pages_from_zero,
)
from kvproto.core.state import Effect, Input, Role, RoomState
from kvproto.wire import (
    NO_SLOT,
    Abort,
    ErrorCode,
    LocalProtocolError,
    Message,
    RoomHold,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    Tag,
    TagKind,
    TransferDone,
    TransferRequest,
    decode_tag,
)

MAX_PARKED = 65536


def _pages_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderLink:
    key: LinkKey
    link_id: int
    instance: str
    decode_rank: int
    num_blocks: int
    block_size: int
    aux_slots: int
    paired_ranks: frozenset[int]
    """Decode ranks of this instance that pair with this prefill rank (all send requests)."""
    writer: bool
    aux_owner: bool
    stage_unit: int = 0
    """Bytes per token of this pair's staged piece; 0: this link moves bytes directly."""
    stage_capacity: int = 0
    """The decode rank's staging region size in bytes (grants are checked against it)."""
    stage_max_units: int = 0
    """Most tokens one staged write may carry (a share of the smaller staging buffer)."""
    cost: PathCost | None = None
    """Pages byte-identical on both sides and staging possible: each room goes direct or staged,
    whichever ``cost`` prices lower (``kvproto.core.cost``). None: every room takes the link's
    one path (staged when ``stage_unit``, else direct or sliced)."""
    regions: int = 0
    """Regions (layers x planes) a direct write covers, for ``cost``."""
    groups: tuple[LinkGroup, ...] = ()
    """The groups beyond the first as the decode rank registered them (``writer`` is the first's)."""
    stage_tail: int = 0
    """Bytes of the state block that ends the staged piece carrying a request's last token
    (staging.md, minor 3: the state slots the link writes, gathered into the piece); 0: none, the
    state slots move in a write of their own."""

    @property
    def writes_any(self) -> bool:
        """This prefill rank writes some group into the decode rank: it sends TRANSFER_DONE."""
        return self.writer or any(g.writes for g in self.groups)


@dataclass(slots=True)
class _Peer:
    link: SenderLink
    request: TransferRequest
    posted: int = 0
    done: int = 0
    nbytes: int = 0
    inflight: set[int] = field(default_factory=set)
    """Seqs posted to the transport and not yet reported DONE or failed."""
    stage_next: int = 0
    """Staged links: the first token not yet granted."""
    stage_end: int = 0
    """Staged links: tokens available so far (chunks submitted, clipped to the request)."""
    outstanding: tuple[int, int, int] | None = None
    """Staged links: the (seq, start, end) of the staging request awaiting its grant."""
    consumed: int = 0
    """Staged links: watermarks received (pieces scattered on decode)."""
    staged_seqs: set[int] = field(default_factory=set)
    """Staged links: seqs granted and not yet watermarked."""
    staged: bool | None = None
    """Whether this room's writes to the link stage; decided at its first chunk with tokens."""


@dataclass(slots=True)
class _Drain:
    """A failed room's link whose writes are still in flight: its ABORT waits for them."""

    generation: int
    link_id: int
    inflight: set[int]
    code: ErrorCode | int | None
    reason: str


@dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    end: int
    last: bool
    aux_slot: int | None
    layers: tuple[int, int] | None = None
    """``(first, end)`` layers of a layer-wise chunk; None: every layer."""
    ready: object | None = None
    """The application's readiness handle (a CUDA event), opaque to the core."""
    completes: bool = True
    """The chunk gives the last layers of its tokens (a whole chunk always does)."""


@dataclass(slots=True, kw_only=True)
class SenderRoom(RoomBase):
    instance: str | None = None
    expected: frozenset[int] = frozenset()
    peers: dict[int, _Peer] = field(default_factory=dict)
    src_pages: list[int] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    posted_chunks: int = 0
    stale_generations: frozenset[int] = frozenset()
    """Generations the room id's previous incarnation accepted or answered with ABORT: a request
    carrying one is a late copy meant for that incarnation, never for this one."""
    hold_until: float = 0.0
    """The end of the latest ROOM_HOLD (capped): BOOTSTRAPPING lasts at least until then
    (``kvproto.core.holds``)."""

    layer_next: int = 0
    """Layer-wise chunks: the next layer of the token range being streamed (0: none open)."""
    group_pages: list[list[int]] = field(default_factory=list)
    """Pages of each paged group beyond the first, from token 0 (state groups: empty). A group
    given the first group's very list in every chunk so far holds ``src_pages`` itself, not a
    copy: its checks and writes then take it by identity."""
    state_slots: tuple[int, ...] | None = None
    """This rank's slot of each state group (paged groups: NO_SLOT), given with the first last chunk."""
    first_page: int = 0
    """Pages of the room this rank never names (its first chunk's ``first_token`` over the block
    size): tokens the decode holds already. ``src_pages`` begins with that many placeholders."""
    decode_prefix: int | None = None
    """The decode's prefix in tokens (the least any paired decode rank named) once every paired
    rank's request has come: what the application may skip (``first_token``)."""

    @property
    def end_token(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    @property
    def last_given(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].last and self.layer_next == 0


class SenderCore(SenderHolds, CoreBase):
    ROLE = Role.SENDER

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        aux_slots: int = 0,
        timeouts: Timeouts | None = None,
        max_parked: int = MAX_PARKED,
        num_layers: int = 0,
        groups: Sequence[GroupSpec] = (),
        layers: Sequence[int] | None = None,
    ) -> None:
        """``num_layers``: the model's layers, for layer-wise chunks (0: only whole chunks);
        ``groups``: the cache's groups beyond the first; ``layers``: the model layer of each of the
        first group's layers (default: the first ``num_layers``)."""
        super().__init__(timeouts=timeouts)
        self.block_size = block_size
        self.num_layers = num_layers
        self.groups = tuple(groups)
        self._states = tuple(g for g, spec in enumerate(self.groups) if spec.state)
        """The state groups (by index into ``groups``): what a room's last chunk gives a slot of."""
        self._group_rows = tuple((g, spec.state, spec.window, spec.layers) for g, spec in enumerate(self.groups))
        """Per group beyond the first: what ``_group_parts`` reads of it for every write."""
        self.layers = tuple(range(num_layers) if layers is None else layers)
        self.num_blocks = num_blocks
        self.aux_slots = aux_slots
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
            if any(not g.state for g in self.groups):
                raise LocalProtocolError("first_token: a cache with paged groups beyond the first names every page")
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

    def _on_request(self, key: LinkKey, msg: TransferRequest, now: float) -> None:
        link = self.links.get(key)
        if link is None:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.NOT_REGISTERED,
                                               "transfer request before registration"))
            return
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        if room is None:
            self._park(key, msg, now)
            return
        if room.state.terminal:  # pragma: no cover - ended rooms leave self.rooms
            return
        if msg.generation in room.stale_generations:
            self.stats.stale_tags += 1  # a late copy of a request the previous incarnation already settled
            return
        if room.instance is not None and room.instance != link.instance:
            self.stats.peer_violations += 1
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.DUPLICATE_ROOM,
                                               f"room {msg.room_id} is already bound to decode instance {room.instance!r}, "
                                               f"not {link.instance!r} (the TP ranks of one decode engine must share EndpointConfig.instance)"))
            return
        known = room.peers.get(link.decode_rank)
        if known is not None and known.link.key == key and known.request == msg:
            self.stats.late_messages += 1  # the same request twice (a duplicated frame): idempotent
            return
        problem = self._check_request(room, link, msg)
        if problem is not None:
            code, reason = problem
            if known is None or known.link.key != key:
                # Not a peer of the room: nothing of ours is in flight to it, tell it now. A peer
                # hears the code through ABORT_PEERS, after its writes in flight are over.
                self.send(key, self._abort_message(msg.room_id, msg.generation, code, reason))
            self.apply(room, Input.PEER_VIOLATION, now, code=code, reason=reason, origin=key)
            return
        room.instance = link.instance
        room.expected = link.paired_ranks
        room.peers[link.decode_rank] = _Peer(link, msg, stage_next=msg.prefix_tokens, stage_end=msg.prefix_tokens)
        mismatch = self._token_mismatch(room)
        if mismatch:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.TOKEN_COUNT_MISMATCH, reason=mismatch)
            return
        if len(room.peers) < len(room.expected):
            self.apply(room, Input.REQUEST_PARTIAL, now)
            return
        room.decode_prefix = min(p.request.prefix_tokens for p in room.peers.values())
        if room.chunks:
            self.apply(room, Input.REQUEST_COMPLETE_WITH_INPUT, now)
        else:
            self.apply(room, Input.REQUEST_COMPLETE, now)

    def _check_request(self, room: SenderRoom, link: SenderLink, msg: TransferRequest) -> tuple[ErrorCode, str] | None:
        if link.decode_rank not in link.paired_ranks:
            return ErrorCode.PEER_PROTOCOL_ERROR, f"decode rank {link.decode_rank} does not pair with this prefill rank"
        if link.decode_rank in room.peers:
            return ErrorCode.PEER_PROTOCOL_ERROR, f"second transfer request from decode rank {link.decode_rank}"
        if msg.prefix_tokens > msg.num_tokens or msg.prefix_tokens % link.block_size:
            return ErrorCode.INDEX_OUT_OF_RANGE, (
                f"prefix of {msg.prefix_tokens} tokens is not a whole number of decode blocks within {msg.num_tokens}")
        need = _pages_for(msg.num_tokens, link.block_size)
        if len(msg.dst_pages) != need:
            return ErrorCode.TOKEN_COUNT_MISMATCH, (
                f"{msg.num_tokens} tokens need {need} decode pages, the request lists {len(msg.dst_pages)}")
        pages_checked, groups_checked = self._checked_by(room, link, msg)
        if not pages_checked:
            if msg.dst_pages and max(msg.dst_pages) >= link.num_blocks:
                return ErrorCode.INDEX_OUT_OF_RANGE, (
                    f"destination page {max(msg.dst_pages)} outside the {link.num_blocks} registered pages")
            twice = duplicate_page(msg.dst_pages)
            if twice is not None:
                return ErrorCode.INDEX_OUT_OF_RANGE, (
                    f"destination page {twice} is listed twice: two token ranges would share it")
        if msg.aux_slot != NO_SLOT and msg.aux_slot >= link.aux_slots:
            return ErrorCode.INDEX_OUT_OF_RANGE, f"aux slot {msg.aux_slot} outside the {link.aux_slots} registered slots"
        if msg.generation == 0:
            return ErrorCode.PEER_PROTOCOL_ERROR, "transfer request without a generation"
        if (self.groups or msg.groups) and not groups_checked:
            return check_destinations(self.groups, link.groups, msg.groups, msg.num_tokens, msg.prefix_tokens,
                                      (msg.dst_pages, link.num_blocks))
        return None

    @staticmethod
    def _checked_by(room: SenderRoom, link: SenderLink, msg: TransferRequest) -> tuple[bool, bool]:
        """Whether a request of ``room`` already checked (a peer's) names ``msg``'s very page list
        (the same object) against a link of no more pages, and its very group destinations for the
        same token counts against a link that registered the same groups: then ``msg``'s pages,
        and its groups, pass the checks that one passed (module docstring)."""
        peer = next(iter(room.peers.values()), None)  # any checked request will do: take the first
        if peer is None:
            return False, False
        seen, other = peer.request, peer.link
        pages = seen.dst_pages is msg.dst_pages and other.num_blocks <= link.num_blocks
        groups = pages and seen.groups is msg.groups and seen.num_tokens == msg.num_tokens and \
            seen.prefix_tokens == msg.prefix_tokens and other.groups == link.groups
        return pages, groups

    def _token_mismatch(self, room: SenderRoom) -> str | None:
        counts = {p.request.num_tokens for p in room.peers.values()}
        if len(counts) > 1:
            return f"decode ranks disagree on the token count: {sorted(counts)}"
        if room.first_page and room.chunks:
            skipped = room.chunks[0].start
            short = [p.request.prefix_tokens for p in room.peers.values() if p.request.prefix_tokens < skipped]
            if short:
                return (f"the prefill sends tokens from {skipped} on (first_token), a decode rank's prefix holds "
                        f"only {min(short)}")
        if counts and room.chunks:
            (n,) = counts
            if room.end_token > n:
                return f"prefill reached token {room.end_token}, decode expects {n} tokens"
            if room.last_given and room.end_token != n:
                return f"prefill's last chunk ends at token {room.end_token}, decode expects {n} tokens"
        return None

    def _park(self, key: LinkKey, msg: TransferRequest, now: float) -> None:
        if self.closed:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.ENDPOINT_CLOSED,
                                               "endpoint closed"))
            return
        if self._answer_late(key, msg.room_id, msg.generation):
            return
        if self._parked_count >= self.max_parked:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.UNKNOWN_ROOM,
                                               "too many requests for rooms not yet opened"))
            return
        parked = self._parked.setdefault(msg.room_id, [])
        if not parked:
            self.timers.schedule(("parked", msg.room_id), now + self.timeouts.parked)
        parked.append((key, msg))
        self._parked_count += 1

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
        if room is None or self._drain_owns(room, link, seq, tag):
            self._drained_write(room_id, link, seq, tag)
            return
        peer = self._current_write(room, link, seq, tag)
        if peer is None:
            return
        peer.inflight.discard(seq)
        peer.done += 1
        peer.nbytes += nbytes
        self.apply(room, Input.ALL_WRITES_DONE if self._all_done(room) else Input.WRITE_DONE, now)

    def write_failed(self, room_id: int, link: LinkKey, seq: int, reason: str, now: float, *,
                     tag: bytes | None = None) -> None:
        room = self.rooms.get(room_id)
        if room is None or self._drain_owns(room, link, seq, tag):
            self._drained_write(room_id, link, seq, tag)
            return
        peer = self._current_write(room, link, seq, tag)
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

    # --- staging -------------------------------------------------------------------------------
    def _stage_up_to(self, room: SenderRoom, peer: _Peer, end: int) -> None:
        """Let the writer ask for staging up to token ``end``. On a link whose pieces end with the
        state block the request's last token waits for the state slots (they come with the last
        chunk, which may add no token): the piece that ends the request must carry them."""
        if peer.link.stage_tail and end == peer.request.num_tokens and room.state_slots is None:
            end -= 1
        peer.stage_end = max(peer.stage_end, end)
        self._request_staging(room, peer)

    def _request_staging(self, room: SenderRoom, peer: _Peer) -> None:
        """Ask for the next staged piece of ``peer``'s tokens, if any is available and none asked."""
        if peer.outstanding is not None or peer.stage_next >= peer.stage_end:
            return
        link = peer.link
        end = min(peer.stage_end, peer.stage_next + max(1, link.stage_max_units or peer.stage_end))
        seq = peer.posted
        peer.posted += 1  # the seq is reserved now; its write is posted once granted
        peer.outstanding = (seq, peer.stage_next, end)
        self.send(link.key, StagingRequest(room_id=room.room_id, generation=peer.request.generation, seq=seq,
                                           start_token=peer.stage_next, end_token=end))

    def _on_grant(self, key: LinkKey, msg: StagingGrant, now: float) -> None:
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        if room is None:
            self._count_missing_room(msg.room_id)
            return
        peer = self._peer_by_key(room, key)
        if peer is None or peer.request.generation != msg.generation:
            self.stats.stale_tags += 1
            return
        link, want = peer.link, peer.outstanding
        problem = None
        if want is None or want[0] != msg.seq or want[1] != msg.start_token:
            problem = ErrorCode.PEER_PROTOCOL_ERROR, f"grant for write {msg.seq} at token {msg.start_token} was not asked for"
        elif not want[1] < msg.end_token <= want[2]:
            problem = ErrorCode.INDEX_OUT_OF_RANGE, (
                f"grant of tokens [{msg.start_token}, {msg.end_token}) outside the request [{want[1]}, {want[2]})")
        elif msg.offset + self._piece_bytes(peer, msg.start_token, msg.end_token) > link.stage_capacity:
            problem = ErrorCode.INDEX_OUT_OF_RANGE, (
                f"grant at offset {msg.offset} overruns the {link.stage_capacity}-byte staging region")
        if problem is not None:
            self.apply(room, Input.PEER_VIOLATION, now, code=problem[0], reason=problem[1])
            return
        peer.outstanding = None
        peer.stage_next = msg.end_token
        self._outputs.append(PostStaged(
            room_id=room.room_id, link=key, seq=msg.seq,
            tag=self._tag(room.room_id, peer, msg.seq, TagKind.STAGED),
            start_token=msg.start_token, end_token=msg.end_token, src_pages=tuple(room.src_pages),
            remote_offset=msg.offset,
            ready=tuple(c.ready for c in room.chunks if c.ready is not None and c.start < msg.end_token),
            group_pages=tuple(tuple(p) for p in room.group_pages),
            states=self._piece_states(room, peer, msg.end_token)))
        peer.inflight.add(msg.seq)
        peer.staged_seqs.add(msg.seq)
        self._request_staging(room, peer)

    @staticmethod
    def _piece_bytes(peer: _Peer, start: int, end: int) -> int:
        """Bytes of the staged piece of tokens ``[start, end)`` to ``peer``: its units, and the
        state block where it carries the request's last token."""
        link = peer.link
        return (end - start) * link.stage_unit + (link.stage_tail if end == peer.request.num_tokens else 0)

    def _on_watermark(self, key: LinkKey, msg: StagingWatermark, now: float) -> None:
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        peer = self._peer_by_key(room, key) if room is not None else None
        if peer is None or peer.request.generation != msg.generation:
            self._count_missing_room(msg.room_id)
            return
        if msg.seq not in peer.staged_seqs:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.PEER_PROTOCOL_ERROR,  # type: ignore[arg-type]
                       reason=f"watermark for write {msg.seq}, which was not staged")
            return
        peer.staged_seqs.discard(msg.seq)
        peer.consumed += 1

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

    def _post_chunks(self, room: SenderRoom) -> None:
        while room.posted_chunks < len(room.chunks):
            chunk = room.chunks[room.posted_chunks]
            room.posted_chunks += 1
            ready = () if chunk.ready is None else (chunk.ready,)
            src: tuple[int, ...] | None = None  # made once, by the first part that names the room's pages
            made: tuple[_Peer, tuple[Part, ...]] | None = None  # a link's parts (not staged), for links alike
            for peer in room.peers.values():
                link, req = peer.link, peer.request
                if not link.writes_any:
                    continue
                start = max(chunk.start, req.prefix_tokens)
                end = min(chunk.end, req.num_tokens)
                if link.writer and start < end and peer.staged is None:
                    peer.staged = self._stages(room, peer, start, end)
                if made is not None and self._alike(made[0], peer):
                    if made[1]:
                        self._post(room, peer, PostGroups, parts=made[1], ready=ready)
                    self._post_aux(room, chunk, peer)
                    continue
                span = local_span(self.layers, chunk.layers)
                parts: list[Part] = []
                if link.writer and start < end:
                    if peer.staged:
                        if chunk.completes:  # staged pieces carry every layer: the range waits for its last
                            self._stage_up_to(room, peer, end)
                    elif span is None or span[0] < span[1]:  # the span holds some of the first group's layers
                        if src is None:
                            src = tuple(room.src_pages)
                        if not self.groups:
                            self._post(room, peer, PostWrite, start_token=start, end_token=end,
                                       src_pages=src, dst_pages=req.dst_pages, layers=span, ready=ready)
                        else:
                            parts.append(new_part(PagedPart, (0, start, end, span, src, req.dst_pages)))
                elif peer.staged and chunk.last and chunk.completes:  # an empty last chunk: it gives the slots
                    self._stage_up_to(room, peer, end)
                if self.groups:
                    self._group_parts(parts, room, peer, chunk, start, end, src)
                posted = tuple(parts)
                if self.groups and peer.staged is not True:
                    made = (peer, posted)
                if posted:
                    self._post(room, peer, PostGroups, parts=posted, ready=ready)
                self._post_aux(room, chunk, peer)

    def _post_aux(self, room: SenderRoom, chunk: _Chunk, peer: _Peer) -> None:
        """The aux slot's write to ``peer``, with the chunk that completes the last token range."""
        if chunk.last and chunk.completes and peer.link.aux_owner and chunk.aux_slot is not None and \
                peer.request.aux_slot != NO_SLOT:
            self._post(room, peer, PostAux, src_slot=chunk.aux_slot, dst_slot=peer.request.aux_slot)

    @staticmethod
    def _alike(made: _Peer, peer: _Peer) -> bool:
        """Whether a chunk's write to ``peer`` has the very parts of the write to ``made`` (neither
        staged): the same request lists (identity) and token counts, a link of the same role and
        groups. The parts name groups, tokens, pages and slots, none of the link's own geometry."""
        a, b = made.request, peer.request
        return peer.staged is made.staged and b.dst_pages is a.dst_pages and b.groups is a.groups and \
            b.num_tokens == a.num_tokens and b.prefix_tokens == a.prefix_tokens and \
            peer.link.writer == made.link.writer and peer.link.groups == made.link.groups

    def _group_parts(self, parts: list[Part], room: SenderRoom, peer: _Peer, chunk: _Chunk, start: int, end: int,
                     src: tuple[int, ...] | None) -> None:
        """Add to ``parts`` the parts of groups beyond the first that a chunk's write to ``peer``
        carries: each paged group's tokens (clipped to its window; none where the link's staged
        pieces carry the group) and, with the last token range, each state slot, unless the piece
        that ends the request's tokens is still to be granted on a staged link: the slots then ride
        in it.
        A group whose pages are the first group's (``src``, that group's part's, if the write has
        one; the request's ``dst_pages``) names the same objects, so that a transport can tell by
        identity that the lists are one (``kvproto.transport.cuda_ipc`` then lists them once in its
        launch)."""
        req = peer.request
        states = chunk.last and room.state_slots is not None and not (peer.staged and peer.link.stage_tail > 0)
        layers, staged, dests = chunk.layers, peer.staged, req.groups
        for (g, state, window, own_layers), lg in zip(self._group_rows, peer.link.groups):
            if not lg.writes or (not states if state else lg.staged and staged):
                continue  # (a paged group the link's staged pieces carry)
            span = None if layers is None else local_span(own_layers, layers)
            if span is not None and span[0] == span[1]:
                continue  # none of the group's layers in this chunk
            dest = dests[g]
            if state:  # (group, layers, src_slot, dst_slot): the part's group counts the first as 0
                parts.append(new_part(StatePart, (g + 1, span, room.state_slots[g], dest.slot)))  # type: ignore[index]
                continue
            first = start if window is None else max(start, self.groups[g].window_start(req.num_tokens))
            if first < end:  # (group, start_token, end_token, layers, src_pages, dst_pages)
                held = room.group_pages[g]
                own = src if src is not None and (held is room.src_pages or held == room.src_pages) else tuple(held)
                pages = dest.pages
                to = req.dst_pages if dest.first_page == 0 and (pages is req.dst_pages or
                                                                pages == req.dst_pages) else pages_from_zero(dest)
                parts.append(new_part(PagedPart, (g + 1, first, end, span, own, to)))

    def _piece_states(self, room: SenderRoom, peer: _Peer, end_token: int) -> tuple[StatePart, ...]:
        """The state slots gathered into a staged piece's state block: every state group the link
        writes, all its layers, in the piece that ends the request's tokens on a link whose pieces
        end with one (``stage_tail``). That piece is asked for only once the last chunk was given,
        and the last chunk gives the slots (``_state_slots``), so they are always known here."""
        req = peer.request
        if not peer.link.stage_tail or end_token != req.num_tokens:
            return ()
        assert room.state_slots is not None, "the piece that ends a request is asked for after its last chunk"
        writes = peer.link.groups
        return tuple([StatePart(g + 1, None, room.state_slots[g], req.groups[g].slot)
                      for g in self._states if writes[g].writes])

    def _post(self, room: SenderRoom, peer: _Peer, output: type, **fields: object) -> None:
        """Emit one tagged write to ``peer`` as its next ``seq``."""
        self._outputs.append(output(room_id=room.room_id, link=peer.link.key, seq=peer.posted,
                                    tag=self._tag(room.room_id, peer), **fields))
        peer.inflight.add(peer.posted)
        peer.posted += 1

    @staticmethod
    def _stages(room: SenderRoom, peer: _Peer, start: int, end: int) -> bool:
        """Whether the room's writes to ``peer`` stage (see ``kvproto.core.cost``)."""
        link = peer.link
        if not link.stage_unit:
            return False
        if link.cost is None:
            return True
        block = link.block_size
        runs = page_runs(room.src_pages, peer.request.dst_pages, start // block, -(-end // block))
        return link.cost.stage_wins(runs * link.regions, (end - start) * link.stage_unit)

    @staticmethod
    def _tag(room_id: int, peer: _Peer, seq: int | None = None, kind: TagKind = TagKind.KV) -> bytes:
        return Tag(kind=kind, room_id=room_id, generation=peer.request.generation,
                   link_id=peer.link.link_id, seq=peer.posted if seq is None else seq).encode()

    def _current_write(self, room: SenderRoom, key: LinkKey, seq: int, tag: bytes | None) -> _Peer | None:
        """The peer whose in-flight write ``seq`` this report is about; None (counted stale) for a
        report of an earlier incarnation of the room id, whose writes may still complete late."""
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

