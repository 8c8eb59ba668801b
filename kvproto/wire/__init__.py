"""Wire format of kvproto spec v1: frames, messages, notification tags, error codes."""

from kvproto.wire.codec import HEADER_SIZE, MAJOR, MAX_FRAME, MINOR, Header, decode_header, peek_header
from kvproto.wire.errors import (
    ErrorCode,
    FrameTooLarge,
    LocalProtocolError,
    MalformedFrame,
    ProtocolError,
    RemoteProtocolError,
    UnsupportedVersion,
)
from kvproto.wire.messages import (
    MESSAGE_TYPES,
    NAMED_WINDOW,
    NO_SLOT,
    Abort,
    BootstrapInfo,
    BootstrapQuery,
    CacheGroups,
    GroupDestination,
    GroupKind,
    NO_SHARD,
    WireGroup,
    WireStateTensor,
    WireGroupLayout,
    WireTensorLayout,
    Heartbeat,
    Message,
    MsgType,
    RankAddress,
    RankAnnounce,
    RegionKind,
    Register,
    RegisterAccept,
    RegisterReject,
    RoomHold,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    TransferDone,
    TransferRequest,
    WireGeometry,
    WireRegion,
    UnknownMessage,
    decode,
    decode_frame,
    encode,
)
from kvproto.wire.tags import TAG_SIZE, MalformedTag, Tag, TagKind, decode_tag

__all__ = [name for name in dir() if not name.startswith("_")]
