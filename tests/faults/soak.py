"""The fault-script soak: perturbed scripts (``Script.generate(seed, perturb=True)``) until a count
or a time is reached, with progress and every failing script's reproducer printed.

    python -m tests.faults.soak --scripts 4000            # or --minutes 30; --first-seed N

Exit status 1 if any script broke an invariant. The same scripts run in CI, fewer of them, as
``test_fault_scripts_perturbed_keep_invariants``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from .scripts import SUMMARY
from .test_fault_scripts import report, run_many

BATCH = 24


async def soak(first: int, scripts: int | None, minutes: float | None) -> int:
    began = time.monotonic()
    ran = failed = 0
    seed = first
    while (scripts is None or ran < scripts) and (minutes is None or time.monotonic() - began < minutes * 60):
        n = BATCH if scripts is None else min(BATCH, scripts - ran)
        outcomes = await run_many(list(range(seed, seed + n)), perturb=True)
        seed += n
        ran += n
        bad = [o for o in outcomes if o.violations]
        failed += len(bad)
        if bad:
            print(report(bad), flush=True)
        print(f"[{time.monotonic() - began:7.1f}s] seeds {first}..{seed - 1}: {ran} perturbed scripts, "
              f"{failed} with violations; decode closes {SUMMARY['decode_closes']}, prefill closes "
              f"{SUMMARY['prefill_closes']}, loop stalls {SUMMARY['stalls']}", flush=True)
    print(f"soak: {ran} perturbed scripts (seeds {first}..{seed - 1}), {ran - failed} without a violation, "
          f"{failed} with; {SUMMARY['rooms']} rooms, decode {SUMMARY['ends_D_SUCCESS']} SUCCESS / "
          f"{SUMMARY['ends_D_FAILED']} FAILED; {time.monotonic() - began:.0f}s")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", type=int, default=None, help="stop after this many scripts")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--first-seed", type=int, default=1)
    args = parser.parse_args()
    if args.scripts is None and args.minutes is None:
        args.scripts = 1000
    sys.exit(asyncio.run(soak(args.first_seed, args.scripts, args.minutes)))


if __name__ == "__main__":
    main()
