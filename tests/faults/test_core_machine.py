"""A Hypothesis state machine over one sender core and one receiver core, with every fault.

Theory of operation
-------------------
``Pair`` wires a ``SenderCore`` (prefill rank) to a ``ReceiverCore`` (decode rank) over one
control link and one data-plane agent, as the endpoints do, and turns the cores' outputs into
*pending* items that only the machine's rules move:

* control messages (encoded now, decoded on delivery), per direction: deliver any one (so
  reordered), drop, duplicate;
* posted writes: perform (the bytes land, a tag and a DONE report become pending), fail (nothing
  lands, an ERROR report), fail after copy (bytes land, no tag, an ERROR report);
* tags: deliver any one, drop, duplicate; write reports: deliver any one;
* scatters of staged pieces: perform (``scatter_done``);
* the application: open rooms on either side (room ids are reused, so incarnations meet),
  give destinations and chunks, abort either side;
* time: small steps and 30 s jumps (``handle_timer`` on both cores);
* the link: drop it (both cores ``remove_link``: heartbeats said the peer is gone; its control
  messages die with the sockets, its writes may still run) and add a new one (a restarted peer).

A ``DropLink`` from the receiver is performed at once, as the endpoint does.

Invariants after every step: each side reports each incarnation of a room at most once; no
receiver room is reported FAILED while a write into it (its room id and generation) is posted
and not yet performed or failed, or a scatter of it runs, and no write lands in it after it
ended — unless its drain deadline forced the report, or the link that the write uses had been
dropped (the receiver trusts a dropped link to write no more); a receiver SUCCESS comes only
after every write posted for that incarnation landed (and was scattered) and the landed token
ranges cover the destination past its prefix; a sender SUCCESS only after every write it posted
was reported DONE. At teardown the machine settles everything (performs all writes, delivers
every pending item, and lets timers fire) and checks that every room ended and nothing is left.

Hypothesis favours the ends of an integer range, so rules that should act rarely (aborts, link
restarts) act on a value in the middle of theirs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvproto.core import (
    DropLink,
    PostAux,
    PostStaged,
    PostWrite,
    ReceiverCore,
    ReceiverLink,
    RoomEnded,
    RoomState,
    Scatter,
    Send,
    SenderCore,
    SenderLink,
    Timeouts,
)
from kvproto.core.staging import StagingRing
from kvproto.wire import MINOR, ErrorCode, RoomHold, decode, decode_tag, encode

BLOCK = 4
BLOCKS = 32
AUX = 2
UNIT = 64
"""Bytes per token of a staged piece."""
RING = 256
CLUSTER = "tcp://prefill:1"
INSTANCE = "decode-A"
ROOM_IDS = (1, 2, 3)
TIMEOUTS = Timeouts(bootstrap=10.0, waiting=10.0, transfer=10.0, parked=10.0, drain=3.0)

STATS: Counter[str] = Counter()
"""What the machine did across all examples (printed in the session summary)."""


def pages(n: int) -> int:
    return -(-n // BLOCK)


@dataclass(eq=False)
class Write:
    out: PostWrite | PostAux | PostStaged
    epoch: int
    room: int
    generation: int


@dataclass
class Incarnation:
    """One opening of a room id on one side."""

    room: int
    generation: int = 0
    """Receiver: the room's generation. Sender: unknown until a write is posted."""
    ended: RoomEnded | None = None
    tokens: int = 0
    prefix: int = 0
    posted: list[Write] = field(default_factory=list)
    reported_ok: set[int] = field(default_factory=set)
    """Sender: ids of its writes reported DONE."""


class Pair:
    def __init__(self, *, staged: bool, max_units: int, seed: int) -> None:
        self.staged = staged
        self.max_units = max_units
        self.now = 1000.0
        self.sender = SenderCore(block_size=BLOCK, num_blocks=BLOCKS, aux_slots=AUX, timeouts=TIMEOUTS)
        self.receiver = ReceiverCore(block_size=BLOCK, num_blocks=BLOCKS, aux_slots=AUX, timeouts=TIMEOUTS,
                                     seed=seed, staging=StagingRing(RING) if staged else None)
        self.epoch = 0
        self.link_up = False
        self.to_decode: list[tuple[int, bytes]] = []
        self.to_prefill: list[tuple[int, bytes]] = []
        self.writes: list[Write] = []
        self.tags: list[tuple[int, bytes]] = []
        self.reports: list[tuple[Write, bool]] = []
        self.scatters: list[Scatter] = []
        self.landed: set[int] = set()
        """ids of writes whose bytes landed."""
        self.covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
        """(room, generation) -> token ranges that landed in the destination pages."""
        self.s_live: dict[int, Incarnation] = {}
        self.r_live: dict[int, Incarnation] = {}
        self.s_ended: list[Incarnation] = []
        self.r_ended: list[Incarnation] = []
        self.tokens: dict[int, tuple[int, int]] = {}
        """room -> (tokens, prefix) both sides use for the id's current incarnations."""
        self.given: dict[int, int] = {}
        """Sender room -> end token of the chunks given so far."""
        self.violations: list[str] = []
        self.exempt: dict[tuple[int, int], frozenset[int] | None] = {}
        """Receiver incarnations ended FAILED -> the epochs (links) whose writes may still land: the
        links dropped by then, which the receiver trusts to write no more (None: any, the drain
        deadline forced the end)."""
        self.dropped: set[int] = set()
        """Epochs whose link was dropped."""
        self._forced: set[int] = set()
        self._dropping: int | None = None
        self.add_link()

    # --- links ----------------------------------------------------------------------------------
    def add_link(self) -> None:
        self.epoch += 1
        e = self.epoch
        self.sender.add_link(SenderLink(
            key=("decode", e), link_id=e, instance=INSTANCE, decode_rank=0, num_blocks=BLOCKS, block_size=BLOCK,
            aux_slots=AUX, paired_ranks=frozenset({0}), writer=True, aux_owner=True,
            stage_unit=UNIT if self.staged else 0, stage_capacity=RING if self.staged else 0,
            stage_max_units=self.max_units if self.staged else 0))
        self.receiver.cluster_pending(CLUSTER)
        self.receiver.cluster_ready(CLUSTER, [ReceiverLink(
            key=("prefill", e), link_id=e, cluster=CLUSTER, prefill_rank=0, agent=f"agent-{e}", writer=True,
            aux_owner=True, stage_unit=UNIT if self.staged else 0, minor=MINOR)], self.now)
        self.link_up = True
        self.pump()

    def drop_link(self, epoch: int | None = None) -> None:
        e = self.epoch if epoch is None else epoch
        if e != self.epoch or not self.link_up:
            return
        self.link_up = False
        self.dropped.add(e)
        self.to_decode = [m for m in self.to_decode if m[0] != e]
        self.to_prefill = [m for m in self.to_prefill if m[0] != e]
        outer, self._dropping = self._dropping, e
        try:
            self.receiver.remove_link(("prefill", e), self.now)
            self.sender.remove_link(("decode", e), self.now)
            self.pump()
        finally:
            self._dropping = outer

    # --- outputs --------------------------------------------------------------------------------
    def pump(self) -> None:
        while True:
            s_out, r_out = self.sender.pop_outputs(), self.receiver.pop_outputs()
            if not s_out and not r_out:
                return
            for out in s_out:
                self._sender_output(out)
            drops = []
            for out in r_out:
                if isinstance(out, DropLink):
                    drops.append(out)
                else:
                    self._receiver_output(out)
            for out in drops:
                STATS["drop_link_outputs"] += 1
                self.drop_link(out.link[1])

    def _sender_output(self, out: Any) -> None:
        if isinstance(out, Send):
            self.to_decode.append((out.link[1], encode(out.message)))
        elif isinstance(out, (PostWrite, PostAux, PostStaged)):
            tag = decode_tag(out.tag)
            w = Write(out, out.link[1], out.room_id, tag.generation)
            self.writes.append(w)
            inc = self.s_live.get(out.room_id)
            assert inc is not None, f"a write for room {out.room_id}, which the sender does not run"
            inc.posted.append(w)
            STATS["writes_posted"] += 1
        elif isinstance(out, RoomEnded):
            self._ended("S", out)
        else:  # pragma: no cover
            raise AssertionError(out)

    def _receiver_output(self, out: Any) -> None:
        if isinstance(out, Send):
            if isinstance(out.message, RoomHold):
                STATS["holds_sent"] += 1
            self.to_prefill.append((out.link[1], encode(out.message)))
        elif isinstance(out, Scatter):
            self.scatters.append(out)
        elif isinstance(out, RoomEnded):
            self._ended("R", out)
        else:  # pragma: no cover
            raise AssertionError(out)

    def _ended(self, side: str, out: RoomEnded) -> None:
        live = self.s_live if side == "S" else self.r_live
        inc = live.pop(out.room_id, None)
        if inc is None:
            self.violations.append(f"{side} reported room {out.room_id} without a live incarnation: {out}")
            return
        inc.ended = out
        (self.s_ended if side == "S" else self.r_ended).append(inc)
        STATS[f"{side}_{out.state.name}" + (f"_{getattr(out.code, 'name', out.code)}" if out.code else "")] += 1
        if side == "S":
            if out.state is RoomState.SUCCESS:
                missing = [w for w in inc.posted if id(w) not in inc.reported_ok]
                if missing:
                    self.violations.append(f"sender room {out.room_id} succeeded before writes {missing} were DONE")
            return
        key = (out.room_id, inc.generation)
        if out.state is RoomState.SUCCESS:
            posted = [w for w in self.all_posted() if (w.room, w.generation) == key]
            if any(id(w) not in self.landed for w in posted):
                self.violations.append(f"receiver room {key} succeeded before every posted write landed")
            if any(s.room_id == out.room_id for s in self.scatters):
                self.violations.append(f"receiver room {key} succeeded with a scatter running")
            want = set(range(inc.prefix, inc.tokens))
            got = {t for a, b in self.covered.get(key, []) for t in range(a, b)}
            if not want <= got:
                self.violations.append(f"receiver room {key} succeeded without tokens {sorted(want - got)}")
            return
        if out.room_id in self._forced:
            STATS["forced_ends"] += 1
            self.exempt[key] = None
            return
        if self._dropping is not None:
            STATS["dropped_link_ends"] += 1
        self.exempt[key] = frozenset(self.dropped)
        busy = [w for w in self.writes if (w.room, w.generation) == key and w.epoch not in self.dropped]
        busy += [s for s in self.scatters if s.room_id == out.room_id]
        if busy:
            self.violations.append(f"receiver room {key} reported FAILED ({out.code}) with {busy} in flight")

    def all_posted(self) -> list[Write]:
        return [w for inc in [*self.s_live.values(), *self.s_ended] for w in inc.posted]

    # --- application ------------------------------------------------------------------------
    def plan_tokens(self, room: int, tokens: int, prefix: int) -> tuple[int, int]:
        if room not in self.s_live and room not in self.r_live:
            self.tokens[room] = (tokens, min(prefix, (tokens - 1) // BLOCK) * BLOCK)
        return self.tokens[room]

    def open_sender(self, room: int, tokens: int, prefix: int) -> None:
        self.plan_tokens(room, tokens, prefix)
        self.s_live[room] = Incarnation(room)
        self.given[room] = 0
        self.sender.open_room(room, self.now)
        self.pump()

    def open_receiver(self, room: int, tokens: int, prefix: int, with_dest: bool) -> None:
        n, pre = self.plan_tokens(room, tokens, prefix)
        if self.receiver.cluster_status(CLUSTER) in ("unknown", "failed"):
            self.receiver.cluster_pending(CLUSTER)  # the endpoint starts a bootstrap first
        self.r_live[room] = inc = Incarnation(room)
        destination = None
        if with_dest:  # as DecodeEndpoint.open_room(pages=...): the room never waits for its destination
            inc.tokens, inc.prefix = n, pre
            destination = self.receiver.check_destination(self.dst_pages(room, n), n, prefix_tokens=pre,
                                                           aux_slot=room % AUX)
        core_room = self.receiver.open_room(room, CLUSTER, self.now, destination=destination)
        inc.generation = core_room.generation
        self.pump()

    @staticmethod
    def dst_pages(room: int, n: int) -> list[int]:
        return [(room * 9 + i) % BLOCKS for i in range(pages(n))]

    def set_destination(self, room: int) -> None:
        """A late destination: the room waited for it (WAITING_FOR_INPUT: holding its prefill room)."""
        n, pre = self.tokens[room]
        inc = self.r_live[room]
        inc.tokens, inc.prefix = n, pre
        self.receiver.set_destination(room, self.dst_pages(room, n), n, self.now, prefix_tokens=pre,
                                      aux_slot=room % AUX)
        self.pump()

    def chunk(self, room: int, step: int) -> None:
        n, _ = self.tokens[room]
        start = self.given[room]
        end = min(n, (start // BLOCK + step) * BLOCK)
        last = end >= n
        new = [(room * 7 + i) % BLOCKS for i in range(pages(start), pages(end))]
        self.given[room] = end
        self.sender.submit_chunk(room, new, end, self.now, last=last, aux_slot=room % AUX if last else None)
        self.pump()

    # --- data plane -------------------------------------------------------------------------
    def perform(self, w: Write, *, fail: bool = False, after_copy: bool = False) -> None:
        self.writes.remove(w)
        if not fail or after_copy:
            self.landed.add(id(w))
            ended = [inc.ended for inc in self.r_ended if (inc.room, inc.generation) == (w.room, w.generation)]
            key = (w.room, w.generation)
            exempt = self.exempt.get(key, frozenset())
            if ended and not (exempt is None or w.epoch in exempt):
                self.violations.append(f"write {w.out} landed in receiver room {key} after it ended: {ended}")
            if not isinstance(w.out, (PostStaged, PostAux)):
                self.covered.setdefault((w.room, w.generation), []).append((w.out.start_token, w.out.end_token))
        if not fail:
            self.tags.append((w.epoch, w.out.tag))
        self.reports.append((w, not fail))

    def deliver_tag(self, i: int, keep: bool = False) -> None:
        epoch, tag = self.tags[i] if keep else self.tags.pop(i)
        self.receiver.on_notification(f"agent-{epoch}", tag, self.now)
        self.pump()

    def deliver_report(self, i: int) -> None:
        w, ok = self.reports.pop(i)
        inc = self.s_live.get(w.room)
        if ok:
            if inc is not None and w in inc.posted:
                inc.reported_ok.add(id(w))
            self.sender.write_done(w.room, w.out.link, w.out.seq, 64, self.now, tag=w.out.tag)
        else:
            self.sender.write_failed(w.room, w.out.link, w.out.seq, "injected", self.now, tag=w.out.tag)
        self.pump()

    def scatter(self, i: int) -> None:
        s = self.scatters.pop(i)
        room = self.receiver.rooms.get(s.room_id)
        if room is not None:
            self.covered.setdefault((s.room_id, room.generation), []).append((s.start_token, s.end_token))
        self.receiver.scatter_done(s.room_id, s.link[1], s.seq, self.now)
        self.pump()

    # --- control plane --------------------------------------------------------------------------
    def deliver(self, direction: str, i: int, keep: bool = False) -> None:
        queue = self.to_decode if direction == "D" else self.to_prefill
        epoch, data = queue[i] if keep else queue.pop(i)
        if epoch != self.epoch or not self.link_up:
            return
        msg = decode(data)
        if direction == "D":
            self.receiver.on_message(("prefill", epoch), msg, self.now)
        else:
            self.sender.on_message(("decode", epoch), msg, self.now)
        self.pump()

    # --- time -----------------------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        self.now += dt
        self.sender.handle_timer(self.now)
        self.pump()
        self._forced = {r for r, room in self.receiver.rooms.items() if room.failing}
        try:
            self.receiver.handle_timer(self.now)
            self.pump()
        finally:
            self._forced = set()

    # --- settling -------------------------------------------------------------------------------
    def settle(self) -> None:
        """Perform and deliver everything pending, letting time pass, until no room is left."""
        for _ in range(200):
            while self.writes or self.tags or self.reports or self.scatters or self.to_decode or self.to_prefill:
                if self.writes:
                    self.perform(self.writes[0])
                elif self.scatters:
                    self.scatter(0)
                elif self.tags:
                    self.deliver_tag(0)
                elif self.reports:
                    self.deliver_report(0)
                elif self.to_decode:
                    self.deliver("D", 0)
                else:
                    self.deliver("P", 0)
            if not (self.sender.rooms or self.receiver.rooms or len(self.sender.timers) or len(self.receiver.timers)):
                return
            self.advance(10.0)
        raise AssertionError("the pair did not settle")


class CoreMachine(RuleBasedStateMachine):
    pair: Pair

    @initialize(staged=st.booleans(), max_units=st.sampled_from([0, 1, 3]), seed=st.integers(0, 1000))
    def start(self, staged: bool, max_units: int, seed: int) -> None:
        self.pair = Pair(staged=staged, max_units=max_units, seed=seed)
        STATS["machines"] += 1
        STATS["machines_staged"] += staged

    # --- application ------------------------------------------------------------------------
    @rule(side=st.sampled_from(["both", "S", "R"]), i=st.integers(0, 2), tokens=st.integers(1, 14),
          prefix=st.integers(0, 2), with_dest=st.booleans())
    def open(self, side: str, i: int, tokens: int, prefix: int, with_dest: bool) -> None:
        """Open a room on one side, or on both (the same id, decode first)."""
        p = self.pair
        sides = ["R", "S"] if side == "both" else [side]
        free = [r for r in ROOM_IDS if all(r not in (p.sender if x == "S" else p.receiver).rooms for x in sides)]
        if not free:
            return
        room = free[i % len(free)]
        for x in sides:
            if x == "S":
                p.open_sender(room, tokens, prefix)
            else:
                p.open_receiver(room, tokens, prefix, with_dest)
            STATS[f"open_{x}"] += 1

    @rule(i=st.integers(0, 2))
    def set_destination(self, i: int) -> None:
        rooms = [r for r, room in self.pair.receiver.rooms.items()
                 if room.destination is None and room.state is not RoomState.TRANSFERRING]
        if rooms:
            self.pair.set_destination(rooms[i % len(rooms)])

    @rule(i=st.integers(0, 2), step=st.integers(1, 4))
    def chunk(self, i: int, step: int) -> None:
        rooms = [r for r, room in self.pair.sender.rooms.items() if not room.last_given]
        if rooms:
            self.pair.chunk(rooms[i % len(rooms)], step)
            STATS["chunks"] += 1

    @rule(side=st.sampled_from("SR"), i=st.integers(0, 2), flip=st.integers(0, 4))  # acts on 2 only
    def abort(self, side: str, i: int, flip: int) -> None:
        core = self.pair.sender if side == "S" else self.pair.receiver
        rooms = sorted(core.rooms)
        if flip != 2 or not rooms:  # (Hypothesis favours the ends of a range)
            return
        STATS[f"abort_{side}"] += 1
        core.abort(rooms[i % len(rooms)], self.pair.now)
        self.pair.pump()

    # --- faults in flight -----------------------------------------------------------------------
    @rule(which=st.integers(0, 4), fate=st.sampled_from(["reorder", "drop", "duplicate", "fail", "fail_after_copy"]),
          i=st.integers(0, 7))
    def fault(self, which: int, fate: str, i: int) -> None:
        """One fault on a pending item: a control message (drop, duplicate, reorder), a write (fail,
        fail after copy, complete out of order), a tag (drop, duplicate, reorder), a write's report
        (out of order)."""
        p = self.pair
        queues: dict[str, list[Any]] = {"to_decode": p.to_decode, "to_prefill": p.to_prefill, "write": p.writes,
                                        "tag": p.tags, "report": p.reports}
        present = [name for name, q in queues.items() if q]
        if not present:
            return
        what = present[which % len(present)]
        queue = queues[what]
        fates = {"write": ("fail", "fail_after_copy", "reorder"), "report": ("reorder",)}.get(
            what, ("reorder", "drop", "duplicate"))
        if fate not in fates:
            fate = fates[0]
        i %= len(queue)
        kind = f"{what}:{fate}"
        STATS[f"fault_{kind}"] += 1
        if what in ("to_decode", "to_prefill"):
            if fate == "drop":
                queue.pop(i)
            else:
                p.deliver("D" if what == "to_decode" else "P", i, keep=fate == "duplicate")
        elif what == "write":
            p.perform(queue[i], fail=fate != "reorder", after_copy=fate == "fail_after_copy")
        elif what == "tag":
            if fate == "drop":
                queue.pop(i)
            else:
                p.deliver_tag(i, keep=fate == "duplicate")
        else:
            p.deliver_report(i)

    def _progress(self, n: int, which: int) -> None:
        p = self.pair
        for k in range(n):
            steps = [(q, f) for q, f in ((p.writes, lambda: p.perform(p.writes[0])),
                                          (p.scatters, lambda: p.scatter(0)),
                                          (p.tags, lambda: p.deliver_tag(0)),
                                          (p.reports, lambda: p.deliver_report(0)),
                                          (p.to_prefill, lambda: p.deliver("P", 0)),
                                          (p.to_decode, lambda: p.deliver("D", 0))) if q]
            if not steps:
                return
            steps[(which + k) % len(steps)][1]()
            STATS["progress_items"] += 1

    @rule(n=st.integers(1, 6), which=st.integers(0, 5))
    def progress(self, n: int, which: int) -> None:
        """Perform or deliver the oldest pending item of each kind in turn, without faults."""
        self._progress(n, which)

    @rule(n=st.integers(1, 6), which=st.integers(0, 5))
    def more_progress(self, n: int, which: int) -> None:
        """The same as ``progress`` (a second rule, so that progress is drawn as often as faults)."""
        self._progress(n, which)

    # --- time and links -------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.01, 0.1, 0.5, 2.0, 0.01, 0.1, 30.0, 2.0, 0.01, 0.1, 0.5, 2.0]))
    def advance(self, dt: float) -> None:
        """Let time pass: small steps, or a 30 s jump."""
        STATS["clock_jumps" if dt >= 30 else "clock_steps"] += 1
        self.pair.advance(dt)

    @rule(flip=st.integers(0, 9))
    def restart_link(self, flip: int) -> None:
        """Drop the link (both sides see the peer gone), or add a new one (the peer restarted)."""
        if flip != 4:
            return
        if self.pair.link_up:
            STATS["link_drops"] += 1
            self.pair.drop_link()
        else:
            STATS["link_adds"] += 1
            self.pair.add_link()

    # --- invariants -----------------------------------------------------------------------------
    @invariant()
    def no_violation(self) -> None:
        assert self.pair.violations == [], self.pair.violations

    @invariant()
    def live_rooms_match(self) -> None:
        p = self.pair
        assert set(p.sender.rooms) == set(p.s_live), (set(p.sender.rooms), set(p.s_live))
        assert set(p.receiver.rooms) == set(p.r_live), (set(p.receiver.rooms), set(p.r_live))
        for core in (p.sender, p.receiver):  # the per-state counts agree with the rooms
            counted = {state: n for state, n in core.live_states.items() if n}
            assert counted == dict(Counter(room.state for room in core.rooms.values())), counted

    def teardown(self) -> None:
        if not hasattr(self, "pair"):
            return
        p = self.pair
        p.settle()
        assert p.violations == [], p.violations
        assert p.s_live == {} and p.r_live == {}
        for name, core in (("sender", p.sender), ("receiver", p.receiver)):
            assert core.rooms == {}, f"{name} still has rooms"
            assert len(core.timers) == 0, f"{name} still has deadlines"
        assert p.sender._draining == {} and p.sender._parked == {} and p.sender._parked_count == 0
        assert p.sender._preaborted == {} and p.sender.remembered_holds() == 0
        ring = p.receiver.ring
        if ring is not None:
            assert (ring.used, ring.queued, ring.live_grants(), ring.owners()) == (0, 0, [], set())
        STATS["settled"] += 1


MACHINE_SETTINGS = settings(
    max_examples=1000, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_core_pair_keeps_invariants_under_random_faults() -> None:
    """Random programs of opens, chunks, aborts, lost/duplicated/reordered messages and tags, failed
    writes, clock jumps and link restarts keep every invariant of the module docstring."""
    run_state_machine_as_test(CoreMachine, settings=MACHINE_SETTINGS)


# --- regressions found by the machine (rule 9) ----------------------------------------------------
def _request_then_writes_in_flight() -> Pair:
    """Sender and receiver of room 1 (one token, aux slot): the request delivered, kept pending
    (as a duplicate would be), the write and the aux write posted and not yet performed."""
    p = Pair(staged=False, max_units=0, seed=0)
    p.open_sender(1, tokens=1, prefix=0)
    p.chunk(1, step=1)
    p.open_receiver(1, tokens=1, prefix=0, with_dest=True)
    p.deliver("P", 0, keep=True)
    assert p.writes
    return p


def test_sender_duplicate_request_abort_waits_for_writes_regression() -> None:
    """A duplicated TRANSFER_REQUEST is absorbed; it never makes the sender ABORT ahead of its writes
    (found by the machine: the sender answered the copy with an immediate ABORT, and the receiver,
    taking any ABORT as settled, reported FAILED while the writes could still land)."""
    p = _request_then_writes_in_flight()
    p.deliver("P", 0)  # the copy
    assert p.to_decode == [] and 1 in p.sender.rooms
    p.settle()
    assert p.violations == []
    assert [inc.ended.state for inc in p.r_ended if inc.ended] == [RoomState.SUCCESS]


def test_sender_conflicting_request_abort_waits_for_writes_regression() -> None:
    """A second, different TRANSFER_REQUEST from a peer with writes in flight fails the room, and the
    ABORT that tells the receiver waits until those writes are over."""
    p = _request_then_writes_in_flight()
    epoch, data = p.to_prefill.pop(0)
    p.to_prefill.append((epoch, encode(replace(decode(data), prefix_tokens=0, num_tokens=2))))
    p.deliver("P", 0)
    assert 1 not in p.sender.rooms and p.to_decode == [], "the ABORT waits for the writes in flight"
    while p.writes:
        p.perform(p.writes[0])
    while p.reports:
        p.deliver_report(0)
    p.settle()
    assert p.violations == []
    assert [inc.ended.code for inc in p.r_ended if inc.ended] == [ErrorCode.PEER_PROTOCOL_ERROR]


def test_sender_late_duplicate_request_after_timeout_waits_for_writes_regression() -> None:
    """A duplicated TRANSFER_REQUEST that reaches the sender after its room timed out with writes
    in flight is not answered at once: the room's held ABORT, sent when the writes are over, is the
    answer (found by the machine: the immediate answer let the draining receiver report FAILED
    while both writes could still land)."""
    p = Pair(staged=False, max_units=0, seed=0)
    p.open_receiver(1, tokens=1, prefix=0, with_dest=True)
    p.open_sender(1, tokens=1, prefix=0)
    p.chunk(1, step=1)
    p.deliver("P", 0, keep=True)  # the request arrives; its copy stays queued
    assert len(p.writes) == 2
    p.now += 30.0  # both rooms' transfer deadlines pass with the writes in flight
    p.sender.handle_timer(p.now)
    p.pump()
    p.receiver.handle_timer(p.now)
    p.pump()
    assert 1 not in p.sender.rooms and p.receiver.rooms[1].failing
    p.deliver("P", 0)  # the late copy
    assert p.to_decode == [], "the late copy was answered ahead of the writes"
    p.settle()
    assert p.violations == []


def test_sender_reopened_room_ignores_request_answered_by_old_incarnation_regression() -> None:
    """The sender aborts a room before the request arrives, answers the request with its ABORT, and
    the application opens the id again: a duplicate of that request must not bind the new
    incarnation (found by the machine: the new room accepted the copy and wrote, while the receiver,
    told by the ABORT that the writer had settled, reported FAILED with those writes in flight)."""
    p = Pair(staged=False, max_units=0, seed=0)
    p.open_receiver(1, tokens=1, prefix=0, with_dest=True)
    p.open_sender(1, tokens=1, prefix=0)
    p.sender.abort(1, p.now)
    p.pump()
    p.deliver("P", 0, keep=True)  # answered at once: the room ended before any request
    assert len(p.to_decode) == 1
    p.open_sender(1, tokens=1, prefix=0)
    p.chunk(1, step=1)
    p.deliver("P", 0)  # the copy reaches the new incarnation
    assert p.writes == [] and p.sender.stats.stale_tags == 1
    p.settle()
    assert p.violations == []
