"""A staged piece's state block (staging.md, minor 3): the runs of a pair's state slots gathered
after the token blocks on the prefill rank and scattered from there on the decode rank. The pattern
kernel (Triton's interpreter on CPU memory, as on the GPU) and the run-by-run copies must move the
same bytes, for any slots, wherever the block lies in the staging buffer."""

from __future__ import annotations

import math

import torch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.aio import KVCache, StateCache
from kvproto.aio.staging import StagingBuffer, StateBlock
from kvproto.geometry.groups import state_block


def _cache(tp: int, rank: int, seed: int, device: str = "cpu"
           ) -> tuple[KVCache, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """A first group and two state groups of TP rank ``rank`` of ``tp``: 'conv' (two tensors, one
    sharded over its middle dimension, one replicated, fp32 and bf16) and 'ssm' (one bf16 tensor
    sharded over rows), 6 slots each, filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(-100, 100, shape, generator=gen).to(dtype).to(device)

    kv = KVCache.from_tensors([[torch.zeros(4, 16, 4 // tp, 8, dtype=torch.bfloat16, device=device)]
                               for _ in range(2)],
                              tp_size=tp, tp_rank=rank, num_kv_heads=4)
    conv = [[rand(6, 3, 8 // tp, 5, dtype=torch.float32), rand(6, 7, dtype=torch.bfloat16)] for _ in range(3)]
    ssm = [[rand(6, 16 // tp, 12, dtype=torch.bfloat16)] for _ in range(2)]
    states = (StateCache.from_tensors("conv", conv, shard_dims=[1, None], tp_size=tp, tp_rank=rank),
              StateCache.from_tensors("ssm", ssm, shard_dims=[0], tp_size=tp, tp_rank=rank))
    return kv.with_groups(*states), conv, ssm


@settings(max_examples=25, deadline=None)
@given(tps=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]), data=st.data())
def test_state_block_kernel_and_runs_move_the_same_bytes(tps: tuple[int, int], data: st.DataObject) -> None:
    """Every decode rank's slots end up holding the prefill slots' overlap of its shard, through a
    block gathered and scattered by the kernel or run by run; bytes outside the slots stay untouched."""
    p_tp, d_tp = tps
    for d in range(d_tp):
        want_slots = {}
        for p in range(p_tp):
            src, src_conv, src_ssm = _cache(p_tp, p, seed=p)
            dst, dst_conv, dst_ssm = _cache(d_tp, d, seed=100 + d)
            runs = state_block(src.cache_geometry, dst.cache_geometry)
            if not runs:
                continue
            kernel = data.draw(st.booleans())
            src_buf, dst_buf = StagingBuffer(src, 1 << 16), StagingBuffer(dst, 1 << 16)
            unit = 64 * data.draw(st.integers(1, 4))
            at = unit * data.draw(st.integers(0, 8))
            states = {1: src.groups[0], 2: src.groups[1]}
            gather = StateBlock(runs, states, side="prefill", unit=unit, buf=src_buf, kernel=kernel)
            scatter = StateBlock(runs, {1: dst.groups[0], 2: dst.groups[1]}, side="decode", unit=unit, buf=dst_buf,
                                 kernel=data.draw(st.booleans()))
            s_slots = {1: data.draw(st.integers(0, 5)), 2: data.draw(st.integers(0, 5))}
            d_slots = {1: data.draw(st.integers(0, 5)), 2: data.draw(st.integers(0, 5))}
            gather.copy(src_buf, at, s_slots, gather=True, stream=None)
            dst_buf.tensor[at:at + gather.nbytes] = src_buf.tensor[at:at + gather.nbytes]  # the write
            before = [t.clone() for layer in dst_conv + dst_ssm for t in layer]
            scatter.copy(dst_buf, at, d_slots, gather=False, stream=None)
            after = [t for layer in dst_conv + dst_ssm for t in layer]
            for was, now in zip(before, after):  # only the named slots may change
                changed = (was != now).flatten(1).any(1).nonzero().flatten().tolist()
                assert set(changed) <= set(d_slots.values())
            # the overlap of the two shards, by hand
            for layer, (s_pair, d_pair) in enumerate(zip(src_conv, dst_conv)):
                sharded_src, sharded_dst = s_pair[0][s_slots[1]], d_pair[0][d_slots[1]]
                n = 8 // d_tp
                lo, hi = max(p * 8 // p_tp, d * n), min((p + 1) * 8 // p_tp, (d + 1) * n)
                if lo < hi:
                    assert torch.equal(sharded_dst[:, lo - d * n:hi - d * n], sharded_src[:, lo - p * 8 // p_tp:hi - p * 8 // p_tp])
                if p == d * p_tp // d_tp:  # the replica's writer
                    assert torch.equal(d_pair[1][d_slots[1]], s_pair[1][s_slots[1]])
            for s_layer, d_layer in zip(src_ssm, dst_ssm):
                n = 16 // d_tp
                lo, hi = max(p * 16 // p_tp, d * n), min((p + 1) * 16 // p_tp, (d + 1) * n)
                if lo < hi:
                    assert torch.equal(d_layer[0][d_slots[2]][lo - d * n:hi - d * n],
                                       s_layer[0][s_slots[2]][lo - p * 16 // p_tp:hi - p * 16 // p_tp])
            want_slots[p] = True
        assert want_slots, "some prefill rank writes state into every decode rank"


@settings(max_examples=20, deadline=None)
@given(tps=st.sampled_from([(1, 1), (1, 2), (2, 1)]), data=st.data())
def test_state_block_in_a_staging_launch_moves_what_its_runs_move(tps: tuple[int, int], data: st.DataObject) -> None:
    """``StateBlock.fused``: the block rides in a gather's and a scatter's staging launch (Triton's
    interpreter here) as tiles made once, the slots of its two groups and the block's place passed
    per piece; the block and the slots end up as the run-by-run copies leave them."""
    from kvproto import kernels

    p_tp, d_tp = tps
    src, _, _ = _cache(p_tp, 0, seed=3)
    dst, dst_conv, dst_ssm = _cache(d_tp, d_tp - 1, seed=4)
    runs = state_block(src.cache_geometry, dst.cache_geometry)
    if not runs:
        return
    unit = 2 * (4 // p_tp) * 8 * 2  # the first group's piece bytes per token on the prefill side
    src_buf, plain_buf = StagingBuffer(src, 1 << 16), StagingBuffer(src, 1 << 16)
    states = {1: src.groups[0], 2: src.groups[1]}
    fused = StateBlock(runs, states, side="prefill", unit=unit, buf=src_buf, kernel=True)
    plain = StateBlock(runs, states, side="prefill", unit=unit, buf=plain_buf, kernel=False)
    pages = torch.tensor([2, 0], dtype=torch.int64)
    regions = kernels.Regions(src.tensors)
    for piece in range(2):  # the same tiles, other slots and another place
        slots = {1: data.draw(st.integers(0, 5)), 2: data.draw(st.integers(0, 5))}
        tokens = data.draw(st.integers(1, 32))
        at = tokens * unit + 64 * data.draw(st.integers(0, 4))
        out = src_buf.view(0, (len(regions), tokens, 4 // p_tp, 8), torch.bfloat16)
        kernels.copy_joined([regions], out, pages, layout=0, start_token=0, end_token=tokens, head_offset=0,
                            to_staging=True, slots=fused.fused(src_buf, at, slots, gather=True))
        plain.copy(plain_buf, at, slots, gather=True, stream=None)
        assert torch.equal(src_buf.tensor[at:at + fused.nbytes], plain_buf.tensor[at:at + fused.nbytes])
        assert torch.equal(out, kernels.gather(regions, layout=0, pages=pages, start_token=0, end_token=tokens,
                                               head_offset=0, head_count=4 // p_tp, backend="torch"))
        # and back into the decode rank's slots, through a scatter's launch
        d_unit = 2 * (4 // d_tp) * 8 * 2
        twin, twin_conv, twin_ssm = _cache(d_tp, d_tp - 1, seed=4)
        for mine, was in zip(dst_conv + dst_ssm, twin_conv + twin_ssm):  # the twin as this rank's slots are
            for a, b in zip(mine, was):
                b.copy_(a)
        d_buf = StagingBuffer(dst, 1 << 16)
        d_at = tokens * d_unit + 64 * data.draw(st.integers(0, 4))
        d_buf.tensor[d_at:d_at + fused.nbytes] = src_buf.tensor[at:at + fused.nbytes]
        d_slots = {1: data.draw(st.integers(0, 5)), 2: data.draw(st.integers(0, 5))}
        into = StateBlock(runs, {1: dst.groups[0], 2: dst.groups[1]}, side="decode", unit=d_unit, buf=d_buf,
                          kernel=True)
        staging = d_buf.view(0, (len(dst.tensors), tokens, 4 // d_tp, 8), torch.bfloat16)
        kernels.copy_joined([kernels.Regions(dst.tensors)], staging, pages, layout=0, start_token=0,
                            end_token=tokens, head_offset=0, to_staging=False,
                            slots=into.fused(d_buf, d_at, d_slots, gather=False))
        twin_buf = StagingBuffer(twin, 1 << 16)
        twin_buf.tensor[d_at:d_at + fused.nbytes] = src_buf.tensor[at:at + fused.nbytes]
        StateBlock(runs, {1: twin.groups[0], 2: twin.groups[1]}, side="decode", unit=d_unit, buf=twin_buf,
                   kernel=False).copy(twin_buf, d_at, d_slots, gather=False, stream=None)
        for mine, want in zip(dst_conv + dst_ssm, twin_conv + twin_ssm):
            assert all(torch.equal(a, b) for a, b in zip(mine, want))


def test_state_block_kernel_is_one_launch_per_piece(monkeypatch) -> None:
    """With the kernel, a piece's whole state block (two groups, every layer and tensor) is one
    pattern launch each way; without it, one copy per run."""
    from kvproto.kernels import pattern

    launches = []
    real = pattern.launch
    monkeypatch.setattr(pattern, "launch", lambda *a, **k: (launches.append(a[0]), real(*a, **k)))
    src, _, _ = _cache(1, 0, seed=1)
    dst, _, _ = _cache(2, 1, seed=2)
    runs = state_block(src.cache_geometry, dst.cache_geometry)
    assert len(runs) == 3 * (3 + 1) + 2  # conv: 3 layers x (3 rows of the sharded tensor, the replica); ssm: 2
    buf = StagingBuffer(src, 1 << 16)
    block = StateBlock(runs, {1: src.groups[0], 2: src.groups[1]}, side="prefill", unit=128, buf=buf, kernel=True)
    block.copy(buf, 256, {1: 3, 2: 4}, gather=True, stream=None)
    assert len(launches) == 1
    plain = StateBlock(runs, {1: src.groups[0], 2: src.groups[1]}, side="prefill", unit=128, buf=buf, kernel=False)
    kernel_bytes = buf.tensor[256:256 + block.nbytes].clone()
    buf.tensor.zero_()
    plain.copy(buf, 256, {1: 3, 2: 4}, gather=True, stream=None)
    assert len(launches) == 1 and torch.equal(buf.tensor[256:256 + block.nbytes], kernel_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_block_on_the_gpu_kernel_matches_the_runs() -> None:
    """On a CUDA cache with device staging the block is one compiled pattern launch each way (picked
    by default); it moves the bytes the run-by-run copies do, and the decode slots get them."""
    src, src_conv, src_ssm = _cache(1, 0, seed=1, device="cuda")
    dst, dst_conv, dst_ssm = _cache(2, 1, seed=2, device="cuda")
    runs = state_block(src.cache_geometry, dst.cache_geometry)
    buf, out = StagingBuffer(src, 1 << 16), StagingBuffer(dst, 1 << 16)
    fast = StateBlock(runs, {1: src.groups[0], 2: src.groups[1]}, side="prefill", unit=4096, buf=buf)
    plain = StateBlock(runs, {1: src.groups[0], 2: src.groups[1]}, side="prefill", unit=4096, buf=buf, kernel=False)
    assert fast._kernel and not plain._kernel
    stream = torch.cuda.Stream()
    fast.copy(buf, 8192, {1: 5, 2: 1}, gather=True, stream=stream)
    plain.copy(buf, 4096, {1: 5, 2: 1}, gather=True, stream=stream)
    stream.synchronize()
    assert torch.equal(buf.tensor[8192:8192 + fast.nbytes], buf.tensor[4096:4096 + fast.nbytes])
    out.tensor[:fast.nbytes] = buf.tensor[8192:8192 + fast.nbytes]
    scatter = StateBlock(runs, {1: dst.groups[0], 2: dst.groups[1]}, side="decode", unit=4096, buf=out)
    assert scatter._kernel
    scatter.copy(out, 0, {1: 2, 2: 3}, gather=False, stream=stream)
    stream.synchronize()
    for s_layer, d_layer in zip(src_ssm, dst_ssm):
        assert torch.equal(d_layer[0][3], s_layer[0][1][8:16])
    for s_layer, d_layer in zip(src_conv, dst_conv):
        assert torch.equal(d_layer[0][2], s_layer[0][5][:, 4:8]) and torch.equal(d_layer[1][2], s_layer[1][5])


# --- slots inside pages, sections ------------------------------------------------------------------
def _paged(tp: int, rank: int, seed: int, pad: int, conv: str) -> tuple[KVCache, list[torch.Tensor], dict]:
    """A first group and a state group 'gdn' of 2 layers in vLLM's pages (one buffer of 6 pages per
    layer: the conv state at offset 0, the temporal state after it, ``pad`` bytes of padding): the
    conv state [Q | K | V] (8, 8, 16 channels, kernel 4) channel-major ("DS") or channel-minor
    ("SD"), split per section; the temporal state (8 heads of 2 x 6, fp32) split on its heads.
    Returns the cache, the page buffers (random bytes) and the global states by (layer, tensor)."""
    gen = torch.Generator().manual_seed(seed)
    conv_local = (32 // tp, 3) if conv == "DS" else (3, 32 // tp)
    sizes = (math.prod(conv_local) * 2, 8 // tp * 2 * 6 * 4)
    page = sizes[0] + sizes[1] + pad
    pages = [torch.randint(0, 256, (6 * page,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    layers = []
    for buf in pages:
        c = buf.view(torch.bfloat16).as_strided((6, *conv_local), (page // 2, conv_local[1], 1), 0)
        s = buf.view(torch.float32).as_strided((6, 8 // tp, 2, 6), (page // 4, 12, 6, 1), sizes[0] // 4)
        layers.append([c, s])
    kv = KVCache.from_tensors([[torch.zeros(4, 16, 4 // tp, 8, dtype=torch.bfloat16)] for _ in range(2)],
                              tp_size=tp, tp_rank=rank, num_kv_heads=4)
    state = StateCache.from_tensors("gdn", layers, shard_dims=[0 if conv == "DS" else 1, 0],
                                    sections=[(8, 8, 16), None], tp_size=tp, tp_rank=rank)
    return kv.with_groups(state), pages, {"page": page, "sizes": sizes, "layers": layers}


def _mine(whole: torch.Tensor, dim: int, sections: tuple[int, ...], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``whole``: its piece of each section along ``dim``, side by side."""
    parts, at = [], 0
    for size in sections:
        parts.append(whole.narrow(dim, at + rank * size // tp, size // tp))
        at += size
    return torch.cat(parts, dim)


@settings(max_examples=20, deadline=None)
@given(tps=st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]), conv=st.sampled_from(["DS", "SD"]),
       how=st.sampled_from(["runs", "kernel", "launch"]), data=st.data())
def test_state_block_slots_in_pages_with_sections(tps: tuple[int, int], conv: str, how: str,
                                                  data: st.DataObject) -> None:
    """State slots a page apart (vLLM), strides differing between the sides, the conv state's
    sections split each on its own: gathered by every prefill rank and scattered into each decode rank
    run by run, by the pattern kernel, or inside a gather's and a scatter's staging launch (Triton's
    interpreter), every decode slot holds its share of Q, K and V and of the heads, built here from
    the global state; no other byte of its pages changes."""
    from kvproto import kernels

    p_tp, d_tp = tps
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dim = 0 if conv == "DS" else 1
    glob = [(torch.randint(-50, 50, (32, 3) if conv == "DS" else (3, 32), generator=gen).to(torch.bfloat16),
             torch.randint(-50, 50, (8, 2, 6), generator=gen).to(torch.float32)) for _ in range(2)]
    src_slot, dst_slot = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 5))
    for d in range(d_tp):
        dst, dst_pages, dst_info = _paged(d_tp, d, 100 + d, data.draw(st.integers(0, 3)) * 4, conv)
        before = [b.clone() for b in dst_pages]
        for p in range(p_tp):
            src, _, src_info = _paged(p_tp, p, p, data.draw(st.integers(0, 3)) * 4, conv)
            for layer, (c, s) in enumerate(src_info["layers"]):
                c[src_slot] = _mine(glob[layer][0], dim, (8, 8, 16), p_tp, p)
                s[src_slot] = glob[layer][1][p * 8 // p_tp:(p + 1) * 8 // p_tp]
            runs = state_block(src.cache_geometry, dst.cache_geometry)
            if not runs:
                continue
            unit = 2 * (4 // p_tp) * 8 * 2
            src_buf, dst_buf = StagingBuffer(src, 1 << 16), StagingBuffer(dst, 1 << 16)
            kernel = how != "runs"
            gather = StateBlock(runs, {1: src.groups[0]}, side="prefill", unit=unit, buf=src_buf, kernel=kernel)
            d_unit = 2 * (4 // d_tp) * 8 * 2
            scatter = StateBlock(runs, {1: dst.groups[0]}, side="decode", unit=d_unit, buf=dst_buf, kernel=kernel)
            tokens = data.draw(st.integers(1, 8))
            at, d_at = tokens * unit, tokens * d_unit
            pages = torch.tensor([1], dtype=torch.int64)
            if how == "launch":  # the block rides in a token launch each way
                out = src_buf.view(0, (2, tokens, 4 // p_tp, 8), torch.bfloat16)
                kernels.copy_joined([kernels.Regions(src.tensors)], out, pages, layout=0, start_token=0,
                                    end_token=tokens, head_offset=0, to_staging=True,
                                    slots=gather.fused(src_buf, at, {1: src_slot}, gather=True))
            else:
                gather.copy(src_buf, at, {1: src_slot}, gather=True, stream=None)
            dst_buf.tensor[d_at:d_at + gather.nbytes] = src_buf.tensor[at:at + gather.nbytes]  # the write
            if how == "launch":
                staging = dst_buf.view(0, (2, tokens, 4 // d_tp, 8), torch.bfloat16)
                kernels.copy_joined([kernels.Regions(dst.tensors)], staging, pages, layout=0, start_token=0,
                                    end_token=tokens, head_offset=0, to_staging=False,
                                    slots=scatter.fused(dst_buf, d_at, {1: dst_slot}, gather=False))
            else:
                scatter.copy(dst_buf, d_at, {1: dst_slot}, gather=False, stream=None)
        for layer, (c, s) in enumerate(dst_info["layers"]):
            assert torch.equal(c[dst_slot], _mine(glob[layer][0], dim, (8, 8, 16), d_tp, d)), (layer, d, how)
            assert torch.equal(s[dst_slot], glob[layer][1][d * 8 // d_tp:(d + 1) * 8 // d_tp]), (layer, d, how)
        page, used = dst_info["page"], sum(dst_info["sizes"])
        for buf, was in zip(dst_pages, before):  # outside the slot's states, nothing moved
            keep = torch.ones(buf.numel(), dtype=torch.bool)
            keep[dst_slot * page:dst_slot * page + used] = False
            assert torch.equal(buf[keep], was[keep]), (d, how)
