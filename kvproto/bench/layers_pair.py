"""``kvproto bench layers --processes``: layer-wise streaming between a prefill and a decode process.

Theory of operation
-------------------
A serving engine's forward computes a *batch* of requests layer by layer, and under layer-wise
streaming every room of the batch becomes ready for layer ``l`` at the same CUDA event. This bench
plays that with two processes, as a real pair runs: the prefill process owns its cache on the
first GPU (host memory without GPUs) and an engine stream; the decode process owns its cache on the
second GPU (the first with one GPU) and opens every room of a batch, with its destination pages,
before the prefill's forward starts (the decode was waiting for those requests, as in the
concurrent proxy flow). For each batch the prefill process runs ``--layers`` layers of
``--compute-ms`` (bf16 matrix products on its engine stream; a sleep on the CPU) and records one
event per layer, and then:

* ``layer``: sends every room's layer ``l`` with that layer's event, as the layer's compute is
  queued, so layer ``l`` moves while layer ``l + 1`` computes;
* ``room``: sends every room whole once the last layer's event has fired.

The figure is the **tail**: from the last layer's event firing (prefill process, seen by a thread
waiting on it; on the CPU, where there is no event, the end of the last layer's compute, before the
sends: a stamp taken by the event loop after a transport's posts that copy before they return would
hide those copies from the tail) to the last room of the batch reaching
SUCCESS (decode process), on one clock (``time.monotonic``: one host). The
first batch of each mode is reported on its own (a new link pays its kernels, descriptor lists and
registrations there), then the median and p99 over ``--batches`` batches. A second table moves the
same batches back to back with no compute, per layer and whole: throughput of layer-wise sending
against whole rooms. Every byte of every room is checked in the decode process against the
prefill's content, which both processes derive from one seed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvproto.aio import trace
from kvproto.bench.layers import Engine


@dataclass
class PairRow:
    transport: str
    mode: str
    batch: int
    layers: int
    room_mib: float
    compute_ms: float
    first_tail_ms: float
    tail_p50_ms: float
    tail_p99_ms: float
    layer_transfer_ms: float
    """The batch's transfer with no compute (whole rooms), divided by the layers: one layer's share."""
    throughput_gbps: float
    """The batch's bytes over its span, back to back with no compute."""
    bad_bytes: int


def _cache(args: argparse.Namespace, device: Any, seed: int | None) -> tuple[list[list[Any]], Any]:
    """Pages for ``args.batch`` rooms (and a spare room's worth), filled from ``seed`` (zeros: None)."""
    import torch

    from kvproto.aio import KVCache

    pages = -(-args.tokens // args.block)
    shape = ((args.batch + 1) * pages, args.block, args.heads, args.head_dim)
    planes = []
    for plane in range(2):
        layers = []
        for layer in range(args.layers):
            if seed is None:
                layers.append(torch.zeros(shape, dtype=torch.bfloat16, device=device))
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + plane * 1_009 + layer)
                layers.append(torch.randint(-100, 100, shape, generator=gen, dtype=torch.int16)
                              .view(torch.bfloat16).to(device))
        planes.append(layers)
    return planes, KVCache.from_tensors(planes, tp_size=1, tp_rank=0, num_kv_heads=args.heads)


def _config(args: argparse.Namespace, transport: str) -> Any:
    from kvproto.aio import EndpointConfig
    from kvproto.core import Timeouts

    t = 120.0
    return EndpointConfig(transport=transport, staging_bytes=0, instance="bench-layers-pair",
                          timeouts=Timeouts(bootstrap=t, waiting=t, transfer=t, parked=t))


def _fired_at(event: Any) -> float:
    """When ``event`` completed, seen from a thread of its own: the event loop may be inside a
    transport's post when it does (a post that copies before it returns), and a stamp taken there
    would start the tail late."""
    event.synchronize()
    return time.monotonic()


def _pages(args: argparse.Namespace, index: int, reverse: bool) -> list[int]:
    pages = -(-args.tokens // args.block)
    out = list(range(index * pages, (index + 1) * pages))
    return out[::-1] if reverse else out  # the decode's pages in another order: no page-to-page shortcut


async def _prefill(args: argparse.Namespace, device: Any, transport: str, conn: Any) -> None:
    from kvproto.aio import PrefillEndpoint

    _planes, kv = _cache(args, device, seed=7)
    engine = Engine(device, args.compute_ms)
    async with PrefillEndpoint(kv, config=_config(args, transport)) as prefill:
        conn.send(prefill.bootstrap_address)
        while (msg := await asyncio.to_thread(conn.recv)) is not None:
            first_room, mode, compute = msg
            rooms = [prefill.open_room(first_room + i) for i in range(args.batch)]
            event, ready = None, 0.0
            for layer in range(args.layers):
                event = await engine.compute() if compute else None
                ready = time.monotonic()  # the layer's KV exists now (on the CPU: the compute was a sleep)
                if mode == "layer":
                    for i, room in enumerate(rooms):
                        room.send(_pages(args, i, False) if layer == 0 else [], args.tokens, last=True,
                                  layers=range(layer, layer + 1), ready=event)
            # the tail starts when the last layer is ready: its event's firing, or (no event: the CPU)
            # the end of its compute, before the sends, whose posts may do the copying on the CPU
            last = await asyncio.to_thread(_fired_at, event) if event is not None else ready
            trace.mark("fired", first_room, int((time.monotonic() - last) * 1e6))  # KVPROTO_TRACE: the tail's start
            if mode == "room":
                for i, room in enumerate(rooms):
                    room.send(_pages(args, i, False), args.tokens, last=True, ready=event)
            await asyncio.gather(*(room.wait() for room in rooms))
            conn.send(last)


async def _decode(args: argparse.Namespace, device: Any, transport: str, conn: Any) -> None:
    import torch

    from kvproto.aio import DecodeEndpoint

    planes, kv = _cache(args, device, seed=None)
    source, _ = _cache(args, torch.device("cpu"), seed=7)  # the prefill's content, for the check
    bootstrap = conn.recv()
    async with DecodeEndpoint(kv, config=_config(args, transport)) as decode:
        while (msg := await asyncio.to_thread(conn.recv)) is not None:
            first_room, check = msg
            for plane in planes:
                for t in plane:
                    t.zero_()
            rooms = [decode.open_room(first_room + i, bootstrap, pages=_pages(args, i, True), num_tokens=args.tokens)
                     for i in range(args.batch)]
            conn.send("open")
            ends = []
            for room in rooms:
                await room.wait()
                ends.append(time.monotonic())
            bad = 0
            if check:
                for i in range(args.batch):
                    src = torch.tensor(_pages(args, i, False))
                    dst = torch.tensor(_pages(args, i, True), device=device)
                    for plane, want_plane in zip(planes, source):
                        for got, want in zip(plane, want_plane):
                            bad += int((got.index_select(0, dst).cpu().view(torch.int16)
                                        != want.index_select(0, src).view(torch.int16)).sum()) * 2
            conn.send((max(ends), bad))


def _child(role: str, args: argparse.Namespace, device: str, transport: str, conn: Any) -> None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    asyncio.run((_prefill if role == "prefill" else _decode)(args, dev, transport, conn))


def run_pair(args: argparse.Namespace, devices: tuple[str, str], transport: str) -> list[PairRow]:
    """Both modes for one adapter (module docstring)."""
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    procs = [ctx.Process(target=_child, args=(role, args, device, transport, conn), daemon=True)
             for role, device, conn in (("prefill", devices[0], p_child), ("decode", devices[1], d_child))]
    for proc in procs:
        proc.start()
    room_bytes = 2 * args.layers * args.tokens * args.heads * args.head_dim * 2
    room = 1

    def batch(mode: str, compute: bool, check: bool) -> tuple[float, int, float, float]:
        """(tail, bad bytes, prefill's start, decode's last end) of one batch."""
        nonlocal room
        d_conn.send((room, check))
        assert d_conn.recv() == "open"
        began = time.monotonic()
        p_conn.send((room, mode, compute))
        last = p_conn.recv()
        ended, bad = d_conn.recv()
        room += args.batch
        return ended - last, bad, began, ended

    try:
        d_conn.send(p_conn.recv())  # the prefill's bootstrap address
        rows = []
        tails: dict[str, list[float]] = {"room": [], "layer": []}
        first: dict[str, float] = {}
        bad = 0
        for i in range(args.batches + 1):
            for mode in ("room", "layer"):
                tail, wrong, _, _ = batch(mode, True, check=True)
                bad += wrong
                if i == 0:
                    first[mode] = tail
                else:
                    tails[mode].append(tail)
        speed: dict[str, float] = {}
        for mode in ("room", "layer", "room", "layer"):
            spans = []
            for _ in range(max(2, args.batches // 2)):
                _, wrong, began, ended = batch(mode, False, check=False)
                spans.append(ended - began)
            speed[mode] = max(speed.get(mode, 0.0), args.batch * room_bytes / statistics.median(spans))
        for mode in ("room", "layer"):
            t = sorted(tails[mode])
            rows.append(PairRow(transport=transport, mode=mode, batch=args.batch, layers=args.layers,
                                room_mib=room_bytes / 2**20, compute_ms=args.compute_ms,
                                first_tail_ms=first[mode] * 1e3, tail_p50_ms=t[len(t) // 2] * 1e3,
                                tail_p99_ms=t[min(len(t) - 1, int(0.99 * len(t)))] * 1e3,
                                layer_transfer_ms=args.batch * room_bytes / speed["room"] / args.layers * 1e3,
                                throughput_gbps=speed[mode] / 1e9, bad_bytes=bad))
        return rows
    finally:
        for conn in (p_conn, d_conn):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def main_pair(args: argparse.Namespace) -> int:
    import json
    import sys

    import torch

    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    devices = ("cuda:0", "cuda:1" if gpus >= 2 else "cuda:0") if gpus else ("cpu", "cpu")
    transports = args.transports or (["nixl", "cuda-ipc"] if gpus else ["nixl"])
    where = (f"{torch.cuda.get_device_name(0)}, prefill process on {devices[0]}, decode process on {devices[1]}"
             if gpus else "CPU, two processes, host memory")
    room_mib = 2 * args.layers * args.tokens * args.heads * args.head_dim * 2 / 2**20
    print(f"kvproto bench layers --processes: {where}; a batch of {args.batch} rooms of {args.tokens} tokens "
          f"({room_mib:.1f} MiB each), {args.layers} layers x {args.heads} KV heads x {args.head_dim} bf16, compute "
          f"{args.compute_ms:g} ms a layer; tail = last layer's event fired (prefill) -> last room SUCCESS (decode); "
          f"every byte checked", flush=True)
    print(f"{'transport':>10} {'mode':>6} {'first tail':>10} {'tail p50':>9} {'tail p99':>9} {'layer xfer':>10} "
          f"{'GB/s':>7} {'bytes':>6}", flush=True)
    rows: list[PairRow] = []
    failed = False
    for transport in transports:
        try:
            got = run_pair(args, devices, transport)
        except Exception as exc:  # noqa: BLE001 - one adapter's failure is reported, the others run
            print(f"{transport}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed = True
            continue
        for r in got:
            print(f"{r.transport:>10} {r.mode:>6} {r.first_tail_ms:>10.2f} {r.tail_p50_ms:>9.2f} {r.tail_p99_ms:>9.2f} "
                  f"{r.layer_transfer_ms:>10.3f} {r.throughput_gbps:>7.2f} {'OK' if r.bad_bytes == 0 else r.bad_bytes:>6}",
                  flush=True)
            failed |= r.bad_bytes != 0
        room, layer = got
        print(f"{transport:>10}: layer-wise tail {layer.tail_p50_ms:.2f} ms = one layer's transfer "
              f"{layer.layer_transfer_ms:.2f} ms + {layer.tail_p50_ms - layer.layer_transfer_ms:.2f} ms (whole rooms "
              f"{room.tail_p50_ms:.2f} ms); throughput per layer / whole: "
              f"{layer.throughput_gbps / room.throughput_gbps:.2f}; first batch's tail {layer.first_tail_ms:.2f} ms",
              flush=True)
        rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "layers-pair", "device": where, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if failed else 0
