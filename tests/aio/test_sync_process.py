"""``ProcessDecode``: the synchronous decode facade with its endpoint in a child process. Real
NIXL and ZMQ on loopback; the cache is the test's own tensors, shared with the child."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvproto.aio import EndpointConfig, KVCache, StateCache, TransferFailed
from kvproto.core import RoomState, Timeouts
from kvproto.sync import SyncPrefill
from kvproto.sync_process import ProcessDecode, ProcessPrefill
from kvproto.wire import ErrorCode, LocalProtocolError

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BLOCK, HEADS, DIM = 4, 2, 8
ENDED = (RoomState.SUCCESS, RoomState.FAILED)


def cache(seed: int) -> tuple[list[list[torch.Tensor]], KVCache]:
    gen = torch.Generator().manual_seed(seed)
    planes = [[torch.randint(0, 256, (32, BLOCK, HEADS, DIM), dtype=torch.uint8, generator=gen) for _ in range(2)]
              for _ in range(2)]
    return planes, KVCache.from_tensors(planes)


def config(**timeouts: float) -> EndpointConfig:
    t = dict(bootstrap=10.0, waiting=10.0, transfer=10.0, parked=10.0)
    t.update(timeouts)
    return EndpointConfig(transport="nixl", timeouts=Timeouts(**t), heartbeat_timeout=2.0, heartbeat_interval=0.5)


def wait(room: object, timeout: float = 30.0) -> RoomState:
    deadline = time.monotonic() + timeout
    while (state := room.poll()) not in ENDED:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the room did not end"
        time.sleep(0.001)
    return state


def tokens(planes: list[list[torch.Tensor]], pages: list[int], n: int) -> list[torch.Tensor]:
    return [t[pages].reshape(-1, HEADS, DIM)[:n] for plane in planes for t in plane]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_rooms_land_byte_exact_in_the_engines_own_tensors_and_end_once(loop: str) -> None:
    """Rooms opened through the child land in the engine's tensors (shared, not copied), pass
    through BOOTSTRAPPING before SUCCESS, and get_finished lists each once; the child's event
    loop is asyncio's or uvloop's."""
    import uvloop

    src, skv = cache(1)
    dst, dkv = cache(2)
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with SyncPrefill(skv, config=config()) as prefill, \
            ProcessDecode(dkv, config=config(), loop_factory=factory) as decode:
        plan = {10 + i: ([i, i + 8], [20 - i, 3 + i], 5 + i % 4) for i in range(6)}
        rooms = {}
        for rid, (s_pages, d_pages, n) in plan.items():
            rooms[rid] = decode.receiver(rid, prefill.bootstrap_address, pages=d_pages, num_tokens=n)
            assert rooms[rid].poll() is RoomState.BOOTSTRAPPING
            tx = prefill.sender(rid)
            tx.init(n)
            tx.send(s_pages, n)
        assert all(wait(r) is RoomState.SUCCESS for r in rooms.values())
        finished = decode.get_finished()
        assert sorted(f[0] for f in finished) == sorted(plan) and all(f[1] is RoomState.SUCCESS for f in finished)
        assert decode.get_finished() == []
    for rid, (s_pages, d_pages, n) in plan.items():
        for a, b in zip(tokens(src, s_pages, n), tokens(dst, d_pages, n)):
            assert torch.equal(a, b), rid


def test_connect_links_the_child_before_any_room() -> None:
    """ProcessDecode.connect returns at once; the child links to the prefill instance with no
    room open (the prefill rank registers it), and a room then lands over that link."""
    src, skv = cache(5)
    dst, dkv = cache(6)
    with SyncPrefill(skv, config=config()) as prefill, ProcessDecode(dkv, config=config()) as decode:
        decode.connect(prefill.bootstrap_address)
        deadline = time.monotonic() + 20
        while not prefill._endpoint._links:
            assert time.monotonic() < deadline, "the child did not link"
            time.sleep(0.005)
        assert not prefill._endpoint.core.rooms
        rx = decode.receiver(3, prefill.bootstrap_address, pages=[9, 4], num_tokens=7)
        tx = prefill.sender(3)
        tx.init(7)
        tx.send([1, 2], 7)
        assert wait(rx) is RoomState.SUCCESS and len(prefill._endpoint._links) == 1
    assert all(torch.equal(a, b) for a, b in zip(tokens(src, [1, 2], 7), tokens(dst, [9, 4], 7)))


def test_destination_given_later_waiting_for_input_is_seen() -> None:
    src, skv = cache(3)
    dst, dkv = cache(4)
    with SyncPrefill(skv, config=config()) as prefill, ProcessDecode(dkv, config=config()) as decode:
        rx = decode.receiver(7, prefill.bootstrap_address)
        deadline = time.monotonic() + 20
        while rx.poll() is not RoomState.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        rx.init([5, 6], 6)
        tx = prefill.sender(7)
        tx.init(6)
        tx.send([30, 31], 6)
        assert wait(rx) is RoomState.SUCCESS
    assert all(torch.equal(a, b) for a, b in zip(tokens(src, [30, 31], 6), tokens(dst, [5, 6], 6)))


def test_refusals_aborts_and_duplicates_fail_only_their_room_with_the_reason() -> None:
    _, skv = cache(5)
    _, dkv = cache(6)
    with SyncPrefill(skv, config=config()) as prefill, ProcessDecode(dkv, config=config()) as decode:
        live = decode.receiver(1, prefill.bootstrap_address)
        dup = decode.receiver(1, prefill.bootstrap_address)
        assert dup.poll() is RoomState.FAILED and dup.code == ErrorCode.DUPLICATE_ROOM
        with pytest.raises(LocalProtocolError, match="already live"):
            dup.failure_exception()
        bad = decode.receiver(2, prefill.bootstrap_address, pages=[1, 1], num_tokens=8)  # a page twice
        assert wait(bad) is RoomState.FAILED
        with pytest.raises(LocalProtocolError):
            bad.failure_exception()
        live.abort()
        assert wait(live) is RoomState.FAILED and live.code == ErrorCode.ABORTED
        with pytest.raises(TransferFailed, match="ABORTED"):
            live.failure_exception()
        ended = {(f[0], f[1]) for f in decode.get_finished()}
        assert ended == {(1, RoomState.FAILED), (2, RoomState.FAILED)}


def test_close_fails_live_rooms_and_ends_the_process() -> None:
    _, skv = cache(7)
    _, dkv = cache(8)
    with SyncPrefill(skv, config=config()) as prefill:
        decode = ProcessDecode(dkv, config=config())
        rx = decode.receiver(3, prefill.bootstrap_address)
        decode.close()
        assert not decode._proc.is_alive()
        assert rx.poll() is RoomState.FAILED and rx.code == ErrorCode.ENDPOINT_CLOSED
        with pytest.raises(LocalProtocolError, match="closed"):
            decode.receiver(4, prefill.bootstrap_address)


def test_a_dead_endpoint_process_fails_its_rooms_only_after_the_drain() -> None:
    """kill -9 of the child: its live rooms report FAILED (INTERNAL_ERROR), not before
    ``Timeouts.drain`` has passed since the death was seen (writes into the shared cache may still
    land until the prefill drops the link)."""
    _, skv = cache(9)
    _, dkv = cache(10)
    with SyncPrefill(skv, config=config()) as prefill:
        decode = ProcessDecode(dkv, config=config(drain=1.0))
        try:
            rx = decode.receiver(8, prefill.bootstrap_address)
            os.kill(decode._proc.pid, signal.SIGKILL)
            decode._proc.join(5)
            seen = time.monotonic()
            assert rx.poll() is not RoomState.FAILED
            state = wait(rx, timeout=10)
            assert state is RoomState.FAILED and rx.code == ErrorCode.INTERNAL_ERROR
            assert time.monotonic() - seen >= 0.9
            with pytest.raises(TransferFailed, match="process died"):
                rx.failure_exception()
        finally:
            decode.close()


def hybrid(seed: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[torch.Tensor]], KVCache]:
    """A hybrid model's cache: full attention on model layers 0 and 3 (K/V pages), another paged
    group on layers 1 and 2, and a state group (two tensors per layer, 6 slots) on 1 and 2."""
    gen = torch.Generator().manual_seed(seed)

    def pages() -> list[list[torch.Tensor]]:
        return [[torch.randint(0, 256, (32, BLOCK, HEADS, DIM), dtype=torch.uint8, generator=gen) for _ in range(2)]
                for _ in range(2)]

    full, lin = pages(), pages()
    state = [[torch.randint(0, 256, (6, 4, 3), dtype=torch.uint8, generator=gen),
              torch.randint(0, 256, (6, 5), dtype=torch.uint8, generator=gen)] for _ in range(2)]
    kv = KVCache.from_tensors(full, model_layers=[0, 3]).with_groups(
        KVCache.from_tensors(lin, name="lin", model_layers=[1, 2]),
        StateCache.from_tensors("state", state, shard_dims=[0, None], model_layers=[1, 2]))
    return full, lin, state, kv


def test_calls_never_wait_for_a_stalled_endpoint_process_and_none_is_lost() -> None:
    """A child that reads no calls (stopped with SIGSTOP) fills the calls pipe; the engine's calls
    still return (a watchdog thread fails the test if one blocks), and once the child runs again
    every call reaches it in order: each room opened while it was stopped ends exactly once. Their
    3000 failure reasons, far more than a pipe holds, never stall the child either (the engine
    reads them with the ends), and each room's reason is still there for failure_exception."""
    import threading

    _dst, dkv = cache(6)
    _src, skv = cache(7)
    with SyncPrefill(skv, config=config()) as prefill, ProcessDecode(dkv, config=config()) as decode:
        pid = decode._proc.pid
        os.kill(pid, signal.SIGSTOP)
        done = threading.Event()
        opened: list[int] = []
        handles = {}

        def engine() -> None:
            for rid in range(1000, 4000):  # ~0.25 MB of calls: several times what a pipe holds
                handles[rid] = decode.receiver(rid, prefill.bootstrap_address, pages=[rid % 32], num_tokens=4)
                opened.append(rid)
                assert decode.get_finished() == []  # the engine's step: flushes the calls, reads ends
            done.set()

        try:
            worker = threading.Thread(target=engine, daemon=True)
            worker.start()
            assert done.wait(60), f"a call blocked on the stopped endpoint process after {len(opened)} rooms"
            assert decode._out, "the calls pipe never filled: the test did not test a stalled child"
        finally:
            os.kill(pid, signal.SIGCONT)
        for rid in opened:
            handles[rid].abort()
        ended: dict[int, RoomState] = {}
        deadline = time.monotonic() + 60
        while len(ended) < len(opened):
            assert time.monotonic() < deadline, f"{len(opened) - len(ended)} rooms never ended"
            for rid, state, _code in decode.get_finished():
                assert rid not in ended, f"room {rid} reported twice"
                ended[rid] = state
            time.sleep(0.005)
        assert sorted(ended) == opened
        assert set(ended.values()) == {RoomState.FAILED}
        for rid in (opened[0], opened[len(opened) // 2], opened[-1]):
            with pytest.raises(TransferFailed, match="abort") as info:
                handles[rid].failure_exception()
            assert info.value.code is ErrorCode.ABORTED


def test_hybrid_caches_cross_to_the_endpoints_processes_and_land_byte_exact() -> None:
    """A hybrid model's cache (two paged groups and a state group) through ProcessPrefill and
    ProcessDecode: the children rebuild it over the engine's own tensors, and a room in two
    chunks lands every group byte-exact, the state in the decode's slot."""
    s_full, s_lin, s_state, skv = hybrid(14)
    d_full, d_lin, d_state, dkv = hybrid(15)
    with ProcessPrefill(skv, config=config()) as prefill, ProcessDecode(dkv, config=config()) as decode:
        rx = decode.receiver(31, prefill.bootstrap_address, pages=[9, 2, 17], num_tokens=11,
                             group_pages={"lin": [30, 0, 5]}, state_slots={"state": 4})
        tx = prefill.sender(31)
        tx.init(11, state_slots={"state": 1})
        tx.send([4, 5], 8, group_pages={"lin": [7, 8]})
        tx.send([6], 11, group_pages={"lin": [12]})
        assert wait(rx) is RoomState.SUCCESS and wait(tx) is RoomState.SUCCESS
    for src, dst, s_pages, d_pages in ((s_full, d_full, [4, 5, 6], [9, 2, 17]), (s_lin, d_lin, [7, 8, 12],
                                                                                   [30, 0, 5])):
        assert all(torch.equal(a, b) for a, b in zip(tokens(src, s_pages, 11), tokens(dst, d_pages, 11)))
    for s_layer, d_layer in zip(s_state, d_state, strict=True):
        assert all(torch.equal(s[1], d[4]) for s, d in zip(s_layer, d_layer, strict=True))


def test_a_cache_without_tensors_is_refused() -> None:
    _, dkv = cache(11)
    bare = KVCache(geometry=dkv.geometry, region_addresses=dkv.region_addresses)
    with pytest.raises(LocalProtocolError, match="KVCache.from_tensors"):
        ProcessDecode(bare)


def test_both_sides_in_processes_chunks_and_layers_land_byte_exact() -> None:
    """ProcessPrefill and ProcessDecode: a room in two chunks, the second streamed layer by
    layer, lands byte-exact; a ``ready`` that is no interprocess CUDA event is refused at once."""
    src, skv = cache(12)
    dst, dkv = cache(13)
    with ProcessPrefill(skv, config=config()) as prefill, ProcessDecode(dkv, config=config()) as decode:
        assert prefill.bootstrap_address.startswith("tcp://")
        rx = decode.receiver(21, prefill.bootstrap_address, pages=[9, 2, 17], num_tokens=11)
        tx = prefill.sender(21)
        tx.init(11)
        tx.send([4, 5], 8)
        with pytest.raises(LocalProtocolError, match="interprocess"):
            tx.send([6], 11, layers=range(0, 1), ready=object())
        tx.send([6], 11, layers=range(0, 1))
        tx.send([], 11, layers=range(1, 2))
        assert wait(rx) is RoomState.SUCCESS and wait(tx) is RoomState.SUCCESS
        assert {f[0] for f in prefill.get_finished()} == {21}
        other = prefill.sender(22)
        rx2 = decode.receiver(22, prefill.bootstrap_address, pages=[1], num_tokens=3)
        other.abort()
        assert wait(rx2) is RoomState.FAILED and rx2.code == ErrorCode.ABORTED
    assert all(torch.equal(a, b) for a, b in zip(tokens(src, [4, 5, 6], 11), tokens(dst, [9, 2, 17], 11)))
