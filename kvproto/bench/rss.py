"""``kvproto bench rss``: does memory stay flat over many rooms?

Theory of operation
-------------------
A prefill rank and a decode rank run in this process (NIXL by default, or loopback) and move
``--rooms`` small rooms one after the other, each on fresh random non-contiguous pages with an
aux slot; every ``--every`` rooms the last room's bytes are checked and the process's memory is
printed: ``VmRSS`` (resident now) and ``VmHWM`` (peak) from ``/proc/self/status``, and
``ru_maxrss`` from ``getrusage``, with the Python objects the collector tracks and the ended
rooms each core remembers (tombstones, bounded by ``kvproto.core.base.TOMBSTONES``) to tell
growth in Python objects from growth elsewhere (the transport, ZMQ, the allocator).

Tombstones are bounded (one per ended room per core, up to ``TOMBSTONES`` each, a few hundred
bytes apiece): ``--tombstones N`` changes the cap for the run. Once the cap is reached any
remaining growth is something else.

The verdict compares resident memory from the first report where the tombstones are at their
cap (the steady state) to the end: "RSS flat: yes" when it grew by at most ``--tolerance-mib``.
The growth from room ``--every`` is printed too. It is a benchmark: the exit
status is non-zero only if a room fails, never because memory grew.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import resource
import sys
import time

import torch

from kvproto.aio import DecodeEndpoint, EndpointConfig, KVCache, PrefillEndpoint
from kvproto.core import Timeouts

MIB = 1 << 20


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes (0 where /proc is not there)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _maxrss() -> int:
    """Peak resident set from getrusage, in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _cache(args: argparse.Namespace, seed: int) -> tuple[KVCache, list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (args.blocks, args.block, args.heads, args.head_dim)
    tensors = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(2 * args.layers)]
    aux = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=gen)
    kv = KVCache.from_tensors([tensors[0::2], tensors[1::2]], aux=aux)
    return kv, tensors, aux


async def _run(args: argparse.Namespace) -> int:
    src_kv, src, src_aux = _cache(args, 1)
    dst_kv, dst, dst_aux = _cache(args, 2)
    timeouts = Timeouts(bootstrap=30, waiting=30, transfer=30)
    config = dict(transport=args.transport, timeouts=timeouts, staging_bytes=0)
    pages = -(-args.tokens // args.block)
    rng = random.Random(args.seed)
    rows = []
    async with PrefillEndpoint(src_kv, config=EndpointConfig(**config)) as prefill, \
            DecodeEndpoint(dst_kv, config=EndpointConfig(**config)) as decode:
        start = time.perf_counter()
        for i in range(1, args.rooms + 1):
            room_id = 1_000_000 + i
            src_pages = rng.sample(range(args.blocks), pages)
            dst_pages = rng.sample(range(args.blocks), pages)
            slot = i % 4
            d = decode.open_room(room_id, prefill.bootstrap_address, pages=dst_pages, num_tokens=args.tokens,
                                 aux_slot=slot)
            p = prefill.open_room(room_id)
            p.send(src_pages, args.tokens, aux_slot=(slot + 1) % 4)
            await d.wait()
            await p.wait()
            if i % args.every == 0 or i == 1:
                exact = all(torch.equal(s[sp], t[dp]) for s, t in zip(src, dst)
                            for sp, dp in zip(src_pages, dst_pages)) and torch.equal(src_aux[(slot + 1) % 4],
                                                                                     dst_aux[slot])
                if not exact:
                    print(f"room {i}: bytes differ", file=sys.stderr)
                    return 1
                gc.collect()
                status = _status()
                tombstones = len(prefill.core._tombstones) + len(decode.core._tombstones)
                rows.append((i, status["VmRSS"], status["VmHWM"], _maxrss(), len(gc.get_objects()), tombstones,
                             time.perf_counter() - start))
                r = rows[-1]
                prev = rows[-2] if len(rows) > 1 else (0, 0, 0, 0, 0, 0, 0.0)
                rate = (r[0] - prev[0]) / max(1e-9, r[6] - prev[6])  # over the last interval
                print(f"{r[0]:>7} {r[1] / MIB:>10.1f} {r[2] / MIB:>10.1f} {r[3] / MIB:>10.1f} {r[4]:>11,} "
                      f"{r[5]:>11,} {rate:>9.0f}", flush=True)
        if prefill.errors or decode.errors:
            print(f"unexpected errors: prefill {prefill.errors}, decode {decode.errors}", file=sys.stderr)
            return 1
    base = next((r for r in rows if r[0] >= args.every), rows[0])
    last = rows[-1]
    growth = (last[1] - base[1]) / MIB
    ratio = last[1] / base[1] if base[1] else float("nan")
    print(f"VmRSS from room {base[0]:,} to room {last[0]:,}: {base[1] / MIB:.1f} -> {last[1] / MIB:.1f} MiB "
          f"(x{ratio:.4f}, {growth:+.1f} MiB, {growth * MIB / max(1, last[0] - base[0]):+.0f} bytes per room); "
          f"tracked Python objects {last[4] - base[4]:+,}; tombstones {last[5] - base[5]:+,} "
          f"(bounded by kvproto.core.base.TOMBSTONES per core)")
    steady = next(r for r in rows if r[5] == last[5])
    steady_growth = (last[1] - steady[1]) / MIB
    if steady[0] < last[0]:
        print(f"steady state (tombstones at their cap) from room {steady[0]:,} to room {last[0]:,}: "
              f"{steady_growth:+.1f} MiB")
    else:
        steady_growth = growth  # the cap was never reached: judge the whole run
    print(f"RSS flat: {'yes' if steady_growth <= args.tolerance_mib else 'no'} (growth {steady_growth:.1f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvproto bench rss", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=1_000, help="print memory every this many rooms")
    ap.add_argument("--transport", default="nixl", choices=["nixl", "loopback"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per room (small: the point is the count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance-mib", type=float, default=4.0,
                    help="growth after room --every up to which RSS counts as flat")
    ap.add_argument("--tombstones", type=int, default=None,
                    help="lower the cores' cap on remembered ended rooms (kvproto.core.base.TOMBSTONES, "
                         "65,536) for this run, to see the memory that is not tombstones")
    args = ap.parse_args(argv)
    if args.tombstones is not None:
        from kvproto.core import base

        base.TOMBSTONES = args.tombstones
    if args.rooms < 1 or args.every < 1:
        ap.error("--rooms and --every must be positive")
    cap = f", tombstones capped at {args.tombstones:,}" if args.tombstones is not None else ""
    print(f"kvproto bench rss: {args.rooms:,} sequential rooms of {args.tokens} tokens, prefill and decode in this "
          f"process, transport {args.transport}{cap}; memory in MiB after gc.collect()")
    print(f"{'room':>7} {'VmRSS':>10} {'VmHWM':>10} {'ru_maxrss':>10} {'py objects':>11} {'tombstones':>11} "
          f"{'rooms/s':>9}")
    return asyncio.run(_run(args))
