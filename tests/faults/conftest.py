"""Session summary of what the fault tests ran: scripts, rooms, faults injected per kind."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from . import scripts, test_core_machine

    if scripts.SUMMARY["scripts"]:
        s = scripts.SUMMARY
        tr = terminalreporter
        tr.section("fault scripts (asyncio endpoints, simulated transport)")
        tr.write_line(
            f"{s['scripts']} scripts ({s['topology_P1D1']} P1->D1, {s['topology_P2D1']} P2->D1; "
            f"paths auto {s['path_auto']}, sliced {s['path_sliced']}, staged {s['path_staged']}; "
            f"{s['scripts_quiet']} quiet, {s['scripts_control_faults']} with control faults, {s['scripts_groups']} "
            f"with hybrid caches), {s['rooms']} rooms")
        tr.write_line(
            f"ends: decode {s['ends_D_SUCCESS']} SUCCESS / {s['ends_D_FAILED']} FAILED, "
            f"prefill {s['ends_P_SUCCESS']} SUCCESS / {s['ends_P_FAILED']} FAILED (hybrid caches: decode "
            f"{s['ends_D_SUCCESS_groups']} SUCCESS / {s['ends_D_FAILED_groups']} FAILED); violations {s['violations']}")
        data = {k[5:]: v for k, v in sorted(s.items()) if k.startswith("data_")}
        control = {k[8:]: v for k, v in sorted(s.items()) if k.startswith("control_") and k != "control_faults"}
        tr.write_line(f"data-plane faults: {data}")
        tr.write_line(f"control-frame faults: {control}")
        other = ("aborts_D", "aborts_P", "aborts_before_open", "abort_in_bootstrap", "decode_closes",
                 "decode_closes_bootstrapping", "prefill_closes", "calls_after_close", "stalls", "lost_peers", "cut_links", "clock_jumps",
                 "exempt_forced", "exempt_dropped", "exempt_hazard", "late_landed_exempt")
        tr.write_line("events: " + ", ".join(f"{k} {s[k]}" for k in other))
    m = test_core_machine.STATS
    if m["machines"]:
        terminalreporter.section("core state machine (sender/receiver cores)")
        terminalreporter.write_line(", ".join(f"{k} {v}" for k, v in sorted(m.items())))
