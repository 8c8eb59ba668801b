"""The adapter kit: what every data-plane adapter keeps the same way, written once.

Theory of operation
-------------------
An adapter (the contract: ``kvproto.transport.base``) is one engine's way of moving bytes and
tags. Around that engine every adapter keeps the same bookkeeping, and the conformance suite
checks it to the letter: calls after ``close`` raise ``TransportClosed``; a registration it does
not hold cannot be deregistered; regions of one ``register`` call are registered as their union;
a peer's metadata is parsed without trusting it and its own metadata is refused; an unknown peer
is an error naming it; a prepared list dies with its peer's snapshot ("removed", "reloaded"); a
write's rows are picked, paired and counted before anything moves; a pending write is released
only once its peer is gone; a notification's tag is never empty. ``AdapterKit`` keeps all of it,
so that an adapter writes only what its engine does differently:

* ``KIND`` names the agent in errors, ``FORMAT`` its metadata's format (JSON written by
  ``_write_metadata``, read back by ``_read_metadata``); ``KINDS`` and ``ONE_DEVICE`` say what
  ``register`` accepts; ``_register(regions)`` / ``_deregister(registration)`` are the engine's
  part of registering (the kit validates, merges and keeps the list);
* ``_peers`` maps a peer's name to what the adapter keeps of it; ``_peer(name, op)`` finds it;
* ``_count(descriptors, nbytes)`` adds a posted write to ``stats``;
* ``_check_release(xfer, peer, present)`` and ``_check_tag(tag)`` are the two checks every
  ``release`` and ``notify`` make.

Two ways of keeping prepared lists are written here too, one per kind of engine:

* ``RowsAdapter``: the adapter keeps the rows itself (its engine takes addresses, as Mooncake's
  and ``process_vm_writev`` do). Local rows are checked against this agent's registrations,
  remote ones against the snapshot of regions the peer's metadata listed (a ``Peer``); a list is
  a ``PreparedRows`` that names the snapshot it was checked against, so removing or reloading the
  peer (``Peer.gone``) is all it takes to invalidate every list made for it. ``prepare``,
  ``release_prepared``, ``post_prepared``, ``post_descs``, ``metadata``, ``add_peer`` and
  ``remove_peer`` are written; the adapter writes ``_post(peer, local_rows, remote_rows, tag)``
  and its tags (``poll``, ``release``, ``notify``, ``drain_notifications``, ``close``).
* ``TrackedList``: the engine holds the list (NIXL's prepared handles) or the adapter keeps more
  than rows beside it (the loopback adapter's region of each row). The adapter keeps its lists in
  ``_lists``; ``_invalidate(peer, why)`` retires those made for a peer (``_retire`` releases the
  engine's handle); ``post_prepared`` and ``post_descs`` check lists, indices and rows and hand
  the engine (``_post_prepared``, ``_post_descs``) a write whose rows pair up.

Tags, where the engine does not carry them (``OwnTags``): a write's tag is queued once its bytes
have landed and leaves in queue order when the peer's queue takes it (``_send_tag``); the write is
DONE then, and not before.

Nothing here moves a byte, sleeps or retries: the kit is bookkeeping, run inside the adapter's
calls, on its one owner's thread.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvproto.transport.base import (
    BAD_METADATA,
    MemKind,
    MemoryRegion,
    Notification,
    PreparedRows,
    TransportClosed,
    TransportError,
    TransportStats,
    XferState,
    as_descs,
    check_pairs,
    check_rows,
    merge_regions,
    sorted_regions,
    take_rows,
)

__all__ = ["AdapterKit", "OwnTags", "Peer", "PreparedRows", "RegionList", "RowsAdapter", "TrackedList", "TrackedLists"]

T = TypeVar("T")


class AdapterKit:
    """The bookkeeping every adapter keeps alike (module docstring). Subclasses set ``KIND`` (and
    ``FORMAT`` where the metadata is the kit's JSON) and call ``super().__init__(name)``."""

    KIND: ClassVar[str] = "adapter"
    """Names this adapter's agents in errors ("loopback agent 'a' is closed")."""
    FORMAT: ClassVar[str] = ""
    """The ``format`` of this adapter's metadata (``_write_metadata``, ``_read_metadata``)."""
    KINDS: ClassVar[frozenset[MemKind] | None] = frozenset({MemKind.DRAM})
    """Memory kinds ``register`` accepts, and ``memory_kinds()`` reports (None: the engine decides)."""
    ONE_DEVICE: ClassVar[bool] = False
    """``register`` accepts memory of device 0 only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = TransportStats()
        self._closed = False
        self._registrations: list[Any] = []
        self._peers: dict[str, Any] = {}

    # --- open or closed -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.KIND} agent {self.name!r} is closed")

    # --- memory ---------------------------------------------------------------------------------
    def memory_kinds(self) -> frozenset[MemKind]:
        self._check_open()
        assert self.KINDS is not None, "an adapter whose engine decides its kinds reports them itself"
        return self.KINDS

    def register(self, regions: Sequence[MemoryRegion]) -> Any:
        """Validate ``regions``, register their union (``merge_regions``) with the engine
        (``_register``) and keep the registration."""
        self._check_open()
        if not regions:
            raise TransportError("register: no regions given")
        kinds = self.KINDS
        for r in regions:
            if r.length <= 0:
                raise TransportError(f"register: region at {r.address:#x} has length {r.length}")
            if kinds is not None and r.kind not in kinds:
                raise TransportError(f"register: {self.KIND} agents register "
                                     f"{'/'.join(k.name for k in sorted(kinds))} only, not {r.kind.name}")
            if self.ONE_DEVICE and r.device_id != 0:
                raise TransportError(f"register: {self.KIND} agents register memory of device 0 only, "
                                     f"not of device {r.device_id}")
        registration = self._register(merge_regions(regions))
        self._registrations.append(registration)
        return registration

    def deregister(self, registration: Any) -> None:
        self._check_open()
        if registration not in self._registrations:
            raise TransportError("deregister: registration is not registered with this agent")
        self._registrations.remove(registration)
        self._deregister(registration)

    def _register(self, regions: list[MemoryRegion]) -> Any:
        """The engine's part of ``register``: ``regions`` validated and without overlaps; returns
        the registration (the adapter undoes what it did before raising)."""
        raise NotImplementedError

    def _deregister(self, registration: Any) -> None:
        """The engine's part of ``deregister`` (the kit has forgotten ``registration``)."""

    # --- metadata and peers ------------------------------------------------------------------------
    def _write_metadata(self, **fields: Any) -> bytes:
        """This agent's metadata: a JSON document of ``FORMAT``, its name and ``fields``."""
        return json.dumps({"format": self.FORMAT, "agent": self.name, **fields}).encode()

    def _read_metadata(self, metadata: bytes, read: Callable[[dict[str, Any]], T]) -> tuple[str, T]:
        """A peer's name and ``read(doc)`` of its metadata, trusting none of it: anything that is
        not a document of ``FORMAT`` whose values ``read`` takes (raising one of ``BAD_METADATA``
        otherwise) is a ``TransportError``, and so is this agent's own metadata (refused before
        ``read`` runs)."""
        try:
            doc = json.loads(metadata)
            if doc["format"] != self.FORMAT:
                raise ValueError(f"format {doc['format']!r}")
            name = str(doc["agent"])
            if name == self.name:
                raise TransportError(f"add_peer: metadata names this agent {name!r} itself")
            return name, read(doc)
        except BAD_METADATA as e:
            raise TransportError(f"add_peer: not {self.FORMAT} metadata ({e})") from e

    def _peer(self, name: str, op: str) -> Any:
        """What this agent keeps of peer ``name``; raises naming it where there is none."""
        self._check_open()
        try:
            return self._peers[name]
        except KeyError:
            raise TransportError(f"{op}: unknown peer {name!r}") from None

    # --- writes and tags -------------------------------------------------------------------------
    def _count(self, descriptors: int, nbytes: int) -> None:
        """A write posted: ``descriptors`` after merging, ``nbytes`` in all."""
        stats = self.stats
        stats.writes += 1
        stats.descriptors += descriptors
        stats.bytes += nbytes

    @staticmethod
    def _check_release(xfer: Any, peer: str, present: bool) -> None:
        """A pending write is released only once its peer is gone (``present``: it is not)."""
        if xfer.state is XferState.PENDING and present and not xfer.released:
            raise TransportError(f"release: the write to {peer!r} is still pending and its peer is present")

    @staticmethod
    def _check_tag(tag: bytes) -> None:
        if not tag:
            raise TransportError("notify: the tag is empty")


# --- lists the engine holds (or that keep more than rows): tracked by peer ---------------------------
@dataclass(eq=False, slots=True)
class TrackedList:
    """A prepared list an adapter keeps in its ``_lists`` until it is released or its peer's
    snapshot goes (``invalid`` then says why): this agent's memory (``peer`` None) or one peer's.
    Adapters subclass it to hold their engine's handle beside the rows."""

    peer: str | None
    kind: MemKind
    rows: np.ndarray
    invalid: str | None = field(default=None, kw_only=True)
    """Why the list can no longer be used, once released or its peer was removed or reloaded."""

    def __len__(self) -> int:
        return len(self.rows)


class TrackedLists:
    """``AdapterKit`` mixin for adapters whose lists are ``TrackedList``s (module docstring)."""

    _lists: set[Any]
    _peers: dict[str, Any]
    _peer: Callable[[str, str], Any]
    _check_open: Callable[[], None]

    def _track(self, dlist: T) -> T:
        self._lists.add(dlist)
        return dlist

    def release_prepared(self, dlist: Any) -> None:
        self._check_open()
        if dlist in self._lists:
            self._lists.discard(dlist)
            dlist.invalid = "it was released"
            self._retire(dlist)
        elif dlist.invalid is None:
            raise TransportError("release_prepared: the list was not prepared by this agent")

    def _new_peer(self, name: str, peer: Any) -> str:
        """``peer`` is what this agent keeps of ``name`` from now on (``add_peer``): lists made
        for an earlier snapshot of it stop working."""
        self._invalidate(name, f"peer {name!r} was reloaded by add_peer")
        self._peers[name] = peer
        return name

    def remove_peer(self, peer: str) -> None:
        self._peer(peer, "remove_peer")
        self._invalidate(peer, f"peer {peer!r} was removed")
        del self._peers[peer]
        self._removed(peer)

    def _removed(self, peer: str) -> None:
        """The engine's part of ``remove_peer`` (the kit has forgotten ``peer`` and its lists)."""

    def _invalidate(self, peer: str, why: str) -> None:
        """Retire every list prepared for ``peer`` (removed, or its metadata reloaded)."""
        for dlist in [d for d in self._lists if d.peer == peer]:
            self._lists.discard(dlist)
            dlist.invalid = why
            self._retire(dlist)

    def _retire(self, dlist: Any) -> None:
        """Release what the engine holds for ``dlist`` (the kit has forgotten it)."""

    def post_prepared(self, peer: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                      tag: bytes) -> Any:
        """Checked here (``peer`` known, ``local`` a live list of this agent's memory, ``remote`` a
        live list of ``peer``'s, every index inside its list, the picked rows paired with equal
        lengths), posted by the engine (``_post_prepared``)."""
        self._peer(peer, "post_prepared")
        lists = self._lists
        for dlist, want, side in ((local, None, "local"), (remote, peer, "remote")):
            if dlist.invalid is not None:
                raise TransportError(f"post_prepared: the {side} list is unusable: {dlist.invalid}")
            if dlist.peer != want or dlist not in lists:
                raise TransportError(f"post_prepared: the {side} list was not prepared by this agent for"
                                     f" {'local memory' if want is None else repr(want)}")
        nbytes = check_pairs(take_rows(local.rows, local_idx, "local"), take_rows(remote.rows, remote_idx, "remote"))
        return self._post_prepared(peer, local, local_idx, remote, remote_idx, tag, nbytes)

    def post_descs(self, peer: str, local_rows: np.ndarray, local_kind: MemKind, remote_rows: np.ndarray,
                   remote_kind: MemKind, tag: bytes) -> Any:
        """Rows checked to pair up here, posted by the engine (``_post_descs``), which checks them
        against registered memory (or has its engine do so)."""
        self._peer(peer, "post_descs")
        lrows, rrows = as_descs(local_rows), as_descs(remote_rows)
        return self._post_descs(peer, lrows, local_kind, rrows, remote_kind, tag, check_pairs(lrows, rrows))

    def _post_prepared(self, peer: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                       tag: bytes, nbytes: int) -> Any:
        """The engine's part of ``post_prepared`` (its write handle)."""
        raise NotImplementedError

    def _post_descs(self, peer: str, local: np.ndarray, local_kind: MemKind, remote: np.ndarray,
                    remote_kind: MemKind, tag: bytes, nbytes: int) -> Any:
        """The engine's part of ``post_descs``, given ``(N, 3)`` rows that pair up."""
        raise NotImplementedError


# --- tags the adapter sends itself, in order, each once its write's bytes have landed ---------------
class OwnTags:
    """``AdapterKit`` mixin for adapters that carry tags beside their engine (a socket of their
    own): tags leave in the order they were queued, each once the peer's queue takes it; a write
    whose tag waits stays PENDING, and is settled (``_tag_left``) once its tag has left or could
    not. The adapter writes ``_send_tag`` and ``_receive_tags``, and queues a finished write's tag
    with ``_queue_tag``; ``notify`` and ``drain_notifications`` are written here."""

    _outbox: deque[tuple[Any, bytes, Any]]
    _peer: Callable[[str, str], Any]
    _check_open: Callable[[], None]
    _check_tag: Callable[[bytes], None]

    def notify(self, peer: str, tag: bytes) -> None:
        target = self._peer(peer, "notify")
        self._check_tag(tag)
        self._outbox.append((target, bytes(tag), None))
        self._flush()

    def drain_notifications(self) -> list[Notification]:
        self._check_open()
        self._flush()
        return self._receive_tags()

    def _queue_tag(self, peer: Any, tag: bytes, xfer: Any) -> None:
        """``xfer``'s tag waits behind the tags queued before it (sent by the next ``_flush``)."""
        self._outbox.append((peer, tag, xfer))

    def _flush(self) -> None:
        """Send the queued tags, oldest first, until a peer's queue is full."""
        outbox = self._outbox
        while outbox:
            peer, tag, xfer = outbox[0]
            error = None
            try:
                if not self._send_tag(peer, tag):
                    return  # the peer's queue is full: the next call tries again, in order
            except TransportError as e:
                error = str(e)
            outbox.popleft()
            if xfer is not None:
                self._tag_left(xfer, error)

    def _send_tag(self, peer: Any, tag: bytes) -> bool:
        """Hand ``tag`` from this agent to ``peer``'s queue: False if it is full (nothing sent);
        raise ``TransportError`` if it can never be sent."""
        raise NotImplementedError

    def _receive_tags(self) -> list[Notification]:
        """The tags that arrived since the last call, in arrival order."""
        raise NotImplementedError

    def _tag_left(self, xfer: Any, error: str | None) -> None:
        """``xfer``'s tag has left (``error`` None), or never will: settle the write."""
        if xfer.state is XferState.PENDING:
            xfer.state, xfer.error = (XferState.DONE, None) if error is None else (XferState.ERROR, error)


# --- rows the adapter keeps, checked against registrations and peer snapshots -----------------------
@dataclass(eq=False)
class Peer:
    """A peer as its metadata described it: its name and the regions it had registered then
    (``(N, 2)`` int64 (address, length), sorted). ``gone`` says why lists prepared against this
    snapshot no longer work ("" while it is current). Adapters subclass it with what their engine
    needs to reach the peer."""

    name: str
    regions: np.ndarray
    gone: str = field(default="", init=False)


@dataclass(eq=False)
class RegionList:
    """A registration of a ``RowsAdapter``: the (address, length) of each region."""

    regions: list[tuple[int, int]] = field(default_factory=list)


class RowsAdapter(AdapterKit):
    """An adapter that keeps rows itself and moves DRAM of device 0 (module docstring). A subclass
    writes ``_peer_of(name, regions, doc)`` (the ``Peer`` its metadata describes), ``_post`` and its
    tags; ``_register`` / ``_deregister`` where its engine registers memory too."""

    ONE_DEVICE = True

    # --- memory ---------------------------------------------------------------------------------
    def _register(self, regions: list[MemoryRegion]) -> Any:
        return RegionList([(r.address, r.length) for r in regions])

    def _regions(self) -> np.ndarray:
        """This agent's registered regions, sorted (``region_index``'s form)."""
        return sorted_regions([r for reg in self._registrations for r in reg.regions])

    # --- peers ----------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        self._check_open()
        return self._write_metadata(**self._metadata_fields(), regions=self._regions().tolist())

    def _metadata_fields(self) -> dict[str, Any]:
        """What a peer needs beside the regions to reach this agent (its engine's address)."""
        return {}

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        name, peer = self._read_metadata(metadata, lambda doc: self._peer_of(
            str(doc["agent"]), sorted_regions([(int(a), int(n)) for a, n in doc["regions"]]), doc))
        old = self._peers.get(name)
        if old is not None:
            self._drop(old, f"peer {name!r} was reloaded by add_peer")
        self._peers[name] = peer
        return name

    def remove_peer(self, peer: str) -> None:
        self._drop(self._peer(peer, "remove_peer"), f"peer {peer!r} was removed")

    def _peer_of(self, name: str, regions: np.ndarray, doc: dict[str, Any]) -> Peer:
        """The ``Peer`` that metadata ``doc`` describes (raise one of ``BAD_METADATA`` on values
        that are not what they should be)."""
        raise NotImplementedError

    def _drop(self, peer: Peer, why: str) -> None:
        """Forget ``peer`` (removed, reloaded or closed): every list made for it stops working."""
        peer.gone = why
        del self._peers[peer.name]

    # --- descriptor lists -----------------------------------------------------------------------
    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> PreparedRows:
        self._check_open()
        target = None if peer is None else self._peer(peer, "prepare")
        arr = self._checked(rows, kind, target)
        if len(arr) == 0:
            raise TransportError("prepare: a descriptor list needs at least one row")
        return PreparedRows(arr, target)

    def release_prepared(self, dlist: PreparedRows) -> None:
        self._check_open()
        dlist.released = True

    def _checked(self, rows: np.ndarray, kind: MemKind, peer: Peer | None) -> np.ndarray:
        if peer is None:
            return check_rows(rows, kind, self._regions(), "this agent's")
        return check_rows(rows, kind, peer.regions, f"peer {peer.name!r}'s")

    # --- writes ---------------------------------------------------------------------------------
    def post_prepared(self, peer: str, local: PreparedRows, local_idx: np.ndarray, remote: PreparedRows,
                      remote_idx: np.ndarray, tag: bytes) -> Any:
        target = self._peer(peer, "post_prepared")
        lrows = take_rows(local.usable(None), local_idx, "local")
        rrows = take_rows(remote.usable(target), remote_idx, "remote")
        return self._post(target, lrows, rrows, tag)

    def post_descs(self, peer: str, local_rows: np.ndarray, local_kind: MemKind, remote_rows: np.ndarray,
                   remote_kind: MemKind, tag: bytes) -> Any:
        target = self._peer(peer, "post_descs")
        return self._post(target, self._checked(local_rows, local_kind, None),
                          self._checked(remote_rows, remote_kind, target), tag)

    def _post(self, peer: Any, local: np.ndarray, remote: np.ndarray, tag: bytes) -> Any:
        """Post a write of checked rows (``local[i]`` into ``remote[i]``; not yet paired: see
        ``check_pairs``) to ``peer``; returns its handle."""
        raise NotImplementedError
