"""A decode rank's registration, checked: the prefill side of REGISTER (and CACHE_GROUPS).

Theory of operation
-------------------
A REGISTER opens a link and names the memory every later write of the link lands in, so every
value in it is checked before anything is registered (house rule 7), in the order messages.md
gives: transport, model, compatibility key, geometry and its agreement, the groups beyond the
first (CACHE_GROUPS, check 5a), then the memory table: bounds, the KV regions (every index once,
long enough, one memory kind this transport reaches), the aux region, each group's regions
(check 5b), the staging region. The first failure raises ``Reject`` with its code and reason,
which the endpoint answers with REGISTER_REJECT; nothing is recorded before the last check
passed. ``Remote`` is what the endpoint keeps of an accepted registration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvproto.aio.endpoint import EndpointConfig
from kvproto.aio.memory import LAYOUT_MINOR, KVCache, geometry_from_wire, groups_from_wire
from kvproto.geometry import IncompatibleGeometry, KVGeometry, check_compatible
from kvproto.geometry.groups import CacheGeometry, IncompatibleGroups, PagedGroup, check_groups
from kvproto.transport import MemKind
from kvproto.wire import MINOR, ErrorCode, RegionKind, Register, WireGroup, WireGroupLayout

MAX_ADDRESS = 2**63
"""Addresses and lengths from a peer must fit a signed 64-bit descriptor."""
MAX_PAGES = 1 << 26
"""Most pages (regions x pages per region) a decode rank may register: bounds descriptor lists."""
MAX_AUX_SLOTS = 1 << 20


class Reject(Exception):
    """A registration refused: the code and reason of REGISTER_REJECT."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Remote:
    """What a decode rank's REGISTER says about its memory, once checked."""

    geometry: KVGeometry
    bases: list[int]
    kind: MemKind
    device: int
    aux: tuple[tuple[tuple[int, int], ...], int] | None
    """The decode rank's aux buffers ((address, bytes per slot) each) and their slot count."""
    staging: tuple[int, int, MemKind, int] | None
    cache: CacheGeometry
    """The decode rank's cache as groups (one group unless it sent CACHE_GROUPS)."""
    group_bases: tuple[list[int], ...] = ()
    """The region bases of each group beyond the first."""


def check_register(msg: Register, wire_groups: Sequence[WireGroup], *, config: EndpointConfig, kv: KVCache,
                   cache: CacheGeometry, reachable: frozenset[MemKind], layouts: Sequence[WireGroupLayout] = (),
                   peer_minor: int = MINOR) -> Remote:
    """What a decode rank's REGISTER (and the CACHE_GROUPS before it: its groups and, minor 4,
    their ``layouts``) says, once every check of messages.md has passed, in its order; ``Reject``
    with the code of the first that fails. ``reachable``: the memory kinds this rank's transport can
    write; ``peer_minor``: the REGISTER's minor (named in a refusal it may explain)."""
    cfg = config
    if msg.transport != cfg.transport:
        raise Reject(ErrorCode.TRANSPORT_ERROR, f"decode uses transport {msg.transport!r}, prefill {cfg.transport!r}")
    if msg.model_id != cfg.model_id:
        raise Reject(ErrorCode.MODEL_MISMATCH, f"decode serves model {msg.model_id!r}, prefill {cfg.model_id!r}")
    if msg.compat_key != cfg.compat_key:
        raise Reject(ErrorCode.COMPAT_KEY_MISMATCH,
                      f"compatibility key {msg.compat_key!r} differs from prefill's {cfg.compat_key!r}")
    try:
        decode_g = geometry_from_wire(msg.geometry)
    except ValueError as exc:
        raise Reject(ErrorCode.INCOMPATIBLE_GEOMETRY, f"invalid decode geometry: {exc}") from None
    try:
        check_compatible(kv.geometry, decode_g)
    except IncompatibleGeometry as exc:
        raise Reject(ErrorCode.INCOMPATIBLE_GEOMETRY, str(exc)) from None
    try:  # groups beyond the first (messages.md, REGISTER check 5a)
        decode_cache = groups_from_wire(PagedGroup(kv.name, decode_g), wire_groups, layouts)
        check_groups(cache, decode_cache)
    except IncompatibleGroups as exc:
        older = f" (the decode speaks version 1.{peer_minor}, before state layouts)" \
            if peer_minor < LAYOUT_MINOR and "sections differ" in exc.reason else ""
        raise Reject(ErrorCode.INCOMPATIBLE_GEOMETRY, f"{exc}{older}") from None
    except ValueError as exc:  # GeometryError: a group that describes no real cache
        raise Reject(ErrorCode.INCOMPATIBLE_GEOMETRY, f"invalid decode group: {exc}") from None
    too_far = [r for r in msg.regions if r.address + r.length > MAX_ADDRESS]
    if too_far:
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE,
                      f"region at {too_far[0].address:#x} of {too_far[0].length} bytes lies beyond 2**63")
    if decode_g.num_regions * decode_g.num_blocks > MAX_PAGES:
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE,
                      f"{decode_g.num_regions} regions of {decode_g.num_blocks} pages exceed {MAX_PAGES} pages")
    if msg.aux_slots > MAX_AUX_SLOTS:
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"{msg.aux_slots} aux slots exceed {MAX_AUX_SLOTS}")
    kv_rows = sorted((r for r in msg.regions if r.kind == RegionKind.KV), key=lambda r: r.index)
    if [r.index for r in kv_rows] != list(range(decode_g.num_regions)):
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE,
                      f"memory table lists KV regions {[r.index for r in kv_rows]}, expected 0..{decode_g.num_regions - 1}")
    short = [r.index for r in kv_rows if r.length < decode_g.region_bytes]
    if short:
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE,
                      f"KV region {short[0]} is shorter than {decode_g.region_bytes} bytes")
    kinds = {r.mem_kind for r in kv_rows}
    if len(kinds) != 1 or next(iter(kinds)) not in (MemKind.DRAM, MemKind.VRAM):
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"KV regions have memory kinds {sorted(kinds)}")
    remote_kind = MemKind(next(iter(kinds)))
    if remote_kind not in reachable:
        raise Reject(ErrorCode.TRANSPORT_ERROR, f"transport cannot reach {remote_kind.name} memory")
    remote_aux = None
    aux_rows = sorted((r for r in msg.regions if r.kind == RegionKind.AUX), key=lambda r: r.index)
    if msg.aux_slots:
        local_aux = kv.aux
        if len(aux_rows) == 1:  # one buffer: its slots are aux_slot_bytes each
            parts = [(aux_rows[0].address, msg.aux_slot_bytes)]
            fits = aux_rows[0].length >= msg.aux_slots * msg.aux_slot_bytes
        else:  # several buffers sharing the slot index: each region holds aux_slots slots exactly
            parts = [(r.address, r.length // msg.aux_slots) for r in aux_rows]
            fits = [r.index for r in aux_rows] == list(range(len(aux_rows))) and \
                all(r.length % msg.aux_slots == 0 for r in aux_rows) and sum(n for _, n in parts) == msg.aux_slot_bytes
        if not aux_rows or not fits:
            raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, "aux slots do not fit the registered aux regions")
        if local_aux is not None and [n for _, n in local_aux.buffers] != [n for _, n in parts]:
            raise Reject(ErrorCode.INCOMPATIBLE_GEOMETRY,
                          f"aux buffers of {[n for _, n in parts]} bytes per slot, prefill uses "
                          f"{[n for _, n in local_aux.buffers]}")
        remote_aux = (tuple(parts), msg.aux_slots)
    group_bases = _group_regions(msg, decode_cache, remote_kind)
    staging_rows = [r for r in msg.regions if r.kind == RegionKind.STAGING]
    staging = None
    if staging_rows:
        row = staging_rows[0]
        if len(staging_rows) > 1 or row.length == 0 or row.mem_kind not in (MemKind.DRAM, MemKind.VRAM):
            raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, "the memory table's staging region is invalid")
        staging = (row.address, row.length, MemKind(row.mem_kind), row.device_id)
    return Remote(decode_g, [r.address for r in kv_rows], remote_kind, kv_rows[0].device_id, remote_aux, staging,
                   decode_cache, group_bases)

def _group_regions(msg: Register, cache: CacheGeometry, kind: MemKind) -> tuple[list[int], ...]:
    """The bases of each group's regions (messages.md, REGISTER check 5b)."""
    rows = [r for r in msg.regions if r.kind == RegionKind.GROUP]
    stray = sorted({r.index >> 24 for r in rows} - set(range(1, len(cache.groups))))
    if stray:
        raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"GROUP regions of group {stray[0]}, which CACHE_GROUPS did not list")
    out = []
    for number, group in enumerate(cache.groups[1:], start=1):
        if isinstance(group, PagedGroup):
            g = group.geometry
            if g.num_regions * g.num_blocks > MAX_PAGES:
                raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"group {group.name!r}: {g.num_regions} regions of "
                                                            f"{g.num_blocks} pages exceed {MAX_PAGES} pages")
            need = [g.region_bytes] * g.num_regions
        else:
            if max(group.strides(cache.tp_size)) >= MAX_ADDRESS:  # (one slot: the stride reaches nothing)
                raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"group {group.name!r}: a slot stride beyond 2**63")
            sizes = group.region_bytes(cache.tp_size)  # the last slot's end, slots their stride apart
            need = [sizes[i % len(sizes)] for i in range(group.regions())]
        mine = sorted((r for r in rows if r.index >> 24 == number), key=lambda r: r.index)
        if [r.index & 0xFFFFFF for r in mine] != list(range(len(need))):
            raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"group {group.name!r}: the memory table lists regions "
                                                        f"{[r.index & 0xFFFFFF for r in mine]}, expected 0..{len(need) - 1}")
        for r, n in zip(mine, need):
            if r.length < n or r.mem_kind != kind:
                raise Reject(ErrorCode.INDEX_OUT_OF_RANGE, f"group {group.name!r}: region {r.index & 0xFFFFFF} "
                                                            f"is shorter than {n} bytes or not in {kind.name}")
        out.append([r.address for r in mine])
    return tuple(out)
