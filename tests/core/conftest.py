"""A sans-IO harness for the protocol core: prefill and decode cores wired by hand, no I/O.

Theory of operation
-------------------
``Net`` holds one ``SenderCore`` per prefill rank and one ``ReceiverCore`` per decode rank of
one prefill instance and one decode instance, linked exactly as ``kvproto.aio.prefill`` (on
REGISTER) and ``kvproto.aio.decode`` (after the handshake) link them: pairing, writers and the
aux owner come from ``kvproto.geometry``.

After every call into a core the harness pops the core's outputs (``pump``) and turns them
into pending ``Event``s that nothing delivers until the test says so:

* ``Send``      -> a control event, *encoded* with ``kvproto.wire.encode`` now and decoded with
                   ``decode`` on delivery (the codec sits on the path). Control events of one
                   direction of one link are FIFO, as on a ZMQ socket.
* ``PostWrite`` / ``PostAux`` -> two independent events: ``tag`` (the receiver's
                   notification, delivered to ``on_notification(agent, tag, now)``) and ``done``
                   (the sender's completion, ``write_done``; ``fail`` turns it into
                   ``write_failed``). The data plane orders neither against anything.
* ``PostStaged`` -> like a write (``tag`` of kind STAGED, ``done``); the harness checks that the
                   piece lands in a region the decode rank's ring granted for it.
* ``Scatter``   -> a ``scatter`` event (the decode rank's scatter kernel); delivering it calls
                   ``scatter_done``. Staged token ranges are recorded per (prefill, decode, room).
* ``RoomEnded`` -> recorded per core in ``ended``. A decode room that ends while a write into it
                   is still in flight (its ``done`` pending) or a scatter of it still runs is
                   recorded in ``unsafe_ends`` unless it ended by its drain deadline
                   (or, for writes of the dropped prefill rank only, by a ``DropLink``).
* ``DropLink``  -> performed at once, as a dead peer would look (``drop_link``): the decode rank
                   removes the link (``remove_link``: the link's rooms fail PEER_GONE and its cluster
                   fails, to bootstrap again) and the prefill rank removes its link to that decode
                   rank. Recorded in ``dropped``. Events already in flight stay pending; ``rejoin``
                   bootstraps the cluster again (the dropped links' pending control events are lost
                   with their sockets then).

A ``done`` can be *stalled* (``stall``): the transport never reports the write, which stays in
flight (pending, never deliverable), so a decode room ending meanwhile is an unsafe end.

Staging (``staged``: every writer pair, or the given (prefill, decode) pairs) goes through one
``StagingRing`` of ``ring`` bytes per decode rank, shared by every writer and room; a pair's unit
is one token of its moved heads over every region (``unit``). With ``ring=None`` the prefill ranks
stage while the decode ranks offer no staging (a misconfigured or hostile peer).

The clock is a float the test advances (``advance``); every core's ``handle_timer`` runs then.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from kvproto.core import (
    PostAux,
    PostWrite,
    ReceiverCore,
    ReceiverLink,
    RoomEnded,
    RoomState,
    Send,
    SenderCore,
    SenderLink,
    Timeouts,
)
from kvproto.core.events import DropLink, PostStaged, Scatter
from kvproto.core.staging import StagingRing
from kvproto.geometry import (
    DType,
    KVGeometry,
    Layout,
    paired_ranks_of_decode,
    paired_ranks_of_prefill,
    plan_pair,
    writers,
)
from kvproto.wire import ErrorCode, Message, TransferRequest, decode, decode_tag, encode

CLUSTER = "tcp://prefill-rank0:5000"
"""The decode side's name for the prefill instance (its bootstrap address)."""
INSTANCE = "decode-instance-A"
"""The prefill side's name for the decode instance."""

TO_DECODE, TO_PREFILL, TAG, DONE, SCATTER = "to_decode", "to_prefill", "tag", "done", "scatter"


def geometry(tp: int, rank: int = 0, *, heads: int = 8, block: int = 16, blocks: int = 64,
             mla: bool = False) -> KVGeometry:
    return KVGeometry(
        tp_size=tp, tp_rank=rank, num_layers=2, num_kv_heads=1 if mla else heads, head_dim=8,
        dtype=DType.FLOAT16, block_size=block, layout=Layout.NHD, mla=mla, num_blocks=blocks,
    )


def pages_for(tokens: int, block: int) -> int:
    return -(-tokens // block)


def agent_of(p: int) -> str:
    return f"prefill-agent-{p}"


def link_id_of(p: int) -> int:
    """The decode-assigned link id of prefill rank ``p`` (every decode rank counts alike)."""
    return 1 + p


@dataclass(eq=False)
class Event:
    kind: str
    p: int
    d: int
    payload: Any
    order: int
    nbytes: int = 0
    fail: str | None = None
    stalled: bool = False
    """A ``done`` the transport never reports: it stays pending (the write may still land) but is
    never deliverable."""

    @property
    def channel(self) -> tuple[str, int, int] | None:
        return (self.kind, self.p, self.d) if self.kind in (TO_DECODE, TO_PREFILL) else None

    def message(self) -> Message:
        assert self.kind in (TO_DECODE, TO_PREFILL)
        return decode(self.payload)

    def __repr__(self) -> str:
        body = self.message() if self.channel else self.payload
        return f"Event({self.kind} P{self.p}/D{self.d} {body!r})"


@dataclass
class Net:
    """One prefill instance (``p_tp`` ranks) linked to one decode instance (``d_tp`` ranks)."""

    p_tp: int = 1
    d_tp: int = 1
    heads: int = 8
    mla: bool = False
    p_block: int = 16
    d_block: int = 16
    p_blocks: int = 64
    d_blocks: int = 64
    aux_slots: int = 4
    timeouts: Timeouts | None = None
    d_timeouts: Timeouts | None = None
    """The decode ranks' timeouts, when they differ from ``timeouts``."""
    ready: bool = True
    report_tags: bool = True
    """Pass each write's tag with its DONE / failure report (as the I/O layer should)."""
    staged: bool | frozenset[tuple[int, int]] = False
    """Writer pairs (prefill rank, decode rank) that stage; ``True``: every writer pair."""
    ring: int | None = 4096
    """Bytes of each decode rank's staging ring (``None``: the decode ranks offer no staging,
    while the prefill ranks still stage to the ``staged`` pairs)."""
    stage_max_units: int = 0
    """Most tokens one staged write of a prefill rank may carry (0: no limit)."""
    now: float = 1000.0
    seed: int = 7
    senders: list[SenderCore] = field(init=False)
    receivers: list[ReceiverCore] = field(init=False)
    pending: list[Event] = field(init=False, default_factory=list)
    posts: dict[int, list[PostWrite | PostAux | PostStaged]] = field(init=False)
    sent: list[tuple[str, int, int, Message]] = field(init=False, default_factory=list)
    ended: dict[tuple[str, int], list[RoomEnded]] = field(init=False)
    delivered_tags: int = field(init=False, default=0)
    landed: set[tuple[int, bytes]] = field(init=False, default_factory=set)
    """(decode rank, tag) of every notification delivered so far."""
    completed: set[tuple[int, int, bytes]] = field(init=False, default_factory=set)
    """(prefill rank, decode rank, tag) of every write reported DONE so far."""
    seen_at_end: dict[tuple[str, int, int], frozenset] = field(init=False, default_factory=dict)
    """What had landed (decode) or completed (prefill) when each room ended SUCCESS."""
    scattered: dict[tuple[int, int, int], list[tuple[int, int]]] = field(init=False)
    """(prefill rank, decode rank, room) -> token ranges scattered on decode, in order."""
    region_errors: list[str] = field(init=False, default_factory=list)
    """Staged writes posted to a region the decode rank's ring had not granted for them."""
    unsafe_ends: list[tuple[int, RoomEnded, list]] = field(init=False, default_factory=list)
    """(decode rank, ending, in-flight events) of decode rooms that ended with writes in flight."""
    forced_ends: list[tuple[int, RoomEnded]] = field(init=False, default_factory=list)
    """Decode rooms whose drain deadline forced the report."""
    dropped: list[tuple[int, DropLink]] = field(init=False, default_factory=list)
    """(decode rank, output) of every DropLink a decode core asked for, in order (all performed)."""
    dropped_ends: list[tuple[int, int, RoomEnded]] = field(init=False, default_factory=list)
    """(decode rank, dropped prefill rank, ending) of decode rooms ended by performing a DropLink."""

    def __post_init__(self) -> None:
        self._order = itertools.count()
        self.pg = [geometry(self.p_tp, r, heads=self.heads, block=self.p_block, blocks=self.p_blocks,
                            mla=self.mla) for r in range(self.p_tp)]
        self.dg = [geometry(self.d_tp, r, heads=self.heads, block=self.d_block, blocks=self.d_blocks,
                            mla=self.mla) for r in range(self.d_tp)]
        self.senders = [
            SenderCore(block_size=g.block_size, num_blocks=g.num_blocks, aux_slots=self.aux_slots,
                       timeouts=self.timeouts)
            for g in self.pg
        ]
        self.receivers = [
            ReceiverCore(block_size=g.block_size, num_blocks=g.num_blocks, aux_slots=self.aux_slots,
                         timeouts=self.d_timeouts or self.timeouts, seed=self.seed + d,
                         staging=StagingRing(self.ring) if self.ring is not None and self._any_staged(d) else None)
            for d, g in enumerate(self.dg)
        ]
        self.posts = defaultdict(list)
        self.ended = defaultdict(list)
        self.scattered = defaultdict(list)
        self._draining_now: set[tuple[int, int]] = set()
        self._drops: list[tuple[int, DropLink]] = []
        self._cut: set[tuple[int, int]] = set()  # (prefill, decode) pairs whose link was dropped
        self._dropping: tuple[int, int] | None = None  # (decode rank, prefill rank) being dropped
        self._given: dict[tuple[int, int], tuple[int, int]] = {}  # (p, room) -> (end token, pages)
        # prefill side: what PrefillEndpoint._on_register computes for each registered decode rank
        self.slinks: dict[int, list[SenderLink]] = {}
        for p, pg in enumerate(self.pg):
            paired = frozenset(paired_ranks_of_prefill(pg, self.dg[0]))
            self.slinks[p] = []
            for d in sorted(paired):
                chosen = writers(pg, self.dg[d])
                is_writer = p in chosen
                unit = self.unit(p, d) if is_writer and self.is_staged(p, d) else 0
                link = SenderLink(
                    key=("decode", d), link_id=link_id_of(p), instance=INSTANCE, decode_rank=d,
                    num_blocks=self.dg[d].num_blocks, block_size=self.dg[d].block_size,
                    aux_slots=self.aux_slots, paired_ranks=paired, writer=is_writer,
                    aux_owner=is_writer and chosen[0] == p, stage_unit=unit,
                    stage_capacity=(self.ring or 4096) if unit else 0,
                    stage_max_units=self.stage_max_units if unit else 0,
                )
                self.slinks[p].append(link)
                self.senders[p].add_link(link)
        # decode side: what DecodeEndpoint._handshake returns
        self.rlinks: dict[int, list[ReceiverLink]] = {}
        for d, dg in enumerate(self.dg):
            chosen = writers(self.pg[0], dg)
            self.rlinks[d] = [
                ReceiverLink(key=("prefill", p), link_id=link_id_of(p), cluster=CLUSTER, prefill_rank=p,
                             agent=agent_of(p), writer=p in chosen, aux_owner=p == chosen[0],
                             stage_unit=self.unit(p, d) if p in chosen and self.is_staged(p, d)
                             and self.ring is not None else 0)
                for p in paired_ranks_of_decode(self.pg[0], dg)
            ]
            self.receivers[d].cluster_pending(CLUSTER)
        if self.ready:
            self.make_ready()

    # --- topology -----------------------------------------------------------------------------
    def is_staged(self, p: int, d: int) -> bool:
        return self.staged is True or (not isinstance(self.staged, bool) and (p, d) in self.staged)

    def _any_staged(self, d: int) -> bool:
        return any(self.is_staged(p, d) for p in range(self.p_tp))

    def unit(self, p: int, d: int) -> int:
        """Bytes of one token of the pair's staged piece: regions x moved heads x head bytes."""
        plan = plan_pair(self.pg[p], self.dg[d])
        return self.pg[p].num_regions * plan.head_count * self.pg[p].head_bytes

    def make_ready(self, ranks: Iterable[int] | None = None) -> None:
        for d in self._d(ranks):
            self.receivers[d].cluster_ready(CLUSTER, self.rlinks[d], self.now)
        self.pump()

    def writers_of(self, d: int) -> list[int]:
        return [lk.prefill_rank for lk in self.rlinks[d] if lk.writer]

    def targets_of(self, p: int) -> list[int]:
        return [lk.decode_rank for lk in self.slinks[p] if lk.writer]

    def paired(self) -> list[tuple[int, int]]:
        return [(p, lk.decode_rank) for p in range(self.p_tp) for lk in self.slinks[p]]

    def _p(self, ranks: Iterable[int] | None) -> list[int]:
        return list(range(self.p_tp)) if ranks is None else list(ranks)

    def _d(self, ranks: Iterable[int] | None) -> list[int]:
        return list(range(self.d_tp)) if ranks is None else list(ranks)

    # --- outputs into events ---------------------------------------------------------------
    def pump(self) -> None:
        """Turn every core's outputs into pending events, performing DropLinks, until no core has any."""
        while True:
            busy = False
            for p, core in enumerate(self.senders):
                for out in core.pop_outputs():
                    busy = True
                    self._sender_output(p, out)
            for d, core in enumerate(self.receivers):
                for out in core.pop_outputs():
                    busy = True
                    self._receiver_output(d, out)
            drops, self._drops = self._drops, []
            for d, out in drops:
                self.drop_link(d, out.link[1], code=out.code, reason=out.reason)
            if not busy and not drops:
                return

    def _event(self, kind: str, p: int, d: int, payload: Any, **kw: Any) -> Event:
        ev = Event(kind, p, d, payload, next(self._order), **kw)
        self.pending.append(ev)
        return ev

    def _sender_output(self, p: int, out: Any) -> None:
        if isinstance(out, Send):
            _, d = out.link
            self.sent.append((TO_DECODE, p, d, out.message))
            self._event(TO_DECODE, p, d, encode(out.message))
        elif isinstance(out, (PostWrite, PostAux, PostStaged)):
            _, d = out.link
            self.posts[p].append(out)
            if isinstance(out, PostStaged):
                nbytes = (out.end_token - out.start_token) * self.unit(p, d)
                self._check_region(p, d, out, nbytes)
            else:
                nbytes = (out.end_token - out.start_token) * 64 if isinstance(out, PostWrite) else 32
            self._event(TAG, p, d, out.tag)
            self._event(DONE, p, d, out, nbytes=nbytes)
        elif isinstance(out, RoomEnded):
            self.ended[("P", p)].append(out)
            if out.state is RoomState.SUCCESS:
                self.seen_at_end[("P", p, out.room_id)] = frozenset(self.completed)
        else:  # pragma: no cover - the core has no other outputs
            raise AssertionError(f"unexpected sender output {out!r}")

    def _receiver_output(self, d: int, out: Any) -> None:
        if isinstance(out, Send):
            _, p = out.link
            self.sent.append((TO_PREFILL, p, d, out.message))
            self._event(TO_PREFILL, p, d, encode(out.message))
        elif isinstance(out, Scatter):
            _, p = out.link
            self._event(SCATTER, p, d, out)
        elif isinstance(out, DropLink):
            self.dropped.append((d, out))
            self._drops.append((d, out))  # performed once this batch of outputs is turned into events
        elif isinstance(out, RoomEnded):
            self.ended[("D", d)].append(out)
            if out.state is RoomState.SUCCESS:
                self.seen_at_end[("D", d, out.room_id)] = frozenset(self.landed)
            if self._dropping is not None and self._dropping[0] == d:
                # the dropped prefill rank is treated as dead: only its own writes are exempt
                self.dropped_ends.append((d, self._dropping[1], out))
                busy = [ev for ev in self.in_flight(d, out.room_id)
                        if not (ev.kind == DONE and ev.p == self._dropping[1])]
                if busy:
                    self.unsafe_ends.append((d, out, busy))
            elif (d, out.room_id) in self._draining_now:
                self.forced_ends.append((d, out))
            else:
                busy = self.in_flight(d, out.room_id)
                if busy:
                    self.unsafe_ends.append((d, out, busy))
        else:
            raise AssertionError(f"a receiver core never posts writes, got {out!r}")

    def _check_region(self, p: int, d: int, out: PostStaged, nbytes: int) -> None:
        """A staged write must land exactly in a live grant of the decode ring for it."""
        ring = self.receivers[d].ring
        key = (out.room_id, link_id_of(p), out.seq)
        live = {k: (off, size) for k, off, size in ring.live_grants()} if ring is not None else {}
        region = live.get(key)
        if region is None or region[0] != out.remote_offset or nbytes > region[1]:
            self.region_errors.append(f"P{p}->D{d} {out!r}: {nbytes} bytes, ring holds {region}")

    def in_flight(self, d: int, room: int) -> list[Event]:
        """Pending write completions and scatters into decode rank ``d`` for the incarnation of
        ``room`` that ``d`` runs (or last ran)."""
        core = self.receivers[d]
        live = core.rooms.get(room)
        gens = {live.generation} if live is not None else set(
            getattr(core._tombstones.get(room), "generations", ()))
        return [ev for ev in self.pending if ev.d == d and (
            (ev.kind == DONE and ev.payload.room_id == room and decode_tag(ev.payload.tag).generation in gens)
            or (ev.kind == SCATTER and ev.payload.room_id == room))]

    # --- links dropped and bootstrapped again ----------------------------------------------------
    def drop_link(self, d: int, p: int, *, code: ErrorCode = ErrorCode.PEER_GONE, reason: str = "",
                  prefill_side: bool = True) -> None:
        """Decode rank ``d`` drops its link to prefill rank ``p`` (``remove_link``: the link's rooms
        fail PEER_GONE, the cluster must bootstrap again) and, unless ``prefill_side`` is false,
        ``p`` loses its link to ``d`` as a dead peer would look (``SenderCore.remove_link``)."""
        self._cut.add((p, d))
        outer, self._dropping = self._dropping, (d, p)
        try:
            self.receivers[d].remove_link(("prefill", p), self.now, code=code, reason=reason)
            if prefill_side:
                self.senders[p].remove_link(("decode", d), self.now, code=code)
            self.pump()
        finally:
            self._dropping = outer

    def rejoin(self, d: int) -> None:
        """Decode rank ``d`` bootstraps its cluster again: the control events still pending on the
        dropped links are lost with their sockets, every paired prefill rank registers ``d`` anew,
        the cluster is ready."""
        paired = {lk.prefill_rank for lk in self.rlinks[d]}
        cut = {p for p in paired if (p, d) in self._cut}
        self._cut -= {(p, d) for p in cut}
        self.pending = [ev for ev in self.pending if not (ev.channel is not None and ev.d == d and ev.p in cut)]
        for p in paired:
            for link in self.slinks[p]:
                if link.decode_rank == d:
                    self.senders[p].add_link(link)
        self.receivers[d].cluster_pending(CLUSTER)
        self.receivers[d].cluster_ready(CLUSTER, self.rlinks[d], self.now)
        self.pump()

    # --- delivery ------------------------------------------------------------------------------
    def deliverable(self, kinds: Iterable[str] | None = None) -> list[Event]:
        """Pending events that may go next: the head of each control FIFO, any tag or done."""
        wanted = set(kinds) if kinds is not None else None
        seen: set[tuple[str, int, int]] = set()
        out = []
        for ev in self.pending:
            if ev.stalled:
                continue
            ch = ev.channel
            if ch is not None:
                if ch in seen:
                    continue
                seen.add(ch)
            if wanted is None or ev.kind in wanted:
                out.append(ev)
        return out

    def stall(self, ev: Event) -> None:
        """The transport never reports write ``ev`` (a ``done``): it stays in flight for good."""
        assert ev.kind == DONE
        ev.stalled = True

    def deliver(self, ev: Event, *, keep: bool = False) -> None:
        """Deliver ``ev`` now (``keep``: leave a copy pending, i.e. a duplicate)."""
        if not keep:
            self.pending.remove(ev)
        if ev.kind == TO_DECODE:
            self.receivers[ev.d].on_message(("prefill", ev.p), ev.message(), self.now)
        elif ev.kind == TO_PREFILL:
            self.senders[ev.p].on_message(("decode", ev.d), ev.message(), self.now)
        elif ev.kind == TAG:
            self.delivered_tags += 1
            self.landed.add((ev.d, ev.payload))
            self.receivers[ev.d].on_notification(agent_of(ev.p), ev.payload, self.now)
        elif ev.kind == SCATTER:
            out = ev.payload
            self.scattered[(ev.p, ev.d, out.room_id)].append((out.start_token, out.end_token))
            self.receivers[ev.d].scatter_done(out.room_id, link_id_of(ev.p), out.seq, self.now)
        elif ev.kind == DONE:
            out = ev.payload
            tag = out.tag if self.report_tags else None
            if ev.fail is not None:
                self.senders[ev.p].write_failed(out.room_id, out.link, out.seq, ev.fail, self.now, tag=tag)
            else:
                self.completed.add((ev.p, ev.d, out.tag))
                self.senders[ev.p].write_done(out.room_id, out.link, out.seq, ev.nbytes, self.now, tag=tag)
        else:  # pragma: no cover
            raise AssertionError(ev.kind)
        self.pump()

    def tamper(self, ev: Event, **changes: Any) -> None:
        """Rewrite a pending control event's message (a buggy or hostile peer)."""
        ev.payload = encode(replace(ev.message(), **changes))

    def take(self, kind: str | None = None, pred: Callable[[Event], bool] | None = None) -> list[Event]:
        """Remove and return the pending events that match (they are lost unless re-delivered)."""
        hit = [ev for ev in self.pending if (kind is None or ev.kind == kind) and (pred is None or pred(ev))]
        for ev in hit:
            self.pending.remove(ev)
        return hit

    def find(self, kind: str | None = None, pred: Callable[[Event], bool] | None = None) -> list[Event]:
        return [ev for ev in self.pending if (kind is None or ev.kind == kind) and (pred is None or pred(ev))]

    def run(self, kinds: Iterable[str] | None = None, *, rng: random.Random | None = None,
            limit: int = 100_000) -> int:
        """Deliver events (of ``kinds``) until none is left: FIFO, or in ``rng``'s order."""
        n = 0
        while True:
            ready = self.deliverable(kinds)
            if not ready:
                return n
            ev = rng.choice(ready) if rng is not None else ready[0]
            self.deliver(ev)
            n += 1
            assert n < limit, "the harness did not quiesce"

    # --- time -----------------------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        self.now += dt
        for core in self.senders:
            core.handle_timer(self.now)
        self.pump()
        for d, core in enumerate(self.receivers):
            # a draining room's only deadline is its drain deadline: an end now is forced
            self._draining_now = {(d, r) for r, room in core.rooms.items() if room.failing}
            core.handle_timer(self.now)
            self.pump()
            self._draining_now = set()

    def next_deadline(self) -> float | None:
        deadlines = [c.next_deadline() for c in [*self.senders, *self.receivers]]
        present = [x for x in deadlines if x is not None]
        return min(present) if present else None

    # --- application ----------------------------------------------------------------------------
    def open(self, room: int, *, prefill: Iterable[int] | None = None, decode: Iterable[int] | None = None,
             sides: str = "PD") -> None:
        if "P" in sides:
            for p in self._p(prefill):
                self.senders[p].open_room(room, self.now)
                self._given.pop((p, room), None)
        if "D" in sides:
            for d in self._d(decode):
                self.receivers[d].open_room(room, CLUSTER, self.now)
        self.pump()

    def dst_pages(self, d: int, room: int, num_tokens: int) -> list[int]:
        blocks = self.dg[d].num_blocks
        return [(room * 5 + 3 * d + i) % blocks for i in range(pages_for(num_tokens, self.dg[d].block_size))]

    def dest(self, room: int, num_tokens: int, *, prefix: int = 0, aux: int | None = None,
             ranks: Iterable[int] | None = None, pages: Sequence[int] | None = None) -> None:
        for d in self._d(ranks):
            self.receivers[d].set_destination(
                room, self.dst_pages(d, room, num_tokens) if pages is None else pages, num_tokens, self.now,
                prefix_tokens=prefix, aux_slot=aux)
        self.pump()

    def chunk(self, room: int, end: int, *, last: bool = False, aux: int | None = None,
              ranks: Iterable[int] | None = None) -> None:
        for p in self._p(ranks):
            _, have = self._given.get((p, room), (0, 0))
            need = pages_for(end, self.pg[p].block_size)
            new = [(room * 7 + i) % self.pg[p].num_blocks for i in range(have, need)]
            self.senders[p].submit_chunk(room, new, end, self.now, last=last, aux_slot=aux)
            self._given[(p, room)] = (end, need)
        self.pump()

    def abort(self, side: str, rank: int, room: int, reason: str = "test abort") -> None:
        core = self.senders[rank] if side == "P" else self.receivers[rank]
        core.abort(room, self.now, reason)
        self.pump()

    # --- observation ----------------------------------------------------------------------------
    def cores(self) -> list[tuple[tuple[str, int], SenderCore | ReceiverCore]]:
        return [(("P", p), c) for p, c in enumerate(self.senders)] + [
            (("D", d), c) for d, c in enumerate(self.receivers)]

    def endings(self, room: int) -> dict[tuple[str, int], list[RoomEnded]]:
        return {who: [e for e in self.ended[who] if e.room_id == room] for who, _ in self.cores()}

    def ending(self, who: tuple[str, int], room: int) -> RoomEnded:
        """The one RoomEnded of ``room`` on core ``who`` (fails unless exactly one)."""
        got = [e for e in self.ended[who] if e.room_id == room]
        assert len(got) == 1, f"{who} ended room {room} {len(got)} times: {got}"
        return got[0]

    def state(self, who: tuple[str, int], room: int) -> RoomState | None:
        side, rank = who
        return (self.senders[rank] if side == "P" else self.receivers[rank]).room_state(room)

    def assert_all_ended(self, room: int, state: RoomState, code: Any = None,
                         who: Iterable[tuple[str, int]] | None = None) -> None:
        for w in (who if who is not None else [w for w, _ in self.cores()]):
            e = self.ending(w, room)
            assert e.state is state, f"{w}: {e}"
            if code is not None:
                assert e.code == code, f"{w}: {e}"

    def assert_ended_once(self) -> None:
        for who, ends in self.ended.items():
            counts = Counter(e.room_id for e in ends)
            assert all(n == 1 for n in counts.values()), f"{who} reported rooms twice: {counts}"

    def assert_clean(self) -> None:
        """No trace of any room remains: rooms, deadlines, parked requests, held ABORTs (drains),
        staging credits; and no staged write went outside its grant."""
        for who, core in self.cores():
            assert core.rooms == {}, f"{who} still has rooms {list(core.rooms)}"
            assert len(core.timers) == 0, f"{who} still has deadlines"
            assert core.next_deadline() is None, f"{who} still has a deadline"
            if isinstance(core, SenderCore):
                assert core._parked == {}, f"{who} still has parked requests {core._parked}"
                assert core._parked_count == 0
                assert core._draining == {}, f"{who} still holds ABORTs {core._draining}"
                assert core._preaborted == {}, f"{who} still remembers pre-aborted rooms {core._preaborted}"
            elif core.ring is not None:
                ring = core.ring
                assert (ring.used, ring.queued, ring.live_grants(), ring.owners()) == (0, 0, [], set()), \
                    f"{who} ring not empty: used {ring.used}, queued {ring.queued}, live {ring.live_grants()}"
        assert self.region_errors == []

    def assert_safe_ends(self) -> None:
        """No decode room ended (other than by its drain deadline) while a write into it
        was in flight or a scatter of it ran."""
        assert self.unsafe_ends == [], f"decode rooms ended with writes in flight: {self.unsafe_ends}"

    def assert_no_early_success(self) -> None:
        """No room succeeded before its writes did: decode after every tag it was sent landed,
        prefill after every write it posted was DONE (rooms of one incarnation only)."""
        for (side, rank, room), seen in self.seen_at_end.items():
            if side == "D":
                need = {(rank, o.tag) for p in range(self.p_tp) for o in self.posted(p, rank, room)}
            else:
                need = {(rank, o.link[1], o.tag) for o in self.posts[rank] if o.room_id == room}
            assert need <= seen, f"{side}{rank} room {room} succeeded before {sorted(need - seen)}"

    def posted(self, p: int, d: int, room: int) -> list[PostWrite | PostAux | PostStaged]:
        return [o for o in self.posts[p] if o.room_id == room and o.link == ("decode", d)]

    def ranges(self, p: int, d: int, room: int) -> list[tuple[int, int]]:
        """Token ranges of the KV writes (direct or staged) of ``p`` into ``d`` for ``room``."""
        return [(o.start_token, o.end_token) for o in self.posted(p, d, room)
                if isinstance(o, (PostWrite, PostStaged))]

    def staged_ranges(self, p: int, d: int, room: int) -> list[tuple[int, int]]:
        return [(o.start_token, o.end_token) for o in self.posted(p, d, room) if isinstance(o, PostStaged)]

    def messages(self, kind: str, cls: type[Message] | None = None, room: int | None = None) -> list[
            tuple[int, int, Message]]:
        """Every message sent so far in direction ``kind`` (delivered or not)."""
        return [(p, d, m) for k, p, d, m in self.sent
                if k == kind and (cls is None or isinstance(m, cls)) and (room is None or m.room_id == room)]

    def requests(self, room: int) -> dict[tuple[int, int], TransferRequest]:
        return {(p, d): m for p, d, m in self.messages(TO_PREFILL, TransferRequest, room)}  # type: ignore[misc]

    def total(self, stat: str) -> int:
        return sum(getattr(core.stats, stat) for _, core in self.cores())


@pytest.fixture(scope="session")
def make_net() -> Callable[..., Net]:
    """Build a ``Net`` (session-scoped factory: safe inside Hypothesis tests)."""
    return Net


@pytest.fixture
def net() -> Net:
    """A 1:1 pair (prefill TP 1, decode TP 1, block 16, 64 pages each, 4 aux slots), ready."""
    return Net()
