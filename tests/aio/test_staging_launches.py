"""A staged piece's launch on the GPU is made and checked once per shape and run again for the
later pieces of that shape with their own pointers (``kvproto.aio.staging._copy_parts``,
``triton_kernels._Launch.again``). Those later pieces must move exactly what the checked path
moves, token blocks and state block alike, both ways."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvproto.aio import KVCache, StateCache
from kvproto.aio.staging import CacheKernels, Copies, StagingBuffer, pair_piece

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _hybrid(seed: int) -> KVCache:
    """Two paged groups of one page shape (their blocks share a launch) and a state group."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(-1000, 1000, shape, generator=gen).to(torch.bfloat16).to("cuda")

    def group(layers: list[int], **kw: object) -> KVCache:
        return KVCache.from_tensors([[rand(40, 16, 4, 32) for _ in layers] for _ in range(2)], tp_size=1, tp_rank=0,
                                    num_kv_heads=4, model_layers=layers, **kw)

    state = StateCache.from_tensors("state", [[rand(8, 4, 64)] for _ in range(3)], shard_dims=[0],
                                    model_layers=[0, 1, 2])
    return group([3]).with_groups(group([0, 1, 2], name="lin"), state)


@pytest.mark.parametrize("kind", ["one group", "hybrid"])
def test_later_pieces_of_a_shape_run_the_first_ones_launch_and_move_the_same_bytes(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvproto.kernels import triton_kernels

    rng = random.Random(5)
    kv = _hybrid(1) if kind == "hybrid" else KVCache.from_tensors(
        [[torch.randn(40, 16, 4, 32, device="cuda").to(torch.bfloat16) for _ in range(4)] for _ in range(2)],
        tp_size=1, tp_rank=0, num_kv_heads=4)
    geometry = kv.cache_geometry
    buf = StagingBuffer(kv, 8 << 20)
    kern = CacheKernels(kv)
    copies = Copies(torch.device("cuda"), kern.uploads)
    state = 2 if kind == "hybrid" else None
    again: list[int] = []
    real = triton_kernels._Launch.again
    monkeypatch.setattr(triton_kernels._Launch, "again", lambda self, *a: again.append(1) or real(self, *a))

    def run(piece, offset, pages, start, end, slots, gather):  # noqa: ANN001, ANN202
        copies.run(lambda stream: piece.copy(buf, offset, 1, [pages] * (1 + len(kv.groups)), start=start, end=end,
                                             slots=slots, keep=False, stream=stream, gather=gather), lambda: None)

    # pieces of 32 tokens at several starts (one shape, run again), one of 20 (a second shape)
    spans = [(0, 32), (32, 64), (64, 96), (16, 48), (40, 60)]
    for gather in (True, False):
        piece = pair_piece(kern, geometry, geometry, side="prefill" if gather else "decode", minor=3, buf=buf)
        checked = dataclasses.replace(piece, launches=None)  # every piece through the checked path
        assert (piece.block is not None) == (kind == "hybrid")
        for i, (start, end) in enumerate(spans):
            pages = rng.sample(range(40), 7)
            slots = {state: rng.randrange(8)} if state is not None and i % 2 == 0 else None
            nbytes = (end - start) * piece.unit + (piece.tail if slots else 0)
            if gather:
                run(piece, 0, pages, start, end, slots, True)
                run(checked, 4 << 20, pages, start, end, slots, True)
                torch.cuda.synchronize()
                copies.poll()
                assert torch.equal(buf.tensor[:nbytes], buf.tensor[4 << 20:(4 << 20) + nbytes]), (start, end)
            else:  # scatter random bytes, gather them back through the checked path: the same bytes
                buf.tensor[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
                run(piece, 0, pages, start, end, slots, False)
                back = pair_piece(kern, geometry, geometry, side="prefill", minor=3, buf=buf)
                run(dataclasses.replace(back, launches=None), 4 << 20, pages, start, end, slots, True)
                torch.cuda.synchronize()
                copies.poll()
                assert torch.equal(buf.tensor[:nbytes], buf.tensor[4 << 20:(4 << 20) + nbytes]), (start, end)
    # each direction: the 32-token pieces after the first of their shape (with a block, without)
    assert len(again) == (2 * 2 if kind == "hybrid" else 2 * 3), again


def _tp_hybrid(tp: int, rank: int) -> KVCache:
    """The model of ``_hybrid`` (4 KV heads, a state of 8 rows) on rank ``rank`` of TP ``tp``."""
    def group(layers: list[int], **kw: object) -> KVCache:
        return KVCache.from_tensors([[torch.zeros(40, 16, 4 // tp, 32, dtype=torch.bfloat16, device="cuda")
                                      for _ in layers] for _ in range(2)], tp_size=tp, tp_rank=rank, num_kv_heads=4,
                                    model_layers=layers, **kw)

    state = StateCache.from_tensors("state", [[torch.zeros(8, 8 // tp, 64, dtype=torch.bfloat16, device="cuda")]
                                              for _ in range(3)], shard_dims=[0], tp_size=tp, tp_rank=rank,
                                    model_layers=[0, 1, 2])
    return group([3]).with_groups(group([0, 1, 2], name="lin"), state)


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (1, 1)])
def test_the_start_up_warm_up_compiles_every_launch_a_hybrid_pair_makes(
        tps: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_kernels`` (an endpoint's start) compiles the launches that carry a pair's state block
    for peers of other TP sizes too: a pair's pieces, of an odd and an even page count, both ways,
    then find every kernel compiled (a kernel compiled in a room costs it ~100 ms)."""
    from kvproto.aio.staging import state_launches, warm_kernels
    from kvproto.kernels import launcher

    monkeypatch.setattr(launcher, "_compiled", {})  # what this test's launches compile, from nothing
    prefill, decode = _tp_hybrid(tps[0], 0), _tp_hybrid(tps[1], tps[1] - 1)
    for kv, gather in ((prefill, True), (decode, False)):
        buf = StagingBuffer(kv, 8 << 20)
        kern = CacheKernels(kv)
        launches = state_launches(kern, kv.cache_geometry, buf, gather=gather)
        assert launches and all(joined for _plan, _count, joined in launches)
        before = set(launcher._compiled)
        thread = warm_kernels(kv, kern, buf, gather=gather)
        assert thread is not None
        thread.join()
        warmed = set(launcher._compiled) - before
        assert any(("SLOTS", True) in key for key in warmed)
        piece = pair_piece(kern, prefill.cache_geometry, decode.cache_geometry,
                           side="prefill" if gather else "decode", minor=3, buf=buf)
        copies = Copies(torch.device("cuda"), kern.uploads)
        # pieces of at least a tile's rows (a smaller piece takes a smaller tile: its own kernel)
        for room, (start, end) in enumerate([(0, 96), (0, 80), (16, 96)]):  # 6 pages, 5 pages, a part of 6
            pages = list(range(5, 5 + -(-end // 16)))
            copies.run(lambda stream, s=start, e=end, p=pages, r=room: piece.copy(
                buf, 0, r, [p] * 3, start=s, end=e, slots={2: r}, keep=False, stream=stream, gather=gather),
                lambda: None)
            copies.finish()
        assert set(launcher._compiled) - before == warmed, "a room's launch compiled a kernel"
