"""The transport conformance suite: what every adapter must do, as tests an adapter runs on itself.

Theory of operation
-------------------
kvproto's protocol is written once, over the ``Transport`` interface; an adapter only moves
bytes (``kvproto.transport.base`` states the contract). This suite is that contract in
executable form. Every built-in adapter runs exactly this class, and a third-party adapter
runs it with a few lines of pytest::

    # test_my_adapter.py
    from kvproto.testing.conformance import TransportConformance

    class TestMyAdapter(TransportConformance):
        transport = "my-adapter"          # a name load_transport() finds (entry point)

or, for an adapter not registered under a name, override ``make(agent_name)``.

Each test makes two agents in this process, "a" and "b", registers real DRAM (numpy arrays)
and has "a" write into "b". Progress is driven the way an endpoint's progress task drives it:
the initiator polls every write to DONE and both agents drain notifications, under a deadline
so that a broken adapter fails a test instead of hanging it.

What an adapter must guarantee, and what it need not (each point is a test below):

- bytes: every byte of a write lands exactly where its rows say, and no other byte changes;
- tags: a write's tag reaches the target once, and only after all its bytes are visible; an
  empty tag sends nothing; ``notify`` tags from one agent arrive in the order they were sent;
  two writes with the same tag deliver it twice (tags are never de-duplicated); tags of
  writes in flight at once may arrive in any order (need not: completion order);
- merging: consecutive indices over contiguous memory may become fewer descriptors (need
  not: merging is an optimisation; rows are never merged across a length change);
- errors: bad rows, out-of-range indices, unknown peers, unequal lengths and garbage
  metadata raise ``TransportError`` naming the cause, and write nothing;
- metadata: a snapshot; a reload invalidates lists prepared from the old one;
- release and close: handles release idempotently; a pending write is released only once
  its peer is gone; after ``close`` every call raises ``TransportClosed``;
- registration: regions of one call may overlap, nest or repeat: rows anywhere in their union
  land;
- deregistration: deregistered memory cannot be prepared; memory deregistered under a
  pending write ends that write (DONE or ERROR, never PENDING for ever), and the adapter
  keeps working; so does a peer removed under a pending write (its tag goes nowhere).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest

from kvproto.transport import (
    DescList,
    MemKind,
    MemoryRegion,
    Notification,
    Transport,
    TransportClosed,
    TransportError,
    Xfer,
    XferState,
    load_transport,
)

__all__ = ["BLOCK", "NBLOCKS", "Pair", "TransportConformance", "block_rows", "complete", "pattern", "region"]

BLOCK = 256
NBLOCKS = 16
DEADLINE_S = 10.0
DRAM = MemKind.DRAM


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    """Bytes that differ between any two 256-byte blocks (the period is 251)."""
    period = ((np.arange(251) * 7 + seed) % 251).astype(np.uint8)
    return np.tile(period, nbytes // 251 + 1)[:nbytes].copy()


def region(buf: np.ndarray) -> MemoryRegion:
    return MemoryRegion(address=buf.ctypes.data, length=buf.nbytes)


def block_rows(buf: np.ndarray, blocks: list[int] | range, size: int = BLOCK) -> np.ndarray:
    """Descriptor rows for the given blocks of ``buf``."""
    return np.array([(buf.ctypes.data + b * size, size, 0) for b in blocks], dtype=np.int64)


@dataclass
class Pair:
    """Agent "a" (initiator) knows agent "b" (target); a's source and b's destination are
    registered, and each holds NBLOCKS blocks."""

    a: Transport
    b: Transport
    src: np.ndarray
    dst: np.ndarray
    keep: list[np.ndarray] = field(default_factory=list)
    """Further buffers a test registered; kept alive until the agents close."""

    def buffer(self, owner: Transport, nbytes: int, fill: np.ndarray | None = None) -> np.ndarray:
        buf = np.zeros(nbytes, dtype=np.uint8) if fill is None else fill
        owner.register([region(buf)])
        self.keep.append(buf)
        return buf

    def local_list(self) -> DescList:
        return self.a.prepare(None, block_rows(self.src, range(NBLOCKS)), DRAM)

    def remote_list(self) -> DescList:
        return self.a.prepare("b", block_rows(self.dst, range(NBLOCKS)), DRAM)

    def write_whole(self, src: np.ndarray, dst: np.ndarray, tag: bytes) -> Xfer:
        """Post one write of all of ``src`` over all of ``dst``."""
        n = src.nbytes
        return self.a.post_descs(
            "b", block_rows(src, [0], n), DRAM, block_rows(dst, [0], n), DRAM, tag
        )


def complete(
    p: Pair,
    xfers: Sequence[Xfer],
    tags: Sequence[bytes] = (),
    on_tag: Callable[[Notification], None] | None = None,
) -> list[Notification]:
    """Poll ``xfers`` to DONE and drain b until every tag in ``tags`` arrived; returns what b
    drained. ``on_tag`` sees each notification the moment it is drained."""
    got: list[Notification] = []
    pending = list(xfers)
    deadline = time.monotonic() + DEADLINE_S
    while pending or not _all_seen(tags, got):
        for x in list(pending):
            state = p.a.poll(x)
            assert state is not XferState.ERROR, f"write failed: {getattr(x, 'error', None)}"
            if state is XferState.DONE:
                pending.remove(x)
        for n in p.b.drain_notifications():
            if on_tag is not None:
                on_tag(n)
            got.append(n)
        assert p.a.drain_notifications() == []
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} writes pending, tags drained so far: {got}")
    return got


def _all_seen(tags: Sequence[bytes], got: list[Notification]) -> bool:
    seen = [n.tag for n in got]
    return all(seen.count(t) >= tags.count(t) for t in tags)


def quiet(p: Pair, rounds: int = 50) -> list[Notification]:
    """Drive both agents for a while; returns anything b drained meanwhile."""
    got = []
    for _ in range(rounds):
        got += p.b.drain_notifications()
        p.a.drain_notifications()
        time.sleep(0.0005)
    return got




class TransportConformance:
    """The suite. Subclass it as ``Test<Something>`` and set ``transport`` (or override ``make``)."""

    transport: ClassVar[str] = ""
    """Name of the adapter under test, as ``load_transport`` knows it."""
    options: ClassVar[dict[str, object]] = {}
    """Options passed to the adapter's constructor."""

    def make(self, agent_name: str) -> Transport:
        """A new agent of the adapter under test called ``agent_name``."""
        if not self.transport:
            raise NotImplementedError("set TransportConformance.transport or override make()")
        return load_transport(self.transport, agent_name, **self.options)

    @pytest.fixture
    def pair(self) -> Iterator[Pair]:
        a = self.make("a")
        try:
            b = self.make("b")
        except BaseException:
            a.close()
            raise
        p = Pair(a, b, pattern(NBLOCKS * BLOCK, seed=3), np.zeros(NBLOCKS * BLOCK, dtype=np.uint8))
        try:
            a.register([region(p.src)])
            b.register([region(p.dst)])
            assert a.add_peer(b.metadata()) == "b"
            yield p
        finally:
            try:
                a.close()
            finally:
                b.close()

    def test_transport_satisfies_protocol(self, pair: Pair) -> None:
        """Adapters are runtime instances of Transport, named, and register DRAM."""
        assert isinstance(pair.a, Transport)
        assert pair.a.name == "a"
        assert MemKind.DRAM in pair.a.memory_kinds()


    def test_add_peer_round_trips_metadata(self, pair: Pair) -> None:
        """Loading an agent's metadata returns its name, in both directions."""
        assert pair.b.add_peer(pair.a.metadata()) == "a"
        assert pair.a.add_peer(pair.b.metadata()) == "b"


    def test_add_peer_rejects_own_metadata(self, pair: Pair) -> None:
        """An agent cannot add itself as a peer."""
        with pytest.raises(TransportError):
            pair.a.add_peer(pair.a.metadata())


    def test_add_peer_rejects_garbage(self, pair: Pair) -> None:
        """Bytes that are not metadata raise TransportError."""
        with pytest.raises(TransportError):
            pair.a.add_peer(b"not metadata")

    def test_add_peer_rejects_hostile_metadata(self, pair: Pair) -> None:
        """Metadata that parses but is not what it claims (JSON ``Infinity`` where a number goes, a
        list where an object goes) raises TransportError, never another exception: a REGISTER
        carries it from a peer."""
        import json

        blobs = [b"[1, 2]", b"Infinity", b'{"format": Infinity}', b'{"regions": [[Infinity, 1, 0, 0]]}']
        try:
            doc = json.loads(pair.b.metadata())
        except ValueError:
            doc = None  # not JSON (an adapter's own format): the generic blobs only

        def infinite(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: infinite(v) for k, v in value.items()}
            if isinstance(value, list):
                return [infinite(v) for v in value]
            return float("inf") if isinstance(value, int) and not isinstance(value, bool) else value

        if isinstance(doc, dict):
            blobs.append(json.dumps(infinite(doc)).encode())
        for blob in blobs:
            with pytest.raises(TransportError):
                pair.a.add_peer(blob)


    def test_post_prepared_scattered_indices_land_exactly(self, pair: Pair) -> None:
        """A WRITE of scattered blocks lands byte-exact and leaves every other byte untouched."""
        local, remote = [5, 0, 9, 3, 15], [1, 14, 6, 11, 2]
        xfer = pair.a.post_prepared(
            "b", pair.local_list(), np.array(local), pair.remote_list(), np.array(remote), b"t"
        )
        complete(pair, [xfer], [b"t"])
        expected = np.zeros_like(pair.dst)
        for lb, rb in zip(local, remote, strict=True):
            expected[rb * BLOCK : (rb + 1) * BLOCK] = pair.src[lb * BLOCK : (lb + 1) * BLOCK]
        assert np.array_equal(pair.dst, expected)
        assert (pair.a.stats.writes, pair.a.stats.bytes) == (1, len(local) * BLOCK)


    def test_post_prepared_consecutive_indices_land_as_at_most_their_rows(self, pair: Pair) -> None:
        """Runs of consecutive indices land exactly; an adapter may merge a run over contiguous
        memory into fewer descriptors, never into fewer than its maximal runs."""
        local, remote = pair.local_list(), pair.remote_list()
        cases = [
            (list(range(2, 10)), list(range(4, 12)), 1),
            ([0, 1, 2, 5, 6], [8, 9, 10, 12, 13], 2),
            ([3, 2, 1], [3, 2, 1], 3),
        ]
        for li, ri, runs in cases:
            pair.dst[:] = 0
            before = pair.a.stats.descriptors
            xfer = pair.a.post_prepared("b", local, np.array(li), remote, np.array(ri), b"m")
            complete(pair, [xfer], [b"m"])
            assert runs <= pair.a.stats.descriptors - before <= len(li), (li, ri)
            for lb, rb in zip(li, ri, strict=True):
                assert np.array_equal(
                    pair.dst[rb * BLOCK : (rb + 1) * BLOCK], pair.src[lb * BLOCK : (lb + 1) * BLOCK]
                ), (li, ri)
            pair.a.release(xfer)
        assert pair.a.stats.writes == len(cases)

    def test_post_prepared_keeps_rows_of_unequal_length_apart(self, pair: Pair) -> None:
        """Contiguous rows of different lengths are never merged (NIXL 1.5 does not)."""
        s, d = pair.src.ctypes.data, pair.dst.ctypes.data
        spans = [(0, 100), (100, 300), (400, 50)]
        local = pair.a.prepare(None, np.array([(s + o, n, 0) for o, n in spans]), DRAM)
        remote = pair.a.prepare("b", np.array([(d + o, n, 0) for o, n in spans]), DRAM)
        xfer = pair.a.post_prepared("b", local, np.arange(3), remote, np.arange(3), b"v")
        complete(pair, [xfer], [b"v"])
        assert pair.a.stats.descriptors == 3
        assert np.array_equal(pair.dst[:450], pair.src[:450])
        assert not pair.dst[450:].any()


    def test_post_prepared_runs_across_adjacent_regions_land(self, pair: Pair) -> None:
        """Rows in two adjacent registered regions are written correctly."""
        src = pattern(2 * BLOCK, seed=9)
        pair.keep.append(src)
        halves = [MemoryRegion(src.ctypes.data + i * BLOCK, BLOCK) for i in range(2)]
        pair.a.register(halves)
        local = pair.a.prepare(None, block_rows(src, range(2)), DRAM)
        xfer = pair.a.post_prepared("b", local, np.arange(2), pair.remote_list(), np.arange(2), b"h")
        complete(pair, [xfer], [b"h"])
        assert np.array_equal(pair.dst[: 2 * BLOCK], src)
        assert 1 <= pair.a.stats.descriptors <= 2


    def test_register_overlapping_regions_reaches_their_union(self, pair: Pair) -> None:
        """Regions of one ``register`` call that overlap, nest or repeat (a hybrid cache's groups
        overlaying one buffer), on both sides: rows anywhere in their union land byte-exact, and the
        registrations deregister cleanly."""
        src = pattern(4 * BLOCK, seed=13)
        dst = np.zeros(4 * BLOCK, dtype=np.uint8)
        pair.keep += [src, dst]

        def overlaid(buf: np.ndarray) -> list[MemoryRegion]:
            at = buf.ctypes.data
            return [MemoryRegion(at, 3 * BLOCK), MemoryRegion(at + BLOCK, 3 * BLOCK),  # overlapping
                    MemoryRegion(at + BLOCK + 10, 100), MemoryRegion(at, 3 * BLOCK)]  # nested, repeated

        regs = pair.a.register(overlaid(src)), pair.b.register(overlaid(dst))
        pair.a.add_peer(pair.b.metadata())  # b's metadata now lists its new memory
        spans = [(BLOCK // 2, 3 * BLOCK), (BLOCK + 50, BLOCK), (3 * BLOCK - 10, 20), (0, 4 * BLOCK)]
        for k, (at, n) in enumerate(spans):
            dst[:] = 0
            rows = np.array([(src.ctypes.data + at, n, 0)], dtype=np.int64)
            xfer = pair.a.post_descs("b", rows, DRAM, np.array([(dst.ctypes.data + at, n, 0)], dtype=np.int64),
                                     DRAM, b"o%d" % k)
            complete(pair, [xfer], [b"o%d" % k])
            pair.a.release(xfer)
            assert np.array_equal(dst[at:at + n], src[at:at + n]), (at, n)
            assert not dst[:at].any() and not dst[at + n:].any(), (at, n)
        pair.a.deregister(regs[0])
        pair.b.deregister(regs[1])

    def test_post_descs_lands_exactly(self, pair: Pair) -> None:
        """One-off rows of varied lengths land byte-exact, unmerged, and nothing else changes."""
        s, d = pair.src.ctypes.data, pair.dst.ctypes.data
        pieces = [(7, 1000, 100), (2000, 50, 300), (4095, 0, 1)]
        xfer = pair.a.post_descs(
            "b",
            np.array([(s + so, n, 0) for so, _, n in pieces]),
            DRAM,
            np.array([(d + do, n, 0) for _, do, n in pieces]),
            DRAM,
            b"d",
        )
        complete(pair, [xfer], [b"d"])
        expected = np.zeros_like(pair.dst)
        for so, do, n in pieces:
            expected[do : do + n] = pair.src[so : so + n]
        assert np.array_equal(pair.dst, expected)
        assert (pair.a.stats.bytes, pair.a.stats.descriptors) == (401, len(pieces))


    def test_post_descs_unequal_lengths_raise(self, pair: Pair) -> None:
        """Pairing rows of different lengths, or different counts, raises and posts nothing."""
        s, d = pair.src.ctypes.data, pair.dst.ctypes.data
        with pytest.raises(TransportError, match="length"):
            pair.a.post_descs("b", np.array([(s, 10, 0)]), DRAM, np.array([(d, 20, 0)]), DRAM, b"x")
        with pytest.raises(TransportError, match="rows"):
            pair.a.post_descs("b", np.array([(s, 10, 0)] * 2), DRAM, np.array([(d, 10, 0)]), DRAM, b"x")
        assert pair.a.stats.writes == 0


    def test_write_tag_arrives_once_after_bytes(self, pair: Pair) -> None:
        """A write's tag is drained exactly once, and its bytes are visible when it is."""
        remote_block = pair.dst[7 * BLOCK : 8 * BLOCK]
        expected = pair.src[:BLOCK].copy()

        def bytes_visible(n: Notification) -> None:
            assert n == Notification("a", b"once")
            assert np.array_equal(remote_block, expected)

        xfer = pair.a.post_prepared(
            "b", pair.local_list(), np.array([0]), pair.remote_list(), np.array([7]), b"once"
        )
        got = complete(pair, [xfer], [b"once"], on_tag=bytes_visible)
        assert got == [Notification("a", b"once")]
        assert quiet(pair) == []


    def test_write_with_empty_tag_sends_no_notification(self, pair: Pair) -> None:
        """An empty tag moves the bytes and notifies nobody."""
        xfer = pair.a.post_prepared(
            "b", pair.local_list(), np.array([1]), pair.remote_list(), np.array([1]), b""
        )
        assert complete(pair, [xfer]) == []
        assert quiet(pair) == []
        assert np.array_equal(pair.dst[BLOCK : 2 * BLOCK], pair.src[BLOCK : 2 * BLOCK])


    def test_notify_delivers_tags_in_order_without_bytes(self, pair: Pair) -> None:
        """Bare tags arrive once each, in the order sent, and write no memory."""
        tags = [b"n%d" % i for i in range(10)]
        for tag in tags:
            pair.a.notify("b", tag)
        got = complete(pair, [], tags)
        assert got == [Notification("a", t) for t in tags]
        assert quiet(pair) == []
        assert not pair.dst.any()


    def test_notify_empty_tag_raises(self, pair: Pair) -> None:
        """A bare notification needs a tag."""
        with pytest.raises(TransportError, match="empty"):
            pair.a.notify("b", b"")


    def test_concurrent_writes_deliver_their_own_tags(self, pair: Pair) -> None:
        """Many writes in flight at once each land and each deliver their own tag once."""
        local, remote = pair.local_list(), pair.remote_list()
        order = np.random.default_rng(1).permutation(NBLOCKS)
        tags = [b"w%02d" % i for i in range(NBLOCKS)]
        xfers = [
            pair.a.post_prepared("b", local, np.array([i]), remote, np.array([order[i]]), tags[i])
            for i in range(NBLOCKS)
        ]
        got = complete(pair, xfers, tags)
        assert sorted(n.tag for n in got) == tags
        assert quiet(pair) == []
        for i in range(NBLOCKS):
            r = int(order[i])
            assert np.array_equal(
                pair.dst[r * BLOCK : (r + 1) * BLOCK], pair.src[i * BLOCK : (i + 1) * BLOCK]
            )


    def test_large_write_completes_while_target_drains(self, pair: Pair) -> None:
        """A 64 MiB write completes and lands exactly while the target keeps draining."""
        size = 64 << 20
        src = pair.buffer(pair.a, size, pattern(size, seed=11))
        dst = pair.buffer(pair.b, size)
        pair.a.add_peer(pair.b.metadata())
        complete(pair, [pair.write_whole(src, dst, b"big")], [b"big"])
        assert np.array_equal(src, dst)
        assert pair.a.stats.bytes == size


    def test_post_prepared_out_of_range_index_raises_and_writes_nothing(self, pair: Pair) -> None:
        """An index past either list, or negative, raises TransportError and writes nothing."""
        local, remote = pair.local_list(), pair.remote_list()
        bad = [
            ([0, NBLOCKS], [0, 1]),
            ([0, 1], [0, NBLOCKS]),
            ([-1], [0]),
            ([0, 1], [0]),
            ([], []),
        ]
        for li, ri in bad:
            with pytest.raises(TransportError):
                pair.a.post_prepared(
                    "b", local, np.array(li, dtype=np.int64), remote, np.array(ri, dtype=np.int64), b"x"
                )
        assert quiet(pair) == []
        assert not pair.dst.any()
        assert pair.a.stats.writes == 0


    def test_prepare_rows_outside_registered_memory_raise(self, pair: Pair) -> None:
        """Rows past registered memory, or on another device, cannot be prepared."""
        beyond = range(NBLOCKS - 1, NBLOCKS + 1)
        with pytest.raises(TransportError):
            pair.a.prepare(None, block_rows(pair.src, beyond), DRAM)
        with pytest.raises(TransportError):
            pair.a.prepare("b", block_rows(pair.dst, beyond), DRAM)
        with pytest.raises(TransportError):
            pair.a.prepare(None, np.array([(pair.src.ctypes.data, BLOCK, 1)]), DRAM)
        with pytest.raises(TransportError):
            pair.a.prepare(None, np.zeros((0, 3), dtype=np.int64), DRAM)


    def test_post_descs_rows_outside_registered_memory_raise_and_write_nothing(self, pair: Pair) -> None:
        """A one-off row outside the local or the peer's registered memory raises; nothing lands."""
        inside_src, inside_dst = block_rows(pair.src, [0]), block_rows(pair.dst, [0])
        outside_src = block_rows(pair.src, [NBLOCKS])
        outside_dst = block_rows(pair.dst, [NBLOCKS])
        for lrows, rrows in ((outside_src, inside_dst), (inside_src, outside_dst)):
            with pytest.raises(TransportError):
                pair.a.post_descs("b", lrows, DRAM, rrows, DRAM, b"x")
        assert quiet(pair) == []
        assert not pair.dst.any()


    def test_unknown_peer_raises(self, pair: Pair) -> None:
        """Every call that names a peer rejects one that was never added."""
        rows = block_rows(pair.dst, [0])
        local = pair.local_list()
        calls: list[Callable[[], object]] = [
            lambda: pair.a.prepare("zzz", rows, DRAM),
            lambda: pair.a.post_descs("zzz", block_rows(pair.src, [0]), DRAM, rows, DRAM, b"x"),
            lambda: pair.a.post_prepared("zzz", local, np.array([0]), local, np.array([0]), b"x"),
            lambda: pair.a.notify("zzz", b"x"),
            lambda: pair.a.remove_peer("zzz"),
        ]
        for call in calls:
            with pytest.raises(TransportError, match="zzz"):
                call()


    def test_remove_peer_invalidates_its_lists(self, pair: Pair) -> None:
        """After remove_peer, writes and tags to it raise; re-adding and re-preparing works."""
        local, remote = pair.local_list(), pair.remote_list()
        src_rows, dst_rows = block_rows(pair.src, [0]), block_rows(pair.dst, [0])
        pair.a.remove_peer("b")
        with pytest.raises(TransportError):
            pair.a.post_prepared("b", local, np.array([0]), remote, np.array([0]), b"x")
        with pytest.raises(TransportError):
            pair.a.post_descs("b", src_rows, DRAM, dst_rows, DRAM, b"x")
        with pytest.raises(TransportError):
            pair.a.notify("b", b"x")
        assert pair.a.add_peer(pair.b.metadata()) == "b"
        with pytest.raises(TransportError, match="removed"):
            pair.a.post_prepared("b", local, np.array([0]), remote, np.array([0]), b"x")
        xfer = pair.a.post_prepared("b", local, np.array([2]), pair.remote_list(), np.array([3]), b"ok")
        complete(pair, [xfer], [b"ok"])
        assert np.array_equal(pair.dst[3 * BLOCK : 4 * BLOCK], pair.src[2 * BLOCK : 3 * BLOCK])


    def test_add_peer_again_reaches_new_registrations(self, pair: Pair) -> None:
        """Memory the peer registers later is reachable only through fresh metadata, which also
        invalidates the lists prepared from the old metadata."""
        remote = pair.remote_list()
        extra = pair.buffer(pair.b, NBLOCKS * BLOCK)
        with pytest.raises(TransportError):
            pair.a.prepare("b", block_rows(extra, [0]), DRAM)
        pair.a.add_peer(pair.b.metadata())
        with pytest.raises(TransportError, match="reloaded"):
            pair.a.post_prepared("b", pair.local_list(), np.array([0]), remote, np.array([0]), b"x")
        extra_list = pair.a.prepare("b", block_rows(extra, range(NBLOCKS)), DRAM)
        local = pair.local_list()
        xfer = pair.a.post_prepared("b", local, np.array([4]), extra_list, np.array([5]), b"e")
        complete(pair, [xfer], [b"e"])
        assert np.array_equal(extra[5 * BLOCK : 6 * BLOCK], pair.src[4 * BLOCK : 5 * BLOCK])


    def test_release_frees_write_and_list_handles(self, pair: Pair) -> None:
        """A pending write cannot be released while its peer is present; finished writes and
        prepared lists release idempotently, and a released handle is unusable."""
        size = 4 << 20
        src = pair.buffer(pair.a, size, pattern(size))
        dst = pair.buffer(pair.b, size)
        pair.a.add_peer(pair.b.metadata())
        xfer = pair.write_whole(src, dst, b"r")
        with pytest.raises(TransportError, match="pending"):
            pair.a.release(xfer)
        complete(pair, [xfer], [b"r"])
        pair.a.release(xfer)
        pair.a.release(xfer)
        with pytest.raises(TransportError, match="released"):
            pair.a.poll(xfer)
        local = pair.local_list()
        pair.a.release_prepared(local)
        pair.a.release_prepared(local)
        with pytest.raises(TransportError, match="released"):
            pair.a.post_prepared("b", local, np.array([0]), pair.remote_list(), np.array([0]), b"x")


    def test_release_pending_write_allowed_once_peer_removed(self, pair: Pair) -> None:
        """Once its peer is removed, a write that never finished can be released."""
        size = 4 << 20
        src = pair.buffer(pair.a, size, pattern(size))
        dst = pair.buffer(pair.b, size)
        pair.a.add_peer(pair.b.metadata())
        xfer = pair.write_whole(src, dst, b"r")
        pair.a.remove_peer("b")
        pair.a.release(xfer)


    def test_deregister_makes_memory_unreachable(self, pair: Pair) -> None:
        """Deregistered memory cannot be prepared, and a registration deregisters only once."""
        buf = np.zeros(BLOCK, dtype=np.uint8)
        reg = pair.a.register([region(buf)])
        pair.a.prepare(None, block_rows(buf, [0]), DRAM)
        pair.a.deregister(reg)
        with pytest.raises(TransportError):
            pair.a.prepare(None, block_rows(buf, [0]), DRAM)
        with pytest.raises(TransportError):
            pair.a.deregister(reg)


    def test_close_is_idempotent_and_later_calls_raise_closed(self, pair: Pair) -> None:
        """close releases outstanding handles, can be repeated, and every later call raises
        TransportClosed."""
        local, remote = pair.local_list(), pair.remote_list()
        xfer = pair.a.post_prepared("b", local, np.array([0]), remote, np.array([0]), b"c")
        complete(pair, [xfer], [b"c"])
        pair.a.close()
        pair.a.close()
        rows = block_rows(pair.src, [0])
        calls: list[Callable[[], object]] = [
            pair.a.memory_kinds,
            lambda: pair.a.register([region(pair.src)]),
            pair.a.metadata,
            lambda: pair.a.add_peer(pair.b.metadata()),
            lambda: pair.a.remove_peer("b"),
            lambda: pair.a.prepare(None, rows, DRAM),
            lambda: pair.a.release_prepared(local),
            lambda: pair.a.post_prepared("b", local, np.array([0]), remote, np.array([0]), b"x"),
            lambda: pair.a.post_descs("b", rows, DRAM, block_rows(pair.dst, [0]), DRAM, b"x"),
            lambda: pair.a.poll(xfer),
            lambda: pair.a.release(xfer),
            lambda: pair.a.notify("b", b"x"),
            pair.a.drain_notifications,
        ]
        for call in calls:
            with pytest.raises(TransportClosed):
                call()

    def test_same_tag_on_two_writes_arrives_twice(self, pair: Pair) -> None:
        """Tags are not de-duplicated: two writes with one tag deliver it twice."""
        local, remote = pair.local_list(), pair.remote_list()
        xfers = [
            pair.a.post_prepared("b", local, np.array([i]), remote, np.array([i]), b"same")
            for i in range(2)
        ]
        got = complete(pair, xfers, [b"same", b"same"])
        assert got == [Notification("a", b"same")] * 2
        assert quiet(pair) == []

    def test_tags_reach_only_the_peer_written(self, pair: Pair) -> None:
        """A third agent that was written nothing drains nothing; the writer drains nothing."""
        c = self.make("c")
        try:
            buf = np.zeros(BLOCK, dtype=np.uint8)
            c.register([region(buf)])
            pair.a.add_peer(c.metadata())
            xfer = pair.a.post_prepared(
                "b", pair.local_list(), np.array([0]), pair.remote_list(), np.array([0]), b"only-b"
            )
            complete(pair, [xfer], [b"only-b"])
            for _ in range(20):
                assert c.drain_notifications() == []
                time.sleep(0.0005)
            assert not buf.any()
        finally:
            c.close()

    def test_deregister_under_pending_write_ends_the_write(self, pair: Pair) -> None:
        """Local memory deregistered while a write from it may be in flight: the write ends (DONE
        or ERROR, never PENDING for ever), or ``deregister`` refuses with TransportError; either
        way the adapter keeps working."""
        size = 16 << 20
        src = pattern(size, seed=21)
        pair.keep.append(src)
        reg = pair.a.register([region(src)])
        dst = pair.buffer(pair.b, size)
        pair.a.add_peer(pair.b.metadata())
        xfer = pair.write_whole(src, dst, b"gone")
        try:
            pair.a.deregister(reg)
        except TransportError:
            pass
        deadline = time.monotonic() + DEADLINE_S
        while (state := pair.a.poll(xfer)) is XferState.PENDING:
            pair.b.drain_notifications()
            assert time.monotonic() < deadline, "the write stayed PENDING after its memory was deregistered"
        assert state in (XferState.DONE, XferState.ERROR)
        xfer2 = pair.a.post_prepared(
            "b", pair.local_list(), np.array([1]), pair.remote_list(), np.array([2]), b"after"
        )
        complete(pair, [xfer2], [b"after"])
        assert np.array_equal(pair.dst[2 * BLOCK : 3 * BLOCK], pair.src[BLOCK : 2 * BLOCK])

    def test_metadata_is_bytes_and_names_the_agent(self, pair: Pair) -> None:
        """Metadata is bytes that any other agent of the adapter loads as this agent's name."""
        meta = pair.b.metadata()
        assert isinstance(meta, bytes) and meta
        c = self.make("c")
        try:
            assert c.add_peer(meta) == "b"
        finally:
            c.close()

    def test_remove_peer_under_pending_write_ends_the_write(self, pair: Pair) -> None:
        """A write whose peer is removed while it may be in flight still polls to an end (DONE
        or ERROR) without raising, can then be released, and the agent keeps working."""
        size = 16 << 20
        src = pair.buffer(pair.a, size, pattern(size, seed=23))
        dst = pair.buffer(pair.b, size)
        pair.a.add_peer(pair.b.metadata())
        xfer = pair.write_whole(src, dst, b"orphan")
        pair.a.remove_peer("b")
        deadline = time.monotonic() + DEADLINE_S
        while pair.a.poll(xfer) is XferState.PENDING:
            pair.b.drain_notifications()
            assert time.monotonic() < deadline, "the write stayed PENDING after its peer was removed"
        pair.a.release(xfer)
        pair.a.drain_notifications()
        assert pair.a.add_peer(pair.b.metadata()) == "b"
        xfer2 = pair.a.post_prepared(
            "b", pair.local_list(), np.array([3]), pair.remote_list(), np.array([4]), b"again"
        )
        complete(pair, [xfer2], [b"again"])
        assert np.array_equal(pair.dst[4 * BLOCK : 5 * BLOCK], pair.src[3 * BLOCK : 4 * BLOCK])
