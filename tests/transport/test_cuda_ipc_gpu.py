"""The kernel path on a GPU, between processes: CUDA IPC mappings, one kernel per write, bounds,
and what happens when the process whose memory is mapped dies (``kill -9``) under the kernels."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvproto.testing.conformance import TransportConformance
from kvproto.transport import MemKind, MemoryRegion, TransportError, XferState, available_transports, load_transport
from kvproto.transport.base import route_of

VRAM = MemKind.VRAM
PAGE = 32768
PEER_GPUS = [0, 1] if torch.cuda.device_count() >= 2 else [0]
"""Where the peer process's memory is: this process's GPU, and the other GPU where there are two
(mapped through CUDA IPC with peer access: NVLink or PCIe)."""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nixl,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable"),
]


class TestCudaIpcOverNixl(TransportConformance):
    """The public suite, unchanged (DRAM: every call goes through the NIXL fallback)."""

    transport = "cuda-ipc"


def _target(conn: Any, nbytes: int, gpu: int) -> None:
    """A process that owns ``nbytes`` of VRAM on ``cuda:gpu`` registered with a cuda-ipc agent; it
    answers ``digest`` (the buffer's bytes as int64 sums per page), forwards tags, and exits on
    ``exit``."""
    torch.cuda.set_device(gpu)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    agent = load_transport("cuda-ipc", f"target-{os.getpid()}")
    agent.register([MemoryRegion(buf.data_ptr(), nbytes, gpu, VRAM)])
    conn.send((agent.metadata(), buf.data_ptr()))
    while True:
        for note in agent.drain_notifications():
            conn.send(("tag", note.tag))
        if conn.poll(0.0005):
            cmd = conn.recv()
            if cmd == "exit":
                agent.close()
                conn.send(("bye", None))
                return
            if cmd == "digest":
                torch.cuda.synchronize()
                conn.send(("digest", buf.view(-1, PAGE).to(torch.int64).sum(1).cpu().numpy()))


def _spawn(nbytes: int, gpu: int = 0) -> tuple[Any, Any, bytes, int]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, nbytes, gpu), daemon=True)
    proc.start()
    meta, address = parent.recv()
    return proc, parent, meta, address


def _until(conn: Any, kind: str, timeout: float = 30.0, agent: Any = None) -> Any:
    """The next ``kind`` message from the target; ``agent`` is driven meanwhile (a first notify's
    handshake advances only inside its sender's calls)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent is not None:
            agent.drain_notifications()
        if conn.poll(0.001):
            what, value = conn.recv()
            if what == kind:
                return value
    raise TimeoutError(f"no {kind} from the target")


def _source(pages: int) -> tuple[torch.Tensor, Any]:
    src = torch.randint(0, 256, (pages * PAGE,), dtype=torch.uint8, device="cuda")
    agent = load_transport("cuda-ipc", f"init-{os.getpid()}-{time.monotonic_ns()}")
    agent.register([MemoryRegion(src.data_ptr(), src.numel(), 0, VRAM)])
    return src, agent


def _drive(agent: Any, xfers: list[Any], timeout: float = 30.0) -> list[XferState]:
    states: dict[int, XferState] = {}
    deadline = time.monotonic() + timeout
    while len(states) < len(xfers) and time.monotonic() < deadline:
        for i, x in enumerate(xfers):
            if i not in states:
                state = agent.poll(x)
                if state is not XferState.PENDING:
                    states[i] = state
        agent.drain_notifications()
    return [states.get(i, XferState.PENDING) for i in range(len(xfers))]


@pytest.mark.parametrize("peer_gpu", PEER_GPUS, ids=lambda g: f"peer-cuda{g}")
def test_cuda_ipc_gpu_pattern_write_into_another_process_lands_byte_exact(peer_gpu: int) -> None:
    """The peer in another process (on this GPU, or on the other one) is mapped (route "kernel"),
    and the agent's lane and upload ring are made then, before any write; one pattern write of
    random pages lands byte-exact in its memory and its tag arrives after the bytes; while it runs,
    the agent offers its kernel's event (``completion_event``), which a thread can wait for; a
    write past its region is refused before launch."""
    pages = 64
    proc, conn, meta, remote = _spawn(pages * PAGE, peer_gpu)
    src, agent = _source(pages)
    try:
        assert agent._lane is None
        peer = agent.add_peer(meta)
        assert route_of(agent, peer).name == "kernel"
        lane = agent._lane  # made when the peer was mapped, so that no first write pays for it
        assert lane is not None and agent._uploads._mirror is not None
        rng = np.random.default_rng(0)
        src_pages, dst_pages = rng.permutation(pages)[:40], rng.permutation(pages)[:40]
        extents = np.stack([src_pages * PAGE, dst_pages * PAGE, np.full(40, PAGE)], 1).astype(np.int64)
        xfer = agent.post_pattern(peer, [src.data_ptr()], VRAM, [remote], VRAM, extents, b"done")
        event = agent.completion_event()  # the kernel's event, while it is all the write waits for
        assert event is not None and event is xfer.event
        waiter = threading.Thread(target=event.synchronize)  # what an endpoint's waiting thread does
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive()
        assert _drive(agent, [xfer]) == [XferState.DONE]
        assert agent.completion_event() is None  # nothing in flight
        assert agent._lane is lane
        assert _until(conn, "tag", agent=agent) == b"done"
        conn.send("digest")
        digest = _until(conn, "digest")
        want = np.zeros(pages, dtype=np.int64)
        sums = src.view(-1, PAGE).to(torch.int64).sum(1).cpu().numpy()
        want[dst_pages] = sums[src_pages]
        assert np.array_equal(digest, want)
        bad = extents.copy()
        bad[0, 1] = pages * PAGE - PAGE // 2
        with pytest.raises(TransportError, match="not inside"):
            agent.post_pattern(peer, [src.data_ptr()], VRAM, [remote], VRAM, bad, b"x")
        agent.remove_peer(peer)
        conn.send("exit")
        _until(conn, "bye")
    finally:
        agent.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("peer_gpu", PEER_GPUS, ids=lambda g: f"peer-cuda{g}")
def test_cuda_ipc_gpu_peer_killed_under_kernels_leaves_this_context_healthy(peer_gpu: int) -> None:
    """kill -9 of the process whose memory is mapped, with kernels queued into it: every write
    still ends (its memory stays alive while mapped here), remove_peer unmaps, this process's CUDA
    context keeps working, and a new peer is mapped and written byte-exact."""
    pages = 4096  # 128 MiB
    proc, conn, meta, remote = _spawn(pages * PAGE, peer_gpu)
    src, agent = _source(pages)
    try:
        peer = agent.add_peer(meta)
        extents = np.array([[0, 0, pages * PAGE]], dtype=np.int64)
        xfers = [agent.post_pattern(peer, [src.data_ptr()], VRAM, [remote], VRAM, extents, b"") for _ in range(40)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        states = _drive(agent, xfers)
        print(f"writes after the kill: {[s.name for s in states].count('DONE')} DONE, "
              f"{[s.name for s in states].count('ERROR')} ERROR")
        assert XferState.PENDING not in states
        agent.remove_peer(peer)
        a = torch.randn(1 << 20, device="cuda")
        assert torch.allclose((a * 2).sum(), a.sum() * 2, rtol=1e-4)
        torch.cuda.synchronize()
        proc2, conn2, meta2, remote2 = _spawn(64 * PAGE, peer_gpu)
        try:
            peer2 = agent.add_peer(meta2)
            one = np.array([[PAGE, 0, 64 * PAGE - PAGE]], dtype=np.int64)
            assert _drive(agent, [agent.post_pattern(peer2, [src.data_ptr()], VRAM, [remote2], VRAM, one,
                                                     b"again")]) == [XferState.DONE]
            assert _until(conn2, "tag", agent=agent) == b"again"
            conn2.send("digest")
            digest = _until(conn2, "digest")
            sums = src.view(-1, PAGE).to(torch.int64).sum(1).cpu().numpy()
            assert np.array_equal(digest[:63], sums[1:64]) and digest[63] == 0
            conn2.send("exit")
            _until(conn2, "bye")
        finally:
            proc2.join(10)
            if proc2.is_alive():
                proc2.kill()
    finally:
        agent.close()
        if proc.is_alive():
            proc.kill()
