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
blocks.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvproto.transport.base import (
    BAD_METADATA,
    MemKind,
    MemoryRegion,
    Notification,
    TransportClosed,
    TransportError,
    TransportStats,
    XferState,
    as_descs,
    check_pairs,
    merge_regions,
    take_rows,
)

_FORMAT = "kvproto-loopback/1"
_REGISTRY: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


@dataclass(eq=False, slots=True)
class LoopbackRegistration:
    """Regions of one ``register`` call: (N, 4) rows of (address, length, device, kind)."""

    regions: np.ndarray


@dataclass(eq=False, slots=True)
class LoopbackDescList:
    """Prepared rows of this agent's memory (``peer is None``) or of one peer's memory."""

    peer: str | None
    kind: MemKind
    rows: np.ndarray
    region: np.ndarray
    """For each row, the index of the registered region that holds it (merging stays inside)."""
    invalid: str | None = None
    """Why the list can no longer be used, once released or its peer was removed or reloaded."""

    def __len__(self) -> int:
        return len(self.rows)


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


class LoopbackTransport:
    """An in-process ``Transport``: DRAM only, bytes moved by ``ctypes.memmove``."""

    def __init__(self, name: str) -> None:
        if name in _REGISTRY:
            raise TransportError(f"a loopback agent named {name!r} is already alive here")
        self.name = name
        self.stats = TransportStats()
        self._token = next(_TOKENS)
        self._closed = False
        self._registrations: list[LoopbackRegistration] = []
        self._peers: dict[str, _Peer] = {}
        self._dlists: set[LoopbackDescList] = set()
        self._inbox: list[Notification] = []
        _REGISTRY[name] = self

    def memory_kinds(self) -> frozenset[MemKind]:
        self._check_open()
        return frozenset({MemKind.DRAM})

    def register(self, regions: Sequence[MemoryRegion]) -> LoopbackRegistration:
        self._check_open()
        if not regions:
            raise TransportError("register: no regions given")
        for r in regions:
            if r.kind is not MemKind.DRAM:
                raise TransportError(f"register: loopback agents cannot register {r.kind.name}")
            if r.length <= 0:
                raise TransportError(f"register: region at {r.address:#x} has length {r.length}")
        reg = LoopbackRegistration(  # overlapping ranges as their union (transport.base)
            np.array([(r.address, r.length, r.device_id, r.kind) for r in merge_regions(regions)], dtype=np.int64)
        )
        self._registrations.append(reg)
        return reg

    def deregister(self, registration: LoopbackRegistration) -> None:
        self._check_open()
        if registration not in self._registrations:
            raise TransportError("deregister: registration is not registered with this agent")
        self._registrations.remove(registration)

    def metadata(self) -> bytes:
        self._check_open()
        doc = {
            "format": _FORMAT,
            "agent": self.name,
            "token": self._token,
            "regions": self._regions().tolist(),
        }
        return json.dumps(doc).encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        try:
            doc = json.loads(metadata)
            if doc["format"] != _FORMAT:
                raise ValueError(f"format {doc['format']!r}")
            name, token = str(doc["agent"]), int(doc["token"])
            regions = np.array(doc["regions"], dtype=np.int64).reshape(-1, 4)
        except BAD_METADATA as e:
            raise TransportError(f"add_peer: not loopback metadata ({e})") from e
        if name == self.name:
            raise TransportError(f"add_peer: metadata names this agent {name!r} itself")
        if _live(name, token) is None:
            raise TransportError(f"add_peer: agent {name!r} is not alive in this process")
        self._invalidate(name, f"peer {name!r} was reloaded by add_peer")
        self._peers[name] = _Peer(token, regions)
        return name

    def remove_peer(self, peer: str) -> None:
        self._peer(peer, "remove_peer")
        self._invalidate(peer, f"peer {peer!r} was removed")
        del self._peers[peer]

    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> LoopbackDescList:
        self._check_open()
        arr = as_descs(rows)
        if len(arr) == 0:
            raise TransportError("prepare: cannot prepare an empty descriptor list")
        region = self._check_inside("prepare", arr, kind, peer)
        dlist = LoopbackDescList(peer, kind, arr, region)
        self._dlists.add(dlist)
        return dlist

    def release_prepared(self, dlist: LoopbackDescList) -> None:
        self._check_open()
        if dlist in self._dlists:
            dlist.invalid = "it was released"
            self._dlists.discard(dlist)
        elif dlist.invalid is None:
            raise TransportError("release_prepared: the list was not prepared by this agent")

    def post_prepared(
        self,
        peer: str,
        local: LoopbackDescList,
        local_idx: np.ndarray,
        remote: LoopbackDescList,
        remote_idx: np.ndarray,
        tag: bytes,
    ) -> LoopbackXfer:
        self._peer(peer, "post_prepared")
        for dlist, want, side in ((local, None, "local"), (remote, peer, "remote")):
            if dlist.invalid is not None:
                raise TransportError(f"post_prepared: the {side} list is unusable: {dlist.invalid}")
            if dlist.peer != want or dlist not in self._dlists:
                raise TransportError(
                    f"post_prepared: the {side} list was not prepared by this agent for"
                    f" {'local memory' if want is None else repr(want)}"
                )
        nbytes = check_pairs(
            take_rows(local.rows, local_idx, "local"), take_rows(remote.rows, remote_idx, "remote")
        )
        merged_local, merged_remote = _merge(
            local, np.asarray(local_idx), remote, np.asarray(remote_idx)
        )
        return self._post(peer, merged_local, local.kind, merged_remote, remote.kind, tag, nbytes)

    def post_descs(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_kind: MemKind,
        remote_rows: np.ndarray,
        remote_kind: MemKind,
        tag: bytes,
    ) -> LoopbackXfer:
        self._peer(peer, "post_descs")
        lrows, rrows = as_descs(local_rows), as_descs(remote_rows)
        nbytes = check_pairs(lrows, rrows)
        self._check_inside("post_descs", lrows, local_kind, None)
        self._check_inside("post_descs", rrows, remote_kind, peer)
        return self._post(peer, lrows, local_kind, rrows, remote_kind, tag, nbytes)

    def poll(self, xfer: LoopbackXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("poll: the write was released")
        if xfer.state is XferState.PENDING:
            xfer.error = self._run(xfer)
            xfer.state = XferState.DONE if xfer.error is None else XferState.ERROR
        return xfer.state

    def release(self, xfer: LoopbackXfer) -> None:
        self._check_open()
        if xfer.state is XferState.PENDING and xfer.peer in self._peers and not xfer.released:
            raise TransportError(
                f"release: the write to {xfer.peer!r} is still pending and its peer is present"
            )
        xfer.released = True

    def notify(self, peer: str, tag: bytes) -> None:
        target = _live(peer, self._peer(peer, "notify").token)
        if target is None:
            raise TransportError(f"notify: peer {peer!r} has closed")
        if not tag:
            raise TransportError("notify: the tag is empty")
        target._inbox.append(Notification(self.name, bytes(tag)))

    def drain_notifications(self) -> list[Notification]:
        self._check_open()
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for dlist in self._dlists:
            dlist.invalid = "the agent was closed"
        self._dlists.clear()
        self._peers.clear()
        self._registrations.clear()
        self._inbox.clear()
        if _REGISTRY.get(self.name) is self:
            del _REGISTRY[self.name]

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
        self.stats.writes += 1
        self.stats.descriptors += len(local)
        self.stats.bytes += nbytes
        return LoopbackXfer(peer, local, local_kind, remote, remote_kind, bytes(tag))

    def _run(self, xfer: LoopbackXfer) -> str | None:
        """Copy a write's bytes and deliver its tag; returns why it could not, or None."""
        peer = self._peers.get(xfer.peer)
        if peer is None:
            return f"peer {xfer.peer!r} was removed before the write ran"
        target = _live(xfer.peer, peer.token)
        if target is None:
            return f"peer {xfer.peer!r} closed before the write ran"
        pos = _first_outside(xfer.local, xfer.local_kind, self._regions())
        if pos is not None:
            return f"local row {pos} is no longer registered"
        pos = _first_outside(xfer.remote, xfer.remote_kind, target._regions())
        if pos is not None:
            return f"remote row {pos} is no longer registered by {xfer.peer!r}"
        pairs = zip(xfer.local.tolist(), xfer.remote.tolist(), strict=True)
        for (src, length, _), (dst, _, _) in pairs:
            ctypes.memmove(dst, src, length)
        if xfer.tag:
            target._inbox.append(Notification(self.name, xfer.tag))
        return None

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

    def _invalidate(self, peer: str, why: str) -> None:
        stale = [d for d in self._dlists if d.peer == peer]
        for dlist in stale:
            dlist.invalid = why
            self._dlists.discard(dlist)

    def _peer(self, peer: str, op: str) -> _Peer:
        self._check_open()
        try:
            return self._peers[peer]
        except KeyError:
            raise TransportError(f"{op}: unknown peer {peer!r}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"loopback agent {self.name!r} is closed")
