"""Load: 1,000 concurrent rooms over real NIXL between two processes, every byte checked.

The prefill rank runs in a child process (``spawn``), the decode rank in the test's event loop;
each has its own NIXL agent and ZMQ sockets. All 1,000 rooms are opened on both sides before
any completes (the decode's requests arrive before the prefill opens its rooms, so most are
parked first), each with non-contiguous pages and an aux slot; the decode checks every byte of
every room against the reference content (``kvproto.demo.Content``).
"""

from __future__ import annotations

import time

import pytest

from .procs import SMALL, Rank, RankSpec

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl, pytest.mark.slow]

ROOMS = 1000
TOKENS = 20
"""Two 16-token pages per room: 2,000 pages in flight on each side."""


async def test_load_thousand_concurrent_rooms_byte_exact(spawn) -> None:
    """1,000 rooms in flight at once between a prefill and a decode process all succeed on both
    sides, byte-exact (KV and aux)."""
    demo = dict(SMALL, blocks=ROOMS * 2 + 64)
    spec = dict(demo=demo, aux_slots=ROOMS, heartbeat_interval=1.0, heartbeat_timeout=10.0, room_timeout=120.0)
    decode = Rank(RankSpec("decode", **spec))
    prefill = spawn(RankSpec("prefill", **spec))
    await decode.start()
    try:
        info = await prefill.call("start")
        rooms = [(900_000 + i, TOKENS) for i in range(ROOMS)]
        ids = [r for r, _ in rooms]
        began = time.perf_counter()
        decode.open(rooms, info["address"])
        await prefill.call("open", rooms, "", True)
        opened = time.perf_counter()
        results = await decode.wait(ids, 100)
        landed = time.perf_counter()
        sent = await prefill.call("wait", ids, 30)
        failed = {r: v for r, v in results.items() if v["state"] != 4 or v["bad"] != 0}
        assert not failed, dict(list(failed.items())[:5])
        assert all(v["state"] == 4 for v in sent.values())
        assert all(v["aux"] for v in results.values())
        snap = await prefill.call("snapshot")
        assert snap["errors"] == 0 and snap["pending"] == 0 and snap["rooms"] == 0, snap
        assert decode.ep.errors == 0
        print(f"\n{ROOMS} concurrent rooms over NIXL, prefill and decode in separate processes: opened in "
              f"{opened - began:.2f} s (page fill included), all landed and checked byte-exact "
              f"{landed - began:.2f} s after the first open")
    finally:
        await decode.close()
