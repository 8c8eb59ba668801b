"""Reference model of a P/D KV transfer, written independently of ``kvproto.geometry.plan``.

Every rank's cache is one ``bytearray`` holding all regions back to back (region ``r`` =
``layer * planes + plane``). Each element of a request token carries bytes derived from its
identity (layer, plane, global head, token, dim), so a misplaced byte shows up as a wrong
value. Slots the request does not own hold seeded random garbage. Head ownership follows the
rules of ``kvproto.geometry.model``'s docstring, re-derived here from first principles.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

NHD = "NHD"
HND = "HND"
_MIX = 0x9E3779B97F4A7C15  # odd, so multiplying is a bijection modulo any power of two
_MAX_TOKENS = 1 << 10


@dataclass(frozen=True)
class Model:
    """What both sides must agree on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    mla: bool

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2


@dataclass(frozen=True)
class Cluster:
    """One side's serving setup: every rank of it shares these and one page table."""

    tp_size: int
    block_size: int
    layout: str
    num_blocks: int


def rank_heads(model: Model, tp_size: int, rank: int) -> list[int]:
    """Global heads (0 for the MLA latent) that ``rank`` of a TP ``tp_size`` cluster holds."""
    if model.mla:
        return [0]
    per_rank = model.num_kv_heads / tp_size
    if per_rank >= 1:
        count = int(per_rank)
        return list(range(rank * count, (rank + 1) * count))
    ranks_per_head = tp_size // model.num_kv_heads
    return [rank // ranks_per_head]


def expected_writers(model: Model, prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[int, ...]:
    """The prefill ranks that must write ``decode_rank``, by the documented replica rule."""
    if model.mla:
        return (decode_rank % prefill_tp,)
    result = set()
    for head in rank_heads(model, decode_tp, decode_rank):
        holders = [r for r in range(prefill_tp) if head in rank_heads(model, prefill_tp, r)]
        result.add(holders[decode_rank % len(holders)])
    return tuple(sorted(result))


def element(model: Model, layer: int, plane: int, head: int, token: int, dim: int) -> bytes:
    """The bytes of one element, unique per identity while the identity fits the item size."""
    ident = (((layer * model.planes + plane) * 8 + head) * _MAX_TOKENS + token) * model.head_dim + dim
    bits = 8 * model.itemsize
    value = ((ident + 1) * _MIX) & ((1 << bits) - 1)
    return value.to_bytes(model.itemsize, "little")


@functools.cache
def head_vector(model: Model, layer: int, plane: int, head: int, token: int) -> bytes:
    return b"".join(element(model, layer, plane, head, token, i) for i in range(model.head_dim))


class RankCache:
    """One rank's whole cache plus the arithmetic to find a (region, page, slot, head)."""

    def __init__(self, model: Model, cluster: Cluster, rank: int, rng: random.Random) -> None:
        self.model = model
        self.cluster = cluster
        self.heads = rank_heads(model, cluster.tp_size, rank)
        self.cell = model.head_dim * model.itemsize
        self.page_bytes = cluster.block_size * len(self.heads) * self.cell
        self.region_bytes = cluster.num_blocks * self.page_bytes
        self.num_regions = model.num_layers * model.planes
        self.data = bytearray(rng.randbytes(self.num_regions * self.region_bytes))

    def region_base(self, region: int) -> int:
        return region * self.region_bytes

    def offset(self, region: int, page: int, slot: int, local_head: int) -> int:
        """Absolute offset of a head vector inside ``data``."""
        block, heads = self.cluster.block_size, len(self.heads)
        if self.cluster.layout == NHD:
            cell_index = slot * heads + local_head
        else:
            cell_index = local_head * block + slot
        return self.region_base(region) + page * self.page_bytes + cell_index * self.cell

    def cells(self, pages: list[int], start: int, end: int):
        """Yield (offset, layer, plane, global head, token) of every cell of tokens [start, end)."""
        block = self.cluster.block_size
        for layer in range(self.model.num_layers):
            for plane in range(self.model.planes):
                region = layer * self.model.planes + plane
                for token in range(start, end):
                    page, slot = pages[token // block], token % block
                    for local, head in enumerate(self.heads):
                        yield self.offset(region, page, slot, local), layer, plane, head, token


def prefill_cache(
    model: Model, cluster: Cluster, rank: int, pages: list[int], num_tokens: int, rng: random.Random
) -> RankCache:
    """A prefill rank after computing the request's tokens ``[0, num_tokens)`` into ``pages``."""
    cache = RankCache(model, cluster, rank, rng)
    for off, layer, plane, head, token in cache.cells(pages, 0, num_tokens):
        vector = head_vector(model, layer, plane, head, token)
        cache.data[off : off + len(vector)] = vector
    return cache


def expected_decode(
    cache: RankCache, pages: list[int], start: int, end: int, whole_pages_allowed: bool
) -> tuple[bytes, bytearray]:
    """(expected bytes, care mask) of a decode cache after receiving tokens ``[start, end)``.

    Bytes with mask 0 may hold anything: with ``whole_pages_allowed`` these are the slots
    outside ``[start, end)`` of the pages that hold tokens of that range.
    """
    expected = bytearray(cache.data)
    care = bytearray(b"\x01" * len(expected))
    if whole_pages_allowed and start < end:
        block = cache.cluster.block_size
        for index in range(start // block, (end - 1) // block + 1):
            for region in range(cache.num_regions):
                base = cache.region_base(region) + pages[index] * cache.page_bytes
                care[base : base + cache.page_bytes] = bytes(cache.page_bytes)
    for off, layer, plane, head, token in cache.cells(pages, start, end):
        vector = head_vector(cache.model, layer, plane, head, token)
        expected[off : off + len(vector)] = vector
        care[off : off + len(vector)] = b"\x01" * len(vector)
    return bytes(expected), care


def differences(actual: bytes | bytearray, expected: bytes, care: bytearray) -> np.ndarray:
    """Indices of the cared-for bytes where ``actual`` and ``expected`` differ."""
    a = np.frombuffer(bytes(actual), dtype=np.uint8)
    e = np.frombuffer(expected, dtype=np.uint8)
    c = np.frombuffer(bytes(care), dtype=np.uint8).astype(bool)
    return np.flatnonzero((a != e) & c)
