"""Transport errors around close: a refused poll fails only its room, and close() still ends
every room and returns (loopback transport, real ZMQ)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvproto.aio import DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState, Timeouts
from kvproto.transport import TransportError
from kvproto.wire import ErrorCode

from .conftest import config, make_cache

pytestmark = pytest.mark.asyncio

BLOCK = 4


async def _code(handle, timeout: float = 5.0):
    try:
        await asyncio.wait_for(handle.wait(), timeout)
    except TransferFailed as exc:
        return ErrorCode.coerce(exc.code)
    return None


async def test_close_prefill_poll_error_fails_only_that_room_and_close_returns() -> None:
    """The prefill transport refuses to poll one write (TransportError): that room fails
    TRANSPORT_ERROR on both sides (the decode after the prefill's ABORT), the next room succeeds,
    and close() returns at once on both sides."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    prefill = PrefillEndpoint(src.kv, config=config("loopback"))
    decode = DecodeEndpoint(dst.kv, config=config("loopback"))
    await prefill.start()
    await decode.start()
    try:
        transport = prefill.transport
        real_poll = transport.poll
        broken: list[object] = []

        def poll(xfer):
            if not broken:
                broken.append(xfer)
            if xfer is broken[0]:
                raise TransportError("poll: the agent refused the handle")
            return real_poll(xfer)

        transport.poll = poll
        d1 = decode.open_room(1, prefill.bootstrap_address, pages=[3], num_tokens=BLOCK)
        p1 = prefill.open_room(1)
        p1.send([5], BLOCK, last=True)
        assert await _code(p1) is ErrorCode.TRANSPORT_ERROR
        assert await _code(d1) is ErrorCode.TRANSPORT_ERROR
        d2 = decode.open_room(2, prefill.bootstrap_address, pages=[4], num_tokens=BLOCK)
        p2 = prefill.open_room(2)
        p2.send([6], BLOCK, last=True)
        assert await _code(p2) is None and await _code(d2) is None
        assert dst.planes[0][0][4].equal(src.planes[0][0][6])
    finally:
        start = time.monotonic()
        await decode.close()
        await prefill.close()
        assert time.monotonic() - start < 3.0


async def test_close_decode_with_notifications_failing_still_ends_every_room() -> None:
    """The decode transport fails every drain of notifications while a room waits for its write:
    the room cannot complete, but its deadline still fires (the progress task goes on), and
    close() ends it and returns within the drain bound."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    t = Timeouts(bootstrap=5, waiting=5, transfer=0.5, parked=5, drain=0.5)
    prefill = PrefillEndpoint(src.kv, config=config("loopback", timeouts=t))
    decode = DecodeEndpoint(dst.kv, config=config("loopback", timeouts=t))
    await prefill.start()
    await decode.start()
    try:
        d1 = decode.open_room(1, prefill.bootstrap_address, pages=[3], num_tokens=BLOCK)
        for _ in range(500):
            if d1.poll() is RoomState.TRANSFERRING:
                break
            await asyncio.sleep(0.005)

        def drain():
            raise TransportError("drain_notifications: the agent is gone")

        decode.transport.drain_notifications = drain
        p1 = prefill.open_room(1)
        p1.send([5], BLOCK, last=True)
        code = await _code(d1)
        assert code is ErrorCode.TRANSFER_TIMEOUT, code
        assert decode.errors > 0
        d2 = decode.open_room(2, prefill.bootstrap_address, pages=[4], num_tokens=BLOCK)
        start = time.monotonic()
        await decode.close()
        assert time.monotonic() - start < t.drain + 2.5
        assert d2.poll() is RoomState.FAILED
    finally:
        await decode.close()
        await prefill.close()
