"""Protocol 1.4 between real endpoints (ZMQ on 127.0.0.1, NIXL on CPU memory): room holds keep a
prefill room past its lease while its decode waits, a refused registration frees the prefill's
rooms at once, and a CURVE refusal fails the decode's rooms at once."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvproto.aio import CurveAuth, DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState, Timeouts
from kvproto.metrics import PrometheusCollector
from kvproto.wire import ErrorCode

from .conftest import config, make_cache

pytestmark = pytest.mark.asyncio

NIXL = pytest.param("nixl", marks=pytest.mark.nixl)
LEASE = 2.0


def timeouts(**kw: float | None) -> Timeouts:
    t: dict = dict(bootstrap=10.0, waiting=30.0, transfer=10.0, parked=10.0)
    t.update(kw)
    return Timeouts(**t)


@pytest.mark.parametrize("transport", [NIXL])
async def test_holds_waiting_decode_keeps_the_prefill_room_past_its_lease(transport: str) -> None:
    """A decode room opened without a destination holds its prefill room (lease 2 s, holds of 2 s every
    2/3 s): after 6 s the prefill room still waits, then the destination comes and the bytes land
    byte-exact. A decode that sends no holds (``Timeouts.hold`` None) lets its prefill room expire at
    the lease, counted in ``metrics.rooms_expired``."""
    src, dst, other = make_cache(seed=1), make_cache(seed=2), make_cache(seed=3)
    async with PrefillEndpoint(src.kv, config=config(transport, timeouts=timeouts(bootstrap=LEASE))) as prefill, \
            DecodeEndpoint(dst.kv, config=config(transport, timeouts=timeouts(hold=LEASE))) as decode, \
            DecodeEndpoint(other.kv, config=config(transport, timeouts=timeouts(hold=None))) as silent:
        loop = asyncio.get_running_loop()
        held_p, dropped_p = prefill.open_room(1), prefill.open_room(2)
        held_d = decode.open_room(1, prefill.address)
        dropped_d = silent.open_room(2, prefill.address)
        began = loop.time()
        with pytest.raises(TransferFailed) as expired:
            await asyncio.wait_for(dropped_p.wait(), 5)
        assert expired.value.code is ErrorCode.BOOTSTRAP_TIMEOUT
        assert loop.time() - began < LEASE + 1.0
        await asyncio.sleep(6.0 - (loop.time() - began))
        assert held_p.poll() is RoomState.BOOTSTRAPPING and held_d.poll() is RoomState.WAITING_FOR_INPUT
        assert dropped_d.poll() is RoomState.WAITING_FOR_INPUT  # it learns when it asks (its request is answered)
        held_d.set_destination([5, 9, 12], num_tokens=10)
        held_p.send([3, 4, 7], 10, last=True)
        await asyncio.wait_for(asyncio.gather(held_d.wait(), held_p.wait()), 10)
        for plane in range(2):
            for layer in range(2):
                for s, d in ((3, 5), (4, 9)):
                    assert src.planes[plane][layer][s].equal(dst.planes[plane][layer][d])
                assert src.planes[plane][layer][7][:2].equal(dst.planes[plane][layer][12][:2])
        assert prefill.metrics.rooms_expired == 1 and prefill.metrics.snapshot(loop.time())["rooms_expired"] == 1
        registry = CollectorRegistry()
        registry.register(PrometheusCollector([prefill, decode]))
        text = generate_latest(registry).decode()
        assert f'kvproto_rooms_expired_total{{agent="{prefill.agent_name}",role="prefill"}} 1.0' in text
        dropped_d.set_destination([1], num_tokens=4)
        with pytest.raises(TransferFailed) as late:
            await asyncio.wait_for(dropped_d.wait(), 5)
        assert late.value.code is ErrorCode.BOOTSTRAP_TIMEOUT


@pytest.mark.parametrize("transport", [NIXL])
async def test_holds_a_hold_for_an_expired_room_fails_the_waiting_decode_room(transport: str) -> None:
    """A prefill room that expired (its application opened it before a decode came, and no hold was
    sent in time) answers the decode's first hold with its code: the waiting decode room fails at
    once instead of when its destination is finally given."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config(transport, timeouts=timeouts(bootstrap=0.5))) as prefill, \
            DecodeEndpoint(dst.kv, config=config(transport, timeouts=timeouts(hold=5.0))) as decode:
        p = prefill.open_room(1)
        with pytest.raises(TransferFailed):
            await asyncio.wait_for(p.wait(), 5)
        d = decode.open_room(1, prefill.address)
        with pytest.raises(TransferFailed) as failed:
            await asyncio.wait_for(d.wait(), 2)
        assert failed.value.code is ErrorCode.BOOTSTRAP_TIMEOUT


@pytest.mark.parametrize("transport", [NIXL])
async def test_holds_refused_registration_frees_the_prefill_room_at_once(transport: str) -> None:
    """A decode of another model_id is refused: its room fails MODEL_MISMATCH on the decode and, within
    a second, the prefill room it wanted fails MODEL_MISMATCH too (lease 30 s); a compatible decode's
    room on the same prefill moves its bytes."""
    src, good_dst, bad_dst = make_cache(seed=1), make_cache(seed=2), make_cache(seed=3)
    lease = timeouts(bootstrap=30.0)
    async with PrefillEndpoint(src.kv, config=config(transport, model_id="m", timeouts=lease)) as prefill, \
            DecodeEndpoint(good_dst.kv, config=config(transport, model_id="m", timeouts=lease)) as good, \
            DecodeEndpoint(bad_dst.kv, config=config(transport, model_id="other", timeouts=lease)) as bad:
        loop = asyncio.get_running_loop()
        wanted, served = prefill.open_room(1), prefill.open_room(2)
        began = loop.time()
        refused = bad.open_room(1, prefill.address, pages=[1, 2], num_tokens=8)
        with pytest.raises(TransferFailed) as on_decode:
            await asyncio.wait_for(refused.wait(), 5)
        assert on_decode.value.code is ErrorCode.MODEL_MISMATCH
        with pytest.raises(TransferFailed) as on_prefill:
            await asyncio.wait_for(wanted.wait(), 5)
        assert on_prefill.value.code is ErrorCode.MODEL_MISMATCH
        assert loop.time() - began < 1.0
        ok = good.open_room(2, prefill.address, pages=[6, 8], num_tokens=8)
        served.send([3, 4], 8, last=True)
        await asyncio.wait_for(asyncio.gather(ok.wait(), served.wait()), 10)
        assert src.planes[0][1][3].equal(good_dst.planes[0][1][6])
        assert src.planes[1][0][4].equal(good_dst.planes[1][0][8])
        assert prefill.metrics.rooms_expired == 0


async def test_holds_curve_refusal_fails_the_rooms_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """With CURVE, a decode whose key the prefill refuses fails its rooms (with and without a
    destination) with AUTH_FAILED within a second, though its bootstrap deadline is 30 s; a prefill
    endpoint started on the same event loop right after another closed refuses as fast (its ZAP
    handler answers: it used to hang every handshake to the deadline)."""
    server_pub, server_sec = CurveAuth.keypair()
    good_pub, _ = CurveAuth.keypair()
    bad_pub, bad_sec = CurveAuth.keypair()
    caplog.set_level(logging.WARNING, logger="kvproto")
    lease = timeouts(bootstrap=30.0)
    prefill_cfg = config("loopback", timeouts=lease, curve=CurveAuth(public_key=server_pub, secret_key=server_sec,
                                                                     allowed=frozenset({good_pub})))
    bad_cfg = config("loopback", timeouts=lease, curve=CurveAuth(public_key=bad_pub, secret_key=bad_sec,
                                                                 server_key=server_pub))
    loop = asyncio.get_running_loop()
    for attempt in range(2):  # the second prefill starts on this loop right after the first closed
        async with PrefillEndpoint(make_cache(seed=1).kv, config=prefill_cfg) as prefill, \
                DecodeEndpoint(make_cache(seed=2).kv, config=bad_cfg) as decode:
            began = loop.time()
            rooms = [decode.open_room(1, prefill.address, pages=[1], num_tokens=4),
                     decode.open_room(2, prefill.address)]
            for room in rooms:
                with pytest.raises(TransferFailed) as failed:
                    await asyncio.wait_for(room.wait(), 5)
                assert failed.value.code is ErrorCode.AUTH_FAILED, attempt
            assert loop.time() - began < 1.0, attempt
            assert prefill._auth is not None and prefill._auth.refused >= 1
    assert any("is not allowed" in r.getMessage() for r in caplog.records)
