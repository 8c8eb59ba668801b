"""The synchronous facade keeps the FAILED promise: a refused call or a close reports FAILED only
once no write can land in the room's pages (simulated transport: writes held in flight)."""

from __future__ import annotations

import time

import pytest

from kvproto.core import RoomState, Timeouts
from kvproto.sync import EngineLoop, SyncDecode, SyncPrefill
from kvproto.testing import FaultPlan, pending_writes
from kvproto.wire import ErrorCode, LocalProtocolError

from .conftest import config, make_cache

BLOCK = 4
"""Tokens per page of ``make_cache``."""

pytestmark = pytest.mark.slow


def _until(cond, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_sync_refused_call_on_a_transferring_room_reports_failed_only_after_its_drain() -> None:
    """KVReceiver.init twice on a room whose writes are in flight: the refused call aborts the
    room, which drains; poll() says TRANSFERRING (never FAILED) while a write into the room can
    still land, then FAILED with the refusal raised by failure_exception() (it used to report
    FAILED at once)."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    plan = FaultPlan(delay_write=1.0, delay_polls=(3000, 3000))
    timeouts = Timeouts(bootstrap=10, waiting=10, transfer=10, parked=10, drain=10)
    loop = EngineLoop()
    try:
        with SyncPrefill(src.kv, config=config("simulated", transport_options={"faults": plan}, timeouts=timeouts,
                                               staging_bytes=0), loop=loop) as prefill, \
                SyncDecode(dst.kv, config=config("simulated", timeouts=timeouts, staging_bytes=0),
                           loop=loop) as decode:
            receiver = decode.receiver(1, prefill.bootstrap_address)
            receiver.init([4], BLOCK)
            sender = prefill.sender(1)
            sender.init(BLOCK)
            sender.send([9])
            agent = decode._endpoint.agent_name
            _until(lambda: bool(pending_writes(agent)))
            assert pending_writes(agent), "no write in flight"
            receiver.init([5], BLOCK)  # refused: the room already has its destination
            seen = []
            while pending_writes(agent):
                seen.append(receiver.poll())
                time.sleep(0.0005)
            assert seen and RoomState.FAILED not in seen, seen
            _until(lambda: receiver.poll() is RoomState.FAILED)
            assert receiver.poll() is RoomState.FAILED
            with pytest.raises(LocalProtocolError):
                receiver.failure_exception()
            finished = decode.get_finished()
            assert [(r, s) for r, s, _ in finished] == [(1, RoomState.FAILED)]
    finally:
        loop.close()


def test_sync_close_with_writes_in_flight_reports_failed_after_them() -> None:
    """Closing the SyncDecode with a write in flight returns once the room ended, and the room
    ended only after its write was over: nothing is pending into the decode when close() returns,
    and the room is FAILED ENDPOINT_CLOSED."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    plan = FaultPlan(delay_write=1.0, delay_polls=(3000, 3000))
    loop = EngineLoop()
    try:
        prefill = SyncPrefill(src.kv, config=config("simulated", transport_options={"faults": plan},
                                                    staging_bytes=0), loop=loop)
        decode = SyncDecode(dst.kv, config=config("simulated", staging_bytes=0), loop=loop)
        receiver = decode.receiver(1, prefill.bootstrap_address, pages=[4], num_tokens=BLOCK)
        sender = prefill.sender(1)
        sender.init(BLOCK)
        sender.send([9])
        agent = decode._endpoint.agent_name
        _until(lambda: bool(pending_writes(agent)))
        assert pending_writes(agent), "no write in flight"
        ended_with_writes: list[bool] = []
        endpoint = decode._endpoint
        original = endpoint._room_ended

        def room_ended(out):  # on the loop, as the room reports its end
            ended_with_writes.append(bool(pending_writes(agent)))
            original(out)

        endpoint._room_ended = room_ended
        decode.close()
        assert ended_with_writes == [False]
        assert receiver.poll() is RoomState.FAILED and receiver.code == ErrorCode.ENDPOINT_CLOSED
        prefill.close()
    finally:
        loop.close()
