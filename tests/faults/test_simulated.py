"""The simulated adapter's faults, one kind at a time, and the control-frame faults and clock."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from kvproto.testing import FaultPlan, FrameFaults, JumpClock, SeededFaults, SimulatedTransport, pending_writes
from kvproto.transport import MemKind, MemoryRegion, TransportError, XferState, load_transport
from kvproto.transport.loopback import LoopbackTransport
from kvproto.wire import Abort, Heartbeat, MsgType, encode

BLOCK = 64
DRAM = MemKind.DRAM


class Agents:
    def __init__(self, plan: FaultPlan, target_plan: FaultPlan | None = None) -> None:
        self.a = SimulatedTransport("sim-a", faults=plan)
        self.b = SimulatedTransport("sim-b", faults=target_plan or FaultPlan(seed=99))
        self.src = (np.arange(16 * BLOCK) % 251).astype(np.uint8)
        self.dst = np.zeros(16 * BLOCK, dtype=np.uint8)
        self.a.register([MemoryRegion(self.src.ctypes.data, self.src.nbytes)])
        self.b.register([MemoryRegion(self.dst.ctypes.data, self.dst.nbytes)])
        self.a.add_peer(self.b.metadata())

    def write(self, block: int, tag: bytes):
        rows = lambda buf: np.array([(buf.ctypes.data + block * BLOCK, BLOCK, 0)])  # noqa: E731
        return self.a.post_descs("sim-b", rows(self.src), DRAM, rows(self.dst), DRAM, tag)

    def landed(self, block: int) -> bool:
        s = slice(block * BLOCK, (block + 1) * BLOCK)
        return bool(np.array_equal(self.dst[s], self.src[s]))

    def drain(self, rounds: int = 20) -> list[bytes]:
        got = []
        for _ in range(rounds):
            got += [n.tag for n in self.b.drain_notifications()]
        return got

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def agents(request: pytest.FixtureRequest) -> Iterator[Agents]:
    ag = Agents(request.param)
    try:
        yield ag
    finally:
        ag.close()


def _plan(**kw: object) -> FaultPlan:
    return FaultPlan(seed=1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("agents", [_plan(fail_write=1.0)], indirect=True)
def test_simulated_fail_write_copies_nothing(agents: Agents) -> None:
    """A failed write polls ERROR, copies nothing and sends no tag."""
    x = agents.write(3, b"t")
    assert agents.a.poll(x) is XferState.ERROR
    assert not agents.dst.any() and agents.drain() == []
    assert agents.a.faults.counts["fail_write"] == 1


@pytest.mark.parametrize("agents", [_plan(fail_after_copy=1.0)], indirect=True)
def test_simulated_fail_after_copy_lands_bytes_without_tag(agents: Agents) -> None:
    """Copy-then-fail: the bytes land, no tag comes, the write polls ERROR."""
    x = agents.write(3, b"t")
    assert agents.a.poll(x) is XferState.ERROR
    assert agents.landed(3) and agents.drain() == []


@pytest.mark.parametrize("agents", [_plan(fail_after_tag=1.0)], indirect=True)
def test_simulated_fail_after_tag_lands_bytes_and_tag(agents: Agents) -> None:
    """The bytes and the tag land, and still the write polls ERROR."""
    x = agents.write(3, b"t")
    assert agents.a.poll(x) is XferState.ERROR
    assert agents.landed(3) and agents.drain() == [b"t"]


@pytest.mark.parametrize("agents", [_plan(delay_write=1.0, delay_polls=(3, 3))], indirect=True)
def test_simulated_delay_keeps_write_pending_for_n_polls(agents: Agents) -> None:
    """A delayed write stays PENDING (and listed as pending into its target) for N polls."""
    x = agents.write(2, b"d")
    for _ in range(3):
        assert agents.a.poll(x) is XferState.PENDING
        assert [w.tag for w in pending_writes("sim-b")] == [b"d"]
        assert not agents.landed(2)
    assert pending_writes("sim-b")[0].overlaps(agents.dst.ctypes.data + 2 * BLOCK, agents.dst.ctypes.data + 3 * BLOCK)
    assert agents.a.poll(x) is XferState.DONE
    assert agents.landed(2) and pending_writes("sim-b") == [] and agents.drain() == [b"d"]


@pytest.mark.parametrize("agents", [_plan(drop_tag=1.0)], indirect=True)
def test_simulated_drop_tag_lands_bytes_only(agents: Agents) -> None:
    """A dropped tag: the write is DONE and its bytes landed, the target hears nothing."""
    assert agents.a.poll(agents.write(1, b"x")) is XferState.DONE
    assert agents.landed(1) and agents.drain() == []


@pytest.mark.parametrize("agents", [_plan(duplicate_tag=1.0, reorder_span=2)], indirect=True)
def test_simulated_duplicate_tag_arrives_twice(agents: Agents) -> None:
    """A duplicated tag is drained twice."""
    agents.a.notify("sim-b", b"n")
    assert agents.drain() == [b"n", b"n"]


@pytest.mark.parametrize("agents", [_plan(reorder_tag=1.0, reorder_span=6)], indirect=True)
def test_simulated_reorder_delivers_every_tag_out_of_order(agents: Agents) -> None:
    """Reordered tags all arrive, once each, and not in the order sent."""
    tags = [b"r%02d" % i for i in range(40)]
    for t in tags:
        agents.a.notify("sim-b", t)
    got = agents.drain(rounds=20)
    assert sorted(got) == tags and got != tags


@pytest.mark.parametrize("agents", [_plan()], indirect=True)
def test_simulated_lost_peer_fails_writes_and_silences_tags(agents: Agents) -> None:
    """After lose(peer): writes to it poll ERROR and copy nothing; tags either way vanish."""
    agents.a.faults.lose("sim-b")
    assert agents.a.poll(agents.write(0, b"w")) is XferState.ERROR
    agents.a.notify("sim-b", b"n")
    assert not agents.dst.any() and agents.drain() == []
    agents.b.add_peer(agents.a.metadata())
    agents.b.notify("sim-a", b"back")
    assert agents.a.drain_notifications() == []
    assert agents.a.faults.counts["lost_write"] == 1 and agents.a.faults.counts["lost_tag"] == 2


@pytest.mark.parametrize("agents", [_plan(drop_tag=1.0)], indirect=True)
def test_simulated_plan_changes_mid_test(agents: Agents) -> None:
    """A plan can be switched off, matched to some tags only, or replaced between writes."""
    agents.a.faults.off()
    agents.a.notify("sim-b", b"1")
    agents.a.faults.on()
    agents.a.faults.match = lambda peer, tag: tag == b"3"
    agents.a.notify("sim-b", b"2")
    agents.a.notify("sim-b", b"3")
    agents.a.faults = FaultPlan()
    agents.a.notify("sim-b", b"4")
    assert agents.drain() == [b"1", b"2", b"4"]


def test_simulated_same_seed_same_faults() -> None:
    """Two runs with the same seed inject the same faults on the same writes."""
    logs = []
    for _ in range(2):
        ag = Agents(FaultPlan(seed=5, fail_write=0.3, drop_tag=0.3, delay_write=0.3))
        try:
            for i in range(16):
                x = ag.write(i, b"%d" % i)
                while ag.a.poll(x) is XferState.PENDING:
                    pass
            logs.append((ag.a.faults.log, ag.drain()))
        finally:
            ag.close()
    assert logs[0] == logs[1] and logs[0][0]


def test_simulated_loads_by_name_with_a_plan_and_refuses_loopback_peers() -> None:
    """load_transport("simulated", name, faults=plan) uses the plan; loopback metadata is refused."""
    plan = FaultPlan(seed=3)
    a = load_transport("simulated", "sim-load", faults=plan)
    lb = LoopbackTransport("lb-peer")
    try:
        assert isinstance(a, SimulatedTransport) and a.faults is plan
        with pytest.raises(TransportError, match="simulated"):
            a.add_peer(lb.metadata())
        with pytest.raises(TransportError):
            lb.add_peer(a.metadata())
    finally:
        a.close()
        lb.close()


def _frames(msg: object) -> list[bytes]:
    return [b"ident", encode(msg)]  # type: ignore[arg-type]


def test_seeded_faults_drop_duplicate_delay_reorder_by_kind() -> None:
    """Per-kind probabilities: heartbeats are dropped, aborts duplicated and delayed in range."""
    faults = SeededFaults(seed=2, delay_range=(0.1, 0.2), kinds={
        MsgType.HEARTBEAT: FrameFaults(drop=1.0),
        MsgType.ABORT: FrameFaults(duplicate=1.0, delay=1.0),
    })
    assert faults.plan(_frames(Heartbeat(boot_id=1, seq=1))) == []
    copies = faults.plan(_frames(Abort(room_id=1, generation=1, code=1, reason="")))
    assert len(copies) == 2 and all(0.1 <= d <= 0.2 for d, _ in copies)
    assert faults.counts == {"drop": 1, "duplicate": 1, "delay": 2}
    assert faults.by_type[("drop", "HEARTBEAT")] == 1


def test_seeded_faults_off_and_cut() -> None:
    """off() lets frames through untouched; cut() drops every frame, faults on or off."""
    faults = SeededFaults(seed=1, drop=1.0)
    frames = _frames(Heartbeat(boot_id=1, seq=1))
    assert faults.plan(frames) == []
    faults.off()
    assert faults.plan(frames) == [(0.0, frames)]
    faults.cut()
    assert faults.plan(frames) == []
    assert faults.counts == {"drop": 1, "cut": 1}


def test_seeded_faults_reorder_jitters_within_bound() -> None:
    """Reordering adds a random delay below the jitter bound."""
    faults = SeededFaults(seed=4, reorder=1.0, jitter=0.02)
    delays = [faults.plan(_frames(Heartbeat(boot_id=1, seq=i)))[0][0] for i in range(50)]
    assert all(0.0 <= d <= 0.02 for d in delays) and len(set(delays)) > 10


def test_jump_clock_follows_loop_and_jumps() -> None:
    """The clock is the loop's time plus the jumps made so far."""

    async def main() -> None:
        clock = JumpClock()
        loop = asyncio.get_running_loop()
        assert abs(clock() - loop.time()) < 0.01
        clock.jump(30.0)
        assert abs(clock() - loop.time() - 30.0) < 0.01
        with pytest.raises(ValueError):
            clock.jump(-1.0)

    asyncio.run(main())
