"""``kvproto bench transfer``: rooms between processes (one per rank, GPUs where there are two)
against raw transport writes of the same bytes, measured in the same run.

Theory of operation
-------------------
Every rank is its own process with its own cache, endpoint and transport agent, driven by the
parent over a pipe. Prefill ranks live on the first GPU and decode ranks on the second where
two exist (several ranks may share a GPU), all on one GPU where there is one, in host memory
otherwise. Where the host has a physical core for every rank process and one more, each rank
process is pinned to cores of its own (two where there are enough; ``--no-pin`` leaves them to the OS):
a rank's loop spins while data is expected, and it should not share a core with another rank's
loop or with the parent. (Pinning does not remove the run-to-run spread that ``--repeat`` is
for: on the GPU hosts measured, runs of one case still differ by 20-30 %.) Before its timed
rooms each rank process moves every object it holds out of the cyclic garbage collector's reach
(``gc.freeze``, as serving engines do once their model is loaded) and takes them back when its
endpoint stops: a process with torch loaded holds ~200,000 objects, and a full collection of them
stopped a rank's loop for 90-240 ms, once or twice per case, on the GPU hosts measured (a room's
p99 of 140 ms beside a p50 of 16 ms); frozen, a full collection takes ~1 ms.

For the same rooms the rank processes also collect their youngest objects only every 100,000
allocations (``--gc-threshold``; CPython's own threshold is 700), as tuned serving processes set
it after start-up, and put CPython's thresholds back when they stop. A young collection is not
paid by the rooms in proportion to what they allocate: it runs when the count of allocations
not yet freed crosses the threshold, and in an interleaved run (below) each segment starts from
a drained pipeline and climbs to its peak of rooms in flight. On an H100 at 128 MiB (1200 rooms
of each kind, 40 segments each) that peak crossed 700 in most hybrid segments and in few
one-group ones, because a hybrid room holds a few more objects in flight: inside hybrid segments
the prefill rank made 27 young collections (18.6 ms in all) at TP 1 -> 1 against 1 inside
one-group segments, 40 against 14 at 1 -> 2, and each prefill rank 26-27 against 1 at 2 -> 1.
That put ``vs one`` at 0.87-0.89 at TP 1 -> 1 and 0.88-0.89 at 2 -> 1 with CPython's threshold,
and 0.92-0.95 at both with 100,000, in alternating runs on one machine (the one-group rooms
gained too: 217-251 against 277-282 GB/s at 1 -> 1); with 100,000 no young collection ran inside
a segment. Rooms leave no reference cycles behind (none found per room with ``gc.DEBUG_SAVEALL``,
prefill and decode endpoints in one process on the CPU), so what the collector would have freed
is freed by reference counts anyway.

A *case* is one (prefill TP → decode TP, room size, page order, path, rooms in
flight); for each the parent starts fresh endpoints, so the first room also pays for the new
link (bootstrap, descriptor lists, kernels), and reports:

* the first room's latency, alone, and a warm room's latency, alone;
* then ``rooms`` rooms with ``in flight`` open at a time on every decode rank: the bytes of all
  of them over the wall-clock span from the first open to the last completion on any decode
  rank (GB/s), beside the *raw* reference: ``in flight`` concurrent one-descriptor WRITEs of
  the same size between the same two processes and devices, through a separate agent of the
  same transport, over as many rounds (measured once per size and concurrency);
* descriptors per room (as posted by the prefill ranks) and the path each room took.

Every byte is checked: the prefill ranks fill their caches once with a pure function of
(region, page, slot, global head, element); every room lands in decode pages of its own, and
after the timed phase each decode rank recomputes, for every room, what its pages must hold from
the room's source pages (the same seeded schedule runs in every process) and compares on the
device. The totals are read once per case.

The run also prints the constants of the direct-or-staged choice that it measured
(``kvproto.core.cost``): the transport's cost per descriptor (a room's bytes as one write of
page-sized descriptors against one single-descriptor write) and a device copy's bandwidth.

*Hybrid caches* (``--groups one hybrid``): the same model layers as a cache of three groups, as
a Gated DeltaNet hybrid keeps them: every fourth layer is the first group (full attention), the
other layers a second paged group of their own pool, and those layers also keep a per-request
state (``STATE_ROWS`` x 128 bf16 per layer, split over TP by rows) in a state group. A hybrid room
moves the same K/V bytes as the one-group room of its case, plus its state (its bytes counted),
in one write per chunk and link carrying every group; its line prints its GB/s against the one-group room's of the
same case (``vs one``), measured in the same run. Every group's bytes are checked. Both paged
groups name every page of the room, the same pages (as an indexer cache names its latent's), so
a hybrid room carries two page lists where a one-group room carries one; equal lists are taken
by identity once the first is checked (``kvproto.core.groups.same_pages``: one comparison, not a
pass for range and one for duplicates; the codec decodes them to one tuple; the kernel path's
table lists them once). Where a prefill rank serves several decode ranks (TP 1 -> 2), their equal
requests are decoded, checked and described once per room (``kvproto.core.sender``, *once per
room*). What a hybrid room still costs the host beyond a one-group room is per group and write:
the second list's encoding, the state group's destination and slot checks, the write's parts,
and where the host sets the pace (rooms of tens of pages on the kernel path) that shows in
``vs one``; the GPU's copy costs the same for both kinds (on an H100 at 128 MiB and TP 1 -> 1:
93.1 us a room's kernel for one group, 93.6 us for the hybrid, in a profile of both). On the
kernel path the pace is the prefill ranks' host time per room: on an H100, 25 us more per write
of the one-group rooms alone raised ``vs one`` at 128 MiB by about 0.05 at TP 2 -> 1 and by
0.06-0.11 at 1 -> 1, while 25 us more per decode room (``open_room``) moved nothing at either.
The kernel path's stream calls per write (``kvproto.kernels.lane``) took a write's adapter call
there from about 190 us to 65-90 us for both kinds alike, which moved both kinds' GB/s up by
12-46 % (two A/B runs) and left the hybrid's own extra work (its request's groups, checks and
parts) a larger share of what remains: at TP 1 -> 1, per-call medians of the prefill rank's
frame, submit and write handlers put it at 39 us a room, 29 us after the codec's record reads,
the checks and the write's parts were trimmed (means, which count the slow calls too: 46 and
39 us).

A case of a few hundred small rooms lasts well under a second, so two runs of it differ by more
than the effect being compared. ``--repeat N`` runs each case N times, the cache kinds taking
turns (one, hybrid, one, hybrid, ...) so that slow and fast spells of the host fall on both,
and prints the median run of each kind (every run's GB/s beside it); ``vs one`` is then the
ratio of the two medians. With three runs or more of each kind, the line also gives that ratio's
90 % bootstrap interval (``vs one 90 %``: each kind's runs drawn again with replacement, 2000
times, seeded): how far the spread of the runs leaves the ratio open. An interval that lies
above a target says more than one median that does.

Runs are not enough where the host's speed moves faster than runs end. On the GPU hosts
measured (virtual machines whose cores share physical ones with other tenants), one pinned core
running a fixed Python loop goes at full speed or at about half, in spells of 100 ms to tens of
seconds, and every core dips at once for ~150 ms about once a second; a case's runs are seconds
apart, so runs of one kind spread by 20-50 % and up to 2-3x, and the ratio of two kinds'
medians moves by 0.1-0.4 between machines. ``--interleave ROOMS`` compares the kinds inside one
run instead: every rank process starts both kinds' endpoints (and caches) at once, each kind's
first and warm rooms go alone, and then the kinds take turns in *segments* of ``ROOMS`` rooms
(0 1 1 0 0 1 1 0 ...: every pair of segments holds one of each, neither always first), each
segment timed from its first open to its last completion on any decode rank, the pipeline
drained between segments. A kind's GB/s is over its own segments; ``vs one`` is the median over
the pairs of adjacent segments (tens of milliseconds apart) of the hybrid's GB/s over the
one-group's, and its interval the bootstrap interval of that median. Every room of both kinds
is checked, as in other runs. Segments should hold several times the rooms in flight (the
drain costs one room's latency per segment). A run of more rooms than a decode rank's pages
hold (``--pool-rooms``: by default what a third of 48 GiB of pages per GPU allows, 120 rooms of
128 MiB) is not cut short: each kind's segments then land in the pages of its previous segment,
whose rooms are checked as it ends (outside its timing, before the next of its kind begins), so
a long run gives many pairs and still checks every byte. (The prefill ranks' CPU share then
spans those checks too, while they wait: only the decode ranks' is over the segments alone.)

It is a benchmark: the exit status is non-zero only when a room fails or a byte differs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproto.options import add_options, option, options_of

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


@dataclass
class Row:
    tp: str
    size_mib: float
    pages: str
    path: str
    in_flight: int
    rooms: int
    gbps: float
    raw_gbps: float
    ratio: float
    descriptors_per_room: float
    first_room_ms: float
    warm_room_ms: float
    first_minus_warm_ms: float
    room_p50_ms: float
    room_p99_ms: float
    bad_bytes: int
    paths: list[str] = field(default_factory=list)
    groups: str = "one"
    vs_one: float = 0.0
    """A hybrid row: its GB/s over the one-group row's of the same case (0: not measured)."""
    vs_one_interval: list[float] = field(default_factory=list)
    """With three runs or more of each kind: the 90 % bootstrap interval of ``vs_one`` (low, high)."""
    prefill_cpu: float = 0.0
    """The busiest prefill rank's process CPU over its rooms (1.0: one core all the time)."""
    decode_cpu: float = 0.0
    """The busiest decode rank's process CPU over the timed rooms."""
    prefill_us_per_room: float = 0.0
    """The busiest prefill rank's process CPU per room, in microseconds (its loop's spinning too)."""
    gbps_runs: list[float] = field(default_factory=list)
    """With ``--repeat``: the GB/s of every run of this case, in order; the row is the median run."""
    vs_one_pairs: list[float] = field(default_factory=list)
    """With ``--interleave``: the hybrid's GB/s over the one-group's in every pair of adjacent
    segments (JSON only); ``vs_one`` is their median."""
    prefill_us_runs: list[float] = field(default_factory=list)
    """With ``--repeat``: ``prefill_us_per_room`` of every run, in order (JSON only): a slow run
    whose prefill spent more CPU per room had a slower host; one that spent less waited."""


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

    async def rooms(self, case: Case, bootstrap: str) -> dict[str, Any]:
        quiet_gc(case.gc_threshold)
        if self.role == "prefill":
            return (await send_rooms([(self, case, i) for i in range(case.rooms + 2)], case.in_flight))[0]
        schedule = [room_pages(case, self.shape, i) for i in range(case.rooms + 2)]
        first = await self._room(case, bootstrap, schedule, 0)
        warm = await self._room(case, bootstrap, schedule, 1)
        latencies: list[float] = []
        start, cpu = time.monotonic(), time.process_time()
        await self._windowed(case, bootstrap, schedule, range(2, case.rooms + 2), latencies)
        end, cpu = time.monotonic(), time.process_time() - cpu
        return {"first": first, "warm": warm, "start": start, "end": end, "latencies": latencies,
                "bad": self._verify(case, schedule), "cpu": cpu / max(1e-9, end - start)}

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


async def send_rooms(order: list[tuple[_Rank, Case, int]], in_flight: int) -> list[dict[str, Any]]:
    """A prefill rank's side of a run: open and send every room of ``order`` ((rank, case, room)
    in the order the decode ranks open them), at most ``2 * in_flight`` unfinished, and wait for
    all. Per rank of ``order`` (in first appearance): the paths its rooms took, the descriptors
    of each room after the first two, and this process's CPU over the whole span."""
    ranks = list({id(rank): rank for rank, _case, _i in order}.values())
    stats = {id(rank): {"paths": set(), "descriptors": []} for rank in ranks}
    live: set[Any] = set()
    changed = asyncio.Event()
    began, cpu = time.monotonic(), time.process_time()

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
    return [{"paths": sorted(stats[id(rank)]["paths"]), "descriptors": stats[id(rank)]["descriptors"],
             "cpu": used / max(1e-9, time.monotonic() - began), "cpu_us_per_room": used / len(order) * 1e6}
            for rank in ranks]


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
    quiet_gc(cases[0].gc_threshold)
    if ranks[0].role == "prefill":
        order = [(ranks[k], cases[k], i) for k in (0, 1) for i in (0, 1)]
        order += [(ranks[k], cases[k], i) for k, rooms in plan for i in rooms]
        return await send_rooms(order, cases[0].in_flight)
    schedules = [[room_pages(case, rank.shape, i) for i in range(case.rooms + 2)] for rank, case in zip(ranks, cases)]
    out: list[dict[str, Any]] = []
    for rank, case, address, schedule in zip(ranks, cases, addresses, schedules):
        first = await rank._room(case, address, schedule, 0)
        out.append({"first": first, "warm": await rank._room(case, address, schedule, 1), "latencies": [],
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


# --- the parent ------------------------------------------------------------------------------------


class _Group:
    """The rank processes of one (prefill TP, decode TP)."""

    def __init__(self, prefill_tp: int, decode_tp: int, shape: Shape, devices: tuple[str, str], transport: str,
                 pin: bool = True):
        ctx = mp.get_context("spawn")
        self.ranks: list[tuple[str, int, Any, Any]] = []
        self.cpus = rank_cpus(prefill_tp + decode_tp) if pin else None
        """The physical core (its logical CPUs) of every rank process in order, or None: not pinned."""
        for role, tp, device in (("prefill", prefill_tp, devices[0]), ("decode", decode_tp, devices[1])):
            for rank in range(tp):
                parent, child = ctx.Pipe()
                cpus = self.cpus[len(self.ranks)] if self.cpus else None
                proc = ctx.Process(target=_rank_main, args=(role, rank, tp, shape, device, transport, child, cpus),
                                   daemon=True, name=f"{role}-{rank}")
                proc.start()
                self.ranks.append((role, rank, parent, proc))

    def by_role(self, role: str) -> list[Any]:
        return [conn for r, _rank, conn, _p in self.ranks if r == role]

    def call(self, conn: Any, *cmd: Any, timeout: float = 600.0) -> Any:
        try:
            conn.send(cmd)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            raise RuntimeError(self._died(conn)) from None
        return self.result(conn, timeout)

    def result(self, conn: Any, timeout: float = 600.0) -> Any:
        try:
            if not conn.poll(timeout):
                raise TimeoutError(f"a rank did not answer within {timeout}s")
            status, value = conn.recv()
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            raise RuntimeError(self._died(conn)) from None
        if status != "ok":
            raise RuntimeError(value)
        return value

    def _died(self, conn: Any) -> str:
        """One line on a rank process that went away."""
        for role, rank, c, proc in self.ranks:
            if c is conn:
                proc.join(timeout=5)
                code = proc.exitcode
                why = ("killed by SIGKILL: most likely the kernel's out-of-memory killer; try smaller --sizes-mib"
                       if code == -9 else f"exit code {code}")
                return f"the {role} rank {rank} process died ({why})"
        return "a rank process died"

    def close(self) -> None:
        for _role, _rank, conn, proc in self.ranks:
            try:
                self.call(conn, "exit", timeout=30)
            except Exception:  # noqa: BLE001 - the process is terminated below either way
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


def run_case(group: _Group, case: Case, shape: Shape, raw_gbps: float) -> Row:
    prefills, decodes = group.by_role("prefill"), group.by_role("decode")
    address = group.call(prefills[0], "start", case, None)
    for conn in prefills[1:]:
        group.call(conn, "start", case, address)
    for conn in decodes:
        group.call(conn, "start", case, None)
    for conn in prefills + decodes:
        conn.send(("rooms", case, address))
    p_results = [group.result(conn) for conn in prefills]
    d_results = [group.result(conn) for conn in decodes]
    for conn in prefills + decodes:
        group.call(conn, "stop")
    span = max(r["end"] for r in d_results) - min(r["start"] for r in d_results)
    return _row(case, shape, raw_gbps, case.room_bytes(shape) * case.rooms / span / 1e9, p_results, d_results)


def run_interleaved(group: _Group, cases: list[Case], shape: Shape, raw_gbps: float,
                    segment: int) -> tuple[list[Row], list[float]]:
    """One interleaved run of the two cache kinds of ``cases`` (module docstring): a row per
    kind, its GB/s over its own segments, and for every pair of adjacent segments the second
    kind's GB/s over the first kind's."""
    prefills, decodes = group.by_role("prefill"), group.by_role("decode")
    addresses = []
    for k, case in enumerate(cases):
        address = group.call(prefills[0], "as", k, "start", case, None)
        for conn in prefills[1:]:
            group.call(conn, "as", k, "start", case, address)
        for conn in decodes:
            group.call(conn, "as", k, "start", case, None)
        addresses.append(address)
    for conn in prefills + decodes:
        conn.send(("alternate", cases, addresses, segment))
    p_results = [group.result(conn) for conn in prefills]
    d_results = [group.result(conn) for conn in decodes]
    for k in range(len(cases)):
        for conn in prefills + decodes:
            group.call(conn, "as", k, "stop")
    rows, segment_gbps = [], []
    for k, case in enumerate(cases):
        spans = [max(r[k]["segments"][j][1] for r in d_results) - min(r[k]["segments"][j][0] for r in d_results)
                 for j in range(len(d_results[0][k]["segments"]))]  # a segment: from its first open on any decode rank
        moved = case.room_bytes(shape) * segment
        segment_gbps.append([moved / span / 1e9 for span in spans])
        rows.append(_row(case, shape, raw_gbps, moved * len(spans) / sum(spans) / 1e9,
                         [r[k] for r in p_results], [r[k] for r in d_results]))
    # pair j: segments 2j and 2j + 1, one of each kind (segment_kinds), each kind's j-th segment
    return rows, [hybrid / one for one, hybrid in zip(*segment_gbps)]


def _row(case: Case, shape: Shape, raw_gbps: float, gbps: float, p_results: list[dict[str, Any]],
         d_results: list[dict[str, Any]]) -> Row:
    """A run's row from what its prefill and decode ranks returned."""
    latencies = sorted(x for r in d_results for x in r["latencies"])
    first = max(r["first"] for r in d_results)
    warm = max(r["warm"] for r in d_results)
    descriptors = [sum(ds) for ds in zip(*(r["descriptors"] for r in p_results))]
    return Row(
        tp=f"{case.prefill_tp}->{case.decode_tp}", size_mib=case.room_bytes(shape) / MIB,
        pages=case.pages, path=case.path, in_flight=case.in_flight, rooms=case.rooms, gbps=gbps,
        raw_gbps=raw_gbps, ratio=gbps / raw_gbps if raw_gbps else 0.0,
        descriptors_per_room=statistics.mean(descriptors) if descriptors else 0.0,
        first_room_ms=first * 1e3, warm_room_ms=warm * 1e3, first_minus_warm_ms=(first - warm) * 1e3,
        room_p50_ms=latencies[len(latencies) // 2] * 1e3 if latencies else 0.0,
        room_p99_ms=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3 if latencies else 0.0,
        bad_bytes=sum(r["bad"] for r in d_results), paths=sorted({p for r in p_results for p in r["paths"]}),
        groups="hybrid" if case.hybrid else "one", prefill_cpu=max(r["cpu"] for r in p_results),
        decode_cpu=max(r["cpu"] for r in d_results), prefill_us_per_room=max(r["cpu_us_per_room"] for r in p_results))


def median_run(runs: list[Row]) -> Row:
    """The run of median GB/s (the lower middle of an even count), with every run's GB/s."""
    row = sorted(runs, key=lambda r: r.gbps)[(len(runs) - 1) // 2]
    row.gbps_runs = [r.gbps for r in runs]
    row.prefill_us_runs = [r.prefill_us_per_room for r in runs]
    return row


def ratio_interval(one: list[float], other: list[float], *, level: float = 0.9, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float] | None:
    """The ``level`` bootstrap interval of median(``other``) / median(``one``): each list drawn again
    with replacement; None with fewer than three runs of either."""
    if len(one) < 3 or len(other) < 3 or min(one) <= 0:
        return None
    return _bootstrap(lambda rng: statistics.median(rng.choices(other, k=len(other)))
                      / statistics.median(rng.choices(one, k=len(one))), level, draws, seed)


def pairs_interval(pairs: list[float], *, level: float = 0.9, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float] | None:
    """The ``level`` bootstrap interval of the median of ``pairs`` (an interleaved run's ratios of
    adjacent segments), drawn again with replacement; None with fewer than three."""
    if len(pairs) < 3:
        return None
    return _bootstrap(lambda rng: statistics.median(rng.choices(pairs, k=len(pairs))), level, draws, seed)


def _bootstrap(statistic: Any, level: float, draws: int, seed: int) -> tuple[float, float]:
    """The central ``level`` of ``draws`` values of ``statistic(rng)`` (seeded: the same runs give
    the same interval)."""
    rng = random.Random(seed)
    values = sorted(statistic(rng) for _ in range(draws))
    tail = int(draws * (1 - level) / 2)
    return values[tail], values[draws - 1 - tail]


def raw_reference(group: _Group, size: int, in_flight: int, rounds: int) -> float:
    """GB/s of ``in_flight`` concurrent one-descriptor WRITEs of ``size`` bytes, prefill 0 -> decode 0."""
    prefill, decode = group.by_role("prefill")[0], group.by_role("decode")[0]
    group.call(prefill, "raw_open", size * in_flight)
    meta, address, dev = group.call(decode, "raw_open", size * in_flight)
    decode.send(("raw_serve", group.call(prefill, "raw_tags", meta, in_flight * (rounds + 1))))
    seconds = group.call(prefill, "raw_write", meta, address, dev, size, in_flight, rounds)
    group.result(decode)
    for conn in (prefill, decode):
        group.call(conn, "raw_close")
    return size * in_flight / seconds / 1e9


def descriptor_cost(group: _Group, size: int, pieces: int) -> float:
    """Seconds per descriptor: one write of ``size`` as ``pieces`` descriptors against one."""
    prefill, decode = group.by_role("prefill")[0], group.by_role("decode")[0]
    group.call(prefill, "raw_open", size)
    meta, address, dev = group.call(decode, "raw_open", size)
    decode.send(("raw_serve", group.call(prefill, "raw_tags", meta, 2 * 4)))
    one = group.call(prefill, "raw_write", meta, address, dev, size, 1, 3, 1)
    many = group.call(prefill, "raw_write", meta, address, dev, size, 1, 3, pieces)
    group.result(decode)
    for conn in (prefill, decode):
        group.call(conn, "raw_close")
    return max(0.0, (many - one) / pieces)


HEADER = (f"{'tp':>5} {'MiB':>7} {'pages':>10} {'path':>7} {'cache':>6} {'took':>20} {'in fl':>5} {'GB/s':>7} "
          f"{'raw':>7} {'ratio':>6} {'vs one':>6} {'desc/room':>9} {'first ms':>9} {'warm ms':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'cpu p/d %':>9} {'p us/room':>9} {'bytes':>6}")


def _print(row: Row) -> None:
    took = "+".join(p.replace("staged-", "s-") for p in row.paths) or "-"
    vs = f"{row.vs_one:.2f}" if row.vs_one else "-"
    print(f"{row.tp:>5} {row.size_mib:>7.1f} {row.pages:>10} {row.path:>7} {row.groups:>6} {took:>20} "
          f"{row.in_flight:>5} {row.gbps:>7.1f} {row.raw_gbps:>7.1f} {row.ratio:>6.2f} {vs:>6} {row.descriptors_per_room:>9.0f} "
          f"{row.first_room_ms:>9.1f} {row.warm_room_ms:>8.2f} {row.room_p50_ms:>7.2f} {row.room_p99_ms:>7.2f} "
          f"{f'{row.prefill_cpu * 100:.0f}/{row.decode_cpu * 100:.0f}':>9} {row.prefill_us_per_room:>9.0f} "
          f"{'OK' if row.bad_bytes == 0 else row.bad_bytes:>6}"
          + ("  runs " + " ".join(f"{g:.1f}" for g in row.gbps_runs) if len(row.gbps_runs) > 1 else "")
          + ("  vs one 90 % {:.2f}-{:.2f}".format(*row.vs_one_interval) if row.vs_one_interval else "")
          + (f" (median of {len(row.vs_one_pairs)} adjacent segment pairs)" if row.vs_one_pairs else ""), flush=True)


def memory_needed(case: Case, shape: Shape, devices: tuple[str, str]) -> dict[str, int]:
    """Bytes a case allocates, per place (``cpu`` or a device): both sides' page pools, the raw
    reference's buffers, staging buffers, and (host memory) each rank process's own footprint."""
    src_pool, dst_pool = pools(case, shape)
    token = shape.token_bytes
    raw = case.tokens(shape) * token * case.in_flight
    cpu = devices[0] == "cpu"
    staging = (case.staging_mib << 20) if case.staging_mib else ((64 << 20) if cpu else (1 << 30))
    need: dict[str, int] = {}
    for device, pool, block, tp in ((devices[0], src_pool, shape.block, case.prefill_tp),
                                    (devices[1], dst_pool, shape.block_of("decode"), case.decode_tp)):
        need[device] = need.get(device, 0) + pool * block * token + raw + tp * staging
    if cpu:
        need["cpu"] += (case.prefill_tp + case.decode_tp) * (400 << 20)  # an interpreter with torch and NIXL
    return need


def memory_available(place: str) -> int:
    """Free bytes at ``place`` (``cpu``: MemAvailable; ``cuda:N``: the device's free memory)."""
    if place == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 1 << 62
    import torch

    return torch.cuda.mem_get_info(torch.device(place))[0]


def memory_short(need: dict[str, int]) -> str:
    """What of ``need`` (bytes per place) does not fit in 85 % of the free memory there, in words
    ("" where everything fits)."""
    free = {place: memory_available(place) for place in need}
    return ", ".join(f"{n / (1 << 30):.1f} GiB of {place} memory ({free[place] / (1 << 30):.1f} free)"
                     for place, n in need.items() if n > 0.85 * free[place])


def default_in_flight(size: int) -> int:
    return 32 if size <= 16 * MIB else (16 if size <= 256 * MIB else 4)


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="kvproto bench transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=None,
                    help="room sizes (default: 8 128 1024 on GPUs; 8 in host memory, see --pages)")
    ap.add_argument("--pages", nargs="+", default=None, choices=["contiguous", "random"],
                    help="page orders (default: both on GPUs; random in host memory, where a run of every "
                         "default case would take many minutes)")
    ap.add_argument("--tp", nargs="+", default=["1:1", "1:2", "2:1"], help="prefill TP:decode TP pairs")
    ap.add_argument("--paths", nargs="+", default=None, help="paths (default: auto direct staged on GPUs; auto in "
                                                             "host memory)",
                    choices=["auto", "direct", "staged", "sliced"])
    ap.add_argument("--in-flight", type=int, default=0, help="rooms in flight (0: 32 / 16 / 4 by size)")
    ap.add_argument("--rooms", type=int, default=0,
                    help="rooms per case (0: 3 x in flight, at least 8; rooms of 16 MiB or less on a GPU: 600, "
                         "enough for a stable host time per room)")
    add_options(ap, Shape)
    ap.add_argument("--device", default="auto", help="auto (two GPUs, one GPU, else CPU memory) or cpu")
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--raw-rounds", type=int, default=5)
    ap.add_argument("--staging-mib", type=int, default=0, help="staging buffer per rank (0: the default)")
    ap.add_argument("--groups", nargs="+", default=["one"], choices=["one", "hybrid"],
                    help="one: the cache as one group; hybrid: the same layers as three groups, a GDN hybrid's "
                         "(every case of both is printed with the hybrid's GB/s over the one-group's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every case, the cache kinds taking turns; the median run is printed")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROOMS",
                    help="with --groups one hybrid: run both kinds at once, in turns of ROOMS rooms, and give "
                         "'vs one' as the median over adjacent turns (module docstring); 0: kinds run by turns "
                         "of whole runs")
    ap.add_argument("--pool-rooms", type=int, default=0, metavar="N",
                    help="rooms whose destination pages a decode rank holds at once (0: as many as 48 GiB of "
                         "pages per GPU, 1 GiB in host memory, allow; a third of that interleaved). More rooms "
                         "than that: fewer rooms, or with --interleave each turn reuses the pages of the "
                         "kind's previous turn, checked as that turn ends")
    ap.add_argument("--gc-threshold", type=int, default=GC_THRESHOLD, metavar="N",
                    help=f"the rank processes' first collector threshold during a case's rooms (default "
                         f"{GC_THRESHOLD:,}; 700 is CPython's own, 0 none; module docstring)")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the rank processes where the OS puts them (default: each on physical cores of its "
                         "own where there are enough)")
    ap.add_argument("--tamper", action="store_true", help=argparse.SUPPRESS)  # tests: the byte check must fail
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    segment = args.interleave
    if segment and (args.groups != ["one", "hybrid"] or args.tamper):
        ap.error("--interleave compares the two cache kinds: give --groups one hybrid")
    shape = Shape(**options_of(Shape, args))
    gpus = torch.cuda.device_count() if args.device == "auto" else 0
    devices = ("cuda:0", "cuda:1") if gpus >= 2 else (("cuda:0", "cuda:0") if gpus == 1 else ("cpu", "cpu"))
    where = {2: "prefill ranks on cuda:0, decode ranks on cuda:1", 1: "every rank on cuda:0"}.get(
        min(gpus, 2), "every rank in host memory")
    name = torch.cuda.get_device_name(0) if gpus else "CPU"
    on_gpu = devices[1] != "cpu"
    # Host memory moves a few GB/s: there the defaults are the cases a 2-core machine runs in about
    # a minute (every TP pair, 8 MiB random pages, auto), not the GPUs' table of 54 cases.
    args.sizes_mib = args.sizes_mib or ([8, 128, 1024] if on_gpu else [8])
    args.pages = args.pages or (["contiguous", "random"] if on_gpu else ["random"])
    args.paths = args.paths or (["auto", "direct", "staged"] if on_gpu else ["auto"])
    print(f"kvproto bench transfer: {name} x {max(gpus, 1) if gpus else 0}; {where}; transport {args.transport}; "
          f"{shape.layers} layers x {shape.heads} KV heads x {shape.head_dim} bf16, {shape.block}-token pages, "
          f"NHD -> {shape.block_of('decode')}-token {shape.decode_layout} pages; raw = the same bytes as concurrent one-descriptor WRITEs "
          f"(a mapped cuda-ipc peer: one contiguous device copy into its mapping), same processes, same run; "
          f"bytes = every room checked; rank processes collect young objects every {args.gc_threshold:,} "
          f"allocations during rooms", flush=True)
    rows: list[Row] = []
    constants: dict[str, float] = {}
    failed = False
    for pair in args.tp:
        p_tp, d_tp = (int(x) for x in pair.split(":"))
        group = _Group(p_tp, d_tp, shape, devices, args.transport, pin=not args.no_pin)
        try:
            print(f"{p_tp}->{d_tp}: " + ("rank processes pinned to cores of their own: " + ", ".join(
                f"{role}-{rank} CPUs {','.join(map(str, sorted(cpus)))}"
                for (role, rank, _c, _p), cpus in zip(group.ranks, group.cpus))
                if group.cpus else "rank processes not pinned" + ("" if args.no_pin else " (too few physical cores)")),
                flush=True)
            if not constants:
                probe = min(int(s * MIB) for s in args.sizes_mib)
                page = shape.block * shape.heads * shape.head_dim * 2
                pieces = max(1, probe // page)
                constants["per_descriptor_s"] = descriptor_cost(group, pieces * page, pieces)
                constants["copy_bytes_per_s"] = group.call(group.by_role("prefill")[0], "copy_bandwidth",
                                                           max(probe, 64 * MIB))
                print(f"measured: per-descriptor cost {constants['per_descriptor_s'] * 1e6:.2f} us "
                      f"({pieces} descriptors of {page // 1024} KiB), device copy "
                      f"{constants['copy_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
                print(HEADER, flush=True)
            raws: dict[tuple[int, int], float] = {}
            for size_mib in args.sizes_mib:
                size = int(size_mib * MIB)
                in_flight = args.in_flight or default_in_flight(size)
                rooms = args.rooms or (600 if on_gpu and size <= 16 * MIB else max(8, 3 * in_flight))
                budget = (48 << 30) if devices[1] != "cpu" else (1 << 30)  # destination pages per decode rank
                if segment:
                    budget //= 3  # both kinds' caches at once, and room for the other processes' buffers
                held = args.pool_rooms or max(2, budget // max(1, size // d_tp) - 2)  # rooms a decode rank holds
                reuse = 0
                if segment and rooms > held >= segment:
                    reuse = segment  # more rooms than pages: each segment's rooms reuse the last's pages
                else:
                    rooms = min(rooms, held)
                key = (size, in_flight)
                for pages in args.pages:
                    for path in args.paths:
                        if path == "direct" and (p_tp != d_tp or shape.block_of("decode") != shape.block
                                                 or shape.decode_layout != "NHD"):
                            continue  # pages differ between the sides: no direct path
                        runs: dict[str, list[Row]] = {}
                        skipped: set[str] = set()
                        pairs: list[float] = []
                        if segment and rooms < 2 * segment:
                            print(f"{p_tp}->{d_tp} {size_mib:g} MiB {pages} {path}: skipped, --interleave {segment} "
                                  f"needs at least {2 * segment} rooms of each kind, the case has {rooms}", flush=True)
                            continue
                        if segment:
                            cases = [Case(p_tp, d_tp, size, pages, path, in_flight, rooms - rooms % segment,
                                          seed=len(rows) + 1 + 2 * turn + k, staging_mib=args.staging_mib,
                                          hybrid=kind == "hybrid", reuse=reuse, gc_threshold=args.gc_threshold)
                                     for turn in range(max(1, args.repeat)) for k, kind in enumerate(args.groups)]
                            need: dict[str, int] = {}
                            for case in cases[:2]:
                                for place, n in memory_needed(case, shape, devices).items():
                                    need[place] = need.get(place, 0) + n
                            short = memory_short(need)
                            if short:
                                print(f"{p_tp}->{d_tp} {size_mib:g} MiB {pages} {path}: skipped, the two kinds "
                                      f"interleaved need {short}", flush=True)
                                continue
                            if key not in raws:
                                raws[key] = raw_reference(group, cases[0].tokens(shape) * shape.token_bytes,
                                                          in_flight, args.raw_rounds)
                            for turn in range(0, len(cases), 2):
                                made, paired = run_interleaved(group, cases[turn:turn + 2], shape, raws[key], segment)
                                for kind, row in zip(args.groups, made):
                                    runs.setdefault(kind, []).append(row)
                                    failed |= row.bad_bytes != 0
                                pairs += paired
                        for turn in range(0 if segment else max(1, args.repeat)):
                            for kind in args.groups:
                                case = Case(p_tp, d_tp, size, pages, path, in_flight, rooms, seed=len(rows) + turn + 1,
                                            staging_mib=args.staging_mib, tamper=args.tamper, hybrid=kind == "hybrid",
                                            gc_threshold=args.gc_threshold)
                                if kind in skipped:
                                    continue
                                short = memory_short(memory_needed(case, shape, devices))
                                if short:
                                    skipped.add(kind)
                                    print(f"{p_tp}->{d_tp} {size_mib:g} MiB {pages} {path}: skipped, it needs {short}",
                                          flush=True)
                                    continue
                                if key not in raws:
                                    tokens_bytes = case.tokens(shape) * shape.token_bytes
                                    raws[key] = raw_reference(group, tokens_bytes, in_flight, args.raw_rounds)
                                row = run_case(group, case, shape, raws[key])
                                runs.setdefault(kind, []).append(row)
                                failed |= row.bad_bytes != 0
                        medians = {kind: median_run(done) for kind, done in runs.items()}
                        one = medians.get("one")
                        for kind, row in medians.items():
                            if kind == "hybrid" and pairs:
                                row.vs_one, row.vs_one_pairs = statistics.median(pairs), pairs
                                interval = pairs_interval(pairs)
                                row.vs_one_interval = list(interval) if interval else []
                            elif kind == "hybrid" and one is not None and one.gbps:
                                row.vs_one = row.gbps / one.gbps
                                interval = ratio_interval(one.gbps_runs, row.gbps_runs)
                                row.vs_one_interval = list(interval) if interval else []
                            row.bad_bytes = sum(r.bad_bytes for r in runs[kind])
                            rows.append(row)
                            _print(row)
        except (RuntimeError, TimeoutError) as exc:
            print(f"bench transfer failed: {exc}", file=sys.stderr, flush=True)
            failed = True
        finally:
            group.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "transfer", "device": name, "placement": where, "constants": constants,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if failed else 0
