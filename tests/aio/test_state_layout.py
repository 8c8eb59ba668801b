"""State in vLLM's page layout, end to end: sectioned conv states, slots a page apart, one buffer.

A GDN-shaped hybrid laid out as vLLM 0.33 lays it out (``kvproto.reference``, ``page_layout="vllm"``):
per full-attention layer one buffer of pages, each block either a fused K|V page of the attention
layer or a GDN layer's states side by side (conv state ``[Q | K | V]`` at offset 0, the temporal
state after it, padding), so the state tensors are views of slots a page apart and every group's
regions overlap in the one buffer. Rooms move across TP 1 -> 2 and 2 -> 1 over every data path
(NIXL descriptor rows, the staged path's state block by run, by kernel and inside a staging launch,
loopback, the simulated adapter, the kernel path on CPU memory) and are checked by content, never by
plan. Peers of an older minor are refused exactly as the spec says, and the prefill addresses the
decode's slots at the decode's stride.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from kvproto.aio import DecodeEndpoint, KVCache, PrefillEndpoint, StateCache, TransferFailed
from kvproto.demo import DemoConfig
from kvproto.reference import PagedShape, RankCache, StateShape
from kvproto.transport import MemoryRegion, available_transports
from kvproto.wire import (
    CacheGroups,
    ErrorCode,
    RegisterAccept,
    RegisterReject,
    WireGroupLayout,
    WireTensorLayout,
)

from .conftest import config
from .test_hybrid import Case, _RawDecode, run_hybrid_room

NIXL = pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")
TPS = [(1, 2), (2, 1)]
TP_IDS = ["tp1-2", "tp2-1"]

# Two full-attention layers (model layers 1 and 3; 4 KV heads, K and V of 8 each, fused) and two GDN
# layers (0 and 2): conv state (32 channels = Q 8 | K 8 | V 16, kernel 4: 3 columns kept) channel-major,
# split per section; temporal state 4 heads of 4 x 6 fp32, split on its heads.
FULL = PagedShape("full", (1, 3), 4, 16, False, fused=True)
GDN = StateShape("gdn", (0, 2), ((32, 3), (4, 4, 6)), ("bf16", "fp32"), (0, 0), salt=1, sections=((8, 8, 16), None))
GDN_SD = dataclasses.replace(GDN, shapes=((3, 32), (4, 4, 6)), shard=(1, 0))  # channel-minor conv state


def vllm_case(p_tp: int, d_tp: int, *, transport: str = "loopback", path: str = "auto", decode_block: int = 16,
              state: StateShape = GDN, page_layout: dict[str, str] | None = None) -> Case:
    """A room of 106 tokens over 8 blocks a rank: the state slot is block 1 (a page into the
    buffer) and the room's pages of block 16 are all 7 others, the last included (a page the
    regions of the state tensors, which start inside the buffer, do not reach: registered as
    their union, NIXL finds it)."""
    cfg = DemoConfig(rooms=1, layers=2, kv_heads=4, head_dim=16, dtype="bf16", prefill_tp=p_tp, decode_tp=d_tp,
                     prefill_block=16, decode_block=decode_block, blocks=8, tokens=106, chunk_tokens=32, seed=9,
                     transport=transport, path=path, page_layout="vllm")
    return Case(cfg, (FULL, state), {"full": 16}, {"full": decode_block}, {"full": "NHD"}, {"full": "NHD"},
                1 << 20, page_layout=page_layout)


# --- the caches themselves ---------------------------------------------------------------------------
def test_state_layout_vllm_cache_is_one_buffer_per_layer() -> None:
    """The reference vLLM cache: the state tensors are slots a page apart inside the attention layers'
    buffers (sections declared), the groups' regions overlap, and the transport registers each
    buffer once (plus the aux buffer) while REGISTER still lists every region."""
    case = vllm_case(1, 2)
    cache = RankCache(torch, case.cfg, tp=2, rank=1, block=16, layout="NHD", aux_slots=1, shapes=list(case.shapes))
    page = 16 * 2 * 16 * 2  # block x local heads x (K + V) x bf16
    state = cache.kv.groups[0]
    assert isinstance(state, StateCache)
    assert state.slot_strides == [page, page] and state.group.tensors[0].sections == (8, 8, 16)
    assert state.group.slot_bytes(2) == [16 * 3 * 2, 2 * 4 * 6 * 4]
    assert [r.address for r in state.regions()] == [
        b.data_ptr() + off for b in cache.buffers for off in (0, 16 * 3 * 2)]
    regions = cache.kv.memory_regions()
    assert sorted((r.address, r.length) for r in regions) == sorted(
        [(b.data_ptr(), b.numel()) for b in cache.buffers] + [(cache.aux.data_ptr(), cache.aux.numel())])
    assert len(cache.kv.wire_regions()) == 2 + 1 + 4  # the full group's 2 regions, aux, gdn's 2 x 2
    assert cache.kv.wire_layouts() == (WireGroupLayout(tensors=(
        WireTensorLayout(sections=(8, 8, 16), slot_stride=page), WireTensorLayout(sections=(), slot_stride=page))),)


def test_state_layout_from_tensors_takes_slot_views_and_refuses_what_is_not_one() -> None:
    """``StateCache.from_tensors`` takes ``(slots, *shape)`` views whose slots are C-contiguous and a
    stride apart (the stride and region lengths follow), and refuses slots that are not contiguous,
    overlap, or lie apart differently from layer to layer; ``sections`` are checked to split."""
    page = 256
    buf = [torch.zeros(5 * page, dtype=torch.uint8) for _ in range(2)]  # a layer's pages each
    conv = [b.view(torch.bfloat16).as_strided((5, 6, 3), (page // 2, 3, 1), 0) for b in buf]
    ssm = [b.view(torch.float32).as_strided((5, 2, 4), (page // 4, 4, 1), 36 // 4) for b in buf]
    cache = StateCache.from_tensors("s", [[c, s] for c, s in zip(conv, ssm)], shard_dims=[0, 0],
                                    sections=[(4, 8), None], tp_size=2, tp_rank=1)
    assert cache.slot_strides == [page, page] and cache.group.tensors[0].sections == (4, 8)
    assert cache.region_lengths() == [4 * page + 36, 4 * page + 32] * 2
    assert [r.address for r in cache.regions()] == [buf[0].data_ptr(), buf[0].data_ptr() + 36,
                                                   buf[1].data_ptr(), buf[1].data_ptr() + 36]
    packed = StateCache.from_tensors("s", [[torch.zeros(5, 6, 3, dtype=torch.bfloat16)]], shard_dims=[0])
    assert packed.group.slot_strides == () and packed.slot_strides == [36]
    with pytest.raises(ValueError, match="not slots of C-contiguous"):  # a slot that is not contiguous
        StateCache.from_tensors("s", [[torch.zeros(5, 3, 6, dtype=torch.bfloat16).transpose(1, 2)]], shard_dims=[0])
    with pytest.raises(ValueError, match="they overlap"):
        StateCache.from_tensors("s", [[torch.zeros(1, 18, dtype=torch.bfloat16).expand(5, 18)]], shard_dims=[0])
    with pytest.raises(ValueError, match="as far apart as layer 0's"):
        StateCache.from_tensors("s", [[conv[0]], [torch.zeros(5, 6, 3, dtype=torch.bfloat16)]], shard_dims=[0])
    with pytest.raises(ValueError, match=r"state group 's': .*section of size 3\) does not split over TP 2"):
        StateCache.from_tensors("s", [[conv[0]]], shard_dims=[0], sections=[(3, 9)], tp_size=2)


# --- rooms over every data path ----------------------------------------------------------------------
@NIXL
@pytest.mark.nixl
@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["sliced", "auto"])
@pytest.mark.parametrize("tps", TPS, ids=TP_IDS)
async def test_state_layout_vllm_gdn_room_over_nixl(tps: tuple[int, int], path: str) -> None:
    """A GDN hybrid in vLLM's pages (attention pages and state slots in one buffer per layer, the conv
    state [Q | K | V] split per section) moves byte-exact through real NIXL on CPU memory across TP
    1 -> 2 and 2 -> 1: the state as descriptor rows at each side's page stride (sliced), or in the
    staged pieces' state block (auto: the TP mismatch stages)."""
    paths = await run_hybrid_room(vllm_case(*tps, transport="nixl", path=path), room_id=61, transport="nixl")
    assert paths == ({"sliced", "state"} if path == "sliced" else {"staged-cpu", "state"}), paths


@NIXL
@pytest.mark.nixl
@pytest.mark.asyncio
async def test_state_layout_vllm_gdn_room_over_nixl_same_tp_direct() -> None:
    """Same TP: whole attention pages (direct) and whole state slots, a page apart, over NIXL."""
    paths = await run_hybrid_room(vllm_case(2, 2, transport="nixl"), room_id=62, transport="nixl")
    assert paths == {"direct", "state"}, paths


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["loopback", "simulated"])
@pytest.mark.parametrize("state", [GDN, GDN_SD], ids=["DS", "SD"])
@pytest.mark.parametrize("tps", TPS, ids=TP_IDS)
async def test_state_layout_vllm_gdn_room_over_loopback_and_simulated(tps: tuple[int, int], state: StateShape,
                                                                      transport: str) -> None:
    """The same over loopback and the simulated adapter, with the conv state channel-major (DS) and
    channel-minor (SD), sliced and staged (a decode block of 32)."""
    await run_hybrid_room(vllm_case(*tps, state=state, path="sliced"), room_id=63, transport=transport)
    paths = await run_hybrid_room(vllm_case(*tps, state=state, decode_block=32), room_id=64, transport=transport)
    assert paths == {"staged-cpu", "state"}, paths


@pytest.mark.asyncio
@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 2)], ids=["tp1-2", "tp2-1", "tp2-2"])
async def test_state_layout_vllm_gdn_room_over_the_kernel_path(tps: tuple[int, int]) -> None:
    """The kernel path (``cuda-ipc``, its kernels in Triton's interpreter on these CPU caches): a
    state slot is one strided-rows kernel over its runs, at each side's page stride."""
    paths = await run_hybrid_room(vllm_case(*tps, state=GDN_SD), room_id=65, transport="cuda-ipc",
                                  options={"fallback": "loopback", "cpu_kernels": True})
    assert "state" in paths and paths <= {"direct-kernel", "sliced-kernel", "state"}, paths


@pytest.mark.asyncio
@pytest.mark.parametrize("tps", TPS, ids=TP_IDS)
async def test_state_layout_state_block_by_the_pattern_kernel(tps: tuple[int, int], monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Staged, with the state block moved by the pattern kernel (Triton's interpreter here, as on a
    CUDA cache with device staging): one launch per piece that ends the prompt on each side (two
    links: two gathers, two scatters) moves the strided, sectioned slots byte-exact. (The block
    riding inside a token launch is ``tests/aio/test_state_block.py``'s.)"""
    from kvproto.aio import staging
    from kvproto.kernels import pattern

    launches: list[int] = []
    real = pattern.launch
    monkeypatch.setattr(staging, "_joins", lambda buf: True)
    monkeypatch.setattr(pattern, "launch", lambda *a, **k: (launches.append(1), real(*a, **k)))
    paths = await run_hybrid_room(vllm_case(*tps, decode_block=32), room_id=66)
    assert paths == {"staged-cpu", "state"} and len(launches) == 4, (paths, launches)


@pytest.mark.asyncio
async def test_state_layout_strided_prefill_packed_decode() -> None:
    """Strides are each side's own: a prefill in vLLM's pages moves into a decode whose slots lie back
    to back (and back), both TP directions, byte-exact."""
    for p, d, paged in ((1, 2, "prefill"), (2, 1, "decode"), (2, 1, "prefill"), (1, 2, "decode")):
        layouts = {"prefill": "", "decode": ""} | {paged: "vllm"}
        await run_hybrid_room(vllm_case(p, d, path="sliced", page_layout=layouts), room_id=67 + p)


# --- older peers -----------------------------------------------------------------------------------------
def _as_minor3(monkeypatch: pytest.MonkeyPatch, side: str) -> None:
    """Make ``side``'s endpoint a version 1.3 peer: its frames say minor 3, its CACHE_GROUPS carry no
    layouts, and it reads none from its peer's."""
    from kvproto.aio import decode as decode_module
    from kvproto.aio import prefill as prefill_module
    from kvproto.wire import encode

    def old(msg: Any, **_: Any) -> bytes:
        return encode(dataclasses.replace(msg, layouts=()) if isinstance(msg, CacheGroups) else msg, minor=3)

    module = prefill_module if side == "prefill" else decode_module
    monkeypatch.setattr(module, "MINOR", 3)
    endpoint = PrefillEndpoint if side == "prefill" else DecodeEndpoint
    monkeypatch.setattr(endpoint, "_encode", lambda self, msg: old(msg))
    if side == "prefill":
        from kvproto.aio import prefill_links  # where a REGISTER is checked

        monkeypatch.setattr(prefill_links, "MINOR", 3)
        real = prefill_links.check_register
        monkeypatch.setattr(prefill_links, "check_register", lambda *a, **kw: real(*a, **{**kw, "layouts": ()}))
    else:
        monkeypatch.setattr(decode_module, "encode", old)
        groups = decode_module.groups_from_wire
        monkeypatch.setattr(decode_module, "groups_from_wire", lambda first, wire, layouts=(): groups(first, wire))


async def _refused(prefill_state: StateShape, decode_state: StateShape, *, prefill_pages: str = "",
                   decode_pages: str = "") -> TransferFailed:
    """The bootstrap of a room (TP 1 -> 1) between caches of these state groups and page layouts
    fails; the decode's state slot stays zero."""
    cfg = vllm_case(1, 1).cfg
    src = RankCache(torch, cfg, tp=1, rank=0, block=16, layout="NHD", aux_slots=1, shapes=[FULL, prefill_state],
                    page_layout=prefill_pages)
    dst = RankCache(torch, cfg, tp=1, rank=0, block=16, layout="NHD", aux_slots=1, shapes=[FULL, decode_state],
                    page_layout=decode_pages)
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        slots = dst.take_slots()
        room = decode.open_room(5, prefill.address, pages=dst.take(1), num_tokens=16, state_slots=slots)
        with pytest.raises(TransferFailed) as info:
            await asyncio.wait_for(room.wait(), 10)
        assert all(t[slots["gdn"]].count_nonzero() == 0 for layer in dst.states["gdn"].tensors for t in layer)
    return info.value


@pytest.mark.asyncio
async def test_state_layout_strided_decode_refuses_a_minor3_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode whose state slots lie a page apart refuses a version 1.3 prefill (it would write them
    back to back) at its REGISTER_ACCEPT: INCOMPATIBLE_GEOMETRY naming the group, nothing moved."""
    _as_minor3(monkeypatch, "prefill")
    plain = dataclasses.replace(GDN, sections=())
    exc = await _refused(plain, plain, decode_pages="vllm")
    assert exc.code == ErrorCode.INCOMPATIBLE_GEOMETRY, exc
    assert "group 'gdn': its slots lie" in exc.reason and "version 1.3 cannot address" in exc.reason, exc.reason


@pytest.mark.asyncio
@pytest.mark.parametrize("older", ["prefill", "decode"])
async def test_state_layout_sections_refuse_a_minor3_peer(older: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sectioned conv states with a version 1.3 peer (whose own conv state is one section: it cannot
    list more): refused on whichever side checks first, INCOMPATIBLE_GEOMETRY naming the group and
    the older version."""
    _as_minor3(monkeypatch, older)
    plain = dataclasses.replace(GDN, sections=())
    exc = await (_refused(plain, GDN) if older == "prefill" else _refused(GDN, plain))
    assert exc.code == ErrorCode.INCOMPATIBLE_GEOMETRY, exc
    assert "group 'gdn': tensor 0's sections differ" in exc.reason and "before state layouts" in exc.reason, exc.reason


@pytest.mark.asyncio
async def test_state_layout_sections_must_agree() -> None:
    """Between two 1.4 peers, a conv state sectioned on one side only is refused, naming the group."""
    exc = await _refused(GDN, dataclasses.replace(GDN, sections=()))
    assert exc.code == ErrorCode.INCOMPATIBLE_GEOMETRY
    assert "group 'gdn': tensor 0's sections differ: (8, 8, 16) on the prefill, one on the decode" in exc.reason


# --- what the prefill checks of the decode's layouts ------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ["stride_past_region", "huge_stride", "paged_layout", "tensor_count",
                                 "short_stride"])
async def test_state_layout_prefill_checks_the_decodes_layouts(bad: str) -> None:
    """The prefill addresses decode slots at the decode's registered stride, so it checks it: a stride
    that would put the last slot past the registered region, or beyond 2**63 (a group of one slot,
    whose stride no region length bounds), is INDEX_OUT_OF_RANGE; a layout that
    describes no cache (a paged group's with tensors, the wrong tensor count, slots closer than their
    bytes) INCOMPATIBLE_GEOMETRY naming the group. The honest layouts are accepted."""
    case = vllm_case(1, 1)
    src = RankCache(torch, case.cfg, tp=1, rank=0, block=16, layout="NHD", aux_slots=1, shapes=list(case.shapes))
    dst = RankCache(torch, case.cfg, tp=1, rank=0, block=16, layout="NHD", aux_slots=1, shapes=list(case.shapes))
    honest = dst.kv.wire_layouts()
    (gdn,) = honest
    conv, ssm = gdn.tensors
    wrong = {
        "stride_past_region": (WireGroupLayout(tensors=(dataclasses.replace(conv, slot_stride=conv.slot_stride + 16),
                                                        ssm)),),
        "huge_stride": (WireGroupLayout(tensors=(dataclasses.replace(conv, slot_stride=2**64 - 1), ssm)),),
        "paged_layout": None,  # below: a layout for a paged group
        "tensor_count": (WireGroupLayout(tensors=(conv,)),),
        "short_stride": (WireGroupLayout(tensors=(dataclasses.replace(conv, slot_stride=8), ssm)),),
    }[bad]
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill:
        raw = _RawDecode(dst, prefill.address)
        try:
            groups = dst.kv.wire_groups()
            if bad == "huge_stride":  # one slot: no region length bounds the stride
                groups = (dataclasses.replace(groups[0], num_slots=1),)
            if bad == "paged_layout":  # the group listed as paged, its layout a state group's
                from kvproto.wire import GroupKind, WireGeometry

                geometry = WireGeometry(tp_size=1, tp_rank=0, num_layers=2, num_kv_heads=1, head_dim=8, dtype=2,
                                        block_size=16, layout=0, mla=1, num_blocks=4)
                groups = (dataclasses.replace(groups[0], kind=GroupKind.PAGED, geometry=geometry, num_layers=0,
                                              num_slots=0, tensors=()),)
                wrong = honest
            await raw.send(CacheGroups(link_id=42, groups=groups, layouts=wrong))
            await raw.send(raw.register())
            reply = await raw.recv()
            assert isinstance(reply, RegisterReject), reply
            out_of_range = bad in ("stride_past_region", "huge_stride")
            want = ErrorCode.INDEX_OUT_OF_RANGE if out_of_range else ErrorCode.INCOMPATIBLE_GEOMETRY
            assert reply.code == want and "group 'gdn'" in reply.reason, reply
            await raw.send(CacheGroups(link_id=42, groups=dst.kv.wire_groups(), layouts=honest))
            await raw.send(raw.register())
            assert isinstance(await raw.recv(), CacheGroups)
            assert isinstance(await raw.recv(), RegisterAccept)
        finally:
            raw.close()


def test_state_layout_memory_regions_register_overlaps_once() -> None:
    """``KVCache.memory_regions``: two paged groups aliasing one layer's tensor (vLLM's groups overlay
    one buffer) and a state group inside it are registered as that buffer once."""
    buf = torch.zeros(8 * 256, dtype=torch.uint8)
    pages = buf.view(torch.bfloat16).view(8, 4, 2, 16)
    first = KVCache.from_tensors([[pages]], kv_fused=True, num_kv_heads=2)
    alias = KVCache.from_tensors([[pages]], kv_fused=True, num_kv_heads=2, name="swa", window=8)
    state = StateCache.from_tensors("s", [[buf.view(torch.float32).as_strided((8, 4, 2), (64, 2, 1), 4)]],
                                    shard_dims=[None])
    kv = first.with_groups(alias, state)
    assert kv.memory_regions() == [MemoryRegion(buf.data_ptr(), buf.numel())]
    assert [r.length for r in kv.wire_regions()] == [buf.numel(), buf.numel(), 7 * 256 + 32]


@pytest.mark.asyncio
@pytest.mark.parametrize("tps", TPS, ids=TP_IDS)
async def test_state_layout_demo_gdn_preset_in_vllm_pages(tps: tuple[int, int]) -> None:
    """``kvproto demo --preset gdn --page-layout vllm``'s model: vLLM's four groups of equal layers
    (full attention with fused K|V, three of GDN layers with [Q | K | V] conv states), all over one
    buffer per full-attention layer, moved byte-exact across TP both ways, staged and sliced."""
    from kvproto.reference import model_groups

    cfg = DemoConfig(rooms=1, layers=2, kv_heads=4, head_dim=64, dtype="bf16", prefill_tp=tps[0], decode_tp=tps[1],
                     prefill_block=16, decode_block=32, blocks=12, tokens=90, chunk_tokens=32, seed=4,
                     transport="loopback", preset="gdn", page_layout="vllm")
    shapes = tuple(model_groups(cfg))
    assert [s.name for s in shapes] == ["full", "gdn0", "gdn1", "gdn2"]
    case = Case(cfg, shapes, {"full": 16}, {"full": 32}, {"full": "NHD"}, {"full": "HND"}, 1 << 20)
    assert await run_hybrid_room(case, room_id=71) == {"staged-cpu", "state"}
    sliced = dataclasses.replace(case, cfg=dataclasses.replace(cfg, path="sliced"))
    assert await run_hybrid_room(sliced, room_id=72) == {"sliced", "state"}
