"""The frame codec against hand-assembled bytes, the decoding order of framing.md, and the
encoder's refusal to coerce values (some of these tests record open bugs: see their docstrings).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest

from kvproto.wire import (
    HEADER_SIZE,
    MAJOR,
    MINOR,
    NO_SLOT,
    Abort,
    BootstrapQuery,
    ErrorCode,
    FrameTooLarge,
    Header,
    Heartbeat,
    LocalProtocolError,
    MalformedFrame,
    MalformedTag,
    ProtocolError,
    Register,
    RemoteProtocolError,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    TransferRequest,
    UnknownMessage,
    UnsupportedVersion,
    WireGeometry,
    decode,
    decode_frame,
    decode_header,
    encode,
)

HEADER_FMT = "<2sBBBBHQII"  # framing.md: magic, major, minor, msg_type, flags, reserved, room, gen, len


def frame_by_hand(msg_type: int, body: bytes, *, room_id: int = 0, generation: int = 0, minor: int = 0,
                  flags: int = 0, reserved: int = 0, major: int = 1) -> bytes:
    """A frame assembled from framing.md's header table; a version 1.0 header (minor 0) unless told."""
    return struct.pack(HEADER_FMT, b"KV", major, minor, msg_type, flags, reserved, room_id, generation,
                       len(body)) + body


def s(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<H", len(data)) + data


GEOMETRY = WireGeometry(tp_size=2, tp_rank=1, num_layers=3, num_kv_heads=8, head_dim=128, dtype=2,
                        block_size=16, layout=1, mla=0, num_blocks=1000)
GEOMETRY_BYTES = struct.pack("<HHIIIBIBBI", 2, 1, 3, 8, 128, 2, 16, 1, 0, 1000)


def test_codec_header_constants() -> None:
    """The header is 24 bytes; this build speaks major 1, minor 6 (version 1.6: notification lists)."""
    assert HEADER_SIZE == struct.calcsize(HEADER_FMT) == 24
    assert (MAJOR, MINOR) == (1, 6)


def test_codec_heartbeat_matches_hand_assembled_bytes() -> None:
    """HEARTBEAT encodes as the header (this build's minor by default, 0 on request) then two u64, little-endian."""
    msg = Heartbeat(room_id=0, generation=0, boot_id=0x0123456789ABCDEF, seq=42)
    body = struct.pack("<QQ", 0x0123456789ABCDEF, 42)
    assert encode(msg) == frame_by_hand(10, body, minor=MINOR)
    assert encode(msg, minor=0) == frame_by_hand(10, body, minor=0)


def test_codec_transfer_request_matches_hand_assembled_bytes() -> None:
    """TRANSFER_REQUEST: room and generation in the header, four ints, then a counted u32 array."""
    msg = TransferRequest(room_id=2**64 - 1, generation=7, num_tokens=33, prefix_tokens=16, aux_slot=NO_SLOT,
                          expected_writers=3, dst_pages=(5, 0, 2**32 - 1))
    body = struct.pack("<IIIH", 33, 16, 0xFFFFFFFF, 3) + struct.pack("<I3I", 3, 5, 0, 2**32 - 1)
    assert encode(msg) == frame_by_hand(7, body, room_id=2**64 - 1, generation=7, minor=MINOR)
    assert encode(msg, minor=0) == frame_by_hand(7, body, room_id=2**64 - 1, generation=7, minor=0)
    for minor in (0, 1):
        assert decode(frame_by_hand(7, body, room_id=2**64 - 1, generation=7, minor=minor)) == msg


def test_codec_register_matches_hand_assembled_bytes() -> None:
    """REGISTER: strings, a nested record without prefix, bytes and a counted record list."""
    from kvproto.wire import WireRegion

    regions = (WireRegion(kind=0, index=0, address=0x1000, length=64, device_id=3, mem_kind=1),
               WireRegion(kind=1, index=0, address=0x2000, length=32, device_id=0, mem_kind=0))
    msg = Register(boot_id=9, instance="inst", link_id=4, agent_name="ag€nt", model_id="m", compat_key="",
                   geometry=GEOMETRY, aux_slots=2, aux_slot_bytes=16, transport="nixl",
                   transport_metadata=b"\x00\xff", regions=regions)
    body = (struct.pack("<Q", 9) + s("inst") + struct.pack("<I", 4) + s("ag€nt") + s("m") + s("")
            + GEOMETRY_BYTES + struct.pack("<II", 2, 16) + s("nixl") + struct.pack("<I", 2) + b"\x00\xff"
            + struct.pack("<I", 2)
            + struct.pack("<BIQQIB", 0, 0, 0x1000, 64, 3, 1) + struct.pack("<BIQQIB", 1, 0, 0x2000, 32, 0, 0))
    assert len(GEOMETRY_BYTES) == 27 and struct.calcsize("<BIQQIB") == 26
    assert encode(msg) == frame_by_hand(4, body, minor=MINOR)
    assert encode(msg, minor=0) == frame_by_hand(4, body, minor=0)
    assert decode(frame_by_hand(4, body)) == msg


def test_codec_register_carries_a_staging_region() -> None:
    """A REGISTER memory table may list a STAGING region (RegionKind 2, minor 1): one more 26-byte record."""
    from kvproto.wire import RegionKind, WireRegion

    staging = WireRegion(kind=RegionKind.STAGING, index=0, address=0x7F0000000000, length=1 << 26, device_id=1,
                         mem_kind=1)
    msg = Register(boot_id=9, instance="i", link_id=4, agent_name="a", model_id="m", compat_key="",
                   geometry=GEOMETRY, aux_slots=0, aux_slot_bytes=0, transport="nixl", transport_metadata=b"",
                   regions=(staging,))
    frame = encode(msg)
    assert frame[-26:] == struct.pack("<BIQQIB", 2, 0, 0x7F0000000000, 1 << 26, 1, 1)
    assert frame[-30:-26] == struct.pack("<I", 1)
    assert decode(frame) == msg


def test_codec_staging_request_matches_hand_assembled_bytes() -> None:
    """STAGING_REQUEST (type 11, minor 1): room and generation in the header, then seq, start, end as u32."""
    msg = StagingRequest(room_id=0xC0FFEE, generation=5, seq=3, start_token=64, end_token=2**32 - 1)
    body = struct.pack("<III", 3, 64, 0xFFFFFFFF)
    assert encode(msg) == frame_by_hand(11, body, room_id=0xC0FFEE, generation=5, minor=MINOR)
    assert decode(frame_by_hand(11, body, room_id=0xC0FFEE, generation=5, minor=1)) == msg


def test_codec_staging_grant_matches_hand_assembled_bytes() -> None:
    """STAGING_GRANT (type 12, minor 1): seq, start, end as u32, then the byte offset as u64."""
    msg = StagingGrant(room_id=1, generation=2, seq=3, start_token=64, end_token=80, offset=2**64 - 1)
    body = struct.pack("<IIIQ", 3, 64, 80, 2**64 - 1)
    assert len(body) == 20
    assert encode(msg) == frame_by_hand(12, body, room_id=1, generation=2, minor=MINOR)
    assert decode(frame_by_hand(12, body, room_id=1, generation=2, minor=1)) == msg


def test_codec_staging_watermark_matches_hand_assembled_bytes() -> None:
    """STAGING_WATERMARK (type 13, minor 1): seq as u32, then the watermark position as u64."""
    msg = StagingWatermark(room_id=1, generation=2, seq=7, watermark=0x0123456789ABCDEF)
    body = struct.pack("<IQ", 7, 0x0123456789ABCDEF)
    assert len(body) == 12
    assert encode(msg) == frame_by_hand(13, body, room_id=1, generation=2, minor=MINOR)
    assert decode(frame_by_hand(13, body, room_id=1, generation=2, minor=1)) == msg


def test_codec_staging_messages_have_no_optional_field() -> None:
    """Every field of the staging messages is required: a body cut before the last one is MalformedFrame."""
    for msg_type, body in ((11, struct.pack("<II", 1, 2)), (12, struct.pack("<IIII", 1, 2, 3, 4)),
                           (13, struct.pack("<II", 1, 2))):
        with pytest.raises(MalformedFrame):
            decode(frame_by_hand(msg_type, body, room_id=1, generation=1, minor=1))


def test_codec_cache_groups_layouts_are_a_trailing_optional_field() -> None:
    """(minor 4) CACHE_GROUPS's layouts follow its groups: a count, then per group a count of tensor
    layouts, each a u32[] of sections and a u64 slot stride. Left at its default the field is not
    sent, and a body that ends after the groups (a minor 2 or 3 sender's) decodes with none."""
    from kvproto.wire import CacheGroups, WireGroupLayout, WireTensorLayout

    plain = CacheGroups(link_id=9, groups=())
    body = struct.pack("<II", 9, 0)
    assert encode(plain) == frame_by_hand(14, body, minor=MINOR)
    layouts = (WireGroupLayout(tensors=()),
               WireGroupLayout(tensors=(WireTensorLayout(sections=(8, 8, 16), slot_stride=2**40 + 3),
                                        WireTensorLayout(sections=(), slot_stride=0))))
    full = dataclasses.replace(plain, layouts=layouts)
    tail = struct.pack("<I", 2) + struct.pack("<I", 0) + struct.pack("<I", 2) + struct.pack("<I3IQ", 3, 8, 8, 16,
                                                                                       2**40 + 3) + \
        struct.pack("<IQ", 0, 0)
    assert encode(full) == frame_by_hand(14, body + tail, minor=MINOR)
    assert decode(frame_by_hand(14, body + tail, minor=MINOR)) == full
    assert decode(frame_by_hand(14, body, minor=2)) == plain
    with pytest.raises(MalformedFrame):  # once the count is sent, its records must be there
        decode(frame_by_hand(14, body + tail[:-4], minor=MINOR))


def test_codec_string_length_counts_bytes_not_characters() -> None:
    """A str field's u16 prefix is the UTF-8 byte count."""
    frame = encode(BootstrapQuery(requester="🚀é"))
    assert frame[HEADER_SIZE:] == struct.pack("<H", 6) + "🚀é".encode()


def test_codec_encode_sets_version_flags_reserved() -> None:
    """encode writes magic KV, major 1, the requested minor (default: this build's, 5), flags 0 and reserved 0."""
    frame = encode(Abort(code=1, reason=""), minor=2)
    magic, major, minor, msg_type, flags, reserved, *_ = struct.unpack_from(HEADER_FMT, frame)
    assert (magic, major, minor, msg_type, flags, reserved) == (b"KV", 1, 2, 9, 0, 0)
    for msg, want in ((Abort(code=1, reason=""), MINOR), (StagingWatermark(seq=0, watermark=0), MINOR)):
        assert struct.unpack_from(HEADER_FMT, encode(msg))[:4] == (b"KV", 1, want, msg.MSG_TYPE)
    assert struct.unpack_from(HEADER_FMT, encode(Abort(code=1, reason=""), minor=0))[2] == 0


def test_codec_decode_frame_reports_header() -> None:
    """decode_frame returns the header as sent, including minor and unknown flags."""
    frame = frame_by_hand(10, struct.pack("<QQ", 1, 2), room_id=5, generation=6, minor=9, flags=0x81,
                          reserved=0xABCD)
    header, msg = decode_frame(frame)
    assert header == Header(msg_type=10, room_id=5, generation=6, flags=0x81, major=1, minor=9)
    assert msg == Heartbeat(room_id=5, generation=6, boot_id=1, seq=2)


def test_codec_decode_header_returns_body_view() -> None:
    """decode_header splits off exactly body_len bytes of body."""
    frame = encode(Heartbeat(boot_id=1, seq=2))
    header, body = decode_header(frame)
    assert header.msg_type == 10 and bytes(body) == frame[HEADER_SIZE:]


def test_codec_message_defaults_room_and_generation_zero() -> None:
    """room_id and generation default to 0 (no room, no generation)."""
    msg = Heartbeat(boot_id=1, seq=1)
    assert (msg.room_id, msg.generation) == (0, 0)


# --- decoding order (framing.md) ----------------------------------------------------------------


def test_codec_decode_order_size_before_everything() -> None:
    """An oversized input is FrameTooLarge even when it is not a frame at all."""
    with pytest.raises(FrameTooLarge):
        decode(b"\x00" * (16 * 1024 * 1024 + 1))


def test_codec_decode_order_short_header() -> None:
    """Fewer than 24 bytes is MalformedFrame, whatever they are."""
    for n in range(HEADER_SIZE):
        with pytest.raises(MalformedFrame):
            decode(encode(Heartbeat(boot_id=1, seq=1))[:n])


def test_codec_decode_order_major_before_body_len() -> None:
    """An unknown major is UnsupportedVersion even when body_len is also wrong."""
    frame = frame_by_hand(10, b"", major=2)
    frame = frame[:20] + struct.pack("<I", 999)
    with pytest.raises(UnsupportedVersion) as info:
        decode(frame)
    assert info.value.major == 2 and info.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_codec_decode_order_magic_before_major() -> None:
    """A bad magic is MalformedFrame even when the major is also unknown."""
    with pytest.raises(MalformedFrame) as info:
        decode(b"XY" + frame_by_hand(10, b"", major=7)[2:])
    assert not isinstance(info.value, UnsupportedVersion)


def test_codec_decode_unknown_type_carries_header() -> None:
    """An unknown msg_type raises UnknownMessage (a MalformedFrame) holding the header."""
    with pytest.raises(UnknownMessage) as info:
        decode(frame_by_hand(77, b"whatever", room_id=3, minor=4))
    assert isinstance(info.value, MalformedFrame)
    assert (info.value.header.msg_type, info.value.header.minor, info.value.header.room_id) == (77, 4, 3)


def test_codec_decode_unknown_type_of_newer_minor_is_ignorable() -> None:
    """Type 200 at minor 7 raises UnknownMessage carrying the header; its minor exceeds this build's
    MINOR (6), which is what lets a receiver ignore it (README.md, versioning)."""
    with pytest.raises(UnknownMessage) as info:
        decode(frame_by_hand(200, b"\x01\x02", room_id=0xC0FFEE, generation=9, minor=7, flags=0x80))
    header = info.value.header
    assert header == Header(msg_type=200, room_id=0xC0FFEE, generation=9, flags=0x80, major=1, minor=7)
    assert header.minor > MINOR
    assert info.value.code is ErrorCode.MALFORMED_FRAME
    with pytest.raises(UnknownMessage) as same_minor:
        decode(frame_by_hand(200, b"", minor=MINOR))
    assert not same_minor.value.header.minor > MINOR  # not newer: a violation, not ignorable


def test_codec_staging_types_are_unknown_to_a_minor0_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A version 1.0 decoder (types 1-10 only) meets a minor-1 STAGING_* frame as an UnknownMessage whose
    header minor (1) is greater than its own (0): ignorable, as the spec requires."""
    import kvproto.wire.messages as messages

    frames = [encode(StagingRequest(room_id=1, generation=2, seq=0, start_token=0, end_token=1), minor=1),
              encode(StagingGrant(room_id=1, generation=2, seq=0, start_token=0, end_token=1, offset=0), minor=1),
              encode(StagingWatermark(room_id=1, generation=2, seq=0, watermark=64), minor=1)]
    for msg_type in (11, 12, 13, 14, 15):
        monkeypatch.delitem(messages.MESSAGE_TYPES, msg_type)
    assert sorted(messages.MESSAGE_TYPES) == list(range(1, 11))
    for msg_type, frame in zip((11, 12, 13), frames):
        with pytest.raises(UnknownMessage) as info:
            decode(frame)
        assert (info.value.header.msg_type, info.value.header.minor) == (msg_type, 1)
        assert info.value.header.minor > 0  # a minor-0 receiver ignores it


def test_codec_decode_rejects_invalid_utf8() -> None:
    """A str field holding invalid UTF-8 (or an encoded surrogate) is MalformedFrame."""
    for bad in (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf"):
        with pytest.raises(MalformedFrame):
            decode(frame_by_hand(1, struct.pack("<H", len(bad)) + bad))


def test_codec_decode_rejects_body_shorter_than_fields() -> None:
    """A body ending before a required field is MalformedFrame (v1.0 has no optional fields)."""
    with pytest.raises(MalformedFrame):
        decode(frame_by_hand(10, struct.pack("<Q", 1)))
    with pytest.raises(MalformedFrame):
        decode(frame_by_hand(8, b""))


@pytest.mark.parametrize("extra", [1, 2, 3])
def test_codec_optional_field_cut_inside_its_count_is_malformed(extra: int) -> None:
    """A body that ends 1 to 3 bytes into TRANSFER_REQUEST's optional groups count is truncated, not
    absent (README.md: versioning), by the fast reader and by the steps alike; ended exactly where
    the count starts, or carrying a count of 0, the field takes its default."""
    from kvproto.wire.codec import _Reader

    body = struct.pack("<IIIHI", 100, 0, NO_SLOT, 1, 1) + struct.pack("<I", 7)
    want = TransferRequest(num_tokens=100, prefix_tokens=0, aux_slot=NO_SLOT, expected_writers=1, dst_pages=(7,))
    for minor in (2, 3):
        assert decode(frame_by_hand(7, body, minor=minor)) == want
        assert decode(frame_by_hand(7, body + bytes(4), minor=minor)) == want
        with pytest.raises(MalformedFrame, match="groups"):
            decode(frame_by_hand(7, body + b"\x01\x00\x00"[:extra], minor=minor))
    with pytest.raises(MalformedFrame, match="groups"):
        TransferRequest.decode_steps(_Reader(memoryview(body + b"\x01\x00\x00"[:extra])))


def test_codec_decode_ignores_trailing_bytes() -> None:
    """Bytes after the last known field are ignored, at minor 0 as at any other minor."""
    for minor in (0, 1, 2, 255):
        assert decode(frame_by_hand(10, struct.pack("<QQ", 1, 2) + b"future", minor=minor)) == Heartbeat(
            boot_id=1, seq=2)
        assert decode(frame_by_hand(12, struct.pack("<IIIQ", 1, 2, 3, 4) + b"future", minor=minor)) == StagingGrant(
            seq=1, start_token=2, end_token=3, offset=4)


def test_codec_decode_rejects_counts_beyond_the_frame() -> None:
    """Huge record and array counts fail as MalformedFrame without allocating."""
    with pytest.raises(MalformedFrame):
        decode(frame_by_hand(2, struct.pack("<HI", 1, 0xFFFFFFFF)))
    with pytest.raises(MalformedFrame):
        decode(frame_by_hand(7, struct.pack("<IIIHI", 1, 0, 0, 1, 0xFFFFFFFF)))


# --- exceptions and codes ----------------------------------------------------------------------


def test_codec_errors_hierarchy_and_codes() -> None:
    """Decode failures are RemoteProtocolErrors carrying their registry code."""
    assert issubclass(RemoteProtocolError, ProtocolError) and issubclass(LocalProtocolError, ProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)
    assert MalformedFrame("x").code is ErrorCode.MALFORMED_FRAME
    assert UnsupportedVersion("x", 2).code is ErrorCode.UNSUPPORTED_VERSION
    assert FrameTooLarge("x").code is ErrorCode.FRAME_TOO_LARGE
    assert issubclass(MalformedTag, MalformedFrame)
    assert issubclass(UnknownMessage, MalformedFrame)


def test_codec_error_code_coerce_keeps_unknown_numbers() -> None:
    """ErrorCode.coerce gives the member for known codes and the raw int for newer ones."""
    assert ErrorCode.coerce(5) is ErrorCode.INDEX_OUT_OF_RANGE
    assert ErrorCode.coerce(999) == 999 and not isinstance(ErrorCode.coerce(999), ErrorCode)


def test_codec_abort_keeps_unknown_code_number() -> None:
    """An ABORT with a code newer than this registry decodes with the number intact."""
    assert decode(encode(Abort(room_id=1, code=0xFFFF, reason="r"))).code == 0xFFFF


# --- the encoder never coerces (rule: refuse, never truncate) -----------------------------------


def test_codec_encode_rejects_non_str_for_str_field() -> None:
    """BUG (codec._encode_field): a non-str in a str field must raise TypeError, not AttributeError."""
    for wrong in (5, b"bytes", None):
        with pytest.raises(TypeError):
            encode(BootstrapQuery(requester=wrong))  # type: ignore[arg-type]


def test_codec_encode_rejects_int_for_bytes_field() -> None:
    """BUG (codec._encode_field): an int in a bytes field must raise TypeError, not encode n zero bytes."""
    reg = Register(boot_id=1, instance="i", link_id=1, agent_name="a", model_id="m", compat_key="",
                   geometry=GEOMETRY, aux_slots=0, aux_slot_bytes=0, transport="t", transport_metadata=b"",
                   regions=())
    with pytest.raises(TypeError):
        encode(dataclasses.replace(reg, transport_metadata=5))


def test_codec_encode_rejects_bytes_for_u32_array_field() -> None:
    """BUG (codec._encode_field): bytes in a u32[] field must raise TypeError, not be reinterpreted as u32s."""
    with pytest.raises(TypeError):
        encode(TransferRequest(num_tokens=1, prefix_tokens=0, aux_slot=0, expected_writers=1,
                               dst_pages=b"abcd"))  # type: ignore[arg-type]


# --- the written-out fast path (codec._Fast) against the compiled steps ----------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvproto.wire import MESSAGE_TYPES, GroupDestination  # noqa: E402
from kvproto.wire.codec import _MAX, _Fast, _Reader  # noqa: E402

FAST = [cls for cls in (*MESSAGE_TYPES.values(), GroupDestination) if _Fast.of(cls) is not None]


def test_the_bodies_on_every_rooms_path_have_a_fast_reader_and_writer() -> None:
    names = {cls.__name__ for cls in FAST}
    assert {"TransferRequest", "GroupDestination", "StagingRequest", "StagingGrant", "StagingWatermark",
            "TransferDone"} <= names
    assert _Fast.of(Abort) is None  # a string: the steps alone
    assert "def read" in (_Fast.code(TransferRequest) or "")


def _values(kind: object, valid: bool) -> st.SearchStrategy:
    if isinstance(kind, list):
        return st.lists(_bodies(kind[0], valid), max_size=3).map(tuple) if valid else \
            st.one_of(st.lists(_bodies(kind[0], valid), max_size=3).map(tuple),
                      st.lists(_bodies(kind[0], valid), max_size=2), st.just(None), st.just((1,)))
    if kind == "u32[]":
        items = st.integers(0, _MAX["u32"]) if valid else st.one_of(
            st.integers(-3, _MAX["u32"] + 3), st.booleans(), st.just(1.5))
        return st.lists(items, max_size=5).map(tuple) if valid else \
            st.one_of(st.lists(items, max_size=5).map(tuple), st.lists(items, max_size=5), st.just("ab"))
    top = _MAX[kind]  # type: ignore[index]
    if valid:
        return st.one_of(st.integers(0, top), st.sampled_from([0, top]))
    return st.one_of(st.integers(-2, top + 2), st.booleans(), st.just(None), st.just(2.0))


def _bodies(cls: type, valid: bool = True) -> st.SearchStrategy:
    head = {"room_id": st.integers(0, 2**64 - 1), "generation": st.integers(1, 2**32 - 1)} \
        if "room_id" in {f.name for f in dataclasses.fields(cls)} else {}
    return st.builds(cls, **head, **{name: _values(kind, valid) for name, kind in cls.FIELDS})


def _outcome(fn: object) -> tuple[str, object]:
    try:
        return "ok", fn()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the two paths must fail alike
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FAST).flatmap(lambda cls: _bodies(cls, valid=True)))
def test_the_fast_writer_takes_every_valid_body_itself(body: object) -> None:
    # giving up is always safe (the steps write it), so only this shows that the fast path is taken
    out = bytearray(b"x")
    assert _Fast.of(type(body)).write(body, out) is True  # type: ignore[union-attr]
    steps = bytearray(b"x")
    body.encode_steps(steps)  # type: ignore[attr-defined]
    assert bytes(out) == bytes(steps)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FAST).flatmap(lambda cls: _bodies(cls, valid=False)))
def test_the_fast_writer_writes_what_the_steps_write_or_leaves_it_to_them(body: object) -> None:
    def steps() -> bytes:
        out = bytearray(b"x")
        body.encode_steps(out)  # type: ignore[attr-defined]
        return bytes(out)

    def fast() -> bytes:
        out = bytearray(b"x")
        body.encode_into(out)  # type: ignore[attr-defined]
        return bytes(out)

    assert _outcome(fast) == _outcome(steps)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FAST).flatmap(lambda cls: st.tuples(st.just(cls), _bodies(cls))), st.data())
def test_the_fast_reader_reads_what_the_steps_read_on_any_bytes(case: tuple[type, object], data: st.DataObject
                                                                  ) -> None:
    cls, body = case
    out = bytearray()
    body.encode_into(out)  # type: ignore[attr-defined]
    whole = bytes(out)
    variants = [whole[:cut] for cut in range(len(whole) + 1)]  # every truncation
    variants.append(whole + data.draw(st.binary(max_size=6)))
    if whole:
        at = data.draw(st.integers(0, len(whole) - 1))
        variants.append(whole[:at] + bytes([whole[at] ^ data.draw(st.integers(1, 255))]) + whole[at + 1:])
    head = {"room_id": 5, "generation": 9} if "room_id" in {f.name for f in dataclasses.fields(cls)} else {}
    for raw in variants:
        def read(way: str, raw: bytes = raw) -> tuple[object, int]:
            r = _Reader(memoryview(raw))
            got = getattr(cls, way)(r, **head)
            return got, r.pos

        assert _outcome(lambda: read("decode_from")) == _outcome(lambda: read("decode_steps"))
    assert cls.decode_from(_Reader(memoryview(whole)), **head) == (
        dataclasses.replace(body, **head) if head else body)  # type: ignore[type-var]


def test_codec_equal_page_lists_of_a_request_decode_to_one_tuple_and_encode_once() -> None:
    """A group that names the first group's pages: its list decodes to the very tuple of
    ``dst_pages`` (no second tuple, identity for those who take it), both ways of encoding write
    the same bytes when one tuple is named twice, and lists that differ keep their own values."""
    from kvproto.wire import NO_SLOT, decode_frame, encode

    pages = tuple(range(1000, 1064))

    def request(dst: tuple[int, ...], group: tuple[int, ...]) -> TransferRequest:
        return TransferRequest(room_id=3, generation=1, num_tokens=64 * 16, prefix_tokens=0, aux_slot=0,
                               expected_writers=1, dst_pages=dst,
                               groups=(GroupDestination(first_page=0, pages=group, slot=NO_SLOT),
                                       GroupDestination(first_page=0, pages=(), slot=4)))

    same = request(pages, pages)
    steps, fast = bytearray(), bytearray()
    same.encode_steps(steps)
    same.encode_into(fast)
    assert bytes(fast) == bytes(steps)
    msg = decode_frame(encode(request(pages, tuple(pages))))[1]  # equal lists, two objects on the way out
    assert msg.dst_pages == pages and msg.groups[0].pages is msg.dst_pages and msg.groups[1].pages == ()
    other = tuple(reversed(pages))
    for dst, group in ((pages, other), (other, pages), (pages, pages[:-1])):
        msg = decode_frame(encode(request(dst, group)))[1]
        assert msg.dst_pages == dst and msg.groups[0].pages == group
        assert msg.groups[0].pages is not msg.dst_pages


def test_codec_a_repeated_request_body_decodes_to_the_kept_lists() -> None:
    """Every decode TP rank sends the same TRANSFER_REQUEST body for a room: an equal body decodes
    to the message kept from the first (itself under the same header; under another, a copy with
    that header's fields and the very same lists), equal to what a fresh decode gives. A body that
    differs decodes on its own; the kept bodies are bounded; a body that does not decode is not
    kept."""
    from kvproto.wire import NO_SLOT, codec

    codec._RECENT.clear()
    pages = tuple(range(2000, 2064))

    def request(gen: int, dst: tuple[int, ...] = pages, room: int = 77) -> TransferRequest:
        return TransferRequest(room_id=room, generation=gen, num_tokens=64 * 16, prefix_tokens=0, aux_slot=1,
                               expected_writers=1, dst_pages=dst,
                               groups=(GroupDestination(first_page=0, pages=dst, slot=NO_SLOT),
                                       GroupDestination(first_page=0, pages=(), slot=3)))

    first = decode(encode(request(5)))
    assert decode(encode(request(5))) is first
    again = decode(encode(request(6)))
    assert again is not first and (again.room_id, again.generation) == (77, 6)
    assert again.dst_pages is first.dst_pages and again.groups is first.groups
    assert again == request(6) and first == request(5)
    fresh = TransferRequest.decode_from(codec._Reader(memoryview(encode(request(6))[HEADER_SIZE:])), room_id=77,
                                        generation=6)  # past the kept bodies
    assert fresh is not again
    assert fresh == again
    other = decode(encode(request(5, pages[:-1] + (3,))))
    assert other.dst_pages[-1] == 3 and other.dst_pages is not first.dst_pages
    for room in range(codec.RECENT_BODIES):
        decode(encode(request(5, (room,))))
    assert len(codec._RECENT) == codec.RECENT_BODIES
    assert decode(encode(request(5))) is not first  # forgotten: decoded anew (and kept again)
    frame = bytearray(encode(request(9, (1, 2))))
    struct.pack_into("<I", frame, HEADER_SIZE + 14, 1000)  # a page count past the body's end
    kept = len(codec._RECENT)
    with pytest.raises(MalformedFrame):
        decode(bytes(frame))
    assert len(codec._RECENT) == kept


def test_compile_messages_leaves_no_code_to_compile_at_the_first_frame() -> None:
    """In a fresh interpreter, after ``compile_messages()`` (what an endpoint does when it starts),
    decoding and re-encoding every message vector of the spec compiles nothing: the first room
    of an endpoint pays for no code generation."""
    import subprocess
    import sys

    script = (
        "import builtins, json, pathlib\n"
        "from kvproto.wire.codec import encode_frame\n"
        "from kvproto.wire.messages import compile_messages, decode_frame\n"
        "compile_messages()\n"
        "def refuse(*a, **k):\n"
        "    raise AssertionError('compiled at a frame')\n"
        "builtins.compile = refuse\n"
        f"root = pathlib.Path({str(Path(__file__).resolve().parents[2] / 'spec' / 'v1' / 'vectors')!r})\n"
        "n = 0\n"
        "for entry in json.loads((root / 'index.json').read_text())['vectors']:\n"
        "    if entry['kind'] != 'frame' or entry['check'] != 'both': continue\n"
        "    frame = bytes.fromhex(''.join((root / entry['file']).read_text().split()))\n"
        "    header, msg = decode_frame(frame)\n"
        "    assert encode_frame(header, msg) == frame, entry['file']\n"
        "    n += 1\n"
        "print(n)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= len(MESSAGE_TYPES)
