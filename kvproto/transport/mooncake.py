"""The Mooncake adapter: Mooncake's Transfer Engine moves the bytes, a ZMQ socket the tags.

Theory of operation
-------------------
Each agent owns one ``mooncake.engine.TransferEngine`` started with the P2P handshake (no
metadata server) over ``protocol`` (``tcp`` by default: it runs on any host; ``rdma`` where
Mooncake finds RDMA devices). Its session id, ``host:rpc_port``, is what a peer writes to, so
``host`` must be an address the peer can reach (the engine listens on every interface).
Mooncake has no bare notification from Python (only blocking transfers that carry one), so
every agent also binds a ZMQ PULL socket on ``host`` and connects a PUSH socket to each peer;
tags go there as ``[agent name, tag]``. ``metadata()`` is a JSON document: agent name, session
id, tag address and a snapshot of the registered regions.

A write is its rows merged into runs (consecutive rows of equal length, contiguous on both
sides and inside one registered region on each side), each submitted with
``transfer_submit_write``. At most ``WINDOW`` runs per peer are in flight (Mooncake's TCP lane
refuses more than 1,024 queued transfers per peer by default): the rest wait in this adapter
and go, in posting order, as earlier runs complete. ``poll`` checks every run of the write
still in flight with the non-blocking ``transfer_check_status``, and once all have completed
queues the write's tag, so a tag never overtakes its bytes. Mooncake frees a run's batch id
when it reports it completed or failed, and checking a freed id crashes the process, so a run
is never checked again after that; runs of a released write or a closed agent are not checked at all (their ids
stay allocated, bounded by the writes abandoned to a dead peer). Tags to one peer leave in the
order they were queued; a full queue leaves a write PENDING until a later call. Every row is
checked here against this agent's registrations and the peer's snapshot before anything is
submitted: Mooncake's TCP transport would read unregistered local memory without complaint.
Those checks, the registrations, peers and prepared lists are the adapter kit's
(``kvproto.transport.kit``: ``RowsAdapter``), and so is the order in which tags leave (``OwnTags``).

``close`` destroys the engine, which takes Mooncake about a second (holding the GIL: a thread
would not hide it); an engine with runs still in flight is kept until the process exits instead.

One Mooncake behaviour shapes the use: the first write to a peer opens its segment with a
handshake inside ``transfer_submit_write`` (one round trip, blocking the caller; up to
Mooncake's 60 s against a peer that accepts and never answers).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvproto.transport.base import MemoryRegion, Notification, TransportError, XferState, check_pairs, region_index
from kvproto.transport.kit import OwnTags, Peer, RegionList, RowsAdapter

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
from mooncake.engine import TransferEngine  # noqa: E402  (reads the settings above)

WINDOW = 512
"""Most runs in flight to one peer."""
_LINGERING: list[Any] = []
"""Engines closed with runs in flight: kept alive until the process exits."""


@dataclass(eq=False)
class _Peer(Peer):
    session: str
    tags: str
    push: zmq.Socket
    inflight: int = 0
    """Runs submitted to this peer and not yet seen to end."""


@dataclass(eq=False)
class MooncakeXfer:
    peer: _Peer
    todo: deque[tuple[int, int, int]]
    """Runs not yet submitted: (local address, remote address, length)."""
    tag: bytes
    runs: list[int] = field(default_factory=list)
    """Batch ids in flight."""
    state: XferState = XferState.PENDING
    error: str | None = None
    queued: bool = False
    """Every run completed and the tag waits in the outbox."""
    released: bool = False


class MooncakeTransport(OwnTags, RowsAdapter):
    """A ``Transport`` over Mooncake's Transfer Engine (P2P handshake), tags over ZMQ."""

    KIND = "Mooncake"
    FORMAT = "kvproto-mooncake/1"

    def __init__(self, name: str, *, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        super().__init__(name)
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise TransportError(f"create agent: Mooncake could not start a {protocol} engine on {host!r}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self._tags = f"tcp://{host}:{port}"
        self._outbox: deque[tuple[_Peer, bytes, MooncakeXfer | None]] = deque()
        """Tags waiting to leave, in order (``OwnTags``)."""
        self._inflight: dict[MooncakeXfer, None] = {}
        """Writes not yet ended (an ordered set)."""
        self._waiting: deque[MooncakeXfer] = deque()
        """Writes with runs not yet submitted, in posting order."""

    # --- memory: registered with the engine too ------------------------------------------------
    def _register(self, regions: list[MemoryRegion]) -> RegionList:
        reg = RegionList()
        for r in regions:
            if self._engine.register_memory(r.address, r.length, "*") != 0:
                self._deregister(reg)
                raise TransportError(f"register: Mooncake refused {r.length} bytes at {r.address:#x}")
            reg.regions.append((r.address, r.length))
        return reg

    def _deregister(self, reg: RegionList) -> None:
        for address, _ in reg.regions:
            self._engine.unregister_memory(address)

    # --- peers: the engine's session and the tag socket ------------------------------------------
    def _metadata_fields(self) -> dict[str, Any]:
        return {"session": self._session, "tags": self._tags}

    def _peer_of(self, name: str, regions: np.ndarray, doc: dict[str, Any]) -> _Peer:
        session, tags = str(doc["session"]), str(doc["tags"])
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 1 << 17)
        try:
            push.connect(tags)
        except zmq.ZMQError as e:
            push.close()
            raise TransportError(f"add_peer: bad tag address {tags!r} ({e})") from e
        return _Peer(name, regions, session, tags, push)

    def _drop(self, peer: _Peer, why: str) -> None:  # type: ignore[override]
        super()._drop(peer, why)
        peer.push.close()
        for xfer in [x for x in self._waiting if x.peer is peer]:
            xfer.error = why  # its unsubmitted runs never go; it polls ERROR once the others end
            xfer.todo.clear()
            self._waiting.remove(xfer)
        kept: deque[tuple[_Peer, bytes, MooncakeXfer | None]] = deque()
        for entry in self._outbox:
            if entry[0] is peer:
                if entry[2] is not None:
                    entry[2].error = why
                    self._end(entry[2], XferState.ERROR)
            else:
                kept.append(entry)
        self._outbox = kept

    # --- writes ---------------------------------------------------------------------------
    def _post(self, peer: _Peer, local: np.ndarray, remote: np.ndarray, tag: bytes) -> MooncakeXfer:
        nbytes = check_pairs(local, remote)
        todo = deque((int(local[s, 0]), int(remote[s, 0]), int(local[s:e, 1].sum()))
                     for s, e in self._runs(local, remote, peer))
        xfer = MooncakeXfer(peer, todo, bytes(tag))
        self._count(len(todo), nbytes)
        self._inflight[xfer] = None
        self._waiting.append(xfer)
        self._submit()
        return xfer

    def _submit(self) -> None:
        """Submit waiting runs, oldest write first, while their peer's window has room."""
        for xfer in list(self._waiting):
            peer = xfer.peer
            if peer.inflight >= WINDOW:
                continue
            while xfer.todo and peer.inflight < WINDOW and xfer.error is None:
                local, remote, length = xfer.todo.popleft()
                batch = self._engine.transfer_submit_write(peer.session, local, remote, length)
                if batch == 0:  # runs already in flight finish first; then the write polls ERROR
                    xfer.error = f"Mooncake refused a write of {length} bytes to {peer.name!r} ({peer.session})"
                    xfer.todo.clear()
                    break
                xfer.runs.append(batch)
                peer.inflight += 1
            if not xfer.todo:
                self._waiting.remove(xfer)

    def _runs(self, local: np.ndarray, remote: np.ndarray, peer: _Peer) -> list[tuple[int, int]]:
        """[start, end) row ranges that go as one submission each."""
        n = len(local)
        if n == 1:
            return [(0, 1)]
        lreg = region_index(local, self._regions())
        rreg = region_index(remote, peer.regions)
        joins = ((local[1:, 0] == local[:-1, 0] + local[:-1, 1]) & (remote[1:, 0] == remote[:-1, 0] + remote[:-1, 1])
                 & (local[1:, 1] == local[:-1, 1]) & (lreg[1:] == lreg[:-1]) & (rreg[1:] == rreg[:-1]))
        starts = [0, *(np.flatnonzero(~joins) + 1).tolist()]
        return list(zip(starts, [*starts[1:], n], strict=True))

    def poll(self, xfer: MooncakeXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("poll: the write was released")
        if xfer.state is XferState.PENDING:
            self._advance(xfer)
        self._flush()
        return xfer.state

    def _advance(self, xfer: MooncakeXfer) -> None:
        still = []
        for batch in xfer.runs:
            status = self._engine.transfer_check_status(batch)
            if status == 0:
                still.append(batch)
                continue
            xfer.peer.inflight -= 1
            if status < 0 and xfer.error is None:  # -1: failed (id freed); -2: timed out (abandoned)
                what = "timed out" if status == -2 else "failed"
                xfer.error = f"a Mooncake write to {xfer.peer.name!r} ({xfer.peer.session}) {what}"
                if xfer.todo:
                    xfer.todo.clear()
                    self._waiting.remove(xfer)
        xfer.runs = still
        self._submit()
        if xfer.runs or xfer.todo or xfer.queued:
            return
        if xfer.error is None and xfer.peer.gone:
            xfer.error = xfer.peer.gone  # its bytes landed, but the tag has nobody to go to
        if xfer.error is not None:
            self._end(xfer, XferState.ERROR)
        elif xfer.tag:
            xfer.queued = True
            self._queue_tag(xfer.peer, xfer.tag, xfer)
        else:
            self._end(xfer, XferState.DONE)

    def _end(self, xfer: MooncakeXfer, state: XferState) -> None:
        xfer.state = state
        self._forget(xfer)

    def _forget(self, xfer: MooncakeXfer) -> None:
        self._inflight.pop(xfer, None)
        if xfer.todo:
            xfer.todo.clear()
            self._waiting.remove(xfer)

    def release(self, xfer: MooncakeXfer) -> None:
        self._check_open()
        self._check_release(xfer, xfer.peer.name, not xfer.peer.gone)
        xfer.released = True
        self._forget(xfer)

    # --- tags -----------------------------------------------------------------------------------
    def _send_tag(self, peer: _Peer, tag: bytes) -> bool:
        try:
            peer.push.send_multipart([self.name.encode(), tag], zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _tag_left(self, xfer: MooncakeXfer, error: str | None) -> None:
        if xfer.state is XferState.PENDING:
            self._end(xfer, XferState.DONE)

    def _receive_tags(self) -> list[Notification]:
        got = []
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            if len(frames) == 2:
                got.append(Notification(frames[0].decode(errors="replace"), frames[1]))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for reg in self._registrations:
            self._deregister(reg)
        self._registrations.clear()
        for peer in list(self._peers.values()):
            self._drop(peer, "the agent was closed")
        self._outbox.clear()
        self._pull.close()
        self._ctx.term()
        engine, self._engine = self._engine, None
        if any(x.runs for x in self._inflight):
            _LINGERING.append(engine)  # never destroy an engine under its own transfers
        self._inflight.clear()
        self._waiting.clear()
        del engine  # Mooncake's destructor runs here: about a second, holding the GIL
