"""Small tables for kernel launches (page lists, region offsets, tiles) without an allocation or a
transfer call per launch.

Theory of operation
-------------------
A launch that moves a few MiB reads a table of a few hundred bytes. Made the plain way (a tensor,
``pin_memory()``, ``.to(device)``) that table costs the host more than the copy costs the GPU, and
both paths that launch per write (the kernel path, per WRITE; the staged path, per piece) are
bound by the host. ``Uploads`` is a ring of pinned host memory with a mirror of the same size on
the device: ``put`` copies the table into the ring (a numpy slice assignment), enqueues one
asynchronous copy of that slot to the mirror on the current stream (the stream of the launch that
reads it: ``put`` is called there), and hands the kernel a ``Pointer`` into the mirror. A kernel
may read the pinned ring directly over the bus, but then every program waits for a bus round
trip before it copies: an 8 MiB staged piece took the GPU 20 µs that way (36 µs for a hybrid
piece's joined table) against 10 µs (12.5 µs) with its tables on the device, which is what the
one small copy buys (``benchmarks/piece_host.py``). A slot is reused only once the event of
the launch that read it has completed: ``used(slot, event)`` names it for one slot, ``seal(event)``
for every slot put since the last seal (a piece's launches, put before its one event exists).
Slots are freed oldest first, as the launches run in order on one stream. A table too big for
the ring, or a ring full of launches in flight, goes to the device as a tensor of its own.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

import numpy as np
import torch


class Pointer:
    """An array at ``address`` as a kernel argument: what Triton reads of a tensor (its address and
    dtype), and, for the checks of the staging kernels, what a trusted device table shows
    (``length`` entries, one dimension, on ``device``)."""

    __slots__ = ("address", "length", "device", "dtype")

    def __init__(self, address: int, length: int = 0, device: Any = None, dtype: Any = torch.int64) -> None:
        self.address = address
        self.length = length
        self.device = device
        self.dtype = dtype
        """What the kernel reads there: int64 tables; a staging launch's words (``_Launch.again``)."""

    def data_ptr(self) -> int:
        return self.address

    def __len__(self) -> int:
        return self.length

    def numel(self) -> int:
        return self.length

    def dim(self) -> int:
        return 1

    def after(self, entries: int) -> Pointer:
        """The entries from ``entries`` on."""
        return Pointer(self.address + self.dtype.itemsize * entries, self.length - entries, self.device, self.dtype)


class Uploads:
    """A ring of pinned host memory for the tables of launches in flight (module docstring)."""

    ENTRIES = 1 << 19  # int64 words: 4 MiB pinned

    def __init__(self) -> None:
        self._host: Any = None
        self._mirror: Any = None
        """The ring's copy on the device, where the kernels read it."""
        self._words: np.ndarray | None = None
        self._addresses = (0, 0)
        """The mirror's and the ring's addresses (a lane copies between them)."""
        self._head = 0
        self._live: deque[list[Any]] = deque()
        """[start, end, event] of every slot in use, oldest first; event None: its kernel is not
        launched yet (a write of several kernels holds several slots before its one event)."""

    def prepare(self, device: Any) -> None:
        """Allocate the ring and its mirror on ``device`` (the first ``put`` does, unless called
        before: a link's registration, ``CudaIpcTransport._ready_lane``)."""
        if self._host is None:
            self._host = torch.empty(self.ENTRIES, dtype=torch.int64, pin_memory=True)
            self._words = self._host.numpy()
        if self._mirror is None:
            self._mirror = torch.empty(self.ENTRIES, dtype=torch.int64, device=device)
            self._addresses = self._mirror.data_ptr(), self._host.data_ptr()

    def put(self, table: np.ndarray, device: Any, lane: Any = None) -> tuple[Any, Any]:
        """``table`` where a kernel on ``device`` reads it (call on the stream of that kernel's
        launch, or name it: ``lane``, a ``kvproto.kernels.lane.Lane`` that drives the driver, whose
        stream then copies it); returns (tensor-like, slot)."""
        n = table.size
        if self._mirror is None:
            self.prepare(device)
        start = self._reserve(n + (n & 1))  # slots start 16-byte aligned
        if start is None:
            flat = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64).reshape(-1))
            with contextlib.nullcontext() if lane is None else torch.cuda.stream(lane.stream):
                return flat.pin_memory().to(device, non_blocking=True), None
        assert self._words is not None
        self._words[start:start + n] = table.reshape(-1)
        # on the launch's stream, before the launch that reads it; the slot's event covers both
        if lane is not None:
            mirror, host = self._addresses
            lane.upload(mirror + 8 * start, host + 8 * start, 8 * n)
        else:
            self._mirror[start:start + n].copy_(self._host[start:start + n], non_blocking=True)
        slot = [start, start + n + (n & 1), None]
        self._live.append(slot)  # held from now: the next put of the same write must not reuse it
        return Pointer(self._addresses[0] + 8 * start, n, device), slot

    def used(self, slot: Any, event: Any) -> None:
        """The kernel reading ``slot`` is launched: the slot is free once ``event`` has completed."""
        if slot is not None:
            slot[2] = event

    def seal(self, event: Any) -> None:
        """Every slot put since the last seal is read by launches that ``event`` follows."""
        for slot in reversed(self._live):
            if slot[2] is not None:
                break
            slot[2] = event

    def _reserve(self, n: int) -> int | None:
        """The start of ``n`` free words, or None. Slots are released oldest first (their writes
        run in order on one stream); the free space is after the newest slot and before the oldest."""
        if n > self.ENTRIES // 4:
            return None
        while self._live and self._live[0][2] is not None and self._live[0][2].query():
            self._live.popleft()
        if not self._live:
            start = 0
        else:
            tail, head = self._live[0][0], self._head
            wrapped = self._live[-1][0] < tail
            if not wrapped and head + n <= self.ENTRIES:
                start = head
            elif not wrapped and n <= tail:
                start = 0
            elif wrapped and head + n <= tail:
                start = head
            else:
                return None
        self._head = start + n
        return start
