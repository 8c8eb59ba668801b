"""Layer-wise streaming through the endpoints: each layer's write waits for its readiness event,
never for a synchronization, and the room lands byte-exact on every adapter."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvproto.aio import DecodeEndpoint, PrefillEndpoint
from kvproto.core import RoomState
from kvproto.sync import EngineLoop, SyncDecode, SyncPrefill
from kvproto.wire import LocalProtocolError

from .conftest import TRANSPORTS, config, make_cache

BLOCK = 4
"""Tokens per page of ``make_cache``."""


class Event:
    """A readiness handle the test fires by hand, as a CUDA event fires when the engine's stream
    reaches it. Waiting for it on the endpoint's loop (``synchronize`` there) would stall every
    room: it fails the test instead. Another thread (``kvproto.aio.ready``) may wait, as for a
    CUDA event: until it fires."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self.queries = 0
        self.waits = 0
        self.loop_thread = threading.get_ident()

    @property
    def fired(self) -> bool:
        return self._set.is_set()

    @fired.setter
    def fired(self, value: bool) -> None:
        assert value, "an event fires once"
        self._set.set()

    def query(self) -> bool:
        self.queries += 1
        return self.fired

    def synchronize(self) -> None:
        if threading.get_ident() == self.loop_thread:
            raise AssertionError("kvproto waited on the engine's event in its event loop")
        self.waits += 1
        self._set.wait(30)

    wait = synchronize


def layer_landed(src, dst, layer: int, src_pages: list[int], dst_pages: list[int]) -> bool:
    return all(dst.planes[p][layer][d].equal(src.planes[p][layer][s])
               for p in range(2) for s, d in zip(src_pages, dst_pages, strict=True))


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS + ["cuda-ipc-kernels"])
async def test_layerwise_each_layer_moves_once_its_event_fires(transport: str) -> None:
    """Two layers sent as two chunks with unfired events: nothing is written until layer 0's event
    fires (queried, never waited on), then layer 0 lands and layer 1 does not, then layer 1; the
    decode room succeeds only after the last layer, every byte exact."""
    options = {}
    if transport == "cuda-ipc-kernels":
        transport, options = "cuda-ipc", {"fallback": "loopback", "cpu_kernels": True}
    src, dst = make_cache(seed=1), make_cache(seed=2)
    cfg = config(transport, transport_options=options, staging_bytes=0)
    async with PrefillEndpoint(src.kv, config=cfg) as prefill, DecodeEndpoint(dst.kv, config=cfg) as decode:
        src_pages, dst_pages = [7, 3], [12, 40]
        d = decode.open_room(1, prefill.bootstrap_address, pages=dst_pages, num_tokens=2 * BLOCK)
        p = prefill.open_room(1)
        e0, e1 = Event(), Event()
        p.send(src_pages, 2 * BLOCK, last=True, layers=range(0, 1), ready=e0)
        p.send([], 2 * BLOCK, last=True, layers=range(1, 2), ready=e1)
        for _ in range(30):
            await asyncio.sleep(0.01)
        assert e0.queries > 0 and not layer_landed(src, dst, 0, src_pages, dst_pages)
        assert d.poll() is RoomState.TRANSFERRING
        e0.fired = True
        for _ in range(500):
            if layer_landed(src, dst, 0, src_pages, dst_pages):
                break
            await asyncio.sleep(0.005)
        assert layer_landed(src, dst, 0, src_pages, dst_pages)
        assert not layer_landed(src, dst, 1, src_pages, dst_pages) and d.poll() is RoomState.TRANSFERRING
        e1.fired = True
        await asyncio.wait_for(asyncio.gather(d.wait(), p.wait()), 10)
        assert layer_landed(src, dst, 1, src_pages, dst_pages)
        assert p.stats.writes == 2


@pytest.mark.asyncio
async def test_layerwise_misuse_raises_and_the_room_goes_on() -> None:
    """Layers out of order raise LocalProtocolError at once; the room then completes normally."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    cfg = config("loopback")
    async with PrefillEndpoint(src.kv, config=cfg) as prefill, DecodeEndpoint(dst.kv, config=cfg) as decode:
        d = decode.open_room(1, prefill.bootstrap_address, pages=[1], num_tokens=BLOCK)
        p = prefill.open_room(1)
        p.send([5], BLOCK, layers=range(0, 1))
        with pytest.raises(LocalProtocolError, match="out of order"):
            p.send([], BLOCK, layers=range(0, 2))
        with pytest.raises(LocalProtocolError, match="consecutive"):
            p.send([], BLOCK, layers=range(1, 2, 2))
        p.send([], BLOCK, layers=range(1, 2))
        await asyncio.wait_for(asyncio.gather(d.wait(), p.wait()), 10)


@pytest.mark.asyncio
async def test_layerwise_close_with_layers_waiting_fails_rooms_and_returns() -> None:
    """A prefill that closes while a layer waits for its event reports that write failed (it was
    never posted): the room fails ENDPOINT_CLOSED on both sides and close() returns at once."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    cfg = config("loopback")
    async with DecodeEndpoint(dst.kv, config=cfg) as decode:
        prefill = PrefillEndpoint(src.kv, config=cfg)
        await prefill.start()
        d = decode.open_room(1, prefill.bootstrap_address, pages=[1], num_tokens=BLOCK)
        p = prefill.open_room(1)
        p.send([5], BLOCK, layers=range(0, 2), ready=Event())
        for _ in range(100):
            if prefill._held:
                break
            await asyncio.sleep(0.01)
        assert prefill._held
        start = time.monotonic()
        await prefill.close()
        assert time.monotonic() - start < 2.0
        assert p.poll() is RoomState.FAILED and not prefill._held
        with pytest.raises(Exception):
            await asyncio.wait_for(d.wait(), 10)
        assert d.poll() is RoomState.FAILED


def test_layerwise_sync_facade_sends_layer_by_layer() -> None:
    """KVSender.send with ``layers`` and an event: the layers move as their events fire, the aux slot
    with the last layer, the decode room succeeds byte-exact."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    loop = EngineLoop()
    try:
        with SyncPrefill(src.kv, config=config("loopback"), loop=loop) as prefill, \
                SyncDecode(dst.kv, config=config("loopback"), loop=loop) as decode:
            receiver = decode.receiver(1, prefill.bootstrap_address, pages=[9, 2], num_tokens=2 * BLOCK, aux_slot=1)
            sender = prefill.sender(1)
            sender.init(2 * BLOCK, aux_slot=3)
            events = [Event(), Event()]
            sender.send([4, 6], layers=range(0, 1), ready=events[0])
            sender.send([], 2 * BLOCK, layers=range(1, 2), ready=events[1])
            for e in events:
                time.sleep(0.05)
                e.fired = True
            deadline = time.monotonic() + 10
            while receiver.poll() not in (RoomState.SUCCESS, RoomState.FAILED) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert receiver.poll() is RoomState.SUCCESS and sender.poll() is RoomState.SUCCESS
            for layer in range(2):
                assert layer_landed(src, dst, layer, [4, 6], [9, 2])
            assert dst.aux[1].equal(src.aux[3])
    finally:
        loop.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("thread", [True, False], ids=["ready-thread", "polled"])
async def test_layerwise_a_fired_event_wakes_the_loop_at_once(thread: bool) -> None:
    """With the loop polling held writes only every 2 s (``transfer_poll_s``), the ready thread
    (``kvproto.aio.ready``) still posts a layer as soon as its event fires: the room ends well
    within the polling interval; without it the write waits for the next poll. Both wait for
    the event in one thread, once for the two rooms that share it, never on the loop."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    slow = config("loopback", staging_bytes=0, transfer_poll_s=2.0, ready_thread=thread)
    async with PrefillEndpoint(src.kv, config=slow) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback", staging_bytes=0)) as decode:
        event = Event()
        rooms = []
        for room, (sp, dp) in enumerate([([7], [12]), ([3], [40])], start=1):
            d = decode.open_room(room, prefill.bootstrap_address, pages=dp, num_tokens=BLOCK)
            p = prefill.open_room(room)
            p.send(sp, BLOCK, last=True, ready=event)
            rooms += [d, p]
        await asyncio.sleep(2.5)  # every request in, the writes held, the loop in its long wait
        assert not event.fired and all(r.poll() is RoomState.TRANSFERRING for r in rooms[::2])
        began = time.monotonic()
        event.fired = True
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in rooms)), 10)
        took = time.monotonic() - began
        assert all(layer_landed(src, dst, layer, sp, dp) for layer in (0, 1) for sp, dp in (([7], [12]), ([3], [40])))
        if thread:
            assert took < 1.0 and event.waits == 1
        else:
            assert event.waits == 0
