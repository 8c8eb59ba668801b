"""Hybrid caches as groups: state plans across TP (both directions) against a numpy model of the
global state, sliding-window token ranges, and group compatibility naming the group."""

from __future__ import annotations

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
    window_pages,
    window_tokens,
)
from kvproto.geometry.model import GeometryError

TPS = [1, 2, 4]


def kv(tp: int, rank: int, *, heads: int = 8, block: int = 16, layout: Layout = Layout.NHD, layers: int = 2,
       mla: bool = False) -> KVGeometry:
    return KVGeometry(tp_size=tp, tp_rank=rank, num_layers=layers, num_kv_heads=1 if mla else heads, head_dim=64,
                      dtype=DType.BFLOAT16, block_size=block, layout=layout, mla=mla, num_blocks=64)


def gdn_state(tp: int, rank: int, slots: int = 4, layers: int = 3) -> CacheGeometry:
    """A Gated DeltaNet hybrid: 3 linear-attention layers (conv state sharded over channels,
    temporal state sharded over heads) per full-attention layer."""
    state = StateGroup("gdn", layers, (StateTensor((64, 3), DType.BFLOAT16, 0), StateTensor((8, 16, 16), DType.FLOAT32, 0)),
                       slots)
    return CacheGeometry(tp, rank, (PagedGroup("full", kv(tp, rank, layers=1)), state))


@st.composite
def state_cases(draw: st.DrawFn) -> tuple[StateGroup, int, int]:
    p_tp, d_tp = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        dims = draw(st.integers(1, 3))
        shard = draw(st.one_of(st.none(), st.integers(0, dims - 1)))
        shape = [draw(st.integers(1, 5)) for _ in range(dims)]
        if shard is not None:
            shape[shard] = 4 * draw(st.integers(1, 3))  # splits over TP 1, 2 and 4
        tensors.append(StateTensor(tuple(shape), draw(st.sampled_from([DType.BFLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3FN])), shard))
    group = StateGroup("s", draw(st.integers(1, 3)), tuple(tensors), draw(st.integers(1, 4)))
    return group, p_tp, d_tp


def shard_of(a: np.ndarray, t: StateTensor, tp: int, rank: int) -> np.ndarray:
    if t.shard_dim is None:
        return a
    r = t.shard(tp, rank)
    return np.take(a, np.arange(r.start, r.stop), axis=t.shard_dim)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_cases(), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_state_plans_move_every_decode_shard_exactly_once(case: tuple[StateGroup, int, int], src_slot: int,
                                                         dst_slot: int, seed: int) -> None:
    """For random state tensors, TP pairs (both directions) and slots, the runs of every writer
    rebuild each decode rank's shard of the global state in its slot byte-exact, write each of its
    bytes once, touch no other slot, and come only from the ranks ``state_writers`` names."""
    group, p_tp, d_tp = case
    src_slot, dst_slot = src_slot % group.num_slots, dst_slot % group.num_slots
    rng = np.random.default_rng(seed)
    n_t = len(group.tensors)
    # the global state of one request: per (layer, tensor), bytes viewed with the tensor's shape
    glob = [rng.integers(0, 256, size=(*t.shape, t.dtype.itemsize), dtype=np.uint8)
            for _layer in range(group.num_layers) for t in group.tensors]
    prefill = [with_state(p_tp, r, group) for r in range(p_tp)]
    src_bytes = group.slot_bytes(p_tp)
    dst_bytes = group.slot_bytes(d_tp)
    src_mem = []
    for r in range(p_tp):
        regions = []
        for region, a in enumerate(glob):
            t = group.tensors[region % n_t]
            buf = rng.integers(0, 256, size=group.num_slots * src_bytes[region % n_t], dtype=np.uint8)
            local = shard_of(a, t, p_tp, r).reshape(-1)
            buf[src_slot * src_bytes[region % n_t]:(src_slot + 1) * src_bytes[region % n_t]] = local
            regions.append(buf)
        src_mem.append(regions)
    for d in range(d_tp):
        decode = with_state(d_tp, d, group)
        dst = [np.zeros(group.num_slots * dst_bytes[i % n_t], dtype=np.uint8) for i in range(len(glob))]
        hits = [np.zeros_like(b, dtype=np.int32) for b in dst]
        writers = []
        for p in range(p_tp):
            runs = plan_state(prefill[p], decode, "s")
            if runs:
                writers.append(p)
            for r in slot_runs(runs, src_slot, dst_slot, src_bytes, dst_bytes, n_t):
                dst[r.region][r.dst:r.dst + r.length] = src_mem[p][r.region][r.src:r.src + r.length]
                hits[r.region][r.dst:r.dst + r.length] += 1
        assert tuple(writers) == state_writers(p_tp, decode, group)
        for region, a in enumerate(glob):
            t = group.tensors[region % n_t]
            lo, hi = dst_slot * dst_bytes[region % n_t], (dst_slot + 1) * dst_bytes[region % n_t]
            assert np.array_equal(dst[region][lo:hi], shard_of(a, t, d_tp, d).reshape(-1)), (region, d)
            assert (hits[region][lo:hi] == 1).all() and hits[region].sum() == hi - lo


def test_state_runs_merge_whole_rows() -> None:
    """Sharded along dimension 0, a TP 2 -> 1 writer's half is one run; along the last dimension
    of a (4, 8) tensor it is one run per row."""
    t0 = StateGroup("a", 1, (StateTensor((8, 4), DType.BFLOAT16, 0),), 1)
    t1 = StateGroup("b", 1, (StateTensor((4, 8), DType.BFLOAT16, 1),), 1)
    for group, want in ((t0, 1), (t1, 4)):
        runs = plan_state(with_state(2, 1, group), with_state(1, 0, group), group.name)
        assert len(runs) == want


def test_replicated_state_is_written_once_per_decode_rank_spread_over_prefill_ranks() -> None:
    """A replicated tensor goes to decode rank d of 4 from prefill rank floor(d * 2 / 4) of 2."""
    group = StateGroup("r", 2, (StateTensor((3, 5), DType.FLOAT32, None),), 2)
    for d in range(4):
        decode = with_state(4, d, group)
        assert state_writers(2, decode, group) == (d // 2,)
        writes = [p for p in range(2) if plan_state(with_state(2, p, group), decode, "r")]
        assert writes == [d // 2]


def with_state(tp: int, rank: int, group: StateGroup, heads: int = 8) -> CacheGeometry:
    return CacheGeometry(tp, rank, (PagedGroup("kv", kv(tp, rank, heads=heads)), group))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_link_roles_every_writer_pairs_and_state_writers_pair_under_the_first_group(
        p_tp: int, d_tp: int, heads: int, other_heads: int, mla: bool) -> None:
    """For every TP pair and two paged groups of different head counts beside a sharded and a
    replicated state tensor: each group of each decode rank is written by its writers, every writer
    pairs, and state writers pair under the first group alone (the union is needed only for paged
    groups of fewer heads)."""
    state = StateGroup("s", 1, (StateTensor((8, 2), DType.BFLOAT16, 0), StateTensor((3,), DType.FLOAT32, None)), 2)

    def cache(tp: int, rank: int) -> CacheGeometry:
        return CacheGeometry(tp, rank, (PagedGroup("kv", kv(tp, rank, heads=heads, mla=mla)),
                                        PagedGroup("idx", kv(tp, rank, heads=other_heads)), state))

    from kvproto.geometry import paired as kv_paired
    from kvproto.geometry.groups import link_roles, paired_ranks_of_decode_cache, paired_ranks_of_prefill_cache

    for d in range(d_tp):
        decode = cache(d_tp, d)
        roles = [link_roles(cache(p_tp, p), decode) for p in range(p_tp)]
        for g in range(3):
            assert any(r.writes[g] for r in roles), (g, d)
        for p, r in enumerate(roles):
            assert r.paired or not r.writer
            if r.writes[2]:
                assert kv_paired(cache(p_tp, p).primary, decode.primary)
        assert paired_ranks_of_decode_cache(cache(p_tp, 0), decode) == tuple(p for p, r in enumerate(roles) if r.paired)
    for p in range(p_tp):
        assert paired_ranks_of_prefill_cache(cache(p_tp, p), cache(d_tp, 0)) == tuple(
            d for d in range(d_tp) if link_roles(cache(p_tp, p), cache(d_tp, d)).paired)


def test_a_group_of_fewer_heads_pairs_ranks_the_first_group_does_not() -> None:
    """Prefill TP 2, decode TP 4: with 8 heads decode rank 1 pairs only with prefill rank 0, but a
    one-head group beside them is written into it by prefill rank 1 (replica rule), which therefore
    pairs too."""
    from kvproto.geometry.groups import link_roles

    def cache(tp: int, rank: int) -> CacheGeometry:
        return CacheGeometry(tp, rank, (PagedGroup("kv", kv(tp, rank, heads=8)), PagedGroup("one", kv(tp, rank, heads=1))))

    roles = link_roles(cache(2, 1), cache(4, 1))
    assert roles.paired and roles.writes == (False, True)


def test_window_tokens_and_pages() -> None:
    assert window_tokens(100, None) == range(0, 100)
    assert window_tokens(100, 32) == range(68, 100)
    assert window_tokens(10, 32) == range(0, 10)
    assert window_pages(100, 32, 16) == range(4, 7)
    assert window_pages(96, 32, 16) == range(4, 6)
    assert window_pages(0, 32, 16) == range(0)


def test_groups_must_match_by_name_kind_and_shape() -> None:
    ok = gdn_state(2, 0), gdn_state(1, 0)
    check_groups(*ok)
    missing = CacheGeometry(1, 0, (PagedGroup("full", kv(1, 0, layers=1)),))
    with pytest.raises(IncompatibleGroups, match="group 'gdn': the prefill has it, the decode does not"):
        check_groups(gdn_state(1, 0), missing)
    with pytest.raises(IncompatibleGroups, match="group 'gdn': the decode has it"):
        check_groups(missing, gdn_state(1, 0))
    other = StateGroup("gdn", 3, (StateTensor((64, 4), DType.BFLOAT16, 0), StateTensor((8, 16, 16), DType.FLOAT32, 0)), 4)
    changed = CacheGeometry(1, 0, (PagedGroup("full", kv(1, 0, layers=1)), other))
    with pytest.raises(IncompatibleGroups, match="group 'gdn': state tensors differ"):
        check_groups(gdn_state(1, 0), changed)
    def with_swa(window: int | None) -> CacheGeometry:
        return CacheGeometry(1, 0, (*gdn_state(1, 0).groups, PagedGroup("swa", kv(1, 0, layers=1), window=window)))

    with pytest.raises(IncompatibleGroups, match="group 'swa': window 64 on the prefill, 128"):
        check_groups(with_swa(64), with_swa(128))
    with pytest.raises(GeometryError, match="first group is paged and keeps every token"):
        CacheGeometry(1, 0, (PagedGroup("full", kv(1, 0, layers=1), window=128),))
    mla = CacheGeometry(1, 0, (PagedGroup("full", kv(1, 0, layers=1, mla=True)), gdn_state(1, 0).groups[1]))
    with pytest.raises(IncompatibleGroups, match="group 'full': .*mla"):
        check_groups(gdn_state(1, 0), mla)


def test_a_state_dimension_that_does_not_split_is_refused() -> None:
    with pytest.raises(GeometryError, match="does not split over TP 4"):
        with_state(4, 1, StateGroup("s", 1, (StateTensor((6, 2), DType.BFLOAT16, 0),), 1))


def test_state_block_is_every_written_state_run_back_to_back() -> None:
    """A pair's state block (staging.md, minor 3): the runs of every state group the prefill rank
    writes into the decode rank, in cache order, back to back; empty where the pair writes no
    state or no first group (it stages nothing)."""
    from kvproto.geometry.groups import block_bytes, state_block

    rows = StateGroup("lin", 24, (StateTensor((16, 128), DType.BFLOAT16, 0),), 4)
    one = state_block(with_state(1, 0, rows), with_state(2, 1, rows))
    assert [(b.group, b.run.region, b.run.src, b.run.dst, b.run.length, b.offset) for b in one[:2]] == [
        (1, 0, 2048, 0, 2048, 0), (1, 1, 2048, 0, 2048, 2048)]
    assert len(one) == 24 and block_bytes(one) == 24 * 2048
    gdn = gdn_state(2, 0)
    both = CacheGeometry(2, 0, (*gdn.groups, StateGroup("r", 1, (StateTensor((3,), DType.FLOAT32, None),), 4)))
    block = state_block(both, both.with_rank(0))
    assert [b.group for b in block] == [1] * 6 + [2]  # gdn's 3 layers x 2 tensors, then the replica
    assert [b.offset for b in block] == list(np.cumsum([0] + [b.run.length for b in block])[:-1])
    assert state_block(both.with_rank(1), both.with_rank(0)) == ()  # rank 1 holds none of rank 0's shards
    assert block_bytes(()) == 0
