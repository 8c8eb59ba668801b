"""What a prefill rank's core keeps of its links and rooms: the records ``SenderCore`` works on.

Theory of operation
-------------------
A ``SenderLink`` is a registered decode rank as the I/O layer computed it from the two
geometries (frozen: a new registration is a new link). A ``SenderRoom`` holds a room's chunks as
the application gave them and, per decode rank that requested it, a ``_Peer``: the request, the
writes posted, done and in flight, and the staging state of a staged link. A failed room's link
whose writes are still in flight is a ``_Drain`` until they end. Only ``SenderCore``
(``kvproto.core.sender``) and its mixins change these records, and only the state table
(``kvproto.core.state``) changes a room's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvproto.core.base import RoomBase
from kvproto.core.cost import PathCost
from kvproto.core.events import LinkKey
from kvproto.core.groups import LinkGroup
from kvproto.wire import ErrorCode, TransferRequest

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
