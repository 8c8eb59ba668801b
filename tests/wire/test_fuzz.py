"""Hypothesis properties of the frame codec: nothing but a RemoteProtocolError ever escapes
decoding, encode/decode round-trips, and encoding refuses values that do not fit.

Example counts keep ``tests/wire`` well under a minute. For the heavy fuzz set
``KVPROTO_FUZZ_EXAMPLES`` (e.g. ``35000``): every decode property then runs that many examples,
and ``test_fuzz_decode_seeded_mutations_heavy`` runs that many seeded mutations of its own; the
terminal summary prints the number of frames decoded.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvproto.wire import (
    HEADER_SIZE,
    MAX_FRAME,
    MINOR,
    FrameTooLarge,
    Heartbeat,
    Message,
    Register,
    RemoteProtocolError,
    TransferRequest,
    WireGeometry,
    decode,
    decode_frame,
    encode,
)

from .fuzzing import (
    COUNTS,
    FUZZ_EXAMPLES,
    MESSAGE_CLASSES,
    UINT_MAX,
    decode_checked,
    fix_body_len,
    fuzz_settings,
    header_then_body,
    message_strategy,
    mutated_frames,
    quick_settings,
    random_message,
    random_mutation,
    record_strategy,
    value_strategy,
)

by_name = pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda c: c.MSG_TYPE.name)

# --- (a) arbitrary bytes -----------------------------------------------------------------------


@fuzz_settings(1000)
@given(st.binary(max_size=300))
def test_fuzz_decode_random_bytes_decode_or_protocol_error(data: bytes) -> None:
    """Any byte string decodes or raises a RemoteProtocolError subclass, nothing else."""
    decode_checked(data)


@fuzz_settings(1500)
@given(header_then_body())
def test_fuzz_decode_valid_header_random_body_decode_or_protocol_error(frame: bytes) -> None:
    """A well-formed header over any body decodes or raises a RemoteProtocolError subclass."""
    decode_checked(frame)


# --- (b) damaged valid frames ------------------------------------------------------------------


@fuzz_settings(2500)
@given(mutated_frames())
def test_fuzz_decode_mutated_frames_decode_or_protocol_error(frame: bytes) -> None:
    """Truncated and byte-mutated frames of every type decode or raise a RemoteProtocolError."""
    decode_checked(frame)


@by_name
@quick_settings(15)
@given(data=st.data())
def test_fuzz_decode_every_truncation_is_refused(cls: type[Message], data: st.DataObject) -> None:
    """Every proper prefix of a valid frame is refused (body_len no longer matches)."""
    frame = encode(data.draw(message_strategy(cls)))
    for n in range(len(frame)):
        assert decode_checked(frame[:n]) is None


@by_name
@quick_settings(10)
@given(data=st.data())
def test_fuzz_decode_every_truncated_body_with_fixed_len_is_refused(cls: type[Message], data: st.DataObject) -> None:
    """A body cut anywhere before its last field, with body_len patched to match, is refused, except
    exactly where its optional additions begin (README.md: an absent addition takes its default)."""
    msg = data.draw(message_strategy(cls))
    frame = encode(msg)
    optional_at = HEADER_SIZE + spec_body_size(msg, cls.OPTIONAL_FROM) if cls.OPTIONAL_FROM is not None else None
    for n in range(HEADER_SIZE, len(frame)):
        cut = decode_checked(fix_body_len(frame[:n]))
        if n == optional_at:
            assert cut is not None and all(getattr(cut, f) == getattr(msg, f) for f, _ in cls.FIELDS[:cls.OPTIONAL_FROM])
        else:
            assert cut is None


def test_fuzz_decode_seeded_mutations_light() -> None:
    """A fixed-seed sweep of 3,000 mutated frames of every type keeps the decode property."""
    rng = random.Random(20240601)
    for _ in range(3000):
        decode_checked(random_mutation(rng, encode(random_message(rng), minor=rng.choice((0, 1, 255)))))


@pytest.mark.slow
@pytest.mark.skipif(not FUZZ_EXAMPLES, reason="heavy fuzz: set KVPROTO_FUZZ_EXAMPLES")
def test_fuzz_decode_seeded_mutations_heavy() -> None:
    """KVPROTO_FUZZ_EXAMPLES seeded random messages, each mutated, keep the decode property."""
    rng = random.Random(FUZZ_EXAMPLES)
    before = COUNTS["frames"]
    for _ in range(FUZZ_EXAMPLES):
        msg = random_message(rng)
        frame = encode(msg, minor=rng.choice((0, 1, 255)))
        assert decode_checked(frame) == msg
        decode_checked(random_mutation(rng, frame))
    assert COUNTS["frames"] - before == 2 * FUZZ_EXAMPLES


# --- (c) round trips ---------------------------------------------------------------------------


@by_name
@quick_settings(60)
@given(data=st.data())
def test_fuzz_roundtrip_decode_encode_is_identity(cls: type[Message], data: st.DataObject) -> None:
    """decode(encode(m)) == m, the header carries m's type, room, generation and version (this build's
    minor by default), and re-encoding with the frame's own minor gives the same bytes."""
    msg = data.draw(message_strategy(cls))
    minor = data.draw(st.sampled_from([None, 0, 1, 2, 255]))
    frame = encode(msg) if minor is None else encode(msg, minor=minor)
    COUNTS["frames"] += 1
    header, back = decode_frame(frame)
    assert back == msg
    assert (header.msg_type, header.room_id, header.generation) == (cls.MSG_TYPE, msg.room_id, msg.generation)
    assert (header.major, header.minor, header.flags) == (1, MINOR if minor is None else minor, 0)
    assert len(frame) == HEADER_SIZE + spec_body_size(msg)
    assert encode(back, minor=header.minor) == frame


@by_name
@quick_settings(30)
@given(data=st.data())
def test_fuzz_roundtrip_newer_minor_with_trailing_bytes(cls: type[Message], data: st.DataObject) -> None:
    """A frame of any minor with unknown trailing fields decodes to the same message (bytes after the
    last field a decoder knows: a message whose optional additions are sent)."""
    msg = data.draw(message_strategy(cls))
    assume(spec_body_size(msg) == spec_body_size(msg, len(cls.FIELDS)))
    minor = data.draw(st.integers(0, 255))
    extra = data.draw(st.binary(max_size=64))
    frame = fix_body_len(encode(msg, minor=minor) + extra)
    COUNTS["frames"] += 1
    header, back = decode_frame(frame)
    assert back == msg
    assert header.minor == minor
    again = encode(back, minor=header.minor)
    assert again == fix_body_len(frame[: len(frame) - len(extra)])


def spec_body_size(body: Any, fields: int | None = None) -> int:
    """The body size that framing.md's kind table gives, computed independently of the codec: its
    first ``fields`` fields, or (by default) every field but trailing optional ones left empty."""
    names = body.FIELDS
    if fields is None:
        fields = len(names)
        optional = body.OPTIONAL_FROM
        while optional is not None and fields > optional and getattr(body, names[fields - 1][0]) in ((), "", b"", 0):
            fields -= 1
    size = 0
    for name, kind in names[:fields]:
        value = getattr(body, name)
        if isinstance(kind, str) and kind in UINT_MAX:
            size += {"u8": 1, "u16": 2, "u32": 4, "u64": 8}[kind]
        elif kind == "str":
            size += 2 + len(value.encode("utf-8"))
        elif kind == "bytes":
            size += 4 + len(value)
        elif kind == "u32[]":
            size += 4 + 4 * len(value)
        elif isinstance(kind, list):
            size += 4 + sum(spec_body_size(item) for item in value)
        else:
            size += spec_body_size(value)
    return size


# --- (d) encode refuses what does not fit --------------------------------------------------------


def _int_targets(cls: type[Message]) -> list[tuple[tuple[Any, ...], str]]:
    """Paths to every integer field of ``cls``: header, body, nested records, record lists."""
    out: list[tuple[tuple[Any, ...], str]] = [(("room_id",), "u64"), (("generation",), "u32")]
    for name, kind in cls.FIELDS:
        if isinstance(kind, str):
            if kind in UINT_MAX:
                out.append(((name,), kind))
        elif isinstance(kind, list):
            out += [((name, 0, sub), k) for sub, k in kind[0].FIELDS if isinstance(k, str) and k in UINT_MAX]
        else:
            out += [((name, sub), k) for sub, k in kind.FIELDS if isinstance(k, str) and k in UINT_MAX]
    return out


def _replace(obj: Any, path: tuple[Any, ...], value: Any, data: st.DataObject, cls: Any) -> Any:
    head, *rest = path
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    child = getattr(obj, head)
    if isinstance(rest[0], int):  # a record list: make sure it has an item 0 to corrupt
        items = list(child) or [data.draw(record_strategy(dict(cls.FIELDS)[head][0]))]
        sub_cls = type(items[0])
        items[0] = _replace(items[0], tuple(rest[1:]), value, data, sub_cls)
        return dataclasses.replace(obj, **{head: tuple(items)})
    return dataclasses.replace(obj, **{head: _replace(child, tuple(rest), value, data, type(child))})


def _out_of_range(kind: str) -> st.SearchStrategy[int]:
    top = UINT_MAX[kind]
    return st.one_of(st.integers(max_value=-1), st.integers(min_value=top + 1), st.sampled_from([-1, top + 1, 2**64, 2**64 + 1]))


@by_name
@quick_settings(60)
@given(data=st.data())
def test_fuzz_encode_rejects_out_of_range_ints(cls: type[Message], data: st.DataObject) -> None:
    """An integer outside its field's width, anywhere in a message, raises ValueError."""
    msg = data.draw(message_strategy(cls))
    path, kind = data.draw(st.sampled_from(_int_targets(cls)))
    bad = _replace(msg, path, data.draw(_out_of_range(kind)), data, cls)
    with pytest.raises(ValueError):
        encode(bad)


@by_name
@quick_settings(40)
@given(data=st.data())
def test_fuzz_encode_rejects_non_int_for_int_fields(cls: type[Message], data: st.DataObject) -> None:
    """A float, string, bytes or None where an integer belongs raises TypeError or ValueError."""
    msg = data.draw(message_strategy(cls))
    path, _ = data.draw(st.sampled_from(_int_targets(cls)))
    wrong = data.draw(st.sampled_from([1.0, 0.5, "1", b"\x01", None, [1]]))
    bad = _replace(msg, path, wrong, data, cls)
    with pytest.raises((TypeError, ValueError)):
        encode(bad)


_ARRAY_FIELDS = [(cls, name) for cls in MESSAGE_CLASSES for name, kind in cls.FIELDS if kind == "u32[]"]


@pytest.mark.parametrize("cls,name", _ARRAY_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in _ARRAY_FIELDS])
@quick_settings(60)
@given(data=st.data())
def test_fuzz_encode_rejects_out_of_range_array_elements(cls: type[Message], name: str, data: st.DataObject) -> None:
    """A u32[] holding a negative or > 2**32-1 element raises ValueError; a float raises TypeError."""
    msg = data.draw(message_strategy(cls))
    good = list(data.draw(value_strategy("u32[]")))
    at = data.draw(st.integers(0, len(good)))
    bad_value = data.draw(st.one_of(_out_of_range("u32"), st.just(1.5)))
    good.insert(at, bad_value)
    with pytest.raises(TypeError if isinstance(bad_value, float) else ValueError):
        encode(dataclasses.replace(msg, **{name: tuple(good)}))


_STR_FIELDS = [(cls, name) for cls in MESSAGE_CLASSES for name, kind in cls.FIELDS if kind == "str"]


@pytest.mark.parametrize("cls,name", _STR_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in _STR_FIELDS])
def test_fuzz_encode_string_length_bound_counts_utf8_bytes(cls: type[Message], name: str) -> None:
    """A string of 65,535 UTF-8 bytes encodes and round-trips; one of 65,536 bytes raises ValueError."""
    msg = random_message_of(cls)
    fits = "é" * 32767 + "x"  # 65,535 bytes, 32,768 characters
    assert decode(encode(dataclasses.replace(msg, **{name: fits}))) == dataclasses.replace(msg, **{name: fits})
    with pytest.raises(ValueError):
        encode(dataclasses.replace(msg, **{name: "é" * 32768}))  # 65,536 bytes
    with pytest.raises(ValueError):
        encode(dataclasses.replace(msg, **{name: "x" * 65536}))


def test_fuzz_encode_rejects_minor_out_of_range() -> None:
    """encode(minor=256) and encode(minor=-1) raise ValueError."""
    for minor in (256, -1):
        with pytest.raises(ValueError):
            encode(Heartbeat(boot_id=1, seq=1), minor=minor)


def test_fuzz_encode_rejects_wrong_record_types() -> None:
    """A record of the wrong type, or a non-record in a record list, raises TypeError."""
    reg = random_message_of(Register)
    with pytest.raises(TypeError):
        encode(dataclasses.replace(reg, geometry=reg.regions[0] if reg.regions else None))
    with pytest.raises(TypeError):
        encode(dataclasses.replace(reg, regions=(reg.geometry,)))
    with pytest.raises(TypeError):
        encode(dataclasses.replace(reg, regions=None))


def random_message_of(cls: type[Message], seed: int = 7) -> Any:
    rng = random.Random(seed)
    while True:
        msg = random_message(rng)
        if type(msg) is cls:
            return msg


# --- (e) the size bound ------------------------------------------------------------------------


def _register_of_size(total: int) -> Register:
    """A REGISTER whose encoded frame is exactly ``total`` bytes (padding in transport_metadata)."""
    base = Register(
        boot_id=1, instance="i", link_id=1, agent_name="a", model_id="m", compat_key="",
        geometry=WireGeometry(tp_size=1, tp_rank=0, num_layers=1, num_kv_heads=1, head_dim=1, dtype=1,
                              block_size=1, layout=0, mla=0, num_blocks=1),
        aux_slots=0, aux_slot_bytes=0, transport="t", transport_metadata=b"", regions=(),
    )
    return dataclasses.replace(base, transport_metadata=bytes(total - len(encode(base))))


def test_fuzz_size_max_frame_exactly_encodes_and_decodes() -> None:
    """A frame of exactly MAX_FRAME bytes encodes and decodes."""
    msg = _register_of_size(MAX_FRAME)
    frame = encode(msg)
    assert len(frame) == MAX_FRAME
    assert decode(frame) == msg


def test_fuzz_size_encode_refuses_frame_over_max() -> None:
    """Encoding a message whose frame would be MAX_FRAME + 1 bytes raises ValueError."""
    with pytest.raises(ValueError):
        encode(_register_of_size(MAX_FRAME + 1))
    pages = (MAX_FRAME - HEADER_SIZE - 18) // 4
    assert len(encode(TransferRequest(num_tokens=1, prefix_tokens=0, aux_slot=0, expected_writers=1,
                                      dst_pages=(0,) * pages))) <= MAX_FRAME
    with pytest.raises(ValueError):
        encode(TransferRequest(num_tokens=1, prefix_tokens=0, aux_slot=0, expected_writers=1,
                               dst_pages=(0,) * (pages + 1)))


def test_fuzz_size_decode_refuses_frame_over_max() -> None:
    """A consistent frame of MAX_FRAME + 1 bytes raises FrameTooLarge before anything else."""
    frame = encode(_register_of_size(MAX_FRAME))
    with pytest.raises(FrameTooLarge):
        decode(fix_body_len(frame + b"\x00"))
    with pytest.raises(FrameTooLarge):
        decode(bytes(MAX_FRAME + 1))  # not even a header: the size is checked first
    with pytest.raises(FrameTooLarge):
        decode(b"XX" + bytes(MAX_FRAME + 64))


@quick_settings(20)
@given(extra=st.integers(1, 4096), head=st.binary(min_size=0, max_size=32))
def test_fuzz_size_any_oversized_input_is_frame_too_large(extra: int, head: bytes) -> None:
    """Any input longer than MAX_FRAME raises FrameTooLarge, whatever its first bytes."""
    data = head + bytes(MAX_FRAME + extra - len(head))
    COUNTS["frames"] += 1
    with pytest.raises(FrameTooLarge) as info:
        decode(data)
    assert isinstance(info.value, RemoteProtocolError)


def test_fuzz_size_max_frame_value() -> None:
    """MAX_FRAME is 16 MiB, as spec/v1/README.md says."""
    assert MAX_FRAME == 16_777_216


def test_fuzz_decode_accepts_bytearray_and_memoryview() -> None:
    """decode takes any bytes-like frame and gives the same message."""
    msg = Heartbeat(room_id=3, generation=4, boot_id=5, seq=6)
    frame = encode(msg)
    assert decode(bytearray(frame)) == decode(memoryview(frame)) == msg
    assert struct.unpack_from("<I", frame, 20)[0] == 16
