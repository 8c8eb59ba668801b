"""The decode rank's sans-IO core: rooms that receive KV pushed by prefill ranks.

Theory of operation
-------------------
A *cluster* is one prefill instance, named by its bootstrap address. The I/O layer bootstraps
it (query, connect, register) and reports ``cluster_ready`` with the links to the prefill ranks
that pair with this decode rank, each marked ``writer`` (it writes into this rank) and
``aux_owner`` (it writes the aux slot), or ``cluster_failed`` with a code.

A room waits in BOOTSTRAPPING for its cluster, in WAITING_FOR_INPUT for the application's
destination (pages, token count, prefix, aux slot), then sends one TRANSFER_REQUEST to every
paired prefill rank under a fresh *generation* and waits in TRANSFERRING.

Groups beyond the first (``kvproto.core.groups``): the destination names each group's pages (only
those holding the tokens this rank needs: a sliding window's) or state slot, checked here before
anything is sent, and the request carries them (``TransferRequest.groups``). A *writer* link is
one whose prefill rank writes some group into this rank; the rest is counting as before, since
every group's writes share the writer's ``seq`` numbering.

Completion is counted per writer identity, never by arrival count: writer ``w`` is complete
when its TRANSFER_DONE said ``writes = n`` and tags with every ``seq`` in ``[0, n)`` arrived for
the room's current generation, on the link whose agent name the transport reports as the
sender. Duplicated tags are idempotent; tags of another generation are stale and dropped; a
tag or TRANSFER_DONE from a link that is not an expected writer, or a ``seq >= n``, is a peer
violation that fails the room.

Staging (a writer that asks): STAGING_REQUESTs of a writer must cover its tokens in order; the
ring grants them FIFO; a STAGED tag turns into a ``Scatter`` output and counts as arrived only
at ``scatter_done``, which releases the region and answers with a STAGING_WATERMARK. A writer
stages all of a room's tokens or none: one whose count is complete with tokens never granted
fails the room (TOKEN_COUNT_MISMATCH), never a success with a gap.

Ends that no link can carry yet: a room that fails while BOOTSTRAPPING (the application's
abort, its deadline, the endpoint's close) has no link to tell, yet the prefill ranks of its
cluster may already hold the room open (or open it soon) and would wait for their own deadline,
pinning their pages. So its ABORT is *held* in the cluster until the bootstrap settles: when the
cluster becomes ready the held ABORTs go to every paired prefill rank, before any new room's
request (a prefill rank fails the room, or remembers a pre-abort for a room it has not opened);
when the bootstrap fails they are dropped (no prefill rank ever heard of this decode rank). A
room id opened again while its end is held supersedes it: the prefill side has one room per id,
and the new incarnation will talk to it. Held ends are bounded per cluster (``MAX_HELD_ENDS``,
oldest dropped first) and live no longer than the bootstrap, itself bounded by its deadline.

Holds and refusals (protocol 1.4, ``kvproto.core.holds``): a room waiting for its destination
sends ROOM_HOLDs to its prefill ranks of minor 4 or later so that their rooms outlive their lease;
a bootstrap that fails can tell the prefill ranks that answered (``cluster_failed``'s ``tell``)
which rooms fail by it, so that they let go of those rooms at once.

Losing one prefill rank: its links fail the cluster (it must bootstrap again), and its rooms
fail. A room that was TRANSFERRING drains (see below): it sends ABORT to its other writers, whose
links stay *retired* — kept in ``links_by_id``, used by no new room — until the last room holding
them ends, so that their answers settle it at once instead of at its drain deadline.

Failure while writes may land (see ``state``): a TRANSFERRING room with unsettled writers or a
scatter running is classified DRAIN instead of failing; it keeps its pages and staging
regions until every writer settles (its TRANSFER_DONE arrived, it answered with ABORT, or its
link went) and no scatter runs, or the drain deadline passes (``DropLink`` for the writers that
never answered); then it fails with the original code.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproto.core.base import CoreBase, RoomBase, Tombstone, duplicate_page, page_outside
from kvproto.core.events import DropLink, LinkKey, Scatter
from kvproto.core.groups import check_destinations, pages_from_zero, slot_destination
from kvproto.core.holds import ReceiverHolds
from kvproto.core.staging import StagingRing
from kvproto.core.state import Effect, Input, Role, RoomState
from kvproto.wire import (
    NO_SLOT,
    Abort,
    GroupDestination,
    ErrorCode,
    LocalProtocolError,
    MalformedTag,
    Message,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    TagKind,
    TransferDone,
    TransferRequest,
    decode_tag,
)

_FAILURES = frozenset({Input.PEER_ABORT, Input.PEER_GONE, Input.PEER_VIOLATION, Input.LOCAL_ABORT,
                       Input.TIMEOUT, Input.CLOSE})

ClusterKey = Hashable

MAX_HELD_ENDS = 65536
"""Most ABORTs held per bootstrapping cluster (see "Ends that no link can carry yet")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverLink:
    key: LinkKey
    link_id: int
    cluster: ClusterKey
    prefill_rank: int
    agent: str
    writer: bool
    """The prefill rank writes some group into this rank (it sends TRANSFER_DONE)."""
    aux_owner: bool
    stage_unit: int = 0
    """Bytes per token of this writer's staged pieces (0: it cannot stage into this rank)."""
    staged_groups: tuple[int, ...] = ()
    """Groups beyond the first (1 = the first of them) that ride in this writer's staged pieces."""
    stage_tail: int = 0
    """Bytes of the state block that ends this writer's piece carrying a request's last token
    (staging.md, minor 3); 0: none."""
    minor: int = 0
    """The prefill rank's minor version (its REGISTER_ACCEPT's header): ROOM_HOLD from 4 on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Destination:
    pages: tuple[int, ...]
    num_tokens: int
    prefix_tokens: int
    aux_slot: int | None
    groups: tuple[GroupDestination, ...] = ()
    """One per group beyond the first: its pages (from ``first_page``) or its state slot."""


def _one_of(pages: tuple[int, ...], first: tuple[int, ...]) -> tuple[int, ...]:
    """``pages``, or the first group's tuple where they are equal: one object for one list, which
    the checks and the codec then take by identity (``kvproto.core.groups.same_pages``)."""
    return first if pages == first else pages


@dataclass(slots=True)
class _Progress:
    writes: int | None = None
    seqs: set[int] = field(default_factory=set)
    nbytes: int = 0
    stage_next: int = 0
    """The first token of this writer's next staging request."""
    asking: int | None = None
    """Seq of this writer's staging request not yet granted."""

    def complete(self) -> bool:
        return self.writes is not None and len(self.seqs) == self.writes


@dataclass(slots=True, kw_only=True)
class ReceiverRoom(RoomBase):
    cluster: ClusterKey
    generation: int = 0
    destination: Destination | None = None
    links: tuple[ReceiverLink, ...] = ()
    writers: dict[int, _Progress] = field(default_factory=dict)
    staged: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    """(link_id, seq) -> (offset, start, end) of granted staging regions not yet consumed."""
    scattering: set[tuple[int, int]] = field(default_factory=set)
    failing: bool = False
    settled: set[int] = field(default_factory=set)
    """Writers (link ids) that can no longer write into this room: answered ABORT or gone."""


@dataclass(slots=True)
class _Cluster:
    ready: bool = False
    links: tuple[ReceiverLink, ...] = ()
    failure: tuple[ErrorCode | int, str] | None = None
    held_ends: dict[int, Abort] = field(default_factory=dict)
    """room id -> the ABORT of a room that ended while this cluster bootstrapped."""


class ReceiverCore(ReceiverHolds, CoreBase):
    ROLE = Role.RECEIVER

    def __init__(self, *, seed: int | None = None, staging: StagingRing | None = None, **cache: Any) -> None:
        """``cache``: what every core knows of its cache (``CoreBase``: ``block_size``,
        ``num_blocks``, ``aux_slots``, ``timeouts``, ``groups``); ``staging``: the ring over this
        rank's staging buffer; ``seed``: where this core's generations start (tests)."""
        super().__init__(**cache)
        self.ring = staging
        self.clusters: dict[ClusterKey, _Cluster] = {}
        self.links_by_id: dict[int, ReceiverLink] = {}
        self._finishing: set[int] = set()
        """Rooms with a writer whose TRANSFER_DONE came before all its tags (see ``expecting_data``)."""
        self._generation = random.Random(seed).randrange(1, 2**31)

    # --- clusters and links ------------------------------------------------------------------
    def cluster_status(self, cluster: ClusterKey) -> str:
        state = self.clusters.get(cluster)
        if state is None:
            return "unknown"
        return "ready" if state.ready else ("failed" if state.failure else "pending")

    def cluster_pending(self, cluster: ClusterKey) -> None:
        """Bootstrap of ``cluster`` (re)started: forget an earlier failure."""
        self.clusters[cluster] = _Cluster()

    def cluster_ready(self, cluster: ClusterKey, links: Sequence[ReceiverLink], now: float) -> None:
        if not any(link.writer for link in links):
            self.cluster_failed(cluster, ErrorCode.INCOMPATIBLE_GEOMETRY, "no prefill rank writes to this rank", now)
            return
        held = self.clusters[cluster].held_ends if cluster in self.clusters else {}
        self.clusters[cluster] = _Cluster(ready=True, links=tuple(links))
        for link in links:
            self.links_by_id[link.link_id] = link
        for abort in held.values():  # ends first: a prefill rank must not serve a room that ended
            for link in links:
                self.send(link.key, abort)
        for room in [r for r in self.rooms.values() if r.cluster == cluster and r.state is RoomState.BOOTSTRAPPING]:
            room.links = tuple(links)
            self.apply(room, Input.LINKS_READY_WITH_INPUT if room.destination else Input.LINKS_READY, now)

    def cluster_failed(self, cluster: ClusterKey, code: ErrorCode | int, reason: str, now: float, *,
                       tell: Sequence[LinkKey] = ()) -> None:
        """The bootstrap of ``cluster`` failed with ``code``: its waiting rooms fail. ``tell``: links
        whose prefill rank answered the registration (it accepted it, or refused it at minor 4 or
        later): each is sent a room ABORT for every room that fails here and every held end, so
        that those prefill ranks let go of the rooms at once (``kvproto.core.holds``)."""
        state = self.clusters.setdefault(cluster, _Cluster())
        if tell:
            aborts = self._refusal_aborts(cluster, state, code, reason)
            for key in tell:
                for abort in aborts:
                    self.send(key, abort)
        retired, state.links = state.links, ()
        self._release_links(retired)
        state.ready, state.failure = False, (code, reason)
        state.held_ends.clear()  # no prefill rank of the cluster ever registered this rank
        for room in [r for r in self.rooms.values() if r.cluster == cluster and not r.links]:  # still bootstrapping
            self.apply(room, Input.PEER_GONE, now, code=code, reason=reason)

    def remove_link(self, key: LinkKey, now: float, code: ErrorCode = ErrorCode.PEER_GONE, reason: str = "") -> None:
        """A prefill rank is gone: its cluster must bootstrap again; rooms that need it fail."""
        gone = next((link for link in self.links_by_id.values() if link.key == key), None)
        if gone is None:
            return
        reason = reason or f"prefill rank {gone.prefill_rank} is gone"
        for room in [r for r in self.rooms.values() if gone in r.links]:
            room.settled.add(gone.link_id)
            self.apply(room, Input.PEER_GONE, now, code=code, reason=reason, origin=key)
        current = self.clusters.get(gone.cluster)
        if current is not None and gone in current.links:
            self.cluster_failed(gone.cluster, code, reason, now)
        self.links_by_id.pop(gone.link_id, None)

    def _release_links(self, links: Sequence[ReceiverLink]) -> None:
        """Forget the links of a failed cluster that no live room holds. A room that still drains
        keeps the links of its other writers (*retired*: no new room uses them) until it ends, so
        that their ABORT answers are heard: see "Losing one prefill rank" above."""
        for link in links:
            if link.link_id in self.links_by_id and not any(link in r.links for r in self.rooms.values()):
                del self.links_by_id[link.link_id]

    def link_in_use(self, link_id: int) -> bool:
        """Whether the link is current or a live room still holds it (the I/O layer keeps its socket)."""
        return link_id in self.links_by_id

    # --- application API ----------------------------------------------------------------------
    def open_room(self, room_id: int, cluster: ClusterKey, now: float, *,
                  destination: Destination | None = None) -> ReceiverRoom:
        """Open a room fed by ``cluster``; ``destination`` (from ``check_destination``) may come
        now or later through ``set_destination``. A refused call changes nothing."""
        self._new_room_check(room_id)
        self._generation = self._generation % 0xFFFFFFFF + 1
        room = ReceiverRoom(room_id=room_id, cluster=cluster, created=now, generation=self._generation,
                            destination=destination)
        self._add_room(room)
        self.timers.schedule(room_id, self._deadline(RoomState.BOOTSTRAPPING, now))
        state = self.clusters.get(cluster)
        if state is not None and state.ready:
            room.links = state.links
            self.apply(room, Input.LINKS_READY_WITH_INPUT if destination else Input.LINKS_READY, now)
        elif state is not None and state.failure:
            code, reason = state.failure
            self.apply(room, Input.PEER_GONE, now, code=code, reason=reason)
        elif state is not None:
            state.held_ends.pop(room_id, None)  # this incarnation supersedes the one that ended
        return room

    def set_destination(
        self,
        room_id: int,
        pages: Sequence[int],
        num_tokens: int,
        now: float,
        *,
        prefix_tokens: int = 0,
        aux_slot: int | None = None,
        group_pages: Sequence[Sequence[int]] = (),
        state_slots: Sequence[int] = (),
    ) -> None:
        room: ReceiverRoom | None = self.rooms.get(room_id)
        if room is None:
            if room_id in self._tombstones:
                self.stats.late_messages += 1
                return
            raise LocalProtocolError(f"room {room_id} was never opened", ErrorCode.UNKNOWN_ROOM)
        if room.destination is not None:
            raise LocalProtocolError(f"room {room_id} already has its destination")
        dest = self.check_destination(pages, num_tokens, prefix_tokens=prefix_tokens, aux_slot=aux_slot,
                                      group_pages=group_pages, state_slots=state_slots)
        if room.state is RoomState.BOOTSTRAPPING or room.state is RoomState.WAITING_FOR_INPUT:
            room.destination = dest
        self.apply(room, Input.DESTINATION, now)

    def check_destination(self, pages: Sequence[int], num_tokens: int, *, prefix_tokens: int = 0,
                          aux_slot: int | None = None, group_pages: Sequence[Sequence[int]] = (),
                          state_slots: Sequence[int] = ()) -> Destination:
        """The destination, validated against this rank's cache; ``LocalProtocolError`` if unusable.
        ``group_pages`` / ``state_slots``: per group beyond the first, its pages (those holding the
        tokens needed: ``GroupSpec.needed_pages``; for a window the engine names, the last pages of
        the prompt that it needs) or its slot; the other kind's entry is ignored."""
        need = -(-num_tokens // self.block_size)
        given, pages = pages, tuple(pages)
        if not 0 < num_tokens < 2**32:
            raise LocalProtocolError(f"token count {num_tokens} outside [1, 2**32)", ErrorCode.TOKEN_COUNT_MISMATCH)
        if len(pages) != need:
            raise LocalProtocolError(f"{num_tokens} tokens need {need} pages, got {len(pages)}",
                                     ErrorCode.TOKEN_COUNT_MISMATCH)
        bad = page_outside(pages, self.num_blocks)
        if bad is not None:
            raise LocalProtocolError(f"page {bad} outside [0, {self.num_blocks})", ErrorCode.INDEX_OUT_OF_RANGE)
        twice = duplicate_page(pages)
        if twice is not None:
            raise LocalProtocolError(f"page {twice} is listed twice: two token ranges would share it",
                                     ErrorCode.INDEX_OUT_OF_RANGE)
        if not 0 <= prefix_tokens <= num_tokens or prefix_tokens % self.block_size:
            raise LocalProtocolError(f"prefix of {prefix_tokens} tokens must be whole blocks within {num_tokens}")
        if aux_slot is not None and not 0 <= aux_slot < self.aux_slots:
            raise LocalProtocolError(f"aux slot {aux_slot} outside [0, {self.aux_slots})", ErrorCode.INDEX_OUT_OF_RANGE)
        groups: tuple[GroupDestination, ...] = ()
        if self.groups or group_pages or state_slots:
            if len(group_pages) != len(self.groups) or len(state_slots) != len(self.groups):
                raise LocalProtocolError(f"the cache has {len(self.groups)} groups beyond the first: give pages or a "
                                         f"slot for each ({', '.join(repr(g.name) for g in self.groups) or 'none'})")
            groups = tuple([
                slot_destination(int(slot)) if spec.state else
                GroupDestination(first_page=(spec.named_from(num_tokens, len(group)) if spec.named else
                                             spec.window_start(num_tokens) // spec.block_size),
                                 pages=pages if group is given else _one_of(tuple(group), pages), slot=NO_SLOT)
                for spec, group, slot in zip(self.groups, group_pages, state_slots)])
            problem = check_destinations(self.groups, self.groups, groups, num_tokens, prefix_tokens,
                                         checked=(pages, self.num_blocks))
            if problem is not None:
                raise LocalProtocolError(problem[1], problem[0])
        return Destination(pages=pages, num_tokens=num_tokens, prefix_tokens=prefix_tokens, aux_slot=aux_slot,
                           groups=groups)

    # --- control plane ---------------------------------------------------------------------------
    def on_message(self, key: LinkKey, msg: Message, now: float) -> None:
        room: ReceiverRoom | None = self.rooms.get(msg.room_id)
        if room is None:
            self._count_missing_room(msg.room_id)
            return
        link = next((lk for lk in room.links if lk.key == key), None)
        if link is None or msg.generation != room.generation:
            self.stats.stale_tags += 1
            return
        if isinstance(msg, Abort):
            room.settled.add(link.link_id)  # a prefill rank aborts only with none of its writes in flight
            self.apply(room, Input.PEER_ABORT, now, code=ErrorCode.coerce(msg.code),
                       reason=f"prefill rank {link.prefill_rank} aborted: {msg.reason}", origin=key)
        elif isinstance(msg, TransferDone):
            self._on_done(room, link, msg, now)
        elif isinstance(msg, StagingRequest):
            self._on_staging_request(room, link, msg, now)
        else:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.PEER_PROTOCOL_ERROR,
                       reason=f"{type(msg).__name__} is not a message a decode rank accepts")

    def _on_done(self, room: ReceiverRoom, link: ReceiverLink, msg: TransferDone, now: float) -> None:
        progress = room.writers.get(link.link_id)
        problem = None
        if progress is None:
            problem = f"prefill rank {link.prefill_rank} is not a writer of this rank but sent TRANSFER_DONE"
        elif progress.writes is not None:
            problem = f"second TRANSFER_DONE from prefill rank {link.prefill_rank}"
        elif progress.seqs and max(progress.seqs) >= msg.writes:
            problem = f"prefill rank {link.prefill_rank} reported {msg.writes} writes after write {max(progress.seqs)}"
        elif msg.writes == 0 and room.destination is not None and \
                room.destination.num_tokens > room.destination.prefix_tokens:
            problem = f"prefill rank {link.prefill_rank} reported no writes, but tokens past the prefix must move"
        if problem or progress is None:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.PEER_PROTOCOL_ERROR, reason=problem or "")
            return
        progress.writes = msg.writes
        progress.nbytes = msg.nbytes
        if not progress.complete():
            self._finishing.add(room.room_id)
        self._arrive(room, Input.WRITER_DONE, now)

    def peer_violation(self, key: LinkKey, room_id: int, generation: int, code: ErrorCode, reason: str,
                       now: float) -> None:
        """A frame from ``key`` naming ``room_id`` could not be accepted: fail that room if the
        link belongs to it and the generation matches; otherwise count it."""
        room: ReceiverRoom | None = self.rooms.get(room_id)
        if room is not None and generation == room.generation and any(lk.key == key for lk in room.links):
            self.apply(room, Input.PEER_VIOLATION, now, code=code, reason=reason)
        else:
            self.stats.peer_violations += 1

    # --- data plane ------------------------------------------------------------------------------
    def on_notification(self, agent: str, data: bytes, now: float) -> None:
        """A transport notification from agent ``agent``."""
        try:
            tag = decode_tag(data)
        except MalformedTag:
            self.stats.peer_violations += 1
            return
        link = self.links_by_id.get(tag.link_id)
        if link is None or link.agent != agent:
            self.stats.peer_violations += 1
            return
        room: ReceiverRoom | None = self.rooms.get(tag.room_id)
        if room is None:
            self._count_missing_room(tag.room_id)
            return
        if tag.generation != room.generation or link not in room.links:
            self.stats.stale_tags += 1
            return
        progress = room.writers.get(link.link_id)
        if progress is None or (progress.writes is not None and tag.seq >= progress.writes):
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.PEER_PROTOCOL_ERROR,
                       reason=f"unexpected write {tag.seq} from prefill rank {link.prefill_rank}")
            return
        if tag.kind is TagKind.STAGED:
            self._on_staged(room, link, tag.seq, now)
            return
        progress.seqs.add(tag.seq)
        self._arrive(room, Input.ARRIVAL, now)

    # --- staging -----------------------------------------------------------------------------------
    def _on_staging_request(self, room: ReceiverRoom, link: ReceiverLink, msg: StagingRequest, now: float) -> None:
        if room.failing:
            # Sent before the writer heard our ABORT: granting would only hold ring space (and
            # invite a write) for a room that is draining. Dropped like its queued requests.
            self.stats.late_messages += 1
            return
        progress = room.writers.get(link.link_id)
        dest = room.destination
        problem = None
        if self.ring is None or not link.stage_unit:
            problem = ErrorCode.PEER_PROTOCOL_ERROR, "staging request, but this rank offers no staging to that writer"
        elif progress is None or dest is None:
            problem = ErrorCode.PEER_PROTOCOL_ERROR, f"prefill rank {link.prefill_rank} is not a writer of this room"
        elif progress.writes is not None:
            problem = ErrorCode.PEER_PROTOCOL_ERROR, (
                f"staging request after prefill rank {link.prefill_rank}'s TRANSFER_DONE")
        elif progress.asking is not None or msg.seq in progress.seqs or (link.link_id, msg.seq) in room.staged:
            problem = ErrorCode.PEER_PROTOCOL_ERROR, f"staging request {msg.seq} overlaps an earlier one"
        elif msg.start_token != progress.stage_next or not msg.start_token < msg.end_token <= dest.num_tokens:
            problem = ErrorCode.INDEX_OUT_OF_RANGE, (
                f"staging request for tokens [{msg.start_token}, {msg.end_token}); expected to start at "
                f"{progress.stage_next} and end by {dest.num_tokens}")
        elif not self.ring.fits(link.stage_unit, link.stage_tail):
            problem = ErrorCode.INDEX_OUT_OF_RANGE, (  # the ring would refuse it (ValueError)
                f"a unit of {link.stage_unit} bytes and a state block of {link.stage_tail} exceed the "
                f"{self.ring.capacity}-byte staging ring")
        if problem is not None:
            self.apply(room, Input.PEER_VIOLATION, now, code=problem[0], reason=problem[1])
            return
        assert self.ring is not None and dest is not None
        progress.asking = msg.seq
        self.ring.request((room.room_id, link.link_id, msg.seq), room.room_id, unit=link.stage_unit,
                          units=msg.end_token - msg.start_token,
                          tail=link.stage_tail if msg.end_token == dest.num_tokens else 0)
        self._grant()

    def _grant(self) -> None:
        """Send every grant the ring can make now."""
        assert self.ring is not None
        for grant in self.ring.take_grants():
            room_id, link_id, seq = grant.key  # type: ignore[misc]
            room: ReceiverRoom = self.rooms[room_id]
            progress = room.writers[link_id]
            link = self.links_by_id[link_id]
            start = progress.stage_next
            end = start + grant.units
            progress.stage_next, progress.asking = end, None
            room.staged[(link_id, seq)] = (grant.offset, start, end)
            self.send(link.key, StagingGrant(room_id=room_id, generation=room.generation, seq=seq,
                                             start_token=start, end_token=end, offset=grant.offset))

    def _on_staged(self, room: ReceiverRoom, link: ReceiverLink, seq: int, now: float) -> None:
        key = (link.link_id, seq)
        region = room.staged.get(key)
        if region is None:
            if seq in room.writers[link.link_id].seqs or key in room.scattering:
                return  # a duplicate tag
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.PEER_PROTOCOL_ERROR,
                       reason=f"staged write {seq} from prefill rank {link.prefill_rank} was never granted")
            return
        if key in room.scattering:
            return
        room.scattering.add(key)
        offset, start, end = region
        assert room.destination is not None
        dest = room.destination
        groups = tuple(pages_from_zero(g) for g in dest.groups)
        slots = tuple(g.slot for g in dest.groups) if link.stage_tail and end == dest.num_tokens else ()
        self._outputs.append(Scatter(room_id=room.room_id, link=link.key, seq=seq, offset=offset,
                                     start_token=start, end_token=end, dst_pages=dest.pages,
                                     group_pages=groups, state_slots=slots))

    def scatter_done(self, room_id: int, link_id: int, seq: int, now: float) -> None:
        """The I/O layer finished scattering staged write ``seq`` of ``link_id`` into the pages."""
        room: ReceiverRoom | None = self.rooms.get(room_id)
        if room is None or (link_id, seq) not in room.scattering:
            return  # pragma: no cover - a scatter outlives its room only through a bug in the caller
        room.scattering.discard((link_id, seq))
        del room.staged[(link_id, seq)]
        assert self.ring is not None
        self.ring.release((room_id, link_id, seq))
        link = self.links_by_id.get(link_id)
        if link is not None:
            self.send(link.key, StagingWatermark(room_id=room_id, generation=room.generation, seq=seq,
                                                 watermark=self.ring.watermark))
        room.writers[link_id].seqs.add(seq)
        self._arrive(room, Input.ARRIVAL, now)
        self._grant()

    def expecting_data(self) -> bool:
        """Whether bytes are known to be on their way: a granted staging region not yet written
        or scattered, or a room whose writers announced their writes (TRANSFER_DONE) with tags
        still to arrive. The I/O layer polls promptly while this holds."""
        return bool(self._finishing) or (self.ring is not None and self.ring.used > 0)

    def _arrive(self, room: ReceiverRoom, partial: Input, now: float) -> None:
        """A write arrived or a writer announced its count: ``partial``, or ALL_ARRIVED once every
        writer is complete, unless a writer that staged some of the room's tokens was never granted
        the rest (its count is complete, so they cannot have landed): such a room fails with
        TOKEN_COUNT_MISMATCH instead of succeeding without them."""
        if not (room.writers and all(p.complete() for p in room.writers.values())):
            self.apply(room, partial, now)
            return
        dest = room.destination
        assert dest is not None
        for link_id, progress in room.writers.items():
            if dest.prefix_tokens < progress.stage_next < dest.num_tokens:
                link = self.links_by_id.get(link_id)
                rank = link.prefill_rank if link is not None else "?"
                self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.TOKEN_COUNT_MISMATCH, reason=(
                    f"prefill rank {rank} reported its {progress.writes} writes done but staged tokens "
                    f"[{dest.prefix_tokens}, {progress.stage_next}) only, of [{dest.prefix_tokens}, {dest.num_tokens})"))
                return
        self.apply(room, Input.ALL_ARRIVED, now)

    # --- failing with writes in flight ---------------------------------------------------------------
    def apply(self, room: ReceiverRoom, inp: Input, now: float, **kw) -> None:  # type: ignore[override]
        """Classify failures of a TRANSFERRING room that may still receive writes as DRAIN, and
        every input of a draining room as DRAIN_PROGRESS or DRAINED (see the module docstring)."""
        if room.failing:
            if inp is Input.TIMEOUT:
                # Drain deadline: a writer that never answered can no longer be trusted. A local
                # scatter still running is waited for: it always finishes, and it writes the pages.
                for link_id in self._unsettled(room):
                    link = self.links_by_id.get(link_id)
                    if link is not None:
                        self._outputs.append(DropLink(link=link.key, code=ErrorCode.PEER_GONE,
                                                      reason=f"prefill rank {link.prefill_rank} did not answer an "
                                                             f"ABORT within {self.timeouts.drain}s"))
                room.settled.update(room.writers)
            inp = Input.DRAINED if self._drained(room) else Input.DRAIN_PROGRESS
            kw = {}
        elif room.state is RoomState.TRANSFERRING and inp in _FAILURES:
            if inp is Input.TIMEOUT and (room.staged or any(p.asking is not None for p in room.writers.values())):
                kw.setdefault("code", ErrorCode.STAGING_STALLED)
                kw.setdefault("reason", f"room {room.room_id} timed out waiting on staged writes")
            # Closing drains like any other failure: the cache outlives the endpoint, so a write
            # that lands after close() would corrupt pages the application already reused.
            if not self._drained(room):
                if inp is Input.TIMEOUT:
                    kw.setdefault("code", ErrorCode.TRANSFER_TIMEOUT)
                    kw.setdefault("reason", f"room {room.room_id} timed out while TRANSFERRING")
                elif inp is Input.PEER_VIOLATION:
                    self.stats.peer_violations += 1  # counted by the base only under its own name
                inp = Input.DRAIN
        super().apply(room, inp, now, **kw)

    def fenced(self, now: float) -> None:
        """The endpoint is going away and has closed its transport (its memory deregistered, its
        peers removed) after waiting for the drains: rooms still draining end FAILED now, with
        their codes. Only ``close()`` calls this, and only once nothing can reach the memory."""
        for room in [r for r in self.rooms.values() if r.failing]:
            room.settled.update(room.writers)
            room.scattering.clear()
            self.apply(room, Input.CLOSE, now)

    def draining(self) -> int:
        """Rooms that failed and wait for their writers to settle (see the module docstring)."""
        return sum(1 for room in self.rooms.values() if room.failing)

    @staticmethod
    def _unsettled(room: ReceiverRoom) -> list[int]:
        return [link_id for link_id, p in room.writers.items() if p.writes is None and link_id not in room.settled]

    @staticmethod
    def _drained(room: ReceiverRoom) -> bool:
        """No writer can still write into the room and no scatter is running. A writer whose
        TRANSFER_DONE arrived wrote everything before sending it: it is settled even if some of
        its tags never come."""
        return not room.scattering and all(
            p.writes is not None or link_id in room.settled for link_id, p in room.writers.items())

    # --- effects -----------------------------------------------------------------------------------
    def _effect(self, room: ReceiverRoom, effect: Effect, now: float, origin: LinkKey | None) -> Input | None:
        if effect is Effect.NONE and room.state is RoomState.BOOTSTRAPPING:
            return self._first_hold(room)  # LINKS_READY: entering WAITING_FOR_INPUT, the first hold is due
        if effect is Effect.SEND_HOLD:
            self._send_hold(room, now)
        elif effect is Effect.SEND_REQUESTS:
            self._stop_holds(room.room_id)
            dest = room.destination
            assert dest is not None
            writers = [link for link in room.links if link.writer]
            room.writers = {link.link_id: _Progress(stage_next=dest.prefix_tokens) for link in writers}
            request = TransferRequest(  # one object for every link: the endpoint encodes it once
                room_id=room.room_id, generation=room.generation, num_tokens=dest.num_tokens,
                prefix_tokens=dest.prefix_tokens, aux_slot=NO_SLOT if dest.aux_slot is None else dest.aux_slot,
                expected_writers=len(writers), dst_pages=dest.pages, groups=dest.groups)
            for link in room.links:
                self.send(link.key, request)
        elif effect in (Effect.ABORT_PEERS, Effect.ABORT_AND_DRAIN):
            abort = self._abort_message(room.room_id, room.generation, room.code, room.reason)
            for link in room.links:
                if link.key != origin:
                    self.send(link.key, abort)
            cluster = self.clusters.get(room.cluster)
            if not room.links and cluster is not None and not cluster.ready and cluster.failure is None:
                self._hold_end(cluster, abort)
            if effect is Effect.ABORT_AND_DRAIN:
                room.failing = True
                if self.ring is not None:
                    self.ring.cancel_queued(room.room_id)
        return None

    @staticmethod
    def _hold_end(cluster: _Cluster, abort: Abort) -> None:
        """Keep the ABORT of a room that ended before its cluster's links came up."""
        held = cluster.held_ends
        held.pop(abort.room_id, None)
        held[abort.room_id] = abort
        if len(held) > MAX_HELD_ENDS:
            del held[next(iter(held))]

    def held_ends(self, cluster: ClusterKey) -> int:
        """How many ended rooms' ABORTs wait for ``cluster``'s links."""
        state = self.clusters.get(cluster)
        return len(state.held_ends) if state is not None else 0

    def _tombstone(self, room: ReceiverRoom) -> Tombstone:
        return Tombstone(room.state, room.code, frozenset({room.generation}))

    def _other_timer(self, key: Hashable, now: float) -> None:
        self._holds_timer(key, now)

    def _moved(self, room: ReceiverRoom) -> int:
        return sum(p.nbytes for p in room.writers.values())

    def _forget(self, room: ReceiverRoom) -> None:
        self._finishing.discard(room.room_id)
        self._stop_holds(room.room_id)
        if self.ring is not None:
            self.ring.cancel_owner(room.room_id)  # safe: the room ended drained (or never wrote)
            if self.rooms:
                self._grant()
        room.writers.clear()
        room.staged.clear()
        links, room.links = room.links, ()
        cluster = self.clusters.get(room.cluster)
        retired = [link for link in links if cluster is None or link not in cluster.links]
        if retired:
            self._release_links(retired)
