"""Hybrid caches end to end: every group of a room lands byte-exact, or the room fails.

Random hybrid geometries (paged groups of their own heads, block sizes, layouts and windows;
state groups of random tensors sharded or replicated over TP) move one room across random TP
pairs over loopback endpoints, checked by content (``kvproto.reference``), never by plan. Named
tests cover what must be refused: a group one side lacks, shapes that differ, bad destinations
from the application and from a peer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.aio import DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState
from kvproto.demo import DemoConfig
from kvproto.reference import PagedShape, RankCache, StateShape
from kvproto.transport import load_transport
from kvproto.wire import (
    NO_SLOT,
    Abort,
    CacheGroups,
    ErrorCode,
    GroupDestination,
    LocalProtocolError,
    Register,
    RegisterAccept,
    RegisterReject,
    TransferRequest,
    decode,
    encode,
)

from .conftest import config

pytestmark = pytest.mark.asyncio


@dataclasses.dataclass(frozen=True)
class Case:
    cfg: DemoConfig
    shapes: tuple[PagedShape | StateShape, ...]
    prefill_blocks: dict[str, int]
    decode_blocks: dict[str, int]
    prefill_layouts: dict[str, str]
    decode_layouts: dict[str, str]
    staging: int
    layerwise: bool = False
    page_layout: dict[str, str] | None = None
    """Per side ("prefill", "decode"), the caches' page layout (``RankCache``; default: the config's)."""


def _tp_choices(heads: int, mla: bool) -> list[int]:
    return [t for t in (1, 2, 4) if mla or t <= heads and heads % t == 0 or t > heads and t % heads == 0]


@st.composite
def hybrid_cases(draw: st.DrawFn, alike: bool = False) -> Case:
    """A first paged group and 1-3 more (paged or state), their model layers interleaved.
    ``alike``: at least one more paged group, and every paged group has the first one's heads,
    head size, block sizes and layouts and no window (their pages look alike: shared launches)."""
    extra = draw(st.lists(st.sampled_from(["paged", "state"]), min_size=1, max_size=3))
    if alike and "paged" not in extra:
        extra[0] = "paged"
    heads_of = [draw(st.sampled_from([1, 2, 4])) for _ in range(1 + len(extra))]
    mla = draw(st.booleans()) and not alike
    heads_of[0] = 1 if mla else heads_of[0]
    if alike:
        heads_of = [heads_of[0] if kind == "paged" else h for kind, h in zip(["paged", *extra], heads_of)]
    tps = set.intersection(*(set(_tp_choices(h, mla and i == 0)) for i, h in enumerate(heads_of)))
    p_tp, d_tp = draw(st.sampled_from(sorted(tps))), draw(st.sampled_from(sorted(tps)))
    per_group = [draw(st.integers(1, 2)) for _ in range(1 + len(extra))]
    # interleave the groups' layers over the model: each model layer belongs to one group
    owners = [g for g, n in enumerate(per_group) for _ in range(n)]
    order = draw(st.permutations(owners))
    layers = [tuple(i for i, g in enumerate(order) if g == k) for k in range(len(per_group))]
    shapes: list[PagedShape | StateShape] = [PagedShape("g0", layers[0], heads_of[0], draw(st.sampled_from([2, 4])), mla)]
    for k, kind in enumerate(extra, start=1):
        if kind == "paged":
            window = None if alike else draw(st.one_of(st.none(), st.integers(1, 40)))
            head_dim = shapes[0].head_dim if alike else draw(st.sampled_from([2, 3, 4]))
            shapes.append(PagedShape(f"g{k}", layers[k], heads_of[k], head_dim, False, window=window, salt=k))
        else:
            tensors = []
            for _ in range(draw(st.integers(1, 2))):
                dims = draw(st.integers(1, 3))
                shard = draw(st.one_of(st.none(), st.integers(0, dims - 1)))
                shape = [draw(st.integers(1, 3)) for _ in range(dims)]
                if shard is not None:
                    shape[shard] = 4 * draw(st.integers(1, 2))
                tensors.append((tuple(shape), draw(st.sampled_from(["bf16", "fp32", "u8"])), shard))
            shapes.append(StateShape(f"g{k}", layers[k], tuple(t[0] for t in tensors), tuple(t[1] for t in tensors),
                                     tuple(t[2] for t in tensors), salt=k))
    names = [s.name for s in shapes if isinstance(s, PagedShape)]
    blocks = [1, 2, 4, 8]
    p_blocks = {n: draw(st.sampled_from(blocks)) for n in names}
    d_blocks = {n: draw(st.sampled_from(blocks)) for n in names}
    if alike:
        p_blocks = dict.fromkeys(names, p_blocks["g0"])
        d_blocks = dict.fromkeys(names, d_blocks["g0"])
    tokens = draw(st.integers(1, 50))
    cfg = DemoConfig(rooms=1, layers=len(layers[0]), kv_heads=heads_of[0], head_dim=shapes[0].head_dim,
                     dtype=draw(st.sampled_from(["bf16", "u8"])), prefill_tp=p_tp, decode_tp=d_tp,
                     prefill_block=p_blocks["g0"], decode_block=d_blocks["g0"], mla=mla, blocks=96,
                     tokens=tokens, prefix_tokens=draw(st.integers(0, tokens)),
                     chunk_tokens=max(p_blocks.values()) * draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**16)),
                     transport="loopback", path=draw(st.sampled_from(["auto", "sliced"])))
    layouts = ["NHD", "HND"]
    p_layouts = {n: draw(st.sampled_from(layouts)) for n in names}
    d_layouts = {n: draw(st.sampled_from(layouts)) for n in names}
    if alike:
        p_layouts, d_layouts = dict.fromkeys(names, p_layouts["g0"]), dict.fromkeys(names, d_layouts["g0"])
    return Case(cfg, tuple(shapes), p_blocks, d_blocks, p_layouts, d_layouts,
                draw(st.sampled_from([0, 4096, 1 << 20])), draw(st.booleans()))


def _prefix(case: Case) -> int:
    """Decode's prefix hit: whole blocks of every paged group."""
    import math

    unit = math.lcm(*case.decode_blocks.values())
    n = case.cfg.tokens
    return min(case.cfg.prefix_tokens, n) // unit * unit


def _caches(case: Case, side: str) -> list[RankCache]:
    cfg = case.cfg
    tp = cfg.prefill_tp if side == "prefill" else cfg.decode_tp
    blocks = case.prefill_blocks if side == "prefill" else case.decode_blocks
    layouts = case.prefill_layouts if side == "prefill" else case.decode_layouts
    first = case.shapes[0].name
    return [RankCache(torch, cfg, tp=tp, rank=r, block=blocks[first], layout=layouts[first], aux_slots=1,
                      shapes=list(case.shapes), group_blocks=blocks, group_layouts=layouts,
                      page_layout=(case.page_layout or {}).get(side)) for r in range(tp)]


async def run_hybrid_room(case: Case, room_id: int, transport: str = "loopback",
                          options: dict[str, Any] | None = None, writes: list[int] | None = None) -> set[str]:
    """One room of ``case`` across all ranks; every group checked on every decode rank. Returns the
    paths the prefill rooms used (and appends each prefill room's write count to ``writes``)."""
    cfg = case.cfg
    pre, dec = _caches(case, "prefill"), _caches(case, "decode")
    n, prefix = cfg.tokens, _prefix(case)
    opts = dict(path=cfg.path, staging_bytes=case.staging, transport_options=options or {})
    first = PrefillEndpoint(pre[0].kv, config=config(transport, **opts))
    await first.start()
    prefills, decodes = [first], []
    try:
        for c in pre[1:]:
            ep = PrefillEndpoint(c.kv, bootstrap=first.address, config=config(transport, **opts))
            await ep.start()
            prefills.append(ep)
        for c in dec:
            ep = DecodeEndpoint(c.kv, config=config(transport, instance=f"decode-{room_id}", **opts))
            await ep.start()
            decodes.append(ep)
        checks, rooms = [], []
        for ep, cache in zip(decodes, dec):
            pages = cache.take(-(-n // cache.block))
            group_pages = cache.decode_group_pages(n)
            slots = cache.take_slots()
            if prefix:
                cache.fill(room_id, pages, 0, prefix)
                cache.fill_groups(room_id, group_pages, 0, prefix, n_tokens=n)
            checks.append((cache, pages, group_pages, slots))
            rooms.append(ep.open_room(room_id, first.address, pages=pages, num_tokens=n, prefix_tokens=prefix,
                                      group_pages=cache.strip(group_pages), state_slots=slots))
        model_layers = pre[0].kv.model_layers
        for ep, cache in zip(prefills, pre):
            room = ep.open_room(room_id)
            pages: list[int] = []
            held: dict[str, list[int]] = {}
            slots = cache.take_slots()
            cache.fill_states(room_id, slots)
            t = 0
            while t < n:
                end = min(n, t + cfg.chunk_tokens)
                new = cache.take(-(-end // cache.block) - len(pages))
                pages += new
                new_groups = cache.take_group_pages(held, end)
                cache.fill(room_id, pages, t, end, garbage_below=prefix)
                cache.fill_groups(room_id, held, t, end, garbage_below=prefix)
                last = end == n
                if case.layerwise:  # one call per model layer, the first with the chunk's pages
                    for layer in range(model_layers):
                        room.send(new if layer == 0 else [], end, last=last, layers=range(layer, layer + 1),
                                  group_pages=new_groups if layer == 0 else None,
                                  state_slots=slots if last and layer == 0 else None)
                else:
                    room.send(new, end, last=last, group_pages=new_groups, state_slots=slots if last else None)
                t = end
            rooms.append(room)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in rooms)), 30)
        for rank, (cache, pages, group_pages, slots) in enumerate(checks):
            assert cache.check(room_id, pages, n) == 0, f"decode rank {rank}: the first group holds wrong bytes"
            assert cache.check_groups(room_id, group_pages, slots, n) == 0, f"decode rank {rank}: a group is wrong"
        if writes is not None:
            writes.extend(r.stats.writes for r in rooms[len(decodes):])
        return set().union(*(r.stats.paths for r in rooms[len(decodes):]))
    finally:
        for ep in [*prefills[::-1], *decodes]:
            await ep.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=hybrid_cases())
async def test_hybrid_random_geometry_moves_every_group(case: Case) -> None:
    """Random hybrid caches (paged groups with their own heads, blocks, layouts and windows, state
    groups sharded or replicated), random TP pairs both ways, chunked, prefix hits, layer-wise or
    whole, direct, sliced or staged: every decode rank holds every group's reference bytes."""
    await run_hybrid_room(case, room_id=1 + case.cfg.seed)


def _preset_case(preset: str, p_tp: int, d_tp: int, *, decode_block: int = 16, layerwise: bool = False,
                 prefix: int = 0) -> Case:
    from kvproto.reference import model_groups

    cfg = DemoConfig(rooms=1, layers=2, kv_heads=4, head_dim=8, prefill_tp=p_tp, decode_tp=d_tp, prefill_block=16,
                     decode_block=decode_block, preset=preset, window=40, blocks=64, tokens=150, prefix_tokens=prefix,
                     chunk_tokens=64, seed=5, transport="loopback")
    shapes = tuple(model_groups(cfg))
    names = [s.name for s in shapes if isinstance(s, PagedShape)]
    return Case(cfg, shapes, {n: 16 for n in names}, {n: decode_block for n in names},
                {n: "NHD" for n in names}, {n: "HND" if decode_block != 16 else "NHD" for n in names}, 1 << 20,
                layerwise)


@pytest.mark.parametrize("preset", ["gdn", "mla-indexer", "swa"])
@pytest.mark.parametrize("tps", [(1, 2), (2, 1)], ids=["tp1-2", "tp2-1"])
async def test_hybrid_presets_across_tp_both_ways(preset: str, tps: tuple[int, int]) -> None:
    """The three families (a GDN hybrid, MLA with an indexer cache, full + sliding-window layers)
    move byte-exact across TP 1 -> 2 and 2 -> 1, and with a block-size and layout mismatch."""
    await run_hybrid_room(_preset_case(preset, *tps), room_id=11)
    await run_hybrid_room(_preset_case(preset, *tps, decode_block=32, prefix=64), room_id=12)


async def test_hybrid_staged_pieces_carry_the_groups_without_a_window() -> None:
    """Where the first group stages (a block-size mismatch), an MLA latent's indexer cache rides in the
    same pieces (staging.md: a block per group): no write of its own, no sliced descriptors; a
    sliding-window group is not staged (its tokens are the window's) and moves by writes of its own."""
    paths = await run_hybrid_room(_preset_case("mla-indexer", 2, 1, decode_block=32), room_id=15)
    assert paths == {"staged-cpu"}, paths
    paths = await run_hybrid_room(_preset_case("swa", 2, 1, decode_block=32), room_id=16)
    assert paths == {"staged-cpu", "sliced"}, paths


@pytest.mark.parametrize("transport", ["loopback", "cuda-ipc"])
async def test_hybrid_room_makes_one_write_per_chunk_and_link(transport: str, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A hybrid room costs the writes a one-group room does: each chunk's write carries every group
    (GDN preset, TP 1 -> 1, 150 tokens in chunks of 64: three writes, the state in the last), and
    where the first group stages, the state slots ride in the piece that ends the prompt."""
    options = {"fallback": "loopback", "cpu_kernels": True} if transport == "cuda-ipc" else None
    writes: list[int] = []
    paths = await run_hybrid_room(_preset_case("gdn", 1, 1), room_id=17, transport=transport, options=options,
                                  writes=writes)
    assert writes == [3], (writes, paths)
    assert paths == ({"direct-kernel", "state"} if transport == "cuda-ipc" else {"direct", "state"}), paths
    if transport == "loopback":
        pieces: list[int] = []
        stage = PrefillEndpoint._stage

        def counted(self: PrefillEndpoint, out: Any, link: Any) -> None:
            pieces.append(out.seq)
            stage(self, out, link)

        monkeypatch.setattr(PrefillEndpoint, "_stage", counted)
        writes.clear()
        paths = await run_hybrid_room(_preset_case("gdn", 1, 1, decode_block=32), room_id=18, writes=writes)
        assert paths == {"staged-cpu", "state"}, paths
        assert pieces and writes == [len(pieces)], (writes, pieces)  # no write of the state's own


@pytest.mark.parametrize("minor", [2, 3])
@pytest.mark.parametrize("tps", [(1, 2), (2, 1)], ids=["tp1-2", "tp2-1"])
async def test_hybrid_state_block_between_minor3_peers_else_a_write_of_its_own(
        minor: int, tps: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Between peers of minor 3 the state slots travel in the state block of the piece that ends the
    prompt: each piece is one descriptor, and the room makes no write but its pieces. Where either
    side speaks 1.2 (here both endpoints told to), the slots move in a write of their own, a
    descriptor per run: byte-exact either way, across TP both ways."""
    from kvproto.aio import decode as decode_module
    from kvproto.aio import prefill as prefill_module
    from kvproto.aio import prefill_links as prefill_links_module

    monkeypatch.setattr(prefill_module, "MINOR", minor)
    monkeypatch.setattr(prefill_links_module, "MINOR", minor)  # (a link's pieces are planned there)
    monkeypatch.setattr(decode_module, "MINOR", minor)
    pieces: list[int] = []
    descriptors: list[int] = []
    stage = PrefillEndpoint._stage
    posted = PrefillEndpoint._posted

    def counted(self: PrefillEndpoint, out: Any, link: Any) -> None:
        pieces.append(out.seq)
        stage(self, out, link)

    def counted_posted(self: PrefillEndpoint, out: Any, link: Any, done: Any, *args: Any) -> None:
        descriptors.append(done.descriptors)
        posted(self, out, link, done, *args)

    monkeypatch.setattr(PrefillEndpoint, "_stage", counted)
    monkeypatch.setattr(PrefillEndpoint, "_posted", counted_posted)
    writes: list[int] = []
    paths = await run_hybrid_room(_preset_case("gdn", *tps, decode_block=32), room_id=19, writes=writes)
    assert paths == {"staged-cpu", "state"}, paths
    if minor == 3:
        assert sum(writes) == len(pieces) and descriptors == [1] * len(pieces), (writes, pieces, descriptors)
    else:
        assert sum(writes) > len(pieces) and max(descriptors) > 1, (writes, pieces, descriptors)


@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (1, 2)], ids=["tp1-1", "tp2-1", "tp1-2"])
async def test_hybrid_staged_groups_of_one_page_shape_move_in_one_launch(tps: tuple[int, int],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two paged groups of one page shape (own pools, own pages) and a state group on a staged link
    (block 16 -> 32): each piece's two blocks are gathered and scattered in one launch reading
    one page table per room (``kvproto.aio.staging``; on a CUDA cache with Triton, here in Triton's
    interpreter), the last piece's state block in the same launch, and every group lands byte-exact."""
    from kvproto import kernels
    from kvproto.aio import staging

    joined: list[tuple[int, bool, bool]] = []
    real = kernels.copy_joined

    def counted(groups: Any, *args: Any, **kwargs: Any) -> None:
        joined.append((len(groups), kwargs["to_staging"], kwargs.get("slots") is not None))
        real(groups, *args, **kwargs)

    monkeypatch.setattr(staging, "_joins", lambda buf: True)
    monkeypatch.setattr(kernels, "copy_joined", counted)
    cfg = DemoConfig(rooms=1, layers=2, kv_heads=2, head_dim=8, prefill_tp=tps[0], decode_tp=tps[1],
                     prefill_block=16, decode_block=32, blocks=24, tokens=70, chunk_tokens=32, seed=3,
                     transport="loopback")
    shapes = (PagedShape("full", (0, 3), 2, 8, False), PagedShape("lin", (1, 2, 4, 5), 2, 8, False, salt=1),
              StateShape("state", (1, 2, 4, 5), ((4, 3),), ("bf16",), (0,), salt=2))
    case = Case(cfg, shapes, {"full": 16, "lin": 16}, {"full": 32, "lin": 32}, {"full": "NHD", "lin": "NHD"},
                {"full": "HND", "lin": "HND"}, 1 << 20)
    paths = await run_hybrid_room(case, room_id=31)
    assert "staged-cpu" in paths, paths
    assert joined and all(n == 2 for n, _, _ in joined), joined
    assert {to for _, to, _ in joined} == {True, False}  # the prefill's gathers and the decode's scatters
    # the state block rides in the launch of the piece that ends the prompt, both ways
    assert {to for _, to, block in joined if block} == {True, False}, joined


async def test_hybrid_layerwise_moves_each_group_with_its_layers() -> None:
    """Layer-wise chunks name model layers: a GDN hybrid streamed one model layer at a time lands
    every group (the state with the last range's layers)."""
    await run_hybrid_room(_preset_case("gdn", 2, 1, layerwise=True), room_id=13)
    await run_hybrid_room(_preset_case("swa", 1, 2, layerwise=True, prefix=32), room_id=14)


@pytest.mark.nixl
async def test_hybrid_presets_over_nixl() -> None:
    """The same over real NIXL (in-process agents)."""
    for preset in ("gdn", "mla-indexer", "swa"):
        await run_hybrid_room(_preset_case(preset, 2, 1, decode_block=32), room_id=21, transport="nixl")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=hybrid_cases())
async def test_hybrid_random_geometry_over_the_kernel_path(case: Case) -> None:
    """The same over the kernel-path adapter (``cuda-ipc``, its kernels run on these CPU caches in
    Triton's interpreter): every paged group's write is one pattern kernel, every state slot a
    kernel over its runs, nothing staged."""
    paths = await run_hybrid_room(case, room_id=1 + case.cfg.seed, transport="cuda-ipc",
                                  options={"fallback": "loopback", "cpu_kernels": True})
    assert paths <= {"direct-kernel", "sliced-kernel", "state", "aux"}, paths


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=hybrid_cases(alike=True))
async def test_hybrid_groups_that_look_alike_share_launches_byte_exact(case: Case) -> None:
    """Paged groups with one page shape (own pages): over the kernel path their regions share one
    rows kernel per write; over loopback with staging, the staged blocks share one gather and one
    scatter launch (as on a CUDA cache; here Triton's interpreter). Every group lands byte-exact.
    (Layer-wise chunks name model layers, each one group's: nothing to share there.)"""
    from unittest import mock

    from kvproto import kernels
    from kvproto.aio import staging
    from kvproto.transport.cuda_ipc import CudaIpcTransport

    joined: list[int] = []
    rows_recipe, copy_joined = CudaIpcTransport._rows_recipe, kernels.copy_joined

    def counted_plans(self: Any, mapped: Any, plans: Any, *rest: Any) -> Any:
        joined.append(len(plans))
        return rows_recipe(self, mapped, plans, *rest)

    def counted_copy(groups: Any, *args: Any, **kwargs: Any) -> None:
        joined.append(len(groups))
        copy_joined(groups, *args, **kwargs)

    with mock.patch.object(CudaIpcTransport, "_rows_recipe", counted_plans):
        paths = await run_hybrid_room(case, room_id=1 + case.cfg.seed, transport="cuda-ipc",
                                      options={"fallback": "loopback", "cpu_kernels": True})
    assert paths <= {"direct-kernel", "sliced-kernel", "state", "aux"}, paths
    moves = not case.layerwise and _prefix(case) < case.cfg.tokens  # pages to move, every group in each chunk
    if moves:  # (a layer-wise chunk holds one model layer: one group's)
        assert joined and max(joined) >= 2, joined  # a write carries the alike groups in one launch
    joined.clear()
    with mock.patch.object(staging, "_joins", lambda buf: True), mock.patch.object(kernels, "copy_joined",
                                                                                 counted_copy):
        paths = await run_hybrid_room(case, room_id=2 + case.cfg.seed)
    if any(p.startswith("staged") for p in paths) and moves:
        assert joined and min(joined) >= 2, (paths, joined)


# --- what must be refused ---------------------------------------------------------------------------
def _pair_caches(prefill_preset: str, decode_preset: str, **decode_overrides: Any) -> tuple[RankCache, RankCache]:
    base = DemoConfig(rooms=1, layers=2, kv_heads=4, head_dim=8, blocks=32, seed=1, transport="loopback")
    return (RankCache(torch, dataclasses.replace(base, preset=prefill_preset), tp=1, rank=0, block=16, layout="NHD",
                      aux_slots=2),
            RankCache(torch, dataclasses.replace(base, preset=decode_preset, **decode_overrides), tp=1, rank=0,
                      block=16, layout="NHD", aux_slots=2))


@pytest.mark.parametrize("sides", [("swa", ""), ("", "swa"), ("swa", "gdn")], ids=["decode-lacks", "prefill-lacks", "other"])
async def test_hybrid_registration_with_a_missing_group_is_refused_naming_it(sides: tuple[str, str]) -> None:
    """A group one side has and the other lacks fails the bootstrap with INCOMPATIBLE_GEOMETRY and a
    reason that names the group, before any room moves a byte."""
    src, dst = _pair_caches(*sides)
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        kwargs = {}
        if dst.paged or dst.states:
            kwargs = dict(group_pages=dst.strip(dst.decode_group_pages(16)), state_slots=dst.take_slots())
        room = decode.open_room(5, prefill.address, pages=dst.take(1), num_tokens=16, **kwargs)
        with pytest.raises(TransferFailed) as info:
            await asyncio.wait_for(room.wait(), 10)
        assert info.value.code == ErrorCode.INCOMPATIBLE_GEOMETRY
        missing = {"swa", "gdn", "full"} & {n for n in (*src.paged, *src.states, *dst.paged, *dst.states)}
        assert any(f"group {name!r}" in info.value.reason for name in missing), info.value.reason


async def test_hybrid_registration_with_a_different_window_is_refused() -> None:
    src, dst = _pair_caches("swa", "swa", window=32)
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        room = decode.open_room(5, prefill.address, pages=dst.take(1), num_tokens=16,
                                group_pages=dst.strip(dst.decode_group_pages(16)))
        with pytest.raises(TransferFailed) as info:
            await asyncio.wait_for(room.wait(), 10)
        assert info.value.code == ErrorCode.INCOMPATIBLE_GEOMETRY and "group 'swa': window" in info.value.reason


async def test_hybrid_application_misuse_is_refused_and_changes_nothing() -> None:
    """A decode room without a state slot, with too few window pages, or naming an unknown group, and
    a prefill chunk with a group page twice, raise LocalProtocolError and open or change nothing."""
    src, dst = _pair_caches("gdn", "gdn")
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        with pytest.raises(LocalProtocolError, match="state group 'gdn' needs a slot"):
            decode.open_room(5, prefill.address, pages=dst.take(1), num_tokens=16)
        with pytest.raises(LocalProtocolError, match="no group 'nope'"):
            decode.open_room(5, prefill.address, pages=dst.take(1), num_tokens=16, state_slots={"gdn": 0, "nope": 1})
        with pytest.raises(LocalProtocolError, match="slot 9 of group 'gdn'"):
            decode.open_room(5, prefill.address, pages=dst.take(1), num_tokens=16, state_slots={"gdn": 9})
        assert decode.core.rooms == {}
        room = prefill.open_room(6)
        with pytest.raises(LocalProtocolError, match="first chunk whose last flag is set gives the slot"):
            room.send([0], 16, last=True)
        room.send([0], 16, last=True, state_slots={"gdn": 1})
    swa_src, swa_dst = _pair_caches("swa", "swa")
    async with PrefillEndpoint(swa_src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(swa_dst.kv, config=config("loopback")) as decode:
        with pytest.raises(LocalProtocolError, match="need pages 1..4 of group 'swa'"):
            decode.open_room(5, prefill.address, pages=[1, 2, 3, 4, 5], num_tokens=80, group_pages={"swa": [7, 8]})
        room = prefill.open_room(7)
        with pytest.raises(LocalProtocolError, match="page 3 of group 'swa' is listed twice"):
            room.send([0, 1], 32, last=False, group_pages={"swa": [3, 3]})
        with pytest.raises(LocalProtocolError, match="need 2 pages of group 'swa'"):
            room.send([0, 1], 32, last=False, group_pages={"swa": [3]})
        room.send([0, 1], 32, last=False, group_pages={"swa": [3, 4]})  # the refused calls changed nothing


class _RawDecode:
    """A decode rank spoken by hand: registers a hybrid cache, then sends hand-made requests."""

    def __init__(self, cache: RankCache, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.cache = cache
        self.transport = load_transport("loopback", "raw-hybrid-decode")
        self.transport.register(cache.kv.memory_regions())

    async def send(self, msg: Any) -> None:
        await self.sock.send(encode(msg))

    async def recv(self) -> Any:
        return decode(await asyncio.wait_for(self.sock.recv(), 10))

    def register(self, link_id: int = 42) -> Register:
        kv = self.cache.kv
        from kvproto.aio.memory import geometry_to_wire

        return Register(boot_id=1, instance="raw", link_id=link_id, agent_name=self.transport.name, model_id="",
                        compat_key="", geometry=geometry_to_wire(kv.geometry), aux_slots=kv.aux.slots,
                        aux_slot_bytes=kv.aux.slot_bytes, transport="loopback",
                        transport_metadata=self.transport.metadata(), regions=kv.wire_regions())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        self.transport.close()


async def test_hybrid_registration_without_cache_groups_is_rejected_by_a_hybrid_prefill() -> None:
    """A REGISTER with no CACHE_GROUPS before it (a one-group or version 1.1 decode) is refused by a
    hybrid prefill rank, naming its group; sent with the groups, the same REGISTER is accepted and
    answered with the prefill's own CACHE_GROUPS first."""
    src, dst = _pair_caches("swa", "swa")
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill:
        raw = _RawDecode(dst, prefill.address)
        try:
            await raw.send(raw.register())
            reply = await raw.recv()
            assert isinstance(reply, RegisterReject) and reply.code == ErrorCode.INCOMPATIBLE_GEOMETRY
            assert "group 'swa': the prefill has it, the decode does not" in reply.reason
            await raw.send(CacheGroups(link_id=41, groups=dst.kv.wire_groups()))  # another link id: not applied
            await raw.send(raw.register())
            assert isinstance(await raw.recv(), RegisterReject)
            await raw.send(CacheGroups(link_id=42, groups=dst.kv.wire_groups()))
            await raw.send(raw.register())
            groups = await raw.recv()
            assert isinstance(groups, CacheGroups) and groups.groups == src.kv.wire_groups()
            assert isinstance(await raw.recv(), RegisterAccept)
        finally:
            raw.close()


@pytest.mark.parametrize("bad", ["missing", "first_page", "out_of_pool", "twice", "slot", "slot_on_paged"])
async def test_hybrid_bad_group_destination_from_a_peer_fails_only_its_room(bad: str) -> None:
    """A TRANSFER_REQUEST whose group destinations are wrong fails that room with its code and
    writes nothing; a good room on the same link succeeds after it."""
    src, dst = _pair_caches("swa", "swa")
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill:
        raw = _RawDecode(dst, prefill.address)
        try:
            await raw.send(CacheGroups(link_id=42, groups=dst.kv.wire_groups()))
            await raw.send(raw.register())
            assert isinstance(await raw.recv(), CacheGroups)
            assert isinstance(await raw.recv(), RegisterAccept)
            n = 80  # window 64: tokens [16, 80) in swa pages 1..4
            good = GroupDestination(first_page=1, pages=(10, 11, 12, 13), slot=NO_SLOT)
            wrong = {
                "missing": (),
                "first_page": (dataclasses.replace(good, first_page=0),),
                "out_of_pool": (dataclasses.replace(good, pages=(10, 11, 12, 999)),),
                "twice": (dataclasses.replace(good, pages=(10, 11, 11, 13)),),
                "slot": (dataclasses.replace(good, slot=3),),
                "slot_on_paged": (dataclasses.replace(good, slot=0),),
            }[bad]
            code = {"missing": ErrorCode.PEER_PROTOCOL_ERROR, "first_page": ErrorCode.TOKEN_COUNT_MISMATCH,
                    "out_of_pool": ErrorCode.INDEX_OUT_OF_RANGE, "twice": ErrorCode.INDEX_OUT_OF_RANGE,
                    "slot": ErrorCode.PEER_PROTOCOL_ERROR, "slot_on_paged": ErrorCode.PEER_PROTOCOL_ERROR}[bad]
            before = [t.clone() for t in dst.paged["swa"].tensors[0]]
            room = prefill.open_room(10)
            await raw.send(TransferRequest(room_id=10, generation=3, num_tokens=n, prefix_tokens=0, aux_slot=NO_SLOT,
                                           expected_writers=1, dst_pages=(1, 2, 3, 4, 5), groups=wrong))
            reply = await raw.recv()
            assert isinstance(reply, Abort) and reply.code == code and "swa" in reply.reason, reply
            assert room.poll() is RoomState.FAILED
            assert all(t.equal(b) for t, b in zip(dst.paged["swa"].tensors[0], before))
            ok = prefill.open_room(11)
            await raw.send(TransferRequest(room_id=11, generation=4, num_tokens=n, prefix_tokens=0, aux_slot=NO_SLOT,
                                           expected_writers=1, dst_pages=(1, 2, 3, 4, 5), groups=(good,)))
            ok.send([0, 1, 2, 3, 4], n, last=True, group_pages={"swa": [5, 6, 7, 8, 9]})
            await asyncio.wait_for(ok.wait(), 10)
        finally:
            raw.close()


async def test_staged_pieces_and_the_default_buffer_leave_room_for_the_state_block() -> None:
    """A staged piece that ends a room carries the pair's state block after its tokens: the piece
    size keeps STAGING_DEPTH such pieces inside the buffer, and a default buffer adds room for
    their blocks, so a hybrid pair keeps as many pieces in flight, of as many tokens, as a
    one-group pair (a buffer sized for whole pieces held one fewer)."""
    from kvproto.aio import KVCache, StateCache
    from kvproto.aio.endpoint import EndpointConfig
    from kvproto.aio.staging import STAGING_ALIGN, STAGING_DEPTH, STATE_ROOM_MAX, piece_tokens, state_room
    from kvproto.core.staging import StagingRing

    def fit(capacity: int, nbytes: int) -> int:
        """Pieces of ``nbytes`` the decode's ring grants at once."""
        ring = StagingRing(capacity // STAGING_ALIGN * STAGING_ALIGN, align=STAGING_ALIGN)
        for key in range(STAGING_DEPTH + 1):
            ring.request(key, key, unit=nbytes, units=1)
        return len(ring.take_grants())

    unit, tail = 4000, 1500
    for capacity in (1 << 20, (1 << 20) + STAGING_DEPTH * 1536, 3 * STAGING_DEPTH * (unit + tail) - 1):
        tokens = piece_tokens(capacity, unit, tail)
        assert fit(capacity, tokens * unit + tail) >= STAGING_DEPTH
        assert STAGING_DEPTH * ((tokens + 1) * unit + tail) > capacity  # one token more would not fit
    assert piece_tokens(1 << 20, unit, 0) == (1 << 20) // (STAGING_DEPTH * unit)
    assert piece_tokens(1024, unit, tail) == 1  # a buffer too small for the rule: pieces of one token
    assert piece_tokens((1 << 20) + STAGING_DEPTH * tail, unit, tail) == piece_tokens(1 << 20, unit, 0)

    def hybrid(rows: int, tp: int = 1) -> KVCache:
        paged = KVCache.from_tensors([[torch.zeros(8, 16, 4 // tp, 32, dtype=torch.bfloat16)] for _ in range(2)],
                                     tp_size=tp, tp_rank=0, num_kv_heads=4, model_layers=[3])
        conv = [[torch.zeros(6, 3, 8 // tp, dtype=torch.float32), torch.zeros(6, rows, dtype=torch.bfloat16)]
                for _ in range(3)]  # the second tensor replicated
        state = StateCache.from_tensors("conv", conv, shard_dims=[1, None], tp_size=tp, tp_rank=0,
                                        model_layers=[0, 1, 2])
        return paged.with_groups(state)

    for tp in (1, 2):
        kv = hybrid(7, tp)
        per_request = 3 * (3 * (8 // tp) * 4 + 7 * 2)  # 3 layers: the sharded fp32 tensor's share, the bf16 replica
        per_piece = -(-per_request // STAGING_ALIGN) * STAGING_ALIGN  # a piece's place in the ring
        assert state_room(kv) == STAGING_DEPTH * per_piece
        endpoint = DecodeEndpoint(kv, config=EndpointConfig(transport="loopback"))
        assert endpoint._staging is not None and endpoint._staging.capacity == (64 << 20) + STAGING_DEPTH * per_piece
        # a one-group piece's worth of tokens, with the block after them: STAGING_DEPTH still fit
        unit = 2 * 4 // tp * 32 * 2
        tokens = piece_tokens(endpoint._staging.capacity, unit, per_request)
        assert tokens == piece_tokens(64 << 20, unit, 0)
        assert fit(endpoint._staging.capacity, tokens * unit + per_request) == STAGING_DEPTH
    assert state_room(hybrid(STATE_ROOM_MAX // 4)) == STATE_ROOM_MAX  # a huge state: the addition is capped
    one = KVCache.from_tensors([[torch.zeros(8, 16, 4, 32, dtype=torch.bfloat16)] for _ in range(2)], tp_size=1,
                               tp_rank=0, num_kv_heads=4)
    assert state_room(one) == 0
