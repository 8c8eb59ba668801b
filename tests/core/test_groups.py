"""The checks both cores run on a room's groups beyond the first (``kvproto.core.groups``): a
group that names the first group's pages is taken on one comparison, and only where that
comparison proves what the checks would; a refusal carries the code messages.md's order gives."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvproto.core.groups as groups
from kvproto.core import GroupSpec, ReceiverCore
from kvproto.wire import NO_SLOT, ErrorCode, GroupDestination, LocalProtocolError

PAGED = GroupSpec("lin", state=False, pool=64, block_size=16)
STATE = GroupSpec("state", state=True, pool=8)


def dest(pages: tuple[int, ...]) -> GroupDestination:
    return GroupDestination(first_page=0, pages=pages, slot=NO_SLOT)


def no_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any pass over a page list fail the test: what is taken on the comparison never gets one."""
    def passed(*_a: object) -> None:
        raise AssertionError("a page list that equals the checked one was checked again")
    monkeypatch.setattr(groups, "page_outside", passed)
    monkeypatch.setattr(groups, "duplicate_page", passed)


def test_same_pages_only_for_equal_lists_of_one_type_in_a_pool_as_large():
    """Equal lists of one type (list, tuple) in a pool at least as large; nothing else."""
    assert groups.same_pages((1, 2), 64, (1, 2), 64)
    assert groups.same_pages([1, 2], 65, [1, 2], 64)
    assert not groups.same_pages((1, 2), 63, (1, 2), 64)  # a smaller pool: the range check must run
    assert not groups.same_pages((1, 2), 64, (2, 1), 64)
    assert not groups.same_pages((1, 2), 64, [1, 2], 64)  # two types: never compared
    assert not groups.same_pages(np.array([1, 2]), 64, np.array([1, 2]), 64)  # arrays: never compared


def test_check_destinations_takes_the_first_groups_pages_on_one_comparison(monkeypatch):
    """A paged group naming the first group's pages (checked, in a pool no larger) passes
    without a pass over its pages for range or duplicates."""
    pages = (5, 9, 1)
    no_pass(monkeypatch)
    assert groups.check_destinations([PAGED], [PAGED], [dest(pages)], 40, 0, checked=(pages, 64)) is None


def test_the_first_groups_very_list_is_taken_by_identity_whatever_its_type(monkeypatch):
    """The first group's list object itself, given again for a group of a pool as large, passes
    both checks on identity alone, before any comparison: even an array, which ``same_pages``
    never compares. In a smaller pool the same object still takes the checks."""
    no_pass(monkeypatch)
    pages = np.array([5, 9, 1])
    assert groups.check_chunk_pages([PAGED], [[]], [pages], 40, True, checked=([], pages, 64)) is None
    assert groups.check_destinations([PAGED], [PAGED], [dest(pages)], 40, 0, checked=(pages, 64)) is None
    with pytest.raises(AssertionError, match="checked again"):
        groups.check_destinations([PAGED], [PAGED], [dest(pages)], 40, 0, checked=(pages, 65))


def test_check_destinations_checks_the_first_groups_pages_in_a_smaller_pool():
    """The first group's pages in a group of a smaller pool still meet its range check."""
    small = GroupSpec("lin", state=False, pool=8, block_size=16)
    pages = (5, 9, 1)
    code, reason = groups.check_destinations([small], [small], [dest(pages)], 40, 0, checked=(pages, 64))
    assert code is ErrorCode.INDEX_OUT_OF_RANGE and "page 9 of group 'lin'" in reason


@pytest.mark.parametrize("pages, what", [((5, 5, 1), "listed twice"), ((5, 70, 1), "page 70")])
def test_check_destinations_checks_pages_unlike_the_first_groups(pages, what):
    """A list that differs from the first group's gets every check: a duplicate or a page outside
    the pool is refused and named."""
    code, reason = groups.check_destinations([PAGED, STATE], [PAGED, STATE],
                                             [dest(pages), GroupDestination(first_page=0, pages=(), slot=3)],
                                             40, 0, checked=((5, 9, 1), 64))
    assert code is ErrorCode.INDEX_OUT_OF_RANGE and what in reason


def test_check_chunk_pages_takes_the_first_groups_pages_when_held_alike(monkeypatch):
    """A chunk's pages equal to the first group's, the room's earlier pages equal too: one comparison."""
    no_pass(monkeypatch)
    assert groups.check_chunk_pages([PAGED], [[3, 4]], [[7]], 40, True, checked=([3, 4], [7], 64)) is None


def test_check_chunk_pages_checks_when_the_held_pages_differ():
    """Equal new pages but different earlier ones: the duplicate across chunks is still found."""
    code, reason = groups.check_chunk_pages([PAGED], [[7, 4]], [[7]], 40, True, checked=([3, 4], [7], 64))
    assert code is ErrorCode.INDEX_OUT_OF_RANGE and "page 7 of group 'lin' is listed twice" in reason


WINDOWED = GroupSpec("swa", state=False, pool=64, block_size=16, window=32)


def test_check_chunk_pages_lets_a_window_name_again_a_page_no_later_token_reads():
    """A sliding window of 32 tokens, chunks of 48: the chunk from token 48 attends from token 17
    on, so the engine may give back page 0 (tokens 0-15) for it; page 1 (tokens 16-31) is still
    read and may not come again. Without a window, any repeat is refused."""
    held = [[5, 6, 7]]
    assert groups.check_chunk_pages([WINDOWED], held, [[5, 8, 9]], 96, False) is None
    code, reason = groups.check_chunk_pages([WINDOWED], held, [[6, 8, 9]], 96, False)
    assert code is ErrorCode.INDEX_OUT_OF_RANGE and "page 6 of group 'swa' is listed twice" in reason
    code, reason = groups.check_chunk_pages([PAGED], held, [[5, 8, 9]], 96, False)
    assert code is ErrorCode.INDEX_OUT_OF_RANGE and "page 5 of group 'lin' is listed twice" in reason


def test_receiver_refuses_the_first_groups_pages_outside_a_smaller_group_pool():
    """End to end on the decode's own check: a group given the first group's pages, which fit the
    first group's 64 pages but not the group's 8, is refused naming the group."""
    core = ReceiverCore(block_size=16, num_blocks=64, aux_slots=4, seed=1,
                        groups=[GroupSpec("lin", state=False, pool=8, block_size=16)])
    pages = [3, 40, 2]
    with pytest.raises(LocalProtocolError, match="page 40 of group 'lin'") as err:
        core.check_destination(pages, 40, group_pages=[pages], state_slots=[NO_SLOT])
    assert err.value.code is ErrorCode.INDEX_OUT_OF_RANGE
    ok = core.check_destination([3, 4, 2], 40, group_pages=[[3, 4, 2]], state_slots=[NO_SLOT])
    assert ok.groups[0].pages == (3, 4, 2) and ok.pages == (3, 4, 2)


WIDE = GroupSpec("wide", state=False, pool=64, block_size=32)


@pytest.mark.parametrize("case, code", [
    ("state-pages-after-a-wrong-first-page", ErrorCode.PEER_PROTOCOL_ERROR),
    ("state-pages-after-a-page-outside", ErrorCode.PEER_PROTOCOL_ERROR),
    ("state-first-page", ErrorCode.PEER_PROTOCOL_ERROR),
    ("wrong-count-after-a-page-outside", ErrorCode.TOKEN_COUNT_MISMATCH),
    ("wrong-count-after-a-prefix", ErrorCode.TOKEN_COUNT_MISMATCH),
    ("wrong-first-page-and-prefix", ErrorCode.TOKEN_COUNT_MISMATCH),
])
def test_check_destinations_answers_the_first_of_checks_11_to_14_over_every_entry(case, code):
    """A refusal carries the code of the first of TRANSFER_REQUEST's checks 11-14 (messages.md) that
    some entry fails, each check over every entry before the next and, within check 12, the page
    range before the prefix: never the code of whichever failing entry comes first."""
    specs = [WIDE, PAGED, STATE]  # 40 tokens: 2 pages of 32, 3 of 16, a slot
    good = {WIDE: dest((4, 5)), PAGED: dest((1, 2, 3)), STATE: GroupDestination(first_page=0, pages=(), slot=3)}
    bad = {
        "state-pages-after-a-wrong-first-page": {
            PAGED: GroupDestination(first_page=1, pages=(1, 2), slot=NO_SLOT),
            STATE: GroupDestination(first_page=0, pages=(7,), slot=3)},
        "state-pages-after-a-page-outside": {WIDE: dest((4, 99)),
                                             STATE: GroupDestination(first_page=0, pages=(7,), slot=3)},
        "state-first-page": {STATE: GroupDestination(first_page=1, pages=(), slot=3)},
        "wrong-count-after-a-page-outside": {WIDE: dest((4, 99)), PAGED: dest((1, 2))},
        "wrong-count-after-a-prefix": {PAGED: dest((1, 2))},
        "wrong-first-page-and-prefix": {WIDE: GroupDestination(first_page=1, pages=(4, 5), slot=NO_SLOT)},
    }[case]
    prefix = 16 if "prefix" in case else 0  # whole blocks of PAGED (16), half a block of WIDE (32)
    got = groups.check_destinations(specs, specs, [bad.get(spec, good[spec]) for spec in specs], 40, prefix)
    assert got is not None and got[0] is code, got
    assert groups.check_destinations(specs, specs, [good[spec] for spec in specs], 40, 0) is None


def spec_code(specs, dests, num_tokens, prefix):
    """TRANSFER_REQUEST checks 11-14 read literally from messages.md: each over every entry, in
    order, check 12's page range before its prefix; the code of the first that fails, or None."""
    paged = [(s, d) for s, d in zip(specs, dests) if not s.state]
    state = [(s, d) for s, d in zip(specs, dests) if s.state]
    if len(dests) != len(specs) or any(d.slot != NO_SLOT for _, d in paged) or any(
            d.pages or d.first_page != 0 for _, d in state):
        return ErrorCode.PEER_PROTOCOL_ERROR
    for s, d in paged:
        start = 0 if s.window is None else max(0, num_tokens - s.window) // s.block_size
        if d.first_page != start or len(d.pages) != max(0, math.ceil(num_tokens / s.block_size) - start):
            return ErrorCode.TOKEN_COUNT_MISMATCH
    if any(prefix % s.block_size for s, _ in paged) or any(
            any(p >= s.pool for p in d.pages) or len(set(d.pages)) != len(d.pages) for s, d in paged) or any(
            d.slot >= s.pool for s, d in state):
        return ErrorCode.INDEX_OUT_OF_RANGE
    return None


@st.composite
def destinations(draw):
    """Groups beyond the first (paged, some windowed, and state) and destinations for a room: each
    entry right, or wrong in one or more of the ways checks 11-14 look for."""
    specs = [GroupSpec(f"g{i}", state=True, pool=draw(st.integers(1, 4))) if draw(st.booleans()) else
             GroupSpec(f"g{i}", state=False, pool=draw(st.integers(2, 12)), block_size=draw(st.sampled_from([4, 8])),
                       window=draw(st.none() | st.integers(1, 20)))
             for i in range(draw(st.integers(1, 3)))]
    num_tokens = draw(st.integers(1, 40))
    prefix = draw(st.sampled_from([0, 4, 8]))
    dests = []
    for s in specs:
        if s.state:
            dests.append(GroupDestination(first_page=draw(st.sampled_from([0, 0, 1])),
                                          pages=draw(st.sampled_from([(), (), (0,)])), slot=draw(st.integers(0, s.pool))))
            continue
        need = s.needed_pages(num_tokens)
        count = len(need) + draw(st.sampled_from([0, 0, 0, 1, -1]))
        pages = draw(st.lists(st.integers(0, s.pool), min_size=max(0, count), max_size=max(0, count)))
        dests.append(GroupDestination(first_page=need.start + draw(st.sampled_from([0, 0, 0, 1])), pages=tuple(pages),
                                      slot=draw(st.sampled_from([NO_SLOT, NO_SLOT, NO_SLOT, 0]))))
    if draw(st.integers(0, 9)) == 0:
        dests = dests[:-1]
    return specs, dests, num_tokens, prefix


@given(destinations())
def test_check_destinations_refuses_as_messages_md_reads_with_its_code(case):
    """On any group destinations, check_destinations passes exactly those that messages.md's checks
    11-14 pass, and refuses the others with the code of the first check that fails."""
    specs, dests, num_tokens, prefix = case
    got = groups.check_destinations(specs, specs, dests, num_tokens, prefix)
    assert (got and got[0]) == spec_code(specs, dests, num_tokens, prefix), got
