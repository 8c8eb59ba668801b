"""An optional timeline of the data path, for finding where a staged piece's time goes.

Theory of operation
-------------------
With ``KVPROTO_TRACE=DIR`` in the environment, the endpoints append ``(time.monotonic(), event,
room, seq)`` for each step of every staged piece (prefill: granted, gathered, written; decode:
tagged, scattered) to a list in memory, with the GPU time of each copy and, through ``step``,
which step of a slow progress pass took its time, and each endpoint writes its list to
``DIR/<role>-<pid>.trace`` when it closes: one line per event. Control messages of a room are
marked as they leave (``sent_<Message>``) and arrive (``recv_<Message>``), a room's writes as
posted and written, its end as ``ended``; ``kvproto bench layers --processes`` marks ``fired``
(a batch's last layer's event seen fired by its thread, the tail's start: room = the batch's
first room, seq = how many microseconds later the event loop got to mark it). ``time.monotonic`` is one clock for every process of
a host, so the files of both sides merge into one timeline (``benchmarks/trace_timeline.py``
prints where a room's time goes, hop by hop). Without the
variable ``mark`` is a test of a module constant and nothing is kept.
"""

from __future__ import annotations

import os
import time

DIR = os.environ.get("KVPROTO_TRACE", "")
ENABLED = bool(DIR)
_events: list[tuple[float, str, int, int]] = []


def mark(event: str, room: int, seq: int) -> None:
    if ENABLED:
        _events.append((time.monotonic(), event, room, seq))


def step(event: str, began: float, floor: float = 5e-4) -> float:
    """Mark ``event`` with the microseconds since ``began`` (a ``time.perf_counter()``) where they
    exceed ``floor`` seconds: which step of a slow progress pass took its time. Returns now."""
    if not ENABLED:
        return 0.0
    now = time.perf_counter()
    if now - began > floor:
        _events.append((time.monotonic(), event, int((now - began) * 1e6), 0))
    return now


def dump(role: str) -> None:
    if not ENABLED or not _events:
        return
    os.makedirs(DIR, exist_ok=True)
    with open(os.path.join(DIR, f"{role}-{os.getpid()}.trace"), "a") as f:
        for t, event, room, seq in _events:
            f.write(f"{t:.6f} {event} {room} {seq}\n")
    _events.clear()
