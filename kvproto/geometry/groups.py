"""A cache of several groups: paged KV groups and per-request state groups (hybrid models).

Theory of operation
-------------------
The models served in 2026 keep more than one kind of cache. Linear-attention and SSM hybrids
(Gated DeltaNet, Mamba) keep, for most layers, a fixed-size *state* per request; sparse attention
keeps an indexer cache paged beside the MLA latent; sliding-window layers keep a pool of their
own of which the decode needs only the last window of tokens. Here a rank's cache is a tuple of
*groups*, each named, and everything a request needs is moved group by group, from geometry
alone, so that both sides compute the same plan without talking:

* a **paged group** is a set of layers with a page pool of its own, described by a
  ``KVGeometry`` (heads, head size, dtype, block size, layout, MLA or fused K/V): its plans are
  ``plan_pair``'s. ``window`` (sliding-window layers) says the decode needs only the prompt's last
  ``window`` tokens of it (``window_tokens``). ``window=NAMED_WINDOW`` leaves the window to the
  engine, room by room (SGLang keeps no window size where a backend can read it, and names a
  sliding-window pool's pages, or an indexer's past the decode's prefix, only with a request's last
  chunk): the prefill's engine gives the group's last pages with the last chunk, the decode names
  the pages it needs from some page to the prompt's end, and the prefill writes those tokens with
  the last chunk, failing the room if its engine named fewer (``kvproto.core.groups``);
* a **state group** holds, for every layer, fixed-shape tensors per request *slot* (a GDN layer's
  conv state and temporal state, say). Each tensor is either *sharded* over TP along one
  dimension (heads, channels: SGLang's ``_send_mamba_state_slice``) or *replicated*. Its memory is
  one region per (layer, tensor): ``num_slots`` slots of the tensor's local bytes, each slot
  C-contiguous in the local shape, slot ``s`` at ``s × slot stride`` from the region's start.

A state tensor sharded along dimension ``k`` of global size ``G`` gives TP rank ``r`` of ``T``
the indices ``[r·G/T, (r+1)·G/T)`` (``G % T == 0`` is required). Every index a decode rank holds
is written by exactly one prefill rank: the one holding it; a replicated tensor is written whole
by prefill rank ``floor(d.tp_rank · prefill.tp_size / decode.tp_size)``: the prefill rank whose
shard holds the start of the decode rank's, which always pairs with it (below). ``plan_state``
turns the overlap
of the two shards into byte runs inside a slot: one run per index of the dimensions before ``k``
(a run per outer row), merged where consecutive runs abut on both sides.

*Sections.* Some sharded dimensions are several projections side by side, each split over TP on
its own: a Gated DeltaNet conv state's channels are ``[Q | K | V]`` (sizes key, key, value) and
rank ``r`` holds ``[Q_r | K_r | V_r]``; Mamba2's are ``[x | B | C]`` (vLLM and SGLang lay their
conv states out so). ``StateTensor.sections`` lists the global sizes; each section then shards as a
dimension of its own (``shards``: per section, the global indices a rank holds and where they
start in its local tensor), and ``plan_state`` makes its runs per outer index *and* per section.
Whether the sharded dimension is the conv state's outer one (channels-major, ``(conv_dim,
kernel - 1)``: a section is one byte range) or its inner one (``(kernel - 1, conv_dim)``: the
sections interleave row by row) is the same rule, since runs are made per index before ``k``.
A one-section tensor is today's tensor; sections are part of the model, so both sides must agree.

*Slot strides.* Some engines keep a layer's states of one block in one page (vLLM: conv state at
offset 0, temporal state after it, padded to the attention page size), so a tensor's slot ``s``
starts ``s × stride`` past its region's base with a stride larger than its bytes, and the regions
of a layer's tensors interleave in address range (never in the bytes a slot uses).
``StateGroup.slot_strides`` holds this rank's stride per tensor. Strides are memory, not model:
the two sides may differ, ``plan_state``'s runs are offsets inside one slot either way, and
``slot_runs`` places them at each side's own stride (the prefill learns the decode's at
registration).

*Pairing* (``link_roles``): prefill rank ``p`` pairs with decode rank ``d`` (``d`` sends it its
TRANSFER_REQUESTs) when it pairs for some group: a paged group by ``plan.paired``, a state group
when ``p`` writes some of it into ``d``; it *writes* group ``g`` into ``d`` by ``plan.writers``
(paged) or ``state_writers`` (state). The state writers always pair with ``d`` under the first
group's head split too, but groups of fewer heads can pair ranks the first group does not (two
prefill ranks, four decode ranks, a one-head group beside eight heads), hence the union. Both
sides compute it from geometry alone.

*Compatibility* (``check_groups``): both sides list the same groups, by name, in the same order,
of the same kinds; a paged group's model fields and window agree (``check_compatible``); a
state group's layers and tensors (global shape, dtype, sharded dimension, sections) agree. The first
difference raises ``IncompatibleGroups`` naming the group, so a group one side lacks can never
be skipped silently. TP size, block sizes, layouts and pool sizes may differ.

Pure Python over ints, like the rest of ``kvproto.geometry``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from kvproto.geometry.model import DType, GeometryError, KVGeometry
from kvproto.geometry.plan import IncompatibleGeometry, check_compatible, paired, plan_pair, writers


class IncompatibleGroups(ValueError):
    """Two caches' groups cannot exchange a request: the message names the group."""

    def __init__(self, group: str, reason: str) -> None:
        super().__init__(f"group {group!r}: {reason}")
        self.group = group
        self.reason = reason


# --- state groups -------------------------------------------------------------------------------
class Shard(NamedTuple):
    """One section of a sharded state tensor on one rank: the global indices ``held`` along the
    sharded dimension, and ``local``, the index where they start in the rank's own tensor."""

    held: range
    local: int


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One per-layer, per-request state tensor: its global (unsharded) shape, its dtype, the
    dimension split over TP (None: every rank holds all of it) and, for a dimension that is several
    projections side by side, their global ``sections`` (module docstring)."""

    shape: tuple[int, ...]
    dtype: DType
    shard_dim: int | None = None
    sections: tuple[int, ...] = ()
    """Global sizes of the sections along ``shard_dim``, summing to its size, each split over TP
    on its own; empty (or one): the dimension is one section."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "sections", tuple(int(n) for n in self.sections))
        if not self.shape or any(n <= 0 for n in self.shape):
            raise GeometryError(f"state shape {self.shape} must have positive sizes")
        if self.shard_dim is not None and not 0 <= self.shard_dim < len(self.shape):
            raise GeometryError(f"shard_dim {self.shard_dim} outside shape {self.shape}")
        if self.sections:
            if self.shard_dim is None:
                raise GeometryError(f"sections {self.sections} of a replicated state tensor")
            if any(n <= 0 for n in self.sections) or sum(self.sections) != self.shape[self.shard_dim]:
                raise GeometryError(f"sections {self.sections} do not add up to dimension {self.shard_dim} of "
                                    f"{self.shape}")
            if len(self.sections) == 1:
                object.__setattr__(self, "sections", ())  # one section is no section: equal to the default

    @property
    def section_sizes(self) -> tuple[int, ...]:
        """Global sizes of the sections along ``shard_dim`` (one, the whole dimension, by default)."""
        assert self.shard_dim is not None, "a replicated tensor has no sections"
        return self.sections or (self.shape[self.shard_dim],)

    def shards(self, tp_size: int, tp_rank: int) -> tuple[Shard, ...]:
        """Per section, the global indices along ``shard_dim`` that ``tp_rank`` holds and where they
        start locally; raises ``GeometryError`` where a section does not split over ``tp_size``."""
        assert self.shard_dim is not None, "a replicated tensor is not sharded"
        out, start, local = [], 0, 0
        for size in self.section_sizes:
            if size % tp_size:
                what = f"section of size {size}" if self.sections else f"size {size}"
                raise GeometryError(f"state dimension {self.shard_dim} ({what}) does not split over TP {tp_size}")
            n = size // tp_size
            out.append(Shard(range(start + tp_rank * n, start + (tp_rank + 1) * n), local))
            start += size
            local += n
        return tuple(out)

    def shard(self, tp_size: int, tp_rank: int) -> range:
        """Global indices along ``shard_dim`` held by ``tp_rank`` (the whole axis if replicated), for
        a one-section tensor (``shards`` for any)."""
        if self.shard_dim is None:
            return range(0, 1)
        if self.sections:
            raise GeometryError("a sectioned state tensor holds several ranges per rank (shards), not one")
        return self.shards(tp_size, tp_rank)[0].held

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.shard_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.shard_dim] = sum(len(s.held) for s in self.shards(tp_size, 0))
        return tuple(shape)

    def local_bytes(self, tp_size: int) -> int:
        return math.prod(self.local_shape(tp_size)) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class StateGroup:
    """Per-request state slots of ``num_layers`` layers, each layer holding ``tensors``; on this
    rank, ``num_slots`` slots per region, ``slot_strides`` apart (module docstring)."""

    name: str
    num_layers: int
    tensors: tuple[StateTensor, ...]
    num_slots: int
    slot_strides: tuple[int, ...] = ()
    """Per tensor, the bytes from a slot's start to the next one's in its regions (0: the tensor's
    local bytes, slots back to back); empty: 0 for every tensor. This rank's memory, not the model:
    ``check_groups`` ignores it, as it ignores ``num_slots``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "slot_strides", tuple(int(n) for n in self.slot_strides))
        if self.num_layers <= 0 or self.num_slots <= 0 or not self.tensors:
            raise GeometryError(f"state group {self.name!r} needs layers, slots and tensors")
        if self.slot_strides and (len(self.slot_strides) != len(self.tensors) or min(self.slot_strides) < 0):
            raise GeometryError(f"state group {self.name!r}: slot strides {self.slot_strides} are not one "
                                f"non-negative stride per tensor ({len(self.tensors)})")
        if not any(self.slot_strides):
            object.__setattr__(self, "slot_strides", ())  # every tensor's slots back to back: the default

    def regions(self) -> int:
        """Regions: one per (layer, tensor), layer-major."""
        return self.num_layers * len(self.tensors)

    def slot_bytes(self, tp_size: int) -> list[int]:
        """Bytes of one slot in each tensor's region."""
        return [t.local_bytes(tp_size) for t in self.tensors]

    def strides(self, tp_size: int) -> list[int]:
        """Bytes from one slot's start to the next's in each tensor's regions, on a rank of TP
        ``tp_size``; raises ``GeometryError`` where a stride is shorter than its slot."""
        sizes = self.slot_bytes(tp_size)
        if not self.slot_strides:
            return sizes
        out = []
        for t, (size, stride) in enumerate(zip(sizes, self.slot_strides)):
            if stride and stride < size:
                raise GeometryError(f"tensor {t}'s slots of {size} bytes lie {stride} bytes apart (they would "
                                    f"overlap)")
            out.append(stride or size)
        return out

    def region_bytes(self, tp_size: int) -> list[int]:
        """Bytes each tensor's region spans on a rank of TP ``tp_size``: its last slot's end."""
        return [(self.num_slots - 1) * stride + size
                for stride, size in zip(self.strides(tp_size), self.slot_bytes(tp_size))]


@dataclass(frozen=True, slots=True)
class PagedGroup:
    """Layers with a page pool of their own; ``window``: the decode needs only the last ``window``
    tokens of a prompt (sliding-window attention), None: every token, ``NAMED_WINDOW``: the tokens
    the engine names, room by room (module docstring)."""

    name: str
    geometry: KVGeometry
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window <= 0:
            raise GeometryError(f"paged group {self.name!r}: window must be positive, got {self.window}")


Group = PagedGroup | StateGroup


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """One rank's cache as groups. A one-group cache of a ``KVGeometry`` is today's cache."""

    tp_size: int
    tp_rank: int
    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise GeometryError("a cache needs at least one group")
        if not isinstance(self.groups[0], PagedGroup) or self.groups[0].window is not None:
            raise GeometryError("a cache's first group is paged and keeps every token (no window)")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise GeometryError(f"group names repeat: {names}")
        for g in self.groups:
            if isinstance(g, PagedGroup) and (g.geometry.tp_size, g.geometry.tp_rank) != (self.tp_size, self.tp_rank):
                raise GeometryError(f"paged group {g.name!r} is for TP rank {g.geometry.tp_rank}/{g.geometry.tp_size}, "
                                    f"the cache for {self.tp_rank}/{self.tp_size}")
            if isinstance(g, StateGroup):
                try:
                    g.strides(self.tp_size)  # raises where a dimension does not split or slots overlap
                except GeometryError as exc:
                    raise GeometryError(f"state group {g.name!r}: {exc}") from None

    @classmethod
    def single(cls, geometry: KVGeometry, name: str = "kv") -> CacheGeometry:
        return cls(geometry.tp_size, geometry.tp_rank, (PagedGroup(name, geometry),))

    def with_rank(self, tp_rank: int) -> CacheGeometry:
        """The same instance's cache seen from another rank."""
        return self.with_tp(self.tp_size, tp_rank)

    def with_tp(self, tp_size: int, tp_rank: int) -> CacheGeometry:
        """The same model's cache on rank ``tp_rank`` of an instance of TP ``tp_size`` (pool sizes,
        block sizes and layouts as this one's: enough for pairing, which reads none of them)."""
        groups = tuple(replace(g, geometry=replace(g.geometry, tp_size=tp_size, tp_rank=tp_rank))
                       if isinstance(g, PagedGroup) else g for g in self.groups)
        return CacheGeometry(tp_size, tp_rank, groups)

    @property
    def primary(self) -> KVGeometry:
        """The first group's geometry (the cache of a one-group model)."""
        first = self.groups[0]
        assert isinstance(first, PagedGroup)
        return first.geometry

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)


# --- compatibility ------------------------------------------------------------------------------
def check_groups(prefill: CacheGeometry, decode: CacheGeometry) -> None:
    """Raise ``IncompatibleGroups`` (naming the group) unless the two caches hold the same groups
    of the same model; TP size, block sizes, layouts and pool sizes may differ."""
    p_names, d_names = [g.name for g in prefill.groups], [g.name for g in decode.groups]
    for name in p_names:
        if name not in d_names:
            raise IncompatibleGroups(name, "the prefill has it, the decode does not")
    for name in d_names:
        if name not in p_names:
            raise IncompatibleGroups(name, "the decode has it, the prefill does not")
    if p_names != d_names:
        raise IncompatibleGroups(p_names[0], f"groups in a different order: prefill {p_names}, decode {d_names}")
    for p, d in zip(prefill.groups, decode.groups, strict=True):
        if type(p) is not type(d):
            raise IncompatibleGroups(p.name, f"a {type(p).__name__} on the prefill, a {type(d).__name__} on the decode")
        if isinstance(p, PagedGroup):
            assert isinstance(d, PagedGroup)
            try:
                check_compatible(p.geometry, d.geometry)
            except IncompatibleGeometry as exc:
                raise IncompatibleGroups(p.name, str(exc)) from None
            if p.window != d.window:
                raise IncompatibleGroups(p.name, f"window {window_name(p.window)} on the prefill, "
                                                 f"{window_name(d.window)} on the decode")
        else:
            assert isinstance(d, StateGroup)
            if p.num_layers != d.num_layers:
                raise IncompatibleGroups(p.name, f"{p.num_layers} layers on the prefill, {d.num_layers} on the decode")
            for i, (a, b) in enumerate(zip(p.tensors, d.tensors)):
                if a != b and a.sections != b.sections and replace(a, sections=()) == replace(b, sections=()):
                    raise IncompatibleGroups(p.name, f"tensor {i}'s sections differ: {a.sections or 'one'} on the "
                                                     f"prefill, {b.sections or 'one'} on the decode")
            if p.tensors != d.tensors:
                raise IncompatibleGroups(p.name, f"state tensors differ: prefill {p.tensors}, decode {d.tensors}")


# --- sliding windows -----------------------------------------------------------------------------
NAMED_WINDOW = 0xFFFF_FFFF
"""A paged group's ``window`` meaning "the tokens the engine names, room by room" (module
docstring); the value ``CACHE_GROUPS`` carries (``kvproto.wire.NAMED_WINDOW``, protocol 1.5)."""


def window_name(window: int | None) -> str:
    """A group's window as a reason names it."""
    return "named by the engine" if window == NAMED_WINDOW else str(window)


def window_tokens(num_tokens: int, window: int | None) -> range:
    """The prompt tokens a decode needs of a group with ``window`` (all of them without one)."""
    start = 0 if window is None else max(0, num_tokens - window)
    return range(start, num_tokens)


def window_pages(num_tokens: int, window: int | None, block_size: int) -> range:
    """Page indices (from the prompt's first page) holding ``window_tokens``."""
    tokens = window_tokens(num_tokens, window)
    if not tokens:
        return range(0)
    return range(tokens.start // block_size, (tokens.stop - 1) // block_size + 1)


# --- state plans ---------------------------------------------------------------------------------
class StateRun(NamedTuple):
    """``length`` bytes from ``src`` (offset in the prefill slot of region ``region``) to ``dst``
    (offset in the decode slot of the same region)."""

    region: int
    src: int
    dst: int
    length: int


def replica_writer(prefill_tp: int, decode: CacheGeometry) -> int:
    """The prefill rank that writes a replicated state tensor into ``decode.tp_rank``: the one whose
    share of the TP group holds the start of the decode rank's."""
    return decode.tp_rank * prefill_tp // decode.tp_size


def state_writers(prefill_tp: int, decode: CacheGeometry, group: StateGroup) -> tuple[int, ...]:
    """Sorted prefill ranks that write some of ``group`` into decode rank ``decode.tp_rank``."""
    chosen: set[int] = set()
    for t in group.tensors:
        if t.shard_dim is None:
            chosen.add(replica_writer(prefill_tp, decode))
            continue
        for (need, _), (first, _) in zip(t.shards(decode.tp_size, decode.tp_rank), t.shards(prefill_tp, 0)):
            n = len(first)  # every prefill rank holds n indices of the section, from first.start on
            chosen.update(range((need.start - first.start) // n, (need.stop - 1 - first.start) // n + 1))
    return tuple(sorted(chosen))


def _overlaps(t: StateTensor, prefill: CacheGeometry, decode: CacheGeometry, inner: int) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes) within one outer row of ``t`` of every section's
    overlap of the two ranks' shares, in section order."""
    out = []
    for (held, src_at), (need, dst_at) in zip(t.shards(prefill.tp_size, prefill.tp_rank),
                                              t.shards(decode.tp_size, decode.tp_rank)):
        lo, hi = max(held.start, need.start), min(held.stop, need.stop)
        if lo < hi:
            out.append(((src_at + lo - held.start) * inner, (dst_at + lo - need.start) * inner, (hi - lo) * inner))
    return out


def plan_state(prefill: CacheGeometry, decode: CacheGeometry, group_name: str) -> list[StateRun]:
    """The runs prefill rank ``prefill.tp_rank`` writes into decode rank ``decode.tp_rank`` for
    one request of group ``group_name``, in region order (empty if it writes nothing there): offsets
    inside one slot of each side (``slot_runs`` places them at slots)."""
    group = prefill.group(group_name)
    if not isinstance(group, StateGroup):
        raise TypeError(f"group {group_name!r} is not a state group")
    runs: list[StateRun] = []
    for layer in range(group.num_layers):
        for i, t in enumerate(group.tensors):
            region = layer * len(group.tensors) + i
            if t.shard_dim is None:
                if prefill.tp_rank == replica_writer(prefill.tp_size, decode):
                    runs.append(StateRun(region, 0, 0, t.local_bytes(1)))
                continue
            k = t.shard_dim
            inner = math.prod(t.shape[k + 1:]) * t.dtype.itemsize
            pieces = _overlaps(t, prefill, decode, inner)
            if not pieces:
                continue
            src_row = t.local_shape(prefill.tp_size)[k] * inner
            dst_row = t.local_shape(decode.tp_size)[k] * inner
            first = len(runs)
            for o in range(math.prod(t.shape[:k])):  # a run per outer row and section, merged where they abut
                for src_at, dst_at, length in pieces:
                    src, dst = o * src_row + src_at, o * dst_row + dst_at
                    last = runs[-1] if len(runs) > first else None
                    if last is not None and last.src + last.length == src and last.dst + last.length == dst:
                        runs[-1] = last._replace(length=last.length + length)
                    else:
                        runs.append(StateRun(region, src, dst, length))
    return runs


def slot_runs(runs: Sequence[StateRun], src_slot: int, dst_slot: int, src_strides: Sequence[int],
              dst_strides: Sequence[int], tensors: int) -> list[StateRun]:
    """``runs`` placed at slot ``src_slot`` / ``dst_slot`` of their regions (offsets in the region),
    slots ``src_strides`` / ``dst_strides`` apart per tensor (``StateGroup.strides``) on each side."""
    out = []
    for r in runs:
        i = r.region % tensors
        out.append(StateRun(r.region, src_slot * src_strides[i] + r.src, dst_slot * dst_strides[i] + r.dst,
                            r.length))
    return out


# --- pairing ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinkRoles:
    """What prefill rank ``p`` does for decode rank ``d`` (see "Pairing" above)."""

    paired: bool
    """``d`` sends ``p`` its requests (``p`` pairs with ``d`` for some group)."""
    writes: tuple[bool, ...]
    """Per group, in cache order: ``p`` writes some of it into ``d``."""

    @property
    def writer(self) -> bool:
        """``p`` writes some group into ``d``: ``d`` expects its TRANSFER_DONE."""
        return any(self.writes)


def link_roles(prefill: CacheGeometry, decode: CacheGeometry) -> LinkRoles:
    """The roles of prefill rank ``prefill.tp_rank`` towards decode rank ``decode.tp_rank``."""
    check_groups(prefill, decode)
    pairs, writes = False, []
    for p, d in zip(prefill.groups, decode.groups, strict=True):
        if isinstance(p, PagedGroup):
            assert isinstance(d, PagedGroup)
            writes.append(p.geometry.tp_rank in writers(p.geometry, d.geometry))
            pairs = pairs or paired(p.geometry, d.geometry)
        else:
            assert isinstance(p, StateGroup)
            writes.append(prefill.tp_rank in state_writers(prefill.tp_size, decode, p))
            pairs = pairs or writes[-1]
    return LinkRoles(pairs, tuple(writes))


def paired_ranks_of_decode_cache(prefill: CacheGeometry, decode: CacheGeometry) -> tuple[int, ...]:
    """Prefill ranks paired with decode rank ``decode.tp_rank``; ``prefill.tp_rank`` is ignored."""
    return tuple(r for r in range(prefill.tp_size) if link_roles(prefill.with_rank(r), decode).paired)


def paired_ranks_of_prefill_cache(prefill: CacheGeometry, decode: CacheGeometry) -> tuple[int, ...]:
    """Decode ranks paired with prefill rank ``prefill.tp_rank``; ``decode.tp_rank`` is ignored."""
    return tuple(r for r in range(decode.tp_size) if link_roles(prefill, decode.with_rank(r)).paired)


class BlockRun(NamedTuple):
    """One run of a staged piece's *state block* (staging.md, minor 3): ``run.length`` bytes of
    state group ``group`` (its index in the cache's groups), at ``offset`` from the block's start."""

    group: int
    run: StateRun
    offset: int


def state_block(prefill: CacheGeometry, decode: CacheGeometry) -> tuple[BlockRun, ...]:
    """The state block this pair's staged pieces end with (minor 3): every state group the prefill
    rank writes into the decode rank, in cache order, each as ``plan_state``'s runs in order, back to
    back. Empty where the pair stages no first group (no pieces) or writes no state. Both sides
    compute it from geometry alone; its bytes are the sum of the runs' lengths."""
    roles = link_roles(prefill, decode)
    if not roles.writes[0]:
        return ()
    out: list[BlockRun] = []
    at = 0
    for i, group in enumerate(prefill.groups):
        if isinstance(group, StateGroup) and roles.writes[i]:
            for run in plan_state(prefill, decode, group.name):
                out.append(BlockRun(i, run, at))
                at += run.length
    return tuple(out)


def block_bytes(block: Sequence[BlockRun]) -> int:
    """Bytes of a state block (``state_block``)."""
    return block[-1].offset + block[-1].run.length if block else 0


def stage_unit(prefill: KVGeometry, decode: KVGeometry) -> int:
    """Bytes of one token of a staged piece's block for one paged group (every region, the pair's
    head slice)."""
    plan = plan_pair(prefill, decode)
    return prefill.num_regions * plan.head_count * prefill.head_dim * prefill.itemsize


def staged_groups(prefill: CacheGeometry, decode: CacheGeometry) -> tuple[int, ...]:
    """Groups beyond the first that ride in this pair's staged pieces, after the first group's block
    (staging.md): paged groups without a window that the prefill rank writes into the decode rank
    beside the first group, in cache order, each whose block starts at an offset its element size
    divides. Both sides compute it from geometry alone."""
    roles = link_roles(prefill, decode)
    if not roles.writes[0]:
        return ()
    total = stage_unit(prefill.primary, decode.primary)
    out = []
    for i, (p, d) in enumerate(zip(prefill.groups[1:], decode.groups[1:]), start=1):
        if isinstance(p, PagedGroup) and isinstance(d, PagedGroup) and p.window is None and roles.writes[i] \
                and total % p.geometry.itemsize == 0:
            out.append(i)
            total += stage_unit(p.geometry, d.geometry)
    return tuple(out)
