"""Report how many frames and tags the wire fuzz properties decoded in this run."""

from __future__ import annotations

from typing import Any

from .fuzzing import COUNTS, FUZZ_EXAMPLES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if COUNTS:
        mode = f"KVPROTO_FUZZ_EXAMPLES={FUZZ_EXAMPLES}" if FUZZ_EXAMPLES else "default example counts"
        terminalreporter.write_line(
            f"kvproto wire fuzz ({mode}): {COUNTS['frames']} frames and {COUNTS['tags']} tags decoded"
        )
