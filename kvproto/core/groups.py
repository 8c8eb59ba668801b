"""Groups beyond the first, as the cores see them: sizes, layer maps and the checks both sides run.

Theory of operation
-------------------
A room moves the whole cache of a request. The first group (K/V planes or an MLA latent) is the
room's ``pages``, as it always was; every further group (``kvproto.geometry.groups``) rides along
in the same room, so that the room succeeds only once every group has landed and no group can be
left behind silently:

* a **paged** group is moved like the first: per chunk, per writer link, the tokens
  ``[max(chunk start, prefix, window start), min(chunk end, num_tokens))`` of that group's pages.
  A decode rank names only the pages holding the tokens it needs (``destination_pages``: the
  window's for a sliding-window group); the prefill names every page of the group, chunk by
  chunk, as it does for the first group. An engine frees a sliding window's pages once no later
  token attends to them and may give one back to the same request for a later chunk (vLLM does):
  a chunk of a windowed group may therefore name again a page whose tokens all lie before the
  chunk's first token minus ``window - 1``. Those tokens are never written (they precede every
  window the decode can need), so only pages holding tokens a later token may read must be
  distinct. On a link whose rooms stage, the paged groups without a
  window ride in the staged pieces instead (``kvproto.geometry.groups.staged_groups``: one block
  per group after the first group's);
* a paged group whose window is **named by the engine** (``NAMED_WINDOW``: SGLang's sliding-window
  and indexer pools) gets its pages with the last chunk only: the prefill's engine names the
  group's last pages (those it still holds), the decode names the pages it needs, from any
  ``first_page`` to the prompt's end, and the prefill writes those tokens, past the prefix, with
  the last chunk. A decode that needs a token before the first the prefill's engine named fails
  the room (``TOKEN_COUNT_MISMATCH``): the prefill no longer holds it;
* a **state** group is the request's slot (of the group's layers in a layer-wise chunk), moved
  with the last token range, like the aux slot.

*One write per chunk and link.* The sender joins a chunk's bytes of every group into one write
(``PostGroups``, one ``seq`` and one tag), so a hybrid room costs the writes, tags and
completions a one-group room does; on a staged link between peers of minor 3 the state slots
ride in the state block of the piece that ends the prompt (``SenderLink.stage_tail``,
``ReceiverLink.stage_tail``). The decode counts writes per writer,
never per group: ``TRANSFER_DONE`` says how many a writer posted, and a writer is any prefill
rank that writes some group into the decode rank (``kvproto.geometry.groups.link_roles``).

*Layers.* Layer-wise chunks name a span of the *model's* layers. Each group maps its own layers
to model layers (``GroupSpec.layers``, ascending); a span moves, in every group, the group's
layers whose model layer lies in the span (``local_span``), possibly none. A span that gives the
model's last layer completes its tokens for every group.

Checks live here so that the two cores apply the same rules: ``check_chunk_pages`` (the
application's pages of a chunk, per group) and ``check_destinations`` (a decode rank's group
destinations, on both sides: the decode's application, and the prefill against what the link
registered). *A page list is checked once.* Groups often name the same pages as the first group
(an indexer cache beside the latent it indexes, paged groups that share one page table): a list
equal to the first group's, whose pool is at least as large, holds no page that the first
group's check has not already passed (in range, none twice), so both checks take it on one
comparison (``same_pages``) instead of a pass over its pages for range and another for
duplicates.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from kvproto.core.base import duplicate_page, page_outside
from kvproto.wire import NAMED_WINDOW, NO_SLOT, ErrorCode, GroupDestination


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group beyond the first, with one side's sizes. ``pool``: pages (paged) or slots (state)."""

    name: str
    state: bool
    pool: int
    block_size: int = 0
    window: int | None = None
    layers: tuple[int, ...] = ()
    """The model layer of each of the group's layers (ascending)."""

    @property
    def named(self) -> bool:
        """Whether the engine names the group's window, room by room (``NAMED_WINDOW``)."""
        return self.window == NAMED_WINDOW

    def needed_pages(self, num_tokens: int, block_size: int | None = None, first_page: int = 0) -> range:
        """Page indices a decode rank names for ``num_tokens`` (``block_size``: the decode's;
        ``first_page``: the first a decode names of a window named by the engine)."""
        block = block_size or self.block_size
        if self.named:
            first = first_page
        else:
            first = 0 if self.window is None else max(0, num_tokens - self.window) // block
        return range(first, -(-num_tokens // block)) if num_tokens > 0 else range(0)

    def named_from(self, end_token: int, named: int) -> int:
        """A window the engine names: the page (of this side's blocks) where the ``named`` last
        pages of a prompt of ``end_token`` tokens begin."""
        return -(-end_token // self.block_size) - named

    def window_start(self, num_tokens: int) -> int:
        """The first token a decode rank needs of this group."""
        return 0 if self.window is None else max(0, num_tokens - self.window)


@dataclass(frozen=True, slots=True)
class LinkGroup:
    """One group beyond the first as a link registered it: the decode rank's sizes, and whether
    this prefill rank writes it there."""

    writes: bool
    pool: int
    block_size: int = 0
    staged: bool = False
    """A paged group that rides in the link's staged pieces (``staged_groups``): when a room's
    writes to the link stage, the pieces carry it."""


_SLOT_DESTINATIONS: dict[int, GroupDestination] = {}


def slot_destination(slot: int) -> GroupDestination:
    """A state group's destination, ``slot``: one shared (immutable) object per slot, as a decode
    rank names the same few slots room after room."""
    dest = _SLOT_DESTINATIONS.get(slot)
    if dest is None:
        if len(_SLOT_DESTINATIONS) >= 1 << 16:
            _SLOT_DESTINATIONS.clear()
        dest = _SLOT_DESTINATIONS[slot] = GroupDestination(first_page=0, pages=(), slot=slot)
    return dest


def pages_from_zero(dest: GroupDestination) -> tuple[int, ...]:
    """A paged group's destination pages indexed from the prompt's page 0, as plans take them: the
    pages before ``first_page`` (a window's) are 0, never read, since no write reaches them."""
    return (0,) * dest.first_page + dest.pages


def local_span(layers: Sequence[int], span: tuple[int, int] | None) -> tuple[int, int] | None:
    """The group's own layers ``(first, end)`` whose model layer lies in ``span``; ``span`` None
    (every layer) gives None; a span holding none of the group's layers gives ``(k, k)``."""
    if span is None:
        return None
    return bisect_left(layers, span[0]), bisect_left(layers, span[1])


def same_pages(pages: Sequence[int], pool: int, checked: Sequence[int], checked_pool: int) -> bool:
    """Whether ``pages`` (of a pool of ``pool`` pages) are the list ``checked``, which already
    passed the checks in a pool of ``checked_pool``: then they pass them too (module docstring).
    Lists of other types (or of two types) are not compared: they take the checks."""
    kind = pages.__class__
    return pool >= checked_pool and (kind is list or kind is tuple) and checked.__class__ is kind and (
        pages is checked or pages == checked)


def check_chunk_pages(groups: Sequence[GroupSpec], held: Sequence[Sequence[int]], new: Sequence[Sequence[int]],
                      end_token: int, last: bool,
                      checked: tuple[Sequence[int], Sequence[int], int] = ((), (), 0)
                      ) -> tuple[ErrorCode | None, str] | None:
    """``(code, reason)`` if a chunk's new pages of the paged groups do not fit (count, pool,
    duplicates, alignment); None if they do. ``held``: the room's pages so far, per group;
    ``checked``: the first group's (held, new, pool), already checked."""
    first_held, first_new, first_pool = checked
    for g, spec in enumerate(groups):
        pages = new[g] if g < len(new) else ()
        if spec.state:
            if pages:
                return None, f"group {spec.name!r} is a state group: it takes a slot, not pages"
            continue
        if spec.window == NAMED_WINDOW:  # its last pages, with the last chunk
            if not last:
                if pages:
                    return None, (f"group {spec.name!r}'s window is named by the engine: its pages come with the "
                                  f"last chunk")
                continue
            need = -(-end_token // spec.block_size)
            if len(held[g]) + len(pages) > need:
                return None, (f"{end_token} tokens fill {need} pages of group {spec.name!r}, the last chunk names "
                              f"{len(held[g]) + len(pages)}")
            bad = page_outside(pages, spec.pool)
            if bad is not None:
                return ErrorCode.INDEX_OUT_OF_RANGE, f"page {bad} of group {spec.name!r} outside [0, {spec.pool})"
            twice = duplicate_page(pages)
            if twice is not None:
                return ErrorCode.INDEX_OUT_OF_RANGE, (
                    f"page {twice} of group {spec.name!r} is listed twice: two token ranges would share it")
            continue
        if not last and end_token % spec.block_size:
            return None, (f"a non-last chunk must end on a page boundary of every paged group: group {spec.name!r} "
                          f"has blocks of {spec.block_size}, the chunk ends at {end_token}")
        need = -(-end_token // spec.block_size)
        if len(held[g]) + len(pages) != need:
            return None, (f"{end_token} tokens need {need} pages of group {spec.name!r}, "
                          f"the room has {len(held[g]) + len(pages)}")
        if (pages is first_new and spec.pool >= first_pool or same_pages(pages, spec.pool, first_new, first_pool)) \
                and (held[g] is first_held or held[g] == first_held):
            continue  # the first group's pages, checked: none outside this pool, none twice
        bad = page_outside(pages, spec.pool)
        if bad is not None:
            return ErrorCode.INDEX_OUT_OF_RANGE, f"page {bad} of group {spec.name!r} outside [0, {spec.pool})"
        live = held[g]
        if spec.window is not None and live:  # a window's pages that no later token reads may come again
            live = live[max(0, (len(live) * spec.block_size - spec.window + 1) // spec.block_size):]
        twice = duplicate_page([*live, *pages] if live else pages)
        if twice is not None:
            return ErrorCode.INDEX_OUT_OF_RANGE, (
                f"page {twice} of group {spec.name!r} is listed twice: two token ranges would share it")
    return None


def check_destinations(groups: Sequence[GroupSpec], sizes: Sequence[GroupSpec | LinkGroup],
                       dests: Sequence[GroupDestination], num_tokens: int, prefix_tokens: int,
                       checked: tuple[tuple[int, ...], int] = ((), 0)) -> tuple[ErrorCode, str] | None:
    """``(code, reason)`` unless ``dests`` names, for every group beyond the first and in order,
    exactly what the decode rank needs: ``sizes[g]`` holds the decode rank's ``pool`` and
    ``block_size`` of group ``g`` (its own ``GroupSpec``, or the ``LinkGroup`` a link registered).
    ``checked``: the first group's destination pages (a tuple), already checked, and its pool.
    None when they fit. Runs once per room on each side: the common case is a few comparisons.
    A refusal gives the code of the first of TRANSFER_REQUEST's checks 11-14 that fails
    (messages.md), each check over every entry before the next (``_first_problem``)."""
    first_pages, first_pool = checked
    if len(dests) != len(groups):
        return ErrorCode.PEER_PROTOCOL_ERROR, (
            f"the room names {len(dests)} destinations for the {len(groups)} groups beyond the first "
            f"({', '.join(repr(s.name) for s in groups) or 'none'})")
    if len(sizes) != len(groups):  # a caller's error, never a peer's: the link registered every group
        raise ValueError(f"{len(sizes)} sizes for {len(groups)} groups")
    for spec, size, dest in zip(groups, sizes, dests):  # (lengths checked: zip's strict=True costs a keyword call)
        if spec.state:
            if dest.pages or dest.first_page or not 0 <= dest.slot < size.pool:
                return _first_problem(groups, sizes, dests, num_tokens, prefix_tokens)
            continue
        block, pages, window = size.block_size, dest.pages, spec.window
        if window == NAMED_WINDOW:
            first = dest.first_page  # the decode's to choose: its page count must reach the prompt's end
        else:
            first = 0 if window is None or num_tokens <= window else (num_tokens - window) // block
        # one test for the common case (every page fits): the reasons are worked out only on a refusal
        if dest.slot != NO_SLOT or dest.first_page != first or len(pages) != -(-num_tokens // block) - first \
                or prefix_tokens % block or not (pages is first_pages and size.pool >= first_pool
                                                 or same_pages(pages, size.pool, first_pages, first_pool)) and (
                    page_outside(pages, size.pool) is not None or len(set(pages)) != len(pages)):
            return _first_problem(groups, sizes, dests, num_tokens, prefix_tokens)
    return None


def _window_words(spec: GroupSpec) -> str:
    return "" if spec.window is None else ", window named by the engine" if spec.named else f", window {spec.window}"


def _first_problem(groups: Sequence[GroupSpec], sizes: Sequence[GroupSpec | LinkGroup],
                   dests: Sequence[GroupDestination], num_tokens: int, prefix_tokens: int) -> tuple[ErrorCode, str]:
    """``check_destinations``' answer for destinations its quick test refused: TRANSFER_REQUEST's
    checks 11-14 in messages.md's order, each over every entry (in group order) before the next, so
    that the code does not depend on which entry is looked at first: 11 (a slot for a paged group,
    pages or a ``first_page`` for a state group), 12 (first the page range, then the prefix), 13
    (pages outside the pool or twice), 14 (a slot outside the pool)."""
    rows = list(zip(groups, sizes, dests))
    paged = [(spec, size, dest) for spec, size, dest in rows if not spec.state]
    for spec, _, dest in rows:
        if spec.state and (dest.pages or dest.first_page):
            return ErrorCode.PEER_PROTOCOL_ERROR, (
                f"state group {spec.name!r} takes a slot, not pages"
                f"{f' (first_page {dest.first_page})' if dest.first_page and not dest.pages else ''}")
        if not spec.state and dest.slot != NO_SLOT:
            return ErrorCode.PEER_PROTOCOL_ERROR, f"paged group {spec.name!r} takes pages, not a slot"
    for spec, size, dest in paged:
        need = spec.needed_pages(num_tokens, size.block_size, dest.first_page)
        if dest.first_page != need.start or len(dest.pages) != len(need):
            return ErrorCode.TOKEN_COUNT_MISMATCH, (
                f"{num_tokens} tokens need pages {need.start}..{need.stop - 1} of group {spec.name!r} (blocks of "
                f"{size.block_size}{_window_words(spec)}), the "
                f"room names {len(dest.pages)} from page {dest.first_page}")
    for spec, size, _ in paged:
        if prefix_tokens % size.block_size:
            return ErrorCode.INDEX_OUT_OF_RANGE, (
                f"prefix of {prefix_tokens} tokens is not a whole number of group {spec.name!r}'s blocks of "
                f"{size.block_size}")
    for spec, size, dest in paged:
        bad = page_outside(dest.pages, size.pool)
        if bad is not None:
            return ErrorCode.INDEX_OUT_OF_RANGE, (
                f"page {bad} of group {spec.name!r} outside the {size.pool} registered pages")
        twice = duplicate_page(dest.pages)
        if twice is not None:
            return ErrorCode.INDEX_OUT_OF_RANGE, (
                f"page {twice} of group {spec.name!r} is listed twice: two token ranges would share it")
    for spec, size, dest in rows:
        if spec.state and not 0 <= dest.slot < size.pool:
            return ErrorCode.INDEX_OUT_OF_RANGE, f"slot {dest.slot} of group {spec.name!r} outside [0, {size.pool})"
    # not reached: the quick test refuses only what one of the checks above refuses
    return ErrorCode.PEER_PROTOCOL_ERROR, "group destinations refused"
