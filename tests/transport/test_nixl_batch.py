"""Writes of one pass share a transfer: the NIXL adapter's batches, on real NIXL (CPU memory).

A peer that reads notification lists (``batch_writes``) gets the ``post_prepared`` writes of one
pass as one NIXL transfer whose notification lists their tags; its adapter hands the tags on one
by one. These tests move real bytes between two agents over loopback and check each write's bytes,
its tag, its state, what a failure touches, and the cases that must not batch.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvproto.transport import MemKind, MemoryRegion, TransportError, XferState, available_transports
from kvproto.transport.base import pack_tags, unpack_tags

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")]
DRAM = MemKind.DRAM
PAGE = 256
PAGES = 64


class _Pair:
    """Agent ``a`` writes pages of ``src`` into pages of ``dst`` (agent ``b``); optionally a second
    target ``c`` with its own ``dst2``."""

    def __init__(self, batch: bool, third: bool = False) -> None:
        from kvproto.transport.nixl import NixlTransport

        self.a, self.b = NixlTransport("a"), NixlTransport("b")
        rng = np.random.default_rng(7)
        self.src = rng.integers(1, 255, PAGES * PAGE, dtype=np.uint8)
        self.dst = np.zeros(PAGES * PAGE, dtype=np.uint8)
        self.a.register([MemoryRegion(self.src.ctypes.data, self.src.nbytes)])
        self.b.register([MemoryRegion(self.dst.ctypes.data, self.dst.nbytes)])
        self.a.add_peer(self.b.metadata())
        self.b.add_peer(self.a.metadata())
        self.local = self.a.prepare(None, self._rows(self.src), DRAM)
        self.remote = self.a.prepare("b", self._rows(self.dst), DRAM)
        self.c = None
        if third:
            self.c = NixlTransport("c")
            self.dst2 = np.zeros(PAGES * PAGE, dtype=np.uint8)
            self.c.register([MemoryRegion(self.dst2.ctypes.data, self.dst2.nbytes)])
            self.a.add_peer(self.c.metadata())
            self.c.add_peer(self.a.metadata())
            self.remote2 = self.a.prepare("c", self._rows(self.dst2), DRAM)
        if batch:
            self.a.batch_writes("b")
            if third:
                self.a.batch_writes("c")

    @staticmethod
    def _rows(buf: np.ndarray) -> np.ndarray:
        return np.array([(buf.ctypes.data + i * PAGE, PAGE, 0) for i in range(PAGES)], dtype=np.int64)

    def post(self, src_pages: list[int], dst_pages: list[int], tag: bytes, peer: str = "b"):  # noqa: ANN201
        remote = self.remote if peer == "b" else self.remote2
        return self.a.post_prepared(peer, self.local, np.array(src_pages), remote, np.array(dst_pages), tag)

    def finish(self, xfers: list, targets: tuple = ()) -> tuple[list[XferState], list]:  # noqa: ANN001
        """Poll every write to an end (draining the targets), release each; the states and the
        notifications the targets received."""
        targets = targets or (self.b,)
        notes: list = []
        deadline = time.monotonic() + 10
        states = [XferState.PENDING] * len(xfers)
        while XferState.PENDING in states and time.monotonic() < deadline:
            states = [self.a.poll(x) for x in xfers]
            for t in targets:
                notes += t.drain_notifications()
        end = time.monotonic() + 0.5  # tags sent with the last poll
        while time.monotonic() < end:
            for t in targets:
                notes += t.drain_notifications()
            if len(notes) >= len(xfers):
                break
        for x in xfers:
            self.a.release(x)
        return states, notes

    def close(self) -> None:
        for t in (self.a, self.b, self.c):
            if t is not None:
                t.close()


def _page(buf: np.ndarray, i: int) -> np.ndarray:
    return buf[i * PAGE:(i + 1) * PAGE]


def test_nixl_batch_writes_of_one_pass_move_as_one_transfer_with_every_tag() -> None:
    """Ten writes posted in one pass wait (nothing moves, no transfer) until the pass ends, then go
    as one transfer; each lands byte-exact, polls DONE, and its tag arrives alone, in order."""
    p = _Pair(batch=True)
    try:
        rng = np.random.default_rng(1)
        src, dst = rng.permutation(PAGES)[:20], rng.permutation(PAGES)[:20]
        xfers = [p.post([int(src[2 * i]), int(src[2 * i + 1])], [int(dst[2 * i]), int(dst[2 * i + 1])],
                        b"tag-%02d" % i) for i in range(10)]
        assert p.a.transfers == 0 and not p.dst.any(), "a write of a batching peer waits for its pass"
        assert p.a.stats.writes == 10 and p.a.stats.bytes == 20 * PAGE
        states, notes = p.finish(xfers)
        assert states == [XferState.DONE] * 10
        assert p.a.transfers == 1
        assert [(n.peer, n.tag) for n in notes] == [("a", b"tag-%02d" % i) for i in range(10)]
        for s, d in zip(src, dst):
            assert np.array_equal(_page(p.dst, int(d)), _page(p.src, int(s)))
        untouched = sorted(set(range(PAGES)) - {int(d) for d in dst})
        assert not any(_page(p.dst, i).any() for i in untouched)
    finally:
        p.close()


def test_nixl_batch_bounds_and_lists_split_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer holds at most BATCH writes and BATCH_BYTES; writes to another peer, or over other
    lists, go in transfers of their own; every write still lands and tags."""
    from kvproto.transport.nixl import NixlTransport

    monkeypatch.setattr(NixlTransport, "BATCH", 4)
    p = _Pair(batch=True, third=True)
    try:
        xfers = [p.post([i], [i], b"b%d" % i) for i in range(10)]  # 4 + 4 + 2
        xfers += [p.post([20 + i], [30 + i], b"c%d" % i, peer="c") for i in range(3)]  # 1 transfer
        other = p.a.prepare("b", p._rows(p.dst)[::-1].copy(), DRAM)  # the same pages listed backwards
        xfers.append(p.a.post_prepared("b", p.local, np.array([40]), other, np.array([PAGES - 1 - 50]), b"rev"))
        states, notes = p.finish(xfers, (p.b, p.c))
        assert states == [XferState.DONE] * len(xfers)
        assert p.a.transfers == 3 + 1 + 1
        assert sorted(n.tag for n in notes) == sorted([b"b%d" % i for i in range(10)] + [b"c%d" % i for i in range(3)]
                                                      + [b"rev"])
        for i in range(10):
            assert np.array_equal(_page(p.dst, i), _page(p.src, i))
        for i in range(3):
            assert np.array_equal(_page(p.dst2, 30 + i), _page(p.src, 20 + i))
        assert np.array_equal(_page(p.dst, 50), _page(p.src, 40))
    finally:
        p.close()


def test_nixl_batch_only_for_a_peer_that_reads_lists() -> None:
    """Without ``batch_writes`` every write is a transfer of its own, posted at once."""
    p = _Pair(batch=False)
    try:
        xfers = [p.post([i], [i], b"t%d" % i) for i in range(5)]
        assert p.a.transfers == 5
        states, notes = p.finish(xfers)
        assert states == [XferState.DONE] * 5 and sorted(n.tag for n in notes) == [b"t%d" % i for i in range(5)]
    finally:
        p.close()


def test_nixl_batch_a_refused_transfer_fails_its_writes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched transfer that NIXL refuses fails each write it carries (they poll ERROR with the
    cause, nothing raises at the caller); the writes of another peer's transfer land."""
    p = _Pair(batch=True, third=True)
    try:
        bad = [p.post([i], [i], b"b%d" % i) for i in range(3)]
        good = [p.post([i], [i], b"c%d" % i, peer="c") for i in range(3)]
        real = p.a._agent.make_prepped_xfer

        def refuse(op, local, li, remote, ri, notif, backends):  # noqa: ANN001, ANN202
            if remote is p.remote.handle:
                raise RuntimeError("NIXL_ERR_BACKEND (injected)")
            return real(op, local, li, remote, ri, notif, backends)

        monkeypatch.setattr(p.a._agent, "make_prepped_xfer", refuse)
        states, notes = p.finish(bad + good, (p.b, p.c))
        assert states == [XferState.ERROR] * 3 + [XferState.DONE] * 3
        assert all("NIXL_ERR_BACKEND (injected)" in x.error for x in bad)
        assert sorted(n.tag for n in notes) == [b"c0", b"c1", b"c2"]
        assert not p.dst.any()
        assert all(np.array_equal(_page(p.dst2, i), _page(p.src, i)) for i in range(3))
    finally:
        p.close()


def test_nixl_batch_a_peer_removed_before_the_pass_ends_fails_its_waiting_writes() -> None:
    """Writes still waiting when their peer is removed never post: they poll ERROR naming why and
    release; a waiting write cannot be released while its peer is present."""
    p = _Pair(batch=True)
    try:
        xfers = [p.post([i], [i], b"t%d" % i) for i in range(3)]
        with pytest.raises(TransportError, match="still pending"):
            p.a.release(xfers[0])
        p.a.remove_peer("b")
        assert [p.a.poll(x) for x in xfers] == [XferState.ERROR] * 3
        assert all("not posted: peer 'b' was removed" in x.error for x in xfers)
        for x in xfers:
            p.a.release(x)
        assert p.a.transfers == 0 and not p.dst.any()
    finally:
        p.close()


def test_nixl_batch_empty_tags_and_large_writes_post_at_once() -> None:
    """A write with no tag (no notification to list) or above BATCH_BYTES posts at once, alone."""
    from kvproto.transport.nixl import NixlTransport

    p = _Pair(batch=True)
    try:
        p.a.BATCH_BYTES = 2 * PAGE  # this agent only
        xfers = [p.post([0], [0], b""), p.post([1, 2, 3], [1, 2, 3], b"big")]
        assert p.a.transfers == 2
        states, notes = p.finish(xfers)
        assert states == [XferState.DONE] * 2 and [n.tag for n in notes] == [b"big"]
        assert NixlTransport.BATCH_BYTES > 2 * PAGE
    finally:
        p.close()


def test_nixl_batch_a_list_that_is_not_well_formed_is_handed_on_whole() -> None:
    """The target hands on a notification that begins as a list but is not one as it came (the
    endpoint drops it as a malformed tag); a well-formed list sent by ``notify`` comes out as its tags."""
    p = _Pair(batch=False)
    try:
        good = pack_tags([b"x" * 24, b"y" * 24])
        bad = good + b"\x00"
        assert unpack_tags(bad) is None
        p.a.notify("b", bad)
        p.a.notify("b", good)
        notes: list = []
        deadline = time.monotonic() + 10
        while len(notes) < 3 and time.monotonic() < deadline:
            p.a.drain_notifications()  # carries the first notify's handshake
            notes += p.b.drain_notifications()
        assert [n.tag for n in notes] == [bad, b"x" * 24, b"y" * 24]
    finally:
        p.close()


def test_pack_tags_bounds() -> None:
    """A list holds 2 to 65535 tags of 1 to 65535 bytes; unpacking gives them back."""
    with pytest.raises(TransportError, match="2 to 65535 tags"):
        pack_tags([b"one"])
    with pytest.raises(TransportError, match="1 to 65535 bytes"):
        pack_tags([b"a", b""])
    tags = [bytes([i % 256]) * (i + 1) for i in range(300)]
    assert unpack_tags(pack_tags(tags)) == tags
