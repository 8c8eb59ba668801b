"""Writes of one pass go together (protocol 1.6): prefill and decode endpoints over real NIXL.

A prefill rank tells its NIXL agent that a decode rank of minor >= 6 reads notification lists, so
the rooms it sends in one pass move as few transfers. These tests check the bytes of every room,
that batches really formed, that an older decode gets a transfer per write, and that a transfer
that fails fails exactly the rooms it carried.
"""

from __future__ import annotations

import asyncio

import pytest

from kvproto.aio import DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState
from kvproto.transport import available_transports
from kvproto.wire import encode
from kvproto.wire.tags import decode_tag

from .conftest import Pair, config, make_cache
from .test_endpoints import assert_room_bytes

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl,
              pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")]

ROOMS = 24


async def _rooms(pair: Pair, first: int = 100) -> list[tuple]:
    """ROOMS rooms of 1-3 pages, all requested by the decode before the prefill sends any, then sent
    in one go (one pass of the prefill's loop); returns (decode room, prefill room, src, dst)."""
    used: set[int] = set()
    rooms = []
    for i in range(ROOMS):
        n = pair.rng.randint(1, 12)
        src = pair.rng.sample(range(64), -(-n // 4))
        dst = pair.pages(-(-n // 4), pair.dst, used)
        decode_room = pair.decode.open_room(first + i, pair.prefill.bootstrap_address, pages=dst, num_tokens=n)
        rooms.append((decode_room, pair.prefill.open_room(first + i), src, dst, n))
    deadline = asyncio.get_running_loop().time() + 10
    while pair.prefill.core.rooms and any(pair.prefill.core.room_state(first + i) is RoomState.BOOTSTRAPPING
                                          for i in range(ROOMS)):
        assert asyncio.get_running_loop().time() < deadline, "the decode's requests did not arrive"
        await asyncio.sleep(0.01)
    for _, prefill_room, src, _, n in rooms:
        prefill_room.send(src, n, last=True)
    return rooms


async def _pair(**kw) -> Pair:  # noqa: ANN003
    import random

    src, dst = make_cache(seed=1), make_cache(seed=2)
    prefill = PrefillEndpoint(src.kv, config=config("nixl"))
    decode = DecodeEndpoint(dst.kv, config=config("nixl"))
    await prefill.start()
    await decode.start()
    return Pair(prefill, decode, src, dst, random.Random(11))


async def _close(pair: Pair) -> None:
    await pair.decode.close()
    await pair.prefill.close()


async def test_batched_writes_rooms_sent_together_share_transfers() -> None:
    """24 rooms sent in one pass land byte-exact in fewer NIXL transfers than writes."""
    pair = await _pair()
    try:
        rooms = await _rooms(pair)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for d, p, *_ in rooms for r in (d, p))), 20)
        for decode_room, prefill_room, src, dst, _ in rooms:
            assert decode_room.poll() is RoomState.SUCCESS and prefill_room.poll() is RoomState.SUCCESS
            assert_room_bytes(pair, src, dst)
        agent = pair.prefill.transport
        assert agent.stats.writes == ROOMS
        assert agent.transfers < ROOMS / 2, (agent.transfers, agent.stats.writes)
    finally:
        await _close(pair)


async def test_batched_writes_not_to_a_decode_of_minor_5(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode whose frames say minor 5 reads no lists: every write is a transfer of its own."""
    from kvproto.aio import decode as decode_module

    monkeypatch.setattr(DecodeEndpoint, "_encode", lambda self, msg: encode(msg, minor=5))
    monkeypatch.setattr(decode_module, "encode", lambda msg, **_: encode(msg, minor=5))  # its REGISTER
    pair = await _pair()
    try:
        rooms = await _rooms(pair)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for d, p, *_ in rooms for r in (d, p))), 20)
        for _, _, src, dst, _ in rooms:
            assert_room_bytes(pair, src, dst)
        agent = pair.prefill.transport
        assert agent.transfers == agent.stats.writes == ROOMS
    finally:
        await _close(pair)


async def test_batched_writes_a_failed_transfer_fails_exactly_its_rooms(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL refuses the first batched transfer: the rooms whose tags it listed fail on both sides, with
    the cause; every other room lands byte-exact."""
    from kvproto.transport import nixl as nixl_module

    carried: list[int] = []
    real_pack = nixl_module.pack_tags

    def pack(tags):  # noqa: ANN001, ANN202
        if not carried:
            carried.extend(decode_tag(t).room_id for t in tags)
            raise nixl_module.TransportError("post_prepared: NIXL failed: injected refusal")
        return real_pack(tags)

    monkeypatch.setattr(nixl_module, "pack_tags", pack)
    pair = await _pair()
    try:
        rooms = await _rooms(pair)
        results = await asyncio.wait_for(asyncio.gather(*(r.wait() for d, p, *_ in rooms for r in (d, p)),
                                                        return_exceptions=True), 20)
        assert len(carried) >= 2
        failed = set()
        for i, (decode_room, prefill_room, src, dst, _) in enumerate(rooms):
            d, p = results[2 * i], results[2 * i + 1]
            if isinstance(p, TransferFailed):
                assert "injected refusal" in p.reason, p.reason
                assert isinstance(d, TransferFailed), d
                failed.add(100 + i)
            else:
                assert d is None and p is None, (d, p)
                assert_room_bytes(pair, src, dst)
        assert failed == set(carried)
    finally:
        await _close(pair)
