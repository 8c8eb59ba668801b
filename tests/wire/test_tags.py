"""The 24-byte notification tag: layout, round trip, and nothing but MalformedTag on bad input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproto.wire import TAG_SIZE, MalformedTag, Tag, TagKind, decode_tag

from .fuzzing import UINT_MAX, decode_tag_checked, fuzz_settings, quick_settings, tags

TAG_FMT = "<2sBBQIII"  # tags.md: magic, version, kind, room_id, generation, link_id, seq


def test_tags_size_is_24() -> None:
    """A tag is exactly 24 bytes."""
    assert TAG_SIZE == struct.calcsize(TAG_FMT) == 24


def test_tags_kind_values() -> None:
    """Tag kinds are wire numbers: KV 1, STAGED 2."""
    assert {k.name: k.value for k in TagKind} == {"KV": 1, "STAGED": 2}


def test_tags_matches_hand_assembled_bytes() -> None:
    """Tag.encode packs magic KT, version 1, kind, room, generation, link and seq little-endian."""
    tag = Tag(kind=TagKind.STAGED, room_id=0x1122334455667788, generation=0x99AABBCC, link_id=7, seq=0xFFFFFFFF)
    expected = struct.pack(TAG_FMT, b"KT", 1, 2, 0x1122334455667788, 0x99AABBCC, 7, 0xFFFFFFFF)
    assert tag.encode() == expected
    assert decode_tag(expected) == tag


def test_tags_carry_no_names() -> None:
    """A tag has only fixed-width numeric fields: no agent name can make it ambiguous."""
    assert set(Tag.__dataclass_fields__) == {"kind", "room_id", "generation", "link_id", "seq"}


@quick_settings(300)
@given(tags)
def test_tags_roundtrip(tag: Tag) -> None:
    """decode_tag(tag.encode()) == tag, and the encoding is always 24 bytes."""
    data = tag.encode()
    assert len(data) == TAG_SIZE
    assert decode_tag_checked(data) == tag


@fuzz_settings(500)
@given(st.binary(max_size=40))
def test_tags_decode_random_bytes_decode_or_malformed(data: bytes) -> None:
    """Any byte string decodes as a tag or raises MalformedTag, nothing else."""
    decode_tag_checked(data)


@fuzz_settings(500)
@given(st.binary(min_size=21, max_size=21), st.sampled_from([b"KT\x01", b"KT\x02", b"KV\x01", b"KT\x00"]))
def test_tags_decode_near_valid_decode_or_malformed(rest: bytes, prefix: bytes) -> None:
    """24-byte strings with a (nearly) valid prefix decode or raise MalformedTag."""
    tag = decode_tag_checked(prefix + rest)
    if tag is not None:
        assert prefix == b"KT\x01" and rest[0] in (1, 2)


def test_tags_every_single_byte_mutation_decodes_or_malformed() -> None:
    """Every one-byte change of a valid tag decodes (to a different tag) or raises MalformedTag."""
    base = Tag(kind=TagKind.KV, room_id=1, generation=2, link_id=3, seq=4).encode()
    for i in range(TAG_SIZE):
        for v in range(256):
            if v == base[i]:
                continue
            mutated = base[:i] + bytes([v]) + base[i + 1 :]
            tag = decode_tag_checked(mutated)
            if i < 4:
                assert (tag is None) == (i < 3 or v not in (1, 2))
            else:
                assert tag is not None and tag.encode() == mutated


def test_tags_wrong_length_is_malformed() -> None:
    """Every length other than 24 is MalformedTag."""
    valid = Tag(kind=TagKind.KV, room_id=1, generation=2, link_id=3, seq=4).encode()
    for n in list(range(TAG_SIZE)) + [25, 48]:
        with pytest.raises(MalformedTag):
            decode_tag((valid * 2)[:n])


def test_tags_encode_rejects_out_of_range_with_value_error() -> None:
    """BUG (tags.Tag.encode): out-of-range fields must raise ValueError; struct.error escapes instead."""
    for field, top in (("room_id", UINT_MAX["u64"]), ("generation", UINT_MAX["u32"]),
                       ("link_id", UINT_MAX["u32"]), ("seq", UINT_MAX["u32"])):
        for bad in (-1, top + 1):
            values = {"kind": TagKind.KV, "room_id": 1, "generation": 1, "link_id": 1, "seq": 1, field: bad}
            with pytest.raises(ValueError):
                Tag(**values).encode()


def test_tags_encode_rejects_unknown_kind() -> None:
    """BUG (tags.Tag.encode): a kind outside TagKind must be refused, not encoded into a tag decode_tag rejects."""
    with pytest.raises((ValueError, TypeError)):
        Tag(kind=9, room_id=1, generation=1, link_id=1, seq=1).encode()  # type: ignore[arg-type]
