"""Deadlines keyed by name, fired by the caller's clock.

Theory of operation: the core never sleeps. It stores one deadline per key; the I/O layer asks
``next_deadline()`` and calls the core's ``handle_timer(now)``, which pops every key whose
deadline is ``<= now``. Rescheduling or cancelling a key invalidates its old heap entry lazily,
so each operation is O(log n) and stale entries cost nothing but memory until popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable


class Timers:
    __slots__ = ("_heap", "_due", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._due: dict[Hashable, tuple[float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._due)

    def schedule(self, key: Hashable, when: float | None) -> None:
        """Set (or, with ``None``, clear) the deadline of ``key``."""
        if when is None:
            self._due.pop(key, None)
            return
        self._seq += 1
        self._due[key] = (when, self._seq)
        heapq.heappush(self._heap, (when, self._seq, key))
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._due):
            self._compact()

    def deadline(self, key: Hashable) -> float | None:
        """The deadline of ``key``, or None if it has none."""
        due = self._due.get(key)
        return None if due is None else due[0]

    def cancel(self, key: Hashable) -> None:
        self._due.pop(key, None)

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap:
            when, seq, key = heap[0]
            if self._due.get(key) == (when, seq):
                return when
            heapq.heappop(heap)
        return None

    def pop_due(self, now: float) -> list[Hashable]:
        """Keys whose deadline is ``<= now``, earliest first; they are cleared."""
        fired: list[Hashable] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, seq, key = heapq.heappop(heap)
            if self._due.get(key) == (when, seq):
                del self._due[key]
                fired.append(key)
        return fired

    def _compact(self) -> None:
        self._heap = [(w, s, k) for k, (w, s) in self._due.items()]
        heapq.heapify(self._heap)
