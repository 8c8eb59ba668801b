"""Random geometries end to end: one endpoint per rank over the loopback transport.

Every prefill rank fills its pages with the reference content (a pure function of room,
layer, plane, global head, token and byte: ``kvproto.demo.Content``), every decode rank checks
every byte of every head it holds against the same function. Nothing here uses
``kvproto.geometry`` to compute what a rank should hold.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.aio import DecodeEndpoint, PrefillEndpoint
from kvproto.demo import DemoConfig, _Cache, prefix_of

from .conftest import config

pytestmark = pytest.mark.asyncio


@st.composite
def geometries(draw: st.DrawFn) -> DemoConfig:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))

    def tp() -> int:
        choices = [t for t in (1, 2, 4, 8) if mla or t <= heads or t % heads == 0]
        return draw(st.sampled_from(choices))

    prefill_block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    decode_block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tokens = draw(st.integers(1, 70))
    return DemoConfig(
        rooms=1, layers=draw(st.integers(1, 3)), kv_heads=heads, head_dim=draw(st.sampled_from([1, 4, 8])),
        dtype=draw(st.sampled_from(["bf16", "fp32", "u8"])), prefill_tp=tp(), decode_tp=tp(),
        prefill_block=prefill_block, decode_block=decode_block,
        prefill_layout=draw(st.sampled_from(["NHD", "HND"])), decode_layout=draw(st.sampled_from(["NHD", "HND"])),
        mla=mla, blocks=160, tokens=tokens,
        prefix_tokens=draw(st.integers(0, tokens)),
        chunk_tokens=prefill_block * draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**16)), transport="loopback",
        path=draw(st.sampled_from(["auto", "sliced"])),
        staging_mb=0,
    ), draw(st.sampled_from([2048, 8192, 1 << 20]))


async def run_room(cfg: DemoConfig, room_id: int, staging_bytes: int = 1 << 20, transport: str = "loopback",
                   options: dict | None = None) -> set[str]:
    """One room across every rank of ``cfg``; returns the paths the prefill rooms used."""
    torch.manual_seed(cfg.seed)
    prefill_caches = [_Cache(torch, cfg, tp=cfg.prefill_tp, rank=r, block=cfg.prefill_block,
                             layout=cfg.prefill_layout, aux_slots=1) for r in range(cfg.prefill_tp)]
    decode_caches = [_Cache(torch, cfg, tp=cfg.decode_tp, rank=r, block=cfg.decode_block,
                            layout=cfg.decode_layout, aux_slots=1) for r in range(cfg.decode_tp)]
    n = cfg.tokens
    prefix = prefix_of(cfg, n)
    opts = dict(path=cfg.path, staging_bytes=staging_bytes, transport_options=options or {})
    first = PrefillEndpoint(prefill_caches[0].kv, config=config(transport, **opts))
    await first.start()
    prefills = [first]
    try:
        for c in prefill_caches[1:]:
            ep = PrefillEndpoint(c.kv, bootstrap=first.address, config=config(transport, **opts))
            await ep.start()
            prefills.append(ep)
        decodes = []
        for c in decode_caches:
            ep = DecodeEndpoint(c.kv, config=config(transport, instance=f"decode-{room_id}", **opts))
            await ep.start()
            decodes.append(ep)
        decode_rooms, decode_pages = [], []
        for ep, cache in zip(decodes, decode_caches):
            pages = cache.take(-(-n // cfg.decode_block))
            if prefix:
                cache.fill(room_id, pages, 0, prefix)
            decode_pages.append(pages)
            decode_rooms.append(ep.open_room(room_id, first.address, pages=pages, num_tokens=n, prefix_tokens=prefix))
        prefill_rooms = []
        for ep, cache in zip(prefills, prefill_caches):
            room = ep.open_room(room_id)
            pages: list[int] = []
            t = 0
            while t < n:
                end = min(n, t + cfg.chunk_tokens)
                new = cache.take(-(-end // cfg.prefill_block) - len(pages))
                pages += new
                cache.fill(room_id, pages, t, end, garbage_below=prefix)
                room.send(new, end, last=end == n)
                t = end
            prefill_rooms.append(room)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in decode_rooms + prefill_rooms)), 20)
        for rank, (cache, pages) in enumerate(zip(decode_caches, decode_pages)):
            assert cache.check(room_id, pages, n) == 0, f"decode rank {rank} holds wrong bytes"
        return set().union(*(room.stats.paths for room in prefill_rooms))
    finally:
        for ep in [*prefills[::-1], *locals().get("decodes", [])]:
            await ep.close()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=geometries())
async def test_endpoints_random_geometry_moves_reference_bytes(case: tuple[DemoConfig, int]) -> None:
    """Any compatible prefill/decode geometry pair lands the reference bytes on every decode rank,
    on the default path (direct or staged, through staging rings as small as 2 KiB) and sliced."""
    cfg, staging_bytes = case
    await run_room(cfg, room_id=1 + cfg.seed, staging_bytes=staging_bytes)


async def test_endpoints_crossed_layouts_with_replication() -> None:
    """A named hard case: P8 -> D2 with 4 heads (GQA replication), HND -> NHD, blocks 4 -> 16."""
    cfg = dataclasses.replace(DemoConfig(), rooms=1, layers=2, kv_heads=4, head_dim=8, prefill_tp=8, decode_tp=2,
                              prefill_block=4, decode_block=16, prefill_layout="HND", decode_layout="NHD",
                              blocks=64, tokens=61, prefix_tokens=16, chunk_tokens=8, transport="loopback")
    await run_room(cfg, room_id=4242)
    await run_room(dataclasses.replace(cfg, path="sliced"), room_id=4243)
    await run_room(cfg, room_id=4244, staging_bytes=1024)  # pieces of 2 tokens: many grants per chunk


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=geometries())
async def test_endpoints_random_geometry_over_the_kernel_path(case: tuple[DemoConfig, int]) -> None:
    """The same geometries over the kernel-path adapter (``cuda-ipc``; its kernels run on these CPU
    caches in Triton's interpreter): reference bytes on every decode rank, every KV write one
    pattern kernel (``direct-kernel`` / ``sliced-kernel``), nothing staged."""
    cfg, staging_bytes = case
    paths = await run_room(cfg, room_id=1 + cfg.seed, staging_bytes=staging_bytes, transport="cuda-ipc",
                           options={"fallback": "loopback", "cpu_kernels": True})
    assert paths <= {"direct-kernel", "sliced-kernel", "aux"}, paths
