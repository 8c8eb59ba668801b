"""The golden vectors of spec/v1/vectors, checked both ways against the codec."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import kvproto.wire as wire
from kvproto.transport.base import pack_tags, unpack_tags
from kvproto.wire import (
    MESSAGE_TYPES,
    MINOR,
    ErrorCode,
    Header,
    MsgType,
    decode_frame,
    encode,
)
from kvproto.wire.codec import Body
from kvproto.wire.tags import Tag, TagKind, decode_tag

from .fuzzing import decode_checked, decode_tag_checked

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "v1" / "vectors"
INDEX = json.loads((VECTORS / "index.json").read_text(encoding="utf-8"))
ENTRIES: list[dict[str, Any]] = INDEX["vectors"]
BY_FILE = {e["file"]: e for e in ENTRIES}


def read_vector(name: str) -> bytes:
    return bytes.fromhex("".join((VECTORS / name).read_text().split()))


def from_json(cls: type[Body], fields: dict[str, Any], **header: int) -> Any:
    """Build a body of ``cls`` from its JSON form (records: objects, bytes: hex, arrays: lists)."""
    kwargs: dict[str, Any] = dict(header)
    names = [name for name, _ in cls.FIELDS]
    required = set(names[:cls.OPTIONAL_FROM]) if cls.OPTIONAL_FROM is not None else set(names)
    assert required <= set(fields) <= set(names), f"{cls.__name__}: fields {sorted(fields)}"
    for name, kind in cls.FIELDS:
        if name not in fields:
            continue  # an optional addition absent from the frame: its default
        value = fields[name]
        if kind == "bytes":
            kwargs[name] = bytes.fromhex(value)
        elif kind == "u32[]":
            kwargs[name] = tuple(value)
        elif isinstance(kind, str):
            kwargs[name] = value
        elif isinstance(kind, list):
            kwargs[name] = tuple(from_json(kind[0], item) for item in value)
        else:
            kwargs[name] = from_json(kind, value)
    return cls(**kwargs)


def entry_message(entry: dict[str, Any]) -> Any:
    cls = MESSAGE_TYPES[MsgType[entry["message"]]]
    assert entry["msg_type"] == cls.MSG_TYPE
    h = entry["header"]
    return from_json(cls, entry["body"], room_id=h["room_id"], generation=h["generation"])


def entry_tag(entry: dict[str, Any]) -> Tag:
    t = entry["tag"]
    return Tag(kind=TagKind[t["kind"]], room_id=t["room_id"], generation=t["generation"], link_id=t["link_id"],
               seq=t["seq"])


def ids(entries: list[dict[str, Any]]) -> list[str]:
    return [e["file"].removesuffix(".hex") for e in entries]


FRAMES_BOTH = [e for e in ENTRIES if e["kind"] == "frame" and e["check"] == "both"]
FRAMES_DECODE = [e for e in ENTRIES if e["kind"] == "frame" and e["check"] == "decode"]
FRAMES_REJECT = [e for e in ENTRIES if e["kind"] == "frame" and e["check"] == "reject"]
FRAMES_REFUSE = [e for e in ENTRIES if e["kind"] == "frame" and e["check"] == "refuse"]
"""Wire-valid frames that a check of messages.md refuses: both ways here, the refusal in
``tests/aio/test_vector_refusals.py``."""
FRAMES_VALID = FRAMES_BOTH + FRAMES_REFUSE
TAGS_BOTH = [e for e in ENTRIES if e["kind"] == "tag" and e["check"] == "both"]
TAGS_REJECT = [e for e in ENTRIES if e["kind"] == "tag" and e["check"] == "reject"]
LISTS_BOTH = [e for e in ENTRIES if e["kind"] == "list" and e["check"] == "both"]
LISTS_REJECT = [e for e in ENTRIES if e["kind"] == "list" and e["check"] == "reject"]


# --- the collection itself ----------------------------------------------------------------------


def test_vectors_index_lists_every_file_once() -> None:
    """Every .hex file has exactly one index entry and every entry names an existing file."""
    files = sorted(p.name for p in VECTORS.glob("*.hex"))
    named = [e["file"] for e in ENTRIES]
    assert len(named) == len(set(named))
    assert sorted(named) == files


def test_vectors_files_are_lowercase_wrapped_hex() -> None:
    """Vector files are lowercase hex, at most 64 digits per line, with a final newline."""
    for path in VECTORS.glob("*.hex"):
        text = path.read_text()
        assert text.endswith("\n"), path.name
        for line in text.splitlines():
            assert re.fullmatch(r"[0-9a-f]{2,64}", line) and len(line) % 2 == 0, (path.name, line)


def test_vectors_entries_are_well_formed() -> None:
    """Every entry has a known kind and check, and the keys its check needs."""
    for e in ENTRIES:
        assert e["kind"] in ("frame", "tag", "list") and e["check"] in ("both", "decode", "reject", "refuse"), e["file"]
        assert e.get("note"), e["file"]
        if e["check"] == "reject":
            assert hasattr(wire, e["error"]) and e["code"] in ErrorCode.__members__, e["file"]
        elif e["kind"] == "frame":
            assert set(e["header"]) == {"room_id", "generation", "minor", "flags"}, e["file"]
        if e["check"] == "refuse":
            assert e["kind"] == "frame" and "error" not in e and e["code"] in ErrorCode.__members__, e["file"]


def test_vectors_cover_every_message_type() -> None:
    """At least one both-ways vector exists for every message type."""
    assert {MsgType[e["message"]] for e in FRAMES_BOTH} == set(MsgType)


def test_vectors_cover_every_tag_kind() -> None:
    """At least one both-ways tag vector exists for every tag kind."""
    assert {TagKind[e["tag"]["kind"]] for e in TAGS_BOTH} == set(TagKind)


def test_vectors_cover_the_edge_cases() -> None:
    """The edge cases the spec promises have vectors."""
    both = [entry_message(e) for e in FRAMES_BOTH]
    assert any(getattr(m, "dst_pages", None) == () for m in both), "an empty page list"
    assert any(m.room_id == 2**64 - 1 for m in both), "room id 2**64-1"
    assert any(getattr(m, "aux_slot", None) == wire.NO_SLOT for m in both), "NO_SLOT"
    assert any(getattr(m, "ranks", None) == () for m in both), "an empty record list"
    assert any(getattr(m, "transport_metadata", None) == b"" for m in both), "empty bytes"
    strings = [v for m in both for name, kind in m.FIELDS if kind == "str" for v in [getattr(m, name)]]
    assert any(any(ord(c) > 0xFFFF for c in v) for v in strings), "a 4-byte UTF-8 character"
    assert any(any(0x7F < ord(c) <= 0x7FF for c in v) for v in strings), "a 2-byte UTF-8 character"
    assert any(e["header"]["minor"] > 0 and e.get("twin") for e in FRAMES_DECODE), "newer minor + trailing bytes"
    assert any(e["header"]["flags"] for e in FRAMES_DECODE), "unknown flag bits"
    assert {e["error"] for e in FRAMES_REJECT} >= {"MalformedFrame", "UnsupportedVersion", "UnknownMessage"}
    # minor 1 (staging)
    assert any(getattr(m, "end_token", None) == 2**32 - 1 for m in both), "a token bound of 2**32-1"
    assert any(getattr(m, "offset", None) == 2**64 - 1 for m in both), "a staging offset of 2**64-1"
    assert any(getattr(m, "watermark", None) == 2**64 - 1 for m in both), "a watermark of 2**64-1"
    assert any(e["msg_type"] == MsgType.STAGING_GRANT and e["header"]["minor"] > MINOR and e.get("twin")
               for e in FRAMES_DECODE), "a STAGING_GRANT of a newer minor with trailing bytes"
    assert any(e["header"]["minor"] == MINOR for e in FRAMES_BOTH), "frames of this build's minor"
    # minor 2 (cache groups)
    assert any(getattr(m, "groups", None) and m.MSG_TYPE == MsgType.TRANSFER_REQUEST for m in both), "group destinations"
    assert any(any(r.kind == wire.RegionKind.GROUP for r in getattr(m, "regions", ())) for m in both), "GROUP regions"
    assert any(t.shard_dim == wire.NO_SHARD or t.shard_dim == 0 for m in both for g in getattr(m, "groups", ())
               if isinstance(g, wire.WireGroup) for t in g.tensors), "state tensors"
    assert any(e["header"]["minor"] == 0 for e in FRAMES_BOTH), "version 1.0 frames"
    # minor 4 (state layouts)
    layouts = [t for m in both if m.MSG_TYPE == MsgType.CACHE_GROUPS for g in m.layouts for t in g.tensors]
    assert any(len(t.sections) > 1 for t in layouts), "a sectioned state tensor"
    assert any(t.slot_stride for t in layouts), "strided slots"
    assert any(m.MSG_TYPE == MsgType.CACHE_GROUPS and any(not g.tensors for g in m.layouts) for m in both), \
        "a paged group's empty layout"


def test_vectors_an_absent_optional_field_leaves_the_body_unchanged() -> None:
    """A minor-2 TRANSFER_REQUEST with no groups is byte for byte the 1.0 body: the optional field is
    left out, not sent empty (README.md: versioning)."""
    a, b = read_vector("transfer_request.hex"), read_vector("transfer_request_no_groups_minor2.hex")
    assert a[24:] == b[24:] and (a[3], b[3]) == (0, 2)


def test_vectors_bodies_list_every_field_but_optional_ones_at_their_defaults() -> None:
    """A frame entry's body names every required field of its message and an optional one exactly
    when it holds more than its default (vectors/README.md: the index key body)."""
    for e in FRAMES_VALID + FRAMES_DECODE:
        msg = decode_frame(read_vector(e["file"]))[1]
        assert list(e["body"]) == [name for name, _ in msg.sent_fields()], e["file"]
    assert "groups" not in BY_FILE["transfer_request_groups_empty.hex"]["body"]


def test_vectors_refuse_entries_name_the_frames_of_one_link() -> None:
    """A refuse vector lists, in order, wire-valid vectors of one link that end with a REGISTER
    (answered by REGISTER_REJECT) or a TRANSFER_REQUEST (answered by ABORT), itself among them, and
    names the check of messages.md that refuses."""
    assert FRAMES_REFUSE
    answers = {"REGISTER": "REGISTER_REJECT", "TRANSFER_REQUEST": "ABORT"}
    for e in FRAMES_REFUSE:
        frames = [BY_FILE[name] for name in e["frames"]]
        assert e["file"] in e["frames"] and all(f["check"] in ("both", "refuse") for f in frames), e["file"]
        assert [f["file"] for f in frames if f["check"] == "refuse"] == [e["file"]], e["file"]
        assert e["answer"] == answers[frames[-1]["message"]], e["file"]
        assert re.fullmatch(r"messages\.md, [A-Z_]+ check \d+[a-z]?", e["rule"]), e["file"]
        links = {f["body"]["link_id"] for f in frames if "link_id" in f["body"]}
        assert len(links) <= 1, e["file"]


def test_vectors_cache_groups_without_layouts_is_the_minor2_body() -> None:
    """A minor-4 CACHE_GROUPS whose groups need no layouts leaves the optional field out: its body is
    the minor-2 vector's; with layouts, the body is that one followed by them."""
    a, b = read_vector("cache_groups.hex"), read_vector("cache_groups_no_layouts_minor4.hex")
    assert a[24:] == b[24:] and (a[3], b[3]) == (2, 4)
    with_layouts = read_vector("cache_groups_layouts.hex")
    assert with_layouts[24:].startswith(a[24:]) and len(with_layouts) > len(a)


def test_vectors_unknown_type_vectors_carry_their_minor() -> None:
    """The unknown-type reject vectors raise UnknownMessage with their header: one of a minor newer than
    this build (ignorable here) and one not newer (a violation here)."""
    newer = []
    for e in FRAMES_REJECT:
        if e["error"] != "UnknownMessage":
            continue
        with pytest.raises(wire.UnknownMessage) as info:
            decode_frame(read_vector(e["file"]))
        assert info.value.header.msg_type not in MESSAGE_TYPES
        newer.append(info.value.header.minor > MINOR)
    assert True in newer and False in newer


def test_vectors_generator_is_in_sync() -> None:
    """generate.py --check finds every vector present and identical (it never rewrites one)."""
    spec = importlib.util.spec_from_file_location("kvproto_vectors_generate", VECTORS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    try:
        spec.loader.exec_module(module)
        assert module.main(["--check"]) == 0
    finally:
        del sys.modules[spec.name]


# --- frames ------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", FRAMES_VALID, ids=ids(FRAMES_VALID))
def test_vectors_frame_decodes_to_its_fields(entry: dict[str, Any]) -> None:
    """decode(vector) gives the header and the fields of index.json (refuse vectors too)."""
    header, msg = decode_frame(read_vector(entry["file"]))
    h = entry["header"]
    assert header == Header(msg_type=entry["msg_type"], room_id=h["room_id"], generation=h["generation"],
                            flags=h["flags"], major=1, minor=h["minor"])
    assert msg == entry_message(entry)


@pytest.mark.parametrize("entry", FRAMES_VALID, ids=ids(FRAMES_VALID))
def test_vectors_frame_encodes_to_its_bytes(entry: dict[str, Any]) -> None:
    """encode(fields of index.json) gives exactly the vector's bytes (refuse vectors too)."""
    assert encode(entry_message(entry), minor=entry["header"]["minor"]) == read_vector(entry["file"])


@pytest.mark.parametrize("entry", FRAMES_DECODE, ids=ids(FRAMES_DECODE))
def test_vectors_decode_only_frame_decodes_like_its_twin(entry: dict[str, Any]) -> None:
    """A newer-minor / trailing-bytes / flags vector decodes to its fields and to its twin's message."""
    header, msg = decode_frame(read_vector(entry["file"]))
    h = entry["header"]
    assert (header.msg_type, header.room_id, header.generation, header.minor, header.flags) == (
        entry["msg_type"], h["room_id"], h["generation"], h["minor"], h["flags"])
    assert msg == entry_message(entry)
    if entry.get("twin"):
        assert BY_FILE[entry["twin"]]["check"] == "both"
        assert decode_frame(read_vector(entry["twin"]))[1] == msg
        assert read_vector(entry["file"]) != read_vector(entry["twin"])


@pytest.mark.parametrize("entry", FRAMES_REJECT, ids=ids(FRAMES_REJECT))
def test_vectors_reject_frame_raises_its_error(entry: dict[str, Any]) -> None:
    """A reject vector raises the listed exception with the listed code."""
    with pytest.raises(getattr(wire, entry["error"])) as info:
        decode_frame(read_vector(entry["file"]))
    assert info.value.code is ErrorCode[entry["code"]]


def test_vectors_every_byte_mutation_keeps_the_decode_property() -> None:
    """Every truncation and every one-byte change (4 values) of every frame vector decodes or is refused."""
    for entry in FRAMES_VALID + FRAMES_DECODE:
        frame = read_vector(entry["file"])
        for n in range(len(frame)):
            assert decode_checked(frame[:n]) is None
        for i in range(len(frame)):
            for v in {0x00, 0xFF, frame[i] ^ 0x01, frame[i] ^ 0x80} - {frame[i]}:
                decode_checked(frame[:i] + bytes([v]) + frame[i + 1 :])


# --- tags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", TAGS_BOTH, ids=ids(TAGS_BOTH))
def test_vectors_tag_both_ways(entry: dict[str, Any]) -> None:
    """decode_tag(vector) gives the listed tag and encoding it gives the vector."""
    data = read_vector(entry["file"])
    assert decode_tag(data) == entry_tag(entry)
    assert entry_tag(entry).encode() == data
    assert decode_tag_checked(data) is not None


@pytest.mark.parametrize("entry", TAGS_REJECT, ids=ids(TAGS_REJECT))
def test_vectors_reject_tag_raises_malformed_tag(entry: dict[str, Any]) -> None:
    """A reject tag vector raises MalformedTag (code MALFORMED_FRAME)."""
    with pytest.raises(getattr(wire, entry["error"])) as info:
        decode_tag(read_vector(entry["file"]))
    assert info.value.code is ErrorCode[entry["code"]]


# --- notification lists (minor 6) ------------------------------------------------------------------


@pytest.mark.parametrize("entry", LISTS_BOTH, ids=ids(LISTS_BOTH))
def test_vectors_list_both_ways(entry: dict[str, Any]) -> None:
    """A notification list unpacks to its tags, each a well-formed tag of the listed fields, and packing
    those tags gives the vector."""
    data = read_vector(entry["file"])
    tags = [Tag(kind=TagKind[t["kind"]], room_id=t["room_id"], generation=t["generation"], link_id=t["link_id"],
                seq=t["seq"]) for t in entry["tags"]]
    assert len(tags) >= 2
    assert unpack_tags(data) == [t.encode() for t in tags]
    assert [decode_tag(one) for one in unpack_tags(data)] == tags
    assert pack_tags([t.encode() for t in tags]) == data


@pytest.mark.parametrize("entry", LISTS_REJECT, ids=ids(LISTS_REJECT))
def test_vectors_reject_list_is_handed_on_as_a_malformed_tag(entry: dict[str, Any]) -> None:
    """Bytes that begin as a list but are not one do not unpack: the receiver checks them as one tag,
    which is malformed (MalformedTag, code MALFORMED_FRAME)."""
    data = read_vector(entry["file"])
    assert data[:2] == b"KL" and unpack_tags(data) is None
    with pytest.raises(getattr(wire, entry["error"])) as info:
        decode_tag(data)
    assert info.value.code is ErrorCode[entry["code"]]
