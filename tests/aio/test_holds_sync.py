"""Protocol 1.4 through the synchronous facades (``kvproto.sync``, ``kvproto.sync_process``): a
receiver opened without pages holds its prefill room past the lease and moves once ``init`` gives
them; expired prefill rooms are counted; a CURVE refusal fails the rooms at once. Real NIXL and ZMQ
on loopback."""

from __future__ import annotations

import time

import pytest
import torch

from kvproto.aio import CurveAuth, EndpointConfig
from kvproto.core import RoomState, Timeouts
from kvproto.sync import SyncDecode, SyncPrefill
from kvproto.sync_process import ProcessDecode, ProcessPrefill
from kvproto.wire import ErrorCode

from .test_sync_process import BLOCK, cache, wait

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

LEASE = 2.0


def config(*, curve: CurveAuth | None = None, **timeouts: float | None) -> EndpointConfig:
    t: dict = dict(bootstrap=10.0, waiting=30.0, transfer=10.0, parked=10.0)
    t.update(timeouts)
    return EndpointConfig(transport="nixl", timeouts=Timeouts(**t), heartbeat_timeout=2.0, heartbeat_interval=0.5,
                          curve=curve)


def same(src: list[list[torch.Tensor]], s_pages: list[int], dst: list[list[torch.Tensor]], d_pages: list[int]) -> bool:
    return all(torch.equal(a[s_pages], b[d_pages]) for pa, pb in zip(src, dst) for a, b in zip(pa, pb))


@pytest.mark.parametrize("facades", ["thread", "process"])
def test_holds_sync_receiver_without_pages_holds_then_init_moves(facades: str) -> None:
    """``receiver(room, bootstrap)`` without pages holds the prefill's room (lease 2 s) for 5 s;
    ``init(pages, ...)`` then moves it byte-exact; a prefill room no decode asks for expires at its
    lease and ``rooms_expired`` counts it (the facade's property, a plain read)."""
    src, skv = cache(1)
    dst, dkv = cache(2)
    prefill_cls, decode_cls = (SyncPrefill, SyncDecode) if facades == "thread" else (ProcessPrefill, ProcessDecode)
    with prefill_cls(skv, config=config(bootstrap=LEASE)) as prefill, \
            decode_cls(dkv, config=config(hold=LEASE)) as decode:
        tx, lonely = prefill.sender(1), prefill.sender(2)
        rx = decode.receiver(1, prefill.bootstrap_address)
        began = time.monotonic()
        assert wait(lonely, 10) is RoomState.FAILED
        assert time.monotonic() - began < LEASE + 1.5
        while time.monotonic() - began < 5.0:
            assert tx.poll() is RoomState.BOOTSTRAPPING, "the held room ended"
            time.sleep(0.05)
        assert rx.poll() is RoomState.WAITING_FOR_INPUT
        rx.init([11, 12], 2 * BLOCK)
        tx.init(2 * BLOCK)
        tx.send([3, 5])
        assert wait(rx) is RoomState.SUCCESS and wait(tx) is RoomState.SUCCESS
        assert same(src, [3, 5], dst, [11, 12])
        finished = prefill.get_finished()
        assert (2, RoomState.FAILED, ErrorCode.BOOTSTRAP_TIMEOUT) in finished
        assert prefill.rooms_expired == 1


def test_holds_sync_facades_fail_a_curve_refusal_at_once() -> None:
    """A ``SyncDecode`` and a ``ProcessDecode`` whose key the prefill refuses see their rooms FAILED with
    AUTH_FAILED within two seconds (bootstrap deadline 30 s)."""
    server_pub, server_sec = CurveAuth.keypair()
    good_pub, _ = CurveAuth.keypair()
    bad_pub, bad_sec = CurveAuth.keypair()
    _, skv = cache(1)
    _, dkv = cache(2)
    _, pkv = cache(3)
    prefill_curve = CurveAuth(public_key=server_pub, secret_key=server_sec, allowed=frozenset({good_pub}))
    bad_curve = CurveAuth(public_key=bad_pub, secret_key=bad_sec, server_key=server_pub)
    with SyncPrefill(skv, config=config(curve=prefill_curve, bootstrap=30.0)) as prefill, \
            SyncDecode(dkv, config=config(curve=bad_curve, bootstrap=30.0)) as thread_decode, \
            ProcessDecode(pkv, config=config(curve=bad_curve, bootstrap=30.0)) as process_decode:
        for decode in (thread_decode, process_decode):
            began = time.monotonic()
            rooms = [decode.receiver(7, prefill.bootstrap_address, pages=[1], num_tokens=BLOCK),
                     decode.receiver(8, prefill.bootstrap_address)]
            for room in rooms:
                assert wait(room, 10) is RoomState.FAILED
                assert room.code == ErrorCode.AUTH_FAILED
            assert time.monotonic() - began < 2.0, type(decode).__name__
