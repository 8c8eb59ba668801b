"""``kvproto bench paths``: one room's KV moved sliced vs staged, against one raw bulk write.

Theory of operation
-------------------
A prefill rank and a decode rank run in this process on one transport (NIXL by default),
with a geometry whose pages are not byte-identical (each of ``ratio`` decode ranks holds a slice of the heads),
so bytes move either sliced (one descriptor per token run and head slice, per region) or staged
(gather, one bulk WRITE per piece, scatter). The reference, measured in the same run, is a raw
transport WRITE of the same number of bytes as one descriptor between two registered buffers:
the ceiling for moving those bytes once. Each path reports its time per room, its bandwidth,
the ratio to the reference and the descriptors it posted per room, side by side. Rooms are
verified against the source once per path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvproto.aio import DecodeEndpoint, EndpointConfig, KVCache, PrefillEndpoint
from kvproto.core import Timeouts
from kvproto.geometry import Layout
from kvproto.transport import MemKind, MemoryRegion, XferState, load_transport


@dataclass
class Setup:
    layers: int
    heads: int
    head_dim: int
    block: int
    tokens: int
    ratio: int
    device: str
    transport: str
    repeat: int
    host_staging: bool


def _caches(s: Setup, seed: int) -> tuple[KVCache, list[KVCache], list[torch.Tensor], list[list[torch.Tensor]]]:
    """One prefill rank holding every head; ``ratio`` decode ranks holding a slice each."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 2 * (s.tokens // s.block + 1)

    def make(heads: int) -> list[torch.Tensor]:
        return [torch.randint(-100, 100, (blocks, s.block, heads, s.head_dim), generator=gen)
                .to(torch.bfloat16).to(s.device) for _ in range(2 * s.layers)]

    src = make(s.heads)
    kv_src = KVCache.from_tensors([src[0::2], src[1::2]], tp_size=1, tp_rank=0, num_kv_heads=s.heads, layout=Layout.NHD)
    dsts = [make(s.heads // s.ratio) for _ in range(s.ratio)]
    kv_dsts = [KVCache.from_tensors([d[0::2], d[1::2]], tp_size=s.ratio, tp_rank=r, num_kv_heads=s.heads,
                                    layout=Layout.NHD) for r, d in enumerate(dsts)]
    return kv_src, kv_dsts, src, dsts


def _raw_write_seconds(s: Setup, nbytes: int) -> float:
    """Median time of one transport WRITE of ``nbytes`` as a single descriptor (with its tag)."""
    a, b = load_transport(s.transport, "bench-raw-a"), load_transport(s.transport, "bench-raw-b")
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=s.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=s.device)
        kind = MemKind.VRAM if s.device != "cpu" else MemKind.DRAM
        dev = src.device.index or 0 if s.device != "cpu" else 0
        a.register([MemoryRegion(src.data_ptr(), nbytes, dev, kind)])
        b.register([MemoryRegion(dst.data_ptr(), nbytes, dev, kind)])
        peer = a.add_peer(b.metadata())
        rows_a = np.array([[src.data_ptr(), nbytes, dev]], dtype=np.int64)
        rows_b = np.array([[dst.data_ptr(), nbytes, dev]], dtype=np.int64)
        times = []
        for i in range(s.repeat + 1):
            t0 = time.perf_counter()
            x = a.post_descs(peer, rows_a, kind, rows_b, kind, b"raw%d" % i)
            got = False
            while not got:
                state = a.poll(x)
                if state is XferState.ERROR:
                    raise RuntimeError("raw write failed")
                got = state is XferState.DONE and bool(b.drain_notifications()) or got
                if state is not XferState.DONE:
                    b.drain_notifications()
            a.release(x)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        a.close()
        b.close()


async def _path_run(s: Setup, path: str) -> tuple[float, int, int, str]:
    """(median seconds per room, bytes per room, descriptors per room, path name)."""
    kv_src, kv_dsts, src, dsts = _caches(s, seed=1)
    cfg = dict(transport=s.transport, path=path, host_staging=s.host_staging, idle_poll_s=0.0002,
               staging_bytes=max(64 << 20, 4 * s.tokens * s.layers * 2 * (s.heads // s.ratio) * s.head_dim * 2),
               timeouts=Timeouts(bootstrap=60, waiting=60, transfer=60))
    pages = list(range(s.tokens // s.block + 1))[::-1]  # reversed: no two pages contiguous in order
    n_pages = -(-s.tokens // s.block)
    times, descs, nbytes, names = [], 0, 0, set()
    decodes = [DecodeEndpoint(kv, config=EndpointConfig(instance="bench-decode", **cfg)) for kv in kv_dsts]
    async with PrefillEndpoint(kv_src, config=EndpointConfig(**cfg)) as prefill:
        for decode in decodes:
            await decode.start()
        for i in range(s.repeat + 1):
            room_id = 100 + i
            t0 = time.perf_counter()
            rooms = [d.open_room(room_id, prefill.address, pages=pages[:n_pages], num_tokens=s.tokens) for d in decodes]
            p = prefill.open_room(room_id)
            p.send(pages[:n_pages], s.tokens)
            await asyncio.gather(p.wait(), *(r.wait() for r in rooms))
            if s.device != "cpu":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
                descs, nbytes, names = p.stats.descriptors, p.stats.nbytes, p.stats.paths
        for decode in decodes:
            await decode.close()
        hs = s.heads // s.ratio
        for rank, dst in enumerate(dsts):
            for r in range(len(src)):
                want = src[r][pages[:n_pages]].reshape(-1, s.heads, s.head_dim)[: s.tokens, rank * hs:(rank + 1) * hs]
                got = dst[r][pages[:n_pages]].reshape(-1, hs, s.head_dim)[: s.tokens]
                if not torch.equal(want, got):
                    raise AssertionError(f"{path}: decode rank {rank} region {r} differs from the source")
    return statistics.median(times), nbytes, descs, "+".join(sorted(names))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvproto bench paths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--ratio", type=int, default=2, help="decode TP / prefill TP (decode holds heads/ratio)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--host-staging", action="store_true", help="stage CUDA caches through pinned host memory")
    ap.add_argument("--paths", nargs="+", default=["sliced", "staged"], choices=["sliced", "staged"])
    args = ap.parse_args(argv)
    dev_name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"device: {dev_name}; transport {args.transport}; bf16, {args.layers} layers, {args.heads} KV heads x "
          f"{args.head_dim}, {args.block}-token pages, prefill TP 1 -> decode TP {args.ratio}; ratio = raw "
          f"single-descriptor WRITE of the same bytes (measured now) / path time")
    print(f"{'tokens':>7} {'MiB':>7} {'raw GB/s':>9} {'path':>12} {'ms/room':>9} {'GB/s':>7} {'vs raw':>7} {'descriptors':>12}")
    for tokens in args.tokens:
        s = Setup(args.layers, args.heads, args.head_dim, args.block, tokens, args.ratio, args.device,
                  args.transport, args.repeat, args.host_staging)
        rows = [asyncio.run(_path_run(s, path)) for path in args.paths]
        nbytes = rows[0][1]
        raw = _raw_write_seconds(s, nbytes)
        for seconds, moved, descs, name in rows:
            assert moved == nbytes
            print(f"{tokens:>7} {nbytes / 2**20:>7.1f} {nbytes / raw / 1e9:>9.2f} {name:>12} {seconds * 1e3:>9.2f} "
                  f"{nbytes / seconds / 1e9:>7.2f} {raw / seconds:>7.2f} {descs:>12}")
    return 0
