"""Control-plane authentication with ZMQ CURVE keys."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvproto.aio import CurveAuth, DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.wire import ErrorCode

from .conftest import config, make_cache

pytestmark = pytest.mark.asyncio


async def test_curve_known_key_transfers_and_unknown_key_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A decode rank with an allowed key moves bytes; one with another key fails AUTH_FAILED and
    the prefill logs the refusal."""
    server_pub, server_sec = CurveAuth.keypair()
    good_pub, good_sec = CurveAuth.keypair()
    bad_pub, bad_sec = CurveAuth.keypair()
    src, dst, other = make_cache(seed=1), make_cache(seed=2), make_cache(seed=3)
    prefill_cfg = config("loopback", curve=CurveAuth(public_key=server_pub, secret_key=server_sec,
                                                     allowed=frozenset({good_pub})))
    good_cfg = config("loopback", curve=CurveAuth(public_key=good_pub, secret_key=good_sec, server_key=server_pub))
    bad_cfg = config("loopback", curve=CurveAuth(public_key=bad_pub, secret_key=bad_sec, server_key=server_pub))
    caplog.set_level(logging.WARNING, logger="kvproto")
    async with PrefillEndpoint(src.kv, config=prefill_cfg) as prefill, \
            DecodeEndpoint(dst.kv, config=good_cfg) as good, DecodeEndpoint(other.kv, config=bad_cfg) as bad:
        ok_room = good.open_room(1, prefill.address, pages=[1, 2], num_tokens=8)
        refused = bad.open_room(2, prefill.address, pages=[1], num_tokens=4)
        p = prefill.open_room(1)
        p.send([3, 4], 8)
        await asyncio.wait_for(asyncio.gather(ok_room.wait(), p.wait()), 10)
        assert src.planes[0][0][3].equal(dst.planes[0][0][1])
        with pytest.raises(TransferFailed) as failed:
            await asyncio.wait_for(refused.wait(), 10)
        assert failed.value.code is ErrorCode.AUTH_FAILED
    assert any("is not allowed" in r.getMessage() for r in caplog.records)
