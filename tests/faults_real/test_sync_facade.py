"""The synchronous facade driven as an engine's scheduler would: from plain threads, every call
returning at once, the prefill rank in another process over real NIXL, bytes checked."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from kvproto.aio import DecodeEndpoint, EndpointConfig, PrefillEndpoint
from kvproto.core import RoomState, Timeouts
from kvproto.sync import EngineLoop, KVPoll, SyncDecode, SyncPrefill
from kvproto.wire import ErrorCode, LocalProtocolError

from .procs import SMALL, Child, Rank, RankSpec

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

N = 40
"""Tokens per room (3 pages of 16)."""
DEMO = dict(SMALL, blocks=1024)
"""Room for 300 rooms of 3 pages on either side."""
DONE = {KVPoll.SUCCESS, KVPoll.FAILED}


def decode_side(heartbeat_timeout: float = 1.0) -> tuple[Rank, EndpointConfig]:
    """A decode cache (with the reference checker) and the config the child prefill expects."""
    rank = Rank(RankSpec("decode", demo=DEMO))
    t = 60.0
    config = EndpointConfig(transport="nixl", model_id="faults-real", heartbeat_interval=0.2,
                            heartbeat_timeout=heartbeat_timeout, staging_bytes=0,
                            timeouts=Timeouts(bootstrap=t, waiting=t, transfer=t, parked=t))
    return rank, config


def prefill_child() -> tuple[Child, str]:
    child = Child(RankSpec("prefill", demo=DEMO))
    info = asyncio.run(child.call("start"))
    return child, info["address"]


def feed(child: Child, room_ids: list[int]) -> None:
    """The prefill child opens the rooms, fills their pages and sends them."""
    child.call_blocking("open", [(r, N) for r in room_ids], "", True)


def reap(child: Child, room_ids: list[int]) -> None:
    """The prefill child forgets ended rooms (their pages go back to its pool)."""
    child.call_blocking("wait", room_ids, 10.0)


def run_scheduler(decode: SyncDecode, rank: Rank, address: str, room_ids: list[int], window: int,
                  *, limit: float = 120.0) -> dict[int, tuple[KVPoll, int | None]]:
    """A synchronous scheduler loop: keep ``window`` rooms open, poll each every step, check the
    bytes of every room that succeeds, give its pages back. Returns room -> (state, bad bytes)."""
    live: dict[int, tuple[Any, list[int]]] = {}
    results: dict[int, tuple[KVPoll, int | None]] = {}
    todo = list(room_ids)
    deadline = time.monotonic() + limit
    while (todo or live) and time.monotonic() < deadline:
        while todo and len(live) < window:
            room_id = todo.pop(0)
            pages = rank.cache.take(-(-N // rank.block))
            live[room_id] = (decode.receiver(room_id, address, pages=pages, num_tokens=N), pages)
        for room_id, (room, pages) in list(live.items()):
            state = room.poll()
            if state in DONE:
                bad = rank.cache.check(room_id, pages, N) if state is KVPoll.SUCCESS else None
                results[room_id] = (state, bad)
                rank.cache.give(pages)
                del live[room_id]
        time.sleep(0.0005)  # the model's step
    return results


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_sync_scheduler_drives_1000_rooms_over_nixl_byte_exact(loop_kind: str) -> None:
    """One scheduler thread drives 1,000 rooms through SyncDecode (64 in flight) on an engine loop
    of asyncio or uvloop, the prefill in another process: every room succeeds with exact bytes,
    and get_finished reports each once."""
    import uvloop

    child, address = prefill_child()
    rank, config = decode_side()
    loop = EngineLoop(loop_factory=uvloop.new_event_loop if loop_kind == "uvloop" else None)
    try:
        with SyncDecode(rank.cache.kv, config=config, loop=loop) as decode:
            ids = list(range(1, 1001))
            results: dict[int, Any] = {}
            for first in range(0, 1000, 200):  # the prefill's pool holds 300 rooms: feed it in batches
                batch = ids[first:first + 200]
                feed(child, batch)
                results.update(run_scheduler(decode, rank, address, batch, window=64))
                reap(child, batch)
            finished = decode.get_finished()
        assert len(results) == 1000, f"{1000 - len(results)} rooms never ended"
        assert all(state is KVPoll.SUCCESS and bad == 0 for state, bad in results.values()), \
            [r for r in results.items() if r[1] != (KVPoll.SUCCESS, 0)][:5]
        assert sorted(r for r, _, _ in finished) == ids
    finally:
        loop.close()
        child.reap()


def test_sync_two_engine_threads_at_once() -> None:
    """Two scheduler threads share one SyncDecode, each with its own rooms: all succeed, exact."""
    child, address = prefill_child()
    rank, config = decode_side()
    lock = threading.Lock()

    class Locked:  # the two threads share the decode cache's page pool
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def take(self, n: int) -> list[int]:
            with lock:
                return self.inner.take(n)

        def give(self, pages: list[int]) -> None:
            with lock:
                self.inner.give(pages)

        def check(self, *args: Any) -> int:
            return self.inner.check(*args)

    try:
        with SyncDecode(rank.cache.kv, config=config) as decode:
            ids = [list(range(1, 101)), list(range(101, 201))]
            feed(child, ids[0] + ids[1])
            out: list[dict[int, Any]] = [{}, {}]
            shared = Rank.__new__(Rank)
            shared.cache, shared.block = Locked(rank.cache), rank.block  # type: ignore[assignment]
            threads = [threading.Thread(target=lambda i=i: out[i].update(
                run_scheduler(decode, shared, address, ids[i], window=16))) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        for i in range(2):
            assert sorted(out[i]) == ids[i] and all(v == (KVPoll.SUCCESS, 0) for v in out[i].values())
    finally:
        child.reap()


def test_sync_abort_and_close_from_the_engine_thread_while_rooms_move() -> None:
    """The engine thread aborts some rooms and then closes the facade while others move: every
    room ends (aborted ones ABORTED, the rest SUCCESS or ENDPOINT_CLOSED), nothing hangs, and
    get_finished lists each room once."""
    child, address = prefill_child()
    rank, config = decode_side()
    try:
        decode = SyncDecode(rank.cache.kv, config=config)
        ids = list(range(1, 61))
        rooms = {r: decode.receiver(r, address, pages=rank.cache.take(3), num_tokens=N) for r in ids}
        feed(child, ids)
        for r in ids[::3]:
            rooms[r].abort()
        time.sleep(0.02)
        t0 = time.monotonic()
        decode.close()
        assert time.monotonic() - t0 < 10
        states = {r: room.poll() for r, room in rooms.items()}
        assert set(states.values()) <= DONE
        for r in ids[::3]:
            if states[r] is KVPoll.FAILED:
                assert rooms[r].code in (ErrorCode.ABORTED, ErrorCode.ENDPOINT_CLOSED)
        finished = decode.get_finished()
        assert sorted(r for r, _, _ in finished) == ids
        with pytest.raises(LocalProtocolError):
            decode.receiver(999, address, pages=[1], num_tokens=1)
    finally:
        child.reap()


def test_sync_killed_peer_seen_through_poll_within_liveness_bound() -> None:
    """The prefill process is killed with rooms waiting: poll() reports FAILED (PEER_GONE)
    within the heartbeat timeout (1 s) and a margin."""
    child, address = prefill_child()
    rank, config = decode_side(heartbeat_timeout=1.0)
    try:
        with SyncDecode(rank.cache.kv, config=config) as decode:
            warm = decode.receiver(1, address, pages=rank.cache.take(3), num_tokens=N)
            feed(child, [1])
            deadline = time.monotonic() + 30
            while warm.poll() not in DONE and time.monotonic() < deadline:
                time.sleep(0.001)
            assert warm.poll() is KVPoll.SUCCESS
            waiting = [decode.receiver(r, address, pages=rank.cache.take(3), num_tokens=N) for r in range(2, 6)]
            time.sleep(0.1)
            killed = child.kill()
            while any(room.poll() not in DONE for room in waiting) and time.monotonic() < killed + 10:
                time.sleep(0.005)
            seen = time.monotonic() - killed
            assert all(room.poll() is KVPoll.FAILED for room in waiting)
            assert {room.code for room in waiting} == {ErrorCode.PEER_GONE}
            assert seen < 2.5, f"FAILED seen {seen:.2f}s after the kill"
            with pytest.raises(Exception) as failed:
                waiting[0].failure_exception()
            assert "PEER_GONE" in str(failed.value)
    finally:
        child.reap()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_sync_facade_prefill_and_refused_calls_report_through_poll(loop_kind: str) -> None:
    """SyncPrefill's KVSender (init, send per chunk) moves a chunked room to SyncDecode on one
    engine loop (asyncio's or uvloop's); a refused call (a page listed twice, a live id) fails
    its room with the code instead of raising in the engine thread, and leaves the live room alone."""
    import uvloop

    rank_p, rank_d = Rank(RankSpec("prefill", demo=DEMO)), Rank(RankSpec("decode", demo=DEMO))
    _, config = decode_side()
    loop = EngineLoop(loop_factory=uvloop.new_event_loop if loop_kind == "uvloop" else None)
    try:
        with SyncPrefill(rank_p.cache.kv, config=config, loop=loop) as prefill, \
                SyncDecode(rank_d.cache.kv, config=config, loop=loop) as decode:
            src, dst = [5, 9, 2], [7, 1, 30]
            rank_p.cache.fill(77, src, 0, N)
            receiver = decode.receiver(77, prefill.bootstrap_address, pages=dst, num_tokens=N)
            sender = prefill.sender(77)
            sender.init(N)
            sender.send(src[:2])  # tokens [0, 32)
            sender.send(src[2:])  # tokens [32, 40): the last chunk
            duplicate = decode.receiver(77, prefill.bootstrap_address, pages=[40, 41, 42], num_tokens=N)
            twice = decode.receiver(78, prefill.bootstrap_address, pages=[50, 50, 51], num_tokens=N)
            deadline = time.monotonic() + 20
            while {receiver.poll(), sender.poll()} - DONE and time.monotonic() < deadline:
                time.sleep(0.001)
            assert (receiver.poll(), sender.poll()) == (KVPoll.SUCCESS, KVPoll.SUCCESS)
            assert rank_d.cache.check(77, dst, N) == 0
            assert duplicate.poll() is KVPoll.FAILED and duplicate.code is ErrorCode.DUPLICATE_ROOM
            assert twice.poll() is KVPoll.FAILED and twice.code is ErrorCode.INDEX_OUT_OF_RANGE
            with pytest.raises(LocalProtocolError):
                twice.failure_exception()
            receiver.failure_exception()  # succeeded: nothing to raise
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_sync_async_endpoints_refuse_calls_from_another_thread() -> None:
    """Calling an async endpoint from a thread other than its loop's raises LocalProtocolError
    naming kvproto.sync, and leaves no coroutine behind (warnings are errors here)."""
    rank_p, rank_d = Rank(RankSpec("prefill", demo=DEMO)), Rank(RankSpec("decode", demo=DEMO))
    _, config = decode_side()
    async with PrefillEndpoint(rank_p.cache.kv, config=config) as prefill, \
            DecodeEndpoint(rank_d.cache.kv, config=config) as decode:
        room = prefill.open_room(3)
        errors: list[BaseException] = []

        def from_thread() -> None:
            for call in (lambda: decode.open_room(1, prefill.address, pages=[1, 2, 3], num_tokens=N),
                         lambda: prefill.open_room(2), lambda: room.send([1, 2, 3], N), room.abort):
                try:
                    call()
                except LocalProtocolError as exc:
                    errors.append(exc)

        thread = threading.Thread(target=from_thread)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert len(errors) == 4 and all("kvproto.sync" in str(e) for e in errors)
        assert room.poll() is RoomState.BOOTSTRAPPING and decode.core.rooms == {}
        room.abort()
