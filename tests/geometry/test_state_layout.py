"""State tensors of sections and slots of strides: every decode byte comes from the right prefill byte.

A sectioned state tensor (a Gated DeltaNet conv state's ``[Q | K | V]`` channels, Mamba2's
``[x | B | C]``) is sharded section by section; a strided slot lies inside a page shared with the
layer's other states (vLLM's page layout). The properties here rebuild each decode rank's memory from
the runs of every prefill rank over a numpy model of the global state, computed by hand (the
sections are sliced here, not by ``StateTensor.shards``), and check it byte for byte: the slot holds
its shard, each of its bytes is written once, and no other byte of the rank's memory (other slots,
the other states of the page, the page's padding) changes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.geometry import DType, KVGeometry, Layout
from kvproto.geometry.groups import (
    CacheGeometry,
    IncompatibleGroups,
    PagedGroup,
    StateGroup,
    StateTensor,
    check_groups,
    plan_state,
    slot_runs,
    state_writers,
)
from kvproto.geometry.model import GeometryError

TPS = [1, 2, 4]
DTYPES = [DType.BFLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3FN]


def cache(tp: int, rank: int, group: StateGroup) -> CacheGeometry:
    kv = KVGeometry(tp_size=tp, tp_rank=rank, num_layers=1, num_kv_heads=8, head_dim=8, dtype=DType.BFLOAT16,
                    block_size=16, layout=Layout.NHD, mla=False, num_blocks=8)
    return CacheGeometry(tp, rank, (PagedGroup("kv", kv), group))


def local_part(a: np.ndarray, t: StateTensor, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s part of the global bytes ``a`` (shape ``(*t.shape, itemsize)``): per section
    along the sharded dimension, its ``rank``-th of ``tp`` equal pieces, side by side."""
    if t.shard_dim is None:
        return a
    sizes = t.sections or (t.shape[t.shard_dim],)
    parts, start = [], 0
    for size in sizes:
        n = size // tp
        parts.append(np.take(a, np.arange(start + rank * n, start + (rank + 1) * n), axis=t.shard_dim))
        start += size
    return np.concatenate(parts, axis=t.shard_dim)


class Memory:
    """One rank's memory of a state group: one flat byte buffer, and each (layer, tensor) region's
    base in it. ``layout``: "packed" (a region per (layer, tensor), slots back to back), "strided"
    (the same, slots ``stride`` apart with garbage between) or "page" (vLLM: one page per (layer,
    slot) holding every tensor of the layer at its offset, then padding; regions interleave)."""

    def __init__(self, group: StateGroup, tp: int, layout: str, pad: list[int], rng: np.random.Generator) -> None:
        sizes = group.slot_bytes(tp)
        slots, n_t = group.num_slots, len(group.tensors)
        self.bases: list[int] = []
        if layout == "page":
            offsets = list(np.cumsum([0] + sizes[:-1]))
            page = sum(sizes) + pad[0]
            self.strides = [page] * n_t
            for layer in range(group.num_layers):
                self.bases += [layer * slots * page + int(o) for o in offsets]
            total = group.num_layers * slots * page
        else:
            self.strides = [s + (p if layout == "strided" else 0) for s, p in zip(sizes, pad)]
            at = 0
            for _layer in range(group.num_layers):
                for t in range(n_t):
                    self.bases.append(at)
                    at += slots * self.strides[t]
            total = at
        self.buf = rng.integers(0, 256, size=total, dtype=np.uint8)
        self.sizes = sizes
        self.n_t = n_t

    def slot(self, region: int, slot: int) -> slice:
        at = self.bases[region] + slot * self.strides[region % self.n_t]
        return slice(at, at + self.sizes[region % self.n_t])


def group_with(group: StateGroup, memory: Memory) -> StateGroup:
    """``group`` as this memory's rank describes it: its slot strides."""
    return StateGroup(group.name, group.num_layers, group.tensors, group.num_slots, tuple(memory.strides))


@st.composite
def sectioned_groups(draw: st.DrawFn) -> StateGroup:
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        dims = draw(st.integers(1, 3))
        shard = draw(st.one_of(st.none(), st.integers(0, dims - 1)))
        shape = [draw(st.integers(1, 4)) for _ in range(dims)]
        sections: tuple[int, ...] = ()
        if shard is not None:  # 1-3 sections, each splitting over TP 1, 2 and 4
            sections = tuple(4 * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
            shape[shard] = sum(sections)
        tensors.append(StateTensor(tuple(shape), draw(st.sampled_from(DTYPES)), shard, sections))
    return StateGroup("s", draw(st.integers(1, 3)), tuple(tensors), draw(st.integers(1, 4)))


def move(group: StateGroup, p_tp: int, d_tp: int, p_layout: str, d_layout: str, src_slot: int, dst_slot: int,
         seed: int, pads: tuple[list[int], list[int]]) -> None:
    """Every decode rank's slot rebuilt from every prefill rank's runs, checked against the model."""
    rng = np.random.default_rng(seed)
    n_t = len(group.tensors)
    glob = [rng.integers(0, 256, size=(*t.shape, t.dtype.itemsize), dtype=np.uint8)
            for _layer in range(group.num_layers) for t in group.tensors]
    src = []
    for p in range(p_tp):
        mem = Memory(group, p_tp, p_layout, pads[0], rng)
        for region, a in enumerate(glob):
            mem.buf[mem.slot(region, src_slot)] = local_part(a, group.tensors[region % n_t], p_tp, p).reshape(-1)
        src.append(mem)
    for d in range(d_tp):
        dst = Memory(group, d_tp, d_layout, pads[1], rng)
        before = dst.buf.copy()
        hits = np.zeros(len(dst.buf), dtype=np.int32)
        d_cache = cache(d_tp, d, group_with(group, dst))
        writers = []
        for p, mem in enumerate(src):
            p_cache = cache(p_tp, p, group_with(group, mem))
            runs = plan_state(p_cache, d_cache, "s")
            if runs:
                writers.append(p)
            p_group, d_group = p_cache.groups[1], d_cache.groups[1]
            assert isinstance(p_group, StateGroup) and isinstance(d_group, StateGroup)
            # the prefill places the runs from the two sides' strides (the decode's learnt at registration)
            for r in slot_runs(runs, src_slot, dst_slot, p_group.strides(p_tp), d_group.strides(d_tp), n_t):
                s_at = mem.bases[r.region] + r.src
                d_at = dst.bases[r.region] + r.dst
                assert mem.slot(r.region, src_slot).start <= s_at and s_at + r.length <= mem.slot(r.region, src_slot).stop
                dst.buf[d_at:d_at + r.length] = mem.buf[s_at:s_at + r.length]
                hits[d_at:d_at + r.length] += 1
        assert tuple(writers) == state_writers(p_tp, d_cache, group), (writers, d)
        mine = np.zeros(len(dst.buf), dtype=bool)
        for region, a in enumerate(glob):
            where = dst.slot(region, dst_slot)
            want = local_part(a, group.tensors[region % n_t], d_tp, d).reshape(-1)
            assert np.array_equal(dst.buf[where], want), (region, d)
            assert (hits[where] == 1).all(), (region, d)
            mine[where] = True
        assert not hits[~mine].any() and np.array_equal(dst.buf[~mine], before[~mine]), d


LAYOUTS = ["packed", "strided", "page"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sectioned_groups(), st.sampled_from(TPS), st.sampled_from(TPS), st.sampled_from(LAYOUTS),
       st.sampled_from(LAYOUTS), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**32 - 1),
       st.lists(st.integers(0, 40), min_size=3, max_size=3), st.lists(st.integers(0, 40), min_size=3, max_size=3))
def test_state_layout_every_decode_byte_comes_from_its_prefill_byte(
        group: StateGroup, p_tp: int, d_tp: int, p_layout: str, d_layout: str, src_slot: int, dst_slot: int,
        seed: int, p_pad: list[int], d_pad: list[int]) -> None:
    """Random sectioned, sharded and replicated tensors, TP 1, 2, 4 both ways, each side's slots
    packed, strided or in vLLM pages (strides differing between the sides): every decode rank's slot
    holds its sections' shards, each byte written once by a rank ``state_writers`` names, and no other
    byte of its memory changes."""
    move(group, p_tp, d_tp, p_layout, d_layout, src_slot % group.num_slots, dst_slot % group.num_slots, seed,
         (p_pad, d_pad))


KEY, VALUE, KERNEL = 8, 16, 4  # a GDN layer: key_dim, value_dim (global), conv kernel 4 (3 columns kept)


def gdn_group(conv: str, slots: int = 3, layers: int = 2) -> StateGroup:
    """A Gated DeltaNet layer's states: the conv state [Q | K | V] channel-major ("DS": (conv_dim,
    kernel - 1)) or channel-minor ("SD": (kernel - 1, conv_dim)), and the temporal state sharded on
    its heads (8 heads of 4 x 6)."""
    dim = 2 * KEY + VALUE
    conv_t = StateTensor((dim, KERNEL - 1), DType.BFLOAT16, 0, (KEY, KEY, VALUE)) if conv == "DS" else \
        StateTensor((KERNEL - 1, dim), DType.BFLOAT16, 1, (KEY, KEY, VALUE))
    return StateGroup("s", layers, (conv_t, StateTensor((8, 4, 6), DType.FLOAT32, 0)), slots)


@pytest.mark.parametrize("conv", ["DS", "SD"])
@pytest.mark.parametrize("p_tp", TPS)
@pytest.mark.parametrize("d_tp", TPS)
def test_state_layout_gdn_conv_sections_in_vllm_pages(conv: str, p_tp: int, d_tp: int) -> None:
    """A GDN layer's conv state [Q | K | V] (both layouts) and temporal state in vLLM pages of
    different paddings on the two sides: decode rank d's conv slot is [Q_d | K_d | V_d], built here
    from Q, K and V themselves, and its temporal state the heads it holds."""
    group = gdn_group(conv)
    rng = np.random.default_rng(7)
    # the model: per layer, Q, K and V with channels on axis 0, and the temporal state
    qkv = [[rng.integers(0, 256, size=(n, KERNEL - 1, 2), dtype=np.uint8) for n in (KEY, KEY, VALUE)]
           for _ in range(group.num_layers)]
    ssm = [rng.integers(0, 256, size=(8, 4, 6, 4), dtype=np.uint8) for _ in range(group.num_layers)]

    def conv_of(parts: list[np.ndarray]) -> np.ndarray:  # channel-major, or channel-minor
        joined = np.concatenate(parts, axis=0)
        return joined if conv == "DS" else joined.transpose(1, 0, 2)

    def share(a: np.ndarray, tp: int, rank: int) -> np.ndarray:
        n = len(a) // tp
        return a[rank * n:(rank + 1) * n]

    src_slot, dst_slot = 2, 1
    src = []
    for p in range(p_tp):
        mem = Memory(group, p_tp, "page", [6, 0, 0], rng)
        for layer in range(group.num_layers):
            mem.buf[mem.slot(2 * layer, src_slot)] = conv_of([share(x, p_tp, p) for x in qkv[layer]]).reshape(-1)
            mem.buf[mem.slot(2 * layer + 1, src_slot)] = share(ssm[layer], p_tp, p).reshape(-1)
        src.append(mem)
    for d in range(d_tp):
        dst = Memory(group, d_tp, "page", [42, 0, 0], rng)
        d_cache = cache(d_tp, d, group_with(group, dst))
        for p, mem in enumerate(src):
            p_cache = cache(p_tp, p, group_with(group, mem))
            for r in slot_runs(plan_state(p_cache, d_cache, "s"), src_slot, dst_slot, mem.strides, dst.strides, 2):
                s_at, d_at = mem.bases[r.region] + r.src, dst.bases[r.region] + r.dst
                dst.buf[d_at:d_at + r.length] = mem.buf[s_at:s_at + r.length]
        for layer in range(group.num_layers):
            want = conv_of([share(x, d_tp, d) for x in qkv[layer]]).reshape(-1)
            assert np.array_equal(dst.buf[dst.slot(2 * layer, dst_slot)], want), (layer, d)
            assert np.array_equal(dst.buf[dst.slot(2 * layer + 1, dst_slot)], share(ssm[layer], d_tp, d).reshape(-1))


def test_state_layout_sectioned_runs_per_section_and_row() -> None:
    """TP 1 -> 2, decode rank 1: a channel-major conv state's share is one run per section (three);
    channel-minor, one per section and kernel row (nine); same TP, each layer's slot is one run."""
    for conv, want in (("DS", 3), ("SD", 9)):
        group = gdn_group(conv, layers=1)
        runs = plan_state(cache(1, 0, group), cache(2, 1, group), "s")
        assert len([r for r in runs if r.region == 0]) == want, conv
    group = gdn_group("SD", layers=1)
    assert [r.length for r in plan_state(cache(2, 1, group), cache(2, 1, group), "s")] == [
        (KERNEL - 1) * (2 * KEY + VALUE) // 2 * 2, 4 * 4 * 6 * 4]  # bf16 conv share, fp32 heads


def test_state_layout_sections_are_model_and_strides_are_memory() -> None:
    """Sections must agree (a mismatch names the group and the tensor); one section equals none;
    strides and slot counts may differ between the sides; a stride shorter than its slot, sections
    that do not add up or do not split are refused."""
    a = gdn_group("DS")
    flat = StateGroup("s", a.num_layers, (StateTensor((2 * KEY + VALUE, KERNEL - 1), DType.BFLOAT16, 0),
                                          a.tensors[1]), a.num_slots)
    with pytest.raises(IncompatibleGroups, match=r"group 's': tensor 0's sections differ: \(8, 8, 16\) on the "
                                                 r"prefill, one on the decode"):
        check_groups(cache(1, 0, a), cache(2, 0, flat))
    assert StateTensor((32, 3), DType.BFLOAT16, 0, (32,)) == StateTensor((32, 3), DType.BFLOAT16, 0)
    strided = StateGroup("s", a.num_layers, a.tensors, 9, (4096, 4096))
    check_groups(cache(1, 0, a), cache(2, 1, strided))
    assert strided.strides(2) == [4096, 4096] and a.strides(2) == a.slot_bytes(2)
    assert strided.region_bytes(1) == [8 * 4096 + 32 * 3 * 2, 8 * 4096 + 8 * 4 * 6 * 4]
    assert StateGroup("s", 1, a.tensors, 2, (0, 0)).slot_strides == ()  # all default: none
    with pytest.raises(GeometryError, match="would overlap"):
        cache(1, 0, StateGroup("s", 1, a.tensors, 2, (100, 0)))
    with pytest.raises(GeometryError, match="do not add up"):
        StateTensor((32, 3), DType.BFLOAT16, 0, (8, 8))
    with pytest.raises(GeometryError, match="replicated"):
        StateTensor((32, 3), DType.BFLOAT16, None, (16, 16))
    with pytest.raises(GeometryError, match=r"section of size 6\) does not split over TP 4"):
        cache(4, 0, StateGroup("s", 1, (StateTensor((16, 3), DType.BFLOAT16, 0, (6, 10)),), 1))
    assert math.prod(a.tensors[0].local_shape(4)) == (2 * KEY + VALUE) // 4 * (KERNEL - 1)
