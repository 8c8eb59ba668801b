"""Staging gather/scatter: reference vs an element loop, Triton vs reference, bit for bit.

The Triton kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` is set
per test with monkeypatch; the package builds interpreted kernels explicitly, so tests that
ran before in the same process do not matter). Tests marked ``gpu`` run the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvproto
from kvproto import kernels
from kvproto.geometry.model import DType, KVGeometry, Layout
from kvproto.kernels import StagingError

DTYPES = {
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.float32: DType.FLOAT32,
    torch.float8_e4m3fn: DType.FLOAT8_E4M3FN,
    torch.float8_e5m2: DType.FLOAT8_E5M2,
}
FAST = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@dataclass(frozen=True, slots=True, kw_only=True)
class Cache:
    """One side's paged cache and the request's page table."""

    regions: list[torch.Tensor]
    layout: Layout
    block_size: int
    heads: int
    pages: torch.Tensor

    @property
    def geometry(self) -> KVGeometry:
        first = self.regions[0]
        return KVGeometry(
            tp_size=1,
            tp_rank=0,
            num_layers=1,
            num_kv_heads=self.heads,
            head_dim=first.shape[-1],
            dtype=DTYPES[first.dtype],
            block_size=self.block_size,
            layout=self.layout,
            mla=False,
            num_blocks=first.shape[0],
        )

    def span(self, start: int, end: int, head_offset: int) -> dict[str, Any]:
        """The cache-side keyword arguments of gather/scatter for these tokens."""
        return {
            "layout": self.layout,
            "pages": self.pages,
            "start_token": start,
            "end_token": end,
            "head_offset": head_offset,
        }


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (NaNs included)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def make_cache(
    *,
    seed: int,
    layout: Layout,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_tokens: int,
    num_regions: int = 2,
    spare_pages: int = 1,
    interleaved: bool = False,
    device: str = "cpu",
) -> Cache:
    """Random regions and a random non-contiguous page table covering ``num_tokens``.

    ``interleaved`` makes each pair of regions views of one ``(pages, 2, ...)`` tensor, so the
    page stride is twice the page size.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = -(-num_tokens // block_size)
    num_blocks = needed + spare_pages + 1
    page = (block_size, heads, head_dim) if layout is Layout.NHD else (heads, block_size, head_dim)
    if interleaved:
        pairs = [random_bits((num_blocks, 2, *page), dtype, gen, device) for _ in range(-(-num_regions // 2))]
        regions = [pair[:, plane] for pair in pairs for plane in (0, 1)][:num_regions]
    else:
        regions = [random_bits((num_blocks, *page), dtype, gen, device) for _ in range(num_regions)]
    pages = torch.randperm(num_blocks, generator=gen)[:needed].to(torch.int32).to(device)
    return Cache(regions=regions, layout=layout, block_size=block_size, heads=heads, pages=pages)


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """A drawn copy: cache geometry, contents seed, token range and head slice."""

    num_regions: int
    layout: Layout
    block_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    spare_pages: int
    interleaved: bool
    seed: int
    start: int
    end: int
    head_offset: int
    head_count: int

    def cache(self, *, contiguous: bool = False) -> Cache:
        return make_cache(
            seed=self.seed,
            layout=self.layout,
            block_size=self.block_size,
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            num_tokens=self.end,
            num_regions=self.num_regions,
            spare_pages=self.spare_pages,
            interleaved=self.interleaved and not contiguous,
        )

    def staging(self, seed: int) -> torch.Tensor:
        """Random staging bytes of this copy's shape."""
        shape = (self.num_regions, self.end - self.start, self.head_count, self.head_dim)
        return random_bits(shape, self.dtype, torch.Generator().manual_seed(seed))


@st.composite
def cases(draw: st.DrawFn, *, max_tokens: int = 40) -> Case:
    """A cache with random bytes, a token range inside its page table and a head slice."""
    heads = draw(st.integers(1, 4))
    head_offset = draw(st.integers(0, heads - 1))
    start = draw(st.integers(0, 20))
    return Case(
        num_regions=draw(st.integers(1, 3)),
        layout=draw(st.sampled_from(Layout)),
        block_size=draw(st.integers(1, 16)),
        heads=heads,
        head_dim=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        dtype=draw(st.sampled_from(list(DTYPES))),
        spare_pages=draw(st.integers(0, 3)),
        interleaved=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
        start=start,
        end=start + draw(st.integers(0, max_tokens)),
        head_offset=head_offset,
        head_count=draw(st.integers(1, heads - head_offset)),
    )


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a.cpu()), bits(b.cpu()))


def all_same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(same_bytes(x, y) for x, y in zip(a, b, strict=True))


def cell_offset(cache: Cache, token: int, head: int) -> int:
    """Byte offset of a token's head inside its region, from the geometry model."""
    return cache.geometry.byte_offset(int(cache.pages[token // cache.block_size]), token % cache.block_size, head)


def torch_gather(src: Any, **args: Any) -> torch.Tensor:
    """The torch reference's gather, through the one contract (``kernels.gather``)."""
    return kernels.gather(src, backend="torch", **args)


def torch_scatter(staging: torch.Tensor, dst: Any, **args: Any) -> None:
    """The torch reference's scatter, through the one contract (``kernels.scatter``)."""
    kernels.scatter(staging, dst, backend="torch", **args)


def staged_rows(staging: torch.Tensor) -> list[list[bytes]]:
    """``[r][t * head_count + h]``: the bytes of each staged head."""
    r, t, h, d = staging.shape
    flat = bits(staging).reshape(r, t * h, d * staging.element_size())
    return [[bytes(row.tolist()) for row in region] for region in flat]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# --- reference against an independent element loop ----------------------------------------


@FAST
@given(case=cases(max_tokens=12))
def test_reference_gather_matches_element_loop(case: Case) -> None:
    """The reference gather puts every byte where the geometry model says it lives."""
    cache = case.cache(contiguous=True)
    span = cache.span(case.start, case.end, case.head_offset)
    out = torch_gather(cache.regions, **span, head_count=case.head_count)
    size = cache.geometry.head_bytes
    want = []
    for region in cache.regions:
        flat = bits(region).flatten().tolist()
        want.append([
            bytes(flat[cell_offset(cache, t, h) + j] for j in range(size))
            for t in range(case.start, case.end)
            for h in range(case.head_offset, case.head_offset + case.head_count)
        ])
    assert staged_rows(out) == want


@FAST
@given(case=cases(max_tokens=12))
def test_reference_scatter_writes_only_staged_cells(case: Case) -> None:
    """The reference scatter writes each staged head into its cell and no other byte."""
    cache = case.cache(contiguous=True)
    staging = case.staging(case.seed + 1)
    want = [bytearray(bits(region).flatten().tolist()) for region in cache.regions]
    for r, rows in enumerate(staged_rows(staging)):
        for i, row in enumerate(rows):
            offset = cell_offset(cache, case.start + i // case.head_count, case.head_offset + i % case.head_count)
            want[r][offset : offset + len(row)] = row
    torch_scatter(staging, cache.regions, **cache.span(case.start, case.end, case.head_offset))
    assert [bytes(bits(region).flatten().tolist()) for region in cache.regions] == [bytes(w) for w in want]


# --- Triton (interpreter) against the reference ---------------------------------------------


@FAST
@given(case=cases())
def test_cpu_gather_matches_reference(case: Case) -> None:
    """The page-run CPU gather equals the reference byte for byte, strided pages included."""
    cache = case.cache()
    span = cache.span(case.start, case.end, case.head_offset)
    want = kernels.gather(cache.regions, **span, head_count=case.head_count, backend="torch")
    got = kernels.gather(cache.regions, **span, head_count=case.head_count, backend="cpu")
    assert same_bytes(got, want)


@FAST
@given(case=cases())
def test_cpu_scatter_matches_reference(case: Case) -> None:
    """The page-run CPU scatter leaves the destination byte-identical to the reference's."""
    cache = case.cache()
    staging = case.staging(case.seed + 1)
    twin = [region.clone() for region in cache.regions]
    span = cache.span(case.start, case.end, case.head_offset)
    kernels.scatter(staging, cache.regions, **span, backend="cpu")
    kernels.scatter(staging, twin, **span, backend="torch")
    assert all_same_bytes(cache.regions, twin)


@needs_triton
@FAST
@given(case=cases())
def test_triton_gather_matches_reference(interpret: None, case: Case) -> None:
    """Interpreted Triton gather equals the reference byte for byte, strided pages included."""
    cache = case.cache()
    span = cache.span(case.start, case.end, case.head_offset)
    want = kernels.gather(cache.regions, **span, head_count=case.head_count, backend="torch")
    got = kernels.gather(cache.regions, **span, head_count=case.head_count, backend="triton")
    assert same_bytes(got, want)


@needs_triton
@FAST
@given(case=cases(), runs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 48)), min_size=1, max_size=5),
       joined=st.booleans())
def test_triton_state_block_rides_in_the_staging_launch(interpret: None, case: Case, runs: list[tuple[int, int]],
                                                        joined: bool) -> None:
    """A state block (runs of absolute addresses, ``triton_kernels.Slots.fixed``) moved in a gather's or a
    scatter's launch, single or joined, lands as a pattern copy of its own would, and the token rows
    are those of the launch without it."""
    from kvproto.kernels import pattern
    from kvproto.kernels.triton_kernels import Slots

    cache = case.cache()
    span = cache.span(case.start, case.end, case.head_offset)
    if case.start == case.end:  # a piece has tokens: the kernels refuse a block without any
        with pytest.raises(StagingError, match="at least one token"):
            kernels.gather(cache.regions, **span, head_count=case.head_count, backend="triton",
                           slots=Slots(None, torch.zeros((1, 5), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)))
        return
    gen = torch.Generator().manual_seed(case.seed)
    state = torch.randint(0, 256, (128,), dtype=torch.uint8, generator=gen)
    block = torch.zeros(sum(n for _, n in runs), dtype=torch.uint8)
    offsets = [sum(n for _, n in runs[:i]) for i in range(len(runs))]
    src = [state.data_ptr() + at for at, _ in runs]
    dst = [block.data_ptr() + at for at in offsets]
    plan = pattern.plan_pattern(torch.tensor([src, dst, [n for _, n in runs]]).T.numpy(), regions=1)
    slots = Slots.fixed(plan, plan.tiles, torch.zeros(1, dtype=torch.int64))
    want = kernels.gather(cache.regions, **span, head_count=case.head_count, backend="torch")
    if joined:
        got = torch.empty((2 * case.num_regions, *want.shape[1:]), dtype=want.dtype)
        regions = kernels.Regions(cache.regions)
        kernels.copy_joined([regions, regions], got, _joint_table([cache, cache]), layout=cache.layout,
                            start_token=case.start, end_token=case.end, head_offset=case.head_offset,
                            to_staging=True, slots=slots)
        got = got[:case.num_regions]
    else:
        got = kernels.gather(cache.regions, **span, head_count=case.head_count, backend="triton", slots=slots)
    assert same_bytes(got, want)
    assert torch.equal(block, torch.cat([state[at:at + n] for at, n in runs]))
    back = torch.zeros_like(state)
    plan = pattern.plan_pattern(torch.tensor([dst, [back.data_ptr() + at for at, _ in runs],
                                              [n for _, n in runs]]).T.numpy(), regions=1)
    staging = case.staging(case.seed + 1)
    twin = [r.clone() for r in cache.regions]
    kernels.scatter(staging, cache.regions, **span, backend="triton",
                    slots=Slots.fixed(plan, plan.tiles, torch.zeros(1, dtype=torch.int64)))
    kernels.scatter(staging, twin, **span, backend="torch")
    assert all_same_bytes(cache.regions, twin)
    for at, n in runs:  # overlapping runs: the last writer of a byte wins, as in any copy order here
        assert torch.equal(back[at:at + n], state[at:at + n])


def _joint_table(caches: list[Cache]) -> torch.Tensor:
    """Every cache's pages back to back, then each region's offset into them (``copy_joined``)."""
    starts, at = [], 0
    for cache in caches:
        starts += [at] * len(cache.regions)
        at += len(cache.pages)
    return torch.cat([c.pages.to(torch.int64) for c in caches] + [torch.tensor(starts, dtype=torch.int64)])


@needs_triton
@FAST
@given(case=cases(), other_pool=st.integers(0, 3), other_regions=st.integers(1, 3))
def test_triton_joined_copy_of_two_groups_matches_reference(interpret: None, case: Case, other_pool: int,
                                                            other_regions: int) -> None:
    """Two groups of one page shape, own pools (sizes differ) and own page tables, gathered in one
    launch equal the two reference gathers back to back; the joined scatter of random staging
    equals the two reference scatters."""
    first = case.cache()
    second = make_cache(seed=case.seed + 7, layout=case.layout, block_size=case.block_size, heads=case.heads,
                        head_dim=case.head_dim, dtype=case.dtype, num_tokens=case.end, num_regions=other_regions,
                        spare_pages=other_pool)
    if first.regions[0].stride(0) != second.regions[0].stride(0):  # interleaved planes: another page stride
        second = make_cache(seed=case.seed + 7, layout=case.layout, block_size=case.block_size, heads=case.heads,
                            head_dim=case.head_dim, dtype=case.dtype, num_tokens=case.end, num_regions=other_regions,
                            spare_pages=other_pool, interleaved=True)
    caches = [first, second]
    groups = [kernels.Regions(c.regions) for c in caches]
    if len({(g.shape[1:], g.page_stride) for g in groups}) != 1:
        return  # one interleaved tensor per region pair: an odd count leaves a region of its own
    span = dict(layout=case.layout, start_token=case.start, end_token=case.end, head_offset=case.head_offset)
    want = torch.cat([kernels.gather(c.regions, pages=c.pages, **span, head_count=case.head_count, backend="torch")
                      for c in caches])
    got = torch.empty_like(want)
    kernels.copy_joined(groups, got, _joint_table(caches), **span, to_staging=True)
    assert same_bytes(got, want)
    staging = random_bits(tuple(want.shape), case.dtype, torch.Generator().manual_seed(case.seed + 1))
    twins = [[region.clone() for region in c.regions] for c in caches]
    kernels.copy_joined(groups, staging, _joint_table(caches), **span, to_staging=False)
    at = 0
    for cache, twin in zip(caches, twins, strict=True):
        n = len(cache.regions)
        kernels.scatter(staging[at:at + n], twin, pages=cache.pages, **span, backend="torch")
        at += n
        assert all_same_bytes(cache.regions, twin)


@needs_triton
@FAST
@given(case=cases())
def test_triton_scatter_matches_reference(interpret: None, case: Case) -> None:
    """Interpreted Triton scatter leaves the destination byte-identical to the reference's."""
    cache = case.cache()
    staging = case.staging(case.seed + 1)
    twin = [region.clone() for region in cache.regions]
    span = cache.span(case.start, case.end, case.head_offset)
    kernels.scatter(staging, cache.regions, **span, backend="triton")
    kernels.scatter(staging, twin, **span, backend="torch")
    assert all_same_bytes(cache.regions, twin)


@needs_triton
@FAST
@given(
    case=cases(max_tokens=30),
    decode_layout=st.sampled_from(Layout),
    decode_block=st.integers(1, 16),
    decode_extra_heads=st.integers(0, 2),
)
def test_triton_roundtrip_converts_block_size_and_layout(
    interpret: None, case: Case, decode_layout: Layout, decode_block: int, decode_extra_heads: int
) -> None:
    """Gather at (Bp, Lp) then scatter at (Bd, Ld) equals the reference and moves every head."""
    source = case.cache()
    target = make_cache(
        seed=case.seed + 2,
        layout=decode_layout,
        block_size=decode_block,
        heads=case.head_count + decode_extra_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        num_tokens=case.end,
        num_regions=case.num_regions,
        spare_pages=2,
    )
    decode_offset = decode_extra_heads // 2
    twin = [region.clone() for region in target.regions]
    for backend, regions in (("triton", target.regions), ("torch", twin)):
        staging = kernels.gather(
            source.regions,
            **source.span(case.start, case.end, case.head_offset),
            head_count=case.head_count,
            backend=backend,
        )
        kernels.scatter(staging, regions, **target.span(case.start, case.end, decode_offset), backend=backend)
    assert all_same_bytes(target.regions, twin)
    moved = torch_gather(
        target.regions, **target.span(case.start, case.end, decode_offset), head_count=case.head_count
    )
    assert same_bytes(moved, staging)


@needs_triton
def test_triton_gather_fills_given_out(interpret: None) -> None:
    """Triton gather writes into a caller's ``out`` and returns that very tensor."""
    cache = make_cache(
        seed=5, layout=Layout.HND, block_size=4, heads=2, head_dim=8, dtype=torch.bfloat16, num_tokens=10
    )
    out = torch.full((2, 10, 1, 8), float("nan"), dtype=torch.bfloat16)
    got = kernels.gather(cache.regions, **cache.span(0, 10, 1), head_count=1, out=out, backend="triton")
    assert got is out
    assert same_bytes(out, torch_gather(cache.regions, **cache.span(0, 10, 1), head_count=1))


@needs_triton
def test_triton_empty_range_is_a_no_op(interpret: None) -> None:
    """An empty token range gathers an empty tensor and scatters nothing."""
    cache = make_cache(
        seed=6, layout=Layout.NHD, block_size=4, heads=2, head_dim=4, dtype=torch.float16, num_tokens=8
    )
    before = [region.clone() for region in cache.regions]
    empty = kernels.gather(cache.regions, **cache.span(3, 3, 0), head_count=2, backend="triton")
    assert empty.shape == (2, 0, 2, 4)
    kernels.scatter(empty, cache.regions, **cache.span(3, 3, 0), backend="triton")
    assert all_same_bytes(cache.regions, before)


@needs_triton
def test_triton_region_table_is_cached_per_region_list() -> None:
    """The region pointer table is built once per list of base addresses."""
    from kvproto.kernels.triton_kernels import region_table

    regions = [torch.zeros(2, 2, 2, 2) for _ in range(3)]
    table = region_table(regions).tensor
    assert region_table(list(regions)).tensor is table
    assert table.tolist() == [region.data_ptr() for region in regions]
    assert region_table(regions[:2]).tensor is not table


@needs_triton
def test_triton_regions_keep_their_table(interpret: None) -> None:
    """A Regions object looks its table up once and gives the same results as a plain list."""
    from kvproto.kernels.triton_kernels import region_table

    cache = make_cache(
        seed=8, layout=Layout.NHD, block_size=4, heads=2, head_dim=8, dtype=torch.float16, num_tokens=9,
        num_regions=3,
    )
    regions = kernels.Regions(cache.regions)
    got = kernels.gather(regions, **cache.span(2, 9, 1), head_count=1, backend="triton")
    assert region_table(regions) is regions.table
    assert same_bytes(got, kernels.gather(cache.regions, **cache.span(2, 9, 1), head_count=1, backend="torch"))


# --- dispatch and argument checks ----------------------------------------------------------


def test_kernels_import_does_not_import_triton() -> None:
    """Importing kvproto.kernels leaves Triton unimported."""
    root = Path(kvproto.__file__).parent.parent
    code = "import sys, kvproto.kernels; sys.exit('triton' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


def test_dispatch_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for Triton on CPU tensors without TRITON_INTERPRET=1 is refused."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = make_cache(seed=9, layout=Layout.NHD, block_size=4, heads=2, head_dim=8, dtype=torch.float32, num_tokens=4)
    with pytest.raises(StagingError, match="TRITON_INTERPRET"):
        kernels.gather(cache.regions, **cache.span(0, 4, 0), head_count=1, backend="triton")


def test_dispatch_auto_on_cpu_matches_reference() -> None:
    """backend='auto' on CPU tensors (the page-run copies) gives the reference result."""
    cache = make_cache(
        seed=7, layout=Layout.NHD, block_size=2, heads=3, head_dim=4, dtype=torch.float32, num_tokens=5
    )
    span = cache.span(1, 5, 1)
    want = torch_gather(cache.regions, **span, head_count=2)
    assert same_bytes(kernels.gather(cache.regions, **span, head_count=2), want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"regions": []}, "at least one region"),
        ({"regions": [torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 4)]}, "region 1"),
        ({"regions": [torch.zeros(2, 4, 2, 8)[:, :, :1]]}, "dense"),
        ({"start_token": 5, "end_token": 4}, "not a range"),
        ({"head_offset": 1, "head_count": 2}, "outside"),
        ({"end_token": 9}, "page entry"),
        ({"pages": torch.tensor([0, 2])}, r"outside \[0, 2\)"),
        ({"pages": torch.tensor([[0, 1]])}, "1-D"),
        ({"pages": torch.tensor([0.0, 1.0])}, "int32/int64"),
        ({"out": torch.zeros(1, 8, 1, 8, dtype=torch.float16)}, "staging is"),
        ({"out": torch.zeros(1, 8, 2, 8).transpose(1, 2)}, "staging is"),
        ({"out": torch.zeros(1, 8, 2, 8)[:, :, :1]}, "contiguous"),
    ],
)
def test_gather_rejects_bad_arguments(change: dict[str, Any], message: str) -> None:
    """Every malformed copy is refused with a StagingError before anything is copied."""
    args: dict[str, Any] = {
        "regions": [torch.zeros(2, 4, 2, 8)],
        "layout": Layout.NHD,
        "pages": torch.tensor([0, 1]),
        "start_token": 0,
        "end_token": 8,
        "head_offset": 1,
        "head_count": 1,
        "out": None,
    }
    args.update(change)
    regions = args.pop("regions")
    with pytest.raises(StagingError, match=message):
        kernels.gather(regions, **args)


def test_scatter_rejects_staging_of_wrong_rank() -> None:
    """A staging tensor that is not 4-D is refused."""
    with pytest.raises(StagingError, match="4-D"):
        kernels.scatter(
            torch.zeros(1, 4, 8),
            [torch.zeros(2, 4, 2, 8)],
            layout=Layout.NHD,
            pages=torch.tensor([0]),
            start_token=0,
            end_token=4,
            head_offset=0,
        )


# --- compiled kernels on a GPU -------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layouts", [(Layout.NHD, Layout.HND), (Layout.HND, Layout.NHD), (Layout.NHD, Layout.NHD)])
def test_cuda_roundtrip_matches_reference(dtype: torch.dtype, layouts: tuple[Layout, Layout]) -> None:
    """Compiled gather then scatter across block sizes and layouts equals the reference on CUDA."""
    common = {"head_dim": 128, "dtype": dtype, "num_tokens": 700, "num_regions": 6, "device": "cuda"}
    source = make_cache(seed=11, layout=layouts[0], block_size=16, heads=8, spare_pages=40, **common)
    target = make_cache(seed=12, layout=layouts[1], block_size=64, heads=4, spare_pages=5, **common)
    twin = [region.clone() for region in target.regions]
    staged = {}
    for backend, regions in (("triton", target.regions), ("torch", twin)):
        staged[backend] = kernels.gather(source.regions, **source.span(37, 683, 4), head_count=4, backend=backend)
        kernels.scatter(staged[backend], regions, **target.span(37, 683, 0), backend=backend)
    assert same_bytes(staged["triton"], staged["torch"])
    assert all_same_bytes(target.regions, twin)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_path", ["bounce", "mapped"])
def test_cuda_host_staging_roundtrip(host_path: str) -> None:
    """Gather into pinned memory and scatter from it, on a side stream, match the reference."""
    common = {"head_dim": 128, "dtype": torch.bfloat16, "num_tokens": 300, "num_regions": 4, "device": "cuda"}
    source = make_cache(seed=13, layout=Layout.NHD, block_size=16, heads=8, spare_pages=9, **common)
    target = make_cache(seed=14, layout=Layout.HND, block_size=32, heads=2, spare_pages=3, **common)
    twin = [region.clone() for region in target.regions]
    pinned = torch.empty((4, 295, 2, 128), dtype=torch.bfloat16, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.gather(source.regions, **source.span(5, 300, 2), head_count=2, out=pinned, backend="triton",
                       host_path=host_path)
        kernels.scatter(pinned, target.regions, **target.span(5, 300, 0), backend="triton", host_path=host_path)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    want = torch_gather(source.regions, **source.span(5, 300, 2), head_count=2)
    assert same_bytes(pinned, want)
    torch_scatter(want, twin, **target.span(5, 300, 0))
    assert all_same_bytes(target.regions, twin)


@pytest.mark.gpu
@needs_cuda
def test_cuda_dispatch_runs_on_given_stream() -> None:
    """gather(stream=...) enqueues on that stream: an event recorded there covers the copy."""
    source = make_cache(
        seed=15, layout=Layout.HND, block_size=16, heads=4, head_dim=64, dtype=torch.float16, num_tokens=100,
        num_regions=3, spare_pages=4, device="cuda",
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out = kernels.gather(source.regions, **source.span(0, 100, 1), head_count=2, stream=stream)
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    assert same_bytes(out, torch_gather(source.regions, **source.span(0, 100, 1), head_count=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_warm_up_compiles_every_head_count_without_touching_the_cache() -> None:
    """warm_up runs one gather per head count on dummy tensors: the cache keeps its bytes."""
    from kvproto.kernels import Regions, warm_up

    regions = Regions([torch.randint(0, 100, (8, 16, 4, 64), device="cuda").to(torch.bfloat16) for _ in range(3)])
    before = [r.clone() for r in regions]
    assert warm_up(regions, layout=0, head_counts=[4, 2, 1], to_staging=False) == 3
    assert warm_up(regions, layout=0, head_counts=[4, 2, 1], to_staging=True) == 3
    assert all(torch.equal(a, b) for a, b in zip(regions, before))


@pytest.mark.gpu
@needs_cuda
def test_launches_after_the_first_of_a_specialisation_skip_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first launch of a specialisation goes through Triton's JIT and keeps its compiled
    kernel; later ones (other tokens, other bytes) call its launcher directly and move the same
    bytes the reference does."""
    from kvproto.kernels import launcher, triton_kernels

    source = make_cache(
        seed=21, layout=Layout.NHD, block_size=16, heads=4, head_dim=64, dtype=torch.bfloat16, num_tokens=200,
        num_regions=3, spare_pages=4, device="cuda",
    )
    assert not launcher._jit_only(), "this Triton's launches cannot skip the JIT: nothing to test"
    kernel = triton_kernels._kernel(False)
    jit = []
    real = type(kernel).run
    monkeypatch.setattr(type(kernel), "run", lambda self, *a, **k: jit.append(1) or real(self, *a, **k))
    for start, end in ((0, 100), (37, 200), (100, 164)):
        out = kernels.gather(source.regions, **source.span(start, end, 1), head_count=2, backend="triton")
        torch.cuda.synchronize()
        assert same_bytes(out, torch_gather(source.regions, **source.span(start, end, 1), head_count=2))
    assert len(jit) <= 1  # the first of this specialisation (none where an earlier test launched it)
    known = [v for k, v in launcher._compiled.items() if k[0] == id(kernel)]
    assert known and all(v is not False for v in known)
