"""``kvproto.core.timers.Timers``: one deadline per key, fired by the caller's clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.core import Timers


def test_timers_empty_has_no_deadline():
    """A fresh Timers has no deadline, no keys, and fires nothing."""
    t = Timers()
    assert t.next_deadline() is None
    assert len(t) == 0
    assert t.pop_due(1e12) == []


def test_timers_fire_exactly_at_deadline():
    """A key fires when now == its deadline, not a microsecond before."""
    t = Timers()
    t.schedule("a", 30.0)
    assert t.pop_due(29.999999) == []
    assert t.next_deadline() == 30.0
    assert t.pop_due(30.0) == ["a"]
    assert t.next_deadline() is None
    assert len(t) == 0


def test_timers_pop_due_earliest_first():
    """Due keys come out earliest first; equal deadlines in scheduling order."""
    t = Timers()
    t.schedule("late", 5.0)
    t.schedule("early", 1.0)
    t.schedule("tie1", 3.0)
    t.schedule("tie2", 3.0)
    t.schedule("future", 100.0)
    assert t.pop_due(10.0) == ["early", "tie1", "tie2", "late"]
    assert t.next_deadline() == 100.0
    assert len(t) == 1


def test_timers_reschedule_replaces_deadline():
    """Scheduling a key again moves its deadline, earlier or later; the old one never fires."""
    t = Timers()
    t.schedule("k", 10.0)
    t.schedule("k", 20.0)
    assert t.next_deadline() == 20.0
    assert t.pop_due(15.0) == []
    t.schedule("k", 12.0)
    assert t.pop_due(12.0) == ["k"]
    assert t.pop_due(100.0) == []


def test_timers_reschedule_same_deadline_fires_once():
    """Re-arming a key with its current deadline still fires it exactly once."""
    t = Timers()
    t.schedule("k", 10.0)
    t.schedule("k", 10.0)
    assert t.pop_due(10.0) == ["k"]
    assert t.pop_due(10.0) == []


def test_timers_cancel_and_none_clear():
    """cancel() and schedule(key, None) both clear a deadline; cancelling twice is harmless."""
    t = Timers()
    t.schedule("a", 1.0)
    t.schedule("b", 2.0)
    t.cancel("a")
    t.cancel("a")
    t.cancel("never")
    t.schedule("b", None)
    t.schedule("c", None)
    assert len(t) == 0
    assert t.next_deadline() is None
    assert t.pop_due(10.0) == []


def test_timers_keys_of_any_hashable_kind():
    """Room ids (ints) and tuples such as ("parked", id) live side by side."""
    t = Timers()
    t.schedule(7, 2.0)
    t.schedule(("parked", 7), 1.0)
    assert t.pop_due(5.0) == [("parked", 7), 7]


def test_timers_compaction_keeps_live_deadlines():
    """Many reschedules compact the heap without losing or duplicating a live deadline."""
    t = Timers()
    for i in range(10):
        t.schedule(i, 1000.0 + i)
    for round_ in range(200):
        for i in range(10):
            t.schedule(i, 1000.0 + i + round_)
    assert len(t) == 10
    assert len(t._heap) <= 4 * len(t) + 64
    assert t.next_deadline() == 1000.0 + 199
    assert t.pop_due(1000.0 + 199 + 9) == list(range(10))
    assert len(t) == 0 and t.next_deadline() is None


def test_timers_next_deadline_skips_cancelled_head():
    """A cancelled earliest key does not shadow the next live deadline."""
    t = Timers()
    t.schedule("a", 1.0)
    t.schedule("b", 2.0)
    t.cancel("a")
    assert t.next_deadline() == 2.0
    assert t.pop_due(1.5) == []


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("schedule"), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 50))),
        st.tuples(st.just("cancel"), st.integers(0, 5), st.none()),
        st.tuples(st.just("pop"), st.none(), st.integers(0, 50)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_timers_match_reference_dict(ops):
    """Timers behaves like a plain {key: deadline} dict under any operation sequence."""
    t = Timers()
    model: dict[int, tuple[float, int]] = {}
    order = 0
    for op, key, value in ops:
        if op == "schedule":
            order += 1
            t.schedule(key, value)
            if value is None:
                model.pop(key, None)
            else:
                model[key] = (value, order)
        elif op == "cancel":
            t.cancel(key)
            model.pop(key, None)
        else:
            due = sorted((w, o, k) for k, (w, o) in model.items() if w <= value)
            assert t.pop_due(value) == [k for _, _, k in due]
            for _, _, k in due:
                del model[k]
        assert len(t) == len(model)
        expect = min((w for w, _ in model.values()), default=None)
        assert t.next_deadline() == expect
