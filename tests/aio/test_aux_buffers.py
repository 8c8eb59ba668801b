"""What an engine that gives raw addresses and pages needs of kvproto (SGLang's backend): aux buffers sharing
one slot index, rooms whose prefill skips the decode's prefix, caches given as raw addresses."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvproto.aio import AuxBuffer, DecodeEndpoint, KVCache, PrefillEndpoint, StateCache, TransferFailed
from kvproto.core import RoomState
from kvproto.wire import ErrorCode

from tests.aio.conftest import TRANSPORTS, config, make_cache

def aux_tensors(seed: int, slots: int = 6) -> list[torch.Tensor]:
    """Buffers shaped like SGLang's metadata: first token ids, float logprobs, a hidden-state row."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2**31 - 1, (slots, 16), dtype=torch.int32, generator=gen),
            torch.rand((slots, 3), generator=gen, dtype=torch.float32),
            torch.randint(0, 256, (slots, 40), dtype=torch.uint8, generator=gen)]


def with_aux(cache, tensors) -> KVCache:
    kv = cache.kv
    return KVCache(kv.geometry, kv.region_addresses, kv.mem_kind, kv.device_id, AuxBuffer.from_tensors(tensors),
                   owner=(kv.owner, tensors), tensors=kv.tensors)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_aux_buffers_slot_moves_in_every_buffer(transport: str) -> None:
    """Slot 2 of the prefill's three aux buffers lands in slot 5 of the decode's three; no other slot moves."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    src_aux, dst_aux = aux_tensors(3), aux_tensors(4)
    before = [t.clone() for t in dst_aux]
    async with PrefillEndpoint(with_aux(src, src_aux), config=config(transport)) as prefill, \
            DecodeEndpoint(with_aux(dst, dst_aux), config=config(transport)) as decode:
        rx = decode.open_room(9, prefill.address, pages=[3, 4], num_tokens=8, aux_slot=5)
        tx = prefill.open_room(9)
        tx.send([10, 11], 8, last=True, aux_slot=2)
        await rx.wait()
        await tx.wait()
    for s, d, b in zip(src_aux, dst_aux, before):
        assert torch.equal(d[5], s[2])
        assert torch.equal(d[:5], b[:5])
    assert torch.equal(dst.planes[0][1][4], src.planes[0][1][11])


@pytest.mark.asyncio
async def test_aux_buffers_that_differ_are_refused_at_registration() -> None:
    """Decode and prefill whose aux buffers differ in slot size: the room fails INCOMPATIBLE_GEOMETRY."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    other = aux_tensors(4)
    other[1] = torch.zeros((6, 4), dtype=torch.float32)
    async with PrefillEndpoint(with_aux(src, aux_tensors(3)), config=config("loopback")) as prefill, \
            DecodeEndpoint(with_aux(dst, other), config=config("loopback")) as decode:
        rx = decode.open_room(9, prefill.address, pages=[3, 4], num_tokens=8, aux_slot=5)
        with pytest.raises(TransferFailed) as info:
            await rx.wait()
    assert info.value.code is ErrorCode.INCOMPATIBLE_GEOMETRY
    assert "aux buffers" in info.value.reason


def test_aux_buffer_from_tensors_checks_slots() -> None:
    """Buffers of different slot counts are not one slot index; one tensor is the plain buffer."""
    with pytest.raises(ValueError, match="slots"):
        AuxBuffer.from_tensors([torch.zeros((4, 2)), torch.zeros((5, 2))])
    one = AuxBuffer.from_tensors([torch.zeros((4, 2), dtype=torch.int64)])
    assert (one.slot_bytes, one.slots, one.parts) == (16, 4, ())
    many = AuxBuffer.from_tensors(aux_tensors(0))
    assert many.slot_bytes == 64 + 12 + 40 and [n for _, n in many.buffers] == [64, 12, 40]


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endpoint_first_token_sends_only_past_the_decode_prefix(transport: str) -> None:
    """The decode holds 8 tokens and names placeholders for them; the prefill names pages from token
    8 on (first_token), learns the prefix from the room, and only tokens [8, 16) land."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    before = [[t.clone() for t in plane] for plane in dst.planes]
    async with PrefillEndpoint(src.kv, config=config(transport)) as prefill, \
            DecodeEndpoint(dst.kv, config=config(transport)) as decode:
        tx = prefill.open_room(4)
        rx = decode.open_room(4, prefill.address, pages=[0, 1, 20, 21], num_tokens=16, prefix_tokens=8)
        while tx.poll() is not RoomState.WAITING_FOR_INPUT:
            await asyncio.sleep(0.005)
        assert tx.decode_prefix == 8
        tx.send([30], 12, last=False, first_token=8)
        tx.send([31], 16, last=True)
        await rx.wait()
    for plane in range(2):
        for layer in range(2):
            assert torch.equal(dst.planes[plane][layer][20], src.planes[plane][layer][30])
            assert torch.equal(dst.planes[plane][layer][21], src.planes[plane][layer][31])
            assert torch.equal(dst.planes[plane][layer][0], before[plane][layer][0])
            assert torch.equal(dst.planes[plane][layer][1], before[plane][layer][1])


def pointer_cache(cache, *, tp: int = 1, rank: int = 0, heads: int = 2) -> KVCache:
    """The same memory as ``cache`` described from raw addresses (``KVCache.from_pointers``)."""
    k, v = cache.planes
    page = k[0][0].numel() * k[0].element_size()
    return KVCache.from_pointers([[t.data_ptr() for t in k], [t.data_ptr() for t in v]], page_bytes=page,
                                 region_bytes=k[0].numel() * k[0].element_size(), block_size=k[0].shape[1],
                                 tp_size=tp, tp_rank=rank, num_kv_heads=heads * tp,
                                 aux=AuxBuffer.from_tensor(cache.aux), owner=cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_from_pointers_cache_moves_like_the_tensors(transport: str) -> None:
    """A cache given as raw layer addresses (pages as bytes) pairs with another such cache and
    moves every byte of the room's pages, aux slot included."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(pointer_cache(src), config=config(transport, staging_bytes=0)) as prefill, \
            DecodeEndpoint(pointer_cache(dst), config=config(transport, staging_bytes=0)) as decode:
        rx = decode.open_room(5, prefill.address, pages=[7, 3, 9], num_tokens=10, aux_slot=1)
        tx = prefill.open_room(5)
        tx.send([2, 40, 41], 10, last=True, aux_slot=3)
        await rx.wait()
    for plane in range(2):
        for layer in range(2):
            for s_page, d_page in ((2, 7), (40, 3)):
                assert torch.equal(dst.planes[plane][layer][d_page], src.planes[plane][layer][s_page])
            assert torch.equal(dst.planes[plane][layer][9][:2], src.planes[plane][layer][41][:2])
    assert torch.equal(dst.aux[1], src.aux[3])


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if str(getattr(t, "values", [t])[0]) in ("loopback", "nixl")])
async def test_from_pointers_with_views_stages_between_tp_sizes(transport: str) -> None:
    """``views=True``: the regions are also uint8 tensors over the same pages (no copy), so a cache
    given as addresses can take the staged path: TP 1 -> 2 rooms stage, and every decode rank's pages
    hold its heads of the prefill's."""
    src = make_cache(seed=1)
    dsts = [make_cache(seed=2 + r, heads=1) for r in range(2)]

    def viewed(cache, tp: int, rank: int, heads: int) -> KVCache:
        k, v = cache.planes
        kv = KVCache.from_pointers([[t.data_ptr() for t in k], [t.data_ptr() for t in v]],
                                   page_bytes=k[0][0].numel() * k[0].element_size(),
                                   region_bytes=k[0].numel() * k[0].element_size(), block_size=k[0].shape[1],
                                   tp_size=tp, tp_rank=rank, num_kv_heads=heads * tp, owner=cache, views=True)
        assert all(t.data_ptr() == a for t, a in zip(kv.tensors, kv.region_addresses))
        return kv

    opts = dict(staging_bytes=1 << 20)
    async with PrefillEndpoint(viewed(src, 1, 0, 2), config=config(transport, **opts)) as prefill:
        decodes = [DecodeEndpoint(viewed(d, 2, r, 1), config=config(transport, instance="dec", **opts))
                   for r, d in enumerate(dsts)]
        for d in decodes:
            await d.start()
        try:
            rxs = [d.open_room(5, prefill.address, pages=[7, 3], num_tokens=7) for d in decodes]
            tx = prefill.open_room(5)
            tx.send([2, 40], 7, last=True)
            await asyncio.gather(*(rx.wait() for rx in rxs))
            assert any(p.startswith("staged") for p in tx.stats.paths), tx.stats.paths
        finally:
            for d in decodes:
                await d.close()
    for r, dst in enumerate(dsts):
        for plane in range(2):
            for layer in range(2):
                for s_page, d_page, n in ((2, 7, 4), (40, 3, 3)):
                    assert torch.equal(dst.planes[plane][layer][d_page][:n], src.planes[plane][layer][s_page][:n, r:r + 1])


def test_from_pointers_describes_pages_as_bytes() -> None:
    """Heads and head bytes come from the page size; pages that do not tile a layer are refused."""
    kv = KVCache.from_pointers([[1000, 2000], [3000, 4000]], page_bytes=1024, region_bytes=8192, block_size=16,
                               tp_size=2, tp_rank=1, num_kv_heads=4)
    g = kv.geometry
    assert (g.num_layers, g.local_heads, g.head_bytes, g.num_blocks, g.head_start) == (2, 2, 32, 8, 2)
    assert kv.region_addresses == (1000, 3000, 2000, 4000)
    with pytest.raises(ValueError, match="do not hold"):
        KVCache.from_pointers([[1], [2]], page_bytes=1000, region_bytes=8000, block_size=16, num_kv_heads=2)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_from_pointers_state_group_slot_moves_with_the_last_chunk(transport: str) -> None:
    """A hybrid cache given as addresses: the first group on model layers 0 and 2, a state group of
    two tensors (bytes per slot) on layer 1; a room whose prefill skips the decode's prefix moves
    its pages and its state slot (given with the last chunk) into another slot."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    gen = torch.Generator().manual_seed(5)
    states = [[torch.randint(0, 256, (4, n), dtype=torch.uint8, generator=gen) for n in (24, 40)] for _ in range(2)]

    def hybrid(cache, tensors):
        k, v = cache.planes
        kv = KVCache.from_pointers([[t.data_ptr() for t in k], [t.data_ptr() for t in v]],
                                   page_bytes=k[0][0].numel(), region_bytes=k[0].numel(), block_size=k[0].shape[1],
                                   num_kv_heads=2, owner=cache, model_layers=[0, 2])
        state = StateCache.from_pointers("mamba", [[t.data_ptr() for t in tensors]], slot_bytes=[24, 40], num_slots=4,
                                         model_layers=[1], owner=tensors)
        return kv.with_groups(state)

    async with PrefillEndpoint(hybrid(src, states[0]), config=config(transport, staging_bytes=0)) as prefill, \
            DecodeEndpoint(hybrid(dst, states[1]), config=config(transport, staging_bytes=0)) as decode:
        tx = prefill.open_room(6)
        rx = decode.open_room(6, prefill.address, pages=[0, 11, 12], num_tokens=12, prefix_tokens=4,
                              state_slots={"mamba": 3})
        while tx.poll() is not RoomState.WAITING_FOR_INPUT:
            await asyncio.sleep(0.005)
        tx.send([20, 21], 12, last=True, first_token=4, state_slots={"mamba": 1})
        await rx.wait()
    for t in range(2):
        assert torch.equal(states[1][t][3], states[0][t][1])
    for plane in range(2):
        for layer in range(2):
            assert torch.equal(dst.planes[plane][layer][11], src.planes[plane][layer][20])


# --- a state group given as addresses, described by shape, shard dimension and sections -----------------
# Per layer, per slot, as bytes: a conv state channel-major (32 channels = Q 8 | K 8 | V 16, 6 bytes each),
# the same channel-minor (3 rows of 32 channels, 2 bytes each: SGLang's Kimi layout), a temporal state
# (4 heads of 24 bytes) and a replicated vector of 5 bytes.
_SECTIONS = (8, 8, 16)
_STATE = [((32, 6), 0, _SECTIONS), ((3, 32, 2), 1, _SECTIONS), ((4, 24), 0, None), ((5,), None, None)]


def _held(size: int, sections: tuple[int, ...] | None, tp: int, rank: int) -> list[int]:
    """The global indices rank ``rank`` of ``tp`` holds along a split dimension, in its local order."""
    out, start = [], 0
    for n in sections or (size,):
        out += range(start + rank * n // tp, start + (rank + 1) * n // tp)
        start += n
    return out


def _rank_state(truth: list[torch.Tensor], tp: int, rank: int, slots: int, slot: int,
                gen: torch.Generator) -> list[torch.Tensor]:
    """One rank's ``(slots, *local shape)`` uint8 tensors: its share of ``truth`` in ``slot``, noise elsewhere."""
    out = []
    for whole, (_, dim, sections) in zip(truth, _STATE):
        share = whole if dim is None else whole.index_select(dim, torch.tensor(
            _held(whole.shape[dim], sections, tp, rank)))
        t = torch.randint(0, 256, (slots, *share.shape), dtype=torch.uint8, generator=gen)
        t[slot] = share
        out.append(t)
    return out


def _pointer_state(tensors: list[list[torch.Tensor]], tp: int, rank: int) -> StateCache:
    return StateCache.from_pointers("mamba", [[t.data_ptr() for t in layer] for layer in tensors],
                                    slot_bytes=[t[0].numel() for t in tensors[0]], num_slots=tensors[0][0].shape[0],
                                    shapes=[t.shape[1:] for t in tensors[0]], shard_dims=[d for _, d, _ in _STATE],
                                    sections=[s for _, _, s in _STATE], tp_size=tp, tp_rank=rank,
                                    model_layers=[2, 3], owner=tensors)


def test_from_pointers_state_shapes_and_sections_describe_the_tensors() -> None:
    """A state group given as addresses with per-slot shapes (bytes), shard dimensions and sections is
    the group ``from_tensors`` makes of the same memory; shapes that are not the slot's bytes,
    sections that do not add up or split over TP are refused."""
    gen = torch.Generator().manual_seed(3)
    for tp in (1, 2):
        truth = [torch.randint(0, 256, s, dtype=torch.uint8, generator=gen) for s, _, _ in _STATE]
        tensors = [_rank_state(truth, tp, tp - 1, 4, 0, gen) for _ in range(2)]
        given = _pointer_state(tensors, tp, tp - 1)
        made = StateCache.from_tensors("mamba", tensors, shard_dims=[d for _, d, _ in _STATE],
                                       sections=[s for _, _, s in _STATE], tp_size=tp, tp_rank=tp - 1,
                                       model_layers=[2, 3])
        assert given.group == made.group and given.region_addresses == made.region_addresses
        assert given.group.tensors[1].shape == (3, 32, 2) and given.group.tensors[1].sections == _SECTIONS
        assert given.group.slot_bytes(tp) == [t[0].numel() for t in tensors[0]]
    one = dict(slot_bytes=[12], num_slots=2)
    with pytest.raises(ValueError, match="not its 12 bytes"):
        StateCache.from_pointers("s", [[1]], shapes=[(4, 2)], **one)
    with pytest.raises(ValueError, match="do not add up"):
        StateCache.from_pointers("s", [[1]], shapes=[(6, 2)], shard_dims=[0], sections=[(2, 2)], **one)
    with pytest.raises(ValueError, match="does not split over TP 4"):
        StateCache.from_pointers("s", [[1]], shapes=[(6, 2)], shard_dims=[0], sections=[(6, 6, 12)], tp_size=4,
                                 **one)
    legacy = StateCache.from_pointers("s", [[1]], tp_size=2, **one).group.tensors[0]
    assert (legacy.shape, legacy.shard_dim, legacy.sections) == ((24,), 0, ())


@pytest.mark.asyncio
@pytest.mark.parametrize("tps", [(1, 2), (2, 1)], ids=["tp1-2", "tp2-1"])
async def test_from_pointers_sectioned_state_moves_across_tp(tps: tuple[int, int]) -> None:
    """A hybrid cache given as addresses, its state group described by shape, shard dimension and
    sections: between TP sizes each decode rank's slot holds exactly its share of every tensor
    (each section split on its own, channel-major and channel-minor alike, the replicated vector
    whole), and no other slot is written."""
    p_tp, d_tp = tps
    gen = torch.Generator().manual_seed(11)
    truth = [[torch.randint(0, 256, s, dtype=torch.uint8, generator=gen) for s, _, _ in _STATE] for _ in range(2)]
    pre = [[_rank_state(layer, p_tp, r, 4, 2, gen) for layer in truth] for r in range(p_tp)]
    dec = [[_rank_state(layer, d_tp, r, 4, 1, gen) for layer in truth] for r in range(d_tp)]
    for rank in dec:  # what the decode slot held before: noise
        for layer in rank:
            for t in layer:
                t[1] = torch.randint(0, 256, t[1].shape, dtype=torch.uint8, generator=gen)
    before = [[[t.clone() for t in layer] for layer in rank] for rank in dec]

    def hybrid(tp: int, rank: int, state: list[list[torch.Tensor]], seed: int) -> KVCache:
        kv = make_cache(seed=seed, tp=tp, rank=rank, heads=2 // tp, kv_heads=2).kv
        return kv.with_groups(_pointer_state(state, tp, rank))

    prefills = [PrefillEndpoint(hybrid(p_tp, 0, pre[0], 1), config=config("loopback", staging_bytes=0))]
    await prefills[0].start()
    decodes = []
    try:
        for r in range(1, p_tp):
            prefills.append(PrefillEndpoint(hybrid(p_tp, r, pre[r], 1 + r), bootstrap=prefills[0].address,
                                            config=config("loopback", staging_bytes=0)))
            await prefills[-1].start()
        for r in range(d_tp):
            decodes.append(DecodeEndpoint(hybrid(d_tp, r, dec[r], 5 + r),
                                          config=config("loopback", instance="decode", staging_bytes=0)))
            await decodes[-1].start()
        rooms = [ep.open_room(9, prefills[0].address, pages=[3], num_tokens=4, state_slots={"mamba": 1})
                 for ep in decodes]
        for ep in prefills:
            room = ep.open_room(9)
            room.send([5], 4, last=True, state_slots={"mamba": 2})
            rooms.append(room)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in rooms)), 30)
    finally:
        for ep in [*prefills[::-1], *decodes]:
            await ep.close()
    for r in range(d_tp):
        want = _rank_state([t for t in truth[0]], d_tp, r, 1, 0, gen), _rank_state(truth[1], d_tp, r, 1, 0, gen)
        for layer in range(2):
            for t, tensor in enumerate(dec[r][layer]):
                assert torch.equal(tensor[1], want[layer][t][0]), (r, layer, t)
                for slot in (0, 2, 3):
                    assert torch.equal(tensor[slot], before[r][layer][t][slot])
