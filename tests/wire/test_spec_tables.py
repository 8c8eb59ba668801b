"""The tables of spec/v1 that describe bytes (header, field lists, enumerations, tag layout)
agree with the code, so the normative text cannot drift from the implementation."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from kvproto.geometry import DType, Layout
from kvproto.transport import MemKind
from kvproto.wire import (
    HEADER_SIZE,
    MAJOR,
    MESSAGE_TYPES,
    MINOR,
    NO_SLOT,
    GroupDestination,
    GroupKind,
    RankAddress,
    RegionKind,
    StagingGrant,
    TransferRequest,
    WireGeometry,
    WireGroup,
    WireGroupLayout,
    WireRegion,
    WireStateTensor,
    WireTensorLayout,
    decode,
    encode,
)
from kvproto.wire.codec import HEADER
from kvproto.wire.tags import TAG, TagKind

SPEC = Path(__file__).resolve().parents[2] / "spec" / "v1"
RECORDS = {cls.__name__: cls for cls in (WireGeometry, WireRegion, RankAddress, WireStateTensor, WireGroup,
                                         GroupDestination, WireTensorLayout, WireGroupLayout)}
KIND_SIZE = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}


def md_tables(path: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every pipe table of a markdown file: (the heading above it, header cells, body rows)."""
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    heading = ""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1]):
            header = cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            tables.append((heading, header, rows))
            continue
        i += 1
    return tables


def cells(line: str) -> list[str]:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


def kind_name(kind: Any) -> str:
    if isinstance(kind, str):
        return kind
    if isinstance(kind, list):
        return f"{kind[0].__name__}[]"
    return kind.__name__


def field_tables() -> dict[str, list[tuple[str, str]]]:
    """messages.md: heading -> [(field, kind)] for every table with field and kind columns."""
    out = {}
    for heading, header, rows in md_tables(SPEC / "messages.md"):
        if "field" in header and "kind" in header:
            f, k = header.index("field"), header.index("kind")
            assert heading not in out, f"two field tables under {heading!r}"
            out[heading] = [(row[f], row[k]) for row in rows]
    return out


# --- README.md -----------------------------------------------------------------------------------


def test_spec_readme_version_matches_codec() -> None:
    """README.md states the version the codec speaks, and its minor-version table ends at MINOR."""
    text = (SPEC / "README.md").read_text(encoding="utf-8")
    m = re.search(r"specifies version \*\*(\d+)\.(\d+)\*\* \(major (\d+), minor (\d+)\)", text)
    assert m, "README.md names no version"
    assert tuple(int(g) for g in m.groups()) == (MAJOR, MINOR, MAJOR, MINOR)
    (table,) = [t for t in md_tables(SPEC / "README.md") if t[1][:2] == ["minor", "version"]]
    rows = [(int(r[0]), r[1]) for r in table[2]]
    assert rows == [(m, f"{MAJOR}.{m}") for m in range(MINOR + 1)]


def test_spec_readme_lists_every_document() -> None:
    """README.md's document table links every markdown file of spec/v1 (and nothing else)."""
    (table,) = [t for t in md_tables(SPEC / "README.md") if t[1][:1] == ["document"]]
    linked = {re.fullmatch(r"\[[^]]+\]\(([^)#]+)\)", row[0]).group(1) for row in table[2]}  # type: ignore[union-attr]
    docs = {p.name for p in SPEC.glob("*.md")} - {"README.md"}
    assert linked - {"vectors/README.md"} == docs
    assert all((SPEC / name).exists() for name in linked)


def test_spec_readme_no_record_is_extended_in_place() -> None:
    """README.md's rule that records never grow in place names every record of messages.md."""
    text = " ".join((SPEC / "README.md").read_text(encoding="utf-8").split())
    (rule,) = [s for s in text.split(". ") if "extended in place" in s]
    assert set(re.findall(r"`(\w+)`", rule)) == set(RECORDS) == set(record_sections())


def test_spec_readme_and_header_table_name_this_minor() -> None:
    """README.md's sender rule and framing.md's header table name this build's minor, and the
    flags row says that no version up to it defines a bit."""
    readme = " ".join((SPEC / "README.md").read_text(encoding="utf-8").split())
    assert f"Senders of version {MAJOR}.{MINOR} put `minor` = {MINOR} (" in readme
    (table,) = [t for t in md_tables(SPEC / "framing.md") if t[0] == "Header"]
    rows = {r[2]: r[4] for r in table[2]}
    assert rows["minor"].startswith(f"the sender's minor version: {MINOR} for version {MAJOR}.{MINOR} (")
    assert all(f"{m} for {MAJOR}.{m}" in rows["minor"] for m in range(MINOR))
    assert f"no bit is defined in any version from {MAJOR}.0 to {MAJOR}.{MINOR};" in rows["flags"]


# --- framing.md --------------------------------------------------------------------------------


def test_spec_framing_header_table_matches_codec() -> None:
    """framing.md's header table gives the offsets, sizes and names of the codec's header struct."""
    (table,) = [t for t in md_tables(SPEC / "framing.md") if t[0] == "Header"]
    _, header, rows = table
    assert header[:3] == ["offset", "size", "field"]
    offsets, sizes, names = ([int(r[0]) for r in rows], [int(r[1]) for r in rows], [r[2] for r in rows])
    assert names == ["magic", "major", "minor", "msg_type", "flags", "reserved", "room_id", "generation",
                     "body_len"]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert sum(sizes) == HEADER_SIZE == HEADER.size
    struct_sizes = [struct.calcsize("<" + c) for c in re.findall(r"\d*[a-zA-Z]", HEADER.format.lstrip("<"))]
    assert sizes == struct_sizes


def test_spec_framing_kind_table_matches_grammar() -> None:
    """framing.md lists exactly the field kinds the codec knows, with their fixed sizes."""
    (table,) = [t for t in md_tables(SPEC / "framing.md") if t[0] == "Field kinds"]
    rows = {r[0]: r[2] for r in table[2]}
    assert set(rows) == {"u8", "u16", "u32", "u64", "str", "bytes", "u32[]", "R", "R[]"}
    for kind, size in KIND_SIZE.items():
        assert rows[kind] == str(size)


def _example_blocks() -> list[bytes]:
    text = (SPEC / "framing.md").read_text(encoding="utf-8").split("## Worked example", 1)[1]
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    out = []
    for block in blocks:
        data = bytearray()
        for line in block.splitlines():
            m = re.match(r"((?:[0-9a-f]{2} )*[0-9a-f]{2})(?:\s{2,}|$)", line)
            assert m, line
            data += bytes.fromhex(m.group(1).replace(" ", ""))
        out.append(bytes(data))
    return out


def _vector(name: str) -> bytes:
    return bytes.fromhex("".join((SPEC / "vectors" / name).read_text().split()))


def test_spec_framing_worked_examples_are_exact() -> None:
    """The annotated bytes in framing.md are the heartbeat vector, an exact version 1.0 TRANSFER_REQUEST,
    and the minor-1 STAGING_GRANT vector."""
    heartbeat, request, grant = _example_blocks()
    assert heartbeat == _vector("heartbeat.hex")
    assert request == encode(TransferRequest(room_id=0xC0FFEE, generation=1_000_001, num_tokens=100,
                                             prefix_tokens=32, aux_slot=5, expected_writers=2,
                                             dst_pages=(17, 18, 19)), minor=0)
    assert grant == _vector("staging_grant.hex")
    assert decode(grant) == StagingGrant(room_id=0xC0FFEE, generation=1_000_001, seq=0, start_token=32,
                                         end_token=64, offset=0x30000)


# --- messages.md -------------------------------------------------------------------------------


@pytest.mark.parametrize("msg_type", sorted(MESSAGE_TYPES), ids=lambda t: MESSAGE_TYPES[t].MSG_TYPE.name)
def test_spec_messages_field_table_matches_grammar(msg_type: int) -> None:
    """Each message's field table in messages.md lists its FIELDS: same names, order and kinds."""
    cls = MESSAGE_TYPES[msg_type]
    tables = field_tables()
    heading = f"{int(msg_type)} {cls.MSG_TYPE.name}"
    assert heading in tables, f"messages.md has no section '### {heading}' with a field table"
    assert tables[heading] == [(name, kind_name(kind)) for name, kind in cls.FIELDS]


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_spec_messages_record_table_matches_grammar(name: str) -> None:
    """Each record's field table in messages.md lists its FIELDS and fixed sizes."""
    cls = RECORDS[name]
    tables = field_tables()
    assert tables[name] == [(n, kind_name(k)) for n, k in cls.FIELDS]
    for heading, header, rows in md_tables(SPEC / "messages.md"):
        if heading == name:
            for row in rows:
                kind, size = row[header.index("kind")], row[header.index("size")]
                if kind in KIND_SIZE:
                    assert size == str(KIND_SIZE[kind]), (name, row)


Size = tuple[int, int, int]
"""A size as messages.md writes it: ``(bytes, n, Σ)`` for ``bytes + n·n + Σ·Σ`` ("12 + 4n", "4 + Σ")."""


def parse_size(text: str) -> Size:
    """A size cell or a record's stated size: terms joined by ``+``, each ``k``, ``kn``, ``n`` or ``Σ``."""
    fixed = per_n = sigma = 0
    for term in text.split("+"):
        term = term.strip()
        if term == "Σ":
            sigma += 1
        elif m := re.fullmatch(r"(\d*)n", term):
            per_n += int(m.group(1) or 1)
        else:
            assert re.fullmatch(r"\d+", term), f"size term {term!r} of {text!r}"
            fixed += int(term)
    return fixed, per_n, sigma


def record_sections() -> dict[str, str]:
    """messages.md: each record's heading -> its prose before the field table."""
    text = (SPEC / "messages.md").read_text(encoding="utf-8").split("\n## Records\n", 1)[1].split("\n## Messages\n")[0]
    out = {}
    for part in re.split(r"^### ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        out[heading.strip()] = body.split("\n|", 1)[0]
    return out


def stated_size(name: str) -> Size:
    """The size a record's section states ("27 bytes.", "46 + n + Σ bytes")."""
    found = re.findall(r"(\d+(?: \+ \d*[nΣ])*) bytes", record_sections()[name])
    assert len(found) == 1, f"messages.md states {len(found)} sizes for {name}: {found}"
    return parse_size(found[0])


def kind_size(kind: str) -> Size:
    """The size a field of ``kind`` takes (framing.md's field kinds): a fixed record its stated size,
    a list of fixed records ``4 + size·n``, any other list ``4 + Σ``."""
    if kind in KIND_SIZE:
        return KIND_SIZE[kind], 0, 0
    if kind in ("str", "bytes"):
        return {"str": 2, "bytes": 4}[kind], 1, 0
    if kind == "u32[]":
        return 4, 4, 0
    if kind.endswith("[]"):
        fixed, per_n, sigma = stated_size(kind[:-2])
        return (4, fixed, 0) if per_n == sigma == 0 else (4, 0, 1)
    size = stated_size(kind)
    assert size[1:] == (0, 0), f"{kind} nested whole must have a fixed size"
    return size


@pytest.mark.parametrize("heading", sorted(RECORDS) + [f"{int(t)} {MESSAGE_TYPES[t].MSG_TYPE.name}"
                                                        for t in sorted(MESSAGE_TYPES)])
def test_spec_messages_size_column_follows_each_kind(heading: str) -> None:
    """Every row's size cell in messages.md is the size of its kind (framing.md): 4 for u32,
    2 + n for str, 27 for WireGeometry, 4 + 26n for WireRegion[], 4 + Σ for other record lists."""
    (table,) = [t for t in md_tables(SPEC / "messages.md") if t[0] == heading and "size" in t[1]]
    _, header, rows = table
    for row in rows:
        kind, size = row[header.index("kind")], row[header.index("size")]
        assert parse_size(size) == kind_size(kind), (heading, row[header.index("field")], size)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_spec_messages_record_size_is_the_sum_of_its_fields(name: str) -> None:
    """The size each record's section states is the sum of its field table's size column, and at
    most one field of a record has a length of its own (so one ``n`` is enough to state it)."""
    (table,) = [t for t in md_tables(SPEC / "messages.md") if t[0] == name]
    _, header, rows = table
    sizes = [parse_size(row[header.index("size")]) for row in rows]
    assert sum(1 for s in sizes if s[1]) <= 1, name
    total = tuple(sum(column) for column in zip(*sizes))
    assert stated_size(name) == total, f"{name}: messages.md states {stated_size(name)}, its fields add up to {total}"


def _records_in(value: Any) -> list[Any]:
    """Every record instance inside ``value`` (a message or record), outermost first."""
    found = []
    for fname, kind in value.FIELDS:
        if isinstance(kind, list):
            items = list(getattr(value, fname))
        elif isinstance(kind, type):
            items = [getattr(value, fname)]
        else:
            continue
        for item in items:
            found += [item, *_records_in(item)]
    return found


def test_spec_messages_record_sizes_match_the_vectors() -> None:
    """Each record's stated size, with ``n`` its string's bytes (or its list's elements) and Σ its
    records' sizes, is the length of that record as encoded in every golden frame vector."""
    entries = json.loads((SPEC / "vectors" / "index.json").read_text(encoding="utf-8"))["vectors"]
    seen = set()
    for e in entries:
        if e["kind"] != "frame" or e["check"] == "reject":
            continue
        for record in _records_in(decode(_vector(e["file"]))):
            fixed, per_n, sigma = stated_size(type(record).__name__)
            n = nested = 0
            for fname, kind in record.FIELDS:
                value = getattr(record, fname)
                if kind == "str":
                    n = len(value.encode("utf-8"))
                elif kind in ("bytes", "u32[]"):
                    n = len(value)
                elif isinstance(kind, list):
                    nested += sum(len(_encoded(item)) for item in value)
            assert fixed + per_n * n + sigma * nested == len(_encoded(record)), (e["file"], record)
            seen.add(type(record).__name__)
    assert seen == set(RECORDS)


def _encoded(record: Any) -> bytes:
    out = bytearray()
    record.encode_into(out)
    return bytes(out)


def _type_table_minors() -> dict[int, int]:
    (table,) = [t for t in md_tables(SPEC / "messages.md") if t[1][:2] == ["type", "name"]]
    _, header, rows = table
    assert header[-1] == "minor"
    return {int(r[0]): int(r[-1]) for r in rows}


def test_spec_messages_type_minor_column_matches_vectors() -> None:
    """messages.md's type table gives each type the minor that introduced it: no later than this
    build's MINOR, the staging types 11-13 at minor 1, the earliest both-ways vector of each type
    at exactly that minor, and no vector of a type under a header older than its minor."""
    since = _type_table_minors()
    assert set(since) == set(MESSAGE_TYPES)
    assert all(0 <= m <= MINOR for m in since.values())
    assert {t for t, m in since.items() if m == 1} == {11, 12, 13}
    entries = json.loads((SPEC / "vectors" / "index.json").read_text(encoding="utf-8"))["vectors"]
    frames = [e for e in entries if e["kind"] == "frame" and e["check"] in ("both", "decode", "refuse")]
    for msg_type, minor in since.items():
        minors = [e["header"]["minor"] for e in frames if e["msg_type"] == msg_type and e["check"] == "both"]
        assert min(minors) == minor, MESSAGE_TYPES[msg_type].__name__
    for e in frames:
        assert e["header"]["minor"] >= since[e["msg_type"]], e["file"]


def test_spec_messages_field_tables_name_only_known_sections() -> None:
    """Every field table in messages.md belongs to a message type or a record."""
    known = {f"{int(t)} {MESSAGE_TYPES[t].MSG_TYPE.name}" for t in MESSAGE_TYPES} | set(RECORDS)
    assert set(field_tables()) == known


@pytest.mark.parametrize("enum_cls", [RegionKind, MemKind, DType, Layout, GroupKind], ids=lambda e: e.__name__)
def test_spec_messages_enumeration_tables_match(enum_cls: Any) -> None:
    """messages.md's enumeration tables list exactly the enum's values and names."""
    (table,) = [t for t in md_tables(SPEC / "messages.md") if t[0] == enum_cls.__name__]
    _, header, rows = table
    assert header[:2] == ["value", "name"]
    assert [(int(r[0]), r[1]) for r in rows] == [(m.value, m.name) for m in enum_cls]


def test_spec_messages_no_slot_value() -> None:
    """messages.md's NO_SLOT is 0xFFFFFFFF, as in the code."""
    assert "`NO_SLOT` = `0xFFFFFFFF`" in (SPEC / "messages.md").read_text(encoding="utf-8")
    assert NO_SLOT == 0xFFFFFFFF


# --- tags.md -------------------------------------------------------------------------------------


def test_spec_tags_layout_table_matches_struct() -> None:
    """tags.md's layout table gives the offsets, sizes and names of the tag struct."""
    (table,) = [t for t in md_tables(SPEC / "tags.md") if t[0] == "Layout"]
    rows = table[2]
    offsets, sizes, names = [int(r[0]) for r in rows], [int(r[1]) for r in rows], [r[2] for r in rows]
    assert names == ["magic", "version", "kind", "room_id", "generation", "link_id", "seq"]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert sum(sizes) == TAG.size == 24
    assert sizes == [struct.calcsize("<" + c) for c in re.findall(r"\d*[a-zA-Z]", TAG.format.lstrip("<"))]


def test_spec_tags_kind_table_matches_enum() -> None:
    """tags.md's tag-kind table lists exactly TagKind."""
    (table,) = [t for t in md_tables(SPEC / "tags.md") if t[0] == "Tag kinds"]
    assert [(int(r[0]), r[1]) for r in table[2]] == [(k.value, k.name) for k in TagKind]
