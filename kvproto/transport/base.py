"""The Transport protocol: what a data-plane adapter must do, and nothing more.

Theory of operation
-------------------
An adapter moves bytes from this process's registered memory into a peer's registered memory
and carries short notification *tags* alongside. It posts and polls; it never retries, sleeps,
times out or decides anything about rooms (house rule 6): rooms decide.

Every call is non-blocking and must be made from the adapter's one owner (the endpoint's
progress task); adapters are not thread-safe.

Descriptors are ``(address, length, device_id)`` rows. A caller prepares a *descriptor list*
once (its own memory: ``peer=None``; a peer's memory: ``peer=name``) and then posts writes that
pick rows of two prepared lists by index. Consecutive indices whose memory is contiguous are
merged by the adapter where it can. ``post_descs`` posts rows built for one write only, for
irregular patterns that were not worth preparing. Each local row and the remote row it is
paired with have the same length.

A write's tag reaches the peer's ``drain_notifications`` only after all of the write's bytes
are visible in the peer's memory; an empty tag sends no notification. ``notify`` sends a
(non-empty) tag with no bytes. Adapters make progress only inside calls: the initiator must
poll every write until it leaves PENDING (a write's tag is sent from there), and both sides
must drain notifications regularly (a target that does not drain can stall large writes).
Tags from one peer arrive in the order they were *sent*, not posted: a ``notify`` overtakes
writes still in flight. Tags from different peers are not ordered.

Regions of one ``register`` call may overlap (a hybrid engine's caches overlay one buffer: vLLM
gives a state group's tensors slots inside the pages of the attention layers, and aliases paged
groups' layers): an adapter registers their union (``merge_regions``), so that a row anywhere in
it is inside one registered region. NIXL 1.5.1 needs this: given overlapping regions it looks a row
up in one of them only (a row inside the union but not inside that one fails with
``NIXL_ERR_NOT_FOUND``), and a range registered twice crashes the process at deregistration.

A peer's metadata is a snapshot: memory the peer registers later is reachable only after
``add_peer`` loads fresh metadata, and loading it again, like ``remove_peer``, invalidates
the lists prepared for that peer.

Failures raise ``TransportError``; a write that fails after posting polls as ``XferState.ERROR``.

Optional methods, which the endpoints use where an adapter has them (``route_of``,
``wakeup_fd``): ``route(peer)`` says how writes to a peer move, and with ``Route.pattern`` the
adapter takes whole patterns through ``post_pattern`` (the kernel path); ``wakeup_fd()`` gives a
descriptor that turns readable when tags arrive; ``batch_writes(peer)`` (``batch_writes``) says
that the peer reads notification lists, so that the writes of one pass to it may share a transfer.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


class MemKind(enum.IntEnum):
    """Memory kinds. Values are wire numbers: never renumber."""

    DRAM = 0
    VRAM = 1


class XferState(enum.IntEnum):
    PENDING = 0
    DONE = 1
    ERROR = 2


class TransportError(RuntimeError):
    """An adapter call failed (bad descriptor, unknown peer, backend error)."""


BAD_METADATA = (ValueError, KeyError, TypeError, AttributeError, OverflowError)
"""What parsing a peer's metadata may raise on hostile bytes (JSON ``Infinity`` read as an int
overflows; a list where an object was expected has no keys): adapters turn these into
``TransportError`` in ``add_peer``, so a bad REGISTER fails its link, never the endpoint."""


class TransportClosed(TransportError):
    """The adapter was closed; no call but ``close`` is allowed."""


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A range of this process's memory to register."""

    address: int
    length: int
    device_id: int = 0
    kind: MemKind = MemKind.DRAM


def merge_regions(regions: Sequence[MemoryRegion]) -> list[MemoryRegion]:
    """``regions`` with every set that overlaps (on one device and memory kind) joined into one
    region, their union, sorted by kind, device and address; regions that only touch stay apart. A
    list without overlaps comes back as it is, in its order (what was registered before)."""
    out: list[MemoryRegion] = []
    for r in sorted(regions, key=lambda r: (r.kind, r.device_id, r.address)):
        last = out[-1] if out else None
        if last is not None and (last.kind, last.device_id) == (r.kind, r.device_id) \
                and r.address < last.address + last.length:
            end = max(last.address + last.length, r.address + r.length)
            out[-1] = MemoryRegion(last.address, end - last.address, last.device_id, last.kind)
        else:
            out.append(r)
    return out if len(out) < len(regions) else list(regions)


@dataclass(frozen=True, slots=True)
class Notification:
    peer: str
    tag: bytes


class Registration(Protocol):
    """Opaque handle of registered memory."""


class DescList(Protocol):
    """Opaque handle of a prepared descriptor list. ``len()`` is its row count."""

    def __len__(self) -> int: ...


class Xfer(Protocol):
    """Opaque handle of one posted write."""


@dataclass(slots=True)
class TransportStats:
    """Counters an adapter keeps: writes posted, the descriptors they became after merging
    (counted once the adapter knows them, at the latest when the write polls DONE), bytes."""

    writes: int = 0
    descriptors: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """How an adapter moves writes to one peer (optional ``route(peer)``; see ``Transport``)."""

    name: str
    """What moves the bytes ("kernel", or an adapter's name): shown in ``room.stats.paths``."""
    pattern: bool
    """``post_pattern`` serves this peer: one write of any number of extents costs about one
    launch, so the endpoints neither stage nor merge runs for it."""


def as_descs(rows: np.ndarray | Sequence[tuple[int, int, int]]) -> np.ndarray:
    """Rows as an ``(N, 3)`` int64 array of (address, length, device_id)."""
    arr = np.asarray(rows, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise TransportError(f"descriptor rows must be (N, 3), got shape {arr.shape}")
    if (arr[:, 1] <= 0).any():
        raise TransportError("descriptor lengths must be positive")
    return arr


def take_rows(rows: np.ndarray, idx: np.ndarray | Sequence[int], side: str) -> np.ndarray:
    """``rows[idx]``; raises ``TransportError`` naming the first index out of range."""
    arr = idx if type(idx) is np.ndarray else np.asarray(idx)
    if arr.size == 0:
        return rows[:0]
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TransportError(
            f"{side} indices must be a 1-D integer array, got {arr.dtype} of shape {arr.shape}"
        )
    # a write of a few pages is most writes: its bounds in plain integers cost a third of the
    # array operations
    small = arr.tolist() if arr.size <= _SMALL else None
    lo, hi = (min(small), max(small)) if small is not None else (int(arr.min()), int(arr.max()))
    if lo < 0 or hi >= len(rows):
        i = int(np.flatnonzero((arr < 0) | (arr >= len(rows)))[0])
        raise TransportError(
            f"{side} index {int(arr[i])} at position {i} is out of range"
            f" for a list of {len(rows)} rows"
        )
    picked: np.ndarray = rows[arr]
    return picked


_SMALL = 64
"""Rows up to which ``take_rows`` and ``check_pairs`` check with plain integers."""


def check_pairs(local: np.ndarray, remote: np.ndarray) -> int:
    """Check that local and remote rows pair up into one write; returns its byte count."""
    if len(local) == 0:
        raise TransportError("a write needs at least one descriptor")
    if len(local) != len(remote):
        raise TransportError(
            f"a write pairs {len(local)} local rows with {len(remote)} remote rows"
        )
    if len(local) <= _SMALL:
        lengths = local[:, 1].tolist()
        if lengths == remote[:, 1].tolist():
            return sum(lengths)
    elif np.array_equal(local[:, 1], remote[:, 1]):
        return int(local[:, 1].sum())
    i = int(np.flatnonzero(local[:, 1] != remote[:, 1])[0])
    raise TransportError(
        f"pair {i}: local length {int(local[i, 1])}"
        f" differs from remote length {int(remote[i, 1])}"
    )


def region_index(rows: np.ndarray, regions: np.ndarray) -> np.ndarray:
    """For each row, the index of the region (an ``(N, 2)`` array of (address, length) sorted
    by address) that holds all of it on device 0, or -1."""
    if len(regions) == 0:
        return np.full(len(rows), -1)
    i = np.searchsorted(regions[:, 0], rows[:, 0], side="right") - 1
    ok = (i >= 0) & (rows[:, 2] == 0)
    j = np.where(ok, i, 0)
    ok &= rows[:, 0] + rows[:, 1] <= regions[j, 0] + regions[j, 1]
    return np.where(ok, i, -1)


def sorted_regions(regions: Sequence[tuple[int, int]]) -> np.ndarray:
    """(address, length) pairs as the sorted ``(N, 2)`` array ``region_index`` takes."""
    return np.array(sorted(regions), dtype=np.int64).reshape(-1, 2)


def check_rows(rows: np.ndarray | Sequence[tuple[int, int, int]], kind: MemKind, regions: np.ndarray,
               whose: str, kinds: frozenset[MemKind] = frozenset({MemKind.DRAM})) -> np.ndarray:
    """``as_descs(rows)``, each row checked to lie inside one of ``regions`` (``whose`` names
    the owner in the error: "this agent's", "peer 'b''s")."""
    arr = as_descs(rows)
    if kind not in kinds:
        raise TransportError(f"this adapter moves {'/'.join(k.name for k in sorted(kinds))} only, not {kind.name}")
    bad = np.flatnonzero(region_index(arr, regions) < 0)
    if bad.size:
        i = int(bad[0])
        raise TransportError(f"row {i} {arr[i].tolist()} is not inside {whose} registered {kind.name}")
    return arr


@dataclass(eq=False)
class PreparedRows:
    """A prepared list for adapters that keep the rows themselves: ``peer`` is the peer snapshot
    it was prepared against (None: local memory), any object whose ``gone`` attribute says why
    it no longer works ("" while it is current)."""

    rows: np.ndarray
    peer: object | None
    released: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    def usable(self, peer: object | None) -> np.ndarray:
        """The rows, for a write to ``peer`` (None: as the local side)."""
        if self.released:
            raise TransportError("descriptor list was released")
        if self.peer is not None:
            gone = getattr(self.peer, "gone", "")
            if gone or self.peer is not peer:
                raise TransportError(gone or "descriptor list belongs to another peer")
        return self.rows


@runtime_checkable
class Transport(Protocol):
    """A data-plane adapter. See the module docstring for the contract."""

    name: str
    """This agent's name, unique among the agents that talk to each other."""

    stats: TransportStats

    def memory_kinds(self) -> frozenset[MemKind]:
        """Memory kinds this adapter can register."""
        ...

    def register(self, regions: Sequence[MemoryRegion]) -> Registration:
        """Register memory for local and remote access."""
        ...

    def deregister(self, registration: Registration) -> None: ...

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach this agent's registered memory."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> DescList:
        """Prepare descriptor rows (``peer=None``: local memory) for later ``post_prepared``."""
        ...

    def release_prepared(self, dlist: DescList) -> None: ...

    def post_prepared(
        self,
        peer: str,
        local: DescList,
        local_idx: np.ndarray,
        remote: DescList,
        remote_idx: np.ndarray,
        tag: bytes,
    ) -> Xfer:
        """Post a WRITE of ``local[local_idx[i]]`` into ``remote[remote_idx[i]]`` for every i."""
        ...

    def post_descs(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_kind: MemKind,
        remote_rows: np.ndarray,
        remote_kind: MemKind,
        tag: bytes,
    ) -> Xfer:
        """Post a WRITE from rows built for this write only."""
        ...

    def poll(self, xfer: Xfer) -> XferState: ...

    def release(self, xfer: Xfer) -> None:
        """Free a write's handle. Releasing a PENDING write is allowed only when its peer is gone."""
        ...

    def notify(self, peer: str, tag: bytes) -> None:
        """Send a tag with no bytes."""
        ...

    def drain_notifications(self) -> list[Notification]:
        """Tags that arrived since the last call, in arrival order per peer.

        Also drives progress."""
        ...

    def close(self) -> None:
        """Release everything. Idempotent."""
        ...


def wakeup_fd(transport: Transport) -> int | None:
    """The adapter's optional ``wakeup_fd()``: a file descriptor that turns readable when tags may
    be waiting, which an endpoint adds to its event loop so that a waiting rank wakes at once
    rather than at its next poll (None: the adapter has none; endpoints poll as always)."""
    fn = getattr(transport, "wakeup_fd", None)
    return None if fn is None else fn()


def completion_event(transport: Transport) -> Any | None:
    """The adapter's optional ``completion_event()``: an object whose ``synchronize()`` waits, with
    the GIL released, until the oldest of the adapter's writes in flight has run, offered only
    while that is all those writes wait for (no write waiting for a pass, a tag or another
    engine's progress). An endpoint whose writes are in flight and that has nothing else to do
    waits for it in a thread (``kvproto.aio.ready``) instead of polling in a spin. None: the
    adapter has none now (or none at all); endpoints poll as always."""
    fn = getattr(transport, "completion_event", None)
    return None if fn is None else fn()


def wait_on_device(transport: Transport, peer: str, events: Sequence[Any]) -> bool:
    """Call the adapter's optional ``wait_on_device(peer, events)``: True where the adapter's next
    write to ``peer`` will run on the device only after ``events`` (CUDA events of the engine's
    streams) complete, so an endpoint may post a write whose KV is still being computed and the
    write starts the moment it is ready, without the host in between (the kernel path). False:
    the adapter cannot (or has no such method); the write must be held until the events fired."""
    fn = getattr(transport, "wait_on_device", None)
    return False if fn is None else bool(fn(peer, events))


def batch_writes(transport: Transport, peer: str) -> bool:
    """Call the adapter's optional ``batch_writes(peer)``, which says that ``peer``'s adapter reads
    notification lists (``pack_tags``; kvproto 1.6 and later): the writes an endpoint posts to that
    peer in one pass may then share one transfer and one notification. False: the adapter has no
    such method (every write stays a transfer of its own)."""
    fn = getattr(transport, "batch_writes", None)
    if fn is None:
        return False
    fn(peer)
    return True


# --- notification lists (spec/v1/tags.md, "Notification lists"): one notification, several tags --------
LIST_MAGIC = b"KL"
LIST_VERSION = 1
_LIST_HEAD = struct.Struct("<2sBBH")  # magic, version, reserved (0), count
_LIST_LEN = struct.Struct("<H")
MAX_LIST = 0xFFFF


def pack_tags(tags: Sequence[bytes]) -> bytes:
    """The tags of several writes that travel as one transfer, as the one notification it sends:
    ``"KL" %x01 %x00 count`` then, per tag, its length (u16) and its bytes."""
    if not 2 <= len(tags) <= MAX_LIST:
        raise TransportError(f"a notification list holds 2 to {MAX_LIST} tags, not {len(tags)}")
    out = [_LIST_HEAD.pack(LIST_MAGIC, LIST_VERSION, 0, len(tags))]
    for tag in tags:
        if not 0 < len(tag) <= 0xFFFF:
            raise TransportError(f"a listed tag is 1 to 65535 bytes, not {len(tag)}")
        out += (_LIST_LEN.pack(len(tag)), tag)
    return b"".join(out)


def unpack_tags(data: bytes) -> list[bytes] | None:
    """The tags of a notification list, or None where ``data`` is not a well-formed one (a tag of
    its own, which the receiver checks as it checks every tag)."""
    if len(data) < _LIST_HEAD.size or data[:2] != LIST_MAGIC:
        return None
    _, version, reserved, count = _LIST_HEAD.unpack_from(data)
    if version != LIST_VERSION or reserved != 0 or count < 2:
        return None
    tags, at = [], _LIST_HEAD.size
    for _ in range(count):
        if at + 2 > len(data):
            return None
        (n,) = _LIST_LEN.unpack_from(data, at)
        at += 2
        if n == 0 or at + n > len(data):
            return None
        tags.append(data[at:at + n])
        at += n
    return tags if at == len(data) else None


def route_of(transport: Transport, peer: str) -> Route | None:
    """The adapter's ``route(peer)`` if it has one (an optional method), else None: writes to
    ``peer`` are descriptors priced per descriptor, as ``kvproto.core.cost`` assumes.

    An adapter whose route says ``pattern`` also offers ``post_pattern(peer, local_bases,
    local_kind, remote_bases, remote_kind, pattern, tag)``: a write of the same extents
    (``(E, 3)``: source offset, destination offset, length) from every local region base into
    the matching remote one, bounds-checked like any write."""
    route = getattr(transport, "route", None)
    return None if route is None else route(peer)
