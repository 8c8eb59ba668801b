"""A kernel-path write after it is posted: waiting for its pass, launched, finished, its tag sent.

Theory of operation
-------------------
The adapter (``kvproto.transport.cuda_ipc.adapter``) checks and plans a write; ``WriteRunner``, a
mixin of it, runs it. Rooms of one forward pass, or of one progress pass, reach the adapter one
``post`` after another, and each launch costs the host tens of microseconds (the tables'
upload, the launcher, the event) where a room of a few MiB costs the link about as much. So a
write of one rows launch (the common one: a room's or a layer's pages) does not launch at once:
it waits in ``_deferred`` until the pass ends — the next ``poll``, ``drain_notifications``,
``flush``, removal or close — and ``_flush`` then launches each run of a peer's consecutive
waiting writes whose recipes share a ``batch_key`` as one kernel (``kvproto.kernels.paged.PagedBatch``:
its grid's second axis is writes x regions, each write reading its own pages and token range).
Every launch, batched or not, records its own event, and the writes finish in launch order
(``_advance``: one event query per pass), each sending its tag in order per peer
(``_send_tags``). What bounds a batch: ``BATCH_BYTES`` (its rooms end together, with its last
byte), ``BATCH`` writes and the grid. Writes of other shapes (several launches, descriptor rows,
patterns) launch at once, after the waiting ones, so each peer's launches keep posting order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvproto.kernels.lane import Lane
from kvproto.transport.base import TransportError, XferState

if TYPE_CHECKING:
    from kvproto.transport.cuda_ipc.adapter import _Peer
    from kvproto.transport.cuda_ipc.launches import _Launch

log = logging.getLogger("kvproto.transport")

GRID_Y = 65535
"""CUDA's limit on a grid's second axis, which a batch fills with writes x regions."""


@dataclass(eq=False)
class KernelXfer:
    peer: str
    tag: bytes
    event: Any
    keep: tuple[Any, ...]
    """Tensors the kernel reads (tile table, staging of the tables) until it has run."""
    state: XferState = XferState.PENDING
    released: bool = False
    error: str | None = None
    finished: bool = False
    """The kernel has run; the write is DONE once its tag has left."""
    owner: bool = False
    """The last write of its launch: it hands the launch's event back to the lane."""


class _Done:
    """The event of a kernel that ran synchronously (the CPU interpreter)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class WriteRunner:
    """The running of posted writes (module docstring); a mixin of ``CudaIpcTransport``."""

    def _run(self, mapped: _Peer, launches: Sequence[_Launch], tag: bytes) -> KernelXfer:
        """Post one write's kernels: a write of one rows launch, smaller than ``BATCH_BYTES``, waits
        in ``_deferred`` for the others of its pass (``_flush``, which every poll, drain and removal
        calls first); any other write runs at once, after the waiting ones (launch order is
        completion order).
        On the GPU the write follows the work already queued on the caller's current stream, as
        of this call (``Lane.follow``), whenever its kernel launches, and the events that
        ``wait_on_device`` gave for this peer's next write (``_after``)."""
        nbytes = sum(launch.nbytes for launch in launches)
        descriptors = sum(launch.descriptors for launch in launches)
        device = launches[0].bases.table.device
        after = self._after.pop(mapped.name, ())
        if device.type == "cuda":
            self._own_lane(device).follow()
        xfer = self._record(mapped, tag, None, (), nbytes, descriptors)
        if len(launches) == 1 and launches[0].rows is not None and nbytes < self.BATCH_BYTES:
            self._deferred.append((launches[0], xfer, after))
            return xfer
        self._flush()
        self._launch(launches, [xfer], after)
        return xfer

    def wait_on_device(self, peer: str, events: Sequence[Any]) -> bool:
        """``peer``'s next write runs on the device after ``events`` (the engine's CUDA events:
        ``torch.cuda.Event``) complete, its kernel launched now, before they do: the lane waits
        for them (``cuStreamWaitEvent``), the host does not (``kvproto.transport.base.wait_on_device``).
        True where the peer is mapped, this agent has its GPU lane and every event is a CUDA event;
        False (nothing changes) elsewhere: a fallback peer, no GPU, events of another kind. The
        caller's next write to ``peer`` must be a kernel write (GPU memory): host memory goes
        through the fallback, which cannot wait on the device."""
        self._check_open()
        if peer not in self._peers or self._lane is None:
            return False
        if not all(getattr(event, "cuda_event", None) for event in events):
            return False
        self._after[peer] = tuple(events)
        return True

    def flush(self) -> None:
        """Launch the writes posted since the last flush (``Transport.flush``)."""
        self._check_open()
        self._flush()

    def _flush(self) -> None:
        """Launch the waiting writes, each peer's in posting order, each run of a peer's
        consecutive writes whose recipes share a ``batch_key`` as one kernel
        (``kvproto.kernels.paged.PagedBatch``): the rooms of one pass to one peer and shape cost one
        table upload, one launch and one event, also where they alternate between peers (a
        prefill rank writing to two decode ranks per room). A launch that fails fails its writes
        (they poll ERROR with the cause), not the caller."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        runs: list[tuple[list[_Launch], list[KernelXfer], list[Any]]] = []
        """Each run's launches, writes, and [key, bytes, events] (a key names its peer's regions:
        one peer; events: what its writes wait for on the device, ``wait_on_device``)."""
        open_runs: dict[str, tuple[list[_Launch], list[KernelXfer], list[Any]]] = {}
        for launch, xfer, after in deferred:
            assert launch.rows is not None
            key = launch.rows.batch_key
            run = open_runs.get(xfer.peer)
            if (run is not None and run[2][0] == key and run[2][1] + launch.nbytes <= self.BATCH_BYTES
                    and len(run[1]) < min(self.BATCH, GRID_Y // launch.rows.shape.rows.regions)
                    and _same(run[2][2], after)):
                run[0].append(launch)
                run[1].append(xfer)
                run[2][1] += launch.nbytes
            else:
                run = open_runs[xfer.peer] = ([launch], [xfer], [key, launch.nbytes, after])
                runs.append(run)
        for launches, xfers, (_, _, after) in runs:
            self._launch(launches, xfers, after)

    BATCH = 256
    """The most writes in one batched launch."""
    BATCH_BYTES = 32 << 20
    """The most bytes in one batched launch (a write of more goes alone). Every write of a batch
    completes with its last byte, so a batch delays its first rooms' ends by the others' time on
    the link, and a pipeline of big rooms would run in convoys (the GPU idle while the host ends
    and posts a whole batch); a launch's host cost matters only beside a small room's link time."""

    def _launch(self, launches: Sequence[_Launch], xfers: Sequence[KernelXfer], after: Sequence[Any] = ()) -> None:
        """Run one write's launches (``xfers`` its one write), or the one rows launch of each of
        several writes as one kernel (``xfers`` those writes), on this agent's lane (on CPU
        memory: at once, in the interpreter), then the one event they wait for: every run of a
        flush its own event, so a room ends as soon as its own kernel has. On the GPU the lane
        makes the tables' uploads, the launches and the event as driver calls on raw handles
        (``kvproto.kernels.lane``); where it has no driver binding, or the caller's current device
        is another, the same calls go through torch with the lane's stream made current. The lane
        first waits for ``after`` (``wait_on_device``). A launch that raises fails these writes
        (they poll ERROR with the cause), nothing else."""
        import torch

        device = launches[0].bases.table.device
        batch = len(xfers) > 1
        keep: list[Any] = []
        try:
            if batch:  # one table and one kernel for all of them
                table, entries = self._batch_table(launches)
                run = launches[0].rows.batched()
                calls = [(table, lambda t, stream=None: run(t, entries, stream), ())]
            else:
                calls = [(launch.table, launch.go, launch.slots) for launch in launches]
            if device.type == "cpu":
                for table, go, extra in calls:
                    go(torch.from_numpy(table), *extra)
                event: Any = _Done()
            else:
                lane = self._own_lane(device)
                lane.wait_events(after)
                slots = []
                raw = lane.raw and torch.cuda.current_device() == lane.index
                stream = lane.stream if raw else None  # raw: named to each launch; else made current
                with contextlib.nullcontext() if raw else torch.cuda.stream(lane.stream):
                    for table, go, extra in calls:
                        upload, slot = self._uploads.put(table, device, lane if raw else None)
                        go(upload, *extra, stream=stream)
                        keep.append(upload)
                        slots.append(slot)
                event = lane.record()
                for slot in slots:
                    self._uploads.used(slot, event)
        except Exception as exc:  # noqa: BLE001 - nothing of these writes is known to have run
            if self._lane is not None and device.type == "cuda":
                self._uploads.seal(self._lane.record())
            why = f"the kernel launch failed: {type(exc).__name__}: {exc}"
            log.warning("kernel path: %s (%d writes fail)", why, len(xfers))
            for xfer in xfers:
                xfer.event, xfer.finished = _Done(), True
                xfer.state, xfer.error = XferState.ERROR, why
            return
        self.launches += len(calls)
        held = tuple(keep)
        for xfer in xfers:
            xfer.event, xfer.keep = event, held
            self._running.append(xfer)
        xfers[-1].owner = True

    @staticmethod
    def _batch_table(launches: Sequence[_Launch]) -> tuple[np.ndarray, np.ndarray]:
        from kvproto.kernels.paged import batch_table

        return batch_table((launch.rows.shape.rows.start, launch.rows.shape.rows.num_rows, launch.rows.shape.split,
                            launch.table) for launch in launches)

    def _record(self, mapped: _Peer, tag: bytes, event: Any, keep: tuple[Any, ...], nbytes: int,
                descriptors: int) -> KernelXfer:
        self._stats.writes += 1
        self._stats.descriptors += descriptors
        self._stats.bytes += nbytes
        xfer = KernelXfer(mapped.name, bytes(tag), event, keep)
        self._xfers.add(xfer)
        return xfer


    def _own_lane(self, device: Any) -> Lane:
        if self._lane is None:
            self._lane = Lane(device)
        return self._lane

    def _advance(self) -> None:
        """Finish the kernels that have run, oldest first: they run in launch order on this
        agent's one stream, so the first one still running ends the scan (one event query per
        call, however many writes are in flight)."""
        running = self._running
        while running and running[0].event.query():
            xfer = running.popleft()
            xfer.keep = ()
            xfer.finished = True
            if self._lane is not None and xfer.owner:
                self._lane.recycle(xfer.event)
            if xfer.state is not XferState.PENDING:
                continue  # its peer was removed meanwhile
            if not xfer.tag:
                xfer.state = XferState.DONE
                continue
            mapped = self._peers.get(xfer.peer)
            if mapped is not None:
                mapped.queue.append(xfer)
                self._send_tags(mapped)

    def _send_tags(self, mapped: _Peer) -> None:
        """Send the queued tags of finished writes to ``mapped``, in order, until its channel is full;
        each write is DONE once its tag has left (ERROR if it cannot be sent at all)."""
        while mapped.queue:
            xfer = mapped.queue[0]
            try:
                if mapped.tags is not None:
                    try:
                        if not self._tags.send(mapped.tags, self.name.encode(), xfer.tag):
                            return  # the peer's queue is full: the next poll tries again, in order
                    except OSError as exc:  # unreachable (e.g. another network namespace)
                        log.info("tags to %s go through %s: %s", mapped.name, self.fallback_name, exc)
                        mapped.tags = None
                        continue
                else:
                    self._fallback_busy()
                    self._fallback_peer(xfer.peer)
                    self._fallback.notify(xfer.peer, xfer.tag)
                xfer.state = XferState.DONE
            except TransportError as exc:
                xfer.state, xfer.error = XferState.ERROR, f"the tag could not be sent: {exc}"
            mapped.queue.popleft()


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two writes wait for the same events (``wait_on_device``): one launch may carry both."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
