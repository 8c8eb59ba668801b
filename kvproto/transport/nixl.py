"""The NIXL adapter: one NIXL agent with the UCX backend, driven only by its owner's calls.

Theory of operation
-------------------
The agent runs without NIXL's progress and listener threads (the progress thread spins a
core), so the UCX worker advances only inside this adapter's calls:

* ``poll`` (``check_xfer_state``) advances the initiator's side; a WRITE's notification is
  sent from there, so every posted write must be polled until it leaves PENDING.
* ``drain_notifications`` (``get_new_notifs``) advances the target's side; a target that stops
  draining stalls large writes aimed at it. It also carries the handshake of a first ``notify``
  to a peer, so the sender must drain too.

Prepared lists go through ``prep_xfer_dlist`` (local memory under ``NIXL_INIT_AGENT``) and
writes over them through ``make_prepped_xfer``, where NIXL merges consecutive index pairs whose
memory is contiguous on both sides and whose rows have equal length. ``post_descs`` uses
``initialize_xfer``, which posts the rows unmerged. Per-request telemetry is on, so the number
of descriptors a write really used is added to ``stats.descriptors`` when it polls DONE.

*Writes of one pass share a transfer* (``batch_writes``). Each NIXL transfer costs the host its
own request, post, polls, telemetry and release, and each notification its own message: tens of
microseconds, where a room of a few pages costs the link a few. So a write to a peer that reads
notification lists (the endpoint says so with ``batch_writes(peer)``: kvproto 1.6) posted through
``post_prepared`` does not post at once: it waits in ``_waiting`` until the pass ends — the next
``poll``, ``drain_notifications``, ``flush``, ``release_prepared``, removal or close — and
``_post_waiting`` then posts each peer's waiting writes over the same two lists as one transfer
(up to ``BATCH`` writes and ``BATCH_BYTES``), its indices those of the writes one after another
and its notification the list of their tags (``pack_tags``). Every write of a transfer polls its
state; the transfer is released with its last write. A transfer that fails fails every write it
carries, and only those. ``drain_notifications`` turns a list back into its tags, so that the
endpoint above sees one notification per write as before. Checks stay at ``post_prepared``: a bad
index still raises there, for the one write. What does not wait: a write without a tag (nothing to
list), a write above ``BATCH_BYTES`` (its bytes, not its fixed costs, bound it, and separate
transfers progress side by side: on one GPU a layer of 16 rooms' 4 MiB writes as one transfer
moved them one after another, 19.6 ms against a tail of 5 ms as 16 transfers), and ``post_descs``
(NIXL checks those rows itself, when the transfer is made: in a batch one bad row would fail the
other writes).

Regions of one ``register`` call that overlap are registered once, as their union
(``merge_regions``): NIXL 1.5.1 accepts overlapping registrations but then looks a descriptor up in
one of them only, refusing (``NIXL_ERR_NOT_FOUND``) a row that lies in the union but not in that
one, and a range registered twice crashes the process when it is deregistered (SIGSEGV);
``tests/transport/test_nixl_overlap.py`` shows both on NIXL itself.

NIXL invalidates the lists prepared for a peer when the peer is removed or its metadata is
loaded again; the adapter tracks lists by peer and releases them at that moment. Every NIXL
exception is re-raised as ``TransportError`` naming the operation; indices, pairing and peers
are checked here first so that the common mistakes get precise messages.

On a machine with no InfiniBand device the adapter keeps UCX from loading its ``ib`` module
(``UCX_MODULES=^ib``, unless ``UCX_MODULES`` is set): that module only pulls in the system's
libibverbs and with it a second copy of libnl-route beside the one NIXL's wheel bundles, and
the two crash the process at exit (SIGSEGV in ``rtnl_tc_unregister`` from the bundled copy's
destructor; seen with NIXL 1.5.1 once Debian's libibverbs1 is installed).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvproto.transport.base import (
    LIST_MAGIC,
    MemKind,
    MemoryRegion,
    Notification,
    TransportError,
    XferState,
    as_descs,
    pack_tags,
    unpack_tags,
)
from kvproto.transport.kit import AdapterKit, TrackedList, TrackedLists


def _has_infiniband() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


if not _has_infiniband():
    os.environ.setdefault("UCX_MODULES", "^ib")


def _import_api() -> ModuleType:
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise ImportError("NIXL is not importable (" + "; ".join(errors) + ")")


_api = _import_api()
_BACKEND = "UCX"
_LOCAL = "NIXL_INIT_AGENT"
_STATES = {"PROC": XferState.PENDING, "DONE": XferState.DONE, "ERR": XferState.ERROR}
_KINDS = {"DRAM_SEG": MemKind.DRAM, "VRAM_SEG": MemKind.VRAM}


@contextmanager
def _nixl(op: str, hint: str = "") -> Iterator[None]:
    """Re-raise any exception from NIXL as ``TransportError`` naming ``op`` and the cause."""
    try:
        yield
    except Exception as e:
        detail = f" ({hint})" if hint else ""
        raise TransportError(f"{op}: NIXL failed: {type(e).__name__}: {e}{detail}") from e


_INSIDE = "each row must lie inside one region its owner registered, on the row's device"


@dataclass(eq=False, slots=True)
class NixlRegistration:
    """NIXL registration lists of one ``register`` call, one per memory kind."""

    dlists: list[Any]


@dataclass(eq=False, slots=True)
class NixlDescList(TrackedList):
    """A prepared list: NIXL's handle beside the rows it was prepared from."""

    handle: Any


@dataclass(eq=False, slots=True)
class _Transfer:
    """One NIXL transfer: its handle, the state last seen, and the writes riding in it that are not
    released yet (one, or a pass's writes to one peer)."""

    handle: Any
    state: XferState
    riders: int
    error: str | None = None


@dataclass(eq=False, slots=True)
class NixlXfer:
    """One posted write: the transfer it rides in (None while it waits for its pass, or where its
    transfer could not be posted) and the state last seen."""

    peer: str
    transfer: _Transfer | None
    state: XferState
    error: str | None = None
    """Why the write polled ERROR."""
    released: bool = False


@dataclass(eq=False, slots=True)
class _Waiting:
    """A write waiting for its pass to end (``_post_waiting``)."""

    xfer: NixlXfer
    local: NixlDescList
    local_idx: np.ndarray
    remote: NixlDescList
    remote_idx: np.ndarray
    tag: bytes
    nbytes: int


class NixlTransport(TrackedLists, AdapterKit):
    """A ``Transport`` over one NIXL agent with the UCX backend."""

    KIND = "NIXL"
    KINDS = None  # what the UCX backend registers (memory_kinds)

    def __init__(self, name: str) -> None:
        config = _api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            capture_telemetry=True,
            backends=[_BACKEND],
        )
        with _nixl("create agent"):
            self._agent = _api.nixl_agent(name, config)
        if _BACKEND not in self._agent.backends:
            raise TransportError(f"create agent: NIXL has no {_BACKEND} backend plugin")
        super().__init__(name)
        self._lists: set[NixlDescList] = set()
        self._xfers: set[_Transfer] = set()
        """Transfers whose handles this agent still holds (released with their last write)."""
        self._batched: set[str] = set()
        """Peers that read notification lists (``batch_writes``)."""
        self._waiting: list[_Waiting] = []
        self.transfers = 0
        """NIXL transfers posted (a batch of writes counts once; ``stats.writes`` counts writes)."""

    BATCH = 64
    """The most writes in one transfer."""
    BATCH_BYTES = 1 << 20
    """Writes up to this size wait for their pass; a transfer of batched writes stays within it."""

    def batch_writes(self, peer: str) -> None:
        """``peer``'s adapter reads notification lists: writes posted to it through
        ``post_prepared`` wait for the pass to end and go as one transfer (module docstring)."""
        self._peer(peer, "batch_writes")
        self._batched.add(peer)

    def flush(self) -> None:
        """Post the writes waiting for their pass now."""
        self._check_open()
        self._post_waiting()

    def memory_kinds(self) -> frozenset[MemKind]:
        self._check_open()
        types = self._agent.get_backend_mem_types(_BACKEND)
        return frozenset(_KINDS[t] for t in types if t in _KINDS)

    def _register(self, regions: list[MemoryRegion]) -> NixlRegistration:
        reg = NixlRegistration([])
        try:
            for kind in sorted({r.kind for r in regions}):
                rows = as_descs(
                    [(r.address, r.length, r.device_id) for r in regions if r.kind == kind]
                )
                with _nixl(f"register {kind.name}"):
                    reg.dlists.append(self._agent.register_memory(rows, kind.name, [_BACKEND]))
        except TransportError:
            self._deregister(reg)
            raise
        return reg

    def _deregister(self, reg: NixlRegistration) -> None:
        for rd in reg.dlists:
            with _nixl("deregister"):
                self._agent.deregister_memory(rd, [_BACKEND])

    def metadata(self) -> bytes:
        self._check_open()
        with _nixl("metadata"):
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        with _nixl("add_peer"):
            raw = self._agent.add_remote_agent(metadata)
        try:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            with _nixl("add_peer (undoing an agent with an undecodable name)"):
                self._agent.remove_remote_agent(raw)
            raise TransportError(f"add_peer: the peer's agent name {raw!r} is not UTF-8") from None
        return self._new_peer(name, name)

    def _removed(self, peer: str) -> None:
        with _nixl(f"remove_peer {peer!r}"):
            self._agent.remove_remote_agent(peer)

    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> NixlDescList:
        self._check_open()
        arr = as_descs(rows)
        if len(arr) == 0:
            raise TransportError("prepare: cannot prepare an empty descriptor list")
        if peer is not None:
            self._peer(peer, "prepare")
        side = "local memory" if peer is None else f"memory of {peer!r}"
        with _nixl(f"prepare {len(arr)} {kind.name} rows of {side}", _INSIDE):
            handle = self._agent.prep_xfer_dlist(
                _LOCAL if peer is None else peer, arr, kind.name, [_BACKEND]
            )
        return self._track(NixlDescList(peer, kind, arr, handle))

    def _retire(self, dlist: NixlDescList) -> None:  # type: ignore[override]
        with _nixl(f"release a list prepared for {dlist.peer or 'local memory'!r}"):
            dlist.handle.release()

    def release_prepared(self, dlist: Any) -> None:
        if self._waiting:
            self._post_waiting()  # a waiting write may be over this list
        super().release_prepared(dlist)

    def _invalidate(self, peer: str, why: str) -> None:
        """A peer removed or reloaded: its waiting writes fail (their lists are going) before
        its lists are retired."""
        for w in self._waiting:
            if w.xfer.peer == peer:
                w.xfer.state, w.xfer.error = XferState.ERROR, f"not posted: {why}"
        self._waiting = [w for w in self._waiting if w.xfer.peer != peer]
        self._batched.discard(peer)
        super()._invalidate(peer, why)

    def _post_prepared(self, peer: str, local: NixlDescList, local_idx: np.ndarray, remote: NixlDescList,
                       remote_idx: np.ndarray, tag: bytes, nbytes: int) -> NixlXfer:
        if tag and peer in self._batched and nbytes <= self.BATCH_BYTES:
            xfer = NixlXfer(peer, None, XferState.PENDING)  # indices copied: they wait beyond the call
            self._waiting.append(_Waiting(xfer, local, np.array(local_idx, dtype=np.int32), remote,
                                          np.array(remote_idx, dtype=np.int32), bytes(tag), nbytes))
            self._count(0, nbytes)
            return xfer
        transfer = self._post(peer, self._prepped(peer, local, local_idx, remote, remote_idx, bytes(tag)), "post_prepared")
        self._count(0, nbytes)  # its descriptors once NIXL says how many (_settle)
        return NixlXfer(peer, transfer, transfer.state)

    def _prepped(self, peer: str, local: NixlDescList, local_idx: np.ndarray, remote: NixlDescList,
                 remote_idx: np.ndarray, tag: bytes) -> Any:
        try:
            return self._agent.make_prepped_xfer(
                "WRITE", local.handle, np.asarray(local_idx, dtype=np.int32), remote.handle,
                np.asarray(remote_idx, dtype=np.int32), tag, [_BACKEND])
        except Exception as e:
            raise TransportError(f"post_prepared to {peer!r}: NIXL failed: {type(e).__name__}: {e}") from e

    def _post_waiting(self) -> None:
        """Post the writes that waited for their pass: each run of a peer's writes over the same two
        lists as one transfer whose notification lists their tags (a run of one: its own tag). A
        transfer NIXL refuses fails the writes it would have carried, not the caller."""
        waiting, self._waiting = self._waiting, []
        runs: list[list[_Waiting]] = []
        open_runs: dict[tuple[str, int, int], tuple[list[_Waiting], int]] = {}
        """The run each (peer, local list, remote list) adds to now, and its bytes."""
        for w in waiting:
            key = (w.xfer.peer, id(w.local), id(w.remote))
            run, nbytes = open_runs.get(key, (None, 0))
            if run is None or len(run) >= self.BATCH or nbytes + w.nbytes > self.BATCH_BYTES:
                run, nbytes = [], 0
                runs.append(run)
            run.append(w)
            open_runs[key] = (run, nbytes + w.nbytes)
        for run in runs:
            first = run[0]
            try:
                if len(run) == 1:
                    handle = self._prepped(first.xfer.peer, first.local, first.local_idx, first.remote,
                                           first.remote_idx, first.tag)
                else:
                    handle = self._prepped(first.xfer.peer, first.local, np.concatenate([w.local_idx for w in run]),
                                           first.remote, np.concatenate([w.remote_idx for w in run]),
                                           pack_tags([w.tag for w in run]))
                transfer = self._post(first.xfer.peer, handle, "post_prepared", riders=len(run))
            except TransportError as exc:
                for w in run:
                    w.xfer.state, w.xfer.error = XferState.ERROR, str(exc)
                continue
            for w in run:
                w.xfer.transfer = transfer

    def _post_descs(self, peer: str, local: np.ndarray, local_kind: MemKind, remote: np.ndarray,
                    remote_kind: MemKind, tag: bytes, nbytes: int) -> NixlXfer:
        with _nixl(f"post_descs to {peer!r}", _INSIDE):
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, local_kind.name),
                self._agent.get_xfer_descs(remote, remote_kind.name),
                peer,
                bytes(tag),
                [_BACKEND],
            )
        transfer = self._post(peer, handle, "post_descs")
        self._count(0, nbytes)
        return NixlXfer(peer, transfer, transfer.state)

    def poll(self, xfer: NixlXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("poll: the write was released")
        if xfer.state is XferState.PENDING:
            if self._waiting:
                self._post_waiting()
            transfer = xfer.transfer
            if transfer is not None:
                if transfer.state is XferState.PENDING:
                    try:
                        state = _STATES[self._agent.check_xfer_state(transfer.handle)]
                    except Exception as e:
                        transfer.error = f"check_xfer_state raised {type(e).__name__}: {e}"
                        state = XferState.ERROR
                    self._settle(transfer, state)
                xfer.state, xfer.error = transfer.state, transfer.error
        return xfer.state

    def release(self, xfer: NixlXfer) -> None:
        self._check_open()
        if xfer.released:
            return
        self._check_release(xfer, xfer.peer, xfer.peer in self._peers)
        xfer.released = True
        transfer = xfer.transfer
        if transfer is None:  # never posted: its pass failed it, or its peer went first (_invalidate)
            return
        transfer.riders -= 1
        if transfer.riders == 0:
            self._xfers.discard(transfer)
            try:
                transfer.handle.release()
            except Exception as e:
                raise TransportError(f"release: NIXL failed: {type(e).__name__}: {e}") from e

    def notify(self, peer: str, tag: bytes) -> None:
        self._peer(peer, "notify")
        self._check_tag(tag)
        with _nixl(f"notify {peer!r}"):
            self._agent.send_notif(peer, bytes(tag))

    def drain_notifications(self) -> list[Notification]:
        """Tags that arrived, a notification list's (``pack_tags``) one by one; a list that is
        not well-formed is handed on whole, for the receiver to drop as the tag it is not."""
        self._check_open()
        if self._waiting:
            self._post_waiting()
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:
            raise TransportError(f"drain_notifications: NIXL failed: {type(e).__name__}: {e}") from e
        out = []
        for peer, tags in notifs.items():
            for tag in tags:
                tag = bytes(tag)
                listed = unpack_tags(tag) if tag[:2] == LIST_MAGIC else None
                if listed is None:
                    out.append(Notification(peer, tag))
                else:
                    out += (Notification(peer, one) for one in listed)
        return out

    def close(self) -> None:
        """Release every handle, deregister all memory, remove all peers; then drop the agent.

        Every step is tried even if an earlier one failed; the first failure is raised at the
        end, with the adapter closed either way."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []

        def attempt(op: str, fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as e:
                errors.append(f"{op}: {type(e).__name__}: {e}")

        for w in self._waiting:
            w.xfer.state, w.xfer.error, w.xfer.released = XferState.ERROR, "the agent was closed", True
        self._waiting.clear()
        for transfer in self._xfers:
            attempt("release write", transfer.handle.release)
        for dlist in self._lists:
            dlist.invalid = "the agent was closed"
            attempt("release list", dlist.handle.release)
        for reg in self._registrations:
            for rd in reg.dlists:
                attempt("deregister", self._agent.deregister_memory, rd, [_BACKEND])
        for peer in self._peers:
            attempt(f"remove peer {peer!r}", self._agent.remove_remote_agent, peer)
        self._xfers.clear()
        self._lists.clear()
        self._registrations.clear()
        self._peers.clear()
        self._agent = None
        if errors:
            raise TransportError(f"close of {self.name!r}: " + "; ".join(errors))

    def _post(self, peer: str, handle: Any, op: str, riders: int = 1) -> _Transfer:
        """Start the transfer of ``handle``, which carries ``riders`` writes."""
        try:
            state = _STATES[self._agent.transfer(handle)]
        except Exception as e:
            handle.release()
            raise TransportError(f"{op} to {peer!r}: NIXL failed: {type(e).__name__}: {e}") from e
        if state is XferState.ERROR:
            handle.release()
            raise TransportError(f"{op} to {peer!r}: NIXL refused to post the write")
        transfer = _Transfer(handle, XferState.PENDING, riders)
        self._xfers.add(transfer)
        self.transfers += 1
        self._settle(transfer, state)
        return transfer

    def _settle(self, transfer: _Transfer, state: XferState) -> None:
        """Record a transfer's new state; count its descriptors when it becomes DONE."""
        transfer.state = state
        if state is XferState.DONE:
            with _nixl("read the telemetry of a finished write"):
                self.stats.descriptors += self._agent.get_xfer_telemetry(transfer.handle).descCount
        elif state is XferState.ERROR and transfer.error is None:
            transfer.error = "NIXL reported the write failed"
