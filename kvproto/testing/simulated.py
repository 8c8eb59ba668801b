"""The simulated adapter: the loopback adapter plus seeded data-plane faults.

Theory of operation
-------------------
``SimulatedTransport`` is a ``LoopbackTransport`` (agents in one process, bytes copied with
``memmove`` at the write's first poll, the tag delivered only after the bytes) whose every
write and notification first passes through a ``FaultPlan``. With an empty plan it behaves
exactly as the loopback adapter and passes the same conformance suite.

Who decides what:

* the *initiator's* plan decides the fate of each write when it is posted (fail with nothing
  copied, copy then fail, copy and notify then fail, or stay PENDING for N more polls) and the
  fate of each tag when it is sent (drop it, duplicate it, or hold it back for a few of the
  target's drains, which delivers it out of order);
* the *target* shuffles a drained batch that holds a tag marked for reordering (with its own
  plan's generator);
* ``FaultPlan.lose(peer)``: from then on every write to ``peer`` polls ERROR with nothing
  copied, tags to ``peer`` vanish, and tags *from* ``peer`` are dropped on arrival.

Plans are plain mutable objects: change their probabilities, ``lose`` a peer, or swap the
whole plan (``SimulatedTransport.faults``) in the middle of a test. Every decision draws from
the plan's ``random.Random(seed)``, so one plan and one sequence of calls give one outcome.

For invariant checks the module keeps every live simulated agent in a registry:
``pending_writes(target)`` lists the writes of any agent into ``target`` that are posted, not
yet run and not released — the writes that may still land in the target's memory; and an agent
whose plan sets ``record_landed`` keeps every write that landed in its memory, in order.
"""

from __future__ import annotations

import random
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvproto.transport.base import MemKind, Notification, XferState
from kvproto.transport.loopback import LoopbackTransport, LoopbackXfer

_AGENTS: weakref.WeakValueDictionary[str, SimulatedTransport] = weakref.WeakValueDictionary()

# Fates of a write, decided at post time.
OK, FAIL, FAIL_AFTER_COPY, FAIL_AFTER_TAG = "ok", "fail_write", "fail_after_copy", "fail_after_tag"

FAULT_KINDS = (
    "fail_write", "fail_after_copy", "fail_after_tag", "delay_write",
    "drop_tag", "duplicate_tag", "reorder_tag", "lost_write", "lost_tag",
)
"""The names ``FaultPlan.counts`` counts under (``lost_*``: writes and tags of a lost peer)."""


@dataclass
class FaultPlan:
    """Seeded data-plane faults of one agent. Probabilities are per write or per tag."""

    seed: int = 0
    fail_write: float = 0.0
    """The write polls ERROR and copies nothing."""
    fail_after_copy: float = 0.0
    """The bytes land, the tag is not sent, the write polls ERROR."""
    fail_after_tag: float = 0.0
    """The bytes land, the tag is sent, and still the write polls ERROR."""
    delay_write: float = 0.0
    """The write stays PENDING for a number of polls drawn from ``delay_polls``."""
    delay_polls: tuple[int, int] = (1, 8)
    delay_s: float = 0.0
    """A delayed write also stays PENDING until this many seconds after it was posted (0: its
    polls alone): a hold whose length does not depend on how fast the machine polls."""
    drop_tag: float = 0.0
    """The bytes land, the tag never arrives."""
    duplicate_tag: float = 0.0
    """The tag arrives twice (the copy possibly later)."""
    reorder_tag: float = 0.0
    """The tag is held back for 0..``reorder_span`` of the target's drains and its batch shuffled."""
    reorder_span: int = 4
    lost: set[str] = field(default_factory=set)
    """Peers this agent lost (see ``lose``)."""
    enabled: bool = True
    """False: no fault is injected (lost peers stay lost)."""
    match: Callable[[str, bytes], bool] | None = None
    """Only writes and tags for which ``match(peer, tag)`` is true are faulted (None: all)."""
    counts: Counter[str] = field(default_factory=Counter)
    """Faults injected so far, by kind (``FAULT_KINDS``)."""
    log: list[tuple[str, str, bytes]] = field(default_factory=list)
    """(kind, peer, tag) of every fault injected, in order."""
    record_landed: bool = False
    """Keep, in ``landed``, every write that lands in this agent's memory (for invariant checks)."""
    landed: list[PendingWrite] = field(default_factory=list)
    """Writes whose bytes landed in this agent's memory, in order (with ``record_landed``)."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def lose(self, peer: str) -> None:
        """From now on writes to ``peer`` fail, and tags to and from it vanish."""
        self.lost.add(peer)

    def off(self) -> None:
        self.enabled = False

    def on(self) -> None:
        self.enabled = True

    def _roll(self, p: float) -> bool:
        return p > 0.0 and self.rng.random() < p

    def _applies(self, peer: str, tag: bytes) -> bool:
        return self.enabled and (self.match is None or self.match(peer, tag))

    def _record(self, kind: str, peer: str, tag: bytes) -> None:
        self.counts[kind] += 1
        self.log.append((kind, peer, bytes(tag)))

    def write_fate(self, peer: str, tag: bytes) -> tuple[str, int]:
        """(fate, polls to wait) of a write posted to ``peer``."""
        if not self._applies(peer, tag):
            return OK, 0
        fate = OK
        for kind, p in ((FAIL, self.fail_write), (FAIL_AFTER_COPY, self.fail_after_copy),
                        (FAIL_AFTER_TAG, self.fail_after_tag)):
            if self._roll(p):
                fate = kind
                self._record(kind, peer, tag)
                break
        delay = 0
        if self._roll(self.delay_write):
            lo, hi = self.delay_polls
            delay = self.rng.randint(lo, hi)
            self._record("delay_write", peer, tag)
        return fate, delay

    def tag_fate(self, peer: str, tag: bytes) -> list[int]:
        """Holds (in target drains) of each copy of a tag sent to ``peer``: [] drops it; a
        negative hold marks a copy for reordering."""
        if not self._applies(peer, tag):
            return [0]
        if self._roll(self.drop_tag):
            self._record("drop_tag", peer, tag)
            return []
        copies = [0]
        if self._roll(self.duplicate_tag):
            self._record("duplicate_tag", peer, tag)
            copies.append(self.rng.randint(0, self.reorder_span))
        if self._roll(self.reorder_tag):
            self._record("reorder_tag", peer, tag)
            copies = [-1 - self.rng.randint(0, self.reorder_span) for _ in copies]
        return copies


@dataclass(eq=False, slots=True)
class SimulatedXfer(LoopbackXfer):
    fate: str = OK
    delay: int = 0
    """Polls left before the write runs."""
    due: float = 0.0
    """``time.monotonic()`` before which the write does not run (a bandwidth cap)."""


@dataclass(slots=True)
class _Queued:
    note: Notification
    hold: int
    shuffle: bool


@dataclass(frozen=True, slots=True, eq=False)
class PendingWrite:
    """A write that may still land (or, in ``FaultPlan.landed``, that did): ``rows`` are its merged
    (address, length, device) targets."""

    initiator: str
    target: str
    tag: bytes
    rows: np.ndarray

    def overlaps(self, start: int, end: int) -> bool:
        lo, ln = self.rows[:, 0], self.rows[:, 1]
        return bool(((lo < end) & (lo + ln > start)).any())


def pending_writes(target: str) -> list[PendingWrite]:
    """Writes of every live simulated agent into agent ``target`` that may still land."""
    out = []
    for agent in list(_AGENTS.values()):
        for xfer in agent._outstanding:
            if xfer.peer == target and xfer.state is XferState.PENDING and not xfer.released:
                out.append(PendingWrite(agent.name, target, xfer.tag, xfer.remote))
    return out


class SimulatedTransport(LoopbackTransport):
    """A loopback ``Transport`` with seeded faults (``faults``; see the module docstring)."""

    FORMAT = "kvproto-simulated/1"
    """Simulated agents peer only with simulated agents."""

    def __init__(self, name: str, *, faults: FaultPlan | None = None, bandwidth: float | None = None) -> None:
        """``bandwidth``: bytes per second of this agent's one simulated link: each write runs no
        sooner than its bytes could have crossed it after the writes posted before it (a link of
        that speed, for benchmarks on the CPU; None: writes run at their first poll)."""
        super().__init__(name)
        self.faults = faults if faults is not None else FaultPlan()
        self.bandwidth = bandwidth
        self._link_free = 0.0
        self._outstanding: set[SimulatedXfer] = set()
        self._queue: list[_Queued] = []
        _AGENTS[name] = self

    # --- writes ------------------------------------------------------------------------------
    def _post(self, peer: str, local: np.ndarray, local_kind: MemKind, remote: np.ndarray,
              remote_kind: MemKind, tag: bytes, nbytes: int) -> SimulatedXfer:
        self._count(len(local), nbytes)
        fate, delay = self.faults.write_fate(peer, tag)
        xfer = SimulatedXfer(peer, local, local_kind, remote, remote_kind, bytes(tag), fate=fate, delay=delay)
        if self.bandwidth:
            self._link_free = max(time.monotonic(), self._link_free) + nbytes / self.bandwidth
            xfer.due = self._link_free
        if delay and self.faults.delay_s:
            xfer.due = max(xfer.due or 0.0, time.monotonic() + self.faults.delay_s)
        self._outstanding.add(xfer)
        return xfer

    def _due(self, xfer: SimulatedXfer) -> bool:  # type: ignore[override]
        """A delayed write waits out its polls, a write on a capped link its time."""
        if xfer.delay > 0:
            xfer.delay -= 1
            return False
        return not (xfer.due and time.monotonic() < xfer.due)

    def release(self, xfer: SimulatedXfer) -> None:  # type: ignore[override]
        super().release(xfer)
        self._outstanding.discard(xfer)

    def _run(self, xfer: SimulatedXfer) -> str | None:  # type: ignore[override]
        """Copy a write's bytes and send its tag, as its fate says; returns why it failed, or None."""
        self._outstanding.discard(xfer)
        if xfer.peer in self.faults.lost:
            self.faults._record("lost_write", xfer.peer, xfer.tag)
            return f"injected: peer {xfer.peer!r} is lost"
        if xfer.fate == FAIL:
            return "injected: the write failed"
        target, why = self._target(xfer)
        if target is None:
            return why
        assert isinstance(target, SimulatedTransport)  # simulated agents peer with simulated agents only
        self._copy(xfer)
        if target.faults.record_landed:
            target.faults.landed.append(PendingWrite(self.name, target.name, xfer.tag, xfer.remote))
        if xfer.fate == FAIL_AFTER_COPY:
            return "injected: the write failed after its bytes landed"
        if xfer.tag:
            self._deliver(target, xfer.tag)
        if xfer.fate == FAIL_AFTER_TAG:
            return "injected: the write failed after its bytes and tag landed"
        return None

    # --- notifications -------------------------------------------------------------------------
    def _deliver(self, target: LoopbackTransport, tag: bytes) -> None:
        assert isinstance(target, SimulatedTransport)
        if target.name in self.faults.lost:
            self.faults._record("lost_tag", target.name, tag)
            return
        target._arrive(Notification(self.name, bytes(tag)), self.faults.tag_fate(target.name, tag))

    def _arrive(self, note: Notification, holds: list[int]) -> None:
        if note.peer in self.faults.lost:
            self.faults._record("lost_tag", note.peer, note.tag)
            return
        for hold in holds:
            self._queue.append(_Queued(note, abs(hold) - 1 if hold < 0 else hold, hold < 0))

    def drain_notifications(self) -> list[Notification]:
        self._check_open()
        if not self._queue:
            return []
        ready: list[_Queued] = []
        kept: list[_Queued] = []
        for item in self._queue:
            if item.hold > 0:
                item.hold -= 1
                kept.append(item)
            else:
                ready.append(item)
        self._queue = kept
        if len(ready) > 1 and any(item.shuffle for item in ready):
            self.faults.rng.shuffle(ready)
        return [item.note for item in ready]

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._outstanding.clear()
        self._queue.clear()
        if _AGENTS.get(self.name) is self:
            del _AGENTS[self.name]
