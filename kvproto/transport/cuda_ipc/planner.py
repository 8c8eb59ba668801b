"""The kernel path's planner: a write's launches checked and planned once per link and shape.

Theory of operation
-------------------
A link posts the same region bases, plans and state-slot rows with every write, so everything
that does not depend on a write's pages is done once and remembered by the identity of what the
link passes: the bases checked against both sides' registered memory, translated into this
process and uploaded (``_bases``, ``_joined_bases``), a rows launch's shape per token range
(``_rows_shape``), a state slot's rows checked and tiled once (``_slot_plan``), and which parts
of a hybrid write share a launch (``prepare_parts``). Each cache is bounded (cleared or trimmed
when full), and the adapter drops what belonged to a peer when it unmaps it.

``LaunchPlanner`` is a mixin of ``CudaIpcTransport``: its methods read the adapter's peers,
registrations and lane, and make the recipes of ``kvproto.transport.cuda_ipc.launches``.
``_inside`` is the one bounds check of rows against registered regions that both use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvproto.geometry import PairPlan
from kvproto.kernels import pattern as kernels
from kvproto.kernels.pattern import alignment as kernels_alignment
from kvproto.kernels.pattern import plan_rows
from kvproto.transport.base import MemKind, TransportError, as_descs, check_pairs
from kvproto.transport.cuda_ipc import launches
from kvproto.transport.cuda_ipc.launches import (
    PreparedParts,
    _Bases,
    _DescsRecipe,
    _Launch,
    _RowsRecipe,
    _RowsShape,
    _SlotPlan,
    _SlotRecipe,
)

if TYPE_CHECKING:
    from kvproto.kernels.lane import Lane
    from kvproto.transport.cuda_ipc.adapter import _Peer


class LaunchPlanner:
    """What ``CudaIpcTransport`` plans once per link and shape of write (module docstring)."""

    _peers: dict[str, Any]
    _bases_cache: dict[tuple[Any, ...], _Bases]
    _seen_bases: dict[tuple[int, int], tuple[Any, Any, _Bases, MemKind]]
    _joined: dict[tuple[Any, ...], tuple[tuple[Any, ...], _Bases]]
    _shapes: dict[tuple[Any, ...], _RowsShape]
    _slot_rows: dict[int, tuple[Any, ...]]
    _check_open: Callable[[], None]
    _mapped: Callable[[str, str], Any]
    _kernel_kind: Callable[[MemKind], bool]
    _kernel_kinds: Callable[[], str]
    _local_regions: Callable[[], np.ndarray]
    _check_local: Callable[[np.ndarray, MemKind, str], np.ndarray]
    _translate: Callable[..., np.ndarray]
    _device_ordinal: Callable[[], int]
    _own_lane: Callable[[Any], Lane]

    def prepare_parts(self, peer: str, parts: Sequence[Any]) -> PreparedParts:
        """The launches of a write of ``parts``, planned for any pages and slots
        (``PreparedParts``): which paged parts share a rows launch (``_joinable``: one page
        geometry, token range and memory kind per side), each launch's shape (``_rows_shape``),
        and a state slot's checked and uploaded tiles riding in the last rows launch (one launch
        less; other state groups get launches of their own). Only the parts' pages and slot
        numbers may differ when it is posted: their token ranges, layers, plans and bases are
        its own."""
        self._check_open()
        mapped = self._mapped(peer, "post_parts")
        if not parts:
            raise TransportError("post_parts: a write needs at least one part")
        slot_at = [i for i, p in enumerate(parts) if p.slots is not None]
        rest = [i for i, p in enumerate(parts) if p.slots is None]
        recipes: list[Any] = []
        runs: list[list[int]] = []
        k = 0
        while k < len(rest):
            first = parts[rest[k]]
            if first.plan is None:
                recipes.append(_DescsRecipe(self, mapped, rest[k], first.local_kind, first.remote_kind))
                k += 1
                continue
            j = k + 1  # the plans that follow with the same page geometry, token range and kinds join it
            while j < len(rest) and parts[rest[j]].plan is not None and _joinable(first.plan, parts[rest[j]].plan):
                j += 1
            runs.append(rest[k:j])
            k = j
        for n, run in enumerate(runs):
            fuse = launches._FUSE_SLOTS and n == len(runs) - 1 and slot_at and \
                parts[slot_at[0]].local_kind is parts[run[0]].plan[2]
            slot = slot_at.pop(0) if fuse else None
            recipes.append(self._rows_recipe(mapped, [parts[i].plan for i in run], run,
                                             None if slot is None else (slot, self._slot_plan(mapped, parts[slot]))))
        recipes += [_SlotRecipe(i, self._slot_plan(mapped, parts[i]), self._zero_bases(parts[i].local_kind))
                    for i in slot_at]
        devices = {r.device for r in recipes if r.device is not None}
        if len(devices) > 1:
            raise TransportError("post_parts: the parts are on different devices")
        return PreparedParts(self, peer, mapped, tuple(parts), tuple(recipes),
                             any(r.device is None for r in recipes) and len(recipes) > 1)

    # --- launches: checked and planned first (``_*_launch``, recipes), then run as one write (adapter._run) ---
    def _rows_recipe(self, mapped: _Peer, plans: Sequence[tuple[Any, ...]], which: Sequence[int],
                     slot: tuple[int, _SlotPlan] | None = None) -> _RowsRecipe:
        """One rows kernel for ``post_plan`` argument tuples of one page geometry and token range
        (``_joinable``; their pages are not read here): the groups of a hybrid cache whose pages
        look alike move in one launch, their regions side by side, each reading its own group's
        page lists. ``slot``: a state slot's part (its index and ``_slot_plan``), copied in the
        same launch. What does not depend on the pages is planned once per link and token range
        (``_rows_shape``: the regions' offsets into the lists, the slot's tiles, uploaded then)."""
        start, end = plans[0][7], plans[0][8]
        if not 0 <= start < end:
            raise TransportError(f"post_plan: bad token range [{start}, {end})")
        shape = self._rows_shape(mapped, plans, start, end)
        zero = None if slot is None else self._zero_bases(plans[0][2]).table
        recipe = _RowsRecipe(tuple(which), shape, start, end, slot, zero)
        if len(plans) > 1:  # the twin for writes whose plans all name the first plan's page lists
            one = self._rows_shape(mapped, plans, start, end, shared=True)
            recipe.shared = _RowsRecipe((which[0],), one, start, end, slot, zero), tuple(which[1:])
        return recipe

    def _rows_shape(self, mapped: _Peer, plans: Sequence[tuple[Any, ...]], start: int, end: int,
                    shared: bool = False) -> _RowsShape:
        """What a rows launch of these plans over tokens ``[start, end)`` is, whatever its pages:
        each plan's bases checked, the regions side by side, the rows plan, the table's layout.
        ``shared``: every plan reads the first plan's two page lists (groups that name the same
        pages), so the table holds two lists, their limits the tightest of the plans'.
        Remembered by the identity of the plans and base arrays (a link passes the same ones for
        every write), the token range and ``shared``."""
        key = (id(mapped), start, end, shared, tuple((id(p[0]), id(p[1]), id(p[3]), p[2], p[4]) for p in plans))
        hit = self._shapes.get(key)
        if hit is not None and hit.peer is mapped and all(
                a is p[0] and b is p[1] and c is p[3] for (a, b, c), p in zip(hit.refs, plans)):
            return hit
        sides: tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]] = ([], [])
        counts = []
        for plan, local_bases, local_kind, remote_bases, remote_kind, *_ in plans:
            bases = self._bases(mapped, local_bases, local_kind, remote_bases, remote_kind)
            for out, g, room in ((sides[0], plan.src, bases.src_room), (sides[1], plan.dst, bases.dst_room)):
                out.append((start // g.block_size, (end - 1) // g.block_size + 1, g.page_bytes, room))
            counts.append(bases.regions)
        if len(plans) > 1:
            bases = self._joined_bases(mapped, plans)
        if shared:  # one list per side, read by every plan: its pages must lie in every plan's memory
            sides = tuple([(*side[0][:3], side[0][2] * min(room // page for _, _, page, room in side))]
                          for side in sides)  # type: ignore[assignment]
            counts = [sum(counts)]
        n_src = sum(count for _, count, _, _ in sides[0])
        offsets = None
        if len(plans) > 1:  # each region's offsets into the source lists, then into the destination lists
            listed: list[int] = []
            for side in sides:
                at = 0
                for (_, count, _, _), regions in zip(side, counts):
                    listed += [at] * regions
                    at += count
            offsets = self._table(np.array(listed, dtype=np.int64), plans[0][2])
        shape = _RowsShape(mapped, tuple((p[0], p[1], p[3]) for p in plans), bases,
                           plan_rows(plans[0][0], start, end, regions=bases.regions, base_align=bases.align),
                           sides, offsets, n_src)
        if len(self._shapes) >= 256:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    def _joined_bases(self, mapped: _Peer, plans: Sequence[tuple[Any, ...]]) -> _Bases:
        """The region bases of several plans side by side, remembered by the identity of each
        plan's base arrays (a link passes the same arrays for every write)."""
        arrays = tuple(a for p in plans for a in (p[1], p[3]))
        key = (mapped.name, plans[0][2], tuple(map(id, arrays)))
        hit = self._joined.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], arrays)) and hit[1].peer is mapped:
            return hit[1]
        bases = self._bases(mapped, np.concatenate([np.asarray(p[1], dtype=np.int64) for p in plans]), plans[0][2],
                            np.concatenate([np.asarray(p[3], dtype=np.int64) for p in plans]), plans[0][4])
        if len(self._joined) >= 64:
            self._joined.clear()
        self._joined[key] = (arrays, bases)
        return bases

    def _slot_plan(self, mapped: _Peer, part: Any) -> _SlotPlan:
        """A part of slot rows (``kvproto.aio.paths.SlotRows``: a state group's slot in every
        region) as a ``_SlotPlan``: the rows of slot 0 checked against registered memory,
        translated, planned and uploaded once per link (remembered by the identity of the link's
        ``SlotRows``), with how many slots fit each side; a write then checks two integers."""
        rows = part.slots
        kind = part.local_kind
        if mapped.gone:
            raise TransportError(f"post_parts: {mapped.gone}")
        known = self._slot_rows.get(id(rows))
        if known is None or known[0] is not rows or known[1] is not mapped or known[2] is not kind \
                or part.remote_kind is not kind:
            if kind is not part.remote_kind or not self._kernel_kind(kind):
                raise TransportError(f"post_parts: kernels copy {self._kernel_kinds()} to the same kind, not "
                                     f"{kind.name} to {part.remote_kind.name}")
            src_slots, dst_slots, strided = self._check_slot_rows(mapped, rows, kind)
            known = (rows, mapped, kind, _SlotPlan(strided, self._table(strided.stepped(), kind), strided.plan.nbytes,
                                                   len(rows.length), src_slots, dst_slots))
            if len(self._slot_rows) >= 64:
                self._slot_rows.clear()
            self._slot_rows[id(rows)] = known
        return known[3]

    def _check_slot_rows(self, mapped: _Peer, rows: Any, kind: MemKind) -> tuple[Any, ...]:
        """(slots that fit locally, slots that fit remotely, and slot 0's rows into slot 0 as
        ``StridedRows`` of absolute addresses here: one plan serves every slot)."""
        fits = []
        for base, stride, regions, whose in ((rows.src, rows.src_stride, self._local_regions(), "this agent's"),
                                             (rows.dst, rows.dst_stride, mapped.regions, f"peer {mapped.name!r}'s")):
            first = np.stack([base, rows.length, np.zeros_like(base)], axis=1)
            j = _inside(first, regions, kind, "post_parts: state row", whose)
            room = regions[j, 0] + regions[j, 1] - (base + rows.length)  # bytes past each row's end
            fits.append(int((room // np.maximum(stride, 1)).min()) + 1)
            if base is rows.dst:
                here = mapped.local[j] + (base - regions[j, 0])
        strided = kernels.plan_strided_rows(rows.src, rows.src_stride, here, rows.dst_stride, rows.length)
        return fits[0], fits[1], strided

    def _zero_bases(self, kind: MemKind) -> _Bases:
        """One region pair of base 0: rows of absolute addresses as a pattern."""
        key = ("", kind, (0,), (0,))
        bases = self._bases_cache.get(key)
        if bases is None:
            zero = np.zeros(1, np.int64)
            bases = self._bases_cache[key] = _Bases(None, zero, zero, 0, 0, align=16,
                                                    table=self._table(np.zeros(2, np.int64), kind))
        return bases

    def _descs_launch(self, mapped: _Peer, local_rows: np.ndarray, local_kind: MemKind, remote_rows: np.ndarray,
                      remote_kind: MemKind, op: str) -> _Launch:
        src = self._check_local(as_descs(local_rows), local_kind, op)
        dst = as_descs(remote_rows)
        if local_kind is not remote_kind or not self._kernel_kind(local_kind):
            raise TransportError(f"{op}: kernels copy {self._kernel_kinds()} to the same kind, not "
                                 f"{local_kind.name} to {remote_kind.name}")
        here = self._translate(mapped, dst, remote_kind, op)
        return self._rows_launch(src, np.stack([here, dst[:, 1], dst[:, 2]], axis=1), local_kind)

    def _rows_launch(self, src: np.ndarray, dst_here: np.ndarray, kind: MemKind) -> _Launch:
        """Rows as a pattern of absolute addresses over one region of base 0."""
        nbytes = check_pairs(src, dst_here)
        pattern = np.stack([src[:, 0], dst_here[:, 0], src[:, 1]], axis=1)
        return self._pattern_launch(pattern, self._zero_bases(kind), nbytes, descriptors=len(src))

    @staticmethod
    def _pattern_launch(pattern: np.ndarray, bases: _Bases, nbytes: int, descriptors: int) -> _Launch:
        plan = kernels.plan_pattern(pattern, regions=bases.regions, base_align=bases.align)
        src_table, dst_table = bases.table[:bases.regions], bases.table[bases.regions:]
        return _Launch(bases, plan.tiles,
                       lambda tiles, stream=None: kernels.launch(plan, src_table, dst_table, tiles, stream=stream),
                       nbytes, descriptors)


    def _bases(self, mapped: _Peer, local_bases: Sequence[int], local_kind: MemKind, remote_bases: Sequence[int],
               remote_kind: MemKind) -> _Bases:
        """The checked, translated and uploaded form of a (local, remote) list of region bases.
        A link passes the same two arrays every time: they are recognised by identity first."""
        seen = self._seen_bases.get((id(local_bases), id(remote_bases)))
        if seen is not None and seen[0] is local_bases and seen[1] is remote_bases and seen[2].peer is mapped \
                and seen[3] is local_kind:
            return seen[2]
        key = (mapped.name, local_kind, tuple(np.asarray(local_bases).tolist()), tuple(np.asarray(remote_bases).tolist()))
        bases = self._bases_cache.get(key)
        if bases is not None and bases.peer is mapped:
            self._remember(local_bases, remote_bases, bases, local_kind)
            return bases
        if not (self._kernel_kind(local_kind) and local_kind is remote_kind):
            raise TransportError(f"post_pattern: kernels move {self._kernel_kinds()} memory, not "
                                 f"{local_kind.name} to {remote_kind.name}")
        if len(key[2]) != len(key[3]) or not key[2]:
            raise TransportError(f"post_pattern: {len(key[2])} local and {len(key[3])} remote regions")
        local = np.asarray(key[2], dtype=np.int64)
        remote = np.asarray(key[3], dtype=np.int64)
        ones = np.ones_like(local)
        regions = self._local_regions()
        i = _inside(np.stack([local, ones, 0 * ones], 1), regions, local_kind, "post_pattern: local base",
                    "this agent's")
        src_room = int((regions[i, 0] + regions[i, 1] - local).min())
        j = _inside(np.stack([remote, ones, 0 * ones], 1), mapped.regions, remote_kind, "post_pattern: remote base",
                    f"peer {mapped.name!r}'s")
        dst_room = int((mapped.regions[j, 0] + mapped.regions[j, 1] - remote).min())
        here = mapped.local[j] + (remote - mapped.regions[j, 0])
        bases = _Bases(mapped, local, here, src_room, dst_room, align=kernels_alignment(np.concatenate([local, here])),
                       table=self._table(np.concatenate([local, here]), local_kind))
        if len(self._bases_cache) >= 256:
            self._bases_cache.pop(next(iter(self._bases_cache)))
        self._bases_cache[key] = bases
        self._remember(local_bases, remote_bases, bases, local_kind)
        return bases

    def _remember(self, local_bases: Any, remote_bases: Any, bases: _Bases, kind: MemKind) -> None:
        if len(self._seen_bases) >= 64:
            self._seen_bases.clear()
        self._seen_bases[(id(local_bases), id(remote_bases))] = (local_bases, remote_bases, bases, kind)

    def _table(self, values: np.ndarray, kind: MemKind) -> Any:
        """``values`` as an int64 tensor where the kernel runs (uploaded once, on this agent's stream)."""
        import torch

        host = torch.from_numpy(values.copy())
        if kind is MemKind.DRAM:
            return host
        device = torch.device("cuda", self._device_ordinal())
        with torch.cuda.stream(self._own_lane(device).stream):
            return host.pin_memory().to(device, non_blocking=True)



def _joinable(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Two ``post_plan`` argument tuples one rows launch can carry: one page geometry (``rows_key``),
    one token range, one memory kind per side."""
    if (a[2], a[4], a[7], a[8]) != (b[2], b[4], b[7], b[8]):
        return False
    return a[0] is b[0] or _rows_key(a[0]) == _rows_key(b[0])


_ROWS_KEYS: dict[int, tuple[Any, Any]] = {}


def _rows_key(plan: PairPlan) -> Any:
    """``rows_key(plan)``, remembered by the plan's identity (a link keeps its plans)."""
    from kvproto.kernels.pattern import rows_key

    hit = _ROWS_KEYS.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    if len(_ROWS_KEYS) >= 1024:
        _ROWS_KEYS.clear()
    key = rows_key(plan)
    _ROWS_KEYS[id(plan)] = (plan, key)
    return key




def _inside(rows: np.ndarray, regions: np.ndarray, kind: MemKind, what: str, whose: str) -> np.ndarray:
    """For each row, the index of the region of ``regions`` ((N, 3): address, length, kind; sorted)
    that holds all of it; raises ``TransportError`` naming the first row that none holds."""
    if len(rows) == 0:
        return np.zeros(0, dtype=np.int64)
    i = np.searchsorted(regions[:, 0], rows[:, 0], side="right") - 1 if len(regions) else np.full(len(rows), -1)
    j = np.clip(i, 0, max(0, len(regions) - 1))
    ok = (i >= 0) & (len(regions) > 0)
    if len(regions):
        ok &= (rows[:, 0] + rows[:, 1] <= regions[j, 0] + regions[j, 1]) & (regions[j, 2] == int(kind))
    bad = np.flatnonzero(~ok)
    if bad.size:
        k = int(bad[0])
        raise TransportError(f"{what} {k} {rows[k].tolist()} is not inside {whose} registered {kind.name}")
    return j
