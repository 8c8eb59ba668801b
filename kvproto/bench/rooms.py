"""``kvproto bench rooms``: what one room costs the control plane, and what it costs a serving loop.

Theory of operation
-------------------
Rooms of one page (the smallest a serving engine sends) make the protocol, not the bytes, the
cost: a TRANSFER_REQUEST, one write and its tag, a TRANSFER_DONE, and the bookkeeping of both
cores and both endpoints. The decode endpoint runs in this process on the event loop that also
runs a 1 ms *ticker*: a task that sleeps 1 ms and records how late it woke. That lateness is
what every other coroutine of a serving loop hosting the endpoint would suffer (the loop lag).

The prefill endpoint runs in a second process for NIXL (``spawn``ed, its own loop: the peer is
another process, as in a deployment) and in this process for ``loopback`` (which cannot cross
processes). The prefill opens every room and gives its page at once, keeping at most
``window + 64`` rooms live; the decode opens rooms keeping ``window`` in flight and measures each
room from ``open_room`` to the return of ``wait()``. Each case reports rooms/s over the whole
wall-clock span, per-room latency p50/p99, and the ticker's lag p50/p99/max while the rooms
moved. Every room's page is checked against the source once all rooms ended.

It is a benchmark: the exit status is non-zero only when a room fails or a byte differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from typing import Any

BLOCK = 16
LAYERS = 4
HEADS = 8
HEAD_DIM = 64


@dataclass(frozen=True)
class Case:
    transport: str
    window: int
    rooms: int


@dataclass
class Result:
    transport: str
    window: int
    rooms: int
    seconds: float
    rooms_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    peer: str


def _cache(seed: int, blocks: int) -> Any:
    import torch

    from kvproto.aio import KVCache

    gen = torch.Generator().manual_seed(seed)
    planes = [[torch.randint(0, 256, (blocks, BLOCK, HEADS, HEAD_DIM), dtype=torch.uint8, generator=gen)
               for _ in range(LAYERS)] for _ in range(2)]
    return planes, KVCache.from_tensors(planes, tp_size=1, tp_rank=0, num_kv_heads=HEADS)


def _config(transport: str) -> Any:
    from kvproto.aio import EndpointConfig
    from kvproto.core import Timeouts

    return EndpointConfig(transport=transport, instance="bench-rooms-decode",
                          timeouts=Timeouts(bootstrap=60, waiting=60, transfer=60, parked=60))


def _page(room_id: int, blocks: int) -> int:
    return room_id % blocks


async def _prefill_rooms(prefill: Any, first: int, rooms: int, window: int, blocks: int) -> None:
    """Open every room and give its page at once, keeping at most ``window + 64`` live."""
    live: set[Any] = set()
    room_done = asyncio.Event()

    def finished(task: Any) -> None:
        live.discard(task)
        room_done.set()

    for room_id in range(first, first + rooms):
        while len(live) >= window + 64:
            room_done.clear()
            await room_done.wait()
        room = prefill.open_room(room_id)
        room.send([_page(room_id, blocks)], BLOCK, last=True)
        task = asyncio.ensure_future(room.wait())
        live.add(task)
        task.add_done_callback(finished)
        await asyncio.sleep(0)
    while live:
        room_done.clear()
        await room_done.wait()


def _prefill_child(transport: str, blocks: int, conn: Any) -> None:
    """The prefill process: serve rooms as the parent asks, (first, rooms, window) at a time."""

    async def serve() -> None:
        from kvproto.aio import PrefillEndpoint

        _planes, kv = _cache(1, blocks)
        async with PrefillEndpoint(kv, config=_config(transport)) as prefill:
            conn.send(prefill.address)
            loop = asyncio.get_running_loop()
            while True:
                job = await loop.run_in_executor(None, conn.recv)
                if job is None:
                    break
                await _prefill_rooms(prefill, *job, blocks=blocks)
                conn.send("done")

    asyncio.run(serve())


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(0.001)
        lags.append(loop.time() - t0 - 0.001)


async def _decode_rooms(decode: Any, address: str, first: int, rooms: int, window: int,
                        blocks: int, failures: list[str] | None = None) -> list[float]:
    """Open rooms keeping ``window`` in flight; each room's seconds from open to ``wait()``. A room
    that fails fails the run, unless ``failures`` is given: its reason is appended there."""
    from kvproto.aio import TransferFailed

    latencies: list[float] = []
    sem = asyncio.Semaphore(window)
    expected = failures is not None
    failures = [] if failures is None else failures

    async def one(room_id: int) -> None:
        try:
            t0 = time.perf_counter()
            room = decode.open_room(room_id, address, pages=[_page(room_id, blocks)], num_tokens=BLOCK)
            await room.wait()
            latencies.append(time.perf_counter() - t0)
        except TransferFailed as exc:
            failures.append(str(exc))
        finally:
            sem.release()

    tasks = []
    for room_id in range(first, first + rooms):
        await sem.acquire()
        tasks.append(asyncio.ensure_future(one(room_id)))
        await asyncio.sleep(0)  # as a serving loop would: one request at a time, not 512 in one breath
    await asyncio.gather(*tasks)
    if failures and not expected:
        raise RuntimeError(f"{len(failures)} rooms failed, the first: {failures[0]}")
    return latencies


def _check(src: Any, dst: Any, first: int, rooms: int, blocks: int, skip: frozenset[int] = frozenset()) -> None:
    """The pages of the last ``blocks`` rooms (those no later room overwrote), but ``skip``."""
    import torch

    for room_id in range(max(first, first + rooms - blocks), first + rooms):
        if room_id in skip:
            continue
        page = _page(room_id, blocks)
        for plane in range(2):
            for layer in range(LAYERS):
                if not torch.equal(src[plane][layer][page], dst[plane][layer][page]):
                    raise AssertionError(f"room {room_id}: page {page} differs from the source")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _run(cases: list[Case], blocks: int) -> list[Result]:
    from kvproto.aio import DecodeEndpoint, PrefillEndpoint

    results = []
    for transport in dict.fromkeys(c.transport for c in cases):
        src, src_kv = _cache(1, blocks)
        dst, dst_kv = _cache(2, blocks)
        child = conn = prefill = None
        if transport == "loopback":
            prefill = PrefillEndpoint(src_kv, config=_config(transport))
            await prefill.start()
            address = prefill.address
        else:
            ctx = mp.get_context("spawn")
            conn, child_conn = ctx.Pipe()
            child = ctx.Process(target=_prefill_child, args=(transport, blocks, child_conn), daemon=True)
            child.start()
            address = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        loop = asyncio.get_running_loop()
        try:
            async with DecodeEndpoint(dst_kv, config=_config(transport)) as decode:
                first = 1
                await _one_case(decode, prefill, conn, address, first, 8, 1, blocks)  # bootstrap, warm up
                first += 8
                for case in [c for c in cases if c.transport == transport]:
                    lags: list[float] = []
                    stop = asyncio.Event()
                    ticker = asyncio.ensure_future(_ticker(lags, stop))
                    t0 = loop.time()
                    latencies = await _one_case(decode, prefill, conn, address, first, case.rooms, case.window,
                                                blocks)
                    seconds = loop.time() - t0
                    stop.set()
                    await ticker
                    _check(src, dst, first, case.rooms, blocks)  # the child's cache has the same seed
                    first += case.rooms
                    results.append(Result(
                        transport=transport, window=case.window, rooms=case.rooms, seconds=seconds,
                        rooms_per_s=case.rooms / seconds, latency_p50_ms=_pct(latencies, 0.5) * 1e3,
                        latency_p99_ms=_pct(latencies, 0.99) * 1e3, lag_p50_ms=_pct(lags, 0.5) * 1e3,
                        lag_p99_ms=_pct(lags, 0.99) * 1e3, lag_max_ms=max(lags, default=0.0) * 1e3,
                        peer="same process" if prefill is not None else "other process"))
                    _print(results[-1])
        finally:
            if prefill is not None:
                await prefill.close()
            if conn is not None:
                conn.send(None)
                child.join(timeout=10)  # type: ignore[union-attr]
    return results


async def _one_case(decode: Any, prefill: Any, conn: Any, address: str, first: int, rooms: int, window: int,
                    blocks: int) -> list[float]:
    if prefill is not None:
        feeding = asyncio.ensure_future(_prefill_rooms(prefill, first, rooms, window, blocks))
        latencies = await _decode_rooms(decode, address, first, rooms, window, blocks)
        await feeding
        return latencies
    conn.send((first, rooms, window))
    latencies = await _decode_rooms(decode, address, first, rooms, window, blocks)
    done = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    assert done == "done"
    return latencies


HEADER = (f"{'transport':>9} {'in flight':>9} {'rooms':>6} {'rooms/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'lag p50':>8} {'lag p99':>8} {'lag max':>8}  peer")


def _print(r: Result) -> None:
    print(f"{r.transport:>9} {r.window:>9} {r.rooms:>6} {r.rooms_per_s:>8.0f} {r.latency_p50_ms:>7.2f} "
          f"{r.latency_p99_ms:>7.2f} {r.lag_p50_ms:>8.2f} {r.lag_p99_ms:>8.2f} {r.lag_max_ms:>8.2f}  {r.peer}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvproto bench rooms", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", nargs="+", default=["loopback", "nixl"])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 64, 512], help="rooms in flight")
    ap.add_argument("--rooms", type=int, default=2000, help="rooms per case")
    ap.add_argument("--blocks", type=int, default=1024, help="pages per cache")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    print(f"1-page rooms ({BLOCK} tokens x {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM} bytes x K,V = "
          f"{BLOCK * LAYERS * HEADS * HEAD_DIM * 2 // 1024} KiB); latency = open_room to wait(); lag = how late "
          f"a 1 ms ticker on the decode's event loop woke")
    print(HEADER)
    cases = [Case(t, w, args.rooms) for t in args.transports for w in args.windows]
    results = asyncio.run(_run(cases, args.blocks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "rooms", "results": [asdict(r) for r in results]}, f, indent=1)
    return 0
