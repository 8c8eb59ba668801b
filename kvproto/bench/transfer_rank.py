"""``kvproto bench transfer``'s rank processes, and what every process derives the same way.

Theory of operation
-------------------
The parent (``kvproto.bench.transfer``) drives one process per rank over a pipe. Each rank
process (``_rank_main``, ``_Rank``) builds its own cache, endpoint and transport agent, moves the
rooms of each case the parent names and checks every byte it holds against a function of what it
is (``token_terms``, ``page_terms``), so a wrong byte cannot pass. The cases' schedule (each
room's pages on both sides: ``room_pages``, the pools they come from, the segments an interleaved
run takes turns in) is a pure function of the case and the cache ``Shape``, computed the same way
in every process, so nothing of it crosses the pipe. The parent's module docstring says how the
figures are measured (pinning, the collector, raw references).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvproto.options import option

MIB = 1 << 20
GC_THRESHOLD = 100_000
"""The collector's first threshold during a case's rooms, by default (``quiet_gc``)."""
_GC_DEFAULT = gc.get_threshold()
"""The collector's thresholds as this process started (``_Rank.stop`` puts them back)."""
STATE_ROWS = 16
"""Rows (split over TP) of a hybrid cache's state tensor per layer: 16 x 128 bf16 = 4 KiB."""


@dataclass(frozen=True)
class Shape:
    """The cache every rank holds; each field is also its ``kvproto bench transfer`` flag."""

    layers: int = option(32)
    heads: int = option(8)
    head_dim: int = option(128)
    block: int = option(16)
    decode_block: int = option(0, "tokens per decode page (0: --block)")
    decode_layout: str = option("NHD", choices=["NHD", "HND"])
    """The decode cache's layout (prefill caches are NHD)."""

    def block_of(self, role: str) -> int:
        return self.decode_block or self.block if role == "decode" else self.block

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over every layer, K and V, every head (bf16)."""
        return self.layers * 2 * self.heads * self.head_dim * 2


@dataclass(frozen=True)
class Case:
    prefill_tp: int
    decode_tp: int
    size: int
    """Room bytes over all heads."""
    pages: str
    """``contiguous`` (consecutive pages on both sides) or ``random``."""
    path: str
    in_flight: int
    rooms: int
    seed: int = 0
    staging_mib: int = 0
    """Staging buffer of every rank (0: the endpoint's default)."""
    tamper: bool = False
    """Flip one byte of the last room on decode rank 0 before the check (proves the check can fail)."""
    hybrid: bool = False
    """The cache as three groups (module docstring)."""
    gc_threshold: int = GC_THRESHOLD
    """The cyclic collector's first threshold in the rank processes during the case's rooms
    (``quiet_gc``; CPython's own is 700)."""
    reuse: int = 0
    """Rooms 2, 3, ... land in the pages of room ``2 + (i - 2) % reuse`` (0: every room in pages of
    its own). An interleaved run longer than the decode pool holds reuses them a segment apart:
    each segment's rooms are checked when it ends, before the next segment of its kind."""

    def tokens(self, shape: Shape) -> int:
        return max(1, self.size // shape.token_bytes)

    def room_bytes(self, shape: Shape) -> int:
        """Bytes a room moves: its tokens of every layer, and a hybrid room's state."""
        state = len(state_layers(shape)) * STATE_ROWS * 128 * 2 if self.hybrid else 0
        return self.tokens(shape) * shape.token_bytes + state


def state_layers(shape: Shape) -> list[int]:
    """A hybrid cache's layers beyond the first group: all but every fourth."""
    return [layer for layer in range(shape.layers) if layer % 4 != 3]


def full_layers(shape: Shape) -> list[int]:
    return [layer for layer in range(shape.layers) if layer % 4 == 3]



# --- the schedule every process derives the same way ---------------------------------------------


def pages_per_room(case: Case, shape: Shape, role: str = "prefill") -> int:
    return -(-case.tokens(shape) // shape.block_of(role))


def pools(case: Case, shape: Shape) -> tuple[int, int]:
    """(prefill pages, decode pages): every room lands in pages of its own (or of its slot, with
    ``reuse``), so that rooms are checked outside the timed phase."""
    held = case.rooms if not case.reuse else min(case.rooms, case.reuse)
    return max(2 * pages_per_room(case, shape), 64), (held + 2) * pages_per_room(case, shape, "decode")


def room_pages(case: Case, shape: Shape, i: int) -> tuple[list[int], list[int]]:
    """(source pages on every prefill rank, destination pages on every decode rank) of room ``i``."""
    n, m = pages_per_room(case, shape), pages_per_room(case, shape, "decode")
    src_pool, _ = pools(case, shape)
    rng = random.Random(case.seed * 1_000_003 + i)
    at = i if not case.reuse or i < 2 else 2 + (i - 2) % case.reuse  # the room whose pages it takes
    dst = list(range(at * m, at * m + m))
    if case.pages == "contiguous":
        first = rng.randrange(0, src_pool - n + 1)
        return list(range(first, first + n)), dst
    rng.shuffle(dst)
    return rng.sample(range(src_pool), n), dst


def token_terms(torch: Any, regions: int, block: int, heads: Any, head_dim: int, device: Any) -> Any:
    """The part of the reference content that does not depend on the page: int16 of shape
    (regions, block, heads, head_dim), each below 16381."""
    def axis(values: Any, dim: int, mult: int) -> Any:
        shape = [1] * 4
        shape[dim] = -1
        return (values.to(device=device, dtype=torch.int32) * mult % 16381).view(shape)

    total = axis(torch.arange(regions), 0, 40503) + axis(torch.arange(block), 1, 337) + axis(heads, 2, 97) + axis(
        torch.arange(head_dim), 3, 13)
    return (total % 16381).to(torch.int16)


def page_terms(torch: Any, pages: Any) -> Any:
    """The page's part of the reference content (int16, below 16381): word = token term + page term."""
    return (pages.to(torch.int32) * 2654 % 16381).to(torch.int16)


# --- a rank process --------------------------------------------------------------------------------


class _Rank:
    def __init__(self, role: str, rank: int, tp: int, shape: Shape, device: str, transport: str) -> None:
        import torch

        self.torch = torch
        self.role, self.rank, self.tp, self.shape = role, rank, tp, shape
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this rank's kernels, events and transport agent
        self.transport = transport
        self.link_s: float | None = None
        """How long this decode rank's ``connect`` of the current case took (``ready``)."""
        self.endpoint: Any = None
        self.local_heads = shape.heads // tp
        self.big: Any = None
        self.sources: list[list[int]] = []
        """A prefill rank's source pages of every room of the case (drawn at ``start``)."""

    def _cache(self, case: Case) -> Any:
        from kvproto.aio import KVCache

        torch, s = self.torch, self.shape
        blocks = pools(case, s)[0 if self.role == "prefill" else 1]
        self.big = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        regions = s.layers * 2
        block = s.block_of(self.role)
        self.hnd = self.role == "decode" and s.decode_layout == "HND"
        page = (self.local_heads, block) if self.hnd else (block, self.local_heads)
        big = torch.zeros((regions, blocks, *page, s.head_dim), dtype=torch.bfloat16, device=self.device)
        heads = torch.arange(self.rank * self.local_heads, (self.rank + 1) * self.local_heads)
        self.terms = token_terms(torch, regions, s.block, heads, s.head_dim, self.device)
        if self.role == "prefill":
            words = big.view(torch.int16)
            every_page = page_terms(torch, torch.arange(blocks, device=self.device))
            for r in range(regions):
                torch.add(self.terms[r][None], every_page[:, None, None, None], out=words[r])
        self.big = big
        layout = "HND" if self.hnd else "NHD"
        if not case.hybrid:
            planes = [[big[2 * layer + plane] for layer in range(s.layers)] for plane in range(2)]
            return KVCache.from_tensors(planes, tp_size=self.tp, tp_rank=self.rank, num_kv_heads=s.heads,
                                        layout=layout)
        return self._hybrid(case, big, layout)

    def _hybrid(self, case: Case, big: Any, layout: str) -> Any:
        """The same regions as three groups (module docstring); the state filled on prefill."""
        from kvproto.aio import KVCache, StateCache

        torch, s = self.torch, self.shape
        full, lin = full_layers(s), state_layers(s)

        def group(layers: list[int], **kw: Any) -> Any:
            planes = [[big[2 * layer + plane] for layer in layers] for plane in range(2)]
            return KVCache.from_tensors(planes, tp_size=self.tp, tp_rank=self.rank, num_kv_heads=s.heads,
                                        layout=layout, model_layers=layers, **kw)

        rows = STATE_ROWS // self.tp
        slots = case.rooms + 2
        self.state = torch.zeros((len(lin), slots, rows, 128), dtype=torch.bfloat16, device=self.device)
        if self.role == "prefill":
            self.state.view(torch.int16).copy_(self._state_words(torch.arange(slots, device=self.device)))
        state = StateCache.from_tensors("state", [[self.state[i]] for i in range(len(lin))], shard_dims=[0],
                                        tp_size=self.tp, tp_rank=self.rank, model_layers=lin)
        return group(full).with_groups(group(lin, name="lin"), state)

    def _state_words(self, src_slots: Any) -> Any:
        """The prefill's state content of ``src_slots``, as int16 (layers, slots, local rows, 128)."""
        torch = self.torch
        rows = STATE_ROWS // self.tp
        layer = torch.arange(len(state_layers(self.shape)), device=self.device).view(-1, 1, 1, 1)
        slot = src_slots.view(1, -1, 1, 1)
        row = (self.rank * rows + torch.arange(rows, device=self.device)).view(1, 1, -1, 1)
        col = torch.arange(128, device=self.device).view(1, 1, 1, -1)
        return ((layer * 1009 + slot * 131 + row * 37 + col) % 16381).to(torch.int16)

    def _config(self, case: Case) -> Any:
        from kvproto.aio import EndpointConfig
        from kvproto.core import Timeouts

        t = 300.0
        return EndpointConfig(transport=self.transport, path=case.path, instance="bench-transfer-decode",
                              timeouts=Timeouts(bootstrap=t, waiting=t, transfer=t, parked=t),
                              staging_bytes=case.staging_mib << 20 if case.staging_mib else None)

    async def start(self, case: Case, bootstrap: str | None) -> str:
        from kvproto.aio import DecodeEndpoint, PrefillEndpoint

        kv = self._cache(case)
        # every room's source pages, drawn now: the rooms' timed phase measures kvproto, not the draws
        self.sources = [room_pages(case, self.shape, i)[0] for i in range(case.rooms + 2)] \
            if self.role == "prefill" else []
        if self.role == "prefill":
            self.endpoint = PrefillEndpoint(kv, bootstrap=bootstrap, config=self._config(case))
        else:
            self.endpoint = DecodeEndpoint(kv, config=self._config(case))
        await self.endpoint.start()
        return getattr(self.endpoint, "address", "")

    async def stop(self) -> None:
        self.link_s = None
        if self.endpoint is not None:
            await self.endpoint.close()
            self.endpoint = None
        self.big = self.state = self.terms = None  # the next case's caches must fit beside nothing
        self.sources = []
        gc.unfreeze()  # what ``quiet_gc`` froze: this case's cycles must be collectable again
        gc.set_threshold(*_GC_DEFAULT)
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    async def ready(self, case: Case, bootstrap: str) -> float:
        """Before a case's rooms, on every rank at once: the collector quieted (``quiet_gc``: a full
        collection, tens of milliseconds) and, on a decode rank, the link made (``connect``), so
        that no rank's first room waits for another rank still doing either. Returns the link's
        seconds (0 on a prefill rank)."""
        quiet_gc(case.gc_threshold)
        return await self.connect(bootstrap) if self.role == "decode" else 0.0

    async def rooms(self, case: Case, bootstrap: str) -> dict[str, Any]:
        """This rank's side of a case's rooms (after ``ready``)."""
        if self.role == "prefill":
            return (await send_rooms([(self, case, i) for i in range(case.rooms + 2)], case.in_flight))[0]
        schedule = [room_pages(case, self.shape, i) for i in range(case.rooms + 2)]
        first = await self._room(case, bootstrap, schedule, 0)
        warm = await self._room(case, bootstrap, schedule, 1)
        latencies: list[float] = []
        start, cpu = time.monotonic(), time.process_time()
        await self._windowed(case, bootstrap, schedule, range(2, case.rooms + 2), latencies)
        end, cpu = time.monotonic(), time.process_time() - cpu
        return {"link": self.link_s, "first": first, "warm": warm, "start": start, "end": end, "latencies": latencies,
                "bad": self._verify(case, schedule), "cpu": cpu / max(1e-9, end - start)}

    async def connect(self, bootstrap: str) -> float:
        """Link this decode rank to the prefill instance ahead of its first room (``connect``):
        the seconds it took, which a first room would otherwise pay."""
        t0 = time.monotonic()
        await self.endpoint.connect(bootstrap)
        self.link_s = time.monotonic() - t0
        return self.link_s

    async def _room(self, case: Case, bootstrap: str, schedule: list[tuple[list[int], list[int]]], i: int) -> float:
        """Open decode room ``i`` of ``case`` and wait for it: its latency."""
        t0 = time.monotonic()
        groups: dict[str, Any] = {}
        if case.hybrid:
            groups = dict(group_pages={"lin": schedule[i][1]}, state_slots={"state": i})
        handle = self.endpoint.open_room(_room_id(case, i), bootstrap, pages=schedule[i][1],
                                         num_tokens=case.tokens(self.shape), **groups)
        await handle.wait()
        return time.monotonic() - t0

    async def _windowed(self, case: Case, bootstrap: str, schedule: list[tuple[list[int], list[int]]],
                        indices: Any, latencies: list[float]) -> None:
        """Decode rooms ``indices`` of ``case``, ``in_flight`` open at a time, until all ended."""
        sem = asyncio.Semaphore(case.in_flight)

        async def windowed(i: int) -> None:
            try:
                latencies.append(await self._room(case, bootstrap, schedule, i))
            finally:
                sem.release()

        tasks = []
        for i in indices:
            await sem.acquire()
            tasks.append(asyncio.ensure_future(windowed(i)))
        await asyncio.gather(*tasks)

    def _verify(self, case: Case, schedule: list[tuple[list[int], list[int]]], slots: int = 0) -> int:
        """Mismatching bytes of every room of ``schedule`` and of the state slots of ``slots`` rooms
        (0: as many as ``schedule`` holds), after the timed phase."""
        if case.tamper and self.rank == 0:
            self.big.view(self.torch.uint8)[0, schedule[-1][1][0]].view(-1)[0] ^= 1  # noqa: E501 - token 0 of the last room
        bad = self._check(schedule, case.tokens(self.shape))
        if case.hybrid:  # decode slot i holds prefill slot i's state, this rank's rows of it
            want = self._decode_state_words(slots or len(schedule))
            bad += int((self.state.view(self.torch.int16) != want).sum().item()) * 2
        return bad

    def _decode_state_words(self, rooms: int) -> Any:
        """What this decode rank's state slots must hold after ``rooms`` rooms: the prefill content
        of the same slot, rows of this rank's share (computed without kvproto's plan)."""
        torch = self.torch
        rows = STATE_ROWS // self.tp
        layer = torch.arange(len(state_layers(self.shape)), device=self.device).view(-1, 1, 1, 1)
        slot = torch.arange(rooms, device=self.device).view(1, -1, 1, 1)
        row = (self.rank * rows + torch.arange(rows, device=self.device)).view(1, 1, -1, 1)
        col = torch.arange(128, device=self.device).view(1, 1, 1, -1)
        return ((layer * 1009 + slot * 131 + row * 37 + col) % 16381).to(torch.int16)

    def _check(self, schedule: list[tuple[list[int], list[int]]], tokens: int) -> int:
        """Mismatching bytes over every room's destination tokens (after the timed phase): token
        ``t`` must hold the content of source page ``src[t // block]``, slot ``t % block``,
        wherever the decode's block size and layout put it."""
        torch, s = self.torch, self.shape
        words = self.big.view(torch.int16)
        regions = words.shape[0]
        sb, db = s.block, s.block_of("decode")
        t = torch.arange(tokens, device=self.device)
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        for src, dst in schedule:
            spage = torch.tensor(src, device=self.device)[t // sb]
            dpage = torch.tensor(dst, device=self.device)[t // db]
            want_page = page_terms(torch, spage)[None, :, None, None]
            step = max(1, (32 << 20) // max(1, tokens * words[0, 0, 0].numel()))
            for first in range(0, regions, step):
                w = words[first:first + step]
                # (R, T, heads, dim); HND's advanced indices around a slice put T first
                got = w[:, dpage, :, t % db].transpose(0, 1) if self.hnd else w[:, dpage, t % db]
                want = self.terms[first:first + step][:, t % sb] + want_page
                bad += (got != want).sum()
        return int(bad.item()) * 2

    # --- raw reference ------------------------------------------------------------------------
    def raw_open(self, nbytes: int) -> tuple[bytes, int, int]:
        from kvproto.transport import MemKind, MemoryRegion, load_transport

        torch = self.torch
        self.raw_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.raw_agent = load_transport(self.transport, f"raw-{self.role}-{self.rank}-{random.getrandbits(32)}")
        kind = MemKind.VRAM if self.device.type == "cuda" else MemKind.DRAM
        dev = self.device.index or 0 if self.device.type == "cuda" else 0
        self.raw_kind, self.raw_dev = kind, dev
        self.raw_agent.register([MemoryRegion(self.raw_buf.data_ptr(), nbytes, dev, kind)])
        return self.raw_agent.metadata(), self.raw_buf.data_ptr(), dev

    def raw_serve(self, tags: int, timeout: float = 120.0) -> int:
        got, deadline = 0, time.monotonic() + timeout
        while got < tags and time.monotonic() < deadline:
            got += len(self.raw_agent.drain_notifications())
        return got

    def raw_write(self, meta: bytes, remote: int, remote_dev: int, size: int, concurrent: int, rounds: int,
                  pieces: int = 1) -> float:
        """Seconds per round of ``concurrent`` WRITEs of ``size`` bytes, each as ``pieces`` descriptors."""
        import numpy as np

        from kvproto.transport import XferState

        agent = self.raw_agent
        peer = agent.add_peer(meta)
        local = self.raw_buf.data_ptr()
        if self._copies_raw(agent, peer):
            seconds = self._raw_copy(agent, peer, remote, size * concurrent, rounds)
            agent.remove_peer(peer)
            return seconds
        piece = size // pieces
        times = []
        for r in range(rounds + 1):
            t0 = time.monotonic()
            xfers = []
            for k in range(concurrent):
                offs = np.arange(pieces, dtype=np.int64) * piece + k * size
                lrows = np.stack([local + offs, np.full(pieces, piece), np.full(pieces, self.raw_dev)], 1)
                rrows = np.stack([remote + offs, np.full(pieces, piece), np.full(pieces, remote_dev)], 1)
                xfers.append(agent.post_descs(peer, lrows, self.raw_kind, rrows, self.raw_kind, b"raw-%d-%d" % (r, k)))
            while xfers:
                for x in list(xfers):
                    state = agent.poll(x)
                    if state is XferState.ERROR:
                        raise RuntimeError("a raw write failed")
                    if state is XferState.DONE:
                        agent.release(x)
                        xfers.remove(x)
                agent.drain_notifications()
            if r:
                times.append(time.monotonic() - t0)
        agent.remove_peer(peer)
        return statistics.median(times)

    def _copies_raw(self, agent: Any, peer: str) -> bool:
        """Whether the raw reference is a device copy into the peer's mapping (the kernel path)
        rather than transport writes (which send the tags ``raw_serve`` counts)."""
        route = getattr(agent, "route", None)
        return route is not None and route(peer).name == "kernel"

    def raw_tags(self, meta: bytes, writes: int) -> int:
        """The tags ``writes`` raw writes to the peer of ``meta`` will send (0 for raw copies)."""
        peer = self.raw_agent.add_peer(meta)
        copies = self._copies_raw(self.raw_agent, peer)
        self.raw_agent.remove_peer(peer)
        return 0 if copies else writes

    def _raw_copy(self, agent: Any, peer: str, remote: int, nbytes: int, rounds: int) -> float:
        """The kernel path's raw reference: seconds of one contiguous device copy of ``nbytes``
        into the peer's memory through this process's mapping of it (median of ``rounds``)."""
        from kvproto.transport.cuda import driver

        torch = self.torch
        dst = agent.here(peer, remote, nbytes)
        stream = torch.cuda.Stream(self.device)
        times = []
        for r in range(rounds + 1):
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record(stream)
            driver().memcpy(dst, self.raw_buf.data_ptr(), nbytes, stream.cuda_stream)
            ended.record(stream)
            ended.synchronize()
            if r:
                times.append(began.elapsed_time(ended) / 1e3)
        return statistics.median(times)

    def raw_close(self) -> None:
        self.raw_agent.close()
        self.raw_buf = None

    def copy_bandwidth(self, nbytes: int) -> float:
        """Bytes per second of one device copy of ``nbytes`` (counted once)."""
        torch = self.torch
        a = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        times = []
        for i in range(6):
            t0 = time.perf_counter()
            b.copy_(a)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if i:
                times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times)


def thread_cpu() -> dict[tuple[int, str], float]:
    """This process's CPU seconds so far per thread, by (thread id, name) (Linux's ``/proc``; empty
    elsewhere): which threads a room's host time goes to (the event loop's, the transport's and
    the driver's own threads). Python's threads go by their Python names, the others by the
    operating system's. The scheduler's nanosecond count (``schedstat``) where the kernel keeps
    it: ``stat``'s clock ticks (10 ms) came in steps of ~200 us a room over 48 rooms."""
    import threading

    named = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9  # time on a CPU, in nanoseconds
        except (OSError, ValueError, IndexError):
            seconds = (int(rest[11]) + int(rest[12])) / tick  # utime, stime
        out[(int(tid), named.get(int(tid), name))] = seconds
    return out


def cpu_by_thread(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float]) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` snapshots per thread name (threads of one name summed)."""
    out: dict[str, float] = {}
    for key, seconds in after.items():
        spent = seconds - before.get(key, 0.0)
        if spent > 0:
            out[key[1]] = out.get(key[1], 0.0) + spent
    return out


async def send_rooms(order: list[tuple[_Rank, Case, int]], in_flight: int) -> list[dict[str, Any]]:
    """A prefill rank's side of a run: open and send every room of ``order`` ((rank, case, room)
    in the order the decode ranks open them), at most ``2 * in_flight`` unfinished, and wait for
    all. Per rank of ``order`` (in first appearance): the paths its rooms took, the descriptors
    of each room after the first two, and this process's CPU over the whole span."""
    ranks = list({id(rank): rank for rank, _case, _i in order}.values())
    stats = {id(rank): {"paths": set(), "descriptors": []} for rank in ranks}
    live: set[Any] = set()
    changed = asyncio.Event()
    began, cpu, threads = time.monotonic(), time.process_time(), thread_cpu()
    counted = {id(rank): _launch_counts(rank) for rank in ranks}

    def finished(handle: Any, mine: dict[str, Any], i: int, task: Any) -> None:
        live.discard(task)
        changed.set()
        if handle.stats.paths:
            mine["paths"].update(handle.stats.paths)
        if i >= 2:
            mine["descriptors"].append(handle.stats.descriptors)

    for rank, case, i in order:
        while len(live) >= 2 * in_flight:
            changed.clear()
            await changed.wait()
        handle = rank.endpoint.open_room(_room_id(case, i))
        src = rank.sources[i]
        if case.hybrid:
            handle.send(src, case.tokens(rank.shape), last=True, group_pages={"lin": src}, state_slots={"state": i})
        else:
            handle.send(src, case.tokens(rank.shape), last=True)
        task = asyncio.ensure_future(handle.wait())
        task.add_done_callback(functools.partial(finished, handle, stats[id(rank)], i))
        live.add(task)
    while live:
        changed.clear()
        await changed.wait()
    used = time.process_time() - cpu
    split = {name: seconds / len(order) * 1e6 for name, seconds in cpu_by_thread(threads, thread_cpu()).items()}
    return [{"paths": sorted(stats[id(rank)]["paths"]), "descriptors": stats[id(rank)]["descriptors"],
             "cpu": used / max(1e-9, time.monotonic() - began), "cpu_us_per_room": used / len(order) * 1e6,
             "threads_us_per_room": split, "writes_per_launch": _per_launch(counted[id(rank)], _launch_counts(rank)),
             "batched_by": _batched_by(rank)}
            for rank in ranks]


def _batched_by(rank: _Rank) -> str:
    """What carries several writes of a rank's agent: a kernel launch or a NIXL transfer."""
    transport = getattr(rank.endpoint, "transport", None)
    return "kernel launch" if hasattr(transport, "launches") else "NIXL transfer"


def _launch_counts(rank: _Rank) -> tuple[int, int] | None:
    """(writes, kernel launches) of a rank's kernel-path agent, or (writes, transfers) of its NIXL
    agent, so far; None for other adapters."""
    transport = getattr(rank.endpoint, "transport", None)
    launches = getattr(transport, "launches", None)
    if launches is not None:
        return transport._stats.writes, launches
    transfers = getattr(transport, "transfers", None)
    return None if transfers is None else (transport.stats.writes, transfers)


def _per_launch(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Writes a launch (or transfer) carried between two ``_launch_counts`` (None: neither)."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def quiet_gc(threshold: int = GC_THRESHOLD) -> None:
    """Before a rank's timed rooms: collect once, keep everything this process holds (torch, the
    caches, the endpoints) out of later collections (``gc.freeze``), and start a collection of the
    youngest objects only after ``threshold`` allocations instead of CPython's 700, as tuned
    serving processes do after loading their model (module docstring). ``_Rank.stop`` undoes all
    three."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(threshold, *_GC_DEFAULT[1:])


def segment_kinds(segments: int) -> list[int]:
    """The cache kind (0 or 1) of each segment of an interleaved run: 0 1 1 0 0 1 1 0 ..., so that
    every pair of segments (2p, 2p + 1) holds one of each and neither kind always goes first."""
    return [(s + s // 2) % 2 for s in range(segments)]


def segment_rooms(rooms: int, segment: int) -> list[tuple[int, range]]:
    """(kind, its rooms) of every segment of an interleaved run of ``rooms`` rooms per kind (a
    multiple of ``segment``): each kind's rooms 2, 3, ... in order, a segment at a time."""
    taken = [0, 0]
    out = []
    for k in segment_kinds(2 * (rooms // segment)):
        out.append((k, range(2 + taken[k] * segment, 2 + (taken[k] + 1) * segment)))
        taken[k] += 1
    return out


async def alternate(ranks: list[_Rank], cases: list[Case], addresses: list[str], segment: int) -> list[dict[str, Any]]:
    """A rank process's side of an interleaved run: both cache kinds' endpoints started, their
    rooms in segments of ``segment`` rooms taking turns (``segment_rooms``); each kind's first
    and warm rooms come first, alone. A decode rank times every segment and then checks every
    room of both kinds (where the kinds' pages are reused, ``Case.reuse``, each segment's rooms
    as it ends, untimed). Per kind: what ``_Rank.rooms`` returns, and ``segments`` ((start, end)
    of each of its segments)."""
    plan = segment_rooms(cases[0].rooms, segment)
    if ranks[0].role == "prefill":
        order = [(ranks[k], cases[k], i) for k in (0, 1) for i in (0, 1)]
        order += [(ranks[k], cases[k], i) for k, rooms in plan for i in rooms]
        return await send_rooms(order, cases[0].in_flight)
    schedules = [[room_pages(case, rank.shape, i) for i in range(case.rooms + 2)] for rank, case in zip(ranks, cases)]
    out: list[dict[str, Any]] = []
    for rank, case, address, schedule in zip(ranks, cases, addresses, schedules):
        first = await rank._room(case, address, schedule, 0)
        out.append({"link": rank.link_s, "first": first, "warm": await rank._room(case, address, schedule, 1), "latencies": [],
                    "segments": []})
    cpu, timed, bad = 0.0, 0.0, [0, 0]
    for k, rooms in plan:
        began, cpu_began = time.monotonic(), time.process_time()
        await ranks[k]._windowed(cases[k], addresses[k], schedules[k], rooms, out[k]["latencies"])
        ended = time.monotonic()
        cpu, timed = cpu + time.process_time() - cpu_began, timed + ended - began
        out[k]["segments"].append((began, ended))
        if cases[k].reuse:  # the next segment of this kind writes these pages again: check them now
            bad[k] += ranks[k]._check([schedules[k][i] for i in rooms], cases[k].tokens(ranks[k].shape))
    start, end = out[plan[0][0]]["segments"][0][0], out[plan[-1][0]]["segments"][-1][1]
    for k, mine in enumerate(out):
        kept = schedules[k][:2] if cases[k].reuse else schedules[k]  # (the rest were checked above)
        mine.update(start=start, end=end, cpu=cpu / max(1e-9, timed),
                    bad=bad[k] + ranks[k]._verify(cases[k], kept, slots=len(schedules[k])))
    return out


def _room_id(case: Case, i: int) -> int:
    """Room ``i`` of ``case``: the same number in every process (a fresh id range per case)."""
    return (case.seed + 1) * 1_000_000 + i


def physical_cores() -> list[set[int]]:
    """This process's usable logical CPUs grouped by physical core (hyperthread siblings
    together), in the order of their first CPU; one group per CPU where the topology is unknown."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores: dict[tuple[str, str], set[int]] = {}
    for cpu in allowed:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                key = (f.read().strip(), g.read().strip())
        except OSError:
            key = ("cpu", str(cpu))
        cores.setdefault(key, set()).add(cpu)
    return sorted(cores.values(), key=min)


def rank_cpus(ranks: int, per_rank: int = 2) -> list[set[int]] | None:
    """Physical cores of their own for each rank process (up to ``per_rank``: its loop, and the
    transport's and CUDA's threads beside it; the last cores, the first stay with the parent and
    the system), or None where there is not one for each rank and one more: two rank loops that
    spin on one core (or on hyperthread siblings) run at a fraction of their speed."""
    cores = physical_cores()
    if len(cores) < ranks + 1:
        return None
    each = max(1, min(per_rank, (len(cores) - 1) // ranks))
    mine = cores[len(cores) - ranks * each:]
    return [set().union(*mine[i * each:(i + 1) * each]) for i in range(ranks)]


def _rank_main(role: str, rank: int, tp: int, shape: Shape, device: str, transport: str, conn: Any,
               cpus: set[int] | None = None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
    ranks = [_Rank(role, rank, tp, shape, device, transport)]
    """The rank of each cache kind this process serves at once: one, and a second for the other
    kind of an interleaved run (made when first named)."""

    def kind(k: int) -> _Rank:
        while len(ranks) <= k:
            ranks.append(_Rank(role, rank, tp, shape, device, transport))
        return ranks[k]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while True:
            cmd, *args = await loop.run_in_executor(None, conn.recv)
            try:
                if cmd == "exit":
                    for me in ranks:
                        await me.stop()
                    conn.send(("ok", None))
                    return
                me = ranks[0]
                if cmd == "as":  # ("as", k, cmd, *args): the rank of cache kind k
                    k, cmd, *args = args
                    me = kind(k)
                if cmd == "alternate":
                    result: Any = alternate([kind(0), kind(1)], *args)
                else:
                    result = getattr(me, cmd)(*args)
                if asyncio.iscoroutine(result):
                    result = await result
                conn.send(("ok", result))
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
                import traceback

                conn.send(("error", f"{role} {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))

    profile_dir = os.environ.get("KVPROTO_BENCH_PROFILE")
    if not profile_dir:
        asyncio.run(serve())
        return
    import cProfile  # where a rank process spends its time: KVPROTO_BENCH_PROFILE=DIR

    with cProfile.Profile() as prof:
        asyncio.run(serve())
    prof.dump_stats(os.path.join(profile_dir, f"{role}-{rank}.prof"))
