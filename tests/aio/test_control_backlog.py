"""Control frames are never dropped for a backlog: a decode rank that opens tens of thousands of
rooms while its prefill rank reads nothing (busy, or a slow process) gets every request through
once the prefill rank reads again (real ZMQ on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from kvproto.aio import DecodeEndpoint
from kvproto.core import Timeouts
from kvproto.sync import SyncPrefill

from .conftest import config, make_cache

ROOMS = 40_000
"""Requests of 40 pages each: several MiB, beyond what the loopback TCP buffers and ZMQ's default
marks (1,000 messages each way) hold, which dropped about a third of them."""


@pytest.mark.asyncio
async def test_a_backlog_of_requests_reaches_a_prefill_that_read_nothing_meanwhile(caplog) -> None:
    src, dst = make_cache(seed=1, blocks=64), make_cache(seed=2, blocks=64)
    cfg = config("loopback", timeouts=Timeouts(bootstrap=120, waiting=120, transfer=120, parked=120))
    prefill = SyncPrefill(src.kv, config=cfg)
    release = threading.Event()
    try:
        async with DecodeEndpoint(dst.kv, config=cfg) as decode:
            await asyncio.wait_for(decode.connect(prefill.bootstrap_address), 10)
            prefill.loop.post(release.wait, 60)  # the prefill rank's loop reads nothing until released
            with caplog.at_level(logging.WARNING, logger="kvproto"):
                for room in range(1, ROOMS + 1):
                    decode.open_room(room, prefill.bootstrap_address, pages=list(range(40)), num_tokens=160)
                    if room % 1000 == 0:
                        await asyncio.sleep(0)  # the loop runs between bursts, as a serving loop's would
                release.set()
                parked = prefill._endpoint.core._parked
                for _ in range(3000):
                    if len(parked) >= ROOMS:
                        break
                    await asyncio.sleep(0.02)
            assert len(parked) == ROOMS
            assert not [r for r in caplog.records if "dropped a frame" in r.getMessage()]
    finally:
        release.set()
        prefill.close()
