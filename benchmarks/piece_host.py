"""Host time to enqueue one staged piece's gather (prefill) or scatter (decode) through ``Copies.run``,
as the endpoints do, and the GPU's time to run it with the stream kept busy (a sleep kernel queued
first, so the events time the copies, not the host's launches), one process: a one-group cache and
the bench's GDN-shaped hybrid with its state block (64 regions, random pages; 8 MiB pieces unless
TOKENS says otherwise), each twice, beside one contiguous device copy of a piece's bytes.

    usage: python benchmarks/piece_host.py [TOKENS] [prof]   (TOKENS per piece, 64 = 8 MiB by default;
                                                          prof: also a cProfile of each kind's gathers)
"""
from __future__ import annotations

import random
import sys
import time

import torch

from kvproto.aio import KVCache, StateCache
from kvproto.aio.staging import CacheKernels, Copies, StagingBuffer, pair_piece

dev = torch.device("cuda")
TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 64
PROF = "prof" in sys.argv[1:]
L, H, D, B, POOL = 32, 8, 128, 16, 4096
big = torch.randn((L * 2, POOL, B, H, D), dtype=torch.bfloat16, device=dev)
full = [l for l in range(L) if l % 4 == 3]
lin = [l for l in range(L) if l % 4 != 3]
def group(layers, **kw):
    return KVCache.from_tensors([[big[2 * l + p] for l in layers] for p in range(2)], tp_size=1, tp_rank=0,
                                num_kv_heads=H, model_layers=layers, **kw)
one = KVCache.from_tensors([[big[2 * l + p] for l in range(L)] for p in range(2)], tp_size=1, tp_rank=0, num_kv_heads=H)
state = torch.randn((len(lin), 1024, 16, 128), dtype=torch.bfloat16, device=dev)
sc = StateCache.from_tensors("state", [[state[i]] for i in range(len(lin))], shard_dims=[0], model_layers=lin)
hyb = group(full).with_groups(group(lin, name="lin"), sc)

def sleep_rate() -> float:
    """Cycles per second of ``torch.cuda._sleep``."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); torch.cuda._sleep(50_000_000); b.record(); torch.cuda.synchronize()
    return 50_000_000 / (a.elapsed_time(b) / 1e3)


rate = sleep_rate()
ref_src = torch.empty(TOKENS * 131072, dtype=torch.uint8, device=dev)
ref_dst = torch.empty_like(ref_src)
cases = (("one", one, False), ("hybrid + state block", hyb, True))
for name, kv, with_state in cases * 2:
    buf = StagingBuffer(kv, 1 << 30)
    kern = CacheKernels(kv)
    copies = Copies(dev, kern.uploads)  # as the endpoints run a piece's copy: its stream, its event
    g = kv.cache_geometry
    tokens = TOKENS
    for gather in (True, False):
        piece = pair_piece(kern, g, g, side="prefill" if gather else "decode", minor=3, buf=buf)
        for iters, backed in ((20, False), (300, False), (300, True)):
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(copies.stream):
                if backed:  # the stream busy while the host enqueues: the events time the GPU's work alone
                    torch.cuda._sleep(int(rate * iters * 400e-6))
                ev0.record(copies.stream)
            host = 0.0
            for i in range(iters):
                pages = random.sample(range(POOL), -(-TOKENS // B))

                def copy(stream, i=i, pages=pages):
                    piece.copy(buf, (i % 4) * (TOKENS * 131072 + (1 << 20)), 1000 + i, [pages] * (1 + len(kv.groups)), start=0,
                               end=tokens, slots={2: i % 1000} if with_state else None, keep=False, stream=stream,
                               gather=gather)

                h0 = time.perf_counter()
                copies.run(copy, lambda: None)
                host += time.perf_counter() - h0
            ev1.record(copies.stream)
            torch.cuda.synchronize()
            copies.poll()
        # the last run was backed: GPU time alone; host time from the same run
        print(f"{name:22s} {'gather ' if gather else 'scatter'} unit {piece.unit} tail {piece.tail}: "
              f"GPU {ev0.elapsed_time(ev1) * 1000 / iters:7.1f} us/piece (stream kept busy), "
              f"host {host * 1e6 / iters:6.1f} us/piece", flush=True)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(int(rate * 0.01)); a.record()
for _ in range(300):
    ref_dst.copy_(ref_src)
b.record(); torch.cuda.synchronize()
print(f"reference: one contiguous {TOKENS * 131072 >> 20} MiB device copy {a.elapsed_time(b) * 1000 / 300:7.1f} us")

if PROF:
    import cProfile
    import pstats

    for name, kv, with_state in (("one", one, False), ("hybrid + state block", hyb, True)):
        buf = StagingBuffer(kv, 1 << 30)
        kern = CacheKernels(kv)
        g = kv.cache_geometry
        piece = pair_piece(kern, g, g, side="prefill", minor=3, buf=buf)
        copies = Copies(dev, kern.uploads)

        def run(n):
            for i in range(n):
                pages = random.sample(range(POOL), -(-TOKENS // B))
                copies.run(lambda stream, i=i, pages=pages: piece.copy(
                    buf, (i % 4) * (TOKENS * 131072 + (1 << 20)), 5000 + i, [pages] * (1 + len(kv.groups)), start=0, end=TOKENS,
                    slots={2: i % 1000} if with_state else None, keep=False, stream=stream, gather=True), lambda: None)
            torch.cuda.synchronize()
            copies.poll()
        run(20)
        prof = cProfile.Profile()
        prof.enable(); run(300); prof.disable()
        print("=====", name)
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
