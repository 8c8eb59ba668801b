"""Host and GPU time to enqueue one staged piece's gather on an idle GPU, one process: a one-group
cache, the bench's GDN-shaped hybrid without its state block, and with it (8 MiB pieces, 64 regions,
random pages). On one H100 the GPU time per piece equals the host time: the copy is launch-bound.

    usage: python benchmarks/piece_host.py [prof]   (prof: also a cProfile of each kind)
"""
from __future__ import annotations

import random
import sys
import time

import torch

from kvproto.aio import KVCache, StateCache
from kvproto.aio.staging import CacheKernels, StagingBuffer, pair_piece

dev = torch.device("cuda")
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
stream = torch.cuda.Stream()
for name, kv, minor, with_state in (("one", one, 3, False), ("hybrid, no state", hyb, 3, False),
                                    ("hybrid + state block", hyb, 3, True), ("one", one, 3, False)):
    buf = StagingBuffer(kv, 1 << 30)
    kern = CacheKernels(kv)
    g = kv.cache_geometry
    piece = pair_piece(kern, g, g, side="prefill", minor=minor, buf=buf)
    tokens = 64
    for iters in (20, 300):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            ev0.record(stream)
            host = 0.0
            for i in range(iters):
                pages = random.sample(range(POOL), 4)
                h0 = time.perf_counter()
                piece.copy(buf, (i % 64) * (16 << 20), 1000 + i, [pages] * (1 + len(kv.groups)), start=0, end=tokens,
                           slots={1: i % 1000, 2: i % 1000, 3: i % 1000} if with_state else None,
                           keep=False, stream=stream, gather=True)
                host += time.perf_counter() - h0
            ev1.record(stream)
        torch.cuda.synchronize()
    print(f"{name:24s} unit {piece.unit} tail {piece.tail}: GPU {ev0.elapsed_time(ev1) * 1000 / iters:7.1f} us/piece, host {host * 1e6 / iters:6.1f} us/piece")

if len(sys.argv) > 1:
    import cProfile
    import pstats

    for name, kv, with_state in (("one", one, False), ("hybrid + state block", hyb, True)):
        buf = StagingBuffer(kv, 1 << 30)
        kern = CacheKernels(kv)
        g = kv.cache_geometry
        piece = pair_piece(kern, g, g, side="prefill", minor=3, buf=buf)
        def run(n):
            with torch.cuda.stream(stream):
                for i in range(n):
                    pages = random.sample(range(POOL), 4)
                    piece.copy(buf, (i % 64) * (16 << 20), 5000 + i, [pages] * (1 + len(kv.groups)), start=0, end=64,
                               slots={2: i % 1000} if with_state else None, keep=False, stream=stream, gather=True)
            torch.cuda.synchronize()
        run(20)
        prof = cProfile.Profile()
        prof.enable(); run(300); prof.disable()
        print("=====", name)
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
