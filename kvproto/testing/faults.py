"""Control-plane faults and a clock that jumps, for tests of the asyncio endpoints.

Theory of operation
-------------------
``SeededFaults`` implements ``kvproto.aio.endpoint.ControlFaults``: an endpoint configured with
it (``EndpointConfig.control_faults``) hands every outgoing control frame to ``plan`` and sends
what comes back: ``[]`` drops the frame, two entries duplicate it, a positive delay sends the
copy later (``loop.call_later``), and a small random delay (*jitter*) lets later frames overtake
it. Probabilities are per frame and may differ per message type (``kinds``); every decision
draws from ``random.Random(seed)``. ``off()`` stops all faults (frames pass untouched), ``cut()``
drops every frame from then on (a link that died without closing).

``JumpClock`` is a callable clock for ``EndpointConfig.clock``: the event loop's time plus an
offset that ``jump`` moves forward, so that a test can make 30 s pass for one endpoint at once
(every deadline and liveness check of that endpoint sees it) while the event loop runs on.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from kvproto.wire import MsgType, peek_header

CONTROL_FAULT_KINDS = ("drop", "duplicate", "delay", "reorder", "cut")
"""The names ``SeededFaults.counts`` counts under."""


@dataclass(frozen=True, slots=True)
class FrameFaults:
    """Probabilities for one kind of control frame."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    reorder: float = 0.0


class SeededFaults:
    """Seeded drop / duplicate / delay / reorder of outgoing control frames (see module docstring).

    ``delay_range`` is the uniform range (seconds) of a delayed copy's delay; ``jitter`` the upper
    bound of the random delay that reorders a copy. ``kinds`` overrides the default probabilities
    for the message types it names; a type mapped to ``FrameFaults()`` is never faulted.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        drop: float = 0.0,
        duplicate: float = 0.0,
        delay: float = 0.0,
        reorder: float = 0.0,
        delay_range: tuple[float, float] = (0.001, 0.05),
        jitter: float = 0.01,
        kinds: Mapping[MsgType, FrameFaults] | None = None,
        enabled: bool = True,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.default = FrameFaults(drop=drop, duplicate=duplicate, delay=delay, reorder=reorder)
        self.kinds: dict[int, FrameFaults] = {int(k): v for k, v in (kinds or {}).items()}
        self.delay_range = delay_range
        self.jitter = jitter
        self.enabled = enabled
        self.cut_off = False
        self.frames = 0
        """Frames seen (sent or not)."""
        self.counts: Counter[str] = Counter()
        """Faults injected, by kind (``CONTROL_FAULT_KINDS``)."""
        self.by_type: Counter[tuple[str, str]] = Counter()
        """(fault kind, message type name) -> count."""

    def off(self) -> None:
        """Let every frame through untouched from now on (a cut stays cut)."""
        self.enabled = False

    def on(self) -> None:
        self.enabled = True

    def cut(self) -> None:
        """Drop every frame from now on."""
        self.cut_off = True

    def faults_for(self, frames: list[bytes]) -> tuple[FrameFaults, str]:
        header = peek_header(frames[-1]) if frames else None
        if header is None:
            return self.default, "?"
        try:
            name = MsgType(header.msg_type).name
        except ValueError:
            name = str(header.msg_type)
        return self.kinds.get(header.msg_type, self.default), name

    def plan(self, frames: list[bytes]) -> list[tuple[float, list[bytes]]]:
        self.frames += 1
        if self.cut_off:
            self._count("cut", frames)
            return []
        if not self.enabled:
            return [(0.0, frames)]
        probs, name = self.faults_for(frames)
        rng = self.rng
        if probs.drop and rng.random() < probs.drop:
            self._count("drop", name)
            return []
        copies = 1
        if probs.duplicate and rng.random() < probs.duplicate:
            self._count("duplicate", name)
            copies = 2
        out = []
        for _ in range(copies):
            delay = 0.0
            if probs.delay and rng.random() < probs.delay:
                self._count("delay", name)
                delay += rng.uniform(*self.delay_range)
            if probs.reorder and rng.random() < probs.reorder:
                self._count("reorder", name)
                delay += rng.uniform(0.0, self.jitter)
            out.append((delay, list(frames)))
        return out

    def _count(self, kind: str, what: object) -> None:
        if not isinstance(what, str):
            what = self.faults_for(what)[1]  # type: ignore[arg-type]
        self.counts[kind] += 1
        self.by_type[(kind, what)] += 1


class JumpClock:
    """``loop.time() + offset`` (``time.monotonic()`` outside a loop); ``jump`` adds to the offset."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self.offset = 0.0
        self.jumps: list[float] = []

    def __call__(self) -> float:
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return time.monotonic() + self.offset
        return loop.time() + self.offset

    def jump(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` at once."""
        if seconds < 0:
            raise ValueError("a clock only jumps forward")
        self.offset += seconds
        self.jumps.append(seconds)
