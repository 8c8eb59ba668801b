"""kvproto-vmwrite: a complete kvproto transport adapter in one file, for processes on one Linux host.

Theory of operation
-------------------
Bytes move with ``process_vm_writev(2)``: the initiator writes straight into the target
process's memory, given its pid and addresses (same user, or root; no shared mapping needed).
Tags move as datagrams on an abstract Unix socket that every agent binds. ``metadata()`` is a
JSON document: agent name, pid, socket name and a snapshot of the registered regions, against
which remote rows are checked before anything is posted.

Everything else is kvproto's adapter kit (``kvproto.transport.kit``): registrations, metadata,
peers, prepared lists and the checks the conformance suite asks for (``RowsAdapter``), and tags
sent in order once their write's bytes have landed (``OwnTags``). So this file holds only what
``process_vm_writev`` and the socket do:

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
import os
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvproto.transport import Notification, TransportError, XferState
from kvproto.transport.base import check_pairs, region_index
from kvproto.transport.kit import OwnTags, Peer, RowsAdapter

_IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                    ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


@dataclass(eq=False)
class _Peer(Peer):
    pid: int
    sock: bytes


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


class VmWriteTransport(OwnTags, RowsAdapter):
    """A ``kvproto.transport.Transport`` over ``process_vm_writev`` and Unix datagrams."""

    KIND = "vmwrite"
    FORMAT = "kvproto-vmwrite/1"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._sock_name = b"\0kvproto-vmwrite/" + os.urandom(8).hex().encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._sock_name)
        self._sock.setblocking(False)
        self._outbox: deque[tuple[_Peer, bytes, VmXfer | None]] = deque()  # tags waiting (OwnTags)

    # --- peers: what a peer's metadata carries beside its regions ----------------------------------
    def _metadata_fields(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "sock": self._sock_name.hex()}

    def _peer_of(self, name: str, regions: np.ndarray, doc: dict[str, Any]) -> _Peer:
        return _Peer(name, regions, int(doc["pid"]), bytes.fromhex(doc["sock"]))

    # --- writes ---------------------------------------------------------------------------------
    def _post(self, peer: _Peer, local: np.ndarray, remote: np.ndarray, tag: bytes) -> VmXfer:
        self._count(len(local), check_pairs(local, remote))
        return VmXfer(peer, local, remote, bytes(tag))

    def poll(self, xfer: VmXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("poll: the write was released")
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
            self._queue_tag(xfer.peer, xfer.tag, xfer)
        else:
            xfer.state = XferState.DONE

    def _fail(self, xfer: VmXfer, why: str) -> None:
        xfer.state, xfer.error = XferState.ERROR, why

    def release(self, xfer: VmXfer) -> None:
        self._check_open()
        self._check_release(xfer, xfer.peer.name, not xfer.peer.gone)
        xfer.released = True

    # --- tags -----------------------------------------------------------------------------------
    def _send_tag(self, peer: _Peer, tag: bytes) -> bool:
        try:
            self._sock.sendto(self.name.encode() + b"\0" + tag, peer.sock)
        except BlockingIOError:
            return False
        except OSError as e:
            raise TransportError(f"tag to {peer.name!r} not delivered: {e}") from e
        return True

    def _receive_tags(self) -> list[Notification]:
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
