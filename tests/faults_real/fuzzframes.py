"""Hostile control frames for the handler fuzz: valid, plausible, mutated and random.

Theory of operation
-------------------
``FrameFuzzer`` draws frames from a seeded ``random.Random``. Most are messages whose fields
name what is live on the endpoints right now (room ids of open rooms, the generations of the
decode's rooms, the decode's real boot id, pages inside and just outside the registered range,
a REGISTER carrying a real side agent's transport metadata), so the frames get past decoding
and into the cores; the rest are fields at their extremes, mutations of such frames (truncated,
bytes overwritten, bytes inserted or deleted with the header's ``body_len`` patched, header
fields changed) and random bytes.

Messages that drop the real link (a link ABORT, a heartbeat with another boot id, a REGISTER of
the real decode instance) are drawn rarely, so that valid traffic keeps moving between them.
"""

from __future__ import annotations

import random
import struct
from typing import Any

from kvproto.wire import (
    HEADER_SIZE,
    MESSAGE_TYPES,
    NO_SLOT,
    Abort,
    BootstrapInfo,
    BootstrapQuery,
    ErrorCode,
    Heartbeat,
    Message,
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

U = {"u8": 2**8 - 1, "u16": 2**16 - 1, "u32": 2**32 - 1, "u64": 2**64 - 1}
TEXT = "aZ09 -_:/.é中🚀\u0000\u007f\uffff\U0010ffff"
CODES = [int(c) for c in ErrorCode]


def rand_uint(rng: random.Random, kind: str) -> int:
    top = U[kind]
    return rng.choice((0, 1, 2, top, top - 1, rng.randrange(top + 1), rng.randrange(256)))


def rand_value(rng: random.Random, kind: Any) -> Any:
    if isinstance(kind, str):
        if kind in U:
            return rand_uint(rng, kind)
        if kind == "str":
            return "".join(rng.choice(TEXT) for _ in range(rng.randrange(12)))
        if kind == "bytes":
            return rng.randbytes(rng.randrange(40))
        if kind == "u32[]":
            return tuple(rand_uint(rng, "u32") for _ in range(rng.randrange(8)))
    if isinstance(kind, list):
        return tuple(rand_record(rng, kind[0]) for _ in range(rng.randrange(4)))
    return rand_record(rng, kind)


def rand_record(rng: random.Random, cls: type[Body]) -> Any:
    return cls(**{name: rand_value(rng, kind) for name, kind in cls.FIELDS})


def rand_message(rng: random.Random, room_id: int, generation: int) -> Message:
    cls = rng.choice(list(MESSAGE_TYPES.values()))
    return cls(room_id=room_id, generation=generation,
               **{name: rand_value(rng, kind) for name, kind in cls.FIELDS})


def fix_body_len(frame: bytearray) -> bytearray:
    if len(frame) >= HEADER_SIZE:
        struct.pack_into("<I", frame, 20, len(frame) - HEADER_SIZE)
    return frame


def mutate(rng: random.Random, frame: bytes) -> bytes:
    out = bytearray(frame)
    n = len(out)
    op = rng.randrange(8)
    if op == 0:
        out = out[: rng.randrange(n)]
    elif op == 1:
        out[rng.randrange(n)] ^= rng.randrange(1, 256)
    elif op == 2:
        for _ in range(rng.randrange(2, 9)):
            out[rng.randrange(n)] = rng.randrange(256)
    elif op == 3:
        i = rng.randrange(HEADER_SIZE, n + 1)
        out[i:i] = rng.randbytes(rng.randrange(1, 17))
        fix_body_len(out)
    elif op == 4:
        i = rng.randrange(HEADER_SIZE, n + 1)
        del out[i: i + rng.randrange(1, 17)]
        fix_body_len(out)
    elif op == 5:
        i = rng.randrange(HEADER_SIZE, n + 1)
        out[i: i + 4] = b"\xff" * min(4, n - i)
        fix_body_len(out)
    elif op == 6:  # header: major, minor, type or flags
        out[rng.choice((2, 3, 4, 5))] = rng.randrange(256)
    else:  # another body behind this header
        out = fix_body_len(out[:HEADER_SIZE] + rng.randbytes(rng.randrange(64)))
    return bytes(out)


class FrameFuzzer:
    """Frames for a live prefill (from a decode rank) and a live decode (from a prefill rank)."""

    def __init__(self, rng: random.Random, *, prefill: Any, decode: Any, side_register: Register,
                 blocks: int, block: int, aux_slots: int) -> None:
        self.rng = rng
        self.prefill = prefill
        self.decode = decode
        self.side_register = side_register
        self.blocks = blocks
        self.block = block
        self.aux_slots = aux_slots

    # --- what is live ----------------------------------------------------------------------------
    def room_id(self) -> int:
        rng = self.rng
        live = list(self.prefill.core.rooms) + list(self.decode.core.rooms)
        ended = list(self.decode.core._tombstones)[-8:]
        r = rng.random()
        if live and r < 0.7:
            return rng.choice(live)
        if ended and r < 0.8:
            return rng.choice(ended)
        return rand_uint(rng, "u64") if r < 0.95 else 0

    def generation(self, room_id: int) -> int:
        room = self.decode.core.rooms.get(room_id)
        if room is not None and self.rng.random() < 0.7:
            return int(room.generation)
        return rand_uint(self.rng, "u32")

    def pages(self, count: int) -> tuple[int, ...]:
        rng = self.rng
        top = self.blocks + (2 if rng.random() < 0.2 else 0)
        return tuple(rng.randrange(top) for _ in range(count))

    # --- frames to the prefill ----------------------------------------------------------------------
    def to_prefill(self, real_link: bool) -> bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.05:
            return rng.randbytes(rng.randrange(80))
        msg = self._prefill_message(real_link)
        frame = encode(msg, minor=rng.choice((0, 1, 1, 1, 2)))
        return mutate(rng, frame) if r < 0.35 else frame

    def _prefill_message(self, real_link: bool) -> Message:
        rng = self.rng
        room_id = self.room_id()
        gen = self.generation(room_id)
        kind = rng.random()
        if kind < 0.30:
            n = rng.choice((1, 16, 40, 64, rng.randrange(1, 400), rand_uint(rng, "u32")))
            need = -(-n // self.block) if n < 10_000 else rng.randrange(4)
            prefix = min(U["u32"], rng.choice((0, 0, 16, n, n + 16, rand_uint(rng, "u32"))))
            return TransferRequest(
                room_id=room_id, generation=gen, num_tokens=n, prefix_tokens=prefix,
                aux_slot=rng.choice((NO_SLOT, 0, self.aux_slots - 1, self.aux_slots, rand_uint(rng, "u32"))),
                expected_writers=rng.choice((0, 1, 2, 65535)),
                dst_pages=self.pages(need + rng.choice((0, 0, 0, -1, 1)) if need else 0))
        if kind < 0.42:
            link_level = rng.random() < (0.02 if real_link else 0.3)
            return Abort(room_id=0 if link_level else room_id, generation=gen, code=rng.choice(CODES + [65535]),
                         reason=rand_value(rng, "str"))
        if kind < 0.52:
            return StagingGrant(room_id=room_id, generation=gen, seq=rng.randrange(4),
                                start_token=rng.randrange(64), end_token=rng.randrange(80),
                                offset=rng.choice((0, 4096, rand_uint(rng, "u64"))))
        if kind < 0.58:
            return StagingWatermark(room_id=room_id, generation=gen, seq=rng.randrange(4),
                                    watermark=rand_uint(rng, "u64"))
        if kind < 0.70:
            return self._register(real_link)
        if kind < 0.80:
            boot = self.decode.boot_id if real_link and rng.random() < 0.97 else rand_uint(rng, "u64")
            return Heartbeat(boot_id=boot, seq=rand_uint(rng, "u64"))
        if kind < 0.84:
            return BootstrapQuery(requester=rand_value(rng, "str"))
        if kind < 0.88:
            return RankAnnounce(tp_rank=rng.choice((0, 1, 2, 65535)), tp_size=rng.choice((0, 1, 2, 65535)),
                                endpoint=rng.choice(("tcp://127.0.0.1:1", "nonsense", "")),
                                boot_id=rand_uint(rng, "u64"))
        if kind < 0.92:  # minor 4: a hold for a room (live, ended, never opened), any length
            return RoomHold(room_id=room_id, generation=gen, hold_ms=rng.choice((0, 1, 1000, 60_000, U["u32"])))
        return rand_message(rng, room_id if rng.random() < 0.5 else 0, gen)

    def _register(self, real_link: bool) -> Register:
        """Mostly a valid REGISTER of a fake decode rank (the side agent's real metadata), with
        one field bent now and then."""
        rng = self.rng
        base = self.side_register
        fields: dict[str, Any] = {name: getattr(base, name) for name, _ in Register.FIELDS}
        fields["boot_id"] = rand_uint(rng, "u64") | 1 << 40  # never the real decode's boot id
        fields["link_id"] = rand_uint(rng, "u32")
        fields["instance"] = f"fuzz-{rng.randrange(4)}"
        if not real_link and rng.random() < 0.01:
            fields["instance"] = self.decode.instance  # replaces the real link: rare
        bend = rng.randrange(12)
        if real_link and rng.random() < 0.95:
            bend = rng.randrange(3)  # refused: the real link stays (a valid one replaces it)
        if bend == 0:
            fields["model_id"] = "other-model"
        elif bend == 1:
            fields["transport"] = rand_value(rng, "str")
        elif bend == 2:
            meta = base.transport_metadata
            fields["transport_metadata"] = rng.choice((b"", rng.randbytes(64), meta[: rng.randrange(len(meta))]))
        elif bend == 3:
            g = base.geometry
            name, kind = rng.choice(WireGeometry.FIELDS)
            fields["geometry"] = WireGeometry(**{**{k: getattr(g, k) for k, _ in WireGeometry.FIELDS},
                                                 name: rand_value(rng, kind)})
        elif bend == 4:
            regions = list(base.regions)
            i = rng.randrange(len(regions))
            r = regions[i]
            name, kind = rng.choice(WireRegion.FIELDS)
            value = rand_value(rng, kind)
            regions[i] = WireRegion(**{**{k: getattr(r, k) for k, _ in WireRegion.FIELDS}, name: value})
            fields["regions"] = tuple(regions)
        elif bend == 5:
            fields["regions"] = base.regions[: rng.randrange(len(base.regions))]
        elif bend == 6:
            fields["aux_slots"] = rng.choice((rng.randrange(65), rand_uint(rng, "u32")))
            fields["aux_slot_bytes"] = rng.choice((0, 1, 16, 17, rand_uint(rng, "u32")))
        return Register(room_id=0, generation=0, **fields)

    # --- frames to the decode ------------------------------------------------------------------------
    def to_decode(self, prefill_boot_id: int) -> bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.05:
            return rng.randbytes(rng.randrange(80))
        msg = self._decode_message(prefill_boot_id)
        frame = encode(msg, minor=rng.choice((0, 1, 1, 1, 2)))
        return mutate(rng, frame) if r < 0.35 else frame

    def _decode_message(self, prefill_boot_id: int) -> Message:
        rng = self.rng
        room_id = self.room_id()
        gen = self.generation(room_id)
        kind = rng.random()
        if kind < 0.30:
            return TransferDone(room_id=room_id, generation=gen, writes=rng.choice((0, 1, 2, 3, rand_uint(rng, "u32"))),
                                nbytes=rand_uint(rng, "u64"))
        if kind < 0.45:
            link_level = rng.random() < 0.02
            return Abort(room_id=0 if link_level else room_id, generation=gen, code=rng.choice(CODES + [65535]),
                         reason=rand_value(rng, "str"))
        if kind < 0.60:
            return StagingRequest(room_id=room_id, generation=gen, seq=rng.randrange(4),
                                  start_token=rng.randrange(64), end_token=rng.randrange(80))
        if kind < 0.75:
            boot = prefill_boot_id if rng.random() < 0.97 else rand_uint(rng, "u64")
            return Heartbeat(boot_id=boot, seq=rand_uint(rng, "u64"))
        if kind < 0.80:
            return RegisterAccept(room_id=0, generation=0, boot_id=rand_uint(rng, "u64"),
                                  link_id=rand_uint(rng, "u32"), agent_name=rand_value(rng, "str"),
                                  geometry=rand_record(rng, WireGeometry), aux_slot_bytes=rand_uint(rng, "u32"))
        if kind < 0.85:
            return RegisterReject(link_id=rand_uint(rng, "u32"), code=rng.choice(CODES), reason="fuzz")
        if kind < 0.90:
            size = rng.randrange(4)
            return BootstrapInfo(tp_size=size + rng.choice((0, 1)), ranks=tuple(
                RankAddress(tp_rank=i, endpoint=rng.choice(("tcp://127.0.0.1:1", "nonsense")), boot_id=i)
                for i in range(size)))
        return rand_message(rng, room_id if rng.random() < 0.5 else 0, gen)

    # --- notification tags --------------------------------------------------------------------------
    def tag(self) -> bytes:
        rng = self.rng
        room_id = self.room_id()
        tag = Tag(kind=rng.choice(list(TagKind)), room_id=room_id, generation=self.generation(room_id),
                  link_id=rng.choice((0, 1, 2, rand_uint(rng, "u32"))), seq=rng.randrange(4)).encode()
        if rng.random() < 0.3:
            data = bytearray(tag)
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            tag = bytes(data[: rng.choice((len(data), rng.randrange(len(data))))])
        return tag
