"""``LinkPath``'s plain-integer plan of a direct write of a few pages (``_few_page_runs``) posts
exactly what the array plan (``pair_extents`` then ``_post_pages``) posts, places the same rows as
a part of a write of several groups (``part``, hybrid caches), and refuses the same bad page
lists."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.aio.memory import KVCache
from kvproto.aio.paths import SMALL_WRITE_PAGES, LinkPath, LocalLists
from kvproto.geometry import plan_pair
from kvproto.geometry.plan import PageListError
from kvproto.kernels.pattern import pair_extents
from kvproto.transport import MemKind

BLOCK, BLOCKS, LAYERS = 4, 32, 3


class _Recorder:
    """A transport that records what is posted (prepared lists are their rows)."""

    def __init__(self) -> None:
        self.posts: list[tuple[list[int], list[int]]] = []

    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> np.ndarray:
        return rows

    def post_prepared(self, peer: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                      tag: bytes) -> object:
        self.posts.append((np.asarray(local_idx).tolist(), np.asarray(remote_idx).tolist()))
        return object()


def _path() -> tuple[LinkPath, _Recorder]:
    planes = [[torch.zeros(BLOCKS, BLOCK, 2, 8, dtype=torch.float16) for _ in range(LAYERS)] for _ in range(2)]
    kv = KVCache.from_tensors(planes, num_kv_heads=2)
    rec = _Recorder()
    g = kv.geometry
    path = LinkPath(transport=rec, local=LocalLists(rec, kv),  # type: ignore[arg-type]
                    peer="peer", plan=plan_pair(g, g), remote=g, remote_bases=[1 << 20] * g.num_regions,
                    remote_kind=MemKind.DRAM, remote_device=0, remote_aux=None)
    return path, rec


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_few_pages_post_what_the_array_plan_posts(data: st.DataObject) -> None:
    path, rec = _path()
    n = data.draw(st.integers(1, SMALL_WRITE_PAGES))
    src = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True))
    dst = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True))
    start = data.draw(st.integers(0, n * BLOCK - 1))
    end = data.draw(st.integers(start + 1, n * BLOCK))
    layers = data.draw(st.sampled_from([None, (0, 1), (1, LAYERS), (0, LAYERS)]))
    few = path.post_kv(b"t", src, dst, start, end, layers)
    first, local_bases, _ = path._regions(layers)
    pattern = pair_extents(path.plan, src, dst, start, end)  # type: ignore[arg-type]
    full = path._post_pages(b"t", pattern, int(pattern[:, 2].sum()) * len(local_bases), first, len(local_bases))
    assert rec.posts[0] == rec.posts[1]
    assert (few.nbytes, few.descriptors) == (full.nbytes, full.descriptors)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_few_pages_as_a_part_place_the_rows_the_array_plan_places(data: st.DataObject) -> None:
    """Runs of consecutive pages merge on both sides, as ``pair_extents`` merges them."""
    path, _rec = _path()
    n = data.draw(st.integers(1, SMALL_WRITE_PAGES))
    first_src = data.draw(st.integers(0, BLOCKS - n))
    src = data.draw(st.one_of(st.just(list(range(first_src, first_src + n))),
                              st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True)))
    dst = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True))
    start = data.draw(st.integers(0, n * BLOCK - 1))
    end = data.draw(st.integers(start + 1, n * BLOCK))
    layers = data.draw(st.sampled_from([None, (0, 1), (1, LAYERS), (0, LAYERS)]))
    part = path.part(src, dst, start, end, layers)
    _first, local_bases, remote_bases = path._regions(layers)
    pattern = pair_extents(path.plan, src, dst, start, end)  # type: ignore[arg-type]
    local, remote = path._rows(pattern, local_bases, remote_bases)
    assert part.rows is not None
    assert np.array_equal(part.rows[0], local) and np.array_equal(part.rows[1], remote)
    assert part.nbytes == int(pattern[:, 2].sum()) * len(local_bases)


@pytest.mark.parametrize("src, dst, why", [
    ([0, BLOCKS], [0, 1], "source page 32 at index 1 is outside the pool"),
    ([0, 1], [-1, 1], "destination page -1 at index 0 is outside the pool"),
    ([0], [0, 1], "source page list has 1 pages"),
])
def test_few_pages_refuse_bad_page_lists_as_the_array_plan_does(src: list[int], dst: list[int], why: str) -> None:
    path, rec = _path()
    with pytest.raises(PageListError, match=why):
        path.post_kv(b"t", src, dst, 0, 2 * BLOCK)
    with pytest.raises(PageListError, match=why):
        path.part(src, dst, 0, 2 * BLOCK)
    with pytest.raises(PageListError, match=why):
        pair_extents(path.plan, src, dst, 0, 2 * BLOCK)  # type: ignore[arg-type]
    assert not rec.posts
