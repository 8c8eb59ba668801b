"""``kvproto bench sync``: what the synchronous facade costs an engine's scheduler thread.

Theory of operation
-------------------
A synchronous scheduler (this process's main thread) drives a decode rank through
``kvproto.sync.SyncDecode`` while the prefill rank runs in another process (NIXL), serving
1-page rooms as ``kvproto bench rooms`` does. The scheduler runs steps: in each it opens rooms
up to ``--window`` in flight (``receiver``), polls every live room (``poll``), drains
``get_finished``, then sleeps ``--step-ms`` as a model step would. Every other step times each
facade call on the engine thread (``perf_counter`` around the call); the steps between time only
the whole step, and their overhead beyond the sleep is the *step overhead*: its p50/p99/max is the
jitter kvproto adds to the engine's loop. (Timing 512 polls one by one costs about as much as the
polls themselves, which an engine does not pay; both figures are printed.) Last, the
facade sits idle for a second with its endpoint started and the process's CPU time over that
second is reported (an idle facade should cost next to nothing).

The prefill side's calls (``sender``, ``init``, ``send``, ``abort``, ``poll``, ``get_finished``)
are timed the same way in a run of their own (``run_prefill``): the scheduler thread drives the
prefill facade while a decode rank in another process opens the rooms; every 50th room is
aborted after ``init`` (the decode must see exactly those fail).

Then an *engine-shaped loop* (``run_engine``): the same thread runs steps of a model step of
``--engine-step-ms`` (many small launches and a synchronize on a GPU; CPU matrix products
otherwise) plus that step's facade calls, in three phases: no kvproto, the facade idle, and
``--engine-rooms`` rooms moving at ``--window`` in flight. The difference of the step's p50 and
p99 to the bare loop is the jitter users feel; the process's CPU beyond the bare loop is what
kvproto costs it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

from kvproto.bench.rooms import BLOCK, _cache, _check, _config, _decode_rooms, _page, _pct, _prefill_child


def _facade(process: bool) -> Any:
    """The decode facade under test: ``SyncDecode`` (endpoint on a thread of this process) or
    ``ProcessDecode`` (endpoint in a child process)."""
    if process:
        from kvproto.sync import ProcessDecode

        return ProcessDecode
    from kvproto.sync import SyncDecode

    return SyncDecode


def _spawn_prefill(transport: str, blocks: int) -> tuple[Any, Any, str]:
    """The prefill rank in a process of its own: (its pipe, the process, its bootstrap address)."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_prefill_child, args=(transport, blocks, child_conn), daemon=True)
    child.start()
    return conn, child, conn.recv()


class _Scheduler:
    """The scheduler's kvproto calls of one step: open rooms up to ``window`` in flight
    (``receiver``), poll every live room, drain ``get_finished``; each call timed into ``calls``
    when given."""

    def __init__(self, decode: Any, address: str, rooms: int, window: int, blocks: int,
                 calls: dict[str, list[float]] | None = None) -> None:
        self.decode, self.address, self.rooms, self.window, self.blocks = decode, address, rooms, window, blocks
        self.calls = calls
        self.live: dict[int, Any] = {}
        self.next_room, self.ended, self.failed = 1, 0, 0

    def _timed(self, name: str, c0: float) -> None:
        if self.calls is not None:
            self.calls[name].append(time.perf_counter() - c0)

    def step(self) -> None:
        from kvproto.core import RoomState

        if self.calls is None:  # the engine's own loop: nothing but the calls
            self._step()
            return
        while len(self.live) < self.window and self.next_room <= self.rooms:
            c0 = time.perf_counter()
            room_id = self.next_room
            self.live[room_id] = self.decode.receiver(room_id, self.address, pages=[_page(room_id, self.blocks)],
                                                      num_tokens=BLOCK)
            self._timed("receiver", c0)
            self.next_room += 1
        for room_id in list(self.live):
            c0 = time.perf_counter()
            state = self.live[room_id].poll()
            self._timed("poll", c0)
            if state in (RoomState.SUCCESS, RoomState.FAILED):
                self.failed += state is RoomState.FAILED
                self.ended += 1
                del self.live[room_id]
        c0 = time.perf_counter()
        self.decode.get_finished()
        self._timed("get_finished", c0)

    def _step(self) -> None:
        """``step`` with no timer around each call."""
        from kvproto.core import RoomState

        success, failed = RoomState.SUCCESS, RoomState.FAILED
        live, decode, address = self.live, self.decode, self.address
        while len(live) < self.window and self.next_room <= self.rooms:
            room_id = self.next_room
            live[room_id] = decode.receiver(room_id, address, pages=[_page(room_id, self.blocks)], num_tokens=BLOCK)
            self.next_room += 1
        for room_id, room in list(live.items()):
            state = room.poll()
            if state is success or state is failed:
                self.failed += state is failed
                self.ended += 1
                del live[room_id]
        decode.get_finished()


def run(rooms: int, window: int, step_ms: float, blocks: int, transport: str, process: bool = False) -> dict[str, Any]:
    conn, child, address = _spawn_prefill(transport, blocks)
    src, _ = _cache(1, blocks)
    dst, kv = _cache(2, blocks)
    calls: dict[str, list[float]] = {"receiver": [], "poll": [], "get_finished": []}
    overheads: list[float] = []
    overheads_timed: list[float] = []
    try:
        decode = _facade(process)(kv, config=_config(transport))
        try:
            conn.send((1, rooms, window))  # the prefill opens every room and gives its page
            scheduler = _Scheduler(decode, address, rooms, window, blocks)
            started = time.perf_counter()
            while scheduler.ended < rooms:
                timed = len(overheads) + len(overheads_timed)
                scheduler.calls = calls if timed % 2 else None  # every other step times each call
                t0 = time.perf_counter()
                scheduler.step()
                (overheads_timed if timed % 2 else overheads).append(time.perf_counter() - t0)
                time.sleep(step_ms / 1000)
            seconds = time.perf_counter() - started
            failed = scheduler.failed
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
                              "idle_cpu_fraction": idle_cpu, "steps": len(overheads) + len(overheads_timed)}
    for name, values in calls.items():
        result[f"{name}_p50_us"] = _pct(values, 0.5) * 1e6
        result[f"{name}_p99_us"] = _pct(values, 0.99) * 1e6
        result[f"{name}_max_us"] = max(values, default=0.0) * 1e6
    result["step_overhead_p50_ms"] = _pct(overheads, 0.5) * 1e3
    result["step_overhead_p99_ms"] = _pct(overheads, 0.99) * 1e3
    result["step_overhead_max_ms"] = max(overheads, default=0.0) * 1e3
    result["timed_step_overhead_p50_ms"] = _pct(overheads_timed, 0.5) * 1e3
    result["timed_step_overhead_p99_ms"] = _pct(overheads_timed, 0.99) * 1e3
    return result


def _model_step(step_ms: float) -> tuple[Any, str]:
    """A model step for the engine loop: launches then a synchronize on a GPU (about a hundred bf16
    matrix products for 20 ms, as a decode step's kernels), a float32 matrix product on the CPU (torch releases
    the interpreter lock while it computes, as a GPU step's launches and synchronize mostly do).
    Returns (step function, what it is)."""
    import torch

    if torch.cuda.is_available():
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # ~0.2 ms each on an H100

        def launches(n: int) -> None:
            for _ in range(n):
                a @ a
            torch.cuda.synchronize()

        what = "GPU: {n} bf16 4096^2 matrix products, then synchronize"
    else:
        torch.set_num_threads(1)  # one core of model work, so that the CPU figures read plainly
        a = torch.randn(256, 256)

        def launches(n: int) -> None:
            for _ in range(n):
                a @ a

        what = "CPU: {n} float32 256^2 matrix products on one thread"
    launches(3)
    per = float("inf")
    for _ in range(5):  # the fastest of five: a busy machine must not shorten the step
        t0 = time.perf_counter()
        launches(20)
        per = min(per, (time.perf_counter() - t0) / 20)
    n = max(1, round(step_ms / 1e3 / per))
    return (lambda: launches(n)), what.format(n=n)


ABORT_EVERY = 50
"""The prefill-side run aborts every ``ABORT_EVERY``-th room right after ``init`` (timing ``abort``)."""


def _decode_child(transport: str, blocks: int, address: str, rooms: int, window: int, aborted: list[int],
                  conn: Any) -> None:
    """The decode rank of the prefill-side run, in a process of its own: says ``ready`` once its
    endpoint has started (the parent's clock starts then, not at the spawn: a process that imports
    torch and starts a NIXL agent takes seconds, which are no part of the prefill's rate), opens
    rooms 1..``rooms`` keeping ``window`` in flight, checks the pages of the last rooms that were not
    aborted, and reports how many rooms failed."""
    import asyncio

    async def serve() -> int:
        from kvproto.aio import DecodeEndpoint

        src, _ = _cache(1, blocks)
        dst, kv = _cache(2, blocks)
        failures: list[str] = []
        async with DecodeEndpoint(kv, config=_config(transport)) as decode:
            conn.send(("ready", None))
            await _decode_rooms(decode, address, 1, rooms, window, blocks, failures)
        _check(src, dst, 1, rooms, blocks, skip=frozenset(aborted))
        return len(failures)

    try:
        conn.send(("done", asyncio.run(serve())))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def run_prefill(rooms: int, window: int, step_ms: float, blocks: int, transport: str,
                process: bool = False) -> dict[str, Any]:
    """The prefill side's calls, timed on a synchronous scheduler thread driving ``SyncPrefill``
    (``ProcessPrefill`` with ``process``) while a decode rank in another process opens the rooms:
    per step, open rooms up to ``window`` (``sender``, ``init``, then ``send`` of the room's page,
    or ``abort`` for every ``ABORT_EVERY``-th room), poll every live room, drain ``get_finished``."""
    from kvproto.core import RoomState

    if process:
        from kvproto.sync import ProcessPrefill as facade
    else:
        from kvproto.sync import SyncPrefill as facade  # type: ignore[assignment]
    _, kv = _cache(1, blocks)
    calls: dict[str, list[float]] = {name: [] for name in ("sender", "init", "send", "abort", "poll", "get_finished")}
    aborted = [r for r in range(1, rooms + 1) if r % ABORT_EVERY == 0]
    ctx = mp.get_context("spawn")
    with facade(kv, config=_config(transport)) as prefill:
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=_decode_child, args=(transport, blocks, prefill.bootstrap_address or prefill.address,
                                                        rooms, window, aborted, child_conn), daemon=True)
        child.start()
        if not conn.poll(120):
            raise RuntimeError("the decode process did not start")
        status, value = conn.recv()
        if status != "ready":
            raise RuntimeError(f"the decode process failed: {value}")
        pc = time.perf_counter
        live: dict[int, Any] = {}
        next_room, ended, failed = 1, 0, 0
        started = pc()
        while ended < rooms:
            while len(live) < window and next_room <= rooms:
                room_id = next_room
                c0 = pc()
                room = prefill.sender(room_id)
                c1 = pc()
                room.init(BLOCK)
                c2 = pc()
                if room_id % ABORT_EVERY == 0:
                    room.abort()
                    calls["abort"].append(pc() - c2)
                else:
                    room.send([_page(room_id, blocks)])
                    calls["send"].append(pc() - c2)
                calls["sender"].append(c1 - c0)
                calls["init"].append(c2 - c1)
                live[room_id] = room
                next_room += 1
            for room_id, room in list(live.items()):
                c0 = pc()
                state = room.poll()
                calls["poll"].append(pc() - c0)
                if state is RoomState.SUCCESS or state is RoomState.FAILED:
                    failed += state is RoomState.FAILED and room_id % ABORT_EVERY != 0
                    ended += 1
                    del live[room_id]
            c0 = pc()
            prefill.get_finished()
            calls["get_finished"].append(pc() - c0)
            time.sleep(step_ms / 1000)
        seconds = pc() - started
        if not conn.poll(120):
            raise RuntimeError("the decode process did not finish")
        status, value = conn.recv()
        child.join(timeout=10)
    if status != "done":
        raise RuntimeError(f"the decode process failed: {value}")
    if failed or value != len(aborted):
        raise RuntimeError(f"{failed} prefill rooms failed; the decode saw {value} failures for {len(aborted)} aborts")
    result: dict[str, Any] = {"prefill_rooms_per_s": rooms / seconds, "prefill_aborted": len(aborted)}
    for name, values in calls.items():
        result[f"prefill_{name}_p50_us"] = _pct(values, 0.5) * 1e6
        result[f"prefill_{name}_p99_us"] = _pct(values, 0.99) * 1e6
        result[f"prefill_{name}_max_us"] = max(values, default=0.0) * 1e6
    return result


def run_engine(rooms: int, window: int, step_ms: float, steps: int, blocks: int, transport: str,
               process: bool = False) -> dict[str, Any]:
    """An engine-shaped loop: a scheduler thread whose step is a model step of ``step_ms`` plus the
    facade calls of that step. Four phases of ``steps`` steps each (rooms moving runs as long as
    rooms move): no kvproto; the facade started and idle; rooms moving at ``window`` in flight; idle
    again (a drift check). The step's wall time distribution of each phase, their differences to
    the first, and the process CPU (what kvproto costs the engine's process)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return _run_engine(rooms, window, step_ms, steps, blocks, transport, process)
    finally:
        torch.set_num_threads(threads)  # the CPU model step ran on one thread


def _run_engine(rooms: int, window: int, step_ms: float, steps: int, blocks: int, transport: str,
                process: bool) -> dict[str, Any]:
    model, what = _model_step(step_ms)
    result: dict[str, Any] = {"engine_model_step": what, "engine_window": window}

    def phase(name: str, body: Any, count: int, until: Any = None) -> None:
        times: list[float] = []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while len(times) < count or (until is not None and not until()):
            t0 = time.perf_counter()
            body()
            model()
            times.append(time.perf_counter() - t0)
        result[f"engine_{name}_cpu_fraction"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        result[f"engine_{name}_steps"] = len(times)
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            result[f"engine_{name}_{label}_ms"] = _pct(times, q) * 1e3
        result[f"engine_{name}_max_ms"] = max(times) * 1e3

    warm_until = time.perf_counter() + 2.0
    while time.perf_counter() < warm_until:  # clocks and caches settle before anything is timed
        model()
    phase("bare", lambda: None, steps)
    conn, child, address = _spawn_prefill(transport, blocks)
    _src, kv = _cache(2, blocks)
    try:
        decode = _facade(process)(kv, config=_config(transport))
        try:
            phase("idle", lambda: decode.get_finished(), steps)
            conn.send((1, rooms, window))
            scheduler = _Scheduler(decode, address, rooms, window, blocks)
            began = time.perf_counter()
            child0 = decode.child_cpu_seconds() if process else 0.0
            phase("moving", scheduler.step, steps, until=lambda: scheduler.ended >= rooms)
            seconds = time.perf_counter() - began
            result["engine_rooms_per_s"] = rooms / seconds
            if process:
                result["engine_endpoint_process_cpu_fraction"] = (decode.child_cpu_seconds() - child0) / seconds
            assert conn.recv() == "done"
            phase("idle_after", lambda: decode.get_finished(), steps)  # drift check: idle again
            if scheduler.failed:
                raise RuntimeError(f"{scheduler.failed} rooms failed")
        finally:
            decode.close()
    finally:
        conn.send(None)
        child.join(timeout=10)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvproto bench sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=4000)
    ap.add_argument("--window", type=int, default=512, help="rooms in flight")
    ap.add_argument("--step-ms", type=float, default=1.0, help="the model step the scheduler sleeps")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--engine-rooms", type=int, default=10000, help="rooms the engine-shaped loop moves")
    ap.add_argument("--engine-step-ms", type=float, default=20.0, help="the engine loop's model step")
    ap.add_argument("--engine-steps", type=int, default=100, help="steps per phase of the engine loop (0: skip it)")
    ap.add_argument("--process", action="store_true",
                    help="the decode endpoint in a process of its own (kvproto.sync.ProcessDecode)")
    ap.add_argument("--prefill-rooms", type=int, default=4000,
                    help="rooms of the prefill-side run (sender, init, send, abort timed; 0: skip it)")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    r = run(args.rooms, args.window, args.step_ms, args.blocks, args.transport, args.process)
    r["facade"] = "ProcessDecode" if args.process else "SyncDecode"
    print(f"synchronous scheduler thread driving {r['facade']}, prefill in another process ({args.transport}), "
          f"{r['rooms']} 1-page rooms, {r['window']} in flight, {r['step_ms']} ms model step: "
          f"{r['rooms_per_s']:.0f} rooms/s over {r['steps']} steps")
    print(f"{'call':>14} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for name in ("receiver", "poll", "get_finished"):
        print(f"{name:>14} {r[name + '_p50_us']:>8.1f} {r[name + '_p99_us']:>8.1f} {r[name + '_max_us']:>8.1f}")
    print(f"step overhead (kvproto calls per step, beyond the model step; steps whose calls are not timed one by "
          f"one): p50 {r['step_overhead_p50_ms']:.3f} ms, p99 {r['step_overhead_p99_ms']:.3f} ms, "
          f"max {r['step_overhead_max_ms']:.3f} ms (the steps that time each call: p50 "
          f"{r['timed_step_overhead_p50_ms']:.3f} ms, p99 {r['timed_step_overhead_p99_ms']:.3f} ms)")
    print(f"idle facade (endpoint started, no rooms): {r['idle_cpu_fraction'] * 100:.1f}% of a core")
    if args.prefill_rooms:
        r.update(run_prefill(args.prefill_rooms, args.window, args.step_ms, args.blocks, args.transport, args.process))
        print(f"prefill side: synchronous scheduler thread driving "
              f"{'ProcessPrefill' if args.process else 'SyncPrefill'}, decode in another process, "
              f"{args.prefill_rooms} 1-page rooms ({r['prefill_aborted']} aborted), {args.window} in flight: "
              f"{r['prefill_rooms_per_s']:.0f} rooms/s")
        print(f"{'call':>14} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
        for name in ("sender", "init", "send", "abort", "poll", "get_finished"):
            print(f"{name:>14} {r[f'prefill_{name}_p50_us']:>8.1f} {r[f'prefill_{name}_p99_us']:>8.1f} "
                  f"{r[f'prefill_{name}_max_us']:>8.1f}")
    if args.engine_steps:
        r.update(run_engine(args.engine_rooms, args.window, args.engine_step_ms, args.engine_steps, args.blocks,
                            args.transport, args.process))
        print(f"engine-shaped loop: scheduler thread, model step = {r['engine_model_step']}; "
              f"rooms moving: {args.engine_rooms} at {args.window} in flight, {r['engine_rooms_per_s']:.0f} rooms/s")
        print(f"{'phase':>22} {'steps':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'+p50':>7} {'+p99':>7} {'CPU':>6}")
        for name, label in (("bare", "no kvproto"), ("idle", "facade idle"), ("moving", "rooms moving"),
                            ("idle_after", "facade idle again")):
            dp50 = r[f"engine_{name}_p50_ms"] - r["engine_bare_p50_ms"]
            dp99 = r[f"engine_{name}_p99_ms"] - r["engine_bare_p99_ms"]
            print(f"{label:>22} {r[f'engine_{name}_steps']:>6} {r[f'engine_{name}_p50_ms']:>8.2f} "
                  f"{r[f'engine_{name}_p99_ms']:>8.2f} {r[f'engine_{name}_max_ms']:>8.2f} {dp50:>+7.2f} {dp99:>+7.2f} "
                  f"{r[f'engine_{name}_cpu_fraction'] * 100:>5.0f}%")
        extra = r["engine_moving_cpu_fraction"] - r["engine_bare_cpu_fraction"]
        print(f"the engine process's CPU beyond the bare loop while rooms move: {extra * 100:.0f}% of a core"
              + (f"; the endpoint's own process: {r['engine_endpoint_process_cpu_fraction'] * 100:.0f}% of a core"
                 if args.process else " (kvproto's loop thread and facade calls)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sync", **r}, f, indent=1)
    return 0
