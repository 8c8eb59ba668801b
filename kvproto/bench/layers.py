"""``kvproto bench layers``: layer-wise streaming against sending a room after its last layer.

Theory of operation
-------------------
A synthetic prefill of ``--layers`` layers computes each layer for ``--compute-ms`` and then
has its KV ready. Two ways to send a room are timed in the same run, on the same endpoints:

* ``layer``: each layer is sent as its compute ends (``room.send(..., layers=range(l, l + 1),
  ready=event)``), so layer ``l`` moves while layer ``l + 1`` computes;
* ``room``: the whole room is sent once the last layer's compute has ended.

The figure is the **tail**: the time from the end of the last layer's compute to the decode
room's SUCCESS. Sent at once, the tail is the whole room's transfer; streamed, it should be one
layer's transfer (plus the protocol's own latency), as long as a layer computes for longer than
it takes to move (where the link is slower, no schedule beats the transfer left when the compute
ends: the room's transfer minus the compute it overlapped). On a GPU the compute is a chain of bf16
matrix products on the engine's own stream and readiness is a CUDA event recorded after it (the
end of compute is seen by polling that event); on the CPU the compute is a sleep of the engine
(an asynchronous one: the endpoints run in the same event loop) and the transport is the
simulated one with a bandwidth cap (``--bandwidth-gbps``), where the difference is large and
stable. A second table moves the same rooms back to back with no compute, per layer and at
once: the throughput of layer-wise sending against whole rooms. Every room's bytes are checked.

Prefill and decode endpoints run in this process (one event loop): the tail includes both
endpoints' protocol work on one thread. With two GPUs the decode's cache is on the second one
(``cuda:1``), so the bytes cross the GPUs' link. ``--processes`` runs them as a real pair does
instead: two processes, a batch of rooms per forward (``kvproto.bench.layers_pair``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


class Engine:
    """The prefill's engine: ``compute()`` queues one layer on its stream and returns the layer's
    event (a sleep and None on the CPU)."""

    def __init__(self, device: Any, compute_ms: float) -> None:
        import torch

        self.torch, self.device, self.compute_ms = torch, device, compute_ms
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.work = 0
        if self.stream is not None:
            self.mat = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            with torch.cuda.stream(self.stream):
                for _ in range(3):
                    self.mat @ self.mat
                began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                began.record(self.stream)
                for _ in range(10):
                    self.mat @ self.mat
                ended.record(self.stream)
            ended.synchronize()
            self.work = max(1, round(compute_ms / (began.elapsed_time(ended) / 10)))

    async def compute(self) -> Any:
        if self.stream is None:
            await asyncio.sleep(self.compute_ms / 1e3)
            return None
        torch = self.torch
        with torch.cuda.stream(self.stream):
            for _ in range(self.work):
                self.mat @ self.mat
            event = torch.cuda.Event()
            event.record(self.stream)
        await asyncio.sleep(0)
        return event


@dataclass
class Row:
    transport: str
    mode: str
    layers: int
    room_mib: float
    compute_ms: float
    rooms: int
    tail_p50_ms: float
    tail_p99_ms: float
    layer_transfer_ms: float
    room_transfer_ms: float
    bad_bytes: int
    throughput_gbps: float = 0.0
    """The same rooms back to back with no compute."""


class _Setup:
    def __init__(self, args: argparse.Namespace, devices: tuple[Any, Any], transport: str) -> None:
        import torch

        from kvproto.aio import KVCache

        device, self.dst_device = devices
        self.torch, self.args, self.device = torch, args, device
        self.transport = transport
        L, H, D, B = args.layers, args.heads, args.head_dim, args.block
        self.pages = -(-args.tokens // B)
        blocks = self.pages * 2 + 2
        gen = torch.Generator(device="cpu").manual_seed(1)
        shape = (blocks, B, H, D)
        self.src = [[torch.randint(-100, 100, shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(L)]
                    for _ in range(2)]
        self.dst = [[torch.zeros(shape, dtype=torch.bfloat16, device=self.dst_device) for _ in range(L)]
                    for _ in range(2)]
        self.kv_src = KVCache.from_tensors(self.src, tp_size=1, tp_rank=0, num_kv_heads=H)
        self.kv_dst = KVCache.from_tensors(self.dst, tp_size=1, tp_rank=0, num_kv_heads=H)
        self.room_bytes = 2 * L * args.tokens * H * D * 2
        self.engine = Engine(device, args.compute_ms)

    def config(self, role: str) -> Any:
        from kvproto.aio import EndpointConfig
        from kvproto.core import Timeouts

        options: dict[str, Any] = {}
        if self.transport == "simulated" and role == "prefill":
            options["bandwidth"] = self.args.bandwidth_gbps * 1e9
        t = 120.0
        return EndpointConfig(transport=self.transport, transport_options=options, staging_bytes=0,
                              instance="bench-layers", timeouts=Timeouts(bootstrap=t, waiting=t, transfer=t, parked=t))

    def check(self, src_pages: list[int], dst_pages: list[int]) -> int:
        torch = self.torch
        s, d = torch.tensor(src_pages, device=self.device), torch.tensor(dst_pages, device=self.dst_device)
        bad = 0
        for plane in range(2):
            for layer in range(self.args.layers):
                got = self.dst[plane][layer].index_select(0, d).to(self.device).view(torch.int16)
                want = self.src[plane][layer].index_select(0, s).view(torch.int16)
                bad += int((got != want).sum().item()) * 2
        return bad


async def _fired(event: Any) -> float:
    """When ``event`` has fired (polled: this never waits on the engine's stream)."""
    while event is not None and not event.query():
        await asyncio.sleep(0)
    return time.monotonic()


async def _room(setup: _Setup, prefill: Any, decode: Any, room_id: int, mode: str, compute: bool) -> tuple[float, int]:
    """One room; returns (tail seconds, bad bytes)."""
    args = setup.args
    pages = setup.pages
    src_pages = list(range(room_id % 2 * pages, room_id % 2 * pages + pages))
    dst_pages = list(range(pages + 2, 2 * pages + 2))[::-1]
    index = setup.torch.tensor(dst_pages, device=setup.dst_device)
    for plane in setup.dst:
        for t in plane:
            t.index_fill_(0, index, 0)  # a write that never lands shows as wrong bytes
    d = decode.open_room(room_id, prefill.bootstrap_address, pages=dst_pages, num_tokens=args.tokens)
    p = prefill.open_room(room_id)
    event = None
    for layer in range(args.layers):
        if compute:
            event = await setup.engine.compute()
        if mode == "layer":
            p.send(src_pages if layer == 0 else [], args.tokens, last=True, layers=range(layer, layer + 1),
                   ready=event)
    last = await _fired(event)
    if mode == "room":
        p.send(src_pages, args.tokens, last=True, ready=event)
    await asyncio.gather(d.wait(), p.wait())
    return time.monotonic() - last, setup.check(src_pages, dst_pages)


async def _run(args: argparse.Namespace, devices: tuple[Any, Any], transport: str) -> list[Row]:
    from kvproto.aio import DecodeEndpoint, PrefillEndpoint

    setup = _Setup(args, devices, transport)
    rows = []
    async with PrefillEndpoint(setup.kv_src, config=setup.config("prefill")) as prefill, \
            DecodeEndpoint(setup.kv_dst, config=setup.config("decode")) as decode:
        room_id = 1
        for mode in ("room", "layer"):
            for _ in range(2):  # warm-up: links, kernels, descriptor lists
                await _room(setup, prefill, decode, room_id, mode, compute=True)
                room_id += 1
        results: dict[str, list[tuple[float, int]]] = {"room": [], "layer": []}
        for _ in range(args.rooms):  # alternate, so that both modes see the same machine state
            for mode in ("room", "layer"):
                results[mode].append(await _room(setup, prefill, decode, room_id, mode, compute=True))
                room_id += 1
        room_transfer = statistics.median(t for t, _ in results["room"])
        for mode in ("room", "layer"):
            tails = sorted(t for t, _ in results[mode])
            rows.append(Row(transport=transport, mode=mode, layers=args.layers, room_mib=setup.room_bytes / 2**20,
                            compute_ms=args.compute_ms, rooms=args.rooms, tail_p50_ms=tails[len(tails) // 2] * 1e3,
                            tail_p99_ms=tails[min(len(tails) - 1, int(0.99 * len(tails)))] * 1e3,
                            layer_transfer_ms=room_transfer / args.layers * 1e3, room_transfer_ms=room_transfer * 1e3,
                            bad_bytes=sum(b for _, b in results[mode])))
        # throughput: the same rooms back to back, no compute, per layer and at once
        speed: dict[str, float] = {}
        for mode in ("room", "layer", "room", "layer"):
            began = time.monotonic()
            for _ in range(args.rooms):
                await _room(setup, prefill, decode, room_id, mode, compute=False)
                room_id += 1
            speed[mode] = max(speed.get(mode, 0.0), args.rooms * setup.room_bytes / (time.monotonic() - began))
        rows[0].throughput_gbps = speed["room"] / 1e9
        rows[1].throughput_gbps = speed["layer"] / 1e9
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="kvproto bench layers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", nargs="+", default=None,
                    help="adapters by name (default: nixl and cuda-ipc on a GPU, simulated on the CPU)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="the engine's compute per layer (default: 1 on a GPU; 6 on the CPU, above one layer's "
                         "transfer at 1 GB/s: a slower link than compute bounds the tail by the transfer left)")
    ap.add_argument("--rooms", type=int, default=10)
    ap.add_argument("--bandwidth-gbps", type=float, default=1.0, help="the simulated transport's link (GB/s)")
    ap.add_argument("--processes", action="store_true",
                    help="prefill and decode in two processes, a batch of rooms per forward "
                         "(kvproto.bench.layers_pair)")
    ap.add_argument("--batch", type=int, default=16, help="with --processes: rooms per forward")
    ap.add_argument("--batches", type=int, default=8, help="with --processes: timed batches per mode")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.processes:
        from kvproto.bench.layers_pair import main_pair

        if args.compute_ms is None:
            args.compute_ms = 1.0 if cuda else 20.0
        return main_pair(args)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    devices = (device, torch.device("cuda", 1) if cuda and torch.cuda.device_count() >= 2 else device)
    if args.compute_ms is None:
        args.compute_ms = 1.0 if cuda else 6.0
    transports = args.transports or (["nixl", "cuda-ipc"] if cuda else ["simulated"])
    where = (f"{torch.cuda.get_device_name(0)}, prefill cache on {devices[0]}, decode cache on {devices[1]}" if cuda
             else f"CPU, simulated link {args.bandwidth_gbps:g} GB/s")
    print(f"kvproto bench layers: {where}; {args.layers} layers x {args.heads} KV heads x {args.head_dim} bf16, "
          f"{args.tokens} tokens a room; compute {args.compute_ms:g} ms a layer; tail = end of the last layer's "
          f"compute -> decode SUCCESS; every room's bytes checked", flush=True)
    print(f"{'transport':>10} {'mode':>6} {'MiB':>7} {'tail p50':>9} {'tail p99':>9} {'room xfer':>10} "
          f"{'layer xfer':>10} {'GB/s':>7} {'bytes':>6}", flush=True)
    rows: list[Row] = []
    failed = False
    for transport in transports:
        try:
            got = asyncio.run(_run(args, devices, transport))
        except Exception as exc:  # noqa: BLE001 - one adapter's failure is reported, the others run
            print(f"{transport}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed = True
            continue
        for r in got:
            print(f"{r.transport:>10} {r.mode:>6} {r.room_mib:>7.1f} {r.tail_p50_ms:>9.2f} {r.tail_p99_ms:>9.2f} "
                  f"{r.room_transfer_ms:>10.2f} {r.layer_transfer_ms:>10.3f} {r.throughput_gbps:>7.2f} "
                  f"{'OK' if r.bad_bytes == 0 else r.bad_bytes:>6}", flush=True)
            failed |= r.bad_bytes != 0
        rows += got
        layer, room = got[1], got[0]
        print(f"{transport:>10}: layer-wise tail {layer.tail_p50_ms:.2f} ms = one layer's transfer "
              f"{layer.layer_transfer_ms:.2f} ms + {layer.tail_p50_ms - layer.layer_transfer_ms:.2f} ms (whole room "
              f"{room.tail_p50_ms:.2f} ms); throughput per layer / at once: "
              f"{layer.throughput_gbps / room.throughput_gbps:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "layers", "device": where, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if failed else 0
