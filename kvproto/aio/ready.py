"""Waking a prefill rank's event loop when the engine's readiness events fire.

Theory of operation
-------------------
A chunk sent with ``ready=`` (layer-wise sends above all: one CUDA event per layer, shared by
every room of the forward) is held by the prefill endpoint until those events complete, then
posted (``PrefillEndpoint._release_held``) — unless its adapter orders it after those events on
the device (``kvproto.transport.base.wait_on_device``: the kernel path into a mapped peer), where
it is posted at once, its kernel queued behind the events, and nothing is held. The progress task
cannot await a CUDA event, and
between passes its loop sleeps in ``epoll``, whose timeout counts whole milliseconds: polling
the events from the loop notices a layer up to a millisecond after it is ready, which was most
of a layer-wise transfer's tail after the last layer.

``ReadyWaiter`` is one daemon thread per endpoint that waits in each watched event's
``synchronize()`` — CUDA's own wait, with the GIL released — in the order the events were
watched (one layer after another: the order they fire in), and wakes the loop
(``call_soon_threadsafe``) as each completes. The loop then releases what that event held, in
the pass it was woken for. The thread only decides *when* the loop looks: the loop still
queries the events itself, so a thread that is late or gone costs latency, never
correctness. An event is watched once however many writes it holds. Objects without
``synchronize`` (a CPU cache's stand-ins) are left to the loop's polling.

Cost: while the engine computes a forward, the thread sits in ``cudaEventSynchronize``; under
CUDA's default scheduling that wait spins one CPU core (an engine process whose device was set
to blocking sync sleeps there instead). ``EndpointConfig.ready_thread=False`` turns it off.

A second ``ReadyWaiter`` of a prefill rank (``kvproto-written``) waits for its own writes: while
writes are in flight and a progress pass found nothing to do, the loop spun (``sleep(0)`` pass
after pass), a core busy for as long as the link was, and the interpreter's lock taken from the
engine's threads each pass. Past ``EndpointConfig.busy_spin_s`` after the last pass that found
work, a rank whose adapter offers the event of its oldest write still running
(``kvproto.transport.base.completion_event``: the kernel path, whose events are made with
blocking sync, so this wait sleeps) watches that event here and sleeps until it fires, a control
message arrives or a deadline is due. The loop still polls every write itself when it wakes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("kvproto.aio")


class ReadyWaiter:
    """Wakes ``wake`` on ``loop`` as each watched event completes (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None], name: str = "kvproto-ready") -> None:
        self._loop, self._wake, self._name = loop, wake, name
        self._queue: collections.deque[Any] = collections.deque()
        self._watched: set[int] = set()
        """ids of the events queued or being waited for (each watched once)."""
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, events: Iterable[Any]) -> None:
        """Wake the loop when each of ``events`` completes (those that can be waited for)."""
        with self._cv:
            if self._closed:
                return
            added = False
            for event in events:
                if id(event) not in self._watched and callable(getattr(event, "synchronize", None)):
                    self._watched.add(id(event))
                    self._queue.append(event)
                    added = True
            if not added:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                event = self._queue[0]
            try:
                event.synchronize()
            except Exception as exc:  # noqa: BLE001 - the loop polls the event itself and sees the error
                log.debug("waiting for a readiness event: %s", exc)
            with self._cv:
                if self._closed:
                    return
                self._queue.popleft()
                self._watched.discard(id(event))
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is closed
                return

    def close(self) -> None:
        """Stop the thread (it ends once its current wait returns; it is a daemon)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._watched.clear()
            self._cv.notify()
