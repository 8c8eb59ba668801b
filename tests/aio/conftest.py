"""Fixtures: small CPU KV caches and prefill/decode endpoint pairs on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import pytest
import pytest_asyncio
import torch

from kvproto.aio import DecodeEndpoint, EndpointConfig, KVCache, PrefillEndpoint
from kvproto.core import Timeouts
from kvproto.geometry import Layout
from kvproto.transport import available_transports

def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every endpoint test runs on asyncio's own event loop and on uvloop (what vLLM and SGLang use)."""
    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


TRANSPORTS = [pytest.param(t, marks=pytest.mark.nixl) if t == "nixl" else t for t in available_transports()]


@dataclass
class Cache:
    """Per-layer K and V tensors (uint8, random) plus an aux buffer, and the KVCache over them."""

    planes: list[list[torch.Tensor]]
    aux: torch.Tensor
    kv: KVCache

    def page(self, plane: int, layer: int, page: int) -> torch.Tensor:
        return self.planes[plane][layer][page]


def make_cache(*, blocks: int = 64, layers: int = 2, heads: int = 2, head_dim: int = 8, block: int = 4,
               seed: int = 0, aux_slots: int = 4, aux_bytes: int = 16, layout: Layout = Layout.NHD,
               tp: int = 1, rank: int = 0, kv_heads: int | None = None) -> Cache:
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, block, heads, head_dim) if layout is Layout.NHD else (blocks, heads, block, head_dim)
    planes = [[torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(layers)]
              for _ in range(2)]
    aux = torch.randint(0, 256, (aux_slots, aux_bytes), dtype=torch.uint8, generator=gen)
    kv = KVCache.from_tensors(planes, aux=aux, layout=layout, tp_size=tp, tp_rank=rank,
                              num_kv_heads=kv_heads or heads * tp)
    return Cache(planes, aux, kv)


def config(transport: str, **overrides) -> EndpointConfig:
    timeouts = overrides.pop("timeouts", Timeouts(bootstrap=10, waiting=10, transfer=10, parked=10))
    return EndpointConfig(transport=transport, timeouts=timeouts, **overrides)


@dataclass
class Pair:
    prefill: PrefillEndpoint
    decode: DecodeEndpoint
    src: Cache
    dst: Cache
    rng: random.Random

    def pages(self, n: int, cache: Cache, used: set[int]) -> list[int]:
        """``n`` random, distinct, non-contiguous-in-general pages not in ``used``."""
        free = [p for p in range(cache.kv.geometry.num_blocks) if p not in used]
        chosen = self.rng.sample(free, n)
        used.update(chosen)
        return chosen


@pytest_asyncio.fixture(params=TRANSPORTS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config(request.param)) as prefill, \
            DecodeEndpoint(dst.kv, config=config(request.param)) as decode:
        yield Pair(prefill, decode, src, dst, random.Random(7))
