"""Windows the engine names (protocol 1.5, transfer.md "Windows the engine names").

A paged group with ``window=NAMED_WINDOW`` gets its pages with the prefill's last chunk only (the
pages its engine still holds: a sliding window's, an indexer's past the decode's prefix), and the
decode names the pages it needs from any page to the prompt's end. These tests move such rooms
through real endpoints (loopback and NIXL, TP both ways, chunked, with a decode prefix, layer-wise)
and check every byte the decode named, that nothing else of the group was written, and that a
decode needing tokens the prefill's engine no longer holds fails the room by its code.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kvproto.aio import DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.demo import DemoConfig
from kvproto.geometry import NAMED_WINDOW
from kvproto.reference import PagedShape, RankCache
from kvproto.wire import ErrorCode

from .conftest import TRANSPORTS, config

pytestmark = pytest.mark.asyncio

ENGINE_WINDOW = 40
"""The window both engines compute the named pages by (kvproto never sees it)."""


def _caches(tp: int, *, blocks: int = 64) -> list[RankCache]:
    cfg = DemoConfig(rooms=1, layers=2, kv_heads=4, head_dim=8, blocks=blocks, seed=3, transport="loopback")
    shapes = [PagedShape("full", (0, 2), 4, 8, False),
              PagedShape("swa", (1, 3), 4, 8, False, window=NAMED_WINDOW, salt=3)]
    return [RankCache(torch, cfg, tp=tp, rank=r, block=16, layout="NHD", aux_slots=2, shapes=shapes)
            for r in range(tp)]


def _named_from(n: int, prefix: int, block: int, window: int = ENGINE_WINDOW) -> int:
    """The first page an engine names of the group: SGLang's ``⌊max(prefix, n − window) / B⌋``."""
    return max(prefix, n - window) // block


async def _move(tps: tuple[int, int], *, n: int, prefix: int = 0, chunk: int = 48, transport: str = "loopback",
                decode_from: int | None = None, layerwise: bool = False) -> tuple[list[Any], list[Any], list[Any]]:
    """One room: the prefill names the group's last pages from ``_named_from`` with its last chunk,
    the decode from ``decode_from`` (default: the same rule). Returns the decode rooms, the decode
    caches with what each named, and the prefill rooms."""
    pre, dec = _caches(tps[0]), _caches(tps[1])
    first = PrefillEndpoint(pre[0].kv, config=config(transport))
    await first.start()
    prefills, decodes = [first], []
    try:
        for c in pre[1:]:
            ep = PrefillEndpoint(c.kv, bootstrap=first.address, config=config(transport))
            await ep.start()
            prefills.append(ep)
        for c in dec:
            ep = DecodeEndpoint(c.kv, config=config(transport, instance="decode-named"))
            await ep.start()
            decodes.append(ep)
        room_id = 7
        checks, d_rooms = [], []
        for ep, cache in zip(decodes, dec):
            part = cache.paged["swa"]
            pages = cache.take(-(-n // cache.block))
            start = _named_from(n, prefix, part.block) if decode_from is None else decode_from
            swa = [-1] * start + part.take(-(-n // part.block) - start)
            if prefix:
                cache.fill(room_id, pages, 0, prefix)
            before = [t.clone() for plane in part.tensors for t in plane]
            checks.append((cache, pages, swa, before))
            d_rooms.append(ep.open_room(room_id, first.address, pages=pages, num_tokens=n, prefix_tokens=prefix,
                                        group_pages={"swa": swa[start:]}))
        p_rooms = []
        for ep, cache in zip(prefills, pre):
            part = cache.paged["swa"]
            room = ep.open_room(room_id)
            held: list[int] = []
            swa = part.take(-(-n // part.block))  # the engine's pages of every token; it names the window's
            t = prefix
            while t < n:
                end = min(n, t + chunk)
                new = cache.take(-(-end // cache.block) - len(held) - prefix // cache.block)
                held += new
                room_pages = [0] * (prefix // cache.block) + held
                cache.fill(room_id, room_pages, t, end)
                part.fill(room_id, swa, t, end)
                last = end == n
                named = {"swa": swa[_named_from(n, prefix, part.block):]} if last else None
                first_token = prefix if t == prefix and prefix else 0
                if layerwise:
                    for layer in range(4):
                        room.send(new if layer == 0 else [], end, last=last, layers=range(layer, layer + 1),
                                  group_pages=named if layer == 0 else None,
                                  first_token=first_token if layer == 0 else 0)
                else:
                    room.send(new, end, last=last, group_pages=named, first_token=first_token)
                t = end
            p_rooms.append(room)
        results = await asyncio.wait_for(asyncio.gather(*(r.wait() for r in [*d_rooms, *p_rooms]),
                                                        return_exceptions=True), 30)
        return list(zip(d_rooms, results)), checks, p_rooms
    finally:
        for ep in [*prefills[::-1], *decodes]:
            await ep.close()


CASES = [((1, 1), 130, 0, 48), ((1, 2), 150, 0, 32), ((2, 1), 150, 32, 48), ((1, 1), 30, 0, 64),
         ((2, 2), 200, 128, 16)]


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if str(getattr(t, "values", [t])[0]) in
                                       ("loopback", "nixl", "cuda-ipc")])
@pytest.mark.parametrize("tps,n,prefix,chunk", CASES,
                         ids=[f"tp{a}to{b}-n{n}-prefix{p}-chunk{c}" for (a, b), n, p, c in CASES])
async def test_named_window_moves_the_tokens_the_decode_names_byte_exact(transport: str, tps: tuple[int, int],
                                                                         n: int, prefix: int, chunk: int) -> None:
    """The prefill's engine names the window's pages with its last chunk; every decode rank gets
    exactly the tokens ``[max(prefix, first named page), n)`` of the group, byte for byte, and the
    group's other pages stay as they were."""
    done, checks, _ = await _move(tps, n=n, prefix=prefix, chunk=chunk, transport=transport)
    for room, result in done:
        assert result is None, result
    for rank, (cache, pages, swa, before) in enumerate(checks):
        part = cache.paged["swa"]
        start = max(prefix, _named_from(n, prefix, part.block) * part.block)
        assert cache.check(7, pages, n) == 0, f"decode rank {rank}: the first group holds wrong bytes"
        assert part.check(7, swa, n, start) == 0, f"decode rank {rank}: the named window holds wrong bytes"
        named = {p for p in swa if p >= 0}
        after = [t for plane in part.tensors for t in plane]
        for b, a in zip(before, after):
            others = [p for p in range(len(a)) if p not in named]
            assert a[others].equal(b[others]), f"decode rank {rank}: a page it did not name was written"


async def test_named_window_layerwise_moves_each_layer_with_the_last_range() -> None:
    done, checks, _ = await _move((1, 2), n=150, chunk=64, layerwise=True)
    assert all(result is None for _, result in done), done
    for cache, pages, swa, _ in checks:
        part = cache.paged["swa"]
        assert cache.check(7, pages, 150) == 0
        assert part.check(7, swa, 150, _named_from(150, 0, part.block) * part.block) == 0


async def test_named_window_a_decode_needing_tokens_the_prefill_no_longer_holds_fails_the_room() -> None:
    """The decode names the group from page 2, the prefill's engine only from page 6: the room fails
    on both sides with TOKEN_COUNT_MISMATCH naming the group, and none of the group's bytes moved."""
    done, checks, p_rooms = await _move((1, 1), n=130, decode_from=2)
    (room, result), = done[:1]
    assert isinstance(result, TransferFailed) and result.code == ErrorCode.TOKEN_COUNT_MISMATCH, result
    assert "group 'swa'" in result.reason and "from 32" in result.reason, result.reason
    for cache, _, _, before in checks:
        after = [t for plane in cache.paged["swa"].tensors for t in plane]
        assert all(a.equal(b) for a, b in zip(after, before))


async def test_named_window_pages_come_with_the_last_chunk_only() -> None:
    """A non-last chunk naming pages of the group, or a last chunk naming more pages than its tokens
    fill, is refused on the prefill and changes nothing."""
    (cache,) = _caches(1)
    async with PrefillEndpoint(cache.kv, config=config("loopback")) as prefill:
        room = prefill.open_room(3)
        from kvproto.wire import LocalProtocolError

        with pytest.raises(LocalProtocolError, match="named by the engine: its pages come with the last chunk"):
            room.send([0, 1], 32, last=False, group_pages={"swa": [4, 5]})
        room.send([0, 1], 32, last=False)
        with pytest.raises(LocalProtocolError, match="fill 3 pages of group 'swa', the last chunk names 4"):
            room.send([2], 40, last=True, group_pages={"swa": [4, 5, 6, 7]})
        room.send([2], 40, last=True, group_pages={"swa": [6, 7]})


async def test_a_named_window_is_refused_beside_a_numbered_one_naming_the_group() -> None:
    pre = _caches(1)[0]
    cfg = DemoConfig(rooms=1, layers=2, kv_heads=4, head_dim=8, blocks=64, seed=3, transport="loopback")
    shapes = [PagedShape("full", (0, 2), 4, 8, False), PagedShape("swa", (1, 3), 4, 8, False, window=40, salt=3)]
    dec = RankCache(torch, cfg, tp=1, rank=0, block=16, layout="NHD", aux_slots=2, shapes=shapes)
    async with PrefillEndpoint(pre.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dec.kv, config=config("loopback")) as decode:
        room = decode.open_room(5, prefill.address, pages=dec.take(1), num_tokens=16,
                                group_pages={"swa": dec.paged["swa"].take(1)})
        with pytest.raises(TransferFailed) as info:
            await asyncio.wait_for(room.wait(), 10)
        assert info.value.code == ErrorCode.INCOMPATIBLE_GEOMETRY
        assert "group 'swa': window named by the engine on the prefill, 40 on the decode" in info.value.reason


async def test_named_window_is_the_wire_value() -> None:
    from kvproto import wire

    assert NAMED_WINDOW == wire.NAMED_WINDOW == 0xFFFFFFFF


async def test_a_decode_with_a_named_window_refuses_a_prefill_older_than_1_5() -> None:
    """An older prefill rank would take 0xFFFFFFFF for a window of that many tokens: a decode rank
    refuses its REGISTER_ACCEPT naming the group and the version (minor 5)."""
    from kvproto.aio.memory import older_peer_refusal

    geometry = _caches(1)[0].kv.cache_geometry
    reason = older_peer_refusal(geometry, 4)
    assert reason is not None and "group 'swa'" in reason and "1.4" in reason and "1.5" in reason
    assert older_peer_refusal(geometry, 5) is None
