"""NIXL notification tags: the binary grammar that names which write of which room landed.

Theory of operation
-------------------
A tag is exactly 24 bytes, little-endian, whatever the agent names hold (the tag never
contains a name; the receiver learns the sender's agent from the transport and checks it
against the link the tag names)::

    offset size field
    0      2    magic      b"KT"
    2      1    version    1
    3      1    kind       TagKind
    4      8    room_id    u64
    12     4    generation u32, the receiver's incarnation of the room
    16     4    link_id    u32, the receiver-assigned id of the writer's link
    20     4    seq        u32, the writer's write number within the room, from 0

Fixed length and a magic make the grammar unambiguous; anything else is a ``MalformedTag``.
A receiver counts a writer complete when ``TRANSFER_DONE.writes`` tags with distinct ``seq``
in ``[0, writes)`` have arrived for the room's current generation. Duplicates are idempotent;
a tag of another generation is stale and dropped.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvproto.wire.errors import MalformedFrame

TAG = struct.Struct("<2sBBQIII")
TAG_SIZE = TAG.size  # 24
TAG_MAGIC = b"KT"
TAG_VERSION = 1


class TagKind(enum.IntEnum):
    """What the tagged write carried. Values are wire numbers: never renumber."""

    KV = 1
    """KV bytes (and, for the aux owner, the aux slot) written straight into decode memory."""
    STAGED = 2
    """Bytes written into a granted staging region; the receiver scatters them."""


class MalformedTag(MalformedFrame):
    """A notification that is not a kvproto tag."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tag:
    kind: TagKind
    room_id: int
    generation: int
    link_id: int
    seq: int

    def encode(self) -> bytes:
        try:
            kind = TagKind(self.kind)
        except ValueError:
            raise ValueError(f"unknown tag kind {self.kind!r}") from None
        try:
            return TAG.pack(TAG_MAGIC, TAG_VERSION, kind, self.room_id, self.generation, self.link_id, self.seq)
        except struct.error as exc:
            raise ValueError(f"tag field out of range: {exc}") from None


def decode_tag(data: bytes) -> Tag:
    if len(data) != TAG_SIZE:
        raise MalformedTag(f"tag of {len(data)} bytes, expected {TAG_SIZE}")
    magic, version, kind, room_id, generation, link_id, seq = TAG.unpack(data)
    if magic != TAG_MAGIC:
        raise MalformedTag(f"bad tag magic {magic!r}")
    if version != TAG_VERSION:
        raise MalformedTag(f"unsupported tag version {version}")
    try:
        tag_kind = TagKind(kind)
    except ValueError:
        raise MalformedTag(f"unknown tag kind {kind}") from None
    return Tag(kind=tag_kind, room_id=room_id, generation=generation, link_id=link_id, seq=seq)
