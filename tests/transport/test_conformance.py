"""The built-in adapters run the public conformance suite (``kvproto.testing.conformance``)
unchanged; below it, tests of what only a particular adapter promises."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest

from kvproto.testing.conformance import (
    BLOCK,
    DEADLINE_S,
    NBLOCKS,
    Pair,
    TransportConformance,
    block_rows,
    complete,
    pattern,
    region,
)
from kvproto.transport import (
    MemKind,
    Notification,
    TransportError,
    XferState,
    available_transports,
    load_transport,
)
from kvproto.transport.loopback import LoopbackTransport

DRAM = MemKind.DRAM
_NO_NIXL = pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")


@pytest.mark.skipif("mooncake" not in available_transports(), reason="Mooncake's Transfer Engine is not importable")
class TestMooncake(TransportConformance):
    transport = "mooncake"


class _Merging:
    """Loopback and NIXL merge every maximal run of contiguous rows into one descriptor, and
    rows of different registrations never (the direct path's descriptor counts rely on it)."""

    def test_post_prepared_merges_every_maximal_run(self, pair: Pair) -> None:
        """Consecutive indices over contiguous memory become exactly one descriptor per run."""
        local, remote = pair.local_list(), pair.remote_list()
        cases = [
            (list(range(2, 10)), list(range(4, 12)), 1),
            ([0, 1, 2, 5, 6], [8, 9, 10, 12, 13], 2),
            ([3, 2, 1], [3, 2, 1], 3),
        ]
        for li, ri, runs in cases:
            before = pair.a.stats.descriptors
            xfer = pair.a.post_prepared("b", local, np.array(li), remote, np.array(ri), b"m")
            complete(pair, [xfer], [b"m"])
            assert pair.a.stats.descriptors - before == runs, (li, ri)

    def test_rows_of_adjacent_registrations_stay_apart(self, pair: Pair) -> None:
        """Two adjacent registered regions are written as two descriptors."""
        src = pattern(2 * BLOCK, seed=9)
        pair.keep.append(src)
        for i in range(2):
            pair.a.register([region(src[i * BLOCK : (i + 1) * BLOCK])])
        local = pair.a.prepare(None, block_rows(src, range(2)), DRAM)
        xfer = pair.a.post_prepared("b", local, np.arange(2), pair.remote_list(), np.arange(2), b"h")
        complete(pair, [xfer], [b"h"])
        assert pair.a.stats.descriptors == 2


class TestLoopback(_Merging, TransportConformance):
    transport = "loopback"


class TestSimulated(TransportConformance):
    transport = "simulated"


@pytest.mark.nixl
@_NO_NIXL
class TestNixl(_Merging, TransportConformance):
    transport = "nixl"


def test_loopback_write_into_deregistered_memory_polls_error() -> None:
    """A loopback write whose target memory went away before it ran fails and copies nothing."""
    a, b = LoopbackTransport("a"), LoopbackTransport("b")
    try:
        src, dst = pattern(BLOCK), np.zeros(BLOCK, dtype=np.uint8)
        a.register([region(src)])
        reg = b.register([region(dst)])
        a.add_peer(b.metadata())
        xfer = a.post_descs("b", block_rows(src, [0]), DRAM, block_rows(dst, [0]), DRAM, b"x")
        b.deregister(reg)
        assert a.poll(xfer) is XferState.ERROR
        assert xfer.error is not None and "no longer registered" in xfer.error
        assert b.drain_notifications() == []
        assert not dst.any()
    finally:
        a.close()
        b.close()


def test_loopback_duplicate_agent_name_raises() -> None:
    """Two live loopback agents cannot share a name; a closed one frees it."""
    a = LoopbackTransport("dup")
    with pytest.raises(TransportError, match="dup"):
        LoopbackTransport("dup")
    a.close()
    LoopbackTransport("dup").close()


def test_load_transport_unknown_name_raises() -> None:
    """Asking for an adapter that does not exist names the known ones."""
    with pytest.raises(TransportError, match="loopback"):
        load_transport("carrier-pigeon", "a")


def test_available_transports_lists_loopback() -> None:
    """The loopback adapter is always available."""
    assert "loopback" in available_transports()


def test_transport_package_import_skips_nixl() -> None:
    """Importing kvproto.transport does not import NIXL."""
    code = "import sys, kvproto.transport; assert 'nixl' not in sys.modules, 'nixl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _nixl_target(conn: Connection, nbytes: int) -> None:
    """Child process: owns agent b's memory, reports what arrived."""
    b = load_transport("nixl", "b")
    try:
        dst = np.zeros(nbytes, dtype=np.uint8)
        b.register([region(dst)])
        conn.send((b.metadata(), dst.ctypes.data))
        got: list[Notification] = []
        deadline = time.monotonic() + DEADLINE_S
        while not got and time.monotonic() < deadline:
            got = b.drain_notifications()
        conn.send((got, bool(np.array_equal(dst, pattern(nbytes, seed=5)))))
    finally:
        b.close()


@pytest.mark.nixl
@pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")
def test_nixl_write_reaches_another_process() -> None:
    """A write into memory owned by another process lands byte-exact with its tag."""
    nbytes = 4 << 20
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_nixl_target, args=(child_end, nbytes))
    child.start()
    a = load_transport("nixl", "a")
    try:
        assert parent_end.poll(DEADLINE_S * 3), "child sent no metadata"
        metadata, dst_addr = parent_end.recv()
        src = pattern(nbytes, seed=5)
        a.register([region(src)])
        assert a.add_peer(metadata) == "b"
        xfer = a.post_descs(
            "b", block_rows(src, [0], nbytes), DRAM, np.array([(dst_addr, nbytes, 0)]), DRAM, b"x1"
        )
        deadline = time.monotonic() + DEADLINE_S
        while a.poll(xfer) is XferState.PENDING:
            assert time.monotonic() < deadline, "write did not finish"
        assert a.poll(xfer) is XferState.DONE
        assert parent_end.poll(DEADLINE_S), "child did not report"
        got, landed = parent_end.recv()
        assert got == [Notification("a", b"x1")]
        assert landed
    finally:
        a.close()
        child.join(DEADLINE_S)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
