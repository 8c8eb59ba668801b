"""Liveness over real NIXL and ZMQ: peers killed with SIGKILL mid-transfer, peers that restart.

Each test runs one rank in the test's event loop and its peer in a child process (``spawn``)
with short heartbeats (every 0.2 s, dead after 1 s of silence), kills the child with SIGKILL
while large writes are in flight, and checks that the survivor fails the rooms in time (no
hang), releases everything it held for the dead peer, and serves a new peer process byte-exact.
Detection latencies are measured from the kill and printed (``-s`` shows them); the bounds
are generous enough for a loaded two-core CI machine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvproto.core import RoomState
from kvproto.wire import ErrorCode

from .procs import BIG, Child, Rank, RankSpec, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl]

INTERVAL, TIMEOUT = 0.2, 1.0
SLACK = 4.0
"""Allowed beyond the heartbeat timeout before a dead peer's rooms must have failed."""
LONG = 30.0
"""Heartbeat timeout of the restart tests: only the restart itself can explain a fast failure."""

T_ROOMS = 12
"""Rooms with a 16 MiB write in flight at the kill (192 MiB in all)."""
W_ROOMS = 4
"""Rooms whose requests arrived but whose KV was never sent (only liveness can fail them)."""

FAILED, WAITING, TRANSFERRING, SUCCESS = (int(s) for s in (RoomState.FAILED, RoomState.WAITING_FOR_INPUT,
                                                           RoomState.TRANSFERRING, RoomState.SUCCESS))


def report(what: str, latencies: list[float]) -> str:
    lat = sorted(latencies)
    line = (f"{what}: n={len(lat)} min {lat[0] * 1e3:.0f} ms, median {lat[len(lat) // 2] * 1e3:.0f} ms, "
            f"max {lat[-1] * 1e3:.0f} ms")
    print(line)
    return line


def rooms(base: int, n: int, tokens: int) -> list[tuple[int, int]]:
    return [(base + i, tokens) for i in range(n)]


def ids(specs: list[tuple[int, int]]) -> list[int]:
    return [r for r, _ in specs]


def assert_served(results: dict[int, dict]) -> None:
    bad = {r: v for r, v in results.items() if v["state"] != SUCCESS or v["bad"] not in (None, 0)}
    assert not bad, bad


async def test_prefill_survives_decode_killed_mid_transfer(spawn) -> None:
    """SIGKILL of the decode process with 192 MiB of writes in flight: every prefill room fails
    within the heartbeat timeout plus slack (PEER_GONE; a room whose write the transport failed
    first may carry TRANSPORT_ERROR), every pending write and the link and transport peer are
    released, and a new decode process is served byte-exact."""
    prefill = Rank(RankSpec("prefill", demo=BIG, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT))
    decode = spawn(RankSpec("decode", demo=BIG, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT))
    successor = spawn(RankSpec("decode", demo=BIG, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT))
    await prefill.start()
    try:
        await decode.call("start")
        moving, waiting = rooms(1000, T_ROOMS, 1024), rooms(2000, W_ROOMS, 64)
        await decode.call("open", moving + waiting, prefill.ep.address)
        prefill.open(moving + waiting)
        await wait_until(lambda: set(prefill.states(ids(moving + waiting)).values()) == {WAITING}, 20,
                         "every request to reach the prefill")
        decode.stop()  # SIGSTOP: it stops draining, so the large writes stay in flight
        silent = time.monotonic()  # and stops heartbeating
        prefill.send(ids(moving))
        await asyncio.sleep(0.2)
        pending = len(prefill.ep._pending)
        assert pending >= T_ROOMS, f"only {pending} writes in flight"
        assert set(prefill.states(ids(moving)).values()) == {TRANSFERRING}
        decode_agent = next(iter(prefill.snapshot()["peers"]))
        killed = decode.kill()

        results = await prefill.wait(ids(moving + waiting), TIMEOUT + SLACK + 1)
        assert {v["state"] for v in results.values()} == {FAILED}, results
        codes = {r: ErrorCode(v["code"]) for r, v in results.items()}
        assert {codes[r] for r in ids(waiting)} == {ErrorCode.PEER_GONE}, codes
        assert {codes[r] for r in ids(moving)} <= {ErrorCode.PEER_GONE, ErrorCode.TRANSPORT_ERROR}, codes
        latency = {r: v["ended"] - killed for r, v in results.items()}
        print(f"\n{pending} writes in flight at the kill; moving rooms ended with "
              f"{sorted(c.name for c in {codes[r] for r in ids(moving)})}")
        report("decode killed -> prefill room failed (moving rooms)", [latency[r] for r in ids(moving)])
        report("decode killed -> prefill room failed (waiting rooms, heartbeat)", [latency[r] for r in ids(waiting)])
        report("decode silent (SIGSTOP, 0.2 s before the kill) -> waiting room failed",
               [results[r]["ended"] - silent for r in ids(waiting)])
        assert max(latency.values()) <= TIMEOUT + SLACK

        released = await wait_until(lambda: prefill.snapshot()["links"] == 0, TIMEOUT + SLACK, "the link drop")
        print(f"decode killed -> link and transport peer removed: {(released - killed) * 1e3:.0f} ms")
        snap = prefill.snapshot()
        assert snap["pending"] == 0 and snap["xfers"] == 0, snap
        assert decode_agent not in snap["peers"], snap
        assert snap["errors"] == 0 and snap["rooms"] == 0 and snap["handles"] == 0, snap

        await successor.call("start")
        again = rooms(3000, 4, 1024)
        await successor.call("open", again, prefill.ep.address)
        prefill.open(again, send=True)
        assert_served(await prefill.wait(ids(again), 30))
        assert_served(await successor.call("wait", ids(again), 30))
        assert prefill.ep.errors == 0
    finally:
        await prefill.close()


async def test_decode_survives_prefill_killed_mid_transfer(spawn) -> None:
    """SIGKILL of the prefill process with its writes in flight: every decode room fails
    PEER_GONE within the heartbeat timeout plus slack (no hang), the decode drops the link, and
    after a new prefill process starts on the same port (a new boot id) new rooms succeed."""
    decode = Rank(RankSpec("decode", demo=BIG, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT))
    spec = RankSpec("prefill", demo=BIG, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT)
    prefill, successor = spawn(spec), spawn(spec)
    await decode.start()
    try:
        first = await prefill.call("start")
        moving = rooms(4000, T_ROOMS, 1024)
        decode.open(moving, first["address"])
        await prefill.call("open", moving)
        await wait_until(lambda: set(decode.states(ids(moving)).values()) == {TRANSFERRING}, 20,
                         "every decode room to send its request")
        await wait_until(async_all_equal(prefill, ids(moving), WAITING), 20, "every request to reach the prefill")
        # This event loop stands still from here to the kill: the decode drains nothing, so the
        # prefill's large writes stay in flight.
        pending = prefill.call_blocking("send", ids(moving))
        time.sleep(0.1)
        still = prefill.call_blocking("snapshot")["pending"]
        killed = prefill.kill()
        assert pending >= T_ROOMS and still >= T_ROOMS, (pending, still)

        results = await decode.wait(ids(moving), TIMEOUT + SLACK + 1)
        assert {v["state"] for v in results.values()} == {FAILED}, results
        assert {ErrorCode(v["code"]) for v in results.values()} == {ErrorCode.PEER_GONE}, results
        latency = [v["ended"] - killed for v in results.values()]
        print(f"\n{still} prefill writes in flight at the kill")
        report("prefill killed -> decode room failed PEER_GONE", latency)
        assert max(latency) <= TIMEOUT + SLACK
        snap = decode.snapshot()
        assert snap["links"] == 0 and snap["rooms"] == 0 and snap["handles"] == 0 and snap["errors"] == 0, snap

        port = int(first["address"].rsplit(":", 1)[1])
        restarted = await successor.call("start", port)
        assert restarted["address"] == first["address"] and restarted["boot_id"] != first["boot_id"]
        again = rooms(5000, 4, 1024)
        decode.open(again, restarted["address"])
        await successor.call("open", again, "", True)
        assert_served(await decode.wait(ids(again), 30))
        assert_served(await successor.call("wait", ids(again), 30))
        assert decode.ep.errors == 0
    finally:
        await decode.close()


def async_all_equal(child: Child, room_ids: list[int], state: int):
    async def check() -> bool:
        return set((await child.call("states", room_ids)).values()) == {state}

    return check


async def test_prefill_detects_decode_restart_while_link_alive(spawn) -> None:
    """A decode rank killed and restarted at once (same instance, new boot id) registers again
    long before the 30 s heartbeat timeout: the prefill drops the old link there, the old
    rooms fail PEER_GONE, and the restarted process's rooms succeed byte-exact."""
    prefill = Rank(RankSpec("prefill", heartbeat_interval=INTERVAL, heartbeat_timeout=LONG))
    spec = RankSpec("decode", heartbeat_interval=INTERVAL, heartbeat_timeout=LONG, instance="decode-restarts")
    decode, successor = spawn(spec), spawn(spec)
    await prefill.start()
    try:
        first = await decode.call("start")
        restarted = await successor.call("start")  # a restart whose process is already up: only the
        # restart is timed
        assert restarted["boot_id"] != first["boot_id"]
        old = rooms(6000, 8, 40)
        await decode.call("open", old, prefill.ep.address)
        prefill.open(old)
        await wait_until(lambda: set(prefill.states(ids(old)).values()) == {WAITING}, 20,
                         "every request to reach the prefill")
        killed = decode.kill()
        again = rooms(7000, 4, 40)
        await successor.call("open", again, prefill.ep.address)

        results = await prefill.wait(ids(old), 10)
        assert {v["state"] for v in results.values()} == {FAILED}, results
        assert {ErrorCode(v["code"]) for v in results.values()} == {ErrorCode.PEER_GONE}, results
        assert all("restarted" in v["reason"] for v in results.values()), results
        latency = [v["ended"] - killed for v in results.values()]
        print()
        report("decode restarted -> prefill room failed PEER_GONE (re-registration)", latency)
        assert max(latency) < LONG / 3  # the restart, not the heartbeat timeout, failed them
        prefill.open(again, send=True)
        assert_served(await prefill.wait(ids(again), 30))
        assert_served(await successor.call("wait", ids(again), 30))
        snap = prefill.snapshot()
        assert snap["links"] == 1 and len(snap["peers"]) == 1 and snap["errors"] == 0, snap
    finally:
        await prefill.close()


async def test_decode_detects_prefill_restart_while_link_alive(spawn) -> None:
    """A prefill rank killed and restarted at once on the same port (new boot id) is detected
    by the decode's next heartbeat, long before the 30 s heartbeat timeout: the old rooms fail
    (the new process answers the heartbeat of a link it never registered with a link ABORT
    NOT_REGISTERED, spec/v1/messages.md section 10), and new rooms bootstrap again and succeed."""
    decode = Rank(RankSpec("decode", heartbeat_interval=INTERVAL, heartbeat_timeout=LONG))
    spec = RankSpec("prefill", heartbeat_interval=INTERVAL, heartbeat_timeout=LONG)
    prefill, successor = spawn(spec), spawn(spec)
    await decode.start()
    try:
        first = await prefill.call("start")
        await successor.call("ping")  # the restarted process is up: only the restart is timed
        old = rooms(8000, 8, 40)
        decode.open(old, first["address"])
        await prefill.call("open", old)
        await wait_until(async_all_equal(prefill, ids(old), WAITING), 20, "every request to reach the prefill")
        killed = prefill.kill()
        port = int(first["address"].rsplit(":", 1)[1])
        restarted = await successor.call("start", port)
        bound = time.monotonic()
        assert restarted["boot_id"] != first["boot_id"]

        results = await decode.wait(ids(old), 10)
        assert {v["state"] for v in results.values()} == {FAILED}, results
        codes = {ErrorCode(v["code"]) for v in results.values()}
        assert codes <= {ErrorCode.PEER_GONE, ErrorCode.NOT_REGISTERED}, results
        latency = [v["ended"] - killed for v in results.values()]
        print(f"\nold decode rooms failed with {sorted(c.name for c in codes)}")
        report("prefill killed -> decode room failed (restart and next heartbeat)", latency)
        report("restarted prefill bound -> decode room failed", [v["ended"] - bound for v in results.values()])
        assert max(latency) < LONG / 3
        again = rooms(9000, 4, 40)
        decode.open(again, restarted["address"])
        await successor.call("open", again, "", True)
        assert_served(await decode.wait(ids(again), 30))
        assert_served(await successor.call("wait", ids(again), 30))
        assert decode.ep.errors == 0
    finally:
        await decode.close()


# --- a new boot id on a link that looks alive, in one process ------------------------------------


async def started_pair(heartbeat_timeout: float = LONG) -> tuple[Rank, Rank]:
    prefill = Rank(RankSpec("prefill", heartbeat_interval=INTERVAL, heartbeat_timeout=heartbeat_timeout))
    decode = Rank(RankSpec("decode", heartbeat_interval=INTERVAL, heartbeat_timeout=heartbeat_timeout))
    await prefill.start()
    await decode.start()
    return prefill, decode


async def open_waiting(prefill: Rank, decode: Rank, specs: list[tuple[int, int]]) -> None:
    """Rooms whose requests reached the prefill and whose KV is not sent yet."""
    decode.open(specs, prefill.ep.address)
    prefill.open(specs)
    await wait_until(lambda: set(prefill.states(ids(specs)).values()) == {WAITING}, 10, "the requests")


async def test_decode_drops_link_on_new_prefill_boot_id() -> None:
    """A heartbeat answer carrying another boot id than the prefill registered with means it
    restarted: the decode drops the link within about one heartbeat interval and its rooms fail
    PEER_GONE; the prefill's stale link is replaced when the decode registers again, failing
    its rooms PEER_GONE too; new rooms succeed."""
    prefill, decode = await started_pair()
    try:
        old = rooms(100, 4, 40)
        await open_waiting(prefill, decode, old)
        prefill.ep.boot_id ^= 0x5A5A  # what the restarted rank would answer with
        changed = time.monotonic()
        results = await decode.wait(ids(old), 5)
        assert {ErrorCode(v["code"]) for v in results.values()} == {ErrorCode.PEER_GONE}, results
        assert all("restarted" in v["reason"] for v in results.values()), results
        print()
        report("prefill boot id changed -> decode room failed PEER_GONE",
               [v["ended"] - changed for v in results.values()])
        assert max(v["ended"] - changed for v in results.values()) < 5 * INTERVAL + SLACK
        again = rooms(200, 4, 40)
        decode.open(again, prefill.ep.address)
        prefill.open(again, send=True)
        stale = await prefill.wait(ids(old), 5)
        assert {ErrorCode(v["code"]) for v in stale.values()} == {ErrorCode.PEER_GONE}, stale
        assert_served(await decode.wait(ids(again), 10))
        assert_served(await prefill.wait(ids(again), 10))
        assert prefill.ep.errors == 0 and decode.ep.errors == 0
    finally:
        await decode.close()
        await prefill.close()


async def test_prefill_drops_link_on_new_decode_boot_id() -> None:
    """A heartbeat carrying another boot id than the decode registered with means it restarted:
    the prefill drops the link at once and its rooms fail PEER_GONE; the decode hears
    NOT_REGISTERED on its next heartbeat and fails its rooms; new rooms register again and
    succeed."""
    prefill, decode = await started_pair()
    try:
        old = rooms(300, 4, 40)
        await open_waiting(prefill, decode, old)
        decode.ep.boot_id ^= 0x5A5A
        changed = time.monotonic()
        results = await prefill.wait(ids(old), 5)
        assert {ErrorCode(v["code"]) for v in results.values()} == {ErrorCode.PEER_GONE}, results
        assert all("restarted" in v["reason"] for v in results.values()), results
        print()
        report("decode boot id changed -> prefill room failed PEER_GONE",
               [v["ended"] - changed for v in results.values()])
        assert max(v["ended"] - changed for v in results.values()) < 5 * INTERVAL + SLACK
        gone = await decode.wait(ids(old), 5)
        assert {v["state"] for v in gone.values()} == {FAILED}, gone
        assert prefill.snapshot()["links"] == 0 and prefill.snapshot()["peers"] == []
        again = rooms(400, 4, 40)
        decode.open(again, prefill.ep.address)
        prefill.open(again, send=True)
        assert_served(await decode.wait(ids(again), 10))
        assert_served(await prefill.wait(ids(again), 10))
        assert prefill.ep.errors == 0 and decode.ep.errors == 0
    finally:
        await decode.close()
        await prefill.close()


async def crash(rank: Rank) -> None:
    """Make an in-process endpoint vanish as a killed process would: no ABORT, no goodbye."""
    ep = rank.ep
    tasks = list(ep._tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ep._router.close(linger=0)
    ep._ctx.destroy(linger=0)
    ep.transport.close()
    ep._closed = True


async def test_decode_prefill_restart_fails_rooms_peer_gone() -> None:
    """A prefill that restarts on the same port fails the decode's old rooms with PEER_GONE."""
    prefill, decode = await started_pair()
    successor = None
    try:
        old = rooms(500, 2, 40)
        await open_waiting(prefill, decode, old)
        port = int(prefill.ep.address.rsplit(":", 1)[1])
        await crash(prefill)
        successor = Rank(RankSpec("prefill", heartbeat_interval=INTERVAL, heartbeat_timeout=LONG))
        await successor.start(port)
        results = await decode.wait(ids(old), 5)
        assert {ErrorCode(v["code"]) for v in results.values()} == {ErrorCode.PEER_GONE}, results
    finally:
        await decode.close()
        if successor is not None:
            await successor.close()
