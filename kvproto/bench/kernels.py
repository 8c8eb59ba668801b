"""Benchmark of the staging kernels against a device copy of the same bytes.

Theory of operation
-------------------
For each (layers, tokens, TP ratio) the prefill cache holds 8 KV heads of head_dim 128 in bf16,
16-token pages, one allocation per region; the decode rank holds ``8 / ratio`` of those heads.
The request's pages are a random permutation of a pool a quarter larger than needed, on both
sides. ``gather`` pulls the decode rank's head slice of every region into a staging tensor of
``S`` bytes; ``scatter`` puts it into the decode cache as its local heads.

Every kernel is compared with ``dst.copy_(src)`` of ``S`` bytes measured in the same run (the
ceiling for moving those bytes once), bandwidth counting bytes read plus bytes written. The
naive baseline is the plain-torch reference (one advanced-indexing gather per region). Host
staging (gather into pinned memory, scatter from it) is compared with a pinned copy of ``S``
bytes in the same direction, for both host paths. Times are CUDA-event medians after warm-ups,
with L2 flushed before each timed iteration. Results are checked against the reference once per
configuration. On a CPU-only machine a tiny configuration runs on the reference backend: it
smoke-tests this script and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvproto.geometry.model import Layout
from kvproto.kernels import Regions
from kvproto.kernels import gather as dispatch_gather
from kvproto.kernels import scatter as dispatch_scatter

HEADS = 8
HEAD_DIM = 128
BLOCK = 16
DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Timing:
    """Median seconds per call: on the device, and on the host to enqueue it."""

    device: float
    host: float


Timer = Callable[[Callable[[], object], int], Timing]


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """One configuration's caches, page tables and staging buffers."""

    src: Regions
    dst: Regions
    src_pages: torch.Tensor
    dst_pages: torch.Tensor
    tokens: int
    head_offset: int
    head_count: int
    staging: torch.Tensor
    copy_dst: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.staging.numel() * self.staging.element_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvproto bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 80])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--ratios", type=int, nargs="+", default=[2, 4], help="TP ratio decode/prefill heads")
    parser.add_argument("--src-layout", choices=[l.name for l in Layout], default="NHD")
    parser.add_argument("--dst-layout", choices=[l.name for l in Layout], default="NHD")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-iters", type=int, default=5)
    parser.add_argument("--no-host", action="store_true", help="skip host staging")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile bytes and warps")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        print("CPU only: tiny sizes on the reference backend; these numbers are NOT meaningful.")
        args.layers, args.tokens, args.ratios, args.iters, args.warmup = [2], [64, 256], [2], 3, 1
        args.no_host, args.sweep = True, False
    device = torch.device("cuda" if cuda else "cpu")
    timer = _cuda_timer(args.warmup) if cuda else _cpu_timer(args.warmup)
    src_layout, dst_layout = Layout[args.src_layout], Layout[args.dst_layout]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device: {name}; bf16, head_dim {HEAD_DIM}, {HEADS} KV heads, {BLOCK}-token pages, "
          f"{src_layout.name} -> {dst_layout.name}; GB/s count read+write; ratio = torch copy time / kernel time; "
          "device times (GPU held busy while the host enqueues), host us = enqueue time per call")
    rng = torch.Generator().manual_seed(0)
    max_layers, max_tokens = max(args.layers), max(args.tokens)
    src = Regions(_cache(2 * max_layers, max_tokens, HEADS, src_layout, device))
    pinned = None
    if cuda and not args.no_host:
        max_bytes = 2 * max_layers * max_tokens * HEADS // min(args.ratios) * HEAD_DIM * DTYPE.itemsize
        pinned = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
    device_rows, host_rows, sweep_rows = [], [], []
    for ratio in args.ratios:
        head_count = HEADS // ratio
        dst = Regions(_cache(2 * max_layers, max_tokens, head_count, dst_layout, device))
        for layers in args.layers:
            for tokens in args.tokens:
                setup = _setup(src, dst, layers, tokens, ratio, device, rng)
                common = {"start_token": 0, "end_token": tokens}
                gather_args = {**common, "layout": src_layout, "pages": setup.src_pages,
                               "head_offset": setup.head_offset, "head_count": head_count}
                scatter_args = {**common, "layout": dst_layout, "pages": setup.dst_pages, "head_offset": 0}
                ok = _check(setup, gather_args, scatter_args)
                t_copy = timer(lambda: setup.copy_dst.copy_(setup.staging), args.iters).device
                gather = timer(lambda: dispatch_gather(setup.src, out=setup.staging, **gather_args), args.iters)
                scatter = timer(lambda: dispatch_scatter(setup.staging, setup.dst, **scatter_args), args.iters)
                naive = timer(lambda: dispatch_gather(setup.src, out=setup.staging, backend="torch", **gather_args),
                              args.iters)
                t_gather, t_scatter, t_naive = gather.device, scatter.device, naive.device
                gbps = lambda t: 2 * setup.nbytes / t / 1e9  # noqa: E731
                device_rows.append([
                    str(layers), str(tokens), f"1:{ratio}", f"{setup.nbytes / 2**20:.0f}",
                    f"{gbps(t_copy):.0f}", f"{gbps(t_gather):.0f}", f"{t_copy / t_gather:.3f}",
                    f"{gbps(t_scatter):.0f}", f"{t_copy / t_scatter:.3f}", f"{t_copy / t_naive:.3f}",
                    f"{gather.host * 1e6:.0f}", f"{scatter.host * 1e6:.0f}", ok,
                ])
                if pinned is not None:
                    host_rows.append(_host_row(setup, pinned, gather_args, scatter_args, timer, args.host_iters,
                                               (layers, tokens, ratio)))
                if args.sweep:
                    sweep_rows.extend(_sweep(setup, gather_args, scatter_args, timer, args.iters, t_copy,
                                             (layers, tokens, ratio)))
                del setup
        del dst
    _table(["layers", "tokens", "TP", "MiB", "copy GB/s", "gather GB/s", "gather/copy",
            "scatter GB/s", "scatter/copy", "naive/copy", "gather host us", "scatter host us", "check"],
           device_rows)
    if host_rows:
        print("\nhost staging, fraction of a pinned copy of the same bytes (GB/s one way)")
        _table(["layers", "tokens", "TP", "D2H pinned GB/s", "D2H bounce", "D2H mapped",
                "H2D pinned GB/s", "H2D bounce", "H2D mapped"], host_rows)
    if sweep_rows:
        print("\ntile sweep: ratio vs torch copy")
        _table(["layers", "tokens", "TP", "tile bytes", "warps", "gather/copy", "scatter/copy"], sweep_rows)
    return 0


def _cache(regions: int, tokens: int, heads: int, layout: Layout, device: torch.device) -> list[torch.Tensor]:
    """``regions`` separate allocations with room for ``tokens`` plus a quarter, random bits."""
    pages = -(-tokens // BLOCK) * 5 // 4 + 1
    shape = (pages, BLOCK, heads, HEAD_DIM) if layout is Layout.NHD else (pages, heads, BLOCK, HEAD_DIM)
    cache = []
    for _ in range(regions):
        region = torch.empty(shape, dtype=DTYPE, device=device)
        region.view(torch.int16).random_()
        cache.append(region)
    return cache


def _setup(src: Regions, dst: Regions, layers: int, tokens: int, ratio: int,
           device: torch.device, rng: torch.Generator) -> Setup:
    needed = -(-tokens // BLOCK)
    head_count = HEADS // ratio
    staging = torch.empty((2 * layers, tokens, head_count, HEAD_DIM), dtype=DTYPE, device=device)
    return Setup(
        src=Regions(src[: 2 * layers]),
        dst=Regions(dst[: 2 * layers]),
        src_pages=torch.randperm(src[0].shape[0], generator=rng)[:needed].to(device=device, dtype=torch.int32),
        dst_pages=torch.randperm(dst[0].shape[0], generator=rng)[:needed].to(device=device, dtype=torch.int32),
        tokens=tokens,
        head_offset=(ratio - 1) * head_count,
        head_count=head_count,
        staging=staging,
        copy_dst=torch.empty_like(staging),
    )


def _check(setup: Setup, gather_args: dict, scatter_args: dict) -> str:
    """Kernel results against the reference: gathered bytes, then the scattered cells."""
    setup.staging.view(torch.int16).fill_(-1)
    dispatch_gather(setup.src, out=setup.staging, **gather_args)
    want = dispatch_gather(setup.src, backend="torch", **gather_args)
    if not torch.equal(setup.staging.view(torch.int16), want.view(torch.int16)):
        return "GATHER WRONG"
    dispatch_scatter(setup.staging, setup.dst, **scatter_args)
    back = dispatch_gather(setup.dst, head_count=setup.head_count, backend="torch", **scatter_args)
    return "ok" if torch.equal(back.view(torch.int16), want.view(torch.int16)) else "SCATTER WRONG"


def _host_row(setup: Setup, pinned: torch.Tensor, gather_args: dict, scatter_args: dict,
              timer: Timer, iters: int,
              config: tuple[int, int, int]) -> list[str]:
    host = pinned[: setup.nbytes].view(DTYPE).view(setup.staging.shape)
    t_d2h = timer(lambda: host.copy_(setup.staging, non_blocking=True), iters).device
    t_h2d = timer(lambda: setup.staging.copy_(host, non_blocking=True), iters).device
    row = [str(config[0]), str(config[1]), f"1:{config[2]}", f"{setup.nbytes / t_d2h / 1e9:.1f}"]
    fractions = {}
    for path in ("bounce", "mapped"):
        try:
            t = timer(lambda: dispatch_gather(setup.src, out=host, backend="triton", host_path=path, **gather_args),
                      iters).device
            fractions[("D2H", path)] = f"{t_d2h / t:.3f}"
        except Exception as exc:  # a path the platform refuses is reported, not fatal
            fractions[("D2H", path)] = f"error: {type(exc).__name__}"
    row += [fractions[("D2H", "bounce")], fractions[("D2H", "mapped")], f"{setup.nbytes / t_h2d / 1e9:.1f}"]
    for path in ("bounce", "mapped"):
        try:
            t = timer(lambda: dispatch_scatter(host, setup.dst, backend="triton", host_path=path, **scatter_args),
                      iters).device
            fractions[("H2D", path)] = f"{t_h2d / t:.3f}"
        except Exception as exc:  # a path the platform refuses is reported, not fatal
            fractions[("H2D", path)] = f"error: {type(exc).__name__}"
    return row + [fractions[("H2D", "bounce")], fractions[("H2D", "mapped")]]


def _sweep(setup: Setup, gather_args: dict, scatter_args: dict,
           timer: Timer, iters: int, t_copy: float,
           config: tuple[int, int, int]) -> list[list[str]]:
    rows = []
    for tile_bytes in (8192, 16384, 32768, 65536):
        for warps in (4, 8):
            tuning = {"backend": "triton", "tile_bytes": tile_bytes, "num_warps": warps}
            t_g = timer(lambda: dispatch_gather(setup.src, out=setup.staging, **gather_args, **tuning), iters)
            t_s = timer(lambda: dispatch_scatter(setup.staging, setup.dst, **scatter_args, **tuning), iters)
            rows.append([str(config[0]), str(config[1]), f"1:{config[2]}", str(tile_bytes), str(warps),
                         f"{t_copy / t_g.device:.3f}", f"{t_copy / t_s.device:.3f}"])
    return rows


def _cuda_timer(warmup: int) -> Timer:
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    cycles_per_s = _sleep_rate()

    def timer(fn: Callable[[], object], iters: int) -> Timing:
        """Median device time of ``fn`` by CUDA events, and its host time.

        Before each timed call the L2 is flushed and the GPU is held by a sleep kernel longer
        than ``fn``'s host time, so the events bracket device work only.
        """
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        hold = int(min(3 * host + 1e-4, 0.5) * cycles_per_s)
        events, hosts = [], []
        for _ in range(iters):
            flush.zero_()
            torch.cuda._sleep(hold)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            start = time.perf_counter()
            fn()
            hosts.append(time.perf_counter() - start)
            end.record()
            events.append((begin, end))
        torch.cuda.synchronize()
        device = statistics.median(begin.elapsed_time(end) for begin, end in events) / 1e3
        return Timing(device, statistics.median(hosts))

    return timer


def _sleep_rate() -> float:
    """Cycles per second of ``torch.cuda._sleep``, measured."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    begin.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (begin.elapsed_time(end) / 1e3)


def _cpu_timer(warmup: int) -> Timer:
    def timer(fn: Callable[[], object], iters: int) -> Timing:
        """Median wall seconds of ``fn`` (host time equals device time here)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return Timing(statistics.median(times), statistics.median(times))

    return timer


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    raise SystemExit(main())
