"""Write the golden vectors of kvproto spec v1 that do not exist yet.

Usage::

    python spec/v1/vectors/generate.py          # write missing vectors, append them to index.json
    python spec/v1/vectors/generate.py --check  # write nothing; report missing or differing vectors

Released vectors are never edited (house rule 5): a ``.hex`` file or an ``index.json`` entry
that already exists is only *compared* with what this script would produce, and a difference
is reported (exit status 1), never written. To change the wire format, add a new vector with a
new file name; to add a vector, append a ``Vector`` to ``VECTORS`` below and run the script.

File format (see ``README.md`` in this folder): lowercase hex, 64 hex digits (32 bytes) per
line, a final newline; a reader removes all whitespace and decodes the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvproto.transport.base import pack_tags
from kvproto.wire import (
    NO_SHARD,
    NAMED_WINDOW,
    NO_SLOT,
    CacheGroups,
    GroupDestination,
    GroupKind,
    RegionKind,
    WireGroup,
    WireGroupLayout,
    WireStateTensor,
    WireTensorLayout,
    Abort,
    BootstrapInfo,
    BootstrapQuery,
    ErrorCode,
    Heartbeat,
    Message,
    MsgType,
    RankAddress,
    RankAnnounce,
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
    encode,
)
from kvproto.wire.codec import Body
from kvproto.wire.tags import Tag, TagKind

HERE = Path(__file__).resolve().parent
INDEX = HERE / "index.json"
WRAP = 64

# --- vector definitions -----------------------------------------------------------------------


@dataclass(frozen=True)
class Vector:
    """One golden vector: a file name, its bytes, and its ``index.json`` entry."""

    file: str
    data: bytes
    entry: dict[str, Any] = field(default_factory=dict)


def body_json(body: Body) -> dict[str, Any]:
    """A body's fields as JSON: records as objects, arrays as lists, bytes as hex strings."""
    out: dict[str, Any] = {}
    for name, kind in body.sent_fields():  # optional additions left at their defaults are not sent
        out[name] = _value_json(kind, getattr(body, name))
    return out


def _value_json(kind: Any, value: Any) -> Any:
    if kind == "bytes":
        return bytes(value).hex()
    if kind == "u32[]":
        return [int(v) for v in value]
    if isinstance(kind, str):
        return int(value) if kind != "str" else value
    if isinstance(kind, list):
        return [body_json(item) for item in value]
    return body_json(value)


def v10(msg: Message) -> bytes:
    """``msg`` as a version 1.0 frame (minor 0). The vectors released with 1.0 were built from
    such frames; ``encode``'s default minor followed the build (1 since version 1.1), so every
    frame below names its minor explicitly."""
    return encode(msg, minor=0)


def frame(file: str, msg: Message, note: str, *, minor: int = 0) -> Vector:
    return Vector(file, encode(msg, minor=minor), {
        "file": file,
        "kind": "frame",
        "check": "both",
        "message": msg.MSG_TYPE.name,
        "msg_type": int(msg.MSG_TYPE),
        "header": {"room_id": msg.room_id, "generation": msg.generation, "minor": minor, "flags": 0},
        "body": body_json(msg),
        "note": note,
    })


def decode_only(file: str, data: bytes, msg: Message, note: str, *, twin: str | None = None,
                minor: int = 0, flags: int = 0) -> Vector:
    entry = frame(file, msg, note, minor=minor).entry
    entry["check"] = "decode"
    entry["header"]["flags"] = flags
    if twin is not None:
        entry["twin"] = twin
    return Vector(file, data, entry)


def reject(file: str, data: bytes, error: str, code: ErrorCode, note: str) -> Vector:
    return Vector(file, data, {
        "file": file, "kind": "frame", "check": "reject", "error": error, "code": code.name, "note": note,
    })


def refuse(file: str, msg: Message, frames: list[str], answer: MsgType, code: ErrorCode, rule: str, note: str,
           *, minor: int) -> Vector:
    """A wire-valid frame that a check of messages.md refuses: a prefill rank that received ``frames``
    on one link (this one among them) answers the last with ``answer`` carrying ``code``."""
    entry = frame(file, msg, note, minor=minor).entry
    entry["check"] = "refuse"
    entry["frames"] = frames
    entry["answer"] = answer.name
    entry["code"] = code.name
    entry["rule"] = rule
    entry["note"] = entry.pop("note")  # the note last, as in every entry
    return Vector(file, encode(msg, minor=minor), entry)


def tag(file: str, t: Tag, note: str) -> Vector:
    return Vector(file, t.encode(), {
        "file": file,
        "kind": "tag",
        "check": "both",
        "tag": {"kind": t.kind.name, "room_id": t.room_id, "generation": t.generation,
                "link_id": t.link_id, "seq": t.seq},
        "note": note,
    })


def tag_reject(file: str, data: bytes, note: str) -> Vector:
    return Vector(file, data, {"file": file, "kind": "tag", "check": "reject", "error": "MalformedTag",
                               "code": ErrorCode.MALFORMED_FRAME.name, "note": note})


def tag_list(file: str, tags: list[Tag], note: str) -> Vector:
    """A notification list (tags.md, minor 6): the tags of several writes that travel as one."""
    return Vector(file, pack_tags([t.encode() for t in tags]), {
        "file": file,
        "kind": "list",
        "check": "both",
        "tags": [{"kind": t.kind.name, "room_id": t.room_id, "generation": t.generation, "link_id": t.link_id,
                  "seq": t.seq} for t in tags],
        "note": note,
    })


def list_reject(file: str, data: bytes, note: str) -> Vector:
    """Bytes that begin as a notification list but are not one: handed on whole, a malformed tag."""
    return Vector(file, data, {"file": file, "kind": "list", "check": "reject", "error": "MalformedTag",
                               "code": ErrorCode.MALFORMED_FRAME.name, "note": note})


def with_trailing(data: bytes, extra: bytes, *, minor: int | None = None) -> bytes:
    """``data`` with ``extra`` appended to the body and ``body_len`` (and ``minor``) patched."""
    out = bytearray(data + extra)
    struct.pack_into("<I", out, 20, len(out) - 24)
    if minor is not None:
        out[3] = minor
    return bytes(out)


def newer_minor(minor: int, extra: str, msg_type: int) -> list[Vector]:
    """The pair every minor version adds: a STAGING_GRANT of that minor carrying ``extra`` (hex),
    bytes of fields an older decoder does not know and ignores, and message type ``msg_type`` at
    that minor, which decoders refuse and a receiver of an older minor ignores."""
    trailing = bytes.fromhex(extra)
    return [
        decode_only(f"staging_grant_minor{minor}_trailing.hex",
                    with_trailing(encode(STAGING_GRANT, minor=minor), trailing, minor=minor), STAGING_GRANT,
                    f"minor {minor}: a STAGING_GRANT with {len(trailing)} bytes of fields this decoder does not know: "
                    f"they are ignored", twin="staging_grant.hex", minor=minor),
        reject(f"reject_unknown_type_minor{minor}.hex", patched(encode(HEARTBEAT, minor=minor), 4, "<B", msg_type),
               "UnknownMessage", ErrorCode.MALFORMED_FRAME,
               f"message type {msg_type} at minor {minor}: decoders raise UnknownMessage; a receiver of minor "
               f"{minor - 1} or lower ignores it (newer minor)"),
    ]


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1

GEOMETRY_GQA = WireGeometry(
    tp_size=2, tp_rank=1, num_layers=2, num_kv_heads=8, head_dim=128, dtype=2, block_size=16,
    layout=0, mla=0, num_blocks=1024,
)
GEOMETRY_PREFILL = WireGeometry(
    tp_size=4, tp_rank=2, num_layers=2, num_kv_heads=8, head_dim=128, dtype=2, block_size=64,
    layout=1, mla=0, num_blocks=512,
)
GEOMETRY_MLA = WireGeometry(
    tp_size=4, tp_rank=3, num_layers=3, num_kv_heads=1, head_dim=576, dtype=2, block_size=64,
    layout=0, mla=1, num_blocks=2048,
)
REGION_BYTES_GQA = 1024 * 16 * 4 * 128 * 2  # num_blocks * block_size * local_heads * head_dim * 2 B
REGION_BYTES_MLA = 2048 * 64 * 1 * 576 * 2

REGISTER = Register(
    boot_id=0x0123456789ABCDEF,
    instance="decode-a1b2c3",
    link_id=7,
    agent_name="kvproto-decode-1-5f0e3c2a9b7d",
    model_id="meta-llama/Llama-3.1-8B-Instruct",
    compat_key="kv-bf16:v2",
    geometry=GEOMETRY_GQA,
    aux_slots=64,
    aux_slot_bytes=256,
    transport="nixl",
    transport_metadata=bytes.fromhex("00014e49584c2d4d44ff"),
    regions=tuple(
        WireRegion(kind=0, index=i, address=0x7F3A00000000 + i * REGION_BYTES_GQA, length=REGION_BYTES_GQA,
                   device_id=1, mem_kind=1)
        for i in range(4)
    ) + (WireRegion(kind=1, index=0, address=0x55D0C0000000, length=64 * 256, device_id=0, mem_kind=0),),
)
REGISTER_MLA = Register(
    boot_id=1,
    instance="decode-mla",
    link_id=1,
    agent_name="kvproto-decode-3-000000000000",
    model_id="deepseek-ai/DeepSeek-V3",
    compat_key="",
    geometry=GEOMETRY_MLA,
    aux_slots=0,
    aux_slot_bytes=0,
    transport="loopback",
    transport_metadata=b"",
    regions=tuple(
        WireRegion(kind=0, index=i, address=0x10000000 * (i + 1), length=REGION_BYTES_MLA, device_id=0, mem_kind=0)
        for i in range(3)
    ),
)
TRANSFER_DONE = TransferDone(room_id=0x00C0FFEE, generation=1_000_001, writes=3, nbytes=25_165_824 + 256)
HEARTBEAT = Heartbeat(boot_id=0x0123456789ABCDEF, seq=42)

# Version 1.1 (minor 1): staging. The example pair is prefill rank 2 of TP 4 (GEOMETRY_PREFILL:
# block 64, HND) writing into decode rank 1 of TP 2 (GEOMETRY_GQA: block 16, NHD) on link 7:
# 2 layers x 2 planes = 4 regions, 2 moved heads of 128 bf16 elements, so one unit (one token)
# is 4 * 2 * 128 * 2 = 2,048 bytes. The room is the one of transfer_request.hex (100 tokens,
# 32 cached): the writer stages tokens [32, 100).
STAGING_UNIT = 4 * 2 * 128 * 2
STAGING_REQUEST = StagingRequest(room_id=0x00C0FFEE, generation=1_000_001, seq=0, start_token=32, end_token=100)
STAGING_GRANT = StagingGrant(room_id=0x00C0FFEE, generation=1_000_001, seq=0, start_token=32, end_token=64,
                             offset=0x30000)
STAGING_WATERMARK = StagingWatermark(room_id=0x00C0FFEE, generation=1_000_001, seq=0,
                                     watermark=0x30000 + 32 * STAGING_UNIT)


TRANSFER_REQUEST = TransferRequest(room_id=0x00C0FFEE, generation=1_000_001, num_tokens=100, prefix_tokens=32,
                                   aux_slot=5, expected_writers=2, dst_pages=(17, 18, 19, 40, 41, 42, 43))
"""The request of transfer_request.hex: 100 tokens in decode blocks of 16, the first 32 cached."""

TRANSFER_REQUEST_DUPLICATE_PAGES = TransferRequest(
    room_id=0x00C0FFEE, generation=1_000_001, num_tokens=100, prefix_tokens=32, aux_slot=5,
    expected_writers=2, dst_pages=(17, 18, 19, 41, 40, 41, 43))
"""transfer_request.hex with page 41 listed twice (tokens [48, 64) and [80, 96))."""


# Version 1.2 (minor 2): caches of several groups. The decode rank of REGISTER (TP 2, rank 1) also
# keeps "swa", sliding-window layers with a pool of their own (1 layer, K and V, window 128), and
# "gdn", Gated DeltaNet state (3 layers of a conv state sharded over its 8,192 channels and a
# recurrent state sharded over its 32 heads, 64 slots). Its GROUP regions: swa's 2 (g = 1), then
# gdn's 6 (g = 2), one per (layer, tensor).
GEOMETRY_SWA = WireGeometry(
    tp_size=2, tp_rank=1, num_layers=1, num_kv_heads=8, head_dim=128, dtype=2, block_size=16,
    layout=0, mla=0, num_blocks=256,
)
ZERO_GEOMETRY = WireGeometry(tp_size=0, tp_rank=0, num_layers=0, num_kv_heads=0, head_dim=0, dtype=0, block_size=0,
                             layout=0, mla=0, num_blocks=0)
GROUPS = (
    WireGroup(name="swa", kind=GroupKind.PAGED, geometry=GEOMETRY_SWA, window=128, num_layers=0, num_slots=0,
              tensors=()),
    WireGroup(name="gdn", kind=GroupKind.STATE, geometry=ZERO_GEOMETRY, window=0, num_layers=3, num_slots=64,
              tensors=(WireStateTensor(shape=(8192, 4), dtype=2, shard_dim=0),
                       WireStateTensor(shape=(32, 128, 128), dtype=3, shard_dim=0))),
)
CACHE_GROUPS = CacheGroups(link_id=7, groups=GROUPS)
SWA_REGION = 256 * 16 * 4 * 128 * 2
GDN_SLOT = (4096 * 4 * 2, 16 * 128 * 128 * 4)
REGISTER_GROUPS = Register(**{
    **{name: getattr(REGISTER, name) for name, _ in Register.FIELDS},
    "regions": REGISTER.regions + tuple(
        WireRegion(kind=RegionKind.GROUP, index=1 << 24 | r, address=0x7F3B00000000 + r * SWA_REGION,
                   length=SWA_REGION, device_id=1, mem_kind=1) for r in range(2)
    ) + tuple(
        WireRegion(kind=RegionKind.GROUP, index=2 << 24 | r, address=0x7F3C00000000 + r * (1 << 28),
                   length=64 * GDN_SLOT[r % 2], device_id=1, mem_kind=1) for r in range(6)
    ),
})
TRANSFER_REQUEST_GROUPS = TransferRequest(
    room_id=0x00C0FFEE, generation=1_000_001, num_tokens=300, prefix_tokens=32, aux_slot=5,
    expected_writers=2, dst_pages=tuple(range(17, 36)),
    groups=(GroupDestination(first_page=10, pages=(200, 201, 202, 203, 204, 205, 206, 207, 208), slot=NO_SLOT),
            GroupDestination(first_page=0, pages=(), slot=9)))
"""A 300-token room: 19 pages of the first group; swa's window of 128 tokens is tokens [172, 300),
pages 10 to 18 of block 16 (9 pages); gdn's state goes to slot 9."""

# Version 1.4 (minor 4): state layouts. The decode rank of REGISTER_GROUPS keeps gdn as vLLM does:
# each layer's conv state and recurrent state of one block share one page of GDN_PAGE bytes (the
# conv state at offset 0, the recurrent state after it, then padding to the attention page size),
# so both tensors' slots lie GDN_PAGE apart and a layer's two regions interleave; and the conv
# state's 8,192 channels are [Q | K | V] (2,048, 2,048 and 4,096), each section sharded over TP on
# its own. swa, a paged group, has an empty layout.
GDN_PAGE = 0x110000
"""1,114,112 bytes: gdn's two local states of one block (32,768 + 1,048,576 bytes) and padding."""
LAYOUTS = (
    WireGroupLayout(tensors=()),
    WireGroupLayout(tensors=(WireTensorLayout(sections=(2048, 2048, 4096), slot_stride=GDN_PAGE),
                             WireTensorLayout(sections=(), slot_stride=GDN_PAGE))),
)
CACHE_GROUPS_LAYOUTS = CacheGroups(link_id=7, groups=GROUPS, layouts=LAYOUTS)
REGISTER_GROUPS_PAGES = Register(**{
    **{name: getattr(REGISTER_GROUPS, name) for name, _ in Register.FIELDS},
    "regions": REGISTER.regions + REGISTER_GROUPS.regions[len(REGISTER.regions):len(REGISTER.regions) + 2] + tuple(
        WireRegion(kind=RegionKind.GROUP, index=2 << 24 | r,
                   address=0x7F3C00000000 + (r // 2) * 64 * GDN_PAGE + (r % 2) * GDN_SLOT[0],
                   length=63 * GDN_PAGE + GDN_SLOT[r % 2], device_id=1, mem_kind=1) for r in range(6)
    ),
})
"""register_groups.hex's REGISTER with gdn's regions in pages: layer l's 64 pages from
0x7F3C00000000 + l * 64 * GDN_PAGE; its conv region starts there, its recurrent region GDN_SLOT[0]
bytes later, each reaching its 64th slot's end (63 strides and the tensor's local bytes)."""


# Version 1.4 (minor 4): room holds. The decode rank of transfer_request.hex's room waits for its
# destination and holds the room on the prefill rank for 10 s (Timeouts.hold's default).
ROOM_HOLD = RoomHold(room_id=0x00C0FFEE, generation=1_000_001, hold_ms=10_000)


# Version 1.5 (minor 5): windows the engine names. The decode rank of REGISTER_GROUPS serves a model
# whose engine names swa's window room by room (window NAMED_WINDOW): for transfer_request_groups's
# 300-token room it names swa's pages from page 12 on (tokens [192, 300), 7 pages of block 16).
GROUPS_NAMED = (dataclasses.replace(GROUPS[0], window=NAMED_WINDOW), GROUPS[1])
CACHE_GROUPS_NAMED = CacheGroups(link_id=7, groups=GROUPS_NAMED)
TRANSFER_REQUEST_NAMED = dataclasses.replace(
    TRANSFER_REQUEST_GROUPS,
    groups=(GroupDestination(first_page=12, pages=(210, 211, 212, 213, 214, 215, 216), slot=NO_SLOT),
            TRANSFER_REQUEST_GROUPS.groups[1]))


def _vectors() -> list[Vector]:
    good = [
        frame("bootstrap_query.hex", BootstrapQuery(requester="kvproto-decode-0-0123456789ab"),
              "decode rank asks prefill rank 0 for the rank table"),
        frame("bootstrap_query_unicode.hex", BootstrapQuery(requester="décode-ランク-🚀"),
              "a string field holding 2-, 3- and 4-byte UTF-8 sequences; the length prefix counts bytes"),
        frame("bootstrap_info.hex", BootstrapInfo(tp_size=2, ranks=(
            RankAddress(tp_rank=0, endpoint="tcp://10.0.0.1:5570", boot_id=0x1111111111111111),
            RankAddress(tp_rank=1, endpoint="tcp://10.0.0.2:5571", boot_id=0x2222222222222222),
        )), "a complete rank table: len(ranks) == tp_size"),
        frame("bootstrap_info_empty.hex", BootstrapInfo(tp_size=4, ranks=()),
              "an empty record list: count 0 and nothing after it"),
        frame("rank_announce.hex", RankAnnounce(tp_rank=3, tp_size=4, endpoint="tcp://10.0.0.4:5573",
                                                boot_id=0xFEDCBA9876543210),
              "prefill rank 3 of 4 announces its address to rank 0"),
        frame("register.hex", REGISTER,
              "decode rank 1 of TP 2 (8 KV heads, bf16, block 16, NHD) with 4 VRAM KV regions and one aux region"),
        frame("register_mla.hex", REGISTER_MLA,
              "an MLA decode rank: one plane per layer, no aux slots, empty transport metadata"),
        frame("register_accept.hex", RegisterAccept(
            boot_id=0xA5A5A5A55A5A5A5A, link_id=7, agent_name="kvproto-prefill-2-9c8b7a6d5e4f",
            geometry=GEOMETRY_PREFILL, aux_slot_bytes=256),
            "prefill rank 2 of TP 4 (block 64, HND) accepts link 7"),
        frame("register_reject.hex", RegisterReject(
            link_id=7, code=ErrorCode.MODEL_MISMATCH,
            reason="decode serves model 'a', prefill 'b'"),
            "registration refused with MODEL_MISMATCH"),
        frame("transfer_request.hex", TransferRequest(
            room_id=0x00C0FFEE, generation=1_000_001, num_tokens=100, prefix_tokens=32, aux_slot=5,
            expected_writers=2, dst_pages=(17, 18, 19, 40, 41, 42, 43)),
            "100 tokens in decode blocks of 16: 7 pages; the first 32 tokens are already cached"),
        frame("transfer_request_no_slot.hex", TransferRequest(
            room_id=9, generation=2, num_tokens=16, prefix_tokens=0, aux_slot=NO_SLOT, expected_writers=1,
            dst_pages=(0,)),
            "aux_slot NO_SLOT (0xFFFFFFFF): no aux region for this room"),
        frame("transfer_request_empty_pages.hex", TransferRequest(
            room_id=1, generation=1, num_tokens=0, prefix_tokens=0, aux_slot=NO_SLOT, expected_writers=1,
            dst_pages=()),
            "an empty u32[]: count 0 and nothing after it (wire-valid; kvproto decode ranks never send 0 tokens)"),
        frame("transfer_request_max.hex", TransferRequest(
            room_id=U64_MAX, generation=U32_MAX, num_tokens=U32_MAX, prefix_tokens=0, aux_slot=U32_MAX - 1,
            expected_writers=0xFFFF, dst_pages=(U32_MAX, 0, U32_MAX - 1)),
            "every integer at its width's bound: room_id 2**64-1, generation 2**32-1"),
        frame("transfer_done.hex", TRANSFER_DONE, "writer reports 3 writes (2 KV chunks and the aux slot)"),
        frame("transfer_done_zero.hex", TransferDone(room_id=5, generation=6, writes=0, nbytes=0),
              "a writer with nothing to write (the prefix covered every token) still reports"),
        frame("abort.hex", Abort(room_id=0x00C0FFEE, generation=1_000_001, code=ErrorCode.TRANSFER_TIMEOUT,
                                 reason="room 12648430 timed out while TRANSFERRING"),
              "a room failed with TRANSFER_TIMEOUT"),
        frame("abort_link.hex", Abort(code=ErrorCode.ENDPOINT_CLOSED, reason="decode closed"),
              "room_id 0: the whole link is closed"),
        frame("abort_unicode.hex", Abort(room_id=77, generation=3, code=ErrorCode.ABORTED,
                                         reason="abgebrochen: Größe ≠ 64 — 中止"),
              "a UTF-8 reason"),
        frame("abort_unknown_code.hex", Abort(room_id=77, generation=3, code=999, reason=""),
              "a code newer than this registry and an empty string: decoders keep the raw number"),
        frame("heartbeat.hex", HEARTBEAT, "decode's heartbeat number 42"),
        frame("heartbeat_max.hex", Heartbeat(room_id=U64_MAX, generation=U32_MAX, boot_id=U64_MAX, seq=U64_MAX),
              "u64 fields at their bound"),
    ]
    tail = [
        decode_only("transfer_done_minor1_trailing.hex",
                    with_trailing(encode(TRANSFER_DONE, minor=1), bytes.fromhex("0102030405060708deadbeef"),
                                  minor=1),
                    TRANSFER_DONE,
                    "minor 1 with 12 bytes of fields this decoder does not know: they are ignored",
                    twin="transfer_done.hex", minor=1),
        decode_only("register_minor7_trailing.hex",
                    with_trailing(encode(REGISTER, minor=7), b"\x05\x00hello\x00\x00\x00\x00", minor=7),
                    REGISTER,
                    "minor 7: trailing bytes after a record list are ignored",
                    twin="register.hex", minor=7),
        decode_only("heartbeat_minor0_trailing.hex",
                    with_trailing(v10(HEARTBEAT), b"\x00"),
                    HEARTBEAT,
                    "trailing bytes are ignored whatever the minor (here 0)",
                    twin="heartbeat.hex"),
        decode_only("heartbeat_flags_reserved.hex",
                    patched(patched(v10(HEARTBEAT), 5, "<B", 0xFF), 6, "<H", 0xBEEF),
                    HEARTBEAT,
                    "unknown flag bits and a nonzero reserved field are ignored (flags are reported)",
                    twin="heartbeat.hex", flags=0xFF),
    ]
    hb = v10(HEARTBEAT)
    query = v10(BootstrapQuery(requester="ab"))
    rejects = [
        reject("reject_short_header.hex", hb[:23], "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "23 bytes: shorter than the header"),
        reject("reject_bad_magic.hex", b"VK" + hb[2:], "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "magic must be 'KV'"),
        reject("reject_major2.hex", patched(hb, 2, "<B", 2), "UnsupportedVersion",
               ErrorCode.UNSUPPORTED_VERSION, "major 2: not spoken by a v1 receiver"),
        reject("reject_major0.hex", patched(hb, 2, "<B", 0), "UnsupportedVersion",
               ErrorCode.UNSUPPORTED_VERSION, "major 0 is not 1 either"),
        reject("reject_body_len_short.hex", patched(hb, 20, "<I", 15), "MalformedFrame",
               ErrorCode.MALFORMED_FRAME, "body_len says 15 but 16 bytes follow"),
        reject("reject_body_len_long.hex", patched(hb, 20, "<I", 17), "MalformedFrame",
               ErrorCode.MALFORMED_FRAME, "body_len says 17 but 16 bytes follow"),
        reject("reject_truncated_body.hex", with_trailing(hb[:24], hb[24:-1]), "MalformedFrame",
               ErrorCode.MALFORMED_FRAME, "a consistent body_len, but the body ends inside the last u64"),
        reject("reject_string_overrun.hex", patched(query, 24, "<H", 3), "MalformedFrame",
               ErrorCode.MALFORMED_FRAME, "a string length prefix longer than the body"),
        reject("reject_invalid_utf8.hex", query[:26] + b"\xc3\x28", "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "a string that is not UTF-8"),
        reject("reject_utf8_surrogate.hex", with_trailing(query[:24], b"\x03\x00\xed\xa0\x80"), "MalformedFrame",
               ErrorCode.MALFORMED_FRAME, "an encoded UTF-16 surrogate is not UTF-8"),
        reject("reject_record_count.hex",
               with_trailing(v10(BootstrapInfo(tp_size=2, ranks=()))[:24], b"\x02\x00\xff\xff\xff\xff"),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME, "a record count far beyond the frame"),
        reject("reject_array_count.hex",
               with_trailing(v10(TransferRequest(num_tokens=1, prefix_tokens=0, aux_slot=0,
                                                 expected_writers=1))[:38], b"\x00\x00\x00\x40"),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME, "a u32[] count whose elements do not fit the frame"),
        reject("reject_unknown_type.hex", patched(hb, 4, "<B", 200), "UnknownMessage", ErrorCode.MALFORMED_FRAME,
               "message type 200 at minor 0: a violation"),
        reject("reject_unknown_type_minor1.hex", patched(patched(hb, 4, "<B", 200), 3, "<B", 1),
               "UnknownMessage", ErrorCode.MALFORMED_FRAME,
               "message type 200 at minor 1: decoders raise UnknownMessage; endpoints ignore it (newer minor)"),
        reject("reject_type0.hex", patched(hb, 4, "<B", 0), "UnknownMessage", ErrorCode.MALFORMED_FRAME,
               "message type 0 is never assigned"),
    ]
    tags = [
        tag("tag_kv.hex", Tag(kind=TagKind.KV, room_id=0x00C0FFEE, generation=1_000_001, link_id=7, seq=0),
            "the first write of link 7 into room 0xC0FFEE"),
        tag("tag_staged.hex", Tag(kind=TagKind.STAGED, room_id=1, generation=2, link_id=3, seq=4),
            "kind STAGED"),
        tag("tag_max.hex", Tag(kind=TagKind.KV, room_id=U64_MAX, generation=U32_MAX, link_id=U32_MAX,
                               seq=U32_MAX), "every field at its bound"),
    ]
    kv = tags[0].data
    tag_rejects = [
        tag_reject("reject_tag_short.hex", kv[:23], "23 bytes"),
        tag_reject("reject_tag_long.hex", kv + b"\x00", "25 bytes"),
        tag_reject("reject_tag_magic.hex", b"KV" + kv[2:], "magic must be 'KT'"),
        tag_reject("reject_tag_version.hex", patched(kv, 2, "<B", 2), "tag version 2"),
        tag_reject("reject_tag_kind0.hex", patched(kv, 3, "<B", 0), "tag kind 0 is not assigned"),
        tag_reject("reject_tag_kind3.hex", patched(kv, 3, "<B", 3), "tag kind 3 is not assigned"),
    ]
    staging = [
        frame("staging_request.hex", STAGING_REQUEST,
              "minor 1: the writer asks for staging space for tokens [32, 100) of room 0xC0FFEE as its write 0",
              minor=1),
        frame("staging_grant.hex", STAGING_GRANT,
              "minor 1: the decode ring grants the first 32 tokens (32 units of 2,048 bytes) at offset 0x30000",
              minor=1),
        frame("staging_request_next.hex",
              StagingRequest(room_id=0x00C0FFEE, generation=1_000_001, seq=1, start_token=64, end_token=100),
              "minor 1: after a partial grant the writer asks for the rest, starting at the grant's end, as write 1",
              minor=1),
        frame("staging_watermark.hex", STAGING_WATERMARK,
              "minor 1: write 0 is scattered and its region released; the ring's watermark moved past it",
              minor=1),
        frame("staging_request_max.hex",
              StagingRequest(room_id=U64_MAX, generation=U32_MAX, seq=U32_MAX, start_token=U32_MAX - 1,
                             end_token=U32_MAX),
              "minor 1: every field at its bound; the token range [2**32-2, 2**32-1)", minor=1),
        frame("staging_grant_max.hex",
              StagingGrant(room_id=U64_MAX, generation=U32_MAX, seq=U32_MAX, start_token=U32_MAX - 1,
                           end_token=U32_MAX, offset=U64_MAX),
              "minor 1: every field at its bound, offset 2**64-1 (wire-valid; a prefill rank refuses it: "
              "offset + length exceeds any staging region, INDEX_OUT_OF_RANGE)", minor=1),
        frame("staging_watermark_max.hex",
              StagingWatermark(room_id=U64_MAX, generation=U32_MAX, seq=U32_MAX, watermark=U64_MAX),
              "minor 1: every field at its bound, watermark 2**64-1", minor=1),
        decode_only("staging_grant_minor2_trailing.hex",
                    with_trailing(encode(STAGING_GRANT, minor=2), bytes.fromhex("efcdab8967452301cafe"), minor=2),
                    STAGING_GRANT,
                    "minor 2: a STAGING_GRANT with 10 bytes of fields this decoder does not know: they are ignored",
                    twin="staging_grant.hex", minor=2),
        reject("reject_staging_grant_truncated.hex",
               with_trailing(encode(STAGING_GRANT, minor=1)[:24], encode(STAGING_GRANT, minor=1)[24:-1]),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "minor 1: a consistent body_len, but the body ends inside offset (no staging field is optional)"),
        reject("reject_unknown_type_minor2.hex", patched(encode(HEARTBEAT, minor=2), 4, "<B", 200),
               "UnknownMessage", ErrorCode.MALFORMED_FRAME,
               "message type 200 at minor 2: decoders raise UnknownMessage; a receiver of minor 0 or 1 ignores "
               "it (newer minor), one of minor 2 or later counts a violation"),
        tag("tag_staged_write.hex", Tag(kind=TagKind.STAGED, room_id=0x00C0FFEE, generation=1_000_001, link_id=7,
                                        seq=0),
            "minor 1: the tag of the staged write that fills the grant of staging_grant.hex"),
    ]
    duplicates = [
        frame("transfer_request_duplicate_pages.hex", TRANSFER_REQUEST_DUPLICATE_PAGES,
              "minor 1: wire-valid, but page 41 holds both tokens [48, 64) and [80, 96): a prefill rank refuses "
              "it before writing anything, answering abort_duplicate_pages.hex and failing the room "
              "(INDEX_OUT_OF_RANGE)", minor=1),
        frame("abort_duplicate_pages.hex", Abort(room_id=0x00C0FFEE, generation=1_000_001,
                                                  code=ErrorCode.INDEX_OUT_OF_RANGE,
                                                  reason="destination page 41 is listed twice: two token ranges "
                                                         "would share it"),
              "minor 1: the prefill rank's answer to transfer_request_duplicate_pages.hex", minor=1),
    ]
    groups = [
        frame("cache_groups.hex", CACHE_GROUPS,
              "minor 2: decode rank 1 of TP 2 lists its groups beyond the first before its REGISTER on link 7: "
              "sliding-window layers with a pool of their own and a window of 128 tokens, and Gated DeltaNet "
              "state (3 layers; a conv state sharded over channels, a recurrent state over heads; 64 slots)",
              minor=2),
        frame("register_groups.hex", REGISTER_GROUPS,
              "minor 2: register.hex's REGISTER with the GROUP regions of cache_groups.hex's groups: swa's 2 "
              "(index 1 << 24 | r), then gdn's 6 (index 2 << 24 | r), each 64 slots of its tensor's local bytes",
              minor=2),
        frame("transfer_request_groups.hex", TRANSFER_REQUEST_GROUPS,
              "minor 2: a 300-token room with one destination per group beyond the first: swa's window (tokens "
              "[172, 300)) in its pages 10-18, gdn's state in slot 9", minor=2),
        frame("transfer_request_no_groups_minor2.hex", TransferRequest(
            room_id=0x00C0FFEE, generation=1_000_001, num_tokens=100, prefix_tokens=32, aux_slot=5,
            expected_writers=2, dst_pages=(17, 18, 19, 40, 41, 42, 43)),
              "minor 2: a one-group room leaves out the optional groups field: its body is transfer_request.hex's",
              minor=2),
        reject("reject_transfer_request_groups_truncated.hex",
               with_trailing(encode(TRANSFER_REQUEST_GROUPS, minor=2)[:24],
                             encode(TRANSFER_REQUEST_GROUPS, minor=2)[24:-2]),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "minor 2: the groups field is optional, but once its count is sent its records must all be there"),
        *newer_minor(3, "0000000001020304", 201),
    ]
    state_block = [
        frame("staging_grant_last.hex",
              StagingGrant(room_id=0x00C0FFEE, generation=1_000_001, seq=1, start_token=64, end_token=100,
                           offset=0x30000 + 32 * STAGING_UNIT),
              "minor 3: the grant of write 1, tokens [64, 100): with staging_grant.hex it covers staging_request.hex's "
              "tokens, and it ends them, so between peers of minor 3 whose prefill rank writes state into the decode "
              "rank its region holds 36 units and then the pair's state block (staging.md)", minor=3),
        *newer_minor(4, "0504030201", 202),
    ]
    # Version 1.3, no change to the wire format: how the text answers questions the 1.2 text left
    # open. Each answer that refuses something, and each that a reader could get wrong, has a vector.
    request_minor3 = encode(TRANSFER_REQUEST, minor=3)
    exact = [
        reject("reject_transfer_request_groups_count_truncated.hex", with_trailing(request_minor3, b"\x01\x00"),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "minor 3: transfer_request.hex's body and then 2 bytes: the body ends inside the count of the "
               "optional groups field, which is truncated, not absent (absent only where the body ends exactly "
               "at the field's start)"),
        decode_only("transfer_request_groups_empty.hex", with_trailing(request_minor3, b"\x00\x00\x00\x00"),
                    TRANSFER_REQUEST,
                    "minor 3: the optional groups field sent empty (count 0) decodes as when it is left out; the "
                    "index lists no groups, as for every optional field at its default",
                    twin="transfer_request_no_groups_minor2.hex", minor=3),
        refuse("refuse_transfer_request_state_first_page.hex",
               dataclasses.replace(TRANSFER_REQUEST_GROUPS, groups=(
                   TRANSFER_REQUEST_GROUPS.groups[0], dataclasses.replace(TRANSFER_REQUEST_GROUPS.groups[1],
                                                                          first_page=1))),
               ["cache_groups.hex", "register_groups.hex", "refuse_transfer_request_state_first_page.hex"],
               MsgType.ABORT, ErrorCode.PEER_PROTOCOL_ERROR, "messages.md, TRANSFER_REQUEST check 11",
               "minor 3: transfer_request_groups.hex, but the destination of gdn (a state group: first_page 0) "
               "has first_page 1: refused (PEER_PROTOCOL_ERROR) before anything is written, never ignored",
               minor=3),
        refuse("refuse_cache_groups_unknown_kind.hex",
               CacheGroups(link_id=7, groups=GROUPS + (
                   WireGroup(name="idx", kind=2, geometry=ZERO_GEOMETRY, window=0, num_layers=0, num_slots=0,
                             tensors=()),)),
               ["refuse_cache_groups_unknown_kind.hex", "register_groups.hex"],
               MsgType.REGISTER_REJECT, ErrorCode.INCOMPATIBLE_GEOMETRY, "messages.md, REGISTER check 5a",
               "minor 3: cache_groups.hex's groups and a third, idx, of kind 2, which versions 1.2 and 1.3 do not "
               "define: the group is not valid, so the REGISTER that follows is refused (INCOMPATIBLE_GEOMETRY); "
               "a receiver that skipped the group would have accepted it", minor=3),
        frame("cache_groups_other_kind_fields.hex", CacheGroups(link_id=7, groups=(
            dataclasses.replace(GROUPS[0], num_layers=5, num_slots=6,
                                tensors=(WireStateTensor(shape=(3,), dtype=2, shard_dim=NO_SHARD),)),
            dataclasses.replace(GROUPS[1], geometry=GEOMETRY_SWA, window=64))),
              "minor 3: cache_groups.hex's groups with values in the fields fixed for the other kind (swa, paged: "
              "num_layers, num_slots, tensors; gdn, state: geometry, window): they are ignored, and a receiver "
              "takes the same groups as from cache_groups.hex", minor=3),
    ]
    layouts = [
        frame("cache_groups_layouts.hex", CACHE_GROUPS_LAYOUTS,
              "minor 4: cache_groups.hex's groups with their layouts: swa's empty (a paged group), gdn's conv "
              "state of sections [Q | K | V] (2,048, 2,048, 4,096 channels) and both its tensors' slots 1,114,112 "
              "bytes apart (a layer's states of one block in one page, vLLM's layout)", minor=4),
        frame("register_groups_pages.hex", REGISTER_GROUPS_PAGES,
              "minor 4: the REGISTER that follows cache_groups_layouts.hex: gdn's regions of layer l in one run of "
              "64 pages, its conv region at the pages' start and its recurrent region 32,768 bytes in, each "
              "63 * 1,114,112 bytes plus its tensor's local bytes long (the two overlap in address range)",
              minor=4),
        frame("cache_groups_no_layouts_minor4.hex", CACHE_GROUPS,
              "minor 4: groups whose state tensors are one section with slots back to back leave out the "
              "optional layouts field: the body is cache_groups.hex's", minor=4),
        reject("reject_cache_groups_layouts_truncated.hex",
               with_trailing(encode(CACHE_GROUPS_LAYOUTS, minor=4)[:24], encode(CACHE_GROUPS_LAYOUTS, minor=4)[24:-3]),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "minor 4: the layouts field is optional, but once its count is sent its records must all be there"),
        *newer_minor(5, "a5a5a5", 203),
    ]
    room_hold = encode(ROOM_HOLD, minor=4)
    holds = [
        frame("room_hold.hex", ROOM_HOLD,
              "minor 4: decode rank 1 of transfer_request.hex's room, still waiting for its destination, asks "
              "the prefill rank to keep room 0xC0FFEE open 10 s more (cut to the prefill's own maximum)", minor=4),
        frame("room_hold_max.hex", RoomHold(room_id=U64_MAX, generation=U32_MAX, hold_ms=U32_MAX),
              "minor 4: every field at its bound, a hold of 2**32-1 ms (wire-valid; the prefill rank cuts it to "
              "its maximum hold)", minor=4),
        decode_only("room_hold_minor5_trailing.hex", with_trailing(encode(ROOM_HOLD, minor=5),
                                                                   bytes.fromhex("0607"), minor=5),
                    ROOM_HOLD, "minor 5: a ROOM_HOLD with 2 bytes of fields this decoder does not know: they are "
                               "ignored", twin="room_hold.hex", minor=5),
        reject("reject_room_hold_truncated.hex", with_trailing(room_hold[:24], room_hold[24:27]),
               "MalformedFrame", ErrorCode.MALFORMED_FRAME,
               "minor 4: a consistent body_len, but the body ends inside hold_ms (the field is required)"),
        frame("abort_register_refused.hex", Abort(room_id=0x00C0FFEE, generation=1_000_001,
                                                   code=ErrorCode.MODEL_MISMATCH,
                                                   reason="prefill rank 0 rejected registration: decode serves "
                                                          "model 'a', prefill 'b'"),
              "minor 4: what a decode rank sends, on the link whose REGISTER register_reject.hex refused, for its "
              "room that fails by the refusal; a prefill rank of minor 4 fails its open room 0xC0FFEE with "
              "MODEL_MISMATCH if no decode rank has requested it yet (messages.md, 9 ABORT: refused "
              "registrations), and drops it otherwise", minor=4),
        decode_only("staging_grant_minor5_trailing_holds.hex",
                    with_trailing(encode(STAGING_GRANT, minor=5), bytes.fromhex("0a0b0c"), minor=5),
                    STAGING_GRANT,
                    "minor 5: a STAGING_GRANT with 3 bytes of fields this decoder does not know: they are ignored",
                    twin="staging_grant.hex", minor=5),
        reject("reject_unknown_type_minor5_holds.hex", patched(encode(HEARTBEAT, minor=5), 4, "<B", 203),
               "UnknownMessage", ErrorCode.MALFORMED_FRAME,
               "message type 203 at minor 5: decoders raise UnknownMessage; a receiver of minor 4 or lower ignores "
               "it (newer minor)"),
    ]
    named = [
        frame("cache_groups_named_window.hex", CACHE_GROUPS_NAMED,
              "minor 5: cache_groups.hex with swa's window named by the engine, room by room "
              "(window 0xFFFFFFFF, NAMED_WINDOW)", minor=5),
        frame("transfer_request_named_window.hex", TRANSFER_REQUEST_NAMED,
              "minor 5: transfer_request_groups.hex's room on a link of cache_groups_named_window.hex: the decode "
              "names swa's pages from page 12 (tokens [192, 300)), where its engine's window begins", minor=5),
        *newer_minor(6, "5a5a", 204),
    ]
    first = Tag(kind=TagKind.KV, room_id=0x00C0FFEE, generation=1_000_001, link_id=7, seq=0)
    pair = pack_tags([first.encode(), dataclasses.replace(first, seq=1).encode()])
    lists = [
        tag_list("list_two_writes.hex", [first, dataclasses.replace(first, seq=1)],
                 "minor 6: tag_kv.hex and the next write of its link (seq 1), posted in one pass and moved as "
                 "one transfer: the receiver takes each tag as if it had come alone"),
        tag_list("list_rooms.hex", [Tag(kind=TagKind.KV, room_id=1, generation=2, link_id=3, seq=0),
                                    Tag(kind=TagKind.STAGED, room_id=1, generation=2, link_id=3, seq=4),
                                    Tag(kind=TagKind.KV, room_id=U64_MAX, generation=U32_MAX, link_id=3, seq=U32_MAX)],
                 "minor 6: three writes of two rooms on link 3, one of them STAGED"),
        list_reject("reject_list_one.hex", pair[:4] + b"\x01\x00"
                    + pair[6:32], "a list of one tag (count 1): not a list; as a tag it is malformed"),
        list_reject("reject_list_trailing.hex", pair + b"\x00", "a byte after the last listed tag"),
        list_reject("reject_list_short.hex", pair[:-1], "the last listed tag ends past the notification"),
        list_reject("reject_list_version.hex", pair[:2] + b"\x02" + pair[3:], "list version 2 is not defined"),
        frame("transfer_done_minor6.hex", TRANSFER_DONE, "minor 6: transfer_done.hex as a version 1.6 prefill "
              "rank sends it: the body is the same", minor=6),
        *newer_minor(7, "7a7a", 205),
    ]
    # The MAX_FRAME bound is tested in tests/wire/test_fuzz.py rather than with 16 MiB files.
    return good + tail + rejects + tags + tag_rejects + staging + duplicates + groups + state_block + exact + layouts + \
        holds + named + lists


VECTORS = _vectors()

# --- writing ----------------------------------------------------------------------------------


def to_hex(data: bytes) -> str:
    h = data.hex()
    return "".join(h[i : i + WRAP] + "\n" for i in range(0, len(h), WRAP)) or "\n"


def from_hex(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; report missing or differing vectors")
    args = parser.parse_args(argv)

    index: dict[str, Any] = json.loads(INDEX.read_text()) if INDEX.exists() else {
        "spec": "kvproto wire v1",
        "format": "lowercase hex, 64 digits per line; remove all whitespace before decoding",
        "vectors": [],
    }
    entries = {e["file"]: e for e in index["vectors"]}
    problems = 0
    added = 0
    names = [v.file for v in VECTORS]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        print(f"duplicate vector names: {sorted(dupes)}", file=sys.stderr)
        return 1
    for vec in VECTORS:
        path = HERE / vec.file
        if path.exists():
            if from_hex(path.read_text()) != vec.data:
                print(f"DIFFERS (released, not rewritten): {vec.file}", file=sys.stderr)
                problems += 1
        elif args.check:
            print(f"missing: {vec.file}", file=sys.stderr)
            problems += 1
        else:
            path.write_text(to_hex(vec.data))
            print(f"wrote {vec.file} ({len(vec.data)} bytes)")
        old = entries.get(vec.file)
        if old is None:
            if not args.check:
                index["vectors"].append(vec.entry)
                entries[vec.file] = vec.entry
                added += 1
        elif old != vec.entry:
            print(f"index entry DIFFERS (released, not rewritten): {vec.file}", file=sys.stderr)
            problems += 1
    if added and not args.check:
        INDEX.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
        print(f"appended {added} entries to index.json")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
