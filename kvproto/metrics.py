"""What an endpoint has done, as numbers a serving loop can read or scrape.

Theory of operation
-------------------
Every endpoint owns an ``EndpointMetrics`` (``endpoint.metrics``) that its event loop updates as
rooms open and end; reading it is a snapshot (``snapshot()``, plain numbers) or the Prometheus
exposition of one or more endpoints (``PrometheusCollector``, for ``prometheus_client``).

* Rooms that ended, by final state and error code; rooms now in each state (from the core).
* Per-room time in each phase, from the states the core saw the room enter: *bootstrap* (open to
  links ready), *waiting* (links ready to transfer start: the application's input), *transfer*
  (first write or request to the end), and the staging copies' time (gathers on prefill,
  scatters on decode), as sums and counts (Prometheus summaries without quantiles).
* Prefill rooms whose lease ran out (``rooms_expired``: no decode rank requested or held the room
  before its BOOTSTRAPPING deadline, ``kvproto.core.holds``): requests a serving engine reports as
  expired. They are among the rooms ended FAILED with BOOTSTRAP_TIMEOUT, which on a prefill rank
  may also come from a decode rank's ABORT.
* Bytes moved, and the wall-clock seconds during which at least one room was open: throughput
  is bytes over that span, never a sum of overlapping room durations (64 rooms moving at once
  for one second is one second, not 64).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvproto.core import RoomState

PHASES = ("bootstrap", "waiting", "transfer", "staging_copy")


@dataclass
class _Summary:
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1


@dataclass
class EndpointMetrics:
    role: str
    ended: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(final state, code name) -> rooms."""
    phases: dict[str, _Summary] = field(default_factory=lambda: {p: _Summary() for p in PHASES})
    bytes: int = 0
    busy_seconds: float = 0.0
    _open: int = 0
    _busy_since: float = 0.0
    core: Any = None

    # --- updated by the endpoint, on its loop -----------------------------------------------------
    def room_opened(self, now: float) -> None:
        if self._open == 0:
            self._busy_since = now
        self._open += 1

    def room_ended(self, now: float, state: RoomState, code: Any, timeline: Iterable[tuple[RoomState, float]],
                   nbytes: int, staging_s: float) -> None:
        self._open -= 1
        if self._open == 0:
            self.busy_seconds += now - self._busy_since
        code_name = getattr(code, "name", None) or ("" if code is None else str(code))
        self.ended[(state.name, code_name)] += 1
        self.bytes += nbytes
        for phase, seconds in room_phases(timeline).items():
            self.phases[phase].add(seconds)
        if staging_s:
            self.phases["staging_copy"].add(staging_s)

    # --- read by anyone ---------------------------------------------------------------------------
    @property
    def rooms_expired(self) -> int:
        """Prefill: rooms that failed at their lease (``CoreStats.rooms_expired``); 0 on a decode rank."""
        return self.core.stats.rooms_expired if self.core is not None else 0

    def busy(self, now: float) -> float:
        """Wall-clock seconds with at least one room open, up to ``now``."""
        return self.busy_seconds + (now - self._busy_since if self._open else 0.0)

    def snapshot(self, now: float) -> dict[str, Any]:
        live = dict(self.core.live_states) if self.core is not None else {}
        busy = self.busy(now)
        return {
            "role": self.role,
            "rooms_ended": {f"{s}/{c}" if c else s: n for (s, c), n in sorted(self.ended.items())},
            "rooms_live": {state.name: live.get(state, 0) for state in RoomState if not state.terminal},
            "rooms_expired": self.rooms_expired,
            "bytes": self.bytes,
            "busy_seconds": busy,
            "throughput_bytes_per_s": self.bytes / busy if busy else 0.0,
            "phase_seconds": {p: {"sum": s.total, "count": s.count} for p, s in self.phases.items()},
        }


def room_phases(timeline: Iterable[tuple[RoomState, float]]) -> dict[str, float]:
    """Seconds in bootstrap / waiting / transfer from the states a room entered, in order."""
    entered = dict(timeline)
    steps = sorted(entered.items(), key=lambda item: item[1])
    out: dict[str, float] = {}
    names = {RoomState.BOOTSTRAPPING: "bootstrap", RoomState.WAITING_FOR_INPUT: "waiting",
             RoomState.TRANSFERRING: "transfer"}
    for (state, began), (_next, ended) in zip(steps, steps[1:]):
        if state in names:
            out[names[state]] = out.get(names[state], 0.0) + (ended - began)
    return out


class PrometheusCollector:
    """A ``prometheus_client`` collector over endpoints:
    ``REGISTRY.register(PrometheusCollector([prefill, decode]))``."""

    def __init__(self, endpoints: Iterable[Any]) -> None:
        self.endpoints = list(endpoints)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        ended = CounterMetricFamily("kvproto_rooms_ended", "Rooms that ended, by final state and error code",
                                    labels=["role", "agent", "state", "code"])
        live = GaugeMetricFamily("kvproto_rooms_live", "Rooms now in each state", labels=["role", "agent", "state"])
        moved = CounterMetricFamily("kvproto_bytes", "KV bytes moved by ended rooms", labels=["role", "agent"])
        expired = CounterMetricFamily("kvproto_rooms_expired", "Prefill rooms that failed at their lease: no decode "
                                      "rank requested or held them in time", labels=["role", "agent"])
        busy = CounterMetricFamily("kvproto_busy_seconds", "Wall-clock seconds with at least one room open",
                                   labels=["role", "agent"])
        phase = SummaryMetricFamily("kvproto_room_phase_seconds", "Time rooms spent in each phase",
                                    labels=["role", "agent", "phase"])
        for ep in self.endpoints:
            m: EndpointMetrics = ep.metrics
            labels = [m.role, ep.agent_name]
            for (state, code), n in m.ended.items():
                ended.add_metric([*labels, state, code], n)
            counts = m.core.live_states if m.core is not None else {}
            for state in RoomState:
                if not state.terminal:
                    live.add_metric([*labels, state.name], counts.get(state, 0))
            moved.add_metric(labels, m.bytes)
            expired.add_metric(labels, m.rooms_expired)
            busy.add_metric(labels, m.busy(ep._now()) if ep._loop is not None else m.busy_seconds)
            for name, summary in m.phases.items():
                phase.add_metric([*labels, name], summary.count, summary.total)
        yield from (ended, live, moved, expired, busy, phase)
