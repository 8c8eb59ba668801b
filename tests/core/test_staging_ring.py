"""The staging ring under Hypothesis: no overlap of live grants, FIFO, every credit returned."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvproto.core.staging import StagingRing


class RingMachine(RuleBasedStateMachine):
    """Requests, grants, out-of-order releases and owner cancellation against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.ring = StagingRing(1024, align=64)
        self.next_key = 0
        self.asked: dict[int, tuple[int, int, int, int]] = {}  # key -> (owner, unit, units, tail) queued
        self.order: list[int] = []  # queued keys in request order
        self.live: dict[int, tuple[int, int, int]] = {}  # key -> (owner, offset, length)

    @rule(owner=st.integers(0, 3), unit=st.sampled_from([1, 48, 64, 100, 300, 1024]), units=st.integers(1, 40),
          tail=st.sampled_from([0, 0, 1, 100, 512]))
    def request(self, owner: int, unit: int, units: int, tail: int) -> None:
        if not self.ring.fits(unit, tail):
            with pytest.raises(ValueError):
                self.ring.request(self.next_key, owner, unit=unit, units=units, tail=tail)
            return
        key = self.next_key
        self.next_key += 1
        self.ring.request(key, owner, unit=unit, units=units, tail=tail)
        self.asked[key] = (owner, unit, units, tail)
        self.order.append(key)

    @rule()
    def grant(self) -> None:
        for g in self.ring.take_grants():
            assert g.key == self.order[0], "grants must come in request order"
            self.order.pop(0)
            owner, unit, units, tail = self.asked.pop(g.key)
            assert 1 <= g.units <= units and g.length == g.units * unit + (tail if g.units == units else 0)
            assert 0 <= g.offset and g.offset + g.length <= self.ring.capacity
            self.live[g.key] = (owner, g.offset, g.length)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        self.ring.release(key)
        del self.live[key]

    @rule(owner=st.integers(0, 3))
    def cancel(self, owner: int) -> None:
        self.ring.cancel_owner(owner)
        self.live = {k: v for k, v in self.live.items() if v[0] != owner}
        for k in [k for k, v in self.asked.items() if v[0] == owner]:
            del self.asked[k]
            self.order.remove(k)

    @invariant()
    def live_grants_never_overlap(self) -> None:
        spans = sorted((off, off + length) for _, off, length in self.live.values())
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"overlap {a0}-{a1} and {b0}-{b1}"

    @invariant()
    def used_within_capacity(self) -> None:
        assert 0 <= self.ring.used <= self.ring.capacity

    @invariant()
    def empty_queue_head_is_grantable_when_ring_is_empty(self) -> None:
        if not self.live and self.order:
            grants = self.ring.take_grants()
            assert grants, "an empty ring must grant the head request (no deadlock)"
            for g in grants:
                self.order.pop(0)
                owner, _unit, _units, _tail = self.asked.pop(g.key)
                self.live[g.key] = (owner, g.offset, g.length)

    def teardown(self) -> None:
        for key in list(self.live):
            self.ring.release(key)
        assert self.ring.used == 0 or not self.ring.live_grants()
        for owner in range(4):
            self.ring.cancel_owner(owner)
        assert self.ring.used == 0 and self.ring.queued == 0 and not self.ring.live_grants()


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_ring_splits_a_chunk_larger_than_the_ring() -> None:
    """A request for more than the ring holds is granted in pieces until it is all staged."""
    ring = StagingRing(1000, align=8)
    remaining, pieces, key = 95, 0, 0
    while remaining:
        ring.request(key, "room", unit=40, units=remaining)
        (grant,) = ring.take_grants()
        assert grant.length <= 1000
        remaining -= grant.units
        ring.release(key)
        pieces += 1
        key += 1
    assert pieces == 4 and ring.used == 0


def test_ring_reuses_space_only_behind_the_watermark() -> None:
    """Releasing a later region first reclaims nothing until the earlier one is released."""
    ring = StagingRing(256, align=64)
    for key in range(4):
        ring.request(key, "r", unit=64, units=1)
    assert len(ring.take_grants()) == 4
    ring.request(9, "r", unit=64, units=1)
    ring.release(2)
    assert ring.take_grants() == [] and ring.used == 256
    ring.release(0)
    (grant,) = ring.take_grants()
    assert grant.offset == 0


def test_ring_stalled_owner_is_cancelled_alone() -> None:
    """Cancelling a stalled owner frees its space for the other owners' queued requests."""
    ring = StagingRing(128, align=64)
    ring.request("stalled", "A", unit=128, units=1)
    ring.take_grants()
    ring.request("waiting", "B", unit=64, units=1)
    assert ring.take_grants() == []
    ring.cancel_owner("A")
    (grant,) = ring.take_grants()
    assert grant.key == "waiting" and grant.owner == "B"


def test_ring_refuses_a_unit_that_can_never_fit() -> None:
    """A unit larger than the ring is refused at request time, not left to deadlock."""
    ring = StagingRing(128, align=64)
    with pytest.raises(ValueError):
        ring.request(1, "A", unit=129, units=1)


def test_ring_tail_comes_only_with_the_last_unit() -> None:
    """A request's tail (a piece's state block) follows its units only in a grant of all of them. A
    request that fits the ring whole waits to be granted whole, tail and all, rather than split;
    one larger than the ring is granted in parts, the tail with the part that holds the last unit."""
    ring = StagingRing(1024, align=64)
    ring.request("a", "A", unit=100, units=4, tail=48)
    (grant,) = ring.take_grants()
    assert (grant.offset, grant.units, grant.length) == (0, 4, 448)
    ring.release("a")
    ring.request("filler", "B", unit=64, units=10)  # 640 bytes: 384 free, 400 + 48 no longer fit
    ring.take_grants()
    ring.request("b", "A", unit=100, units=4, tail=48)
    assert ring.take_grants() == []  # no part of it now: the whole once there is room
    ring.release("filler")
    (grant,) = ring.take_grants()
    assert (grant.units, grant.length) == (4, 448)
    ring.release("b")
    ring.request("c", "A", unit=100, units=12, tail=48)  # 1248 bytes: more than the ring
    (grant,) = ring.take_grants()
    assert (grant.units, grant.length) == (10, 1000)  # the tail waits for the last unit
    ring.request("d", "A", unit=100, units=2, tail=48)
    assert ring.take_grants() == []  # 248 bytes: only behind the watermark
    ring.release("c")
    (grant,) = ring.take_grants()
    assert (grant.units, grant.length) == (2, 248)


def test_ring_wraps_a_request_that_fits_whole_rather_than_split_it() -> None:
    """A request that does not fit before the end of the buffer but fits the ring whole is granted
    whole at the start once there is room there (the end's stretch padded), never in two parts."""
    ring = StagingRing(1024, align=64)
    for key in ("x", "y", "z"):
        ring.request(key, "A", unit=64, units=4)  # 256 bytes each: 768 used, 256 left before the end
    assert len(ring.take_grants()) == 3
    ring.request("w", "B", unit=64, units=5)  # 320 bytes: 4 units would fit before the end
    assert ring.take_grants() == []
    ring.release("x")  # 256 free at the start: still not the whole
    assert ring.take_grants() == []
    ring.release("y")
    (grant,) = ring.take_grants()
    assert (grant.offset, grant.units, grant.length) == (0, 5, 320)


def test_ring_refuses_a_tail_that_can_never_fit() -> None:
    """One unit and the tail must fit in the ring; otherwise the request is refused up front."""
    ring = StagingRing(128, align=64)
    assert ring.fits(64, 64) and not ring.fits(64, 65)
    with pytest.raises(ValueError, match="tail"):
        ring.request(1, "A", unit=64, units=3, tail=65)
