"""Fused K/V caches (one plane per layer, each head's K then V side by side: vLLM's layout since
0.33) move byte-exact across TP, block size and layout; a fused cache never pairs with a K/V one."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kvproto.aio import DecodeEndpoint, KVCache, PrefillEndpoint, TransferFailed
from kvproto.aio.memory import geometry_from_wire, geometry_to_wire
from kvproto.geometry import Layout
from kvproto.wire import ErrorCode

from .conftest import TRANSPORTS, config, make_cache

HEADS, CONTENT, LAYERS = 4, 16, 3  # CONTENT = K (8) + V (8) per head and token


def fused(*, tp: int = 1, rank: int = 0, block: int = 4, layout: Layout = Layout.NHD, seed: int = 0,
          blocks: int = 32) -> tuple[list[torch.Tensor], KVCache]:
    heads = HEADS // tp
    shape = (blocks, block, heads, CONTENT) if layout is Layout.NHD else (blocks, heads, block, CONTENT)
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
    return layers, KVCache.from_tensors([layers], tp_size=tp, tp_rank=rank, num_kv_heads=HEADS, layout=layout,
                                        kv_fused=True)


def token_head(t: torch.Tensor, layout: Layout, block: int, pages: list[int], token: int, head: int) -> torch.Tensor:
    page, slot = pages[token // block], token % block
    return t[page, slot, head] if layout is Layout.NHD else t[page, head, slot]


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fused_cache_moves_byte_exact_tp1_to_tp2_hnd_to_nhd_block4_to_8(transport: str) -> None:
    src, src_kv = fused(layout=Layout.HND, seed=1)
    dsts = [fused(tp=2, rank=r, block=8, seed=2 + r) for r in range(2)]
    n, src_pages, dst_pages = 27, [9, 3, 20, 7, 11, 30, 1], [[5, 17, 2, 12], [8, 0, 19, 25]]
    async with PrefillEndpoint(src_kv, config=config(transport)) as prefill:
        decodes = [DecodeEndpoint(kv, config=config(transport, instance="fused-decode")) for _, kv in dsts]
        for d in decodes:
            await d.start()
        try:
            rooms = [d.open_room(3, prefill.address, pages=dst_pages[r], num_tokens=n) for r, d in enumerate(decodes)]
            room = prefill.open_room(3)
            room.send(src_pages, n)
            await asyncio.wait_for(asyncio.gather(room.wait(), *(r.wait() for r in rooms)), 30)
        finally:
            for d in decodes:
                await d.close()
    for layer in range(LAYERS):
        for token in range(n):
            for head in range(HEADS):
                rank, local = divmod(head, HEADS // 2)
                want = token_head(src[layer], Layout.HND, 4, src_pages, token, head)
                got = token_head(dsts[rank][0][layer], Layout.NHD, 8, dst_pages[rank], token, local)
                assert torch.equal(want, got), (layer, token, head)


@pytest.mark.asyncio
@pytest.mark.nixl
async def test_fused_decode_and_kv_plane_prefill_are_refused_as_incompatible() -> None:
    """A decode with one fused plane per layer and a prefill with K and V planes of the same bytes
    per head: the room fails INCOMPATIBLE_GEOMETRY naming ``kv_fused``; nothing is written."""
    prefill_cache = make_cache(layers=LAYERS, heads=HEADS, head_dim=CONTENT // 2, seed=3)
    layers, kv = fused(seed=4)
    before = [t.clone() for t in layers]
    async with PrefillEndpoint(prefill_cache.kv, config=config("nixl")) as prefill, \
            DecodeEndpoint(kv, config=config("nixl")) as decode:
        d = decode.open_room(9, prefill.address, pages=[1, 2], num_tokens=8)
        with pytest.raises(TransferFailed) as info:
            await asyncio.wait_for(d.wait(), 20)
    assert info.value.code == ErrorCode.INCOMPATIBLE_GEOMETRY
    assert "kv_fused" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, layers))


def test_fused_geometry_goes_on_the_wire_as_mla_2() -> None:
    """``mla`` = 2 on the wire is a fused K/V cache; 1 (and any other nonzero value, as 1.0 and 1.1
    receivers read it) is MLA. A receiver that reads 2 as MLA refuses it: MLA has one head."""
    _, kv = fused(tp=2, rank=1)
    wire = geometry_to_wire(kv.geometry)
    assert wire.mla == 2
    back = geometry_from_wire(wire)
    assert back == kv.geometry and back.kv_fused and not back.mla and back.planes == 1
    mla = dataclasses.replace(kv.geometry, kv_fused=False, mla=True, num_kv_heads=1)
    assert geometry_to_wire(mla).mla == 1
    for value in (1, 3, 255):
        g = geometry_from_wire(dataclasses.replace(geometry_to_wire(mla), mla=value))
        assert g.mla and not g.kv_fused
    assert geometry_to_wire(make_cache().kv.geometry).mla == 0
