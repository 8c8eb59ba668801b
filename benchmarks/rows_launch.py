"""Host time to launch the kernel path's rows kernel once (``copy_paged``: one write of a prepared
link), three ways, on one plan (a 128 MiB room's arguments: 64 regions, 64-page lists, TP 1 -> 1,
16-token pages; one-group, and the bench's hybrid with its state slot fused in), interleaved,
warm, one process. Each launch copies one page per region (2 MiB), so that the GPU keeps up and
the host's launches are what is timed:

- ``jit``: Triton's own launch, ``kernel[grid](*args, **constants)`` (the reference);
- ``keyed``: ``kvproto.kernels.launcher._launch``, which finds the compiled kernel by a key built per launch;
- ``bound``: ``copy_paged`` as the transport calls it (``PagedLaunch``: bound once per plan and
  tables, a write gives its two page lists and slots).

The GPU is synchronised between batches only. Prints the median
microseconds per launch of each way and its ratio to ``jit``.

    usage: python benchmarks/rows_launch.py [LAUNCHES]   (per batch, 2000 by default; 10 batches each)
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from kvproto.geometry import KVGeometry, Layout, plan_pair
from kvproto.geometry.model import DType
from kvproto.kernels import pattern as P
from kvproto.kernels import paged as TK
from kvproto.kernels.pattern import plan_strided_rows
from kvproto.kernels.uploads import Pointer

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
dev = torch.device("cuda")
geometry = KVGeometry(tp_size=1, tp_rank=0, num_layers=1, num_kv_heads=8, head_dim=128, dtype=DType.BFLOAT16,
                      block_size=16, layout=Layout.NHD, mla=False, num_blocks=256)
pair = plan_pair(geometry, geometry)
REGIONS, PAGES = 64, 64
src = [torch.empty(256 * pair.src.page_bytes, dtype=torch.uint8, device=dev) for _ in range(REGIONS)]
dst = [torch.empty(256 * pair.dst.page_bytes, dtype=torch.uint8, device=dev) for _ in range(REGIONS)]
bases = torch.tensor([t.data_ptr() for t in src + dst], dtype=torch.int64, device=dev)
src_table, dst_table = bases[:REGIONS], bases[REGIONS:]
rows = P.plan_rows(pair, 0, 16, regions=REGIONS, base_align=16)  # one page of each region: the host is timed
lists = torch.zeros(2 * PAGES + 2, dtype=torch.int64, device=dev)
lists[:PAGES] = torch.randperm(256, device=dev)[:PAGES]
lists[PAGES:2 * PAGES] = torch.randperm(256, device=dev)[:PAGES]
src_pages, dst_pages = Pointer(lists.data_ptr()), Pointer(lists.data_ptr() + 8 * PAGES)

state = torch.empty((24, 64, 4096), dtype=torch.uint8, device=dev)  # 24 layers x 64 slots of 4 KiB
state_dst = torch.empty_like(state)
zero = torch.zeros(1, dtype=torch.int64, device=dev)
strided = plan_strided_rows([state[i, 0].data_ptr() for i in range(24)], [4096] * 24,
                            [state_dst[i, 0].data_ptr() for i in range(24)], [4096] * 24, [4096] * 24)
slot = TK.SlotTiles(strided.plan, torch.from_numpy(strided.stepped()).to(dev), len(strided.plan.tiles), zero)


def ways(slots: TK.SlotTiles | None) -> dict[str, object]:
    bound = TK.PagedLaunch.of(rows, src_table, dst_table, None, slots)
    head, mid = bound.args
    args = (*head, src_pages, dst_pages, src_pages, *mid, 3, 5)
    grid, constants, kernel = bound.grid, bound.constants, bound.kernel
    return {
        "jit": lambda: kernel[grid](*args, **constants),
        "keyed": lambda: TK._launch(kernel, grid, args, constants),
        "bound": lambda: TK.copy_paged(rows, src_table, dst_table, src_pages, dst_pages, None, slots, 3, 5),
    }


for name, slots in (("one group", None), ("hybrid (state slot fused)", slot)):
    launches = ways(slots)
    for f in launches.values():
        f()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in launches}
    for batch in range(10):
        order = list(launches.items())
        for k, f in order if batch % 2 else order[::-1]:
            t = time.perf_counter_ns()
            for _ in range(N):
                f()
            times[k].append((time.perf_counter_ns() - t) / N / 1e3)
            torch.cuda.synchronize()
    ref = statistics.median(times["jit"])
    print(f"{name}: {torch.cuda.get_device_name()}, {REGIONS} regions x {PAGES} pages, {N} launches x 10 batches")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"  {k:6s} {med:6.2f} us per launch  ({med / ref:.2f} of jit)   batches: "
              + " ".join(f"{x:.1f}" for x in v))
