"""A decode rank's REGISTER on a prefill rank: checked, then accepted as a link or refused.

Theory of operation
-------------------
A REGISTER is checked (version, model, compatibility key, geometry, memory table, transport:
``kvproto.aio.registration.check_register``, with the CACHE_GROUPS the same socket sent before it)
before the decode agent's metadata is loaded; a refusal answers REGISTER_REJECT with its code and
remembers the socket as refused (``kvproto.core.holds``). An accepted rank becomes a ``_DecodeLink``:
the pair's writers decided from the two geometries, the path its writes take (direct, sliced or
staged: ``_choose_path``, by ``EndpointConfig.path``, the transport's route and what both staging
buffers hold), one path per group beyond the first (``_group_paths``), the staged pieces' shape
(``_piece``), and the core's ``SenderLink``; then this rank's CACHE_GROUPS and REGISTER_ACCEPT. A
decode rank of minor 6 or later reads notification lists (spec/v1/tags.md), so the transport is told
it may batch the writes of one pass to it (``batch_writes``).
A registration that fails half-way leaves nothing behind (the link, its pieces, the peer).

``PrefillLinks`` is a mixin of ``PrefillEndpoint``; it runs once per link, never per room.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproto.aio.memory import KVCache, StateCache, geometry_to_wire
from kvproto.aio.paths import GroupWrites, LinkPath, StatePath
from kvproto.aio.registration import Reject, Remote, check_register
from kvproto.aio.staging import Piece, pair_piece, piece_tokens
from kvproto.core import DEVICE_COST, HOST_COST, LinkGroup, SenderLink
from kvproto.geometry import plan_pair, writers
from kvproto.geometry.groups import PagedGroup, StateGroup, link_roles, paired_ranks_of_prefill_cache, plan_state
from kvproto.transport import MemKind, TransportError
from kvproto.transport.base import Route, batch_writes, route_of
from kvproto.wire import MINOR, CacheGroups, ErrorCode, Register, RegisterAccept, RegisterReject

LIST_MINOR = 6
"""The first minor whose decode ranks read notification lists (several writes' tags in one)."""

log = logging.getLogger("kvproto")


@dataclass(slots=True)
class _DecodeLink:
    """A registered decode rank as this prefill rank keeps it: its socket identity, the core's
    ``SenderLink``, its transport agent and boot id, and the paths its writes take (the first
    group's, one per group beyond it, and the writes of several groups)."""

    ident: bytes
    link: SenderLink
    agent: str
    boot_id: int
    path: LinkPath
    last_seen: float
    groups: tuple[LinkPath | StatePath, ...] = ()
    """One path per group beyond the first."""
    writes: GroupWrites = field(init=False)
    """Its writes of several groups (``PostGroups``)."""

    def __post_init__(self) -> None:
        self.writes = GroupWrites(self.path, self.groups)

    def release(self) -> None:
        self.writes.release()
        self.path.release()
        for path in self.groups:
            path.release()



class PrefillLinks:
    """``PrefillEndpoint``'s part: REGISTERs, and the links they become (module docstring)."""

    # what ``PrefillEndpoint`` (through ``EndpointBase``) provides
    kv: Any
    config: Any
    core: Any
    transport: Any
    boot_id: int
    agent_name: str
    _cache: Any
    _staging: Any
    _kernels: Any
    _local: Any
    _group_locals: list[Any]
    _links: dict[bytes, _DecodeLink]
    _pieces: dict[bytes, Piece]
    _pending_groups: dict[bytes, CacheGroups]
    _send: Callable[..., None]
    _now: Callable[[], float]
    _drop_link: Callable[..., None]

    def _on_register(self, ident: bytes, minor: int, msg: Register) -> None:
        groups = self._pending_groups.pop(ident, None)
        try:
            mine = groups is not None and groups.link_id == msg.link_id
            remote = self._check_register(msg, groups.groups if mine else (), groups.layouts if mine else (), minor)
        except Reject as rej:
            log.warning("rejected registration from %s: %s", msg.agent_name, rej.reason)
            self._reject(ident, msg.link_id, rej.code, rej.reason)
            return
        now = self._now()
        old = self._links.get(ident)
        if old is not None:
            self._drop_link(old, ErrorCode.PEER_GONE, "decode rank registered again")
        decode_g = remote.geometry
        for other in [lk for lk in self._links.values()
                      if lk.link.instance == msg.instance and lk.link.decode_rank == decode_g.tp_rank]:
            self._drop_link(other, ErrorCode.PEER_GONE, "decode rank restarted")
        assert self.transport is not None and self._local is not None
        try:
            agent = self.transport.add_peer(msg.transport_metadata)
        except TransportError as exc:
            self._reject(ident, msg.link_id, ErrorCode.TRANSPORT_ERROR, f"cannot load the decode agent: {exc}")
            return
        try:
            self._accept(ident, minor, msg, remote, agent, now)
        except Exception as exc:
            self._links.pop(ident, None)
            self._pieces.pop(ident, None)
            if not any(other.agent == agent for other in self._links.values()):
                with contextlib.suppress(TransportError):
                    self.transport.remove_peer(agent)
            log.warning("rejected registration from %s: %r", msg.agent_name, exc)
            self._reject(ident, msg.link_id, ErrorCode.INDEX_OUT_OF_RANGE, f"cannot use the registered memory: {exc}")

    def _reject(self, ident: bytes, link_id: int, code: ErrorCode, reason: str) -> None:
        """Answer a REGISTER with REGISTER_REJECT. A socket that is not registered is remembered as
        refused, so that its ABORTs for the rooms it wanted count (``kvproto.core.holds``)."""
        self._send(ident, RegisterReject(link_id=link_id, code=code, reason=reason))
        if ident not in self._links:
            self.core.refuse_link(ident, self._now())

    def _accept(self, ident: bytes, minor: int, msg: Register, remote: Remote, agent: str, now: float) -> None:
        assert self.transport is not None and self._local is not None
        decode_g = remote.geometry
        g = self.kv.geometry
        chosen = writers(g, decode_g)
        is_writer = g.tp_rank in chosen
        plan = plan_pair(g, decode_g) if is_writer else None
        piece = self._piece(plan, remote, minor)
        unit = piece.unit if piece is not None else 0
        route = route_of(self.transport, agent)
        if minor >= LIST_MINOR:
            batch_writes(self.transport, agent)
        kind, can_stage = self._choose_path(plan, unit, piece.tail if piece is not None else 0, remote, minor, route)
        path = LinkPath(
            transport=self.transport, local=self._local, peer=agent, plan=plan, remote=decode_g,
            remote_bases=remote.bases, remote_kind=remote.kind, remote_device=remote.device,
            remote_aux=remote.aux, kind=kind, remote_staging=remote.staging, route=route,
        )
        # A direct link that can also stage picks per room by cost (``kvproto.core.cost``).
        by_cost = kind == "direct" and can_stage and self.config.path == "auto"
        staged = kind == "staged" or by_cost
        assert unit or not staged
        capacity = min(self._staging.capacity, remote.staging[1]) if staged and self._staging and remote.staging else 0
        group_paths, link_groups = self._group_paths(agent, remote, route,
                                                     {p.group for p in piece.parts[1:]} if staged and piece else set())
        link = SenderLink(
            key=ident, link_id=msg.link_id, instance=msg.instance, decode_rank=decode_g.tp_rank,
            num_blocks=decode_g.num_blocks, block_size=decode_g.block_size, aux_slots=msg.aux_slots,
            paired_ranks=frozenset(paired_ranks_of_prefill_cache(self._cache, remote.cache)), writer=is_writer,
            aux_owner=is_writer and chosen[0] == g.tp_rank,
            stage_unit=unit if staged else 0,
            stage_capacity=remote.staging[1] if staged and remote.staging else 0,
            stage_max_units=piece_tokens(capacity, unit, piece.tail if piece is not None else 0) if staged else 0,
            cost=(self.config.path_cost or (DEVICE_COST if self.kv.mem_kind is MemKind.VRAM else HOST_COST))
            if by_cost else None,
            regions=sum(p.piece.regions for p in piece.parts) if piece is not None else g.num_regions,
            groups=link_groups,
            stage_tail=piece.tail if staged and piece is not None else 0,
        )
        if kind == "direct" and not (route is not None and route.pattern):
            path.prepare()  # the peer's page list, before the first request needs it
        if piece is not None:
            self._pieces[ident] = piece
        self._links[ident] = _DecodeLink(ident, link, agent, msg.boot_id, path, now, group_paths)
        self.core.add_link(link)
        log.info("registered decode %s rank %d (%s path, minor %d)", msg.instance, decode_g.tp_rank, path.label, minor)
        if self.kv.groups:
            self._send(ident, CacheGroups(link_id=msg.link_id, groups=self.kv.wire_groups(),
                                          layouts=self.kv.wire_layouts()))
        self._send(ident, RegisterAccept(
            boot_id=self.boot_id, link_id=msg.link_id, agent_name=self.agent_name,
            geometry=geometry_to_wire(g), aux_slot_bytes=self.kv.aux.slot_bytes if self.kv.aux else 0))

    def _piece(self, plan: Any, remote: Remote, minor: int) -> Piece | None:
        """What this pair's staged pieces would hold; None where this rank cannot stage or writes
        no first group."""
        if plan is None or self._staging is None:
            return None
        return pair_piece(self._kernels, self._cache, remote.cache, side="prefill", minor=min(minor, MINOR),
                          buf=self._staging)

    def _group_paths(self, agent: str, remote: Remote, route: Route | None, staged: set[int]
                     ) -> tuple[tuple[LinkPath | StatePath, ...], tuple[LinkGroup, ...]]:
        """A path per group beyond the first into the decode rank of ``remote``, and what the core
        needs of each (whether this rank writes it there, the decode rank's pool, whether the link's
        staged pieces carry it: ``staged``, by group number)."""
        assert self.transport is not None
        roles = link_roles(self._cache, remote.cache)
        paths: list[LinkPath | StatePath] = []
        groups: list[LinkGroup] = []
        for i, (extra, mine, theirs, bases) in enumerate(zip(
                self.kv.groups, self._cache.groups[1:], remote.cache.groups[1:], remote.group_bases, strict=True)):
            writes = roles.writes[i + 1]
            if isinstance(mine, PagedGroup):
                assert isinstance(theirs, PagedGroup) and isinstance(extra, KVCache)
                plan = plan_pair(mine.geometry, theirs.geometry) if writes else None
                kind = "none" if plan is None else (
                    "direct" if plan.direct and self.config.path != "sliced" else "sliced")
                local = self._group_locals[i]
                assert local is not None
                path = LinkPath(transport=self.transport, local=local, peer=agent, plan=plan, remote=theirs.geometry,
                                remote_bases=bases, remote_kind=remote.kind, remote_device=remote.device,
                                remote_aux=None, kind=kind, route=route)
                if kind == "direct" and not (route is not None and route.pattern):
                    path.prepare()
                paths.append(path)
                groups.append(LinkGroup(writes, theirs.geometry.num_blocks, theirs.geometry.block_size,
                                        staged=i + 1 in staged))
            else:
                assert isinstance(theirs, StateGroup) and isinstance(extra, StateCache)
                runs = plan_state(self._cache, remote.cache, mine.name) if writes else []
                paths.append(StatePath(transport=self.transport, peer=agent, local=extra, runs=runs, remote_bases=bases,
                                       remote_kind=remote.kind, remote_device=remote.device,
                                       remote_strides=theirs.strides(remote.cache.tp_size), route=route))
                groups.append(LinkGroup(writes, theirs.num_slots))
        return tuple(paths), tuple(groups)

    def _choose_path(self, plan: Any, unit: int, tail: int, remote: Remote, minor: int,
                     route: Route | None) -> tuple[str, bool]:
        """(direct / sliced / staged for this pair, whether it can stage: a piece of one token and
        the state block must fit both staging buffers); see ``EndpointConfig.path``.
        A pattern route (the kernel path) never stages unless ``path="staged"`` asks: staging
        saves descriptors, and a pattern write pays none."""
        if plan is None:
            return "none", False
        assert self.transport is not None
        can_stage = (
            minor >= 1 and remote.staging is not None and self._staging is not None and unit > 0
            and remote.staging[2] in self.transport.memory_kinds()
            and unit + tail <= min(remote.staging[1], self._staging.capacity)
        )
        want = self.config.path
        if route is not None and route.pattern and want != "staged":
            return ("direct" if plan.direct and want != "sliced" else "sliced"), False
        if want == "sliced":
            return "sliced", can_stage
        if want == "staged" and can_stage:
            return "staged", can_stage
        if plan.direct:
            return "direct", can_stage
        return ("staged" if can_stage else "sliced"), can_stage

    def _check_register(self, msg: Register, wire_groups: Sequence[Any] = (), layouts: Sequence[Any] = (),
                        minor: int = MINOR) -> Remote:
        assert self.transport is not None
        return check_register(msg, wire_groups, config=self.config, kv=self.kv, cache=self._cache,
                              reachable=self.transport.memory_kinds(), layouts=layouts, peer_minor=minor)
