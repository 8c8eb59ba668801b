"""Room lifecycle through the public API, over loopback and real NIXL (ZMQ on 127.0.0.1).

Every room ends exactly once and its waiter sees it: a refused call (a live room id opened again,
a page listed twice) changes nothing, and a decode room that ends while its link to the prefill
instance still bootstraps reaches the prefill within one round trip of the link coming up,
instead of pinning the prefill room until its own deadline (10 s in these fixtures).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.aio import DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.core import RoomState
from kvproto.wire import ErrorCode, LocalProtocolError

from .conftest import TRANSPORTS, Pair, config, make_cache

pytestmark = pytest.mark.asyncio

QUICK = 2.0
"""Every ending below must be seen within this; the fixtures' room deadlines are 10 s."""
BLOCK = 4


async def outcome(handle, timeout: float = QUICK) -> ErrorCode | None:
    """The room's ending as ``wait()`` reports it: None for SUCCESS, else the failure code."""
    try:
        await asyncio.wait_for(handle.wait(), timeout)
    except TransferFailed as exc:
        return ErrorCode.coerce(exc.code)  # type: ignore[arg-type]
    return None


def moved(pair: Pair, src_pages: list[int], dst_pages: list[int]) -> bool:
    """The destination pages hold the source pages' bytes, in every region."""
    return all(pair.dst.planes[plane][layer][d].equal(pair.src.planes[plane][layer][s])
               for plane in range(2) for layer in range(len(pair.src.planes[0]))
               for s, d in zip(src_pages, dst_pages))


# --- a refused duplicate open leaves the live room intact (issue: wait() never returned) -------------


async def test_lifecycle_duplicate_open_on_decode_keeps_the_live_room(pair: Pair) -> None:
    """Opening a live room id again on decode raises DUPLICATE_ROOM and changes nothing: the live
    room then succeeds byte-exact on both sides and both ``wait()`` calls return."""
    address = pair.prefill.bootstrap_address
    d = pair.decode.open_room(2, address, pages=[1], num_tokens=BLOCK)
    with pytest.raises(LocalProtocolError) as refused:
        pair.decode.open_room(2, address, pages=[2], num_tokens=BLOCK)
    assert refused.value.code is ErrorCode.DUPLICATE_ROOM
    assert d.poll() in (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING)
    p = pair.prefill.open_room(2)
    p.send([7], BLOCK, last=True)
    assert await outcome(d) is None and await outcome(p) is None
    assert d.poll() is RoomState.SUCCESS and p.poll() is RoomState.SUCCESS
    assert moved(pair, [7], [1])


async def test_lifecycle_duplicate_open_on_prefill_keeps_the_live_room(pair: Pair) -> None:
    """Opening a live room id again on prefill raises DUPLICATE_ROOM and changes nothing: the live
    prefill room's ``wait()`` returns SUCCESS when the transfer ends."""
    p = pair.prefill.open_room(3)
    with pytest.raises(LocalProtocolError) as refused:
        pair.prefill.open_room(3)
    assert refused.value.code is ErrorCode.DUPLICATE_ROOM
    d = pair.decode.open_room(3, pair.prefill.bootstrap_address, pages=[4], num_tokens=BLOCK)
    p.send([9], BLOCK, last=True)
    assert await outcome(p) is None and await outcome(d) is None
    assert p.poll() is RoomState.SUCCESS and d.poll() is RoomState.SUCCESS
    assert moved(pair, [9], [4])


async def test_lifecycle_duplicate_open_after_room_ended_opens_a_new_room(pair: Pair) -> None:
    """An id whose room ended may be opened again: the new room is independent of the old one."""
    address = pair.prefill.bootstrap_address
    d = pair.decode.open_room(4, address, pages=[1], num_tokens=BLOCK)
    d.abort()
    assert await outcome(d) is ErrorCode.ABORTED
    d2 = pair.decode.open_room(4, address, pages=[2], num_tokens=BLOCK)
    p = pair.prefill.open_room(4)
    p.send([11], BLOCK, last=True)
    # The first incarnation's ABORT may fail the prefill room (it came first); either way both
    # sides end, each once, and the second decode room's waiter sees how.
    results = await asyncio.gather(outcome(d2, 12.0), outcome(p, 12.0))
    assert d2.poll() is (RoomState.SUCCESS if results[0] is None else RoomState.FAILED)
    assert d.poll() is RoomState.FAILED and d.code is ErrorCode.ABORTED


# --- a page listed twice is refused before anything moves ---------------------------------------------


async def test_lifecycle_duplicate_pages_refused_on_decode(pair: Pair) -> None:
    """``open_room`` and ``set_destination`` with a page listed twice raise INDEX_OUT_OF_RANGE and
    open nothing: the id is still free, and the room then works with distinct pages."""
    address = pair.prefill.bootstrap_address
    with pytest.raises(LocalProtocolError) as refused:
        pair.decode.open_room(5, address, pages=[10, 10], num_tokens=2 * BLOCK)
    assert refused.value.code is ErrorCode.INDEX_OUT_OF_RANGE
    assert pair.decode.core.room_state(5) is None and 5 not in pair.decode._handles
    d = pair.decode.open_room(5, address)
    with pytest.raises(LocalProtocolError) as refused:
        d.set_destination([12, 13, 12], 3 * BLOCK)
    assert refused.value.code is ErrorCode.INDEX_OUT_OF_RANGE
    d.set_destination([12, 13, 14], 3 * BLOCK)
    p = pair.prefill.open_room(5)
    p.send([20, 21, 22], 3 * BLOCK, last=True)
    assert await outcome(d) is None and await outcome(p) is None
    assert moved(pair, [20, 21, 22], [12, 13, 14])


async def test_lifecycle_duplicate_pages_refused_on_prefill(pair: Pair) -> None:
    """A chunk naming a page twice (within it, or one of the room's earlier chunks) raises
    INDEX_OUT_OF_RANGE and leaves the room as it was; correct chunks then complete it."""
    d = pair.decode.open_room(6, pair.prefill.bootstrap_address, pages=[30, 31, 32], num_tokens=3 * BLOCK)
    p = pair.prefill.open_room(6)
    with pytest.raises(LocalProtocolError) as refused:
        p.send([40, 40], 2 * BLOCK, last=False)
    assert refused.value.code is ErrorCode.INDEX_OUT_OF_RANGE
    p.send([40], BLOCK, last=False)
    with pytest.raises(LocalProtocolError) as refused:
        p.send([41, 40], 3 * BLOCK, last=True)
    assert refused.value.code is ErrorCode.INDEX_OUT_OF_RANGE
    p.send([41, 42], 3 * BLOCK, last=True)
    assert await outcome(d) is None and await outcome(p) is None
    assert moved(pair, [40, 41, 42], [30, 31, 32])


# --- a decode room that ends while its link bootstraps (issue: prefill waited 30 s) -----------------------


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-open-first", "prefill-open-later"])
async def test_lifecycle_decode_abort_while_bootstrapping_reaches_prefill(pair: Pair, prefill_first: bool) -> None:
    """Decode aborts its first room to a prefill instance at once (the link is not registered
    yet): the prefill room fails ABORTED within a round trip of the link coming up, whether it
    was already open or opens afterwards (pre-abort), not at its bootstrap deadline."""
    start = time.monotonic()
    p = pair.prefill.open_room(1) if prefill_first else None
    d = pair.decode.open_room(1, pair.prefill.bootstrap_address, pages=[1], num_tokens=BLOCK)
    assert d.poll() is RoomState.BOOTSTRAPPING
    d.abort()
    assert d.poll() is RoomState.FAILED and await outcome(d) is ErrorCode.ABORTED
    if p is None:
        await asyncio.sleep(0.2)  # the link comes up and the held ABORT lands as a pre-abort
        p = pair.prefill.open_room(1)
    assert await outcome(p) is ErrorCode.ABORTED
    print(f"prefill room ended ABORTED {time.monotonic() - start:.3f}s after the decode opened")
    assert pair.decode.core.held_ends(pair.prefill.bootstrap_address) == 0
    # The link that came up serves the next room.
    d2 = pair.decode.open_room(2, pair.prefill.bootstrap_address, pages=[2], num_tokens=BLOCK)
    p2 = pair.prefill.open_room(2)
    p2.send([3], BLOCK, last=True)
    assert await outcome(d2) is None and await outcome(p2) is None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-open-first", "prefill-open-later"])
async def test_lifecycle_decode_close_while_bootstrapping_reaches_prefill(transport: str, prefill_first: bool) -> None:
    """The decode endpoint closes right after opening its first room (the link is not registered
    yet): close lets the handshake finish, so the prefill room fails ENDPOINT_CLOSED at once (open
    before, or opened after: pre-abort) instead of waiting for its bootstrap deadline; then the
    prefill drops the decode's link and forgets its transport peer."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config(transport)) as prefill:
        decode = DecodeEndpoint(dst.kv, config=config(transport))
        await decode.start()
        start = time.monotonic()
        p = prefill.open_room(1) if prefill_first else None
        d = decode.open_room(1, prefill.bootstrap_address, pages=[1], num_tokens=BLOCK)
        assert d.poll() is RoomState.BOOTSTRAPPING
        await decode.close()
        closed = time.monotonic() - start
        assert await outcome(d) is ErrorCode.ENDPOINT_CLOSED
        if p is None:
            p = prefill.open_room(1)
        assert await outcome(p) is ErrorCode.ENDPOINT_CLOSED
        print(f"decode closed in {closed:.3f}s; prefill room ENDPOINT_CLOSED {time.monotonic() - start:.3f}s "
              f"after the decode opened")
        for _ in range(100):
            if not prefill._links:
                break
            await asyncio.sleep(0.01)
        assert not prefill._links
        assert prefill.errors == 0 and decode.errors == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_lifecycle_decode_close_with_unreachable_prefill_returns_quickly(transport: str) -> None:
    """A decode that closes while its bootstrap cannot finish (nobody listens at the address)
    waits at most the close's grace for it, then closes; its room fails ENDPOINT_CLOSED."""
    dst = make_cache(seed=2)
    decode = DecodeEndpoint(dst.kv, config=config(transport))
    await decode.start()
    d = decode.open_room(1, "tcp://127.0.0.1:9", pages=[1], num_tokens=BLOCK)
    start = time.monotonic()
    await decode.close()
    # the 2 s grace, plus the adapter's own close (Mooncake's engine destructor takes ~1 s)
    assert time.monotonic() - start < 3.0 + (1.5 if transport == "mooncake" else 0.0)
    assert await outcome(d) is ErrorCode.ENDPOINT_CLOSED
    assert decode.errors == 0


# --- property: duplicate opens, aborts and reuse, interleaved with live rooms -----------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["open_d", "open_p", "dup_d", "dup_p", "send", "abort_d", "abort_p", "pages_twice",
                               "yield"]),
              st.integers(1, 4)),
    min_size=1, max_size=14,
)


@pytest.mark.parametrize("transport", ["loopback"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=OPS)
async def test_lifecycle_every_handle_ends_once_and_wait_agrees_with_poll(transport: str, program) -> None:
    """Any interleaving of opens, duplicate opens (refused), aborts, page lists with a page twice
    (refused), sends and id reuse: every handle ever returned ends, its ``wait()`` returns (or
    raises ``TransferFailed``) exactly as ``poll()`` reports, and a refused call never disturbs the
    live room with that id."""
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config(transport)) as prefill, \
            DecodeEndpoint(dst.kv, config=config(transport)) as decode:
        address = prefill.bootstrap_address
        live_d: dict[int, object] = {}
        live_p: dict[int, object] = {}
        sent: set[int] = set()
        handles = []
        for op, room in program:
            d, p = live_d.get(room), live_p.get(room)
            if op in ("open_d", "dup_d"):
                if d is not None and not d.done:
                    before = d.poll()
                    with pytest.raises(LocalProtocolError):
                        decode.open_room(room, address, pages=[room], num_tokens=BLOCK)
                    assert d.poll() is before and decode._handles[room] is d
                else:
                    live_d[room] = decode.open_room(room, address, pages=[room], num_tokens=BLOCK)
                    handles.append(live_d[room])
            elif op in ("open_p", "dup_p"):
                if p is not None and not p.done:
                    before = p.poll()
                    with pytest.raises(LocalProtocolError):
                        prefill.open_room(room)
                    assert p.poll() is before and prefill._handles[room] is p
                else:
                    live_p[room] = prefill.open_room(room)
                    sent.discard(room)
                    handles.append(live_p[room])
            elif op == "send" and p is not None and not p.done and room not in sent:
                p.send([10 + room], BLOCK, last=True)
                sent.add(room)
            elif op == "abort_d" and d is not None:
                d.abort()
            elif op == "abort_p" and p is not None:
                p.abort()
            elif op == "pages_twice":
                with pytest.raises(LocalProtocolError):
                    decode.open_room(100 + room, address, pages=[room, room], num_tokens=2 * BLOCK)
                assert decode.core.room_state(100 + room) is None
            else:
                await asyncio.sleep(0.01)
        for h in handles:  # end whatever is still live, explicitly
            if not h.done:
                await asyncio.sleep(0.05)
                h.abort()
        for h in handles:
            code = await outcome(h, 12.0)
            assert h.done
            assert h.poll() is (RoomState.SUCCESS if code is None else RoomState.FAILED)
        assert not decode._handles and not prefill._handles
        assert prefill.errors == 0 and decode.errors == 0


# --- an unexpected error in the data path fails its room at once ----------------------------------------
@pytest.mark.parametrize("where", ["post", "gather", "piece-write"])
async def test_lifecycle_unexpected_error_in_a_write_fails_its_room_at_once(where: str, monkeypatch) -> None:
    """An exception nobody expects (a bug, a kernel that fails to build) while the prefill posts a
    write, gathers a staged piece or writes it fails that room at once, with the exception's text,
    not at its transfer deadline (30 s here); the endpoint counts it, frees the staging region, and
    the next room moves byte-exact."""
    from kvproto.aio import paths, staging

    staged = where != "post"
    src, dst = make_cache(seed=1, block=BLOCK), make_cache(seed=2, block=2 * BLOCK if staged else BLOCK)
    name, owner = {"post": ("post_kv", paths.LinkPath), "gather": ("copy", staging.Piece),
                   "piece-write": ("post_staged", paths.LinkPath)}[where]
    real = getattr(owner, name)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("kernel failed to build")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, broken)
    slow = config("loopback").timeouts.__class__(bootstrap=30, waiting=30, transfer=30, parked=30)
    async with PrefillEndpoint(src.kv, config=config("loopback", timeouts=slow)) as prefill, \
            DecodeEndpoint(dst.kv, config=config("loopback", timeouts=slow)) as decode:
        first, second = ([3], [7]) if staged else ([3, 4], [7, 8])
        began = time.monotonic()
        d = decode.open_room(1, prefill.bootstrap_address, pages=first, num_tokens=2 * BLOCK)
        p = prefill.open_room(1)
        p.send([5, 6], 2 * BLOCK, last=True)
        assert await outcome(p, 5.0) is not None and await outcome(d, 5.0) is not None
        assert time.monotonic() - began < 5.0
        with pytest.raises(TransferFailed, match="kernel failed to build"):
            await p.wait()
        assert prefill.errors == 1 and calls
        d = decode.open_room(2, prefill.bootstrap_address, pages=second, num_tokens=2 * BLOCK)
        p = prefill.open_room(2)
        p.send([9, 10], 2 * BLOCK, last=True)
        assert await outcome(p, 5.0) is None and await outcome(d, 5.0) is None
        assert any(path.startswith("staged") for path in p.stats.paths) == staged, p.stats.paths
    d_block = 2 * BLOCK if staged else BLOCK
    for plane in range(2):
        for layer in range(2):
            for t in range(2 * BLOCK):
                want = src.planes[plane][layer][[9, 10][t // BLOCK]][t % BLOCK]
                assert dst.planes[plane][layer][second[t // d_block]][t % d_block].equal(want), (plane, layer, t)
