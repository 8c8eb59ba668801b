"""Pattern copies (the kernel path's kernel): the plan covers every extent exactly, and the Triton
kernel (interpreted on CPU tensors here; compiled under ``-m gpu``) equals the torch reference."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.kernels import pattern as P

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def patterns(draw):
    """A region size, an alignment and non-overlapping destination extents with any sources."""
    align = draw(st.sampled_from([1, 2, 4, 8, 16]))
    units = draw(st.integers(4, 64))
    size = units * 16
    n = draw(st.integers(1, min(6, units)))
    dst_starts = sorted(draw(st.lists(st.integers(0, units - 1), min_size=n, max_size=n, unique=True)))
    extents = []
    for i, start in enumerate(dst_starts):
        limit = (dst_starts[i + 1] if i + 1 < n else units) - start
        length = draw(st.integers(1, limit)) * 16 - draw(st.sampled_from([0, align])) % 16
        length = max(align, length - length % align)
        src = draw(st.integers(0, (size - length) // align)) * align
        extents.append((src, start * 16, length))
    return size, align, np.array(extents, dtype=np.int64)


@FAST
@given(case=patterns(), regions=st.integers(1, 3), tile=st.sampled_from([16, 64, 1024, 32768]))
def test_pattern_plan_tiles_cover_each_extent_exactly(case, regions, tile) -> None:
    """Tiles, mapped back to bytes, are exactly the extents (no gap, no overlap, none longer than a
    tile), and the word and vector divide every offset, length and base."""
    size, align, extents = case
    bases = [4096 * (r + 1) for r in range(regions)]
    plan = P.plan_pattern(extents, regions=regions, base_align=P.alignment(bases), max_tile_bytes=max(tile, 16),
                          min_programs=1)
    unit = plan.word * plan.vec
    assert unit >= align and all(int(v) % unit == 0 for v in [*extents.reshape(-1), *bases])
    got: list[tuple[int, int]] = sorted((int(s) * unit, int(n) * unit) for s, _d, n in plan.tiles)
    assert max(n for _s, n in got) <= plan.tile_words * plan.word
    covered = np.zeros(size, dtype=np.int64)
    for s, d, n in plan.tiles:
        covered[int(d) * unit:int(d + n) * unit] += 1
        assert int(s) * unit - int(d) * unit in {int(e[0] - e[1]) for e in extents}
    want = np.zeros(size, dtype=np.int64)
    for _s, d, n in extents:
        want[d:d + n] += 1
    assert np.array_equal(covered, want)
    assert plan.nbytes == int(extents[:, 2].sum()) * regions


def test_pattern_plan_small_writes_use_small_tiles() -> None:
    """A small write is cut into tiles small enough to keep many programs busy; a large one into
    the longest tiles."""
    small = P.plan_pattern(np.array([[0, 0, 32768 * 4]]), regions=64)
    large = P.plan_pattern(np.array([[0, 0, 32768 * 512]]), regions=64)
    assert small.tile_words * small.word < P.MAX_TILE_BYTES and small.programs >= 1024
    assert large.tile_words * large.word == P.MAX_TILE_BYTES


def test_pattern_plan_refuses_empty_and_mismatched() -> None:
    with pytest.raises(ValueError):
        P.plan_pattern(np.zeros((0, 3)), regions=1)
    with pytest.raises(ValueError):
        P.plan_pattern(np.array([[0, 0, 16]]), regions=0)
    with pytest.raises(ValueError):
        P.plan_pattern(np.array([[0, 0, 0]]), regions=1)


@needs_triton
@FAST
@given(case=patterns(), regions=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_pattern_triton_interpreted_equals_reference(case, regions, seed) -> None:
    """Bit for bit: the interpreted kernel writes the extents of every region and nothing else."""
    size, _align, extents = case
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(regions)]
    dst = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(regions)]
    want = [d.clone() for d in dst]
    P.copy_reference(extents, src, want)
    bases = [t.data_ptr() for t in src + dst]
    plan = P.plan_pattern(extents, regions=regions, base_align=P.alignment(bases), min_programs=4)
    P.launch(plan, torch.tensor([t.data_ptr() for t in src]), torch.tensor([t.data_ptr() for t in dst]),
             torch.from_numpy(plan.tiles))
    for got, ref in zip(dst, want, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pattern_triton_compiled_equals_reference_on_gpu() -> None:
    """The compiled kernel: random pages of bf16 regions, byte-exact, other bytes untouched."""
    gen = torch.Generator().manual_seed(0)
    pages, page = 256, 32768
    src = [torch.randn(pages * page // 2, generator=gen).to(torch.bfloat16).cuda() for _ in range(4)]
    dst = [torch.zeros_like(s) for s in src]
    perm = torch.randperm(pages, generator=gen)[:100].tolist()
    extents = np.array([[p * page, q * page, page] for p, q in zip(perm, perm[::-1], strict=True)], dtype=np.int64)
    want = [d.clone() for d in dst]
    P.copy_reference(extents, src, want)
    plan = P.plan_pattern(extents, regions=4, base_align=P.alignment([t.data_ptr() for t in src + dst]))
    table = torch.tensor([t.data_ptr() for t in src] + [t.data_ptr() for t in dst], device="cuda")
    P.launch(plan, table[:4], table[4:], torch.from_numpy(plan.tiles).cuda())
    torch.cuda.synchronize()
    for got, ref in zip(dst, want, strict=True):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@FAST
@given(rows=st.integers(1, 6), seed=st.integers(0, 2**16), src_slot=st.integers(0, 40), dst_slot=st.integers(0, 40))
def test_strided_rows_stepped_tiles_move_to_any_slot_pair_as_the_shifted_tiles_do(rows, seed, src_slot,
                                                                                   dst_slot) -> None:
    """The kernel path's fused state slot reads the link's ``stepped`` tiles and two slot numbers:
    each tile at slot 0 plus the slots times its steps is the tile ``tiles(src_slot, dst_slot)``
    computes on the host, for rows of any lengths and strides."""
    rng = np.random.default_rng(seed)
    length = rng.integers(1, 40, rows) * 16
    src_stride = length * rng.integers(1, 4, rows)
    dst_stride = length * rng.integers(1, 4, rows)
    src = np.cumsum(np.concatenate([[4096], src_stride[:-1] * 64]))
    dst = np.cumsum(np.concatenate([[1 << 20], dst_stride[:-1] * 64]))
    strided = P.plan_strided_rows(src, src_stride, dst, dst_stride, length)
    stepped = strided.stepped()
    assert stepped.shape == (len(strided.plan.tiles), 5)
    moved = stepped[:, :3].copy()
    moved[:, 0] += src_slot * stepped[:, 3]
    moved[:, 1] += dst_slot * stepped[:, 4]
    assert np.array_equal(moved, strided.tiles(src_slot, dst_slot))


def _rows_case(device: str, regions: int = 2, seed: int = 0):
    """Source regions (TP 1, blocks of 4, NHD) and zeroed destination regions (TP 2 rank 1, blocks
    of 8, HND) of bf16 pages, a rows plan of tokens [3, 29) between them, the tables."""
    from kvproto.geometry import KVGeometry, Layout, plan_pair
    from kvproto.geometry.model import DType

    def geometry(tp: int, rank: int, block: int, layout: str) -> KVGeometry:
        return KVGeometry(tp_size=tp, tp_rank=rank, num_layers=1, num_kv_heads=4, head_dim=8,
                          dtype=DType.BFLOAT16, block_size=block, layout=Layout[layout], mla=False, num_blocks=16)

    pair = plan_pair(geometry(1, 0, 4, "NHD"), geometry(2, 1, 8, "HND"))
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randint(0, 256, (16 * pair.src.page_bytes,), generator=gen, dtype=torch.uint8).to(device)
           for _ in range(regions)]
    dst = [torch.zeros(16 * pair.dst.page_bytes, dtype=torch.uint8, device=device) for _ in range(regions)]
    rows = P.plan_rows(pair, 3, 29, regions=regions, base_align=P.alignment([t.data_ptr() for t in src + dst]))
    table = torch.tensor([t.data_ptr() for t in src + dst], dtype=torch.int64, device=device)
    return pair, rows, src, dst, table[:regions], table[regions:]


def _rows_want(pair, src, dst, src_pages, dst_pages) -> list[torch.Tensor]:
    import dataclasses

    want = [torch.zeros_like(d.cpu()) for d in dst]
    P.copy_reference(P.pair_extents(dataclasses.replace(pair, direct=False), src_pages, dst_pages, 3, 29),
                     [s.cpu() for s in src], want)
    assert all(w.count_nonzero() > 600 for w in want)  # 26 tokens x 2 heads x 16 bytes: 832, mostly nonzero
    return want


@needs_triton
def test_paged_launch_is_bound_once_per_plan_and_tables_and_moves_each_writes_pages() -> None:
    """The rows launch is bound once per plan and tables (``PagedLaunch.of``: by identity, the
    same binding for the same objects, another for another table); writes of other pages through
    one binding each land as the torch reference puts them (interpreted on CPU tensors)."""
    from kvproto.kernels import paged as TK

    pair, rows, src, dst, src_table, dst_table = _rows_case("cpu")
    bound = TK.PagedLaunch.of(rows, src_table, dst_table)
    assert TK.PagedLaunch.of(rows, src_table, dst_table) is bound
    assert TK.PagedLaunch.of(rows, src_table.clone(), dst_table) is not bound
    for seed in range(3):
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(seed))
        src_pages, dst_pages = perm[:8].tolist(), perm[8:12].tolist()
        for d in dst:
            d.zero_()
        P.launch_rows(rows, src_table, dst_table, torch.tensor(src_pages), torch.tensor(dst_pages))
        assert TK.PagedLaunch.of(rows, src_table, dst_table) is bound
        for got, want in zip(dst, _rows_want(pair, src, dst, src_pages, dst_pages), strict=True):
            assert torch.equal(got, want)


def test_paged_launch_keeps_at_most_its_limit_of_bindings(monkeypatch) -> None:
    """Bindings are kept by identity up to ``KEPT``, the oldest out first; each holds what it binds."""
    from collections import OrderedDict

    from kvproto.kernels import paged as TK

    monkeypatch.setattr(TK.PagedLaunch, "_bound", OrderedDict())
    monkeypatch.setattr(TK.PagedLaunch, "KEPT", 3)
    _, rows, _, _, src_table, dst_table = _rows_case("cpu")
    tables = [src_table.clone() for _ in range(4)]
    first = [TK.PagedLaunch.of(rows, t, dst_table) for t in tables]
    assert len(TK.PagedLaunch._bound) == 3 and len({id(b) for b in first}) == 4
    assert TK.PagedLaunch.of(rows, tables[3], dst_table) is first[3]
    assert TK.PagedLaunch.of(rows, tables[0], dst_table) is not first[0]  # the oldest went out
    assert all(held[1] is t for (held, _), t in zip(TK.PagedLaunch._bound.values(), tables[2:] + tables[:1]))


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_launch_compiled_takes_the_jit_once_per_page_list_alignment(monkeypatch) -> None:
    """On the GPU a bound rows launch goes through Triton's JIT only for the first write of each
    specialisation of its page lists (16-byte aligned or not); every later write calls the
    compiled kernel's launcher directly. Each write lands as the torch reference puts it."""
    from kvproto.kernels import paged as TK

    assert not TK._jit_only(), "this Triton's launches cannot skip the JIT: nothing to test"
    pair, rows, src, dst, src_table, dst_table = _rows_case("cuda")
    kernel = TK._paged_kernel(False)
    jit = []
    real = type(kernel).run
    monkeypatch.setattr(type(kernel), "run", lambda self, *a, **k: jit.append(1) or real(self, *a, **k))
    from kvproto.kernels import launcher

    monkeypatch.setattr(launcher, "_compiled", {})  # this test's specialisations, from nothing
    lists = torch.zeros(64, dtype=torch.int64, device="cuda")  # two lists at 16-byte aligned or odd entries
    for seed, at in enumerate((0, 0, 1, 1, 0, 1)):
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(seed))
        src_pages, dst_pages = perm[:8].tolist(), perm[8:12].tolist()
        lists[at:at + 8] = torch.tensor(src_pages)
        lists[at + 16:at + 20] = torch.tensor(dst_pages)
        for d in dst:
            d.zero_()
        P.launch_rows(rows, src_table, dst_table, lists[at:], lists[at + 16:])
        torch.cuda.synchronize()
        for got, want in zip(dst, _rows_want(pair, src, dst, src_pages, dst_pages), strict=True):
            assert torch.equal(got.cpu(), want)
    assert len(jit) == 2  # aligned lists, then lists 8 bytes past an alignment
    assert len(TK.PagedLaunch.of(rows, src_table, dst_table)._known) == 2
