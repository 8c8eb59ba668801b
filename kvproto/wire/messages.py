"""Control-plane messages of spec v1 and their field grammar.

Each message is a frozen, slotted, keyword-only dataclass. ``room_id`` and ``generation`` travel
in the frame header; every other field is in ``FIELDS`` order in the body (see ``codec``).
``MsgType`` values are wire numbers: never renumbered or reused (house rule 5).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from kvproto.wire.codec import Body, Header, MAJOR, MINOR, compile_bodies, decode_body, decode_header, encode_frame
from kvproto.wire.errors import MalformedFrame

NO_SLOT = 0xFFFFFFFF
"""``aux_slot`` value meaning "no aux region for this room"."""

NAMED_WINDOW = 0xFFFFFFFF
"""(minor 5) A PAGED ``WireGroup``'s ``window`` meaning "the engine names the window, room by
room": the prefill's engine gives the group's last pages with the last chunk, the decode names the
pages it needs from some ``first_page`` to the prompt's end (transfer.md, engine-named windows)."""


class MsgType(enum.IntEnum):
    BOOTSTRAP_QUERY = 1
    BOOTSTRAP_INFO = 2
    RANK_ANNOUNCE = 3
    REGISTER = 4
    REGISTER_ACCEPT = 5
    REGISTER_REJECT = 6
    TRANSFER_REQUEST = 7
    TRANSFER_DONE = 8
    ABORT = 9
    HEARTBEAT = 10
    # minor 1: staging
    STAGING_REQUEST = 11
    STAGING_GRANT = 12
    STAGING_WATERMARK = 13
    # minor 2: caches of several groups
    CACHE_GROUPS = 14
    # minor 4: room holds
    ROOM_HOLD = 15


class RegionKind(enum.IntEnum):
    KV = 0
    AUX = 1
    STAGING = 2
    GROUP = 3
    """(minor 2) a region of a group beyond the first: ``index`` = group << 24 | region."""


class GroupKind(enum.IntEnum):
    PAGED = 0
    STATE = 1


NO_SHARD = 0xFF
"""``WireStateTensor.shard_dim`` value meaning "replicated on every TP rank"."""


# --- records nested in messages -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WireGeometry(Body):
    """One rank's KV cache shape (see ``kvproto.geometry.KVGeometry``)."""

    tp_size: int
    tp_rank: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: int
    block_size: int
    layout: int
    mla: int
    num_blocks: int

    FIELDS: ClassVar = (
        ("tp_size", "u16"),
        ("tp_rank", "u16"),
        ("num_layers", "u32"),
        ("num_kv_heads", "u32"),
        ("head_dim", "u32"),
        ("dtype", "u8"),
        ("block_size", "u32"),
        ("layout", "u8"),
        ("mla", "u8"),
        ("num_blocks", "u32"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WireRegion(Body):
    """One registered memory region: a KV plane of one layer, the aux buffer, or staging."""

    kind: int
    index: int
    address: int
    length: int
    device_id: int
    mem_kind: int

    FIELDS: ClassVar = (
        ("kind", "u8"),
        ("index", "u32"),
        ("address", "u64"),
        ("length", "u64"),
        ("device_id", "u32"),
        ("mem_kind", "u8"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RankAddress(Body):
    tp_rank: int
    endpoint: str
    boot_id: int

    FIELDS: ClassVar = (("tp_rank", "u16"), ("endpoint", "str"), ("boot_id", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class WireStateTensor(Body):
    """(minor 2) One per-layer, per-request state tensor of a state group: its global shape."""

    shape: tuple[int, ...]
    dtype: int
    shard_dim: int

    FIELDS: ClassVar = (("shape", "u32[]"), ("dtype", "u8"), ("shard_dim", "u8"))


@dataclass(frozen=True, slots=True, kw_only=True)
class WireGroup(Body):
    """(minor 2) One cache group beyond the first (see ``kvproto.geometry.groups``). A PAGED group
    has ``geometry`` and ``window`` (0: every token; ``NAMED_WINDOW``: named by the engine, room by
    room); a STATE group ``num_layers``, ``num_slots``
    and ``tensors``. The fields of the other kind are zero or empty."""

    name: str
    kind: int
    geometry: WireGeometry
    window: int
    num_layers: int
    num_slots: int
    tensors: tuple[WireStateTensor, ...]

    FIELDS: ClassVar = (
        ("name", "str"),
        ("kind", "u8"),
        ("geometry", WireGeometry),
        ("window", "u32"),
        ("num_layers", "u32"),
        ("num_slots", "u32"),
        ("tensors", [WireStateTensor]),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WireTensorLayout(Body):
    """(minor 4) How one state tensor of a group lies on the sender's rank: the global ``sections``
    of its sharded dimension (empty: one section) and the bytes from one slot's start to the next's
    in its regions (0: the tensor's local bytes, slots back to back)."""

    sections: tuple[int, ...]
    slot_stride: int

    FIELDS: ClassVar = (("sections", "u32[]"), ("slot_stride", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class WireGroupLayout(Body):
    """(minor 4) The layout of one group beyond the first, in ``CacheGroups.layouts``: a STATE
    group's tensors, one per tensor in order; a PAGED group's: empty."""

    tensors: tuple[WireTensorLayout, ...]

    FIELDS: ClassVar = (("tensors", [WireTensorLayout]),)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupDestination(Body):
    """(minor 2) Where one group beyond the first goes on the decode rank: a PAGED group's pages,
    ``pages[i]`` holding the prompt's page ``first_page + i``, or a STATE group's ``slot``."""

    first_page: int
    pages: tuple[int, ...]
    slot: int

    FIELDS: ClassVar = (("first_page", "u32"), ("pages", "u32[]"), ("slot", "u32"))


# --- messages ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Message(Body):
    MSG_TYPE: ClassVar[MsgType]
    room_id: int = 0
    generation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapQuery(Message):
    """decode → bootstrap: which prefill ranks exist and where."""

    MSG_TYPE: ClassVar = MsgType.BOOTSTRAP_QUERY
    requester: str
    FIELDS: ClassVar = (("requester", "str"),)


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapInfo(Message):
    """bootstrap → decode: the prefill ranks announced so far (complete when len == tp_size)."""

    MSG_TYPE: ClassVar = MsgType.BOOTSTRAP_INFO
    tp_size: int
    ranks: tuple[RankAddress, ...]
    FIELDS: ClassVar = (("tp_size", "u16"), ("ranks", [RankAddress]))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankAnnounce(Message):
    """prefill rank → bootstrap: this rank serves ``endpoint``."""

    MSG_TYPE: ClassVar = MsgType.RANK_ANNOUNCE
    tp_rank: int
    tp_size: int
    endpoint: str
    boot_id: int
    FIELDS: ClassVar = (("tp_rank", "u16"), ("tp_size", "u16"), ("endpoint", "str"), ("boot_id", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Register(Message):
    """decode rank → prefill rank: geometry, memory and data-plane identity of the decode rank."""

    MSG_TYPE: ClassVar = MsgType.REGISTER
    boot_id: int
    instance: str
    link_id: int
    agent_name: str
    model_id: str
    compat_key: str
    geometry: WireGeometry
    aux_slots: int
    aux_slot_bytes: int
    transport: str
    transport_metadata: bytes
    regions: tuple[WireRegion, ...]
    FIELDS: ClassVar = (
        ("boot_id", "u64"),
        ("instance", "str"),
        ("link_id", "u32"),
        ("agent_name", "str"),
        ("model_id", "str"),
        ("compat_key", "str"),
        ("geometry", WireGeometry),
        ("aux_slots", "u32"),
        ("aux_slot_bytes", "u32"),
        ("transport", "str"),
        ("transport_metadata", "bytes"),
        ("regions", [WireRegion]),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterAccept(Message):
    """prefill rank → decode rank: registration accepted; the prefill rank's own geometry."""

    MSG_TYPE: ClassVar = MsgType.REGISTER_ACCEPT
    boot_id: int
    link_id: int
    agent_name: str
    geometry: WireGeometry
    aux_slot_bytes: int
    FIELDS: ClassVar = (
        ("boot_id", "u64"),
        ("link_id", "u32"),
        ("agent_name", "str"),
        ("geometry", WireGeometry),
        ("aux_slot_bytes", "u32"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterReject(Message):
    """prefill rank → decode rank: registration refused, with a code and a reason."""

    MSG_TYPE: ClassVar = MsgType.REGISTER_REJECT
    link_id: int
    code: int
    reason: str
    FIELDS: ClassVar = (("link_id", "u32"), ("code", "u16"), ("reason", "str"))


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferRequest(Message):
    """decode rank → prefill rank: where this room's KV goes on the decode rank."""

    MSG_TYPE: ClassVar = MsgType.TRANSFER_REQUEST
    num_tokens: int
    prefix_tokens: int
    aux_slot: int
    expected_writers: int
    dst_pages: tuple[int, ...] = field(default=())
    groups: tuple[GroupDestination, ...] = field(default=())
    """(minor 2) one destination per group beyond the first, in group order; optional."""
    FIELDS: ClassVar = (
        ("num_tokens", "u32"),
        ("prefix_tokens", "u32"),
        ("aux_slot", "u32"),
        ("expected_writers", "u16"),
        ("dst_pages", "u32[]"),
        ("groups", [GroupDestination]),
    )
    OPTIONAL_FROM: ClassVar = 5
    REPEATED: ClassVar = True  # every TP rank of the decode engine sends the same body


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferDone(Message):
    """prefill rank → decode rank: every write of this room to you is complete."""

    MSG_TYPE: ClassVar = MsgType.TRANSFER_DONE
    writes: int
    nbytes: int
    FIELDS: ClassVar = (("writes", "u32"), ("nbytes", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Message):
    """either side: the room (or, with room_id 0, the link) failed with ``code``."""

    MSG_TYPE: ClassVar = MsgType.ABORT
    code: int
    reason: str
    FIELDS: ClassVar = (("code", "u16"), ("reason", "str"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """either side: I am alive; ``boot_id`` changes when a peer restarts."""

    MSG_TYPE: ClassVar = MsgType.HEARTBEAT
    boot_id: int
    seq: int
    FIELDS: ClassVar = (("boot_id", "u64"), ("seq", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingRequest(Message):
    """prefill rank → decode rank (minor 1): stage tokens ``[start_token, end_token)`` of my head
    slice as my write ``seq``; grant me room in your staging ring."""

    MSG_TYPE: ClassVar = MsgType.STAGING_REQUEST
    seq: int
    start_token: int
    end_token: int
    FIELDS: ClassVar = (("seq", "u32"), ("start_token", "u32"), ("end_token", "u32"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingGrant(Message):
    """decode rank → prefill rank (minor 1): write tokens ``[start_token, end_token)`` (a prefix of
    the request's range) as write ``seq`` at byte ``offset`` of my staging region."""

    MSG_TYPE: ClassVar = MsgType.STAGING_GRANT
    seq: int
    start_token: int
    end_token: int
    offset: int
    FIELDS: ClassVar = (("seq", "u32"), ("start_token", "u32"), ("end_token", "u32"), ("offset", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingWatermark(Message):
    """decode rank → prefill rank (minor 1): your staged write ``seq`` is scattered into my pages
    and its region released; my ring's watermark is now ``watermark`` (a byte position)."""

    MSG_TYPE: ClassVar = MsgType.STAGING_WATERMARK
    seq: int
    watermark: int
    FIELDS: ClassVar = (("seq", "u32"), ("watermark", "u64"))


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheGroups(Message):
    """(minor 2) either side, just before its REGISTER / REGISTER_ACCEPT of link ``link_id``: the
    groups of its cache beyond the first (sent only when there are some)."""

    MSG_TYPE: ClassVar = MsgType.CACHE_GROUPS
    link_id: int
    groups: tuple[WireGroup, ...]
    layouts: tuple[WireGroupLayout, ...] = field(default=())
    """(minor 4) one per group of ``groups``, in order, where some state tensor has sections or
    strided slots; absent (or empty): every group's tensors are one section with slots back to back."""
    FIELDS: ClassVar = (("link_id", "u32"), ("groups", [WireGroup]), ("layouts", [WireGroupLayout]))
    OPTIONAL_FROM: ClassVar = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomHold(Message):
    """(minor 4) decode rank → prefill rank: this decode instance still wants room ``room_id``
    (its rank waits for the application's destination); keep the room open ``hold_ms`` more
    milliseconds, as far as the prefill rank's own maximum allows."""

    MSG_TYPE: ClassVar = MsgType.ROOM_HOLD
    hold_ms: int
    FIELDS: ClassVar = (("hold_ms", "u32"),)


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.MSG_TYPE: cls
    for cls in (
        BootstrapQuery,
        BootstrapInfo,
        RankAnnounce,
        Register,
        RegisterAccept,
        RegisterReject,
        TransferRequest,
        TransferDone,
        Abort,
        Heartbeat,
        StagingRequest,
        StagingGrant,
        StagingWatermark,
        CacheGroups,
        RoomHold,
    )
}


def compile_messages() -> None:
    """Compile every message type's encoder and decoder now (``codec.compile_bodies``)."""
    compile_bodies(MESSAGE_TYPES.values())


def encode(msg: Message, *, minor: int = MINOR) -> bytes:
    return encode_frame(
        Header(msg.MSG_TYPE, msg.room_id, msg.generation, 0, MAJOR, minor), msg
    )


class UnknownMessage(MalformedFrame):
    """A message type this build does not know. From a newer minor version it is ignorable."""

    def __init__(self, message: str, header: Header) -> None:
        super().__init__(message)
        self.header = header


def decode_frame(frame: bytes | memoryview) -> tuple[Header, Message]:
    """Decode one frame into its header and message, or raise a ``RemoteProtocolError``."""
    header, body = decode_header(frame)
    cls = MESSAGE_TYPES.get(header.msg_type)
    if cls is None:
        raise UnknownMessage(f"unknown message type {header.msg_type} (minor {header.minor})", header)
    msg: Message = decode_body(cls, body, room_id=header.room_id, generation=header.generation)
    return header, msg


def decode(frame: bytes | memoryview) -> Message:
    """Decode one frame, or raise a ``RemoteProtocolError`` subclass."""
    return decode_frame(frame)[1]
