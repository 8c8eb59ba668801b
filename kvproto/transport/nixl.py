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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvproto.transport.base import (
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
class NixlDescList:
    """A prepared list: NIXL's handle and the rows it was prepared from."""

    peer: str | None
    kind: MemKind
    rows: np.ndarray
    handle: Any
    invalid: str | None = None
    """Why the list can no longer be used, once released or its peer was removed or reloaded."""

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(eq=False, slots=True)
class NixlXfer:
    """One posted write: NIXL's handle and the state last seen."""

    peer: str
    handle: Any
    state: XferState
    error: str | None = None
    """Why the write polled ERROR."""
    released: bool = False


class NixlTransport:
    """A ``Transport`` over one NIXL agent with the UCX backend."""

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
        self.name = name
        self.stats = TransportStats()
        self._closed = False
        self._registrations: list[NixlRegistration] = []
        self._peers: set[str] = set()
        self._dlists: set[NixlDescList] = set()
        self._xfers: set[NixlXfer] = set()

    def memory_kinds(self) -> frozenset[MemKind]:
        self._check_open()
        types = self._agent.get_backend_mem_types(_BACKEND)
        return frozenset(_KINDS[t] for t in types if t in _KINDS)

    def register(self, regions: Sequence[MemoryRegion]) -> NixlRegistration:
        self._check_open()
        if not regions:
            raise TransportError("register: no regions given")
        regions = merge_regions(regions)  # overlapping ranges once, as their union (transport.base)
        reg = NixlRegistration([])
        try:
            for kind in sorted({r.kind for r in regions}):
                rows = as_descs(
                    [(r.address, r.length, r.device_id) for r in regions if r.kind == kind]
                )
                with _nixl(f"register {kind.name}"):
                    reg.dlists.append(self._agent.register_memory(rows, kind.name, [_BACKEND]))
        except TransportError:
            self._deregister_all(reg)
            raise
        self._registrations.append(reg)
        return reg

    def deregister(self, registration: NixlRegistration) -> None:
        self._check_open()
        if registration not in self._registrations:
            raise TransportError("deregister: registration is not registered with this agent")
        self._registrations.remove(registration)
        self._deregister_all(registration)

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
        self._invalidate(name, f"peer {name!r} was reloaded by add_peer")
        self._peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self._check_peer(peer, "remove_peer")
        self._invalidate(peer, f"peer {peer!r} was removed")
        self._peers.discard(peer)
        with _nixl(f"remove_peer {peer!r}"):
            self._agent.remove_remote_agent(peer)

    def prepare(self, peer: str | None, rows: np.ndarray, kind: MemKind) -> NixlDescList:
        self._check_open()
        arr = as_descs(rows)
        if len(arr) == 0:
            raise TransportError("prepare: cannot prepare an empty descriptor list")
        if peer is not None:
            self._check_peer(peer, "prepare")
        side = "local memory" if peer is None else f"memory of {peer!r}"
        with _nixl(f"prepare {len(arr)} {kind.name} rows of {side}", _INSIDE):
            handle = self._agent.prep_xfer_dlist(
                _LOCAL if peer is None else peer, arr, kind.name, [_BACKEND]
            )
        dlist = NixlDescList(peer, kind, arr, handle)
        self._dlists.add(dlist)
        return dlist

    def release_prepared(self, dlist: NixlDescList) -> None:
        self._check_open()
        if dlist in self._dlists:
            self._dlists.discard(dlist)
            dlist.invalid = "it was released"
            with _nixl("release_prepared"):
                dlist.handle.release()
        elif dlist.invalid is None:
            raise TransportError("release_prepared: the list was not prepared by this agent")

    def post_prepared(
        self,
        peer: str,
        local: NixlDescList,
        local_idx: np.ndarray,
        remote: NixlDescList,
        remote_idx: np.ndarray,
        tag: bytes,
    ) -> NixlXfer:
        self._check_peer(peer, "post_prepared")
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
        with _nixl(f"post_prepared to {peer!r}"):
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                local.handle,
                np.asarray(local_idx, dtype=np.int32),
                remote.handle,
                np.asarray(remote_idx, dtype=np.int32),
                bytes(tag),
                [_BACKEND],
            )
        return self._post(peer, handle, nbytes, "post_prepared")

    def post_descs(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_kind: MemKind,
        remote_rows: np.ndarray,
        remote_kind: MemKind,
        tag: bytes,
    ) -> NixlXfer:
        self._check_peer(peer, "post_descs")
        lrows, rrows = as_descs(local_rows), as_descs(remote_rows)
        nbytes = check_pairs(lrows, rrows)
        with _nixl(f"post_descs to {peer!r}", _INSIDE):
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(lrows, local_kind.name),
                self._agent.get_xfer_descs(rrows, remote_kind.name),
                peer,
                bytes(tag),
                [_BACKEND],
            )
        return self._post(peer, handle, nbytes, "post_descs")

    def poll(self, xfer: NixlXfer) -> XferState:
        self._check_open()
        if xfer.released:
            raise TransportError("poll: the write was released")
        if xfer.state is XferState.PENDING:
            try:
                state = _STATES[self._agent.check_xfer_state(xfer.handle)]
            except Exception as e:
                xfer.error = f"check_xfer_state raised {type(e).__name__}: {e}"
                state = XferState.ERROR
            self._settle(xfer, state)
        return xfer.state

    def release(self, xfer: NixlXfer) -> None:
        self._check_open()
        if xfer.released:
            return
        if xfer.state is XferState.PENDING and xfer.peer in self._peers:
            raise TransportError(
                f"release: the write to {xfer.peer!r} is still pending and its peer is present"
            )
        xfer.released = True
        self._xfers.discard(xfer)
        with _nixl("release"):
            xfer.handle.release()

    def notify(self, peer: str, tag: bytes) -> None:
        self._check_peer(peer, "notify")
        if not tag:
            raise TransportError("notify: the tag is empty")
        with _nixl(f"notify {peer!r}"):
            self._agent.send_notif(peer, bytes(tag))

    def drain_notifications(self) -> list[Notification]:
        self._check_open()
        with _nixl("drain_notifications"):
            notifs = self._agent.get_new_notifs()
        return [Notification(peer, bytes(tag)) for peer, tags in notifs.items() for tag in tags]

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

        for xfer in self._xfers:
            xfer.released = True
            attempt("release write", xfer.handle.release)
        for dlist in self._dlists:
            dlist.invalid = "the agent was closed"
            attempt("release list", dlist.handle.release)
        for reg in self._registrations:
            for rd in reg.dlists:
                attempt("deregister", self._agent.deregister_memory, rd, [_BACKEND])
        for peer in self._peers:
            attempt(f"remove peer {peer!r}", self._agent.remove_remote_agent, peer)
        self._xfers.clear()
        self._dlists.clear()
        self._registrations.clear()
        self._peers.clear()
        self._agent = None
        if errors:
            raise TransportError(f"close of {self.name!r}: " + "; ".join(errors))

    def _post(self, peer: str, handle: Any, nbytes: int, op: str) -> NixlXfer:
        try:
            with _nixl(f"{op} to {peer!r}"):
                state = _STATES[self._agent.transfer(handle)]
        except TransportError:
            handle.release()
            raise
        if state is XferState.ERROR:
            handle.release()
            raise TransportError(f"{op} to {peer!r}: NIXL refused to post the write")
        xfer = NixlXfer(peer, handle, XferState.PENDING)
        self._xfers.add(xfer)
        self.stats.writes += 1
        self.stats.bytes += nbytes
        self._settle(xfer, state)
        return xfer

    def _settle(self, xfer: NixlXfer, state: XferState) -> None:
        """Record a write's new state; count its descriptors when it becomes DONE."""
        xfer.state = state
        if state is XferState.DONE:
            with _nixl("read the telemetry of a finished write"):
                self.stats.descriptors += self._agent.get_xfer_telemetry(xfer.handle).descCount
        elif state is XferState.ERROR and xfer.error is None:
            xfer.error = "NIXL reported the write failed"

    def _deregister_all(self, reg: NixlRegistration) -> None:
        for rd in reg.dlists:
            with _nixl("deregister"):
                self._agent.deregister_memory(rd, [_BACKEND])

    def _invalidate(self, peer: str, why: str) -> None:
        for dlist in [d for d in self._dlists if d.peer == peer]:
            self._dlists.discard(dlist)
            dlist.invalid = why
            with _nixl(f"release a list prepared for {peer!r}"):
                dlist.handle.release()

    def _check_peer(self, peer: str, op: str) -> None:
        self._check_open()
        if peer not in self._peers:
            raise TransportError(f"{op}: unknown peer {peer!r}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"NIXL agent {self.name!r} is closed")
