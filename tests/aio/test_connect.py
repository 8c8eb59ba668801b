"""``DecodeEndpoint.connect``: a decode rank links to a prefill instance ahead of its first room
(real ZMQ on 127.0.0.1; loopback and NIXL)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvproto.aio import ConnectFailed, DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState, Timeouts
from kvproto.sync import SyncDecode, SyncPrefill
from kvproto.wire import ErrorCode

from .conftest import TRANSPORTS, Pair, config, make_cache

def landed(pair: Pair, src: list[int], dst: list[int]) -> bool:
    return all(torch.equal(pair.src.page(plane, layer, s), pair.dst.page(plane, layer, d))
               for plane in range(2) for layer in range(2) for s, d in zip(src, dst))


@pytest.mark.asyncio
async def test_connect_registers_the_links_before_any_room(pair: Pair) -> None:
    """After connect() the prefill rank holds the decode rank's registered link (its memory
    loaded into the transport) with no room opened; the first room then moves its bytes over
    that link without another bootstrap, and a second connect() returns at once."""
    assert not pair.prefill._links
    await asyncio.wait_for(pair.decode.connect(pair.prefill.bootstrap_address), 10)
    assert len(pair.prefill._links) == 1 and not pair.prefill.core.rooms and not pair.decode.core.rooms
    link = next(iter(pair.prefill._links.values()))
    cluster = pair.decode.core.clusters[pair.prefill.bootstrap_address]
    assert cluster.ready and not pair.decode._bootstraps

    await asyncio.wait_for(pair.decode.connect(pair.prefill.bootstrap_address), 1)
    assert pair.decode.core.clusters[pair.prefill.bootstrap_address] is cluster  # no second bootstrap

    rx = pair.decode.open_room(1, pair.prefill.bootstrap_address, pages=[5, 9], num_tokens=8)
    assert rx.poll() is RoomState.TRANSFERRING  # linked already: the room never bootstraps
    tx = pair.prefill.open_room(1)
    tx.send([2, 7], 8, last=True)
    await asyncio.wait_for(asyncio.gather(rx.wait(), tx.wait()), 10)
    assert landed(pair, [2, 7], [5, 9])
    assert list(pair.prefill._links.values()) == [link] and not pair.decode._bootstraps


@pytest.mark.asyncio
async def test_a_room_opened_while_connecting_shares_the_bootstrap(pair: Pair) -> None:
    """A room opened while connect() is still linking waits for the same bootstrap: one link
    registers, both the call and the room end well."""
    linking = asyncio.ensure_future(pair.decode.connect(pair.prefill.bootstrap_address))
    await asyncio.sleep(0)
    assert pair.decode.core.cluster_status(pair.prefill.bootstrap_address) == "pending"
    rx = pair.decode.open_room(2, pair.prefill.bootstrap_address, pages=[1], num_tokens=4)
    tx = pair.prefill.open_room(2)
    tx.send([3], 4, last=True)
    await asyncio.wait_for(asyncio.gather(linking, rx.wait(), tx.wait()), 10)
    assert len(pair.prefill._links) == 1 and landed(pair, [3], [1])


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_connect_to_nobody_fails_with_the_bootstrap_code(transport: str) -> None:
    """No prefill instance answers: connect() raises ConnectFailed(BOOTSTRAP_TIMEOUT) naming the
    address, and a room that waited for the same bootstrap fails with the same code."""
    dst = make_cache(seed=5)
    async with DecodeEndpoint(dst.kv, config=config(transport, timeouts=Timeouts(bootstrap=0.5))) as decode:
        linking = asyncio.ensure_future(decode.connect("tcp://127.0.0.1:9"))
        await asyncio.sleep(0)
        room = decode.open_room(9, "tcp://127.0.0.1:9", pages=[1], num_tokens=4)
        with pytest.raises(ConnectFailed) as failed:
            await asyncio.wait_for(linking, 5)
        assert failed.value.code is ErrorCode.BOOTSTRAP_TIMEOUT and failed.value.bootstrap == "tcp://127.0.0.1:9"
        assert "tcp://127.0.0.1:9" in str(failed.value)
        with pytest.raises(TransferFailed) as room_failed:
            await asyncio.wait_for(room.wait(), 5)
        assert room_failed.value.code is ErrorCode.BOOTSTRAP_TIMEOUT


@pytest.mark.asyncio
async def test_connect_to_an_incompatible_prefill_names_the_cause() -> None:
    """A prefill instance of another head size: connect() raises INCOMPATIBLE_GEOMETRY with the
    handshake's reason; the endpoint goes on (a later connect tries again and fails the same way)."""
    src, dst = make_cache(seed=1, head_dim=16), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        for _ in range(2):
            with pytest.raises(ConnectFailed) as failed:
                await asyncio.wait_for(decode.connect(prefill.bootstrap_address), 10)
            assert failed.value.code is ErrorCode.INCOMPATIBLE_GEOMETRY and failed.value.reason
        assert not prefill._links


@pytest.mark.asyncio
async def test_close_while_connecting_ends_the_call() -> None:
    """close() while connect() waits for an instance that never answers: the call ends with
    ConnectFailed(ENDPOINT_CLOSED) at once, not at the bootstrap deadline."""
    dst = make_cache(seed=5)
    decode = DecodeEndpoint(dst.kv, config=config("loopback", timeouts=Timeouts(bootstrap=60)))
    await decode.start()
    linking = asyncio.ensure_future(decode.connect("tcp://127.0.0.1:9"))
    await asyncio.sleep(0.1)
    await asyncio.wait_for(decode.close(), 10)
    with pytest.raises(ConnectFailed) as failed:
        await asyncio.wait_for(linking, 1)
    assert failed.value.code is ErrorCode.ENDPOINT_CLOSED


@pytest.mark.asyncio
async def test_a_cancelled_connect_leaves_the_bootstrap_running() -> None:
    """Cancelling the caller of connect() does not cancel the bootstrap: the link still
    registers, and the next connect() returns once it has."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        caller = asyncio.ensure_future(decode.connect(prefill.bootstrap_address))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(decode.connect(prefill.bootstrap_address), 10)
        assert decode.core.cluster_status(prefill.bootstrap_address) == "ready" and len(prefill._links) == 1


def test_sync_decode_connects_before_its_rooms() -> None:
    """SyncDecode.connect blocks until the link is registered; without ``wait`` it returns at
    once and the link comes up on its own; a failure raises ConnectFailed in the caller."""
    src, other, dst = make_cache(seed=1), make_cache(seed=3), make_cache(seed=2)
    first = SyncPrefill(src.kv, config=config("loopback"))
    second = SyncPrefill(other.kv, config=config("loopback"))
    decode = SyncDecode(dst.kv, config=config("loopback", timeouts=Timeouts(bootstrap=0.5)))
    try:
        decode.connect(first.bootstrap_address, timeout=10)
        assert len(first._endpoint._links) == 1  # registered when the call returned
        decode.connect(second.bootstrap_address, wait=False)
        for _ in range(500):
            if second._endpoint._links:
                break
            time.sleep(0.01)
        assert len(second._endpoint._links) == 1
        with pytest.raises(ConnectFailed) as failed:
            decode.connect("tcp://127.0.0.1:9", timeout=10)
        assert failed.value.code is ErrorCode.BOOTSTRAP_TIMEOUT
    finally:
        decode.close()
        first.close()
        second.close()
