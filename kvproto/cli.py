"""The ``kvproto`` command: ``kvproto demo``, ``kvproto bench ...``."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvproto", description="KV-cache transfer for P/D disaggregation")
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol events")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvproto import demo

    demo_parser = sub.add_parser("demo", help="prefill and decode in separate processes, verified bytes")
    demo.add_arguments(demo_parser)

    bench_parser = sub.add_parser("bench", help="benchmarks (ratios against references measured in the same run)")
    bench_parser.add_argument("which", choices=["kernels", "layers", "paths", "rooms", "rss", "sync", "transfer"],
                              help="kernels: staging gather/scatter vs device copy; "
                                   "layers: layer-wise streaming vs sending a room after its last layer; "
                                   "paths: sliced vs staged room vs one raw transport write; "
                                   "rooms: control-plane cost and event-loop lag with 1-page rooms; "
                                   "rss: memory over 10,000 sequential rooms; "
                                   "sync: the synchronous facade's cost to a scheduler thread; "
                                   "transfer: rooms between two processes (GPUs) vs raw transport writes")
    bench_parser.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark (--help)")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    if args.command == "demo":
        return demo.main(args)
    if args.command == "bench" and args.which == "kernels":
        from kvproto.bench import kernels

        return kernels.main(args.rest)
    if args.command == "bench" and args.which == "paths":
        from kvproto.bench import paths

        return paths.main(args.rest)
    if args.command == "bench" and args.which in ("layers", "rooms", "sync", "transfer"):
        import importlib

        return importlib.import_module(f"kvproto.bench.{args.which}").main(args.rest)
    if args.command == "bench" and args.which == "rss":
        from kvproto.bench import rss

        return rss.main(args.rest)
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
