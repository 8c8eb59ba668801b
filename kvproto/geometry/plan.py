"""Which heads and which tokens move from one prefill rank to one decode rank, as byte extents.

Theory of operation
-------------------
Prefill pushes KV into decode memory. For one request, every decode rank ``d`` must receive,
for every region (layer, plane), the tokens it does not already hold of every head it holds
(:func:`heads_needed`). This module decides who sends what; it never touches memory.

*Compatibility.* Both sides must agree on the model: ``mla``, ``dtype``, ``head_dim``,
``num_layers`` and ``num_kv_heads`` (:func:`check_compatible`). Tensor-parallel size, block
size, layout and pool size may differ freely.

*Pairing and writers.* Prefill rank ``p`` is *paired* with decode rank ``d`` when it holds a
head ``d`` needs (MLA: every pair). Each head ``d`` needs is written by exactly one prefill
rank, its *writer*. A head held by one prefill rank is written by that rank; a head
replicated over ``R`` prefill ranks (prefill TP > KV heads) is written by replica
``d.tp_rank % R`` of its holders, so decode ranks spread over the replicas. Under MLA the
latent is on every prefill rank and ``d`` is written by prefill rank
``d.tp_rank % prefill.tp_size``. The rules read only geometry, so both sides compute the same
answer without talking; a paired rank that is not a writer sends nothing and its caller
counts it as done.

*Plans and extents.* :func:`plan_pair` fixes the global heads ``[head_start, head_start +
head_count)`` a writer moves: the heads both ranks hold, a contiguous range. An :class:`Extent`
is a byte run inside one region; the same pattern applies to every region, since region
``r`` of the source maps to region ``r`` of the destination. :meth:`PairPlan.extents` walks
the token range in *token runs*: maximal spans whose source page and destination page are
both fixed. Inside a run the moved bytes form a grid of tokens x heads of ``head_bytes``
cells; whichever axis is contiguous on both sides becomes one extent per row, and
:func:`merge_runs` then joins consecutive extents that abut on both sides.

*Direct mode.* When block size and layout agree (one local head on both sides makes NHD and
HND the same bytes) and the moved heads are every local head of both ranks, source page
``i`` and destination page ``i`` are byte-identical images, so whole pages move: every page
the token range touches, including the slots past ``end_token`` in the last page. Those
slots are don't-care bytes of a page the request owns; a later chunk that reaches into the
same page rewrites it whole, so a caller posts one room's chunks to a decode rank in order,
each after the previous one's writes to that rank completed.

Invariants (property-tested against an independent reference model):

* the writers of ``d`` cover ``heads_needed(d)``, each head exactly once;
* a sliced plan's extents cover each (token, moved head) of ``[start_token, end_token)``
  exactly once and nothing else; a direct plan's cover exactly the touched pages;
* extents never overlap on the destination, stay inside the region, and come in token order;
* no two consecutive extents abut on both sides (they would have been merged).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvproto.geometry.model import KVGeometry, Layout, pages_for_tokens

# Checked in this order, so an MLA/MHA mix is reported as ``mla``, not as a head count.
_MODEL_FIELDS = ("mla", "kv_fused", "dtype", "head_dim", "num_layers", "num_kv_heads")


class IncompatibleGeometry(ValueError):
    """Prefill and decode describe different models: KV cannot move between them."""

    def __init__(self, field: str, prefill_value: object, decode_value: object) -> None:
        self.field = field
        self.prefill_value = prefill_value
        self.decode_value = decode_value
        super().__init__(
            f"prefill and decode disagree on {field}: "
            f"prefill has {_show(prefill_value)}, decode has {_show(decode_value)}"
        )


class TokenCountMismatch(ValueError):
    """A page list's length disagrees with the number of tokens it should hold."""

    def __init__(self, num_tokens: int, block_size: int, num_pages: int) -> None:
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.num_pages = num_pages
        self.expected_pages = pages_for_tokens(num_tokens, block_size)
        super().__init__(
            f"{num_tokens} tokens in blocks of {block_size} fill {self.expected_pages} pages, "
            f"but the page list has {num_pages}"
        )


class PageListError(ValueError):
    """A page list lacks a page the token range needs, or names a page outside the pool."""


def _show(value: object) -> str:
    return value.name if isinstance(value, enum.Enum) else repr(value)


def check_compatible(p: KVGeometry, d: KVGeometry) -> None:
    """Raise :class:`IncompatibleGeometry` unless prefill ``p`` and decode ``d`` share a model."""
    for field in _MODEL_FIELDS:
        prefill_value, decode_value = getattr(p, field), getattr(d, field)
        if prefill_value != decode_value:
            raise IncompatibleGeometry(field, prefill_value, decode_value)


def check_page_count(num_tokens: int, block_size: int, num_pages: int) -> None:
    """Raise :class:`TokenCountMismatch` unless ``num_pages`` pages hold ``num_tokens`` exactly.

    A prompt of exactly ``k`` blocks has ``k`` pages: the sampled token has no KV yet.
    """
    if num_pages != pages_for_tokens(num_tokens, block_size):
        raise TokenCountMismatch(num_tokens, block_size, num_pages)


# --- pairing -----------------------------------------------------------------------------


def heads_needed(d: KVGeometry) -> range:
    """Global heads decode rank ``d`` holds, hence must receive (MLA: the latent, head 0)."""
    return range(d.head_start, d.head_start + d.local_heads)


def _heads_held(g: KVGeometry) -> range:
    return range(g.head_start, g.head_start + g.local_heads)


def _holders(prefill: KVGeometry, head: int) -> range:
    """Prefill ranks holding global ``head`` (not MLA)."""
    if prefill.tp_size <= prefill.num_kv_heads:
        rank = head // prefill.local_heads
        return range(rank, rank + 1)
    replicas = prefill.tp_size // prefill.num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


def paired(p: KVGeometry, d: KVGeometry) -> bool:
    """Whether prefill rank ``p`` holds at least one head decode rank ``d`` needs."""
    check_compatible(p, d)
    if d.mla:
        return True
    held, needed = _heads_held(p), heads_needed(d)
    return held.start < needed.stop and needed.start < held.stop


def writers(prefill: KVGeometry, d: KVGeometry) -> tuple[int, ...]:
    """Sorted prefill ranks that write into decode rank ``d``; ``prefill.tp_rank`` is ignored."""
    check_compatible(prefill, d)
    if d.mla:
        return (d.tp_rank % prefill.tp_size,)
    chosen: set[int] = set()
    for head in heads_needed(d):
        holders = _holders(prefill, head)
        chosen.add(holders[d.tp_rank % len(holders)])
    return tuple(sorted(chosen))


def paired_ranks_of_prefill(p: KVGeometry, decode: KVGeometry) -> tuple[int, ...]:
    """Decode ranks paired with prefill rank ``p``; ``decode.tp_rank`` is ignored."""
    return tuple(r for r in range(decode.tp_size) if paired(p, decode.with_rank(r)))


def paired_ranks_of_decode(prefill: KVGeometry, d: KVGeometry) -> tuple[int, ...]:
    """Prefill ranks paired with decode rank ``d``; ``prefill.tp_rank`` is ignored."""
    return tuple(r for r in range(prefill.tp_size) if paired(prefill.with_rank(r), d))


def write_targets(p: KVGeometry, decode: KVGeometry) -> tuple[int, ...]:
    """Decode ranks prefill rank ``p`` writes into; ``decode.tp_rank`` is ignored."""
    return tuple(
        r for r in range(decode.tp_size) if p.tp_rank in writers(p, decode.with_rank(r))
    )


# --- extents -----------------------------------------------------------------------------


class Extent(NamedTuple):
    """``length`` bytes at ``src_offset`` copied to ``dst_offset``, offsets inside one region."""

    src_offset: int
    dst_offset: int
    length: int


def merge_runs(extents: Iterable[Extent]) -> list[Extent]:
    """Join consecutive extents that abut on both sides, keeping their order."""
    out: list[Extent] = []
    for e in extents:
        if out:
            last = out[-1]
            size = last.length
            if last.src_offset + size == e.src_offset and last.dst_offset + size == e.dst_offset:
                out[-1] = Extent(last.src_offset, last.dst_offset, size + e.length)
                continue
        out.append(e)
    return out


def expand_regions(
    extents: Sequence[Extent], src_bases: Sequence[int], dst_bases: Sequence[int]
) -> list[Extent]:
    """Apply a per-region pattern to every region, as absolute offsets, merged across regions.

    ``src_bases[r]`` and ``dst_bases[r]`` are where region ``r`` starts on each side (device
    addresses, or offsets in one buffer); the result's offsets are in that same space. Regions
    laid out back to back on both sides can merge into fewer descriptors than regions.
    """
    if len(src_bases) != len(dst_bases):
        raise ValueError(f"{len(src_bases)} source regions but {len(dst_bases)} destination regions")
    return merge_runs(
        Extent(s_base + e.src_offset, d_base + e.dst_offset, e.length)
        for s_base, d_base in zip(src_bases, dst_bases)
        for e in extents
    )


def _strides(g: KVGeometry) -> tuple[int, int]:
    """(token stride, head stride) in bytes inside one page of ``g``."""
    if g.layout is Layout.NHD:
        return g.token_bytes, g.head_bytes
    return g.head_bytes, g.block_size * g.head_bytes


def _check_pages(side: str, pages: Sequence[int], g: KVGeometry, start: int, end: int) -> None:
    first, last = start // g.block_size, (end - 1) // g.block_size
    if last >= len(pages):
        raise PageListError(
            f"{side} page list has {len(pages)} pages, but tokens [{start}, {end}) "
            f"in blocks of {g.block_size} need page index {last}"
        )
    for index in range(first, last + 1):
        page = pages[index]
        if not 0 <= page < g.num_blocks:
            raise PageListError(
                f"{side} page {page} at index {index} is outside the pool [0, {g.num_blocks})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class PairPlan:
    """What one writer moves into one decode rank; build it with :func:`plan_pair`.

    ``head_start``/``head_count`` are the moved global heads; ``src_head_offset`` and
    ``dst_head_offset`` are the local index of the first of them on each side. ``direct``
    means whole pages move (see the module docstring).
    """

    src: KVGeometry
    dst: KVGeometry
    head_start: int
    head_count: int
    src_head_offset: int
    dst_head_offset: int
    direct: bool

    def extents(
        self,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        start_token: int,
        end_token: int,
    ) -> list[Extent]:
        """Extents moving request tokens ``[start_token, end_token)``, in token order, merged.

        ``src_pages[i]`` holds request tokens ``[i*Bp, (i+1)*Bp)`` on prefill and
        ``dst_pages[j]`` tokens ``[j*Bd, (j+1)*Bd)`` on decode. Lists may be longer than the
        range needs; a missing or out-of-pool page raises :class:`PageListError`.
        """
        if not 0 <= start_token <= end_token:
            raise ValueError(f"bad token range [{start_token}, {end_token})")
        if start_token == end_token:
            return []
        _check_pages("source", src_pages, self.src, start_token, end_token)
        _check_pages("destination", dst_pages, self.dst, start_token, end_token)
        if self.direct:
            size = self.src.page_bytes
            block = self.src.block_size
            return merge_runs(
                Extent(src_pages[i] * size, dst_pages[i] * size, size)
                for i in range(start_token // block, (end_token - 1) // block + 1)
            )
        return merge_runs(self._sliced(src_pages, dst_pages, start_token, end_token))

    def _sliced(
        self, src_pages: Sequence[int], dst_pages: Sequence[int], start: int, end: int
    ) -> list[Extent]:
        src, dst = self.src, self.dst
        cell, heads = src.head_bytes, self.head_count
        s_tok, s_head = _strides(src)
        d_tok, d_head = _strides(dst)
        s_block, d_block = src.block_size, dst.block_size
        s_page, d_page = src.page_bytes, dst.page_bytes
        s_first_head = self.src_head_offset * s_head
        d_first_head = self.dst_head_offset * d_head
        # Axis contiguity is fixed per plan; only a run's token count n varies.
        heads_are_row = heads == 1 or (s_head == cell and d_head == cell)
        tokens_are_row = s_tok == cell and d_tok == cell
        out: list[Extent] = []
        t = start
        while t < end:
            s_index, s_slot = divmod(t, s_block)
            d_index, d_slot = divmod(t, d_block)
            n = min(end - t, s_block - s_slot, d_block - d_slot)
            s0 = src_pages[s_index] * s_page + s_slot * s_tok + s_first_head
            d0 = dst_pages[d_index] * d_page + d_slot * d_tok + d_first_head
            t += n
            if heads_are_row:
                # One row per token: the moved heads of a token are contiguous on both sides.
                row = heads * cell
                if n == 1 or (s_tok == row and d_tok == row):
                    out.append(Extent(s0, d0, n * row))
                else:
                    out.extend(Extent(s0 + k * s_tok, d0 + k * d_tok, row) for k in range(n))
            elif tokens_are_row:
                # One row per head: the run's tokens of a head are contiguous on both sides.
                row = n * cell
                out.extend(Extent(s0 + h * s_head, d0 + h * d_head, row) for h in range(heads))
            else:
                # Layouts cross: only single (token, head) cells are contiguous on both sides.
                out.extend(
                    Extent(s0 + k * s_tok + h * s_head, d0 + k * d_tok + h * d_head, cell)
                    for k in range(n)
                    for h in range(heads)
                )
        return out


def plan_pair(p: KVGeometry, d: KVGeometry) -> PairPlan:
    """The plan for writer ``p`` into decode rank ``d``; ValueError if ``p`` does not write ``d``."""
    chosen = writers(p, d)
    if p.tp_rank not in chosen:
        raise ValueError(
            f"prefill rank {p.tp_rank} does not write decode rank {d.tp_rank}; "
            f"its writers are {chosen}"
        )
    if d.mla:
        head_start, head_count = 0, 1
    else:
        held, needed = _heads_held(p), heads_needed(d)
        head_start = max(held.start, needed.start)
        head_count = min(held.stop, needed.stop) - head_start
    same_bytes_per_page = p.layout is d.layout or (p.local_heads == 1 and d.local_heads == 1)
    direct = (
        p.block_size == d.block_size
        and same_bytes_per_page
        and head_count == p.local_heads == d.local_heads
    )
    return PairPlan(
        src=p,
        dst=d,
        head_start=head_start,
        head_count=head_count,
        src_head_offset=head_start - p.head_start,
        dst_head_offset=head_start - d.head_start,
        direct=direct,
    )
