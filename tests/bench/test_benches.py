"""The benchmarks run end to end at tiny sizes on CPU memory: every figure the notes quote is a
named field of their JSON output, and the byte check of ``bench transfer`` can fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

TINY = ["--device", "cpu", "--layers", "2", "--heads", "4", "--head-dim", "16", "--sizes-mib", "0.125",
        "--rooms", "3", "--in-flight", "2", "--raw-rounds", "2"]


def test_bench_transfer_tiny_on_cpu_checks_every_room(tmp_path: Path) -> None:
    """Same-TP and mixed-TP cases on every requested path move every byte, and each row carries
    the figures of the issue: GB/s, raw GB/s, ratio, descriptors, first and warm room, path."""
    from kvproto.bench import transfer

    out = tmp_path / "transfer.json"
    code = transfer.main([*TINY, "--tp", "1:1", "2:1", "--paths", "auto", "direct", "staged", "--pages",
                          "contiguous", "random", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["tp"], r["path"]) for r in rows} == {("1->1", "auto"), ("1->1", "direct"), ("1->1", "staged"),
                                                   ("2->1", "auto"), ("2->1", "staged")}
    assert len(rows) == 10 and all(r["bad_bytes"] == 0 for r in rows)
    for r in rows:
        assert r["gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0 and r["first_room_ms"] > 0
        assert r["paths"], r
    assert {p for r in rows if r["path"] == "staged" for p in r["paths"]} == {"staged-cpu"}
    assert {p for r in rows if r["path"] == "direct" for p in r["paths"]} == {"direct"}
    assert report["constants"]["per_descriptor_s"] >= 0 and report["constants"]["copy_bytes_per_s"] > 0


def test_bench_transfer_byte_check_catches_a_flipped_byte(tmp_path: Path) -> None:
    """One byte flipped in a decode page before the check makes the run fail and count it."""
    from kvproto.bench import transfer

    out = tmp_path / "transfer.json"
    code = transfer.main([*TINY, "--tp", "1:1", "--paths", "auto", "--pages", "random", "--tamper",
                          "--json", str(out)])
    assert code == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bad_bytes"] > 0


def test_bench_transfer_hybrid_case_checks_every_group_and_compares_with_one_group(tmp_path: Path) -> None:
    """--groups one hybrid: each case runs as one group and as a GDN-shaped hybrid of the same
    layers (every group's bytes and the state checked), the hybrid row carrying its GB/s over the
    one-group row's; TP 2 -> 1 splits the state's rows."""
    from kvproto.bench import transfer

    out = tmp_path / "transfer.json"
    code = transfer.main([*TINY, "--layers", "4", "--tp", "1:1", "2:1", "--paths", "auto", "--pages", "random",
                          "--groups", "one", "hybrid", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["groups"]) for r in rows] == [("1->1", "one"), ("1->1", "hybrid"), ("2->1", "one"),
                                                      ("2->1", "hybrid")]
    for one, hybrid in zip(rows[::2], rows[1::2]):
        assert one["bad_bytes"] == hybrid["bad_bytes"] == 0
        assert hybrid["vs_one"] == pytest.approx(hybrid["gbps"] / one["gbps"])
        assert "state" in hybrid["paths"] and hybrid["size_mib"] > one["size_mib"]


def test_bench_transfer_repeat_prints_the_median_run_of_each_cache_kind(tmp_path: Path) -> None:
    """--repeat 3: every case runs three times per cache kind, the kinds taking turns; each row is
    the median run, carries every run's GB/s, and ``vs one`` is the ratio of the two medians."""
    import statistics

    from kvproto.bench import transfer

    out = tmp_path / "transfer.json"
    code = transfer.main([*TINY, "--layers", "4", "--tp", "1:1", "--paths", "auto", "--pages", "random",
                          "--groups", "one", "hybrid", "--repeat", "3", "--json", str(out)])
    assert code == 0
    one, hybrid = json.loads(out.read_text())["rows"]
    assert (one["groups"], hybrid["groups"]) == ("one", "hybrid")
    for row in (one, hybrid):
        assert len(row["gbps_runs"]) == 3 and all(g > 0 for g in row["gbps_runs"])
        assert row["gbps"] == statistics.median(row["gbps_runs"]) and row["bad_bytes"] == 0
    assert hybrid["vs_one"] == pytest.approx(hybrid["gbps"] / one["gbps"])
    low, high = hybrid["vs_one_interval"]  # three runs of each: the ratio's bootstrap interval
    assert low <= hybrid["vs_one"] <= high and one["vs_one_interval"] == []


def _interleaved(tmp_path: Path, *args: str) -> tuple[dict, dict]:
    """An interleaved run (``--interleave 2``) of both cache kinds, four layers of TINY's shape,
    random pages, with ``args``; it must exit 0. Its one-group and hybrid rows."""
    from kvproto.bench import transfer

    out = tmp_path / "transfer.json"
    code = transfer.main([*TINY, "--layers", "4", "--paths", "auto", "--pages", "random", "--groups", "one",
                          "hybrid", "--interleave", "2", *args, "--json", str(out)])
    assert code == 0
    one, hybrid = json.loads(out.read_text())["rows"]
    return one, hybrid


def test_bench_transfer_interleave_alternates_the_kinds_in_segments_and_pairs_them(tmp_path: Path) -> None:
    """--interleave 2: both kinds' endpoints run in the same rank processes, their rooms in
    segments of two taking turns (0 1 1 0 ...); every room of both is checked, each row's GB/s
    is over its own segments, and ``vs one`` is the median of the adjacent pairs' ratios."""
    import statistics

    from kvproto.bench import transfer, transfer_rank

    assert transfer_rank.segment_kinds(8) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert transfer_rank.segment_rooms(4, 2) == [(0, range(2, 4)), (1, range(2, 4)), (1, range(4, 6)), (0, range(4, 6))]
    one, hybrid = _interleaved(tmp_path, "--rooms", "5", "--tp", "1:2", "--repeat", "2")
    assert (one["groups"], hybrid["groups"], one["rooms"], hybrid["rooms"]) == ("one", "hybrid", 4, 4)
    assert one["bad_bytes"] == hybrid["bad_bytes"] == 0 and "state" in hybrid["paths"]
    assert len(hybrid["vs_one_pairs"]) == 4 and all(p > 0 for p in hybrid["vs_one_pairs"])  # 2 pairs per run
    assert hybrid["vs_one"] == pytest.approx(statistics.median(hybrid["vs_one_pairs"]))
    low, high = hybrid["vs_one_interval"]
    assert low <= hybrid["vs_one"] <= high
    with pytest.raises(SystemExit):
        transfer.main([*TINY, "--groups", "one", "--interleave", "2"])


def test_bench_transfer_interleave_longer_than_the_pool_reuses_pages_and_checks_every_segment(
        tmp_path: Path) -> None:
    """With more rooms than a decode rank's pages hold (``--pool-rooms 4``), an interleaved run is
    not cut short: rooms 2, 3, ... cycle through the pages of one segment, each segment's rooms
    are checked as it ends (checking them at the end, after later segments wrote the same pages
    from other sources, would count mismatching bytes), and every pair of segments is compared."""
    from kvproto.bench import transfer_rank

    case = transfer_rank.Case(1, 1, 1 << 17, "random", "auto", 2, 8, reuse=2)
    shape = transfer_rank.Shape(2, 4, 16, 16)
    m = transfer_rank.pages_per_room(case, shape, "decode")
    assert transfer_rank.pools(case, shape)[1] == 4 * m  # rooms 0, 1 and one segment's two
    dst = [sorted(transfer_rank.room_pages(case, shape, i)[1]) for i in range(10)]
    assert dst[2] == dst[4] == dst[6] == dst[8] and dst[3] == dst[5] == dst[7] == dst[9]
    assert len({p for d in dst[:4] for p in d}) == 4 * m  # rooms 0-3: pages of their own
    one, hybrid = _interleaved(tmp_path, "--rooms", "8", "--pool-rooms", "4", "--tp", "1:1")
    assert (one["rooms"], hybrid["rooms"]) == (8, 8) and one["bad_bytes"] == hybrid["bad_bytes"] == 0
    assert len(hybrid["vs_one_pairs"]) == 4 and all(p > 0 for p in hybrid["vs_one_pairs"])


def test_rank_processes_freeze_the_gc_for_their_timed_rooms_and_thaw_it_when_they_stop() -> None:
    """A rank freezes what it holds before its timed rooms (no full collection stalls its loop
    mid-run) and raises the young collections' threshold; it unfreezes and puts the thresholds
    back when it stops, so that the next case's collection frees this case's caches."""
    import asyncio
    import gc

    from kvproto.bench import transfer_rank as transfer  # the rank process

    before = gc.get_threshold()
    rank = transfer._Rank("decode", 0, 1, transfer.Shape(layers=2), "cpu", "loopback")
    try:
        transfer.quiet_gc(50_000)
        assert gc.get_freeze_count() > 1000  # torch and the rest of this process
        assert gc.get_threshold() == (50_000, *before[1:])
        asyncio.run(rank.stop())
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_bench_rooms_tiny_reports_rates_latency_and_loop_lag(tmp_path: Path) -> None:
    """1-page rooms on loopback (one process) and NIXL (peer in another process): rooms/s,
    latency p50/p99 and the ticker's lag are reported for each window."""
    from kvproto.bench import rooms

    out = tmp_path / "rooms.json"
    assert rooms.main(["--rooms", "40", "--windows", "1", "8", "--blocks", "64", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["transport"], r["window"]) for r in results} == {("loopback", 1), ("loopback", 8), ("nixl", 1),
                                                               ("nixl", 8)}
    for r in results:
        assert r["rooms"] == 40 and r["rooms_per_s"] > 0 and 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
        assert r["lag_max_ms"] >= r["lag_p99_ms"] >= r["lag_p50_ms"] >= 0


def test_bench_layers_on_cpu_streams_the_tail_down_to_a_layer(tmp_path: Path) -> None:
    """The layer-wise bench over the simulated transport capped at 1 GB/s: every room's bytes
    are right; streamed, the tail (end of the last layer's compute to decode SUCCESS) stays within
    one layer's transfer and a few milliseconds of protocol latency, far below the whole room's; and
    streaming keeps the throughput of sending rooms at once. (Wide margins: this checks that the
    mechanism works on a loaded CI machine; ``kvproto bench layers`` prints the real figures.)"""
    from kvproto.bench import layers

    out = tmp_path / "layers.json"
    code = layers.main(["--device", "cpu", "--layers", "8", "--tokens", "1024", "--heads", "4", "--head-dim", "64",
                        "--compute-ms", "3", "--rooms", "4", "--json", str(out)])
    assert code == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    room, layer = rows["room"], rows["layer"]
    assert room["bad_bytes"] == 0 and layer["bad_bytes"] == 0
    assert room["tail_p50_ms"] >= 0.8 * room["room_transfer_ms"]
    assert layer["tail_p50_ms"] < layer["layer_transfer_ms"] + 5.0 < room["tail_p50_ms"]
    assert layer["throughput_gbps"] > 0.5 * room["throughput_gbps"]


def test_bench_layers_in_two_processes_checks_every_byte_of_a_batch(tmp_path: Path) -> None:
    """``bench layers --processes``: a prefill and a decode process over NIXL in host memory, a batch
    of rooms per forward; both modes move every byte right, the first batch is reported apart, and
    streamed, the tail after the last layer's compute is far below the whole rooms' (a 20 ms
    compute per layer hides each layer's transfer; wide margins for a loaded CI machine)."""
    from kvproto.bench import layers

    out = tmp_path / "pair.json"
    code = layers.main(["--device", "cpu", "--processes", "--layers", "8", "--tokens", "256", "--heads", "4",
                        "--head-dim", "64", "--batch", "4", "--batches", "3", "--json", str(out)])
    assert code == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    room, layer = rows["room"], rows["layer"]
    assert room["bad_bytes"] == 0 and layer["bad_bytes"] == 0
    assert room["first_tail_ms"] > 0 and layer["first_tail_ms"] > 0
    assert layer["tail_p50_ms"] < room["tail_p50_ms"]
    assert layer["throughput_gbps"] > 0 and room["throughput_gbps"] > 0


def test_bench_sync_engine_loop_reports_every_phase(tmp_path: Path) -> None:
    """``bench sync`` times the facade's calls (both sides', every kind: the prefill side aborts
    every 50th room) and runs the engine-shaped loop: no kvproto, the facade idle, rooms moving
    (every room ends SUCCESS, else the run fails), idle again; each phase has its step
    distribution and the process's CPU."""
    from kvproto.bench import sync

    out = tmp_path / "sync.json"
    assert sync.main(["--rooms", "60", "--window", "16", "--blocks", "64", "--engine-rooms", "80",
                      "--engine-steps", "5", "--engine-step-ms", "2", "--prefill-rooms", "120",
                      "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["rooms_per_s"] > 0 and r["engine_rooms_per_s"] > 0
    assert r["prefill_rooms_per_s"] > 0 and r["prefill_aborted"] == 2  # rooms 50 and 100: the decode saw both fail
    for name in ("sender", "init", "send", "abort", "poll", "get_finished"):
        assert 0 < r[f"prefill_{name}_p50_us"] <= r[f"prefill_{name}_p99_us"] <= r[f"prefill_{name}_max_us"]
    for name in ("bare", "idle", "moving", "idle_after"):
        assert r[f"engine_{name}_steps"] >= 5
        assert 0 < r[f"engine_{name}_p50_ms"] <= r[f"engine_{name}_p99_ms"] <= r[f"engine_{name}_max_ms"]
        assert r[f"engine_{name}_cpu_fraction"] > 0


def test_the_ratio_interval_holds_the_ratio_and_narrows_with_more_runs() -> None:
    """``ratio_interval``: the bootstrap interval of median(b) / median(a), seeded; runs that agree
    give a point, runs that spread give an interval that holds the ratio, narrower with more runs;
    fewer than three runs give none."""
    from kvproto.bench.transfer import ratio_interval

    assert ratio_interval([10.0] * 5, [8.0] * 5) == (pytest.approx(0.8), pytest.approx(0.8))
    assert ratio_interval([10.0, 11.0], [9.0, 9.5, 10.0]) is None
    one = [9.3, 14.8, 10.6, 11.7, 12.3, 14.8, 15.7]
    other = [15.8, 13.8, 16.7, 13.1, 15.3, 13.8, 13.9]
    low, high = ratio_interval(one, other)
    assert low < 13.9 / 12.3 < high and high - low > 0.1
    assert ratio_interval(one, other) == (low, high)  # seeded
    low3, high3 = ratio_interval(one * 3, other * 3)
    assert low <= low3 and high3 <= high and high3 - low3 < high - low


def test_thread_cpu_counts_a_millisecond_of_work_to_the_thread_that_did_it() -> None:
    """``thread_cpu`` (the transfer bench's per-thread column) resolves a few milliseconds of one
    thread's work, and only to that thread (the kernel's per-thread ``schedstat`` in nanoseconds,
    where ``stat``'s clock ticks are 10 ms)."""
    import os
    import threading
    import time

    from kvproto.bench.transfer_rank import cpu_by_thread, thread_cpu

    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("the kernel keeps no schedstat here")
    done = threading.Event()
    idle = threading.Thread(target=done.wait, name="idle-thread")
    idle.start()
    try:
        before = thread_cpu()
        end = time.thread_time() + 0.003
        while time.thread_time() < end:  # 3 ms of this thread's CPU
            pass
        spent = cpu_by_thread(before, thread_cpu())
    finally:
        done.set()
        idle.join()
    assert 0.002 <= spent[threading.current_thread().name] < 0.5
    assert spent.get("idle-thread", 0.0) < 0.002
