"""Shared helpers of the wire tests: strategies derived from the field grammar, a seeded
random message generator, frame mutators, and the one decode check every fuzz test uses.

``COUNTS`` tallies how many frames and tags the fuzz properties fed to the decoders; the
``conftest`` prints it at the end of the run (the heavy fuzz reports its total from there).
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvproto.wire import (
    HEADER_SIZE,
    MESSAGE_TYPES,
    ErrorCode,
    Message,
    RemoteProtocolError,
    UnknownMessage,
    decode_frame,
    encode,
)
from kvproto.wire.codec import Body
from kvproto.wire.tags import MalformedTag, Tag, TagKind, decode_tag

COUNTS: Counter[str] = Counter()

UINT_MAX = {"u8": 2**8 - 1, "u16": 2**16 - 1, "u32": 2**32 - 1, "u64": 2**64 - 1}
MESSAGE_CLASSES: list[type[Message]] = [MESSAGE_TYPES[t] for t in sorted(MESSAGE_TYPES)]
REJECT_CODES = {ErrorCode.MALFORMED_FRAME, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.FRAME_TOO_LARGE}

FUZZ_EXAMPLES = int(os.environ.get("KVPROTO_FUZZ_EXAMPLES", "0") or 0)
"""When set, the decode properties each run this many examples (the heavy fuzz)."""


def fuzz_settings(default: int) -> settings:
    """Settings of a decode property: ``default`` examples, or ``KVPROTO_FUZZ_EXAMPLES``."""
    return settings(
        max_examples=FUZZ_EXAMPLES or default,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def quick_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --- Hypothesis strategies from the field grammar ------------------------------------------------


def value_strategy(kind: Any) -> st.SearchStrategy[Any]:
    """Valid values of one field kind: ints within the width, any Unicode text, any bytes."""
    if isinstance(kind, str):
        if kind in UINT_MAX:
            return st.integers(0, UINT_MAX[kind])
        if kind == "str":
            return st.text(max_size=24)
        if kind == "bytes":
            return st.binary(max_size=48)
        if kind == "u32[]":
            return st.lists(st.integers(0, UINT_MAX["u32"]), max_size=24).map(tuple)
        raise AssertionError(f"unknown kind {kind!r}")
    if isinstance(kind, list):
        return st.lists(record_strategy(kind[0]), max_size=4).map(tuple)
    return record_strategy(kind)


def record_strategy(cls: type[Body]) -> st.SearchStrategy[Any]:
    return st.builds(cls, **{name: value_strategy(kind) for name, kind in cls.FIELDS})


def message_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    return st.builds(
        cls,
        room_id=st.integers(0, UINT_MAX["u64"]),
        generation=st.integers(0, UINT_MAX["u32"]),
        **{name: value_strategy(kind) for name, kind in cls.FIELDS},
    )


messages = st.one_of([message_strategy(cls) for cls in MESSAGE_CLASSES])

tags = st.builds(
    Tag,
    kind=st.sampled_from(TagKind),
    room_id=st.integers(0, UINT_MAX["u64"]),
    generation=st.integers(0, UINT_MAX["u32"]),
    link_id=st.integers(0, UINT_MAX["u32"]),
    seq=st.integers(0, UINT_MAX["u32"]),
)


def fix_body_len(frame: bytes | bytearray) -> bytes:
    """``frame`` with ``body_len`` set to the bytes that follow the header (if it has one)."""
    out = bytearray(frame)
    if len(out) >= HEADER_SIZE:
        struct.pack_into("<I", out, 20, len(out) - HEADER_SIZE)
    return bytes(out)


@st.composite
def header_then_body(draw: st.DrawFn) -> bytes:
    """A well-formed header (any type, minor, flags) in front of an arbitrary body."""
    body = draw(st.binary(max_size=256))
    header = struct.pack(
        "<2sBBBBHQII",
        b"KV",
        1,
        draw(st.integers(0, 255)),
        draw(st.one_of(st.sampled_from(sorted(MESSAGE_TYPES)), st.integers(0, 255))),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 0xFFFF)),
        draw(st.integers(0, UINT_MAX["u64"])),
        draw(st.integers(0, UINT_MAX["u32"])),
        len(body),
    )
    return header + body


MUTATIONS = ("truncate", "truncate_fixed", "set_byte", "set_bytes", "insert_fixed", "delete_fixed", "splice_fixed")


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame of any message type, then truncated, overwritten, grown or shrunk.

    The ``_fixed`` mutations patch ``body_len`` afterwards so that the body parser, not the
    length check, meets the damage.
    """
    msg = draw(messages)
    frame = bytearray(encode(msg, minor=draw(st.sampled_from([0, 0, 1, 255]))))
    op = draw(st.sampled_from(MUTATIONS))
    n = len(frame)
    if op.startswith("truncate"):
        frame = frame[: draw(st.integers(0, n - 1))]
    elif op == "set_byte":
        i = draw(st.integers(0, n - 1))
        frame[i] = draw(st.integers(0, 255).filter(lambda v: v != frame[i]))
    elif op == "set_bytes":
        for _ in range(draw(st.integers(2, 8))):
            frame[draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
    elif op == "insert_fixed":
        i = draw(st.integers(HEADER_SIZE, n))
        frame[i:i] = draw(st.binary(min_size=1, max_size=16))
    elif op == "delete_fixed":
        i = draw(st.integers(HEADER_SIZE, n))
        frame[i : i + draw(st.integers(1, 16))] = b""
    else:  # splice_fixed: overwrite a body stretch with 0xff (huge counts and lengths)
        i = draw(st.integers(HEADER_SIZE, n))
        frame[i : i + 4] = b"\xff" * min(4, n - i)
    if op.endswith("_fixed"):
        frame = bytearray(fix_body_len(frame))
    return bytes(frame)


# --- the decode property ---------------------------------------------------------------------------


def decode_checked(frame: bytes) -> Message | None:
    """Decode ``frame``: it either decodes or raises a ``RemoteProtocolError`` with a decode code.

    Anything else (another exception type, a message of the wrong class, a decoded message that
    does not re-encode, with the frame's own minor, to the canonical form of the frame) fails the
    calling test. The canonical form keeps the header but zeroes ``flags`` and ``reserved`` and
    drops the bytes after the last known field: decoding then encoding is exact on everything else.
    """
    COUNTS["frames"] += 1
    try:
        header, msg = decode_frame(frame)
    except RemoteProtocolError as exc:
        assert exc.code in REJECT_CODES, f"{type(exc).__name__} carries {exc.code!r}"
        if isinstance(exc, UnknownMessage):
            assert exc.header.msg_type not in MESSAGE_TYPES
        return None
    assert type(msg) is MESSAGE_TYPES[header.msg_type]
    assert (msg.room_id, msg.generation) == (header.room_id, header.generation)
    again = encode(msg, minor=header.minor)
    assert len(again) <= len(frame)
    canonical = bytearray(frame[: len(again)])
    canonical[5:8] = b"\x00\x00\x00"  # flags and reserved
    assert again == fix_body_len(canonical)
    assert decode_frame(again) == (dataclasses.replace(header, flags=0), msg)
    return msg


def decode_tag_checked(data: bytes) -> Tag | None:
    """Decode a tag: it either decodes (and re-encodes to the same bytes) or raises MalformedTag."""
    COUNTS["tags"] += 1
    try:
        tag = decode_tag(data)
    except MalformedTag as exc:
        assert exc.code is ErrorCode.MALFORMED_FRAME
        return None
    assert tag.encode() == bytes(data)
    return tag


# --- seeded generation (the heavy loop, without Hypothesis' per-example overhead) ------------------

_TEXT_POOL = "aZ09 -_:/.é中🚀\u0000\u007f\u0080\u07ff\u0800\uffff\U00010000\U0010ffff"


def random_value(rng: random.Random, kind: Any) -> Any:
    if isinstance(kind, str):
        if kind in UINT_MAX:
            top = UINT_MAX[kind]
            return rng.choice((0, 1, top, top - 1, rng.randrange(top + 1), rng.randrange(256)))
        if kind == "str":
            return "".join(rng.choice(_TEXT_POOL) for _ in range(rng.randrange(12)))
        if kind == "bytes":
            return rng.randbytes(rng.randrange(24))
        if kind == "u32[]":
            return tuple(rng.randrange(2**32) for _ in range(rng.randrange(10)))
    if isinstance(kind, list):
        return tuple(random_record(rng, kind[0]) for _ in range(rng.randrange(4)))
    return random_record(rng, kind)


def random_record(rng: random.Random, cls: type[Body]) -> Any:
    return cls(**{name: random_value(rng, kind) for name, kind in cls.FIELDS})


def random_message(rng: random.Random) -> Message:
    cls = rng.choice(MESSAGE_CLASSES)
    return cls(
        room_id=random_value(rng, "u64"),
        generation=random_value(rng, "u32"),
        **{name: random_value(rng, kind) for name, kind in cls.FIELDS},
    )


def random_mutation(rng: random.Random, frame: bytes) -> bytes:
    out = bytearray(frame)
    n = len(out)
    op = rng.choice(MUTATIONS)
    if op.startswith("truncate"):
        out = out[: rng.randrange(n)]
    elif op == "set_byte":
        out[rng.randrange(n)] ^= rng.randrange(1, 256)
    elif op == "set_bytes":
        for _ in range(rng.randrange(2, 9)):
            out[rng.randrange(n)] = rng.randrange(256)
    elif op == "insert_fixed":
        i = rng.randrange(HEADER_SIZE, n + 1)
        out[i:i] = rng.randbytes(rng.randrange(1, 17))
    elif op == "delete_fixed":
        i = rng.randrange(HEADER_SIZE, n + 1)
        del out[i : i + rng.randrange(1, 17)]
    else:
        i = rng.randrange(HEADER_SIZE, n + 1)
        out[i : i + 4] = b"\xff" * min(4, n - i)
    return fix_body_len(out) if op.endswith("_fixed") else bytes(out)
