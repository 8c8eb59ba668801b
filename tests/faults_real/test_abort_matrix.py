"""Aborts from either side in every state a room can be in, cancelled waits, and endpoint close,
over loopback and real NIXL (both endpoints in the test's event loop, ZMQ on 127.0.0.1).

Every room deadline is 60 s and every wait here is at most a few seconds, so an ending that
came from a deadline instead of the abort fails the test. Writes are kept in flight, where a
case needs them, by a gate on the prefill transport's ``poll``: a write is in flight until its
initiator polls it DONE (and a NIXL write's notification leaves only from that poll).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from kvproto.aio import DecodeEndpoint, EndpointClosed, EndpointConfig, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState
from kvproto.transport import XferState, available_transports
from kvproto.wire import ErrorCode

from .procs import SMALL, Rank, RankSpec, wait_until

pytestmark = pytest.mark.asyncio

TRANSPORTS = [pytest.param(t, marks=pytest.mark.nixl) if t == "nixl" else t
              for t in available_transports() if t in ("loopback", "nixl")]
QUICK = 5.0
"""Every abort must be decided within this (the room deadlines are 60 s)."""
N = 40
"""Tokens per room (3 pages of 16)."""

B, W, T = RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING
OK, FAILED = RoomState.SUCCESS, RoomState.FAILED


class Gate:
    """Holds the prefill's writes in flight: ``poll`` answers PENDING until ``open()``."""

    def __init__(self, transport: Any) -> None:
        self._poll = transport.poll
        self.held = True
        transport.poll = self.poll

    def poll(self, xfer: Any) -> XferState:
        return XferState.PENDING if self.held else self._poll(xfer)

    def open(self) -> None:
        self.held = False


@dataclass
class Pair:
    prefill: Rank
    decode: Rank
    transport: str

    @property
    def address(self) -> str:
        return self.prefill.ep.address

    def p(self, room_id: int) -> Any:
        return self.prefill.rooms[room_id].handle

    def d(self, room_id: int) -> Any:
        return self.decode.rooms[room_id].handle

    async def ready(self) -> None:
        """Bootstrap the decode's link to the prefill with one room that succeeds."""
        self.decode.open([(1, N)], self.address)
        self.prefill.open([(1, N)], send=True)
        results = await self.decode.wait([1], 10)
        assert results[1]["state"] == int(OK) and results[1]["bad"] == 0, results
        await self.prefill.wait([1], 10)


def make_pair(transport: str) -> Pair:
    demo = dict(SMALL, transport=transport)
    return Pair(Rank(RankSpec("prefill", demo=demo)), Rank(RankSpec("decode", demo=demo)), transport)


@pytest_asyncio.fixture(params=TRANSPORTS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    pair = make_pair(request.param)
    await pair.prefill.start()
    await pair.decode.start()
    try:
        yield pair
    finally:
        await pair.decode.close()
        await pair.prefill.close()
        assert pair.prefill.ep.errors == 0 and pair.decode.ep.errors == 0


async def ended(handle: Any, timeout: float = QUICK) -> ErrorCode | None:
    """Wait for the room to end (quickly); its code (None on success)."""
    start = time.monotonic()
    try:
        await asyncio.wait_for(handle.wait(), timeout)
    except TransferFailed as exc:
        assert time.monotonic() - start < timeout
        return ErrorCode.coerce(exc.code)  # type: ignore[arg-type]
    return None


async def state_is(handle: Any, state: RoomState, what: str) -> None:
    await wait_until(lambda: handle.poll() is state, QUICK, what)


# --- aborts, state by state --------------------------------------------------------------------------


async def test_abort_decode_bootstrapping_reaches_prefill_when_link_comes_up(pair: Pair) -> None:
    """Decode aborts while its cluster still bootstraps: ABORTED at once; the room has no link
    yet, so the decode holds its ABORT until the link registers, and the prefill room fails
    ABORTED then (within a round trip), not at its bootstrap deadline (60 s here)."""
    pair.prefill.open([(10, N)])
    pair.decode.open([(10, N)], pair.address)
    assert pair.d(10).poll() is B
    pair.d(10).abort()
    assert pair.d(10).poll() is FAILED and pair.d(10).code is ErrorCode.ABORTED
    assert await ended(pair.d(10)) is ErrorCode.ABORTED
    assert await ended(pair.p(10), 1.0) is ErrorCode.ABORTED


async def test_abort_prefill_bootstrapping_answers_later_request(pair: Pair) -> None:
    """Prefill aborts before any request came: ABORTED at once; the decode's request that comes
    later is answered with the room's code, so the decode room fails ABORTED without a deadline."""
    await pair.ready()
    pair.prefill.open([(11, N)])
    pair.p(11).abort()
    assert pair.p(11).poll() is FAILED
    pair.decode.open([(11, N)], pair.address)
    assert await ended(pair.d(11)) is ErrorCode.ABORTED
    assert await ended(pair.p(11)) is ErrorCode.ABORTED


async def test_abort_decode_waiting_for_input_reaches_prefill(pair: Pair) -> None:
    """Decode aborts while waiting for its destination: the prefill room (open, no request yet)
    fails ABORTED too."""
    await pair.ready()
    pair.prefill.open([(12, N)])
    pair.decode.open([(12, N)], pair.address, destination=False)
    assert pair.d(12).poll() is W
    pair.d(12).abort()
    assert await ended(pair.d(12)) is ErrorCode.ABORTED
    assert await ended(pair.p(12)) is ErrorCode.ABORTED


async def test_abort_decode_before_prefill_opens_fails_room_on_open(pair: Pair) -> None:
    """Decode aborts a room the prefill has not opened: the prefill remembers it and the room
    fails ABORTED the moment it opens."""
    await pair.ready()
    pair.decode.open([(13, N)], pair.address, destination=False)
    pair.d(13).abort()
    assert await ended(pair.d(13)) is ErrorCode.ABORTED
    await asyncio.sleep(0.1)  # the ABORT reaches the prefill
    pair.prefill.open([(13, N)])
    assert await ended(pair.p(13)) is ErrorCode.ABORTED


async def test_abort_prefill_waiting_for_input_reaches_decode(pair: Pair) -> None:
    """Prefill aborts with the request in hand and no KV sent: both rooms end ABORTED."""
    await pair.ready()
    pair.decode.open([(14, N)], pair.address)
    pair.prefill.open([(14, N)])
    await state_is(pair.p(14), W, "the request")
    assert pair.d(14).poll() is T
    pair.p(14).abort()
    assert await ended(pair.p(14)) is ErrorCode.ABORTED
    assert await ended(pair.d(14)) is ErrorCode.ABORTED


async def test_abort_decode_transferring_before_writes(pair: Pair) -> None:
    """Decode aborts after sending its request, before any write: the prefill answers with its
    own ABORT and both rooms end ABORTED."""
    await pair.ready()
    pair.decode.open([(15, N)], pair.address)
    pair.prefill.open([(15, N)])
    await state_is(pair.p(15), W, "the request")
    pair.d(15).abort()
    assert await ended(pair.p(15)) is ErrorCode.ABORTED
    assert await ended(pair.d(15)) is ErrorCode.ABORTED


async def test_abort_decode_transferring_drains_writes_in_flight(pair: Pair) -> None:
    """Decode aborts with the prefill's writes in flight: the prefill room fails ABORTED at
    once, the decode room stays TRANSFERRING (its pages may still be written) until the writes
    finish and the prefill's ABORT says so, then fails ABORTED."""
    await pair.ready()
    gate = Gate(pair.prefill.ep.transport)
    pair.decode.open([(16, N)], pair.address)
    pair.prefill.open([(16, N)])
    await state_is(pair.p(16), W, "the request")
    pair.prefill.send([16])
    assert pair.p(16).poll() is T and len(pair.prefill.ep._pending) == 2  # KV and aux
    pair.d(16).abort()
    assert await ended(pair.p(16)) is ErrorCode.ABORTED
    await asyncio.sleep(0.3)
    assert pair.d(16).poll() is T, "decode reported the room before the writes into it finished"
    gate.open()
    assert await ended(pair.d(16)) is ErrorCode.ABORTED
    await wait_until(lambda: not pair.prefill.ep._pending, QUICK, "the writes to be released")


async def test_abort_prefill_transferring_holds_abort_until_writes_finish(pair: Pair) -> None:
    """Prefill aborts with its writes in flight: ABORTED at once locally; its ABORT goes out only
    when the writes finish, and then the decode room fails ABORTED."""
    await pair.ready()
    gate = Gate(pair.prefill.ep.transport)
    pair.decode.open([(17, N)], pair.address)
    pair.prefill.open([(17, N)], send=True)
    await state_is(pair.p(17), T, "the writes")
    assert pair.prefill.ep._pending
    pair.p(17).abort()
    assert pair.p(17).poll() is FAILED and pair.p(17).code is ErrorCode.ABORTED
    await asyncio.sleep(0.3)
    assert pair.d(17).poll() is T, "the prefill sent ABORT with writes still in flight"
    gate.open()
    assert await ended(pair.d(17)) is ErrorCode.ABORTED
    assert await ended(pair.p(17)) is ErrorCode.ABORTED


async def test_abort_after_success_is_a_noop(pair: Pair) -> None:
    """Aborting rooms that succeeded changes nothing on either side and sends nothing."""
    await pair.ready()
    pair.decode.open([(18, N)], pair.address)
    pair.prefill.open([(18, N)], send=True)
    assert await ended(pair.d(18)) is None and await ended(pair.p(18)) is None
    late = (pair.prefill.ep.core.stats.late_messages, pair.decode.ep.core.stats.late_messages)
    for _ in range(2):
        pair.d(18).abort()
        pair.p(18).abort()
    await asyncio.sleep(0.2)
    assert pair.d(18).poll() is OK and pair.p(18).poll() is OK
    assert await ended(pair.d(18)) is None and await ended(pair.p(18)) is None
    assert (pair.prefill.ep.core.stats.late_messages, pair.decode.ep.core.stats.late_messages) == late


async def test_abort_twice_and_after_failure_keeps_first_code(pair: Pair) -> None:
    """A second abort, or an abort of a room that already failed, is a no-op: the code stays."""
    await pair.ready()
    pair.decode.open([(19, N)], pair.address)
    pair.prefill.open([(19, N)])
    await state_is(pair.p(19), W, "the request")
    pair.p(19).abort()
    pair.p(19).abort()
    assert await ended(pair.d(19)) is ErrorCode.ABORTED
    pair.d(19).abort()
    assert pair.d(19).code is ErrorCode.ABORTED and pair.p(19).code is ErrorCode.ABORTED


# --- cancelled waits -------------------------------------------------------------------------------


async def test_room_cancelled_wait_leaves_room_intact(pair: Pair) -> None:
    """Cancelling callers of ``wait()`` (directly and by ``wait_for`` timing out) in
    BOOTSTRAPPING and TRANSFERRING neither cancels nor corrupts the room: it then succeeds
    byte-exact and a new ``wait()`` returns."""
    pair.decode.open([(20, N)], pair.address)
    waiter = asyncio.ensure_future(pair.d(20).wait())
    await asyncio.sleep(0)
    assert pair.d(20).poll() is B
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pair.d(20).poll() is B
    pair.prefill.open([(20, N)])
    await state_is(pair.d(20), T, "the request")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(pair.d(20).wait(), 0.05)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(pair.p(20).wait(), 0.05)
    assert pair.d(20).poll() is T and pair.p(20).poll() is W
    pair.prefill.send([20])
    results = await pair.decode.wait([20], QUICK)
    assert results[20]["state"] == int(OK) and results[20]["bad"] == 0, results


async def test_room_cancelled_wait_then_abort_reports_abort(pair: Pair) -> None:
    """After a cancelled wait, an abort still ends the room and a new ``wait()`` raises it."""
    await pair.ready()
    pair.decode.open([(21, N)], pair.address)
    pair.prefill.open([(21, N)])
    waiter = asyncio.ensure_future(pair.p(21).wait())
    await state_is(pair.p(21), W, "the request")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    pair.p(21).abort()
    assert await ended(pair.p(21)) is ErrorCode.ABORTED
    assert await ended(pair.d(21)) is ErrorCode.ABORTED


# --- close ----------------------------------------------------------------------------------------------


def transport_maps(transport: Any) -> dict[str, int]:
    """Sizes of the adapter's internal maps (handles it still holds)."""
    names = ("_xfers", "_lists", "_registrations", "_peers")  # (prepared lists: the adapter kit's _lists)
    return {name: len(getattr(transport, name)) for name in names if hasattr(transport, name)}


def spy_on_close(transport: Any) -> dict[str, int]:
    """Record the adapter's maps at the moment the endpoint closes it: by then the endpoint must
    have released every write and prepared list itself and removed every peer."""
    seen: dict[str, int] = {}
    close = transport.close

    def spying_close() -> None:
        seen.update(transport_maps(transport))
        close()

    transport.close = spying_close
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endpoint_close_releases_everything_and_is_idempotent(transport: str) -> None:
    """Closing both endpoints with rooms in every state (writes in flight included) fails the
    live rooms ENDPOINT_CLOSED on both sides, releases every write, list and peer before the
    adapter closes, leaves the adapter's maps empty and its memory deregistered, is
    idempotent, and every later call but ``close``/``abort`` raises EndpointClosed."""
    pair = make_pair(transport)
    prefill, decode = pair.prefill, pair.decode
    await prefill.start()
    await decode.start()
    await pair.ready()
    decode.open([(30, N)], pair.address, destination=False)  # WAITING_FOR_INPUT
    decode.open([(31, N), (32, N)], pair.address)
    prefill.open([(31, N), (32, N), (33, N)])  # 33: BOOTSTRAPPING
    await state_is(pair.p(31), W, "the request")
    await state_is(pair.p(32), W, "the request")
    prefill.send([32])
    assert pair.p(32).poll() is T and prefill.ep._pending, "no write in flight at close"
    seen = spy_on_close(prefill.ep.transport)
    start = time.monotonic()
    await prefill.ep.close()
    await prefill.ep.close()
    assert time.monotonic() - start < QUICK
    assert prefill.ep.closed
    for room_id in (31, 32, 33):
        assert await ended(pair.p(room_id)) is ErrorCode.ENDPOINT_CLOSED
    for room_id in (31, 32):  # 32's writes finish within the close's grace; its room failed at close
        assert await ended(pair.d(room_id)) is ErrorCode.ENDPOINT_CLOSED
    assert seen.get("_xfers", 0) == 0 and seen["_lists"] == 0 and seen["_peers"] == 0, seen
    assert set(transport_maps(prefill.ep.transport).values()) == {0}
    assert not prefill.ep._pending and not prefill.ep._links and not prefill.ep._handles and not prefill.ep._tasks

    decode_seen = spy_on_close(decode.ep.transport)
    await decode.ep.close()
    await decode.ep.close()
    assert await ended(pair.d(30)) is ErrorCode.ENDPOINT_CLOSED
    assert decode_seen["_lists"] == 0 and decode_seen["_peers"] == 0, decode_seen
    assert set(transport_maps(decode.ep.transport).values()) == {0}
    assert not decode.ep._links and not decode.ep._handles and not decode.ep._tasks
    if transport == "nixl":
        assert prefill.ep.transport._agent is None and decode.ep.transport._agent is None

    with pytest.raises(EndpointClosed):
        prefill.ep.open_room(40)
    with pytest.raises(EndpointClosed):
        decode.ep.open_room(40, pair.address, pages=[1], num_tokens=4)
    with pytest.raises(EndpointClosed):
        pair.p(33).send([1], 4)
    with pytest.raises(EndpointClosed):
        pair.d(30).set_destination([1], 4)
    with pytest.raises(EndpointClosed):
        await prefill.ep.start()
    pair.p(33).abort()  # abort after close: a no-op, never an error
    assert pair.p(33).poll() is FAILED and pair.d(30).poll() is FAILED
    assert prefill.ep.errors == 0 and decode.ep.errors == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endpoint_decode_close_drops_prefill_link(transport: str) -> None:
    """A closing decode sends a link ABORT (ENDPOINT_CLOSED): the prefill drops the link and
    removes the transport peer at once, not at its heartbeat timeout (30 s here)."""
    demo = dict(SMALL, transport=transport)
    pair = Pair(Rank(RankSpec("prefill", demo=demo, heartbeat_timeout=30)),
                Rank(RankSpec("decode", demo=demo, heartbeat_timeout=30)), transport)
    await pair.prefill.start()
    await pair.decode.start()
    try:
        await pair.ready()
        assert pair.prefill.snapshot()["links"] == 1
        await pair.decode.close()
        await wait_until(lambda: pair.prefill.snapshot()["links"] == 0, 1.0, "the prefill to drop the link")
        assert pair.prefill.snapshot()["peers"] == []
    finally:
        await pair.prefill.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endpoint_prefill_close_drops_decode_link(transport: str) -> None:
    """A closing prefill tells its decode links: the decode drops the link at once."""
    demo = dict(SMALL, transport=transport)
    pair = Pair(Rank(RankSpec("prefill", demo=demo, heartbeat_timeout=30)),
                Rank(RankSpec("decode", demo=demo, heartbeat_timeout=30)), transport)
    await pair.prefill.start()
    await pair.decode.start()
    try:
        await pair.ready()
        await pair.prefill.close()
        await wait_until(lambda: pair.decode.snapshot()["links"] == 0, 1.0, "the decode to drop the link")
    finally:
        await pair.decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endpoint_close_unstarted_is_idempotent(transport: str) -> None:
    """An endpoint closed before it started (or twice) creates nothing and refuses to start."""
    pair = make_pair(transport)
    config = EndpointConfig(transport=transport)
    for ep in (PrefillEndpoint(pair.prefill.cache.kv, config=config), DecodeEndpoint(pair.decode.cache.kv, config=config)):
        await ep.close()
        await ep.close()
        assert ep.closed and ep.transport is None
        with pytest.raises(EndpointClosed):
            await ep.start()
