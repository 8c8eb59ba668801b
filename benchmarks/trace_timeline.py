"""Where a room's time goes, hop by hop, from the ``KVPROTO_TRACE`` files of both sides.

Run any bench (or serving loop) with ``KVPROTO_TRACE=DIR``, then::

    python benchmarks/trace_timeline.py DIR

Every endpoint writes ``DIR/<role>-<pid>.trace`` (``kvproto.aio.trace``: one ``time.monotonic``
clock for the processes of a host). This merges the files, orders each room's events (prefixed
``p:`` for prefill, ``d:`` for decode), prints the most common orders, and for each pair of
consecutive events the median and 90th percentile of the time between them: with one room in
flight (``kvproto bench transfer --in-flight 1``) that is the anatomy of one room, from
``d:open`` through the request's hop (``d:sent_TransferRequest`` to ``p:recv_TransferRequest``),
the post, the write, to the decode's ``d:ended``. Events that are not a room's (slow-pass and
copy timings, marked ``*_us``) are left out.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics


def load(directory: str) -> dict[int, list[tuple[float, str]]]:
    rooms: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    for path in glob.glob(os.path.join(directory, "*.trace")):
        side = "p" if os.path.basename(path).startswith("prefill") else "d"
        with open(path) as f:
            for line in f:
                t, event, room, _seq = line.split()
                if event.endswith("_us"):
                    continue
                rooms[int(room)].append((float(t), f"{side}:{event}"))
    for events in rooms.values():
        events.sort()
    return rooms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the KVPROTO_TRACE directory")
    parser.add_argument("--orders", type=int, default=3, help="most common event orders to show")
    args = parser.parse_args()
    rooms = load(args.directory)
    if not rooms:
        raise SystemExit(f"no trace events in {args.directory!r}")
    orders = collections.Counter(tuple(name for _, name in events) for events in rooms.values())
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    spans = []
    for events in rooms.values():
        spans.append((events[-1][0] - events[0][0]) * 1e6)
        for (t0, a), (t1, b) in zip(events, events[1:]):
            gaps[(a, b)].append((t1 - t0) * 1e6)
    print(f"{len(rooms)} rooms; first to last event: p50 {statistics.median(spans):.0f} us")
    for order, n in orders.most_common(args.orders):
        print(f"{n:6d} x  " + " > ".join(order))
    print(f"{'from':>26} {'to':<26} {'rooms':>6} {'p50 us':>8} {'p90 us':>8}")
    for (a, b), values in sorted(gaps.items(), key=lambda kv: -len(kv[1])):
        values.sort()
        print(f"{a:>26} {b:<26} {len(values):6d} {statistics.median(values):8.1f} "
              f"{values[int(0.9 * (len(values) - 1))]:8.1f}")


if __name__ == "__main__":
    main()
