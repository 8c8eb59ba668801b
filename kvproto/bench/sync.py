"""``kvproto bench sync``: what the synchronous facade costs an engine's scheduler thread.

Theory of operation
-------------------
A synchronous scheduler (this process's main thread) drives a decode rank through
``kvproto.sync.SyncDecode`` while the prefill rank runs in another process (NIXL), serving
1-page rooms as ``kvproto bench rooms`` does. The scheduler runs steps: in each it opens rooms
up to ``--window`` in flight (``receiver``), polls every live room (``poll``), drains
``get_finished``, then sleeps ``--step-ms`` as a model step would. Every facade call is timed
on the engine thread (``perf_counter`` around the call), and every step's overhead beyond its
sleep is recorded: its p50/p99/max is the jitter kvproto adds to the engine's loop. Last, the
facade sits idle for a second with its endpoint started and the process's CPU time over that
second is reported (an idle facade should cost next to nothing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

from kvproto.bench.rooms import BLOCK, _cache, _config, _page, _pct, _prefill_child


def run(rooms: int, window: int, step_ms: float, blocks: int, transport: str) -> dict[str, Any]:
    from kvproto.core import RoomState
    from kvproto.sync import SyncDecode

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_prefill_child, args=(transport, blocks, child_conn), daemon=True)
    child.start()
    address = conn.recv()
    src, _ = _cache(1, blocks)
    dst, kv = _cache(2, blocks)
    calls: dict[str, list[float]] = {"receiver": [], "poll": [], "get_finished": []}
    overheads: list[float] = []
    done = {RoomState.SUCCESS, RoomState.FAILED}
    try:
        decode = SyncDecode(kv, config=_config(transport))
        try:
            conn.send((1, rooms, window))  # the prefill opens every room and gives its page
            live: dict[int, Any] = {}
            next_room, finished, failed = 1, 0, 0
            started = time.perf_counter()
            while finished < rooms:
                t0 = time.perf_counter()
                while len(live) < window and next_room <= rooms:
                    c0 = time.perf_counter()
                    live[next_room] = decode.receiver(next_room, address, pages=[_page(next_room, blocks)],
                                                      num_tokens=BLOCK)
                    calls["receiver"].append(time.perf_counter() - c0)
                    next_room += 1
                for room_id in list(live):
                    c0 = time.perf_counter()
                    state = live[room_id].poll()
                    calls["poll"].append(time.perf_counter() - c0)
                    if state in done:
                        failed += state is RoomState.FAILED
                        finished += 1
                        del live[room_id]
                c0 = time.perf_counter()
                decode.get_finished()
                calls["get_finished"].append(time.perf_counter() - c0)
                overheads.append(time.perf_counter() - t0)
                time.sleep(step_ms / 1000)
            seconds = time.perf_counter() - started
            assert conn.recv() == "done"
            for room_id in range(max(1, rooms - blocks + 1), rooms + 1):
                page = _page(room_id, blocks)
                if not all(src[p][layer][page].equal(dst[p][layer][page]) for p in range(2) for layer in range(4)):
                    raise AssertionError(f"room {room_id}: page {page} differs from the source")
            cpu0, wall0 = time.process_time(), time.perf_counter()
            time.sleep(1.0)
            idle_cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        finally:
            decode.close()
    finally:
        conn.send(None)
        child.join(timeout=10)
    if failed:
        raise RuntimeError(f"{failed} rooms failed")
    result: dict[str, Any] = {"rooms": rooms, "window": window, "step_ms": step_ms, "rooms_per_s": rooms / seconds,
                              "idle_cpu_fraction": idle_cpu, "steps": len(overheads)}
    for name, values in calls.items():
        result[f"{name}_p50_us"] = _pct(values, 0.5) * 1e6
        result[f"{name}_p99_us"] = _pct(values, 0.99) * 1e6
        result[f"{name}_max_us"] = max(values, default=0.0) * 1e6
    result["step_overhead_p50_ms"] = _pct(overheads, 0.5) * 1e3
    result["step_overhead_p99_ms"] = _pct(overheads, 0.99) * 1e3
    result["step_overhead_max_ms"] = max(overheads, default=0.0) * 1e3
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvproto bench sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=4000)
    ap.add_argument("--window", type=int, default=512, help="rooms in flight")
    ap.add_argument("--step-ms", type=float, default=1.0, help="the model step the scheduler sleeps")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    r = run(args.rooms, args.window, args.step_ms, args.blocks, args.transport)
    print(f"synchronous scheduler thread driving SyncDecode, prefill in another process ({args.transport}), "
          f"{r['rooms']} 1-page rooms, {r['window']} in flight, {r['step_ms']} ms model step: "
          f"{r['rooms_per_s']:.0f} rooms/s over {r['steps']} steps")
    print(f"{'call':>14} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for name in ("receiver", "poll", "get_finished"):
        print(f"{name:>14} {r[name + '_p50_us']:>8.1f} {r[name + '_p99_us']:>8.1f} {r[name + '_max_us']:>8.1f}")
    print(f"step overhead (kvproto calls per step, beyond the model step): p50 {r['step_overhead_p50_ms']:.3f} ms, "
          f"p99 {r['step_overhead_p99_ms']:.3f} ms, max {r['step_overhead_max_ms']:.3f} ms")
    print(f"idle facade (endpoint started, no rooms): {r['idle_cpu_fraction'] * 100:.1f}% of a core")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sync", **r}, f, indent=1)
    return 0
