"""The room transition table: total, terminal states absorb, values equal SGLang's KVPoll, and
spec/v1 (states.md, errors.md, messages.md) lists exactly what the code does."""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

import pytest

import kvproto.wire.errors as errors_module
from kvproto.core.state import INPUTS, TABLE, Effect, Input, Role, RoomState, transition
from kvproto.wire import ErrorCode, MsgType

SPEC = Path(__file__).resolve().parents[2] / "spec" / "v1"
TERMINAL = (RoomState.SUCCESS, RoomState.FAILED)
LIVE = (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING)
FAILURE_INPUTS = (Input.PEER_ABORT, Input.PEER_GONE, Input.PEER_VIOLATION, Input.LOCAL_ABORT, Input.TIMEOUT,
                  Input.CLOSE)
DRAIN_INPUTS = (Input.DRAIN, Input.DRAIN_PROGRESS, Input.DRAINED)


def md_tables(path: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every pipe table of a markdown file: (the heading above it, header cells, body rows)."""
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    heading = ""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1]):
            header = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append((heading, header, rows))
            continue
        i += 1
    return tables


def _cells(line: str) -> list[str]:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


# --- the table in code ------------------------------------------------------------------------------


def test_state_table_room_state_values_equal_kvpoll() -> None:
    """RoomState values equal SGLang's KVPoll: FAILED 0 ... SUCCESS 4."""
    assert {s.name: s.value for s in RoomState} == {
        "FAILED": 0, "BOOTSTRAPPING": 1, "WAITING_FOR_INPUT": 2, "TRANSFERRING": 3, "SUCCESS": 4}


def test_state_table_terminal_property() -> None:
    """Exactly SUCCESS and FAILED are terminal."""
    assert {s for s in RoomState if s.terminal} == set(TERMINAL)


def test_state_table_is_total() -> None:
    """Every (role, state, input) of the role's inputs has exactly one row, and there are no others."""
    expected = {(role, state, inp) for role in Role for state in RoomState for inp in INPUTS[role]}
    assert set(TABLE) == expected


def test_state_table_role_inputs_partition() -> None:
    """The failure inputs belong to both roles; every other input to exactly one."""
    assert INPUTS[Role.SENDER] | INPUTS[Role.RECEIVER] == set(Input)
    assert INPUTS[Role.SENDER] & INPUTS[Role.RECEIVER] == set(FAILURE_INPUTS)


def test_state_table_terminal_states_absorb() -> None:
    """In SUCCESS and FAILED every input of the role is ABSORB and keeps the state."""
    for role in Role:
        for state in TERMINAL:
            for inp in INPUTS[role]:
                assert TABLE[(role, state, inp)] == (Effect.ABSORB, state)


def test_state_table_no_row_leaves_a_terminal_state() -> None:
    """No row starting in a terminal state names another next state."""
    assert all(nxt is state for (_, state, _), (_, nxt) in TABLE.items() if state.terminal)


def test_state_table_absorb_only_in_terminal_states() -> None:
    """ABSORB appears only in terminal states: a live room never silently drops an input."""
    assert all(state.terminal for (_, state, _), (effect, _) in TABLE.items() if effect is Effect.ABSORB)


def test_state_table_failure_inputs_fail_every_live_room() -> None:
    """Abort, peer gone, violation, local abort, timeout and close fail a live room, telling peers."""
    for role in Role:
        for state in LIVE:
            for inp in FAILURE_INPUTS:
                assert TABLE[(role, state, inp)] == (Effect.ABORT_PEERS, RoomState.FAILED)


def test_state_table_effect_rules() -> None:
    """LOCAL_ERROR keeps the state; INTERNAL_ERROR and ABORT_PEERS go to FAILED; SUCCESS only via
    SEND_DONE/COMPLETE; a live room enters FAILED only by ABORT_PEERS, INTERNAL_ERROR or DRAINED."""
    for (role, state, inp), (effect, nxt) in TABLE.items():
        if effect is Effect.LOCAL_ERROR:
            assert nxt is state
        if effect in (Effect.INTERNAL_ERROR, Effect.ABORT_PEERS):
            assert nxt is RoomState.FAILED
        if nxt is RoomState.SUCCESS and not state.terminal:
            assert effect is (Effect.SEND_DONE if role is Role.SENDER else Effect.COMPLETE)
        if nxt is RoomState.FAILED and not state.terminal:
            assert effect in (Effect.ABORT_PEERS, Effect.INTERNAL_ERROR) or (
                (role, state, inp, effect) == (Role.RECEIVER, RoomState.TRANSFERRING, Input.DRAINED, Effect.NONE))


def test_state_table_drain_rows() -> None:
    """The decode drain (minor 1): only a TRANSFERRING receiver drains. DRAIN sends ABORT and stays
    (ABORT_AND_DRAIN), DRAIN_PROGRESS records and stays, DRAINED enters FAILED; in the states the
    classifier never drains from they are INTERNAL_ERROR; ABORT_AND_DRAIN appears nowhere else."""
    R, T = Role.RECEIVER, RoomState.TRANSFERRING
    assert TABLE[(R, T, Input.DRAIN)] == (Effect.ABORT_AND_DRAIN, T)
    assert TABLE[(R, T, Input.DRAIN_PROGRESS)] == (Effect.RECORD, T)
    assert TABLE[(R, T, Input.DRAINED)] == (Effect.NONE, RoomState.FAILED)
    for state in (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT):
        for inp in DRAIN_INPUTS:
            assert TABLE[(R, state, inp)] == (Effect.INTERNAL_ERROR, RoomState.FAILED)
    assert not any(inp in INPUTS[Role.SENDER] for inp in DRAIN_INPUTS)
    assert [k for k, (e, _) in TABLE.items() if e is Effect.ABORT_AND_DRAIN] == [(R, T, Input.DRAIN)]


def test_state_table_drain_always_reaches_failed() -> None:
    """From a draining room (after DRAIN), DRAINED is always available and ends it FAILED: a drain
    can never leave the room live for good, and never turns it into SUCCESS."""
    _, state = TABLE[(Role.RECEIVER, RoomState.TRANSFERRING, Input.DRAIN)]
    assert TABLE[(Role.RECEIVER, state, Input.DRAINED)][1] is RoomState.FAILED
    assert TABLE[(Role.RECEIVER, state, Input.DRAIN_PROGRESS)][1] is state


def test_state_table_success_reachable_from_every_live_state() -> None:
    """From every live state some sequence of non-failure inputs reaches SUCCESS."""
    for role in Role:
        for start in LIVE:
            seen, todo = {start}, deque([start])
            while todo:
                state = todo.popleft()
                for inp in INPUTS[role]:
                    effect, nxt = TABLE[(role, state, inp)]
                    if effect not in (Effect.ABORT_PEERS, Effect.INTERNAL_ERROR) and nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            assert RoomState.SUCCESS in seen, (role, start)


def test_state_table_transition_reads_the_table() -> None:
    """transition() returns the table's row for every key."""
    for key, row in TABLE.items():
        assert transition(*key) == row


# --- spec/v1/states.md --------------------------------------------------------------------------------


def _spec_rows() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for _, header, body in md_tables(SPEC / "states.md"):
        if header == ["role", "state", "input", "effect", "next"]:
            rows += [tuple(r) for r in body]  # type: ignore[misc]
    return rows


def test_state_table_spec_rows_equal_table() -> None:
    """states.md's transition rows equal TABLE exactly, in both directions, without duplicates."""
    spec = _spec_rows()
    assert len(spec) == len(set(spec)), "states.md lists a row twice"
    keys = [r[:3] for r in spec]
    assert len(keys) == len(set(keys)), "states.md decides a (role, state, input) twice"
    code = {(k[0].name, k[1].name, k[2].name, v[0].name, v[1].name) for k, v in TABLE.items()}
    missing_in_spec = sorted(code - set(spec))
    missing_in_code = sorted(set(spec) - code)
    assert not missing_in_spec, f"rows in TABLE but not in states.md: {missing_in_spec}"
    assert not missing_in_code, f"rows in states.md but not in TABLE: {missing_in_code}"


def test_state_table_spec_state_values() -> None:
    """states.md's state table gives each RoomState's value and terminality."""
    (table,) = [t for t in md_tables(SPEC / "states.md") if t[1] == ["value", "state", "terminal"]]
    assert sorted((int(r[0]), r[1], r[2] == "yes") for r in table[2]) == sorted(
        (s.value, s.name, s.terminal) for s in RoomState)


def test_state_table_spec_lists_every_input_and_effect() -> None:
    """states.md describes every Input (with its role) and every Effect."""
    tables = md_tables(SPEC / "states.md")
    (inputs,) = [t for t in tables if t[1][:2] == ["input", "role"]]
    described = {r[0]: r[1] for r in inputs[2]}
    assert set(described) == {i.name for i in Input}
    for inp in Input:
        roles = {r for r in Role if inp in INPUTS[r]}
        assert described[inp.name] == ("both" if len(roles) == 2 else roles.pop().name), inp
    (effects,) = [t for t in tables if t[1][:1] == ["effect"]]
    assert {r[0] for r in effects[2]} == {e.name for e in Effect}


# --- spec/v1/errors.md ---------------------------------------------------------------------------------


def test_state_table_errors_md_equals_error_code() -> None:
    """errors.md's registry lists exactly ErrorCode: same codes, same names, same order."""
    (table,) = [t for t in md_tables(SPEC / "errors.md") if t[1] == ["code", "name", "meaning"]]
    rows = [(int(r[0]), r[1]) for r in table[2]]
    assert rows == [(c.value, c.name) for c in ErrorCode]
    assert all(r[2] for r in table[2]), "every code has a meaning"


def test_state_table_error_codes_are_dense_and_start_at_one() -> None:
    """Codes are 1..N with no gap and 0 unassigned (codes are appended, never removed)."""
    assert [c.value for c in ErrorCode] == list(range(1, len(ErrorCode) + 1))


def test_state_table_error_codes_documented_in_code() -> None:
    """Every ErrorCode member has a docstring in kvproto/wire/errors.py."""
    tree = ast.parse(Path(errors_module.__file__).read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ErrorCode"]
    documented = {
        stmt.targets[0].id
        for stmt, nxt in zip(cls.body, cls.body[1:])
        if isinstance(stmt, ast.Assign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }
    assert documented == {c.name for c in ErrorCode}


# --- spec/v1/messages.md ----------------------------------------------------------------------------------


def test_state_table_messages_md_lists_every_msg_type() -> None:
    """messages.md's message-type table lists exactly MsgType, number and name."""
    (table,) = [t for t in md_tables(SPEC / "messages.md") if t[1][:2] == ["type", "name"]]
    assert [(int(r[0]), r[1]) for r in table[2]] == [(t.value, t.name) for t in MsgType]


@pytest.mark.parametrize("msg_type", list(MsgType), ids=lambda t: t.name)
def test_state_table_messages_md_has_a_section_per_type(msg_type: MsgType) -> None:
    """messages.md has a '### <number> <NAME>' section for every message type."""
    text = (SPEC / "messages.md").read_text(encoding="utf-8")
    assert re.search(rf"^### {msg_type.value} {msg_type.name}$", text, flags=re.M)
