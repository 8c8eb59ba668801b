"""What the sans-IO core asks its I/O layer to do, and the core's configuration.

The core appends outputs to a list; the I/O layer pops and performs them in order. Outputs
never block and never fail the core: a ``Send`` to a vanished peer is dropped by the I/O layer.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvproto.core.state import RoomState
from kvproto.wire import ErrorCode, Message

LinkKey = Hashable
"""The I/O layer's name for a control link (a ZMQ routing id, a socket...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Per-state deadlines in seconds (``None``: wait forever)."""

    bootstrap: float | None = 30.0
    """A room must leave BOOTSTRAPPING within this. On a prefill rank this is the room's *lease*:
    a decode rank of protocol 1.4 that still wants the room extends it with ROOM_HOLDs (see
    ``hold``, ``max_hold``); a room that no decode holds fails at it (counted in
    ``CoreStats.rooms_expired``)."""
    waiting: float | None = 300.0
    """A room may wait this long for the application's input."""
    transfer: float | None = 300.0
    """A TRANSFERRING room fails after this long without progress."""
    parked: float = 30.0
    """A transfer request for a room not yet opened is kept this long."""
    drain: float = 10.0
    """A failing decode room waits this long for its writers to settle before reporting FAILED."""
    hold: float | None = 10.0
    """Decode: the hold each ROOM_HOLD asks for. A decode room waiting for its destination
    (WAITING_FOR_INPUT) sends one to each of its prefill ranks of protocol 1.4 or later as it enters
    that state and every ``hold / 3`` after, so that the prefill's room outlives a lost hold (two in
    a row leave it to the third, sent as the first runs out). None: no holds (the prefill's
    ``bootstrap`` alone bounds the wait)."""
    max_hold: float = 30.0
    """Prefill: the longest one ROOM_HOLD extends a BOOTSTRAPPING room (a longer hold is cut to
    this, so that a decode that vanishes after a hold pins the room no longer than the lease would);
    it should exceed the hold interval of the decode ranks it serves. 0: holds are ignored."""


@dataclass(frozen=True, slots=True)
class Send:
    link: LinkKey
    message: Message


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteOutput:
    """What every sender output that posts a write names: the room, the link it goes to, the
    write's number on that link (``seq``) and the tag that travels with it."""

    room_id: int
    link: LinkKey
    seq: int
    tag: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class PostWrite(WriteOutput):
    """Sender: write tokens ``[start_token, end_token)`` of the room to one decode rank.

    ``src_pages`` are the prefill pages of the room from token 0; ``dst_pages`` the decode
    pages from token 0. The I/O layer plans extents for the link's geometry and posts them as
    one write tagged ``tag``; it reports back with ``write_done`` / ``write_failed``. A cache of
    several groups writes through ``PostGroups`` instead.
    """

    start_token: int
    end_token: int
    src_pages: Sequence[int]
    dst_pages: Sequence[int]
    layers: tuple[int, int] | None = None
    """``(first, end)``: only these layers (all when None)."""
    ready: tuple[object, ...] = ()
    """The application's readiness handles (CUDA events) the write must wait for (opaque here)."""


class PagedPart(NamedTuple):
    """Tokens ``[start_token, end_token)`` of paged group ``group`` (0: the first), of its own
    ``layers`` (``(first, end)``) or all of them (None); pages from the prompt's token 0 on both
    sides.

    The parts of a write are tuples (immutable, as the other outputs): a hybrid write makes
    several per chunk and link, and a tuple costs a third of a frozen dataclass to build. A
    part's last two fields are what one write of its shape names and the next one changes (its
    pages, a state part's slots); the fields before them are its *shape* (``part[:-2]``), which
    the I/O layer plans a write by once (``kvproto.aio.paths.GroupWrites``)."""

    group: int
    start_token: int
    end_token: int
    layers: tuple[int, int] | None
    src_pages: Sequence[int]
    dst_pages: Sequence[int]


class StatePart(NamedTuple):
    """Slot ``src_slot`` of state group ``group`` (of its own ``layers``, or all of them: None)
    into the decode rank's slot ``dst_slot``."""

    group: int
    layers: tuple[int, int] | None
    src_slot: int
    dst_slot: int


Part = PagedPart | StatePart

new_part = tuple.__new__
"""``new_part(PagedPart, (group, start, end, layers, src, dst))``: a part built without the named
tuple's ``__new__`` (a Python-level call, where this is one C call): a hybrid write builds
several per chunk and link."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PostGroups(WriteOutput):
    """Sender, caches of several groups: one write to one decode rank carrying ``parts`` of any
    groups (a chunk's tokens of every paged group the link writes, and with the last token
    range every state slot), posted as one transport write under one tag: the tag arrives only
    once every part has landed. One write per chunk and link, as a one-group cache makes."""

    parts: tuple[Part, ...]
    ready: tuple[object, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PostAux(WriteOutput):
    """Sender: write aux slot ``src_slot`` into the decode rank's aux slot ``dst_slot``."""

    src_slot: int
    dst_slot: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PostStaged(WriteOutput):
    """Sender: gather tokens ``[start_token, end_token)`` of the pair's head slice into local
    staging and write them to the decode rank's staging region at ``remote_offset``."""

    start_token: int
    end_token: int
    src_pages: Sequence[int]
    remote_offset: int
    ready: tuple[object, ...] = ()
    """The readiness handles of every chunk the piece reads from (see ``PostWrite.ready``)."""
    group_pages: tuple[Sequence[int], ...] = ()
    """The room's pages of each group beyond the first (those the link stages ride in the piece)."""
    states: tuple[StatePart, ...] = ()
    """State slots gathered into the piece's state block (the piece that ends the request's tokens,
    on a link whose pieces end with one: ``SenderLink.stage_tail``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scatter:
    """Receiver: a staged piece landed at ``offset``; scatter tokens ``[start_token, end_token)``
    of the writer's head slice into ``dst_pages``, then report ``scatter_done``."""

    room_id: int
    link: LinkKey
    seq: int
    offset: int
    start_token: int
    end_token: int
    dst_pages: Sequence[int]
    group_pages: tuple[Sequence[int], ...] = ()
    """The destination pages of each group beyond the first, from the prompt's page 0 (pages before
    a window's first are 0 and never read): the groups the link stages are scattered from the piece."""
    state_slots: tuple[int, ...] = ()
    """The piece ends with the state block (``ReceiverLink.stage_tail``): this rank's slot of each
    group beyond the first (NO_SLOT for a paged group), where the block's runs are scattered.
    Empty: no state block."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DropLink:
    """Receiver: stop trusting this link (it left an ABORT unanswered past the drain deadline)."""

    link: LinkKey
    code: ErrorCode
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomEnded:
    """The room reached SUCCESS or FAILED; the core has forgotten it."""

    room_id: int
    state: RoomState
    code: ErrorCode | int | None = None
    reason: str = ""
    timeline: tuple[tuple[RoomState, float], ...] = field(default=(), compare=False)
    """(state, time) of every state the room entered, in order; the last is its end."""
    nbytes: int = field(default=0, compare=False)
    """KV bytes the room moved, as this side counted them (writes DONE on prefill, TRANSFER_DONE
    reports on decode)."""


Output = Send | PostWrite | PostGroups | PostAux | PostStaged | Scatter | DropLink | RoomEnded


@dataclass(slots=True)
class CoreStats:
    """Counters an operator reads to see what the core absorbed."""

    rooms_succeeded: int = 0
    rooms_failed: int = 0
    late_messages: int = 0
    """Messages or tags for rooms that already ended (house rule 4): dropped."""
    stale_tags: int = 0
    """Tags naming another generation of a live room: dropped."""
    unknown_room_messages: int = 0
    """Messages for rooms never seen: dropped (or answered with UNKNOWN_ROOM)."""
    peer_violations: int = 0
    rooms_expired: int = 0
    """Prefill: rooms that failed at their BOOTSTRAPPING deadline (the lease): no decode rank sent
    the room's requests in time, nor held it (also counted in ``rooms_failed``)."""
    refused_messages: int = 0
    """Prefill: room messages from links whose registration this rank refused, dropped (their room
    ABORTs that fail a room with no request yet are not counted here)."""
