"""Fault scripts over real asyncio endpoints: generation, execution and the invariants checked.

Theory of operation
-------------------
A ``Script`` is a seeded, printable description of one run: a prefill instance of TP 1 or 2
(``prefill_tp``) and one decode rank on the ``simulated`` transport, ZMQ on 127.0.0.1, a path
(``auto``/``sliced``/``staged``), several rooms (random tokens, prefix, aux slot, chunking,
open order and times, late destinations, aborts from either side at random times) and faults:
data-plane (``FaultPlan`` of every prefill agent: failed writes, copy-then-fail, delayed writes,
dropped / duplicated / reordered tags), control-plane (``SeededFaults`` on every endpoint: dropped
/ duplicated / delayed / reordered frames), a lost peer (the prefill agent loses the decode agent;
with ``cut`` its control frames stop too: the link dies), and a 30 s jump of one endpoint's clock. About a third of the scripts (``groups``) move a hybrid cache:
beside the K/V planes every rank has a sliding-window group of its own pool (the decode names only
the window's pages) and a state group sharded over TP (one slot per room), and every invariant
below covers their bytes too.
``Script.generate(seed)`` draws one; its ``repr`` is a complete reproducer. With
``perturb=True`` (the soak) the same script also gets perturbed scheduling (the event loop
stalls for random moments at random times), slow writes, and decode or prefill closes at random
moments of the rooms' lives, so that races between a close and the writes in flight are met
within minutes.

``run_script`` plays it and an ``Observer`` instruments the endpoints (wrapping ``_room_ended``,
``_drop_link`` and the decode core's ``handle_timer`` on the instances) to check, as it happens:

* each room ends exactly once on each side, and every room ends within ``WALL_S`` (no hang);
* a decode room reports SUCCESS only when its pages (past the prefix) and aux slot hold exactly
  the source bytes, and with no write of the simulated transport pending into them;
* a decode room never reports FAILED while a simulated write into its pages (or tagged with its
  room, for staged writes into its staging regions) is pending, and no write lands there after
  the room reported its end (the decode agent records every write that lands in it) — except
  when its drain deadline forced the report, or when the decode rank declared that write's
  initiator gone (heartbeat silence, a clock jump, a DropLink): those ends are counted as
  ``exempt_*`` (and ``exempt_hazard`` / ``late_landed_exempt`` when a write was in fact pending /
  landed late), since the design trusts a dropped link. A link that its prefill closed
  (ENDPOINT_CLOSED) earns no exemption: the prefill tells only once its writes cannot land;
* once every room ended, nothing remains: no rooms in the cores, no room deadlines (only parked
  requests, pre-aborts and holds remembered for rooms never opened may wait for theirs), no held
  ABORTs (``_draining``), empty staging rings, empty ``_handles`` and ``_pending``;
* with control faults off, no cut link and no clock jump (``quiet``), failure codes agree: a
  side fails with a code that was injected for that room (ABORTED, TRANSPORT_ERROR,
  ENDPOINT_CLOSED when the script closes the decode endpoint) or PEER_GONE; a timeout is allowed
  only where the script made one necessary (a lost tag: decode TRANSFER_TIMEOUT or
  STAGING_STALLED, and on staged paths the stalled ring's other rooms) — a decode abort or close
  while the link still bootstraps must reach the prefill, never leave it to its BOOTSTRAP_TIMEOUT —
  a code carried by the peer's ABORT counts as the peer's; and a
  decode room that fails after its prefill did (or after an abort) fails well under the
  transfer timeout after it.
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import zmq

from kvproto.aio import DecodeEndpoint, EndpointConfig, KVCache, PrefillEndpoint, StateCache
from kvproto.aio.endpoint import CLOSE_GRACE_S
from kvproto.aio.room import _Handle
from kvproto.core import RoomEnded, RoomState, Timeouts
from kvproto.geometry import Layout
from kvproto.testing import FaultPlan, FrameFaults, JumpClock, SeededFaults, pending_writes
from kvproto.wire import Abort, ErrorCode, MalformedTag, MsgType, decode_tag

BLOCK = 4
BLOCKS = 64
LAYERS = 2
HEADS = 2
"""KV heads per prefill rank (the decode rank holds all of them)."""
HEAD_DIM = 8
AUX_SLOTS = 8
AUX_BYTES = 16
SWA_WINDOW = 6
"""The sliding window of the ``swa`` group of scripts with ``groups``: the decode needs 6 tokens."""
STATE_SHAPE = (4, 8)
"""The ``ssm`` group's one tensor per layer (uint8, split over TP along its first dimension)."""
STATE_LAYERS = 2
TIMEOUTS = Timeouts(bootstrap=2.0, waiting=2.5, transfer=2.5, parked=2.0, drain=1.0, hold=1.0)
"""``hold``: a decode room waiting for its late destination holds its prefill rooms (protocol 1.4)
every third of a second, each hold for a second, so holds and their faults are met in every script."""
HEARTBEAT = (0.2, 1.0)
WALL_S = 15.0
"""Every room of a script must end within this (the longest chain is a bootstrap retry, a transfer
timeout and a drain deadline)."""
QUICK_S = 1.0
"""With quiet control, a decode room fails at most this long after the failure that caused it."""
TIMEOUT_CODES = frozenset({ErrorCode.BOOTSTRAP_TIMEOUT, ErrorCode.WAITING_TIMEOUT, ErrorCode.TRANSFER_TIMEOUT,
                           ErrorCode.STAGING_STALLED})
TAG_LOSSES = frozenset({"drop_tag", "fail_after_copy", "lost_tag"})
WRITE_FAILURES = frozenset({"fail_write", "fail_after_copy", "fail_after_tag", "lost_write"})

SUMMARY: Counter[str] = Counter()
"""Counts across every script run in this process (printed in the session summary)."""


def pages(n: int) -> int:
    return -(-n // BLOCK)


# --- scripts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoomScript:
    room_id: int
    tokens: int
    prefix: int
    chunks: tuple[int, ...]
    """End token of each prefill chunk; the last is ``tokens``."""
    src_pages: tuple[tuple[int, ...], ...]
    """Per prefill rank, the pages holding the room's tokens from 0."""
    dst_pages: tuple[int, ...]
    aux: tuple[int, int] | None
    """(prefill slot, decode slot) or None."""
    decode_at: float
    prefill_at: float
    dest_at: float | None
    """None: pages given at open; else ``set_destination`` this long after the open."""
    chunk_gap: float
    abort: tuple[str, float] | None
    """("D" or "P<rank>", seconds after the script starts)."""
    swa_src: tuple[tuple[int, ...], ...] = ()
    """Scripts with ``groups``: per prefill rank, the swa pages of the room's tokens from 0."""
    swa_dst: tuple[int, ...] = ()
    """The decode's swa pages: those holding the window's tokens."""
    state: tuple[tuple[int, ...], int] | None = None
    """(per prefill rank its slot, the decode slot) of the ssm group."""

    @property
    def window_start(self) -> int:
        return max(0, self.tokens - SWA_WINDOW)


@dataclass(frozen=True)
class Script:
    seed: int
    prefill_tp: int
    path: str
    staging_bytes: int
    rooms: tuple[RoomScript, ...]
    data: tuple[tuple[str, float], ...] = ()
    """FaultPlan probabilities of every prefill agent."""
    control: tuple[tuple[str, float], ...] | None = None
    """SeededFaults probabilities of every endpoint (None: control faults off)."""
    lose: tuple[int, float, bool] | None = None
    """(prefill rank, at, cut): the rank's agent loses the decode agent; ``cut``: its control link dies too."""
    jump: tuple[str, float] | None = None
    """("D" or "P<rank>", at): that endpoint's clock jumps 30 s."""
    control_kinds: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    """Per message type (``MsgType`` name) probabilities overriding ``control`` (turning it on)."""
    delay_polls: tuple[int, int] = (1, 8)
    """``FaultPlan.delay_polls`` of every prefill agent."""
    close_decode: float | None = None
    """Seconds after the script starts at which the decode endpoint closes (drawn by ``generate``
    while its link to the prefill instance typically still bootstraps; perturbed scripts draw it
    anywhere in the rooms' lives)."""
    close_prefill: tuple[int, float] | None = None
    """(prefill rank, at): that prefill endpoint closes (perturbed scripts and regressions)."""
    groups: bool = False
    """Every cache has the swa and ssm groups beyond its K/V planes (see the module docstring)."""
    perturb: tuple[float, float] | None = None
    """Perturbed scheduling (the soak, ``Script.generate(seed, perturb=True)``): (mean seconds
    between stalls, longest stall): a task blocks the event loop for a random time at random
    moments, as a loaded machine does, so that callbacks, deadlines and polls interleave
    differently from run to run."""

    @property
    def quiet(self) -> bool:
        """No control faults, no dead link, no clock jump: failure codes and times must agree."""
        return self.control is None and not self.control_kinds and self.jump is None and not (
            self.lose and self.lose[2])

    @classmethod
    def generate(cls, seed: int, *, perturb: bool = False) -> Script:
        """The script of ``seed``. ``perturb``: the same script, then perturbed scheduling, slow
        writes and endpoint closes at random moments (drawn apart: a seed's rooms and faults stay
        what they are without it)."""
        script = cls._generate(seed)
        if not perturb:
            return script
        rng = random.Random(seed * 104729 + 7)
        close_decode, close_prefill = script.close_decode, None
        first = min(r.decode_at for r in script.rooms)
        if close_decode is None and rng.random() < 0.3:  # anywhere in the rooms' lives
            close_decode = round(first + rng.uniform(0.0, 0.5), 4)
        if rng.random() < 0.2:
            close_prefill = (rng.randrange(script.prefill_tp), round(rng.uniform(0.0, 0.5), 4))
        data = dict(script.data)
        data.setdefault("delay_write", round(rng.uniform(0.2, 0.8), 3))
        low = rng.choice([1, 10, 100])
        return replace(script, close_decode=close_decode, close_prefill=close_prefill,
                       data=tuple(sorted(data.items())), delay_polls=(low, low * rng.choice([2, 10, 50])),
                       perturb=(round(rng.uniform(0.002, 0.02), 4), round(rng.uniform(0.0005, 0.004), 4)))

    @classmethod
    def _generate(cls, seed: int) -> Script:
        rng = random.Random(seed)
        tp = rng.choice([1, 1, 2])
        path = rng.choice(["auto", "auto", "sliced", "staged"])
        staging = rng.choice([256, 1024, 4096])
        used: set[int] = set()
        rooms = []
        for i in range(rng.randint(2, 5)):
            tokens = rng.randint(1, 16)
            prefix = rng.choice([0, 0, 0, BLOCK * rng.randint(0, (tokens - 1) // BLOCK)])
            ends: list[int] = []
            while not ends or ends[-1] < tokens:
                step = BLOCK * rng.randint(1, 3)
                end = min(tokens, (ends[-1] if ends else 0) + step)
                ends.append(end)
            n = pages(tokens)
            dst = rng.sample([p for p in range(BLOCKS) if p not in used], n)
            used.update(dst)
            abort = None
            if rng.random() < 0.3:
                abort = (rng.choice(["D"] + [f"P{r}" for r in range(tp)]), round(rng.uniform(0.0, 0.4), 3))
            rooms.append(RoomScript(
                room_id=1000 * seed + i + 1, tokens=tokens, prefix=prefix, chunks=tuple(ends),
                src_pages=tuple(tuple(rng.sample(range(BLOCKS), n)) for _ in range(tp)), dst_pages=tuple(dst),
                aux=(rng.randrange(AUX_SLOTS), i) if rng.random() < 0.5 else None,
                decode_at=round(rng.uniform(0.0, 0.2), 3), prefill_at=round(rng.uniform(0.0, 0.2), 3),
                dest_at=round(rng.uniform(0.0, 0.15), 3) if rng.random() < 0.25 else None,
                chunk_gap=rng.choice([0.0, 0.0, 0.01, 0.05]), abort=abort,
            ))
        data: dict[str, float] = {}
        for kind, p in (("fail_write", 0.1), ("fail_after_copy", 0.1), ("fail_after_tag", 0.1), ("delay_write", 0.5),
                        ("drop_tag", 0.1), ("duplicate_tag", 0.3), ("reorder_tag", 0.5)):
            if rng.random() < 0.3:
                data[kind] = round(rng.uniform(0.0, p), 3)
        control = None
        if rng.random() < 0.5:
            control = {k: round(rng.uniform(0.0, p), 3) for k, p in
                       (("drop", 0.08), ("duplicate", 0.2), ("delay", 0.3), ("reorder", 0.3)) if rng.random() < 0.6}
        lose = None
        if rng.random() < 0.15:
            lose = (rng.randrange(tp), round(rng.uniform(0.0, 0.4), 3), rng.random() < 0.5)
        jump = None
        if rng.random() < 0.1:
            jump = (rng.choice(["D"] + [f"P{r}" for r in range(tp)]), round(rng.uniform(0.0, 0.5), 3))
        # Endings while the decode's link still bootstraps, drawn apart so that the scripts of the
        # draws above stay what they were for every seed.
        extra = random.Random(seed * 7919 + 13)
        close_decode = None
        first = min(rooms, key=lambda r: r.decode_at)
        if extra.random() < 0.12:  # abort while bootstrapping: right after the first decode open
            i = rooms.index(first)
            rooms[i] = replace(first, abort=("D", round(first.decode_at + 0.001, 4)))
        elif extra.random() < 0.1:  # close while bootstrapping: every decode room opens, then close
            rooms = [replace(r, decode_at=first.decode_at, dest_at=None) for r in rooms]
            close_decode = round(first.decode_at + extra.uniform(0.0005, 0.005), 4)
        # Hybrid caches, drawn apart too.
        hybrid = random.Random(seed * 15485863 + 29)
        groups = hybrid.random() < 0.35
        if groups:
            used_swa: set[int] = set()
            prefill_slots = [list(range(AUX_SLOTS)) for _ in range(tp)]
            for k, r in enumerate(rooms):
                n = pages(r.tokens)
                first = r.window_start // BLOCK
                dst = hybrid.sample([p for p in range(BLOCKS) if p not in used_swa], n - first)
                used_swa.update(dst)
                slots = tuple(hybrid.choice(prefill_slots[rank]) for rank in range(tp))
                rooms[k] = replace(r, swa_src=tuple(tuple(hybrid.sample(range(BLOCKS), n)) for _ in range(tp)),
                                   swa_dst=tuple(dst), state=(slots, k))
        return cls(seed=seed, prefill_tp=tp, path=path, staging_bytes=staging, rooms=tuple(rooms), groups=groups,
                   data=tuple(sorted(data.items())),
                   control=tuple(sorted(control.items())) if control is not None else None, lose=lose, jump=jump,
                   close_decode=close_decode)


# --- caches ---------------------------------------------------------------------------------------------
@dataclass
class Cache:
    planes: list[list[torch.Tensor]]
    aux: torch.Tensor
    kv: KVCache
    swa: list[list[torch.Tensor]] = field(default_factory=list)
    """Scripts with ``groups``: the swa group's K and V planes (one layer)."""
    state: list[torch.Tensor] = field(default_factory=list)
    """Scripts with ``groups``: the ssm group's tensor of each layer, ``(slots, *local shape)``."""


def make_cache(*, heads: int, tp: int, rank: int, seed: int, total_heads: int, groups: bool = False) -> Cache:
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BLOCK, heads, HEAD_DIM)
    planes = [[torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
              for _ in range(2)]
    aux = torch.randint(0, 256, (AUX_SLOTS, AUX_BYTES), dtype=torch.uint8, generator=gen)
    kv = KVCache.from_tensors(planes, aux=aux, layout=Layout.NHD, tp_size=tp, tp_rank=rank, num_kv_heads=total_heads)
    if not groups:
        return Cache(planes, aux, kv)
    swa = [[torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)] for _ in range(2)]
    local = (STATE_SHAPE[0] // tp, STATE_SHAPE[1])
    state = [torch.randint(0, 256, (AUX_SLOTS, *local), dtype=torch.uint8, generator=gen) for _ in range(STATE_LAYERS)]
    kv = kv.with_groups(
        KVCache.from_tensors(swa, layout=Layout.NHD, tp_size=tp, tp_rank=rank, num_kv_heads=total_heads, name="swa",
                             window=SWA_WINDOW),
        StateCache.from_tensors("ssm", [[t] for t in state], shard_dims=[0], tp_size=tp, tp_rank=rank))
    return Cache(planes, aux, kv, swa, state)


def page_ranges(cache: Cache, page_list: tuple[int, ...], planes: list[list[torch.Tensor]] | None = None
                ) -> list[tuple[int, int]]:
    """Byte ranges of ``page_list`` in every region of ``cache`` (or of ``planes``)."""
    out = []
    for plane in cache.planes if planes is None else planes:
        for t in plane:
            size = t[0].numel() * t.element_size()
            out += [(t.data_ptr() + p * size, t.data_ptr() + (p + 1) * size) for p in page_list]
    return out


# --- the run ----------------------------------------------------------------------------------------
@dataclass
class End:
    side: str
    room_id: int
    state: RoomState
    code: Any
    reason: str
    at: float


@dataclass
class Outcome:
    script: Script
    ends: list[End] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    events: dict[tuple[int, str], float] = field(default_factory=dict)
    """(room, "abort") or (0, "lose") -> the loop time it happened."""
    notes: dict[tuple[int, str], Any] = field(default_factory=dict)
    """(room, "abort_state"): the room's state when aborted; (0, "fault_log"): (kind, tag) of every
    data-plane fault injected."""


class Observer:
    """Wraps the endpoints' hooks (on the instances) to check invariants as rooms end."""

    def __init__(self, script: Script, outcome: Outcome, decode: DecodeEndpoint, dcache: Cache,
                 prefills: list[PrefillEndpoint], pcaches: list[Cache], decode_plan: FaultPlan) -> None:
        self.script = script
        self.decode_plan = decode_plan
        self.marks: dict[int, tuple[int, RoomState, bool, frozenset[int]]] = {}
        """Decode room -> (writes landed before it ended, its end state, forced, links dropped by then)."""
        self.out = outcome
        self.decode = decode
        self.dcache = dcache
        self.prefills = prefills
        self.pcaches = pcaches
        self.rooms = {r.room_id: r for r in script.rooms}
        self.forced: set[int] = set()
        """Decode rooms whose end the core emitted at their drain deadline."""
        self.dropped_links: set[int] = set()
        """Link ids the decode rank dropped: it trusts them to write no more."""
        self.loop = asyncio.get_running_loop()
        self._wrap()

    def _wrap(self) -> None:
        d = self.decode
        orig_end, orig_drop, orig_timer = d._room_ended, d._drop_link, d.core.handle_timer

        def room_ended(out: RoomEnded) -> None:
            self._decode_end(out)
            orig_end(out)

        def drop_link(link: Any, code: Any, reason: str) -> None:
            if code != ErrorCode.ENDPOINT_CLOSED:  # a prefill that closed its link said so only once fenced
                self.dropped_links.add(link.link_id)
            orig_drop(link, code, reason)

        def handle_timer(now: float) -> None:
            failing = {r for r, room in d.core.rooms.items() if room.failing}
            before = len(d.core._outputs)
            orig_timer(now)
            for ended in d.core._outputs[before:]:
                if isinstance(ended, RoomEnded) and ended.room_id in failing:
                    self.forced.add(ended.room_id)

        d._room_ended = room_ended  # type: ignore[method-assign]
        d._drop_link = drop_link  # type: ignore[method-assign]
        d.core.handle_timer = handle_timer  # type: ignore[method-assign]
        for rank, p in enumerate(self.prefills):
            orig = p._room_ended

            def p_room_ended(out: RoomEnded, _orig: Callable[[RoomEnded], None] = orig, _rank: int = rank) -> None:
                self._record(f"P{_rank}", out)
                _orig(out)

            p._room_ended = p_room_ended  # type: ignore[method-assign]
            orig_send = p._send

            def p_send(link: Any, message: Any, _orig: Callable[..., None] = orig_send, _p: Any = p,
                       _rank: int = rank) -> None:
                if isinstance(message, Abort):
                    self._check_abort(_rank, _p, message)
                _orig(link, message)

            p._send = p_send  # type: ignore[method-assign]

    def _check_abort(self, rank: int, prefill: PrefillEndpoint, abort: Abort) -> None:
        """A prefill rank sends a room ABORT (or a link ABORT) to the decode rank only once none of
        its writes into it (for that room) can still land (spec/v1/messages.md, "Writes in flight")."""
        pending = [w for w in pending_writes(self.decode.agent_name) if w.initiator == prefill.agent_name
                   and (abort.room_id == 0 or _tag(w).room_id == abort.room_id)]
        if pending:
            what = f"room {abort.room_id}" if abort.room_id else "link"
            self.out.violations.append(f"prefill rank {rank} sent a {what} ABORT ({abort.reason}) with its writes "
                                       f"pending: {[_tag(w) for w in pending]}")

    def _record(self, side: str, out: RoomEnded) -> None:
        self.out.ends.append(End(side, out.room_id, out.state, out.code, out.reason, self.loop.time()))

    def _into(self, room_id: int, writes: list[Any]) -> list[Any]:
        """The writes among ``writes`` that target the room's pages or aux slot, or name the room."""
        r = self.rooms.get(room_id)
        ranges = page_ranges(self.dcache, r.dst_pages) if r is not None else []
        if r is not None and r.aux is not None:
            base = self.dcache.aux.data_ptr() + r.aux[1] * AUX_BYTES
            ranges.append((base, base + AUX_BYTES))
        if r is not None and r.state is not None:
            ranges += page_ranges(self.dcache, r.swa_dst, self.dcache.swa)
            for t in self.dcache.state:
                size = t[0].numel() * t.element_size()
                ranges.append((t.data_ptr() + r.state[1] * size, t.data_ptr() + (r.state[1] + 1) * size))
        hit = []
        for w in writes:
            try:
                named = decode_tag(w.tag).room_id == room_id
            except MalformedTag:
                named = False
            if named or any(w.overlaps(a, b) for a, b in ranges):
                hit.append(w)
        return hit

    def _decode_end(self, out: RoomEnded) -> None:
        self._record("D", out)
        busy = self._into(out.room_id, pending_writes(self.decode.agent_name))
        forced, dropped = out.room_id in self.forced, frozenset(self.dropped_links)
        self.marks[out.room_id] = (len(self.decode_plan.landed), out.state, forced, dropped)
        if out.state is RoomState.SUCCESS:
            if busy:
                self.out.violations.append(f"decode room {out.room_id} SUCCESS with writes pending: {busy}")
            problem = self.check_bytes(out.room_id)
            if problem:
                self.out.violations.append(f"decode room {out.room_id} SUCCESS but {problem}")
            return
        unexcused = [w for w in busy if not _excused(w, forced, dropped)]
        if forced:
            self.out.counts["exempt_forced"] += 1
        elif self.dropped_links:
            self.out.counts["exempt_dropped"] += 1
        self.out.counts["exempt_hazard"] += len(busy) > len(unexcused)
        if unexcused:
            self.out.violations.append(
                f"decode room {out.room_id} FAILED ({out.code}: {out.reason}) with writes pending into it: "
                f"{[(w.initiator, _tag(w)) for w in unexcused]}")

    def check_late_writes(self) -> None:
        """No write landed in a decode room's memory after the room ended (bar the exemptions)."""
        landed = self.decode_plan.landed
        for room_id, (mark, state, forced, dropped) in self.marks.items():
            late = self._into(room_id, landed[mark:])
            unexcused = [w for w in late if state is RoomState.SUCCESS or not _excused(w, forced, dropped)]
            self.out.counts["late_landed_exempt"] += len(late) - len(unexcused)
            if unexcused:
                self.out.violations.append(
                    f"{len(unexcused)} writes landed in decode room {room_id} after it reported {state.name}: "
                    f"{[(w.initiator, _tag(w)) for w in unexcused]}")

    def check_bytes(self, room_id: int) -> str | None:
        r = self.rooms[room_id]
        for plane in range(2):
            for layer in range(LAYERS):
                dst = self.dcache.planes[plane][layer]
                for t in range(r.prefix, r.tokens):
                    dp, off = r.dst_pages[t // BLOCK], t % BLOCK
                    for rank, cache in enumerate(self.pcaches):
                        src = cache.planes[plane][layer][r.src_pages[rank][t // BLOCK], off]
                        got = dst[dp, off, rank * HEADS:(rank + 1) * HEADS]
                        if not torch.equal(src, got):
                            return f"token {t} plane {plane} layer {layer} heads of rank {rank} differ"
        if r.aux is not None and not torch.equal(self.dcache.aux[r.aux[1]], self.pcaches[0].aux[r.aux[0]]):
            return f"aux slot {r.aux[1]} differs"
        if r.state is not None:
            return self._check_groups(r)
        return None

    def _check_groups(self, r: RoomScript) -> str | None:
        first = r.window_start // BLOCK
        for plane in range(2):
            dst = self.dcache.swa[plane][0]
            for t in range(max(r.prefix, r.window_start), r.tokens):
                dp, off = r.swa_dst[t // BLOCK - first], t % BLOCK
                for rank, cache in enumerate(self.pcaches):
                    src = cache.swa[plane][0][r.swa_src[rank][t // BLOCK], off]
                    if not torch.equal(src, dst[dp, off, rank * HEADS:(rank + 1) * HEADS]):
                        return f"swa token {t} plane {plane} heads of rank {rank} differ"
        tp = len(self.pcaches)
        rows = STATE_SHAPE[0] // tp
        for layer, dst in enumerate(self.dcache.state):
            for rank, cache in enumerate(self.pcaches):
                if not torch.equal(cache.state[layer][r.state[0][rank]], dst[r.state[1], rank * rows:(rank + 1) * rows]):
                    return f"ssm layer {layer} rows of rank {rank} differ"
        return None


def _tag(w: Any) -> Any:
    try:
        return decode_tag(w.tag)
    except MalformedTag:
        return w.tag


def _excused(w: Any, forced: bool, dropped: frozenset[int]) -> bool:
    """A write the design lets land after its room ended: the drain deadline forced the end, or the
    write's link had been dropped (the decode rank trusts a dropped link to write no more)."""
    tag = _tag(w)
    return forced or (not isinstance(tag, bytes) and tag.link_id in dropped)


# Bootstrap ports, never handed out twice in one process. Scripts run side by side
# (``CONCURRENT``): with random ports, a closed prefill rank's port is free again at once, another
# script's prefill binds it, and the first script's decode, still retrying its bootstrap address,
# meets an endpoint serving other caches (refused: another geometry, another group set, or a rank
# that is not a bootstrap rank; found by perturbed seed 13). Real deployments meet that too, and
# the decode fails the room naming the refusal; here it would only hide what the script tests. The
# range sits below Linux's ephemeral ports (32768-60999), so no outgoing connection takes one.
_PORTS = iter(range(20000 + (os.getpid() % 40) * 250, 32768))


async def _start_prefill(make: Callable[[int], PrefillEndpoint]) -> PrefillEndpoint:
    """Start the endpoint ``make(port)`` builds on the next unused port (skipping ones taken)."""
    for port in _PORTS:
        ep = make(port)
        try:
            await ep.start()
        except zmq.ZMQError as e:
            await ep.close()
            if e.errno != errno.EADDRINUSE:
                raise
            continue
        return ep
    raise RuntimeError("fault scripts ran out of bootstrap ports")


def _config(script: Script, *, plan: FaultPlan, clock: JumpClock, faults: SeededFaults,
            port: int = 0) -> EndpointConfig:
    return EndpointConfig(
        transport="simulated", transport_options={"faults": plan}, timeouts=TIMEOUTS,
        heartbeat_interval=HEARTBEAT[0], heartbeat_timeout=HEARTBEAT[1], idle_poll_s=0.002,
        clock=clock, control_faults=faults, path=script.path, staging_bytes=script.staging_bytes,
        host="127.0.0.1", port=port,
    )


async def run_script(script: Script, *, summarize: bool = True) -> Outcome:
    """Play ``script`` against fresh endpoints; returns what happened and every violation seen
    (``summarize``: count it in ``SUMMARY``)."""
    out = Outcome(script)
    loop = asyncio.get_running_loop()
    tp = script.prefill_tp
    pcaches = [make_cache(heads=HEADS, tp=tp, rank=r, seed=script.seed * 7 + r, total_heads=HEADS * tp,
                          groups=script.groups) for r in range(tp)]
    dcache = make_cache(heads=HEADS * tp, tp=1, rank=0, seed=script.seed * 7 + 5, total_heads=HEADS * tp,
                        groups=script.groups)
    plans = [FaultPlan(seed=script.seed * 10 + r, delay_polls=script.delay_polls,
                       **dict(script.data))  # type: ignore[arg-type]
             for r in range(tp)]
    control = dict(script.control or ())
    kinds = {MsgType[name]: FrameFaults(**dict(probs)) for name, probs in script.control_kinds}
    names = [f"P{r}" for r in range(tp)] + ["D"]
    on = script.control is not None or bool(kinds)
    faults = {n: SeededFaults(seed=script.seed * 10 + 5 + i, enabled=on, kinds=kinds, **control)
              for i, n in enumerate(names)}
    clocks = {n: JumpClock() for n in names}
    prefills: list[PrefillEndpoint] = []
    decode: DecodeEndpoint | None = None
    stalls: asyncio.Task[None] | None = None
    started = time.monotonic()
    try:
        for r in range(tp):
            ep = await _start_prefill(lambda port, r=r: PrefillEndpoint(
                pcaches[r].kv, bootstrap=prefills[0].address if r else None,
                config=_config(script, plan=plans[r], clock=clocks[f"P{r}"], faults=faults[f"P{r}"], port=port)))
            prefills.append(ep)
        decode_plan = FaultPlan(seed=script.seed * 10 + 9, record_landed=True)
        decode = DecodeEndpoint(dcache.kv, config=_config(script, plan=decode_plan, clock=clocks["D"],
                                                          faults=faults["D"]))
        await decode.start()
        observer = Observer(script, out, decode, dcache, prefills, pcaches, decode_plan)
        handles: dict[tuple[str, int], _Handle] = {}
        t0 = loop.time()
        tasks = []
        for r in script.rooms:
            tasks.append(asyncio.create_task(_decode_side(out, decode, prefills[0].bootstrap_address, r, handles, t0)))
            for rank, ep in enumerate(prefills):
                tasks.append(asyncio.create_task(_prefill_side(out, ep, rank, r, handles, t0)))
            if r.abort is not None:
                tasks.append(asyncio.create_task(_abort(out, r, handles, t0)))
        if script.lose is not None:
            tasks.append(asyncio.create_task(_lose(out, script, plans, faults, decode.agent_name, t0)))
        if script.jump is not None:
            tasks.append(asyncio.create_task(_jump(out, script, clocks, t0)))
        if script.close_decode is not None:
            tasks.append(asyncio.create_task(_close_decode(out, script, decode, t0)))
        if script.close_prefill is not None:
            tasks.append(asyncio.create_task(_close_prefill(out, script, prefills, t0)))
        if script.perturb is not None:
            stalls = asyncio.create_task(_stall(out, script))
        await asyncio.gather(*tasks)
        if stalls is not None:
            stalls.cancel()
        expected = {(s, r.room_id) for r in script.rooms for s in ["D", *names[:-1]]}
        deadline = t0 + WALL_S
        while loop.time() < deadline and not all(h.done for h in handles.values()):
            await asyncio.sleep(0.02)
        missing = sorted(expected - set(handles) - out.notes.get((0, "skipped"), set()))
        if missing:
            out.violations.append(f"rooms never opened: {missing}")
        hung = sorted(k for k, h in handles.items() if not h.done)
        if hung:
            states = {k: handles[k].poll().name for k in hung}
            out.violations.append(f"rooms still live after {WALL_S}s: {states}")
        _check_ends(out, script)
        out.notes[(0, "fault_log")] = [(kind, tag) for plan in plans for kind, _peer, tag in plan.log]
        if not hung:
            await _check_clean(out, decode, prefills)
        observer.check_late_writes()
        if script.quiet and not hung:
            _check_codes(out, script)
        for plan in plans:
            for kind, n in plan.counts.items():
                out.counts[f"data_{kind}"] += n
        for f in faults.values():
            for kind, n in f.counts.items():
                out.counts[f"control_{kind}"] += n
        out.counts["errors"] = decode.errors + sum(p.errors for p in prefills)
        if out.counts["errors"]:
            out.violations.append(f"endpoints absorbed {out.counts['errors']} unexpected exceptions")
    finally:
        for ep in [decode, *prefills[::-1]]:
            if ep is not None:
                await _close(out, ep)
    out.counts["wall_ms"] = int((time.monotonic() - started) * 1000)
    if summarize:
        _summarize(out)
    return out


CLOSE_S = 10.0


async def _close(out: Outcome, ep: Any) -> None:
    """Close an endpoint; one that has not closed within ``CLOSE_S`` is a finding (with its tasks' stacks)."""
    closing = asyncio.ensure_future(ep.close())
    done, _ = await asyncio.wait({closing}, timeout=CLOSE_S)
    if done:
        closing.result()
        return
    stacks = io.StringIO()
    for task in list(ep._tasks):
        print(f"task {task.get_name()} (cancelling={task.cancelling()}):", file=stacks)
        task.print_stack(limit=8, file=stacks)
    out.violations.append(f"{ep.ROLE} close() did not return within {CLOSE_S}s; its tasks:\n{stacks.getvalue()}")
    closing.cancel()
    for task in list(ep._tasks):
        task.cancel()


async def _at(t0: float, delay: float) -> None:
    await asyncio.sleep(max(0.0, t0 + delay - asyncio.get_running_loop().time()))


async def _decode_side(out: Outcome, decode: DecodeEndpoint, bootstrap: str, r: RoomScript,
                       handles: dict[tuple[str, int], _Handle], t0: float) -> None:
    await _at(t0, r.decode_at)
    if _after_close(out, decode, "D", r.room_id):
        return
    try:
        groups = {} if r.state is None else dict(group_pages={"swa": list(r.swa_dst)}, state_slots={"ssm": r.state[1]})
        if r.dest_at is None:
            handles[("D", r.room_id)] = decode.open_room(
                r.room_id, bootstrap, pages=list(r.dst_pages), num_tokens=r.tokens, prefix_tokens=r.prefix,
                aux_slot=r.aux[1] if r.aux else None, **groups)
            return
        room = handles[("D", r.room_id)] = decode.open_room(r.room_id, bootstrap)
        await asyncio.sleep(r.dest_at)
        if not _after_close(out, decode, "D", r.room_id):
            room.set_destination(list(r.dst_pages), r.tokens, prefix_tokens=r.prefix,
                                 aux_slot=r.aux[1] if r.aux else None, **groups)
    except Exception as exc:  # noqa: BLE001 - any exception from the API is a finding
        out.violations.append(f"decode room {r.room_id}: the application call raised {exc!r}")


def _after_close(out: Outcome, ep: Any, side: str, room_id: int) -> bool:
    """The script's next call for the room comes after ``ep`` closed: skip it (the API would
    refuse it with EndpointClosed, as ``test_endpoint_close_releases_everything`` checks)."""
    if not ep.closed:
        return False
    out.counts["calls_after_close"] += 1
    out.notes.setdefault((0, "skipped"), set()).add((side, room_id))
    return True


async def _prefill_side(out: Outcome, ep: PrefillEndpoint, rank: int, r: RoomScript,
                        handles: dict[tuple[str, int], _Handle], t0: float) -> None:
    await _at(t0, r.prefill_at)
    if _after_close(out, ep, f"P{rank}", r.room_id):
        return
    try:
        room = handles[(f"P{rank}", r.room_id)] = ep.open_room(r.room_id)
        start = 0
        for end in r.chunks:
            if r.chunk_gap:
                await asyncio.sleep(r.chunk_gap)
            if _after_close(out, ep, f"P{rank}", r.room_id):
                return
            last = end == r.tokens
            groups = {} if r.state is None else dict(
                group_pages={"swa": list(r.swa_src[rank][pages(start):pages(end)])},
                state_slots={"ssm": r.state[0][rank]} if last else None)
            room.send(list(r.src_pages[rank][pages(start):pages(end)]), end, last=last,
                      aux_slot=r.aux[0] if last and r.aux else None, **groups)
            start = end
    except Exception as exc:  # noqa: BLE001
        out.violations.append(f"prefill rank {rank} room {r.room_id}: the application call raised {exc!r}")


async def _abort(out: Outcome, r: RoomScript, handles: dict[tuple[str, int], _Handle], t0: float) -> None:
    assert r.abort is not None
    side, at = r.abort
    await _at(t0, at)
    handle = handles.get((side, r.room_id))
    if handle is None:
        out.counts["aborts_before_open"] += 1
        return
    out.notes[(r.room_id, "abort_state")] = handle.poll()
    out.events[(r.room_id, "abort")] = asyncio.get_running_loop().time()
    out.counts[f"aborts_{side[0]}"] += 1
    handle.abort()  # type: ignore[attr-defined]


async def _lose(out: Outcome, script: Script, plans: list[FaultPlan], faults: dict[str, SeededFaults],
                decode_agent: str, t0: float) -> None:
    assert script.lose is not None
    rank, at, cut = script.lose
    await _at(t0, at)
    plans[rank].lose(decode_agent)
    out.counts["lost_peers"] += 1
    out.events[(0, "lose")] = asyncio.get_running_loop().time()
    if cut:
        faults[f"P{rank}"].cut()
        out.counts["cut_links"] += 1


async def _close_decode(out: Outcome, script: Script, decode: DecodeEndpoint, t0: float) -> None:
    assert script.close_decode is not None
    await _at(t0, script.close_decode)
    out.counts["decode_closes"] += 1
    out.counts["decode_closes_bootstrapping"] += any(
        h.poll() is RoomState.BOOTSTRAPPING for h in list(decode._handles.values()))
    out.events[(0, "close")] = asyncio.get_running_loop().time()
    await decode.close()


async def _close_prefill(out: Outcome, script: Script, prefills: list[PrefillEndpoint], t0: float) -> None:
    assert script.close_prefill is not None
    rank, at = script.close_prefill
    await _at(t0, at)
    out.counts["prefill_closes"] += 1
    out.events[(0, "close_prefill")] = asyncio.get_running_loop().time()
    await prefills[rank].close()


async def _stall(out: Outcome, script: Script) -> None:
    """Block the event loop for a random moment at random times (``Script.perturb``)."""
    assert script.perturb is not None
    mean, longest = script.perturb
    rng = random.Random(script.seed * 31 + 17)
    while True:
        await asyncio.sleep(rng.expovariate(1.0 / mean))
        time.sleep(rng.uniform(0.0, longest))
        out.counts["stalls"] += 1


async def _jump(out: Outcome, script: Script, clocks: dict[str, JumpClock], t0: float) -> None:
    assert script.jump is not None
    who, at = script.jump
    await _at(t0, at)
    clocks[who].jump(30.0)
    out.counts["clock_jumps"] += 1


# --- checks after the run ---------------------------------------------------------------------------
def _check_ends(out: Outcome, script: Script) -> None:
    seen = Counter((e.side, e.room_id) for e in out.ends)
    twice = {k: n for k, n in seen.items() if n > 1}
    if twice:
        out.violations.append(f"rooms reported more than once: {twice}")


async def _check_clean(out: Outcome, decode: DecodeEndpoint, prefills: list[PrefillEndpoint]) -> None:
    """Nothing of any room remains (allowing a moment for held ABORTs and late writes to finish)."""
    deadline = asyncio.get_running_loop().time() + 2.0
    while True:
        left = _leftovers(decode, prefills)
        if not left or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.02)
    if left:
        out.violations.append(f"left behind after every room ended: {left}")


def _leftovers(decode: DecodeEndpoint, prefills: list[PrefillEndpoint]) -> list[str]:
    left = []
    for name, ep in [("D", decode), *((f"P{r}", p) for r, p in enumerate(prefills))]:
        core = ep.core
        if core.rooms:
            left.append(f"{name} core rooms {sorted(core.rooms)}")
        room_timers = [k for k in core.timers._due
                       if not (isinstance(k, tuple) and k[0] in ("parked", "preaborted", "held"))]
        if room_timers:
            left.append(f"{name} room deadlines {room_timers}")
        if ep._handles:
            left.append(f"{name} handles {sorted(ep._handles)}")
        tables = getattr(ep, "_kernels", None)  # the staging kernels' page tables, every group
        if tables is not None and len(tables):
            left.append(f"{name} page tables of {len(tables)} rooms")
    ring = decode.core.ring
    if ring is not None and (ring.used or ring.queued or ring.live_grants() or ring.owners()):
        left.append(f"D staging ring used {ring.used} queued {ring.queued} live {ring.live_grants()}")
    for r, p in enumerate(prefills):
        if p.core._draining:
            left.append(f"P{r} held ABORTs {list(p.core._draining)}")
        if p._pending:
            left.append(f"P{r} pending writes {len(p._pending)}")
        stager = getattr(p, "_stager", None)
        ring = getattr(stager, "ring", None)
        if ring is not None and (ring.used or ring.queued):
            left.append(f"P{r} local staging ring used {ring.used} queued {ring.queued}")
    return left


def _check_codes(out: Outcome, script: Script) -> None:
    """Quiet scripts: codes agree across sides, and a decode failure follows its cause quickly."""
    logs: dict[int, set[str]] = {}
    plans_logs = out.notes.get((0, "fault_log"), [])
    for kind, tag in plans_logs:
        try:
            logs.setdefault(decode_tag(tag).room_id, set()).add(kind)
        except MalformedTag:
            pass
    lost_rank = script.lose[0] if script.lose else None
    skipped = out.notes.get((0, "skipped"), set())
    any_tag_lost = any(kinds & TAG_LOSSES for kinds in logs.values())
    for r in script.rooms:
        ends = {e.side: e for e in out.ends if e.room_id == r.room_id}
        injected = logs.get(r.room_id, set())
        origins: set[Any] = {ErrorCode.PEER_GONE}
        aborted = (r.room_id, "abort") in out.events
        if aborted:
            origins.add(ErrorCode.ABORTED)
        if injected & WRITE_FAILURES or lost_rank is not None:
            origins.add(ErrorCode.TRANSPORT_ERROR)
        allowed_timeouts: dict[str, set[Any]] = {"D": set(), "P": set()}
        if any_tag_lost or lost_rank is not None:
            # A lost tag stalls its room, and on the staged path the shared staging ring behind it.
            allowed_timeouts["D"] |= {ErrorCode.TRANSFER_TIMEOUT, ErrorCode.STAGING_STALLED}
            allowed_timeouts["P"].add(ErrorCode.STAGING_STALLED)
            if script.path != "sliced" and (script.path == "staged" or script.prefill_tp > 1):
                # A grant is no progress for the prefill room's deadline: one starved by a stalled ring
                # can time out (TRANSFER_TIMEOUT) just after its late grant arrived.
                allowed_timeouts["P"].add(ErrorCode.TRANSFER_TIMEOUT)
        if script.close_decode is not None or script.close_prefill is not None:
            origins.add(ErrorCode.ENDPOINT_CLOSED)
        if script.close_prefill is not None or any(room == r.room_id for _s, room in skipped):
            # A closed prefill rank answers no handshake, and a side that closed before opening the
            # room never asks for it: the others can only wait out their bootstrap deadline.
            allowed_timeouts["D"].add(ErrorCode.BOOTSTRAP_TIMEOUT)
            allowed_timeouts["P"].add(ErrorCode.BOOTSTRAP_TIMEOUT)
        # A decode room that ends while its link bootstraps holds its ABORT until the link is up:
        # the prefill fails with the decode's code, never by waiting out its own deadline.
        abort_state = out.notes.get((r.room_id, "abort_state"))
        if aborted and r.abort and r.abort[0] == "D" and abort_state is RoomState.BOOTSTRAPPING:
            out.counts["abort_in_bootstrap"] += 1
        for side, e in ends.items():
            if e.state is not RoomState.FAILED:
                continue
            code = ErrorCode.coerce(e.code) if isinstance(e.code, int) else e.code
            if code in TIMEOUT_CODES:
                if not _propagated(side, e) and code not in allowed_timeouts[side[0]]:
                    out.violations.append(f"room {r.room_id}: {side} waited out {code.name} ({e.reason}); "
                                          f"injected {sorted(injected)}, ends {_fmt(ends)}")
            elif code not in origins:
                out.violations.append(f"room {r.room_id}: {side} failed with {code!r} ({e.reason}), "
                                      f"not one of {sorted(c.name for c in origins)}; ends {_fmt(ends)}")
        d = ends.get("D")
        if d is None or d.state is not RoomState.FAILED:
            continue
        causes = [e.at for s, e in ends.items() if s != "D" and e.state is RoomState.FAILED
                  and e.code not in TIMEOUT_CODES]
        if aborted:
            causes.append(out.events[(r.room_id, "abort")])
        # A closing prefill tells the decode only once its writes in flight ended (up to the grace).
        quick = QUICK_S + (CLOSE_GRACE_S if script.close_prefill is not None else 0.0)
        if causes and d.code not in TIMEOUT_CODES and d.at - min(causes) > quick:
            out.violations.append(f"room {r.room_id}: decode failed {d.at - min(causes):.2f}s after its cause "
                                  f"({_fmt(ends)})")
        if causes and d.code in TIMEOUT_CODES and not any_tag_lost and lost_rank is None and \
                script.close_prefill is None:
            out.violations.append(
                f"room {r.room_id}: decode timed out although a failure could reach it ({_fmt(ends)})")


def _propagated(side: str, e: End) -> bool:
    """The side failed with the code the other side's ABORT carried (its reason says so)."""
    return e.reason.startswith("decode aborted:") if side != "D" else (
        e.reason.startswith("prefill rank") and " aborted: " in e.reason)


def _fmt(ends: dict[str, End]) -> str:
    return ", ".join(f"{s}={e.state.name}/{getattr(e.code, 'name', e.code)}" for s, e in sorted(ends.items()))


def _summarize(out: Outcome) -> None:
    SUMMARY["scripts"] += 1
    s = out.script
    SUMMARY[f"topology_P{s.prefill_tp}D1"] += 1
    SUMMARY[f"path_{s.path}"] += 1
    SUMMARY["scripts_quiet"] += s.quiet
    SUMMARY["scripts_control_faults"] += s.control is not None
    SUMMARY["rooms"] += len(s.rooms)
    SUMMARY["scripts_groups"] += s.groups
    for e in out.ends:
        SUMMARY[f"ends_{e.side[0]}_{e.state.name}_groups"] += s.groups
        SUMMARY[f"ends_{e.side[0]}_{e.state.name}"] += 1
    for k, v in out.counts.items():
        if k != "wall_ms":
            SUMMARY[k] += v
    SUMMARY["violations"] += len(out.violations)
