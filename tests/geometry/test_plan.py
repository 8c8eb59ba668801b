"""Extent planning between prefill and decode ranks, checked byte for byte against refmodel."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.kernels.pattern import pair_extents
from kvproto.geometry import (
    DType,
    Extent,
    IncompatibleGeometry,
    KVGeometry,
    Layout,
    PageListError,
    PairPlan,
    TokenCountMismatch,
    check_compatible,
    check_page_count,
    expand_regions,
    heads_needed,
    merge_runs,
    pages_for_tokens,
    paired,
    paired_ranks_of_decode,
    paired_ranks_of_prefill,
    plan_pair,
    write_targets,
    writers,
)

from . import refmodel as ref

_DTYPES = {1: DType.UINT8, 2: DType.FLOAT16, 4: DType.FLOAT32}


def geometry(model: ref.Model, cluster: ref.Cluster, rank: int = 0) -> KVGeometry:
    return KVGeometry(
        tp_size=cluster.tp_size,
        tp_rank=rank,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=_DTYPES[model.itemsize],
        block_size=cluster.block_size,
        layout=Layout[cluster.layout],
        mla=model.mla,
        num_blocks=cluster.num_blocks,
    )


@dataclass(frozen=True)
class Scenario:
    """One request moved from a prefill cluster to a decode cluster, chunk by chunk."""

    model: ref.Model
    prefill: ref.Cluster
    decode: ref.Cluster
    num_tokens: int
    src_pages: list[int]
    dst_pages: list[int]
    prefix_blocks: int = 0  # decode blocks already held (prefix cache hit)
    cuts: tuple[int, ...] = ()  # chunk boundaries strictly inside the moved range
    seed: int = 0

    @property
    def start(self) -> int:
        return self.prefix_blocks * self.decode.block_size


@dataclass
class Outcome:
    """What a scenario planned, per decode rank: writers, plans and extents per chunk."""

    writers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    plans: dict[int, list[PairPlan]] = field(default_factory=dict)
    extents: dict[tuple[int, int], list[list[Extent]]] = field(default_factory=dict)


def _check_pattern(extents: list[Extent], plan: PairPlan) -> None:
    """Extents of one plan: in bounds, positive, and not mergeable with their successor."""
    for e in extents:
        assert e.length > 0
        assert 0 <= e.src_offset and e.src_offset + e.length <= plan.src.region_bytes
        assert 0 <= e.dst_offset and e.dst_offset + e.length <= plan.dst.region_bytes
    for a, b in zip(extents, extents[1:]):
        assert not (
            a.src_offset + a.length == b.src_offset and a.dst_offset + a.length == b.dst_offset
        ), f"unmerged neighbours {a} {b}"


def _check_disjoint(extents: list[Extent]) -> None:
    spans = sorted((e.dst_offset, e.dst_offset + e.length) for e in extents)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, f"destination extents overlap at {start}"


def run_scenario(s: Scenario) -> Outcome:
    """Plan and apply every writer pair of ``s``; assert every decode rank matches refmodel."""
    model = s.model
    prefill, decode = geometry(model, s.prefill), geometry(model, s.decode)
    check_page_count(s.num_tokens, s.prefill.block_size, len(s.src_pages))
    check_page_count(s.num_tokens, s.decode.block_size, len(s.dst_pages))
    rng = random.Random(s.seed)
    sources = [
        ref.prefill_cache(model, s.prefill, r, s.src_pages, s.num_tokens, rng)
        for r in range(s.prefill.tp_size)
    ]
    bounds = [s.start, *s.cuts, s.num_tokens]
    chunks = list(zip(bounds, bounds[1:]))
    cell = model.head_dim * model.itemsize
    outcome = Outcome()
    for d in range(s.decode.tp_size):
        dst_geo = decode.with_rank(d)
        sink = ref.RankCache(model, s.decode, d, rng)
        heads = ref.rank_heads(model, s.decode.tp_size, d)
        assert list(heads_needed(dst_geo)) == heads

        chosen = writers(prefill, dst_geo)
        assert chosen == ref.expected_writers(model, s.prefill.tp_size, s.decode.tp_size, d)
        holders = tuple(
            r
            for r in range(s.prefill.tp_size)
            if set(ref.rank_heads(model, s.prefill.tp_size, r)) & set(heads)
        )
        assert paired_ranks_of_decode(prefill, dst_geo) == holders
        assert set(chosen) <= set(holders)
        for idle in set(holders) - set(chosen):
            with pytest.raises(ValueError, match="does not write"):
                plan_pair(prefill.with_rank(idle), dst_geo)

        plans = [plan_pair(prefill.with_rank(w), dst_geo) for w in chosen]
        moved = sorted(h for p in plans for h in range(p.head_start, p.head_start + p.head_count))
        assert moved == heads, "every needed head is written exactly once"
        for w, plan in zip(chosen, plans):
            assert ref.rank_heads(model, s.prefill.tp_size, w)[plan.src_head_offset] == plan.head_start
            assert heads[plan.dst_head_offset] == plan.head_start
        direct = any(p.direct for p in plans)
        assert not direct or len(plans) == 1

        expected, care = ref.expected_decode(sink, s.dst_pages, s.start, s.num_tokens, direct)
        regions = range(sink.num_regions)
        outcome.writers[d], outcome.plans[d] = chosen, plans
        for w, plan in zip(chosen, plans):
            outcome.extents[(w, d)] = []
        for a, b in chunks:
            landed: list[Extent] = []
            for w, plan in zip(chosen, plans):
                pattern = plan.extents(s.src_pages, s.dst_pages, a, b)
                _check_pattern(pattern, plan)
                # the array form the data path posts (kvproto.kernels.pattern) is the same, extent for extent
                assert pair_extents(plan, s.src_pages, s.dst_pages, a, b).tolist() == [list(e) for e in pattern]
                if not plan.direct:
                    assert sum(e.length for e in pattern) == (b - a) * plan.head_count * cell
                outcome.extents[(w, d)].append(pattern)
                landed.extend(pattern)
                source = sources[w]
                for e in expand_regions(
                    pattern,
                    [source.region_base(r) for r in regions],
                    [sink.region_base(r) for r in regions],
                ):
                    sink.data[e.dst_offset : e.dst_offset + e.length] = source.data[
                        e.src_offset : e.src_offset + e.length
                    ]
            _check_disjoint(landed)
        wrong = ref.differences(sink.data, expected, care)
        if wrong.size:
            index = int(wrong[0])
            region, inner = divmod(index, sink.region_bytes)
            page, byte = divmod(inner, sink.page_bytes)
            pytest.fail(
                f"decode rank {d}: {wrong.size} wrong bytes, first in region {region} "
                f"page {page} byte {byte}; plans {plans}"
            )
    return outcome


def scenario(
    *,
    tp: tuple[int, int],
    heads: int = 4,
    blocks: tuple[int, int] = (4, 4),
    layouts: tuple[str, str] = ("NHD", "NHD"),
    num_tokens: int = 23,
    mla: bool = False,
    contiguous: bool = False,
    prefix_blocks: int = 0,
    cuts: tuple[int, ...] = (),
) -> Scenario:
    """A named case: 2 layers, head_dim 2, 2-byte items, shuffled pages unless contiguous."""
    model = ref.Model(num_layers=2, num_kv_heads=1 if mla else heads, head_dim=2, itemsize=2, mla=mla)
    rng = random.Random(7)
    page_lists = []
    for block in blocks:
        count = pages_for_tokens(num_tokens, block)
        pool = count + 5
        page_lists.append(list(range(3, 3 + count)) if contiguous else rng.sample(range(pool), count))
    return Scenario(
        model=model,
        prefill=ref.Cluster(tp[0], blocks[0], layouts[0], len(page_lists[0]) + 5),
        decode=ref.Cluster(tp[1], blocks[1], layouts[1], len(page_lists[1]) + 5),
        num_tokens=num_tokens,
        src_pages=page_lists[0],
        dst_pages=page_lists[1],
        prefix_blocks=prefix_blocks,
        cuts=cuts,
    )


# --- the property ------------------------------------------------------------------------

_BLOCKS = [1, 2, 3, 4, 6, 8, 16]


def _valid_tp(heads: int, mla: bool) -> list[int]:
    if mla:
        return list(range(1, 9))
    return [t for t in range(1, 9) if (t <= heads and heads % t == 0) or (t > heads and t % heads == 0)]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    mla = draw(st.integers(0, 4)) == 0
    heads = 1 if mla else draw(st.integers(1, 8))
    tps = _valid_tp(heads, mla)
    model = ref.Model(
        num_layers=draw(st.integers(1, 2)),
        num_kv_heads=heads,
        head_dim=draw(st.integers(1, 3)),
        itemsize=draw(st.sampled_from([1, 2, 4])),
        mla=mla,
    )
    block_p, block_d = draw(st.sampled_from(_BLOCKS)), draw(st.sampled_from(_BLOCKS))
    shape = draw(st.integers(0, 9))  # 0: empty, 1-3: exact multiple of a block, else any
    if shape == 0:
        num_tokens = 0
    elif shape <= 3:
        num_tokens = draw(st.integers(1, 4)) * draw(st.sampled_from([block_p, block_d]))
    else:
        num_tokens = draw(st.integers(1, 48))
    prefix_blocks = draw(st.integers(0, num_tokens // block_d))
    start = prefix_blocks * block_d
    cuts = ()
    if num_tokens - start >= 2:
        cuts = tuple(sorted(draw(st.sets(st.integers(start + 1, num_tokens - 1), max_size=3))))

    def page_table(block: int) -> tuple[list[int], int]:
        count = pages_for_tokens(num_tokens, block)
        pool = max(1, count + draw(st.integers(0, 4)))
        if draw(st.booleans()):
            first = draw(st.integers(0, pool - count))
            return list(range(first, first + count)), pool
        return draw(st.permutations(range(pool)))[:count], pool

    src_pages, pool_p = page_table(block_p)
    dst_pages, pool_d = page_table(block_d)
    return Scenario(
        model=model,
        prefill=ref.Cluster(draw(st.sampled_from(tps)), block_p, draw(st.sampled_from([ref.NHD, ref.HND])), pool_p),
        decode=ref.Cluster(draw(st.sampled_from(tps)), block_d, draw(st.sampled_from([ref.NHD, ref.HND])), pool_d),
        num_tokens=num_tokens,
        src_pages=src_pages,
        dst_pages=dst_pages,
        prefix_blocks=prefix_blocks,
        cuts=cuts,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_transfer_matches_reference_model(s: Scenario) -> None:
    """Any compatible pair of clusters: every decode rank ends byte-equal to the reference."""
    run_scenario(s)


# --- named transfers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "heads", "expected_writers"),
    [
        ((1, 1), 4, {0: (0,)}),
        ((2, 1), 4, {0: (0, 1)}),
        ((4, 2), 4, {0: (0, 1), 1: (2, 3)}),
        ((1, 2), 4, {0: (0,), 1: (0,)}),
        ((2, 4), 4, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}),
        ((8, 2), 4, {0: (0, 2), 1: (5, 7)}),
        ((2, 4), 2, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}),
    ],
    ids=["P1D1", "P2D1", "P4D2", "P1D2", "P2D4", "P8D2-4heads", "P2D4-2heads"],
)
def test_transfer_tp_pairs(tp: tuple[int, int], heads: int, expected_writers: dict[int, tuple[int, ...]]) -> None:
    """TP mismatch both ways and GQA replication: writers as documented, bytes as reference."""
    outcome = run_scenario(scenario(tp=tp, heads=heads, cuts=(9,)))
    assert outcome.writers == expected_writers


def test_transfer_p1d1_is_direct_and_one_descriptor() -> None:
    """Same TP, block and layout with contiguous pages: one whole-page extent per region."""
    outcome = run_scenario(scenario(tp=(1, 1), num_tokens=23, contiguous=True))
    (plan,) = outcome.plans[0]
    assert plan.direct
    (chunk,) = outcome.extents[(0, 0)]
    assert chunk == [Extent(3 * plan.src.page_bytes, 3 * plan.dst.page_bytes, 6 * plan.src.page_bytes)]


def test_transfer_p8d2_spreads_replicas() -> None:
    """Prefill TP 8 over 4 heads: decode ranks read from different replicas of their heads."""
    outcome = run_scenario(scenario(tp=(8, 2), heads=4))
    assert [(p.head_start, p.src.tp_rank) for p in outcome.plans[0]] == [(0, 0), (1, 2)]
    assert [(p.head_start, p.src.tp_rank) for p in outcome.plans[1]] == [(2, 5), (3, 7)]


@pytest.mark.parametrize(("tp", "expected_writers"), [((2, 1), {0: (0,)}), ((1, 4), {d: (0,) for d in range(4)})])
def test_transfer_mla(tp: tuple[int, int], expected_writers: dict[int, tuple[int, ...]]) -> None:
    """MLA: one prefill rank writes the latent into each decode rank."""
    outcome = run_scenario(scenario(tp=tp, mla=True, cuts=(5, 17)))
    assert outcome.writers == expected_writers
    assert all(plan.direct for plans in outcome.plans.values() for plan in plans)


def test_writers_mla_spreads_over_prefill_ranks() -> None:
    """MLA with prefill TP 2 and decode TP 4: decode rank d is written by prefill d % 2."""
    s = scenario(tp=(2, 4), mla=True)
    prefill, decode = geometry(s.model, s.prefill), geometry(s.model, s.decode)
    assert [writers(prefill, decode.with_rank(d)) for d in range(4)] == [(0,), (1,), (0,), (1,)]
    assert paired_ranks_of_decode(prefill, decode.with_rank(3)) == (0, 1)


@pytest.mark.parametrize("blocks", [(16, 64), (64, 16), (16, 48), (48, 16)])
@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 2)])
def test_transfer_block_size_mismatch(blocks: tuple[int, int], tp: tuple[int, int]) -> None:
    """Different block sizes, multiples or not: tokens move one by page-run, never whole pages."""
    outcome = run_scenario(scenario(tp=tp, blocks=blocks, num_tokens=150, cuts=(40, 100)))
    assert not any(plan.direct for plans in outcome.plans.values() for plan in plans)


def test_extents_block_16_to_64_contiguous_heads_merge_per_token_run() -> None:
    """Full heads, NHD, 16 to 64, contiguous pages: runs merge into one extent."""
    outcome = run_scenario(scenario(tp=(1, 1), blocks=(16, 64), num_tokens=128, contiguous=True))
    (chunk,) = outcome.extents[(0, 0)]
    assert len(chunk) == 1 and chunk[0].length == 128 * outcome.plans[0][0].src.token_bytes


@pytest.mark.parametrize("layouts", [("HND", "NHD"), ("NHD", "HND"), ("HND", "HND")])
def test_transfer_layout_mismatch_p1d2(layouts: tuple[str, str]) -> None:
    """Layout conversion while slicing heads for two decode ranks."""
    outcome = run_scenario(scenario(tp=(1, 2), layouts=layouts, num_tokens=30, cuts=(11,)))
    assert outcome.writers == {0: (0,), 1: (0,)}


@pytest.mark.parametrize("layouts", [("HND", "NHD"), ("NHD", "HND")])
def test_transfer_layout_mismatch_same_tp_is_not_direct(layouts: tuple[str, str]) -> None:
    """Same TP and block but different layouts with 2 local heads: converted token by token."""
    outcome = run_scenario(scenario(tp=(2, 2), layouts=layouts, num_tokens=30, contiguous=True))
    assert not any(plan.direct for plans in outcome.plans.values() for plan in plans)


def test_plan_pair_single_head_layouts_coincide() -> None:
    """With one local head on both sides NHD and HND are the same bytes: pages move whole."""
    outcome = run_scenario(scenario(tp=(4, 4), layouts=("NHD", "HND"), num_tokens=20))
    assert all(plan.direct for plans in outcome.plans.values() for plan in plans)


def test_transfer_exact_multiple_prompt() -> None:
    """A prompt of exactly k blocks occupies k pages and moves k pages, nothing beyond."""
    s = scenario(tp=(1, 1), blocks=(8, 8), num_tokens=24, contiguous=True)
    assert len(s.src_pages) == len(s.dst_pages) == 3
    outcome = run_scenario(s)
    (chunk,) = outcome.extents[(0, 0)]
    assert sum(e.length for e in chunk) == 3 * outcome.plans[0][0].src.page_bytes


def test_check_page_count_rejects_off_by_one() -> None:
    """k blocks of tokens need exactly k pages; k+1 or k-1 pages raise TokenCountMismatch."""
    check_page_count(32, 16, 2)
    check_page_count(33, 16, 3)
    check_page_count(0, 16, 0)
    for pages in (1, 3):
        with pytest.raises(TokenCountMismatch, match="32 tokens in blocks of 16 fill 2 pages") as info:
            check_page_count(32, 16, pages)
        assert isinstance(info.value, ValueError) and info.value.expected_pages == 2


def test_transfer_prefix_hit_moves_only_the_rest() -> None:
    """Decode already holds 4 of 7 blocks: only pages 4..6 of the request move."""
    s = scenario(tp=(1, 1), blocks=(8, 8), num_tokens=56, prefix_blocks=4)
    outcome = run_scenario(s)
    plan = outcome.plans[0][0]
    (chunk,) = outcome.extents[(0, 0)]
    size = plan.dst.page_bytes
    touched = sorted({(e.dst_offset + k) // size for e in chunk for k in range(0, e.length, size)})
    assert touched == sorted(s.dst_pages[4:7])


def test_transfer_prefix_hit_sliced_moves_only_the_rest() -> None:
    """Prefix hit with TP 2 to 1 and block 4 to 8: moved bytes are those of tokens 32..55."""
    s = scenario(tp=(2, 1), blocks=(4, 8), num_tokens=56, prefix_blocks=4, cuts=(41,))
    outcome = run_scenario(s)
    cell = s.model.head_dim * s.model.itemsize
    for (_, _), chunks in outcome.extents.items():
        assert sum(e.length for chunk in chunks for e in chunk) == (56 - 32) * 2 * cell


def test_extents_full_hit_moves_nothing() -> None:
    """When decode already holds every block the range is empty and so are the extents."""
    s = scenario(tp=(2, 1), num_tokens=28, prefix_blocks=7)
    outcome = run_scenario(s)
    assert all(chunk == [] for chunks in outcome.extents.values() for chunk in chunks)


# --- compatibility -----------------------------------------------------------------------


def _base(**changes: object) -> KVGeometry:
    geo = KVGeometry(
        tp_size=2,
        tp_rank=0,
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype=DType.BFLOAT16,
        block_size=16,
        layout=Layout.NHD,
        mla=False,
        num_blocks=100,
    )
    return replace(geo, **changes)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"dtype": DType.FLOAT16}, "dtype", ("BFLOAT16", "FLOAT16")),
        ({"head_dim": 64}, "head_dim", ("128", "64")),
        ({"num_layers": 3}, "num_layers", ("4", "3")),
        ({"num_kv_heads": 4}, "num_kv_heads", ("8", "4")),
        ({"num_kv_heads": 1, "mla": True, "tp_size": 1}, "mla", ("False", "True")),
    ],
)
def test_check_compatible_rejects_model_mismatch(change: dict[str, object], field: str, words: tuple[str, str]) -> None:
    """A model difference raises IncompatibleGeometry naming the field and both values."""
    with pytest.raises(IncompatibleGeometry) as info:
        check_compatible(_base(), _base(**change))
    assert info.value.field == field
    assert f"prefill has {words[0]}" in str(info.value) and f"decode has {words[1]}" in str(info.value)
    with pytest.raises(IncompatibleGeometry):
        writers(_base(), _base(**change))


def test_check_compatible_accepts_deployment_differences() -> None:
    """TP size, block size, layout and pool size may differ between the two sides."""
    other = _base(tp_size=4, tp_rank=3, block_size=64, layout=Layout.HND, num_blocks=7)
    check_compatible(_base(), other)
    check_compatible(other, _base())
    assert plan_pair(_base(tp_rank=1), other).head_count == 2


# --- pairing helpers ---------------------------------------------------------------------


def test_paired_ranks_p4_d2() -> None:
    """P4/D2 over 8 heads: prefill ranks 0,1 feed decode 0; 2,3 feed decode 1."""
    prefill, decode = _base(tp_size=4), _base(tp_size=2)
    assert paired_ranks_of_decode(prefill, decode.with_rank(1)) == (2, 3)
    assert paired_ranks_of_prefill(prefill.with_rank(2), decode) == (1,)
    assert write_targets(prefill.with_rank(2), decode) == (1,)
    assert paired(prefill.with_rank(0), decode.with_rank(0))
    assert not paired(prefill.with_rank(0), decode.with_rank(1))


def test_write_targets_skip_unchosen_replicas() -> None:
    """P8/D2 over 4 heads: rank 1 is paired with decode 0 but only replica 0 writes it."""
    prefill, decode = _base(tp_size=8, num_kv_heads=4), _base(tp_size=2, num_kv_heads=4)
    assert paired_ranks_of_prefill(prefill.with_rank(1), decode) == (0,)
    assert write_targets(prefill.with_rank(1), decode) == ()
    assert write_targets(prefill.with_rank(5), decode) == (1,)


def test_plan_pair_rejects_non_writer() -> None:
    """Planning for a rank that is not a writer is an error naming the actual writers."""
    with pytest.raises(ValueError, match=r"prefill rank 1 does not write decode rank 0; its writers are \(0,\)"):
        plan_pair(_base(tp_size=2, tp_rank=1, mla=True, num_kv_heads=1), _base(tp_size=1, mla=True, num_kv_heads=1))


def test_plan_pair_offsets_for_p1_d2() -> None:
    """P1/D2 over 8 heads: decode rank 1 gets heads 4..7 from local heads 4..7 of prefill 0."""
    plan = plan_pair(_base(tp_size=1), _base(tp_size=2, tp_rank=1))
    assert (plan.head_start, plan.head_count, plan.src_head_offset, plan.dst_head_offset) == (4, 4, 4, 0)
    assert not plan.direct


# --- extents edge cases ------------------------------------------------------------------


def test_extents_rejects_missing_page() -> None:
    """A page list too short for the token range raises PageListError naming the index."""
    plan = plan_pair(_base(tp_size=1), _base(tp_size=1))
    with pytest.raises(PageListError, match="need page index 2"):
        plan.extents([0, 1], [0, 1, 2], 0, 33)
    with pytest.raises(PageListError, match="destination page list has 1 pages"):
        plan.extents([0, 1], [0], 10, 20)


def test_extents_rejects_page_outside_pool() -> None:
    """A page id the pool does not have (a peer's bad index) raises before any extent exists."""
    plan = plan_pair(_base(tp_size=1), _base(tp_size=1, num_blocks=5))
    with pytest.raises(PageListError, match="destination page 5 at index 1 is outside the pool"):
        plan.extents([0, 1], [0, 5], 0, 20)
    with pytest.raises(PageListError, match="source page -1"):
        plan.extents([-1], [0], 0, 2)


def test_extents_rejects_reversed_range() -> None:
    """A start past the end is a caller error, not an empty transfer."""
    plan = plan_pair(_base(tp_size=1), _base(tp_size=1))
    with pytest.raises(ValueError, match=r"bad token range \[5, 3\)"):
        plan.extents([0], [0], 5, 3)


def test_extents_direct_moves_whole_touched_pages() -> None:
    """Direct mode moves every page the range touches, including the partial last one."""
    plan = plan_pair(_base(tp_size=1), _base(tp_size=1))
    size = plan.src.page_bytes
    assert plan.extents([4, 9, 2], [7, 8, 1], 20, 33) == [Extent(9 * size, 8 * size, size), Extent(2 * size, 1 * size, size)]


def test_merge_runs_needs_both_sides_adjacent() -> None:
    """Extents merge only when source and destination both continue; order is kept."""
    runs = [Extent(0, 100, 4), Extent(4, 104, 4), Extent(8, 200, 4), Extent(12, 204, 2), Extent(0, 206, 1)]
    assert merge_runs(runs) == [Extent(0, 100, 8), Extent(8, 200, 6), Extent(0, 206, 1)]
    assert merge_runs([]) == []


def test_expand_regions_merges_back_to_back_regions() -> None:
    """A whole-region pattern over adjacent regions becomes one descriptor; gaps keep them apart."""
    pattern = [Extent(0, 0, 10)]
    assert expand_regions(pattern, [0, 10, 20], [50, 60, 70]) == [Extent(0, 50, 30)]
    assert expand_regions(pattern, [0, 100], [0, 100]) == [Extent(0, 0, 10), Extent(100, 100, 10)]
    with pytest.raises(ValueError, match="2 source regions but 1 destination regions"):
        expand_regions(pattern, [0, 1], [0])
