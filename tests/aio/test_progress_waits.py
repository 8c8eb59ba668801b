"""How an endpoint's progress task waits. A prefill rank whose writes are in flight waits for
them in a thread instead of spinning its loop (``EndpointConfig.busy_spin_s``,
``kvproto.transport.base.completion_event``), and that thread wakes the loop the moment they may
have ended. A decode rank waiting for a room's bytes pauses a millisecond between polls on
asyncio's loop and on uvloop alike (uvloop once made its 0.2 ms pause a spin).

The adapter here is the loopback one with a stand-in device: its writes run only once the
device is released, and it offers the device as the event to wait for (``synchronize()``
blocks in a thread, as a CUDA event's wait does). Real ZMQ on 127.0.0.1; heartbeats, the loop's
back-off and deadlines are set far apart, so only the waiting thread can wake the loop soon."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

import kvproto.aio.endpoint as endpoint_module
from kvproto.aio import DecodeEndpoint, PrefillEndpoint
from kvproto.core import Timeouts
from kvproto.transport.loopback import LoopbackTransport

from .conftest import config, make_cache

SLOW = 5.0
"""The loop's longest pause, heartbeats' interval: what would wake it without the thread."""


class Device:
    """Writes run once ``release`` is called; ``synchronize`` waits for that, as a CUDA event's
    ``synchronize`` waits for its kernel."""

    def __init__(self) -> None:
        self.ran = threading.Event()
        self.waits = 0
        self.waiters: set[str] = set()

    def synchronize(self) -> None:
        self.waits += 1
        self.waiters.add(threading.current_thread().name)
        self.ran.wait()


class GatedLoopback(LoopbackTransport):
    device: Device

    def _due(self, xfer: Any) -> bool:
        return self.device.ran.is_set()

    def completion_event(self) -> Device | None:
        return None if self.device.ran.is_set() else self.device


def gated(device: Device) -> Any:
    def load(name: str, agent_name: str, **options: Any) -> LoopbackTransport:
        transport = GatedLoopback(agent_name)
        transport.device = device
        return transport
    return load


class PassCounter:
    """Counts an endpoint's progress passes (``count``, from 0 again at ``reset``)."""

    def __init__(self, endpoint: Any) -> None:
        self.count = 0
        progress_once = endpoint._progress_once

        def counted() -> bool:
            self.count += 1
            return progress_once()

        endpoint._progress_once = counted

    def reset(self) -> None:
        self.count = 0


def quiet_config(**overrides: Any) -> Any:
    return config("loopback", idle_poll_s=SLOW, heartbeat_interval=SLOW, heartbeat_timeout=60,
                  timeouts=Timeouts(bootstrap=30, waiting=30, transfer=30, parked=30), **overrides)


async def one_room_in_flight(monkeypatch: pytest.MonkeyPatch, **prefill_overrides: Any) -> tuple[int, float, Device]:
    """A room whose write waits for the device for 0.3 s: (the prefill's progress passes during
    those 0.3 s, seconds from the device's release to the end of both sides, the device)."""
    device = Device()
    monkeypatch.setattr(endpoint_module, "load_transport", gated(device))
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=quiet_config(**prefill_overrides)) as prefill, \
            DecodeEndpoint(dst.kv, config=quiet_config()) as decode:
        passes = PassCounter(prefill)
        rx = decode.open_room(1, prefill.bootstrap_address, pages=[5, 9], num_tokens=8)
        tx = prefill.open_room(1)
        tx.send([2, 7], 8, last=True)
        deadline = time.monotonic() + 10
        while not prefill._pending:  # the write is posted: in flight until the device runs it
            assert time.monotonic() < deadline, "the write was never posted"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        passes.reset()
        await asyncio.sleep(0.3)
        in_flight = passes.count
        released = time.monotonic()
        device.ran.set()
        await asyncio.wait_for(asyncio.gather(rx.wait(), tx.wait()), 2 * SLOW)
        took = time.monotonic() - released
        for plane in range(2):
            for layer in range(2):
                for s, d in ((2, 5), (7, 9)):
                    assert torch.equal(src.page(plane, layer, s), dst.page(plane, layer, d))
        return in_flight, took, device


@pytest.mark.asyncio
async def test_a_write_in_flight_is_waited_for_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the write is in flight the prefill's loop sleeps (a handful of passes in 0.3 s) and a
    thread named kvproto-written waits on the adapter's event; released, the room ends at once
    (well before the loop's own pause of 5 s), its bytes landed."""
    passes, took, device = await one_room_in_flight(monkeypatch)
    assert passes <= 20, f"{passes} progress passes while the write was in flight: the loop spun"
    assert device.waiters == {"kvproto-written"} and device.waits >= 1
    assert took < SLOW / 2, f"the room ended {took:.2f} s after its write ran: nothing woke the loop"


@pytest.mark.asyncio
async def test_without_the_thread_the_loop_polls_in_a_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ready_thread=False``: no thread waits, the loop polls the write pass after pass (what
    the test above shows it no longer does), and the room still ends at once."""
    passes, took, device = await one_room_in_flight(monkeypatch, ready_thread=False)
    assert passes > 200, f"only {passes} progress passes in 0.3 s"
    assert device.waits == 0
    assert took < SLOW / 2


@pytest.mark.asyncio
async def test_a_long_spin_keeps_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """``busy_spin_s`` longer than the write: the loop polls all along, as before this wait."""
    passes, _took, device = await one_room_in_flight(monkeypatch, busy_spin_s=60.0)
    assert passes > 200 and device.waits == 0


@pytest.mark.asyncio
async def test_a_decode_waiting_for_bytes_does_not_spin() -> None:
    """A decode room TRANSFERRING whose prefill has not sent yet: its loop polls about once a
    millisecond (``transfer_poll_s`` of 0.2 ms is a millisecond's pause), on both loops; under
    uvloop a 0.2 ms timer used to be one of 0 ms, some hundred thousand passes a second."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config("loopback")) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback")) as decode:
        rx = decode.open_room(1, prefill.bootstrap_address, pages=[5], num_tokens=4)
        tx = prefill.open_room(1)
        deadline = time.monotonic() + 10
        while decode.core.transferring == 0:
            assert time.monotonic() < deadline, "the room never reached TRANSFERRING"
            await asyncio.sleep(0.01)
        passes = PassCounter(decode)
        began = time.monotonic()
        await asyncio.sleep(0.3)
        seconds = time.monotonic() - began
        assert passes.count <= 3000 * seconds, f"{passes.count} progress passes in {seconds:.2f} s: the loop spun"
        tx.send([2], 4, last=True)
        await asyncio.wait_for(asyncio.gather(rx.wait(), tx.wait()), 10)
