"""The loopback adapter: agents in one process write into each other's memory with memmove.

Theory of operation
-------------------
Every live ``LoopbackTransport`` sits in a module-level registry keyed by agent name (weakly,
so a dropped agent disappears). ``metadata()`` is a small JSON document naming the agent, a
per-instance token and a snapshot of its registered regions; ``add_peer`` checks that the named
agent is alive in this process with that token and keeps the snapshot, against which remote
rows are validated, as NIXL validates them against the peer's metadata.

A posted write only records what to copy and stays PENDING; its first ``poll`` validates every
row again against the *live* registrations of both agents (memory deregistered after posting
must never be touched), copies the bytes, then appends the tag to the peer's inbox and reports
DONE. So, as with NIXL, a write's tag reaches the peer only when the initiator polls it, and
never before its bytes. A write that can no longer run polls as ERROR and copies nothing.

Consecutive pairs are merged as NIXL 1.5 merges prepared lists: both indices advance by one,
both memories continue the previous row within the same registered region, and the row has
the previous row's length. Merged runs are copied with one memmove each and counted in
``stats.descriptors``; ``post_descs`` rows are not merged. Nothing here sleeps, retries or
blocks. What every adapter keeps alike (registrations, peers, prepared lists tracked by peer,
the checks the conformance suite asks for) is the adapter kit's (``kvproto.transport.kit``).

``kvproto.testing.simulated`` is this adapter with faults: it decides when a write runs
(``_due``), what running it does (``_run``, from ``_target``, ``_copy`` and ``_deliver``), and how
a tag arrives (``_deliver``).
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from dataclasses import dataclass

import numpy as np

from kvproto.transport.base import MemKind, MemoryRegion, Notification, TransportError, XferState, as_descs
from kvproto.transport.kit import AdapterKit, TrackedList, TrackedLists

_REGISTRY: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


@dataclass(eq=False, slots=True)
class LoopbackRegistration:
    """Regions of one ``register`` call: (N, 4) rows of (address, length, device, kind)."""

    regions: np.ndarray


@dataclass(eq=False, slots=True)
class LoopbackDescList(TrackedList):
    """Prepared rows of this agent's memory (``peer is None``) or of one peer's memory."""

    region: np.ndarray
    """For each row, the index of the registered region that holds it (merging stays inside)."""


@dataclass(eq=False, slots=True)
class LoopbackXfer:
    """One posted write: merged runs to copy, waiting for its first poll."""

    peer: str
    local: np.ndarray
    local_kind: MemKind
    remote: np.ndarray
    remote_kind: MemKind
    tag: bytes
    state: XferState = XferState.PENDING
    error: str | None = None
    """Why the write polled ERROR."""
    released: bool = False


@dataclass(slots=True)
class _Peer:
    token: int
    regions: np.ndarray
    """The peer's registrations when its metadata was taken."""


def _live(name: str, token: int) -> LoopbackTransport | None:
    """The agent called ``name`` if it is the instance that issued ``token`` and still open."""
    agent = _REGISTRY.get(name)
    return agent if agent is not None and agent._token == token else None


def _locate(rows: np.ndarray, kind: MemKind, regions: np.ndarray) -> np.ndarray:
    """For each row, the index in ``regions`` of a region of ``kind`` that holds all of it on
    the row's device, or -1."""
    if len(regions) == 0:
        return np.full(len(rows), -1)
    start, end, dev = rows[:, 0:1], rows[:, 0:1] + rows[:, 1:2], rows[:, 2:3]
    inside = (
        (regions[:, 3] == kind)
        & (start >= regions[:, 0])
        & (end <= regions[:, 0] + regions[:, 1])
        & (dev == regions[:, 2])
    )
    found: np.ndarray = np.where(inside.any(axis=1), inside.argmax(axis=1), -1)
    return found


def _first_outside(rows: np.ndarray, kind: MemKind, regions: np.ndarray) -> int | None:
    bad = np.flatnonzero(_locate(rows, kind, regions) < 0)
    return int(bad[0]) if bad.size else None


def _merge(
    local: LoopbackDescList,
    local_idx: np.ndarray,
    remote: LoopbackDescList,
    remote_idx: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge the pairs of one write into runs, by NIXL's rule (see the module docstring)."""
    lrows, rrows = local.rows[local_idx], remote.rows[remote_idx]
    lreg, rreg = local.region[local_idx], remote.region[remote_idx]
    joins = (
        (np.diff(local_idx) == 1)
        & (np.diff(remote_idx) == 1)
        & (lrows[1:, 0] == lrows[:-1, 0] + lrows[:-1, 1])
        & (rrows[1:, 0] == rrows[:-1, 0] + rrows[:-1, 1])
        & (lrows[1:, 1] == lrows[:-1, 1])
        & (lreg[1:] == lreg[:-1])
        & (rreg[1:] == rreg[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(lrows[:, 1], starts)
    merged_local, merged_remote = lrows[starts], rrows[starts]
    merged_local[:, 1] = lengths
    merged_remote[:, 1] = lengths
    return merged_local, merged_remote


class LoopbackTransport(TrackedLists, AdapterKit):
    """An in-process ``Transport``: DRAM only, bytes moved by ``ctypes.memmove``."""

    KIND = "loopback"
    FORMAT = "kvproto-loopback/1"

    def __init__(self, name: str) -> None:
        if name in _REGISTRY:
            raise TransportError(f"a loopback agent named {name!r} is already alive here")
        super().__init__(name)
        self._token = next(_TOKENS)
        self._lists: set[LoopbackDescList] = set()
        self._inbox: list[Notification] = []
        _REGISTRY[name] = self

    def _register(self, regions: list[MemoryRegion]) -> LoopbackRegistration:
        return LoopbackRegistration(
            np.array([(r.address, r.length, r.device_id, r.kind) for r in regions], dtype=np.int64)
        )

    def metadata(self) -> bytes:
        self._check_open()
        return self._write_metadata(token=self._token, regions=self._regions().tolist())

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        name, peer = self._read_metadata(metadata, lambda doc: _Peer(
            int(doc["token"]), np.array(doc["regions"], dtype=np.int64).reshape(-1, 4)))
        if _live(name, peer.token) is None:
            raise TransportError(f"add_peer: agent {name!r} is not alive in this process")
        return self._new_peer(name, peer)

    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> LoopbackDescList:
        self._check_open()
        arr = as_descs(rows)
        if len(arr) == 0:
            raise TransportError("prepare: cannot prepare an empty descriptor list")
        region = self._check_inside("prepare", arr, kind, peer)
        return self._track(LoopbackDescList(peer, kind, arr, region))

    def _post_prepared(self, peer: str, local: LoopbackDescList, local_idx: np.ndarray, remote: LoopbackDescList,
                       remote_idx: np.ndarray, tag: bytes, nbytes: int) -> LoopbackXfer:
        merged_local, merged_remote = _merge(local, np.asarray(local_idx), remote, np.asarray(remote_idx))
        return self._post(peer, merged_local, local.kind, merged_remote, remote.kind, tag, nbytes)

    def _post_descs(self, peer: str, local: np.ndarray, local_kind: MemKind, remote: np.ndarray,
                    remote_kind: MemKind, tag: bytes, nbytes: int) -> LoopbackXfer:
        self._check_inside("post_descs", local, local_kind, None)
        self._check_inside("post_descs", remote, remote_kind, peer)
        return self._post(peer, local, local_kind, remote, remote_kind, tag, nbytes)

    def poll(self, xfer: LoopbackXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("poll: the write was released")
        if xfer.state is XferState.PENDING and self._due(xfer):
            xfer.error = self._run(xfer)
            xfer.state = XferState.DONE if xfer.error is None else XferState.ERROR
        return xfer.state

    def release(self, xfer: LoopbackXfer) -> None:
        self._check_open()
        self._check_release(xfer, xfer.peer, xfer.peer in self._peers)
        xfer.released = True

    def notify(self, peer: str, tag: bytes) -> None:
        target = _live(peer, self._peer(peer, "notify").token)
        if target is None:
            raise TransportError(f"notify: peer {peer!r} has closed")
        self._check_tag(tag)
        self._deliver(target, bytes(tag))

    def drain_notifications(self) -> list[Notification]:
        self._check_open()
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for dlist in self._lists:
            dlist.invalid = "the agent was closed"
        self._lists.clear()
        self._peers.clear()
        self._registrations.clear()
        self._inbox.clear()
        if _REGISTRY.get(self.name) is self:
            del _REGISTRY[self.name]

    # --- a write's life: posted, then run at its first poll (when ``_due``) ----------------------
    def _post(
        self,
        peer: str,
        local: np.ndarray,
        local_kind: MemKind,
        remote: np.ndarray,
        remote_kind: MemKind,
        tag: bytes,
        nbytes: int,
    ) -> LoopbackXfer:
        self._count(len(local), nbytes)
        return LoopbackXfer(peer, local, local_kind, remote, remote_kind, bytes(tag))

    def _due(self, xfer: LoopbackXfer) -> bool:
        """Whether a pending write runs at this poll (always, here)."""
        return True

    def _run(self, xfer: LoopbackXfer) -> str | None:
        """Copy a write's bytes and deliver its tag; returns why it could not, or None."""
        target, why = self._target(xfer)
        if target is None:
            return why
        self._copy(xfer)
        if xfer.tag:
            self._deliver(target, xfer.tag)
        return None

    def _target(self, xfer: LoopbackXfer) -> tuple[LoopbackTransport | None, str]:
        """The live agent a write goes to, both of its sides still registered; else (None, why)."""
        peer = self._peers.get(xfer.peer)
        if peer is None:
            return None, f"peer {xfer.peer!r} was removed before the write ran"
        target = _live(xfer.peer, peer.token)
        if target is None:
            return None, f"peer {xfer.peer!r} closed before the write ran"
        pos = _first_outside(xfer.local, xfer.local_kind, self._regions())
        if pos is not None:
            return None, f"local row {pos} is no longer registered"
        pos = _first_outside(xfer.remote, xfer.remote_kind, target._regions())
        if pos is not None:
            return None, f"remote row {pos} is no longer registered by {xfer.peer!r}"
        return target, ""

    @staticmethod
    def _copy(xfer: LoopbackXfer) -> None:
        pairs = zip(xfer.local.tolist(), xfer.remote.tolist(), strict=True)
        for (src, length, _), (dst, _, _) in pairs:
            ctypes.memmove(dst, src, length)

    def _deliver(self, target: LoopbackTransport, tag: bytes) -> None:
        """A tag from this agent arrives at ``target``."""
        target._inbox.append(Notification(self.name, tag))

    # --- checks ------------------------------------------------------------------------------------
    def _regions(self) -> np.ndarray:
        if not self._registrations:
            return np.zeros((0, 4), dtype=np.int64)
        return np.concatenate([r.regions for r in self._registrations])

    def _check_inside(
        self, op: str, rows: np.ndarray, kind: MemKind, peer: str | None
    ) -> np.ndarray:
        """The region of each row, local (``peer is None``) or in the peer's metadata (see
        ``_locate``); raises naming the first row outside them."""
        if peer is None:
            side, owner, regions = "local", self.name, self._regions()
        else:
            side, owner, regions = "remote", peer, self._peer(peer, op).regions
        region = _locate(rows, kind, regions)
        bad = np.flatnonzero(region < 0)
        if bad.size:
            pos = int(bad[0])
            addr, length, dev = (int(v) for v in rows[pos])
            raise TransportError(
                f"{op}: {side} row {pos} ({addr:#x}, {length} bytes, device {dev}) lies"
                f" outside the {kind.name} memory registered by {owner!r}"
            )
        return region
