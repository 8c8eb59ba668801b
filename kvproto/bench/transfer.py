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
flight); for each the parent starts fresh endpoints and readies every rank before any room
opens (each decode rank links to the prefill instance, ``DecodeEndpoint.connect``: bootstrap,
registration, the peer's memory mapped or loaded; every rank makes its one full collection,
``quiet_gc``), and the case reports:

* how long that link took (``link ms``: what a first room would pay without ``connect``), the
  first room's latency on the new link, alone, and a warm room's latency, alone;
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
import json
import multiprocessing as mp
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproto.bench.transfer_rank import (  # the schedule and the rank processes: what the parent drives
    GC_THRESHOLD,
    MIB,
    Case,
    Shape,
    _rank_main,
    pools,
    rank_cpus,
)
from kvproto.options import add_options, options_of

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
    link_ms: float
    """The decode ranks' ``connect`` to the prefill instance (the slowest rank's)."""
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
    prefill_threads: dict[str, float] = field(default_factory=dict)
    """The busiest prefill rank's ``prefill_us_per_room`` split by thread name (Linux; printed
    under the table): the event loop's (``MainThread``), the transport's, the driver's own."""
    writes_per_launch: float | None = None
    """Writes per kernel launch (kernel path) or per NIXL transfer (writes of one pass batched) on
    the busiest prefill rank; ``batched_by`` says which."""
    batched_by: str = ""
    prefill_us_runs: list[float] = field(default_factory=list)
    """With ``--repeat``: ``prefill_us_per_room`` of every run, in order (JSON only): a slow run
    whose prefill spent more CPU per room had a slower host; one that spent less waited."""


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
    for conn in prefills + decodes:  # every rank ready (decode ranks linked) before any room opens
        conn.send(("ready", case, address))
    for conn in prefills + decodes:
        group.result(conn)
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
        for conn in prefills + decodes:  # every rank ready (decode ranks linked) before any room opens
            conn.send(("as", k, "ready", case, address))
        for conn in prefills + decodes:
            group.result(conn)
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
    busiest = max(p_results, key=lambda r: r["cpu_us_per_room"])
    return Row(
        tp=f"{case.prefill_tp}->{case.decode_tp}", size_mib=case.room_bytes(shape) / MIB,
        pages=case.pages, path=case.path, in_flight=case.in_flight, rooms=case.rooms, gbps=gbps,
        raw_gbps=raw_gbps, ratio=gbps / raw_gbps if raw_gbps else 0.0,
        descriptors_per_room=statistics.mean(descriptors) if descriptors else 0.0,
        link_ms=max(r["link"] for r in d_results) * 1e3, first_room_ms=first * 1e3, warm_room_ms=warm * 1e3,
        first_minus_warm_ms=(first - warm) * 1e3,
        room_p50_ms=latencies[len(latencies) // 2] * 1e3 if latencies else 0.0,
        room_p99_ms=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3 if latencies else 0.0,
        bad_bytes=sum(r["bad"] for r in d_results), paths=sorted({p for r in p_results for p in r["paths"]}),
        groups="hybrid" if case.hybrid else "one", prefill_cpu=max(r["cpu"] for r in p_results),
        decode_cpu=max(r["cpu"] for r in d_results), prefill_us_per_room=max(r["cpu_us_per_room"] for r in p_results),
        prefill_threads=busiest.get("threads_us_per_room", {}), writes_per_launch=busiest.get("writes_per_launch"),
        batched_by=busiest.get("batched_by", ""))


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
          f"{'raw':>7} {'ratio':>6} {'vs one':>6} {'desc/room':>9} {'link ms':>8} {'first ms':>9} {'warm ms':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'cpu p/d %':>9} {'p us/room':>9} {'bytes':>6}")


def _print(row: Row) -> None:
    took = "+".join(p.replace("staged-", "s-") for p in row.paths) or "-"
    vs = f"{row.vs_one:.2f}" if row.vs_one else "-"
    print(f"{row.tp:>5} {row.size_mib:>7.1f} {row.pages:>10} {row.path:>7} {row.groups:>6} {took:>20} "
          f"{row.in_flight:>5} {row.gbps:>7.1f} {row.raw_gbps:>7.1f} {row.ratio:>6.2f} {vs:>6} {row.descriptors_per_room:>9.0f} "
          f"{row.link_ms:>8.1f} {row.first_room_ms:>9.1f} {row.warm_room_ms:>8.2f} {row.room_p50_ms:>7.2f} "
          f"{row.room_p99_ms:>7.2f} "
          f"{f'{row.prefill_cpu * 100:.0f}/{row.decode_cpu * 100:.0f}':>9} {row.prefill_us_per_room:>9.0f} "
          f"{'OK' if row.bad_bytes == 0 else row.bad_bytes:>6}"
          + ("  runs " + " ".join(f"{g:.1f}" for g in row.gbps_runs) if len(row.gbps_runs) > 1 else "")
          + ("  vs one 90 % {:.2f}-{:.2f}".format(*row.vs_one_interval) if row.vs_one_interval else "")
          + (f" (median of {len(row.vs_one_pairs)} adjacent segment pairs)" if row.vs_one_pairs else ""), flush=True)
    if row.prefill_threads:
        split = sorted(row.prefill_threads.items(), key=lambda kv: -kv[1])
        print(f"{'':>5} p us/room by thread: " + ", ".join(f"{name} {us:.0f}" for name, us in split[:6])
              + (f"; writes per {row.batched_by} {row.writes_per_launch:.1f}" if row.writes_per_launch else ""),
              flush=True)


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
