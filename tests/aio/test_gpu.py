"""CUDA caches end to end over NIXL: direct VRAM writes, GPU staging and host staging."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvproto.aio import DecodeEndpoint, KVCache, PrefillEndpoint
from kvproto.core import RoomState
from kvproto.geometry import Layout

from .conftest import config

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.gpu,
    pytest.mark.nixl,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


DECODE_GPUS = [0, 1] if torch.cuda.device_count() >= 2 else [0]
"""Where the decode's cache is: the prefill's GPU, and the other GPU where there are two."""


def cuda_cache(heads: int, tp: int, rank: int, layout: Layout, block: int, seed: int,
               gpu: int = 0) -> tuple[KVCache, list]:
    gen = torch.Generator().manual_seed(seed)
    shape = (64, block, heads, 32) if layout is Layout.NHD else (64, heads, block, 32)
    regions = [torch.randint(-50, 50, shape, generator=gen).to(torch.bfloat16).to(f"cuda:{gpu}") for _ in range(4)]
    kv = KVCache.from_tensors([regions[0::2], regions[1::2]], tp_size=tp, tp_rank=rank, num_kv_heads=8, layout=layout)
    return kv, regions


def token_heads(region: torch.Tensor, pages: list[int], n: int, layout: Layout) -> torch.Tensor:
    t = region[pages]
    if layout is Layout.HND:
        t = t.transpose(1, 2)
    return t.reshape(-1, t.shape[2], t.shape[3])[:n]


@pytest.mark.parametrize("decode_gpu", DECODE_GPUS, ids=lambda g: f"decode-cuda{g}")
@pytest.mark.parametrize("mode", ["direct", "device-staging", "host-staging", "kernel-direct", "kernel-sliced"])
async def test_gpu_room_lands_byte_exact(mode: str, decode_gpu: int) -> None:
    """A prefill TP 1 -> decode TP 2 room (or a same-geometry room for ``direct``) between CUDA
    caches lands byte-exact, on the path the mode selects (``kernel-*``: the cuda-ipc adapter,
    endpoints in this process: one pattern kernel per write, no staging); the decode's cache is on
    the prefill's GPU, or on the other one."""
    direct = mode in ("direct", "kernel-direct")
    decode_tp = 1 if direct else 2
    src_layout, dst_layout = (Layout.NHD, Layout.NHD) if direct else (Layout.HND, Layout.NHD)
    transport = "cuda-ipc" if mode.startswith("kernel") else "nixl"
    src_kv, src = cuda_cache(8, 1, 0, src_layout, 16, seed=1)
    opts = dict(host_staging=mode == "host-staging", staging_bytes=8 << 20)
    dsts = [cuda_cache(8 // decode_tp, decode_tp, r, dst_layout, 16 if direct else 32, seed=2 + r, gpu=decode_gpu)
            for r in range(decode_tp)]
    n, src_pages = 150, [9, 3, 41, 7, 20, 11, 60, 2, 33, 18]
    dst_pages = [[5, 17, 40, 1, 30], [8, 9, 10, 50, 22]] if not direct else [[12, 6, 44, 0, 38, 27, 14, 59, 31, 4]]
    async with PrefillEndpoint(src_kv, config=config(transport, **opts)) as prefill:
        decodes = [DecodeEndpoint(kv, config=config(transport, instance="gpu-decode", **opts)) for kv, _ in dsts]
        for d in decodes:
            await d.start()
        try:
            rooms = [d.open_room(7, prefill.address, pages=dst_pages[r], num_tokens=n) for r, d in enumerate(decodes)]
            room = prefill.open_room(7)
            room.send(src_pages, n)
            await asyncio.wait_for(asyncio.gather(room.wait(), *(r.wait() for r in rooms)), 60)
        finally:
            for d in decodes:
                await d.close()
    want_path = {"direct": "direct", "device-staging": "staged-device", "host-staging": "staged-host",
                 "kernel-direct": "direct-kernel", "kernel-sliced": "sliced-kernel"}[mode]
    assert want_path in room.stats.paths
    for gpu in DECODE_GPUS:
        torch.cuda.synchronize(gpu)
    hs = 8 // decode_tp
    for rank, (_kv, dst) in enumerate(dsts):
        for r in range(4):
            want = token_heads(src[r], src_pages, n, src_layout)[:, rank * hs:(rank + 1) * hs]
            got = token_heads(dst[r], dst_pages[rank], n, dst_layout).to(want.device)
            assert torch.equal(want, got), f"decode rank {rank} region {r}"


@pytest.mark.parametrize("decode_gpu", DECODE_GPUS, ids=lambda g: f"decode-cuda{g}")
@pytest.mark.parametrize("transport", ["nixl", "cuda-ipc"])
async def test_gpu_layerwise_send_never_waits_for_the_engine_stream(transport: str, decode_gpu: int) -> None:
    """Layer chunks whose CUDA events fire only after ~0.3 s of work on the engine's own stream:
    send() returns at once (kvproto never synchronizes the engine), nothing is written before
    the event, and the room lands byte-exact once it has fired."""
    src_kv, src = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=1)
    dst_kv, dst = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=2, gpu=decode_gpu)
    n, src_pages, dst_pages = 32, [9, 3], [12, 40]
    engine = torch.cuda.Stream()
    async with PrefillEndpoint(src_kv, config=config(transport, staging_bytes=0)) as prefill, \
            DecodeEndpoint(dst_kv, config=config(transport, staging_bytes=0)) as decode:
        d = decode.open_room(3, prefill.address, pages=dst_pages, num_tokens=n)
        room = prefill.open_room(3)
        events = []
        with torch.cuda.stream(engine):
            for _ in range(2):
                torch.cuda._sleep(300_000_000)  # ~0.15 s of GPU cycles per layer
                events.append(torch.cuda.Event())
                events[-1].record(engine)
        began = time.monotonic()
        room.send(src_pages, n, layers=range(0, 1), ready=events[0])
        room.send([], n, layers=range(1, 2), ready=events[1])
        assert time.monotonic() - began < 0.05, "send() waited for the engine"
        assert not events[0].query()
        await asyncio.sleep(0.02)
        assert d.poll() is not RoomState.SUCCESS
        await asyncio.wait_for(asyncio.gather(room.wait(), d.wait()), 30)
        assert events[1].query()
    for gpu in DECODE_GPUS:
        torch.cuda.synchronize(gpu)
    for r in range(4):
        want = token_heads(src[r], src_pages, n, Layout.NHD)
        assert torch.equal(want, token_heads(dst[r], dst_pages, n, Layout.NHD).to(want.device))



@pytest.mark.parametrize("decode_gpu", DECODE_GPUS, ids=lambda g: f"decode-cuda{g}")
@pytest.mark.parametrize("transport", ["nixl", "cuda-ipc"])
async def test_gpu_a_layer_posted_before_its_event_moves_what_the_engine_wrote_after_it(
        transport: str, decode_gpu: int) -> None:
    """The engine writes a layer's KV at the end of ~0.75 s of its own stream's work and records
    the layer's event; two rooms are sent at once with that event. The kernel path posts both
    writes at once, queued on the device behind the event (``wait_on_device``: the adapter counts
    them before the event fires) and, ready together, launched as one kernel; NIXL holds them
    until the event has fired. Either way the decode gets what the engine wrote, not what the
    pages held before."""
    src_kv, src = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=1)
    dst_kv, dst = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=2, gpu=decode_gpu)
    n, src_pages, dst_pages = 32, [[9, 3], [21, 5]], [[12, 40], [2, 33]]
    every = torch.tensor(src_pages[0] + src_pages[1], device="cuda:0")  # on the device: no copy waits for the engine
    fresh = [torch.full_like(region[every], 7 + r) for r, region in enumerate(src)]
    for region in src:  # the engine's kernels loaded now: a first launch (lazy module loading) waits for the device
        region.index_copy_(0, every, region.index_select(0, every))
    engine = torch.cuda.Stream()
    async with PrefillEndpoint(src_kv, config=config(transport, staging_bytes=0)) as prefill, \
            DecodeEndpoint(dst_kv, config=config(transport, staging_bytes=0)) as decode:
        ds = [decode.open_room(3 + i, prefill.address, pages=dst_pages[i], num_tokens=n) for i in range(2)]
        rooms = [prefill.open_room(3 + i) for i in range(2)]
        await asyncio.sleep(0.05)  # the decode's requests are in: the sends below post or hold at once
        torch.cuda.synchronize()
        engine.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(engine):
            torch.cuda._sleep(1_500_000_000)  # ~0.75 s: the checks below run well before it ends
            for region, values in zip(src, fresh):
                region.index_copy_(0, every, values)  # the layer's KV, computed only now
            event = torch.cuda.Event()
            event.record(engine)
        writes, launches = prefill.transport.stats.writes, getattr(prefill.transport, "launches", 0)
        for room, pages in zip(rooms, src_pages):
            room.send(pages, n, ready=event)
        await asyncio.sleep(0.02)
        assert not event.query()
        posted = prefill.transport.stats.writes - writes  # kernel path: posted, queued behind the event
        assert posted == (2 if transport == "cuda-ipc" else 0), posted
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in rooms), *(d.wait() for d in ds)), 30)
        if transport == "cuda-ipc":
            assert prefill.transport.launches - launches == 1
    for gpu in DECODE_GPUS:
        torch.cuda.synchronize(gpu)
    for r in range(4):
        for i in range(2):
            want = token_heads(src[r], src_pages[i], n, Layout.NHD)
            assert int(want[0, 0, 0]) == 7 + r
            assert torch.equal(want, token_heads(dst[r], dst_pages[i], n, Layout.NHD).to(want.device))


SLOW_POLLS = dict(transfer_poll_s=0.005, idle_poll_s=0.005)
"""The decode's polls, 5 ms apart: under uvloop a pause under a millisecond is a timer of 0 ms,
so the default 0.2 ms of a decode waiting for its room would spin this process's loop (the
adapter's tag descriptor wakes it when the bytes land)."""


@pytest.mark.parametrize("ready_thread", [True, False], ids=["waits-in-thread", "polls"])
async def test_gpu_a_write_queued_behind_the_engine_costs_no_core_while_it_waits(ready_thread: bool) -> None:
    """A room sent while ~0.3 s of the engine's work is still queued on its stream: the kernel-path
    write follows that work, so it is in flight for 0.3 s. With the waiting thread (the default)
    the prefill's loop sleeps through it (this process's CPU well under the wall time; the decode
    polls for its room every 5 ms); with ``ready_thread=False`` it polls in a spin, a core busy all
    along. The room lands byte-exact either way."""
    src_kv, src = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=1)
    dst_kv, dst = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=2)
    n, src_pages, dst_pages = 32, [9, 3], [12, 40]
    async with PrefillEndpoint(src_kv, config=config("cuda-ipc", staging_bytes=0, ready_thread=ready_thread)) as prefill, \
            DecodeEndpoint(dst_kv, config=config("cuda-ipc", staging_bytes=0, **SLOW_POLLS)) as decode:
        warm = decode.open_room(1, prefill.address, pages=[1], num_tokens=16)
        first = prefill.open_room(1)
        first.send([1], 16)
        await asyncio.wait_for(asyncio.gather(first.wait(), warm.wait()), 30)  # linked, compiled
        d = decode.open_room(2, prefill.address, pages=dst_pages, num_tokens=n)
        while d.poll() is not RoomState.TRANSFERRING:
            await asyncio.sleep(0.001)
        room = prefill.open_room(2)
        torch.cuda._sleep(600_000_000)  # ~0.3 s of GPU cycles on the engine's (current) stream
        wall, cpu = time.monotonic(), time.process_time()
        room.send(src_pages, n)
        await asyncio.wait_for(asyncio.gather(room.wait(), d.wait()), 30)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    print(f"ready_thread={ready_thread}: {cpu * 1e3:.0f} ms of CPU over {wall * 1e3:.0f} ms in flight")
    assert wall > 0.1, f"the write was in flight {wall:.3f} s only: the engine's work did not hold it"
    if ready_thread:
        assert cpu < 0.5 * wall, f"{cpu:.3f} s of CPU over {wall:.3f} s: the loop spun while the write waited"
    else:
        assert cpu > 0.7 * wall, f"{cpu:.3f} s of CPU over {wall:.3f} s: the polling loop did not spin"
    torch.cuda.synchronize()
    for r in range(4):
        want = token_heads(src[r], src_pages, n, Layout.NHD)
        assert torch.equal(want, token_heads(dst[r], dst_pages, n, Layout.NHD))
