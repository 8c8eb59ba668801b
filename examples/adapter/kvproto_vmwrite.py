"""kvproto-vmwrite: a complete kvproto transport adapter in one file, for processes on one Linux host.

Theory of operation
-------------------
Bytes move with ``process_vm_writev(2)``: the initiator writes straight into the target
process's memory, given its pid and addresses (same user, or root; no shared mapping needed).
Tags move as datagrams on an abstract Unix socket that every agent binds. ``metadata()`` is a
JSON document: agent name, pid, socket name and a snapshot of the registered regions, against
which remote rows are checked before anything is posted.

A posted write is only queued (PENDING). Its first ``poll`` re-checks the local rows against
the live registrations, copies with one syscall per 1024 rows, then queues its tag; the write
is DONE once its tag has been handed to the socket (a full peer queue just leaves it PENDING
until a later call). So a tag never overtakes its bytes, and tags to one peer leave in the
order they were queued. A copy that faults (the peer unmapped the memory, or exited) polls as
ERROR. Rows are never merged: every row is one descriptor. Nothing here sleeps, retries or
blocks; every call is made by the agent's one owner.

Registered with kvproto under the name ``vmwrite`` by this package's entry point:
``kvproto.transport.load_transport("vmwrite", "agent-name")``.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvproto.transport import (
    MemKind,
    MemoryRegion,
    Notification,
    TransportClosed,
    TransportError,
    TransportStats,
    XferState,
)
from kvproto.transport.base import (
    BAD_METADATA,
    PreparedRows,
    check_pairs,
    check_rows,
    merge_regions,
    region_index,
    sorted_regions,
    take_rows,
)

_FORMAT = "kvproto-vmwrite/1"
_IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                    ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


@dataclass(eq=False)
class _Peer:
    name: str
    pid: int
    sock: bytes
    regions: np.ndarray
    """(N, 2) rows of (address, length), sorted."""
    gone: str = ""
    """Why lists prepared for this snapshot no longer work ("" while it is current)."""


@dataclass(eq=False)
class VmXfer:
    peer: _Peer
    local: np.ndarray
    remote: np.ndarray
    tag: bytes
    state: XferState = XferState.PENDING
    copied: bool = False
    released: bool = False
    error: str | None = None


@dataclass(eq=False)
class VmRegistration:
    regions: list[tuple[int, int]] = field(default_factory=list)


class VmWriteTransport:
    """A ``kvproto.transport.Transport`` over ``process_vm_writev`` and Unix datagrams."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = TransportStats()
        self._sock_name = b"\0kvproto-vmwrite/" + os.urandom(8).hex().encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._sock_name)
        self._sock.setblocking(False)
        self._registrations: list[VmRegistration] = []
        self._peers: dict[str, _Peer] = {}
        self._outbox: deque[tuple[_Peer, bytes, VmXfer | None]] = deque()
        self._closed = False

    # --- memory ----------------------------------------------------------------------------
    def memory_kinds(self) -> frozenset[MemKind]:
        self._check_open()
        return frozenset({MemKind.DRAM})

    def register(self, regions: Sequence[MemoryRegion]) -> VmRegistration:
        self._check_open()
        if any(r.kind is not MemKind.DRAM or r.device_id != 0 or r.length <= 0 for r in regions):
            raise TransportError("vmwrite registers DRAM of device 0 with a positive length only")
        # regions that overlap (a hybrid cache's groups overlaying one buffer) as their union
        reg = VmRegistration([(r.address, r.length) for r in merge_regions(regions)])
        self._registrations.append(reg)
        return reg

    def deregister(self, registration: VmRegistration) -> None:
        self._check_open()
        if registration not in self._registrations:
            raise TransportError("deregister: registration is not registered with this agent")
        self._registrations.remove(registration)

    def _regions(self) -> np.ndarray:
        return sorted_regions([r for reg in self._registrations for r in reg.regions])

    # --- peers ----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        self._check_open()
        doc = {"format": _FORMAT, "agent": self.name, "pid": os.getpid(),
               "sock": self._sock_name.hex(), "regions": self._regions().tolist()}
        return json.dumps(doc).encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        try:
            doc = json.loads(metadata)
            if doc["format"] != _FORMAT:
                raise ValueError(f"format {doc['format']!r}")
            peer = _Peer(str(doc["agent"]), int(doc["pid"]), bytes.fromhex(doc["sock"]),
                         sorted_regions([(int(a), int(n)) for a, n in doc["regions"]]))
        except BAD_METADATA as e:
            raise TransportError(f"add_peer: not vmwrite metadata ({e})") from e
        if peer.name == self.name:
            raise TransportError(f"add_peer: {peer.name!r} is this agent itself")
        if old := self._peers.get(peer.name):
            old.gone = f"peer {peer.name!r} was reloaded by add_peer"
        self._peers[peer.name] = peer
        return peer.name

    def remove_peer(self, peer: str) -> None:
        self._peer(peer).gone = f"peer {peer!r} was removed"
        del self._peers[peer]

    def _peer(self, name: str) -> _Peer:
        self._check_open()
        try:
            return self._peers[name]
        except KeyError:
            raise TransportError(f"unknown peer {name!r}") from None

    # --- descriptor lists -----------------------------------------------------------------
    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> PreparedRows:
        self._check_open()
        target = None if peer is None else self._peer(peer)
        arr = self._checked(rows, kind, target)
        if len(arr) == 0:
            raise TransportError("prepare: a descriptor list needs at least one row")
        return PreparedRows(arr, target)

    def release_prepared(self, dlist: PreparedRows) -> None:
        self._check_open()
        dlist.released = True

    def _checked(self, rows: np.ndarray, kind: MemKind, peer: _Peer | None) -> np.ndarray:
        if peer is None:
            return check_rows(rows, kind, self._regions(), "this agent's")
        return check_rows(rows, kind, peer.regions, f"peer {peer.name!r}'s")

    # --- writes ---------------------------------------------------------------------------
    def post_prepared(self, peer: str, local: PreparedRows, local_idx: np.ndarray, remote: PreparedRows,
                      remote_idx: np.ndarray, tag: bytes) -> VmXfer:
        target = self._peer(peer)
        lrows = take_rows(local.usable(None), local_idx, "local")
        rrows = take_rows(remote.usable(target), remote_idx, "remote")
        return self._post(target, lrows, rrows, tag)

    def post_descs(self, peer: str, local_rows: np.ndarray, local_kind: MemKind,
                   remote_rows: np.ndarray, remote_kind: MemKind, tag: bytes) -> VmXfer:
        target = self._peer(peer)
        return self._post(target, self._checked(local_rows, local_kind, None),
                          self._checked(remote_rows, remote_kind, target), tag)

    def _post(self, peer: _Peer, local: np.ndarray, remote: np.ndarray, tag: bytes) -> VmXfer:
        nbytes = check_pairs(local, remote)
        self.stats.writes += 1
        self.stats.bytes += nbytes
        self.stats.descriptors += len(local)
        return VmXfer(peer, local, remote, bytes(tag))

    def poll(self, xfer: VmXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("write handle was released")
        if xfer.state is XferState.PENDING and not xfer.copied:
            xfer.copied = True
            self._copy(xfer)
        self._flush()
        return xfer.state

    def _copy(self, xfer: VmXfer) -> None:
        if (region_index(xfer.local, self._regions()) < 0).any():
            return self._fail(xfer, "its local memory is no longer registered")
        if xfer.peer.gone:
            return self._fail(xfer, xfer.peer.gone)
        for s in range(0, len(xfer.local), _IOV_MAX):
            liov = np.ascontiguousarray(xfer.local[s:s + _IOV_MAX, :2], dtype=np.uint64)
            riov = np.ascontiguousarray(xfer.remote[s:s + _IOV_MAX, :2], dtype=np.uint64)
            want = int(liov[:, 1].sum())
            got = _libc.process_vm_writev(xfer.peer.pid, liov.ctypes.data, len(liov),
                                          riov.ctypes.data, len(riov), 0)
            if got != want:
                err = os.strerror(ctypes.get_errno()) if got < 0 else f"{got} of {want} bytes"
                return self._fail(xfer, f"process_vm_writev into pid {xfer.peer.pid}: {err}")
        if xfer.tag:
            self._outbox.append((xfer.peer, self.name.encode() + b"\0" + xfer.tag, xfer))
        else:
            xfer.state = XferState.DONE

    def _fail(self, xfer: VmXfer, why: str) -> None:
        xfer.state, xfer.error = XferState.ERROR, why

    def release(self, xfer: VmXfer) -> None:
        self._check_open()
        if xfer.state is XferState.PENDING and not xfer.peer.gone and not xfer.released:
            raise TransportError("release: the write is pending and its peer is still present")
        xfer.released = True

    # --- tags -----------------------------------------------------------------------------
    def notify(self, peer: str, tag: bytes) -> None:
        target = self._peer(peer)
        if not tag:
            raise TransportError("notify: empty tag")
        self._outbox.append((target, self.name.encode() + b"\0" + bytes(tag), None))
        self._flush()

    def _flush(self) -> None:
        while self._outbox:
            peer, payload, xfer = self._outbox[0]
            try:
                self._sock.sendto(payload, peer.sock)
            except BlockingIOError:
                return  # the peer's queue is full: try again in a later call
            except OSError as e:
                if xfer is not None:
                    self._fail(xfer, f"tag to {peer.name!r} not delivered: {e}")
            else:
                if xfer is not None:
                    xfer.state = XferState.DONE
            self._outbox.popleft()

    def drain_notifications(self) -> list[Notification]:
        self._check_open()
        self._flush()
        got = []
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return got
            name, _, tag = data.partition(b"\0")
            got.append(Notification(name.decode(), tag))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
            self._peers.clear()
            self._outbox.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"vmwrite agent {self.name!r} is closed")
