"""CUDA helpers of the kernel path: the driver calls (IPC) and the kernels' tables in pinned memory.

Theory of operation
-------------------
``driver()`` wraps the few driver calls the kernel path needs, through NVIDIA's ``cuda-bindings``
(``cuda.bindings.driver``): the driver API's own, versioned binding, where IPC is public
(PyTorch's IPC helpers are ``torch.multiprocessing`` internals). Errors become
``TransportError``; without the binding or a GPU, ``available()`` is False and callers fall back.

``Uploads`` hands each kernel launch its small tables (tiles, page lists) without an allocation
or a transfer call: a ring of pinned host memory that the kernel reads directly over the bus, a
slot reused only once the event of the launch that read it has completed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvproto.transport.base import TransportError

class Driver:
    """The few driver calls the adapter needs (``cuda.bindings.driver``), with errors as
    ``TransportError``. Loaded on first use; ``available()`` is False without the binding or a GPU."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver  # type: ignore[import-not-found]
        except ImportError:
            try:
                from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
            except ImportError:
                driver = None
        self.cu = driver

    def available(self) -> bool:
        if self.cu is None:
            return False
        import torch

        return torch.cuda.is_available()

    def _check(self, what: str, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise TransportError(f"{what}: CUDA error {int(err)} ({err!r})")
        return rest[0] if len(rest) == 1 else rest

    def export(self, address: int) -> tuple[bytes, int]:
        """(IPC handle, offset of ``address`` in its allocation)."""
        base, _size = self._check("cuMemGetAddressRange", self.cu.cuMemGetAddressRange(address))
        handle = self._check("cuIpcGetMemHandle", self.cu.cuIpcGetMemHandle(base))
        return bytes(handle.reserved), address - int(base)

    def open(self, handle: bytes) -> int:
        h = self.cu.CUipcMemHandle()
        h.reserved = handle
        flags = self.cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return int(self._check("cuIpcOpenMemHandle", self.cu.cuIpcOpenMemHandle(h, flags)))

    def close(self, address: int) -> None:
        self._check("cuIpcCloseMemHandle", self.cu.cuIpcCloseMemHandle(address))

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cuMemcpyDtoDAsync`` on ``stream`` (benchmarks: the raw copy a kernel path is held to)."""
        self._check("cuMemcpyDtoDAsync", self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream))

    def uuid(self, ordinal: int) -> str:
        dev = self._check("cuDeviceGet", self.cu.cuDeviceGet(ordinal))
        return bytes(self._check("cuDeviceGetUuid", self.cu.cuDeviceGetUuid(dev)).bytes).hex()

    def can_access(self, ordinal: int, peer: int) -> bool:
        if ordinal == peer:
            return True
        a = self._check("cuDeviceGet", self.cu.cuDeviceGet(ordinal))
        b = self._check("cuDeviceGet", self.cu.cuDeviceGet(peer))
        return bool(self._check("cuDeviceCanAccessPeer", self.cu.cuDeviceCanAccessPeer(a, b)))

    def enable_peer(self, ordinal: int, peer: int) -> None:
        """Let kernels on ``cuda:ordinal`` reach this process's own allocations on ``cuda:peer``
        (memory opened through IPC gets this from ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``)."""
        if ordinal == peer:
            return
        if not self.can_access(ordinal, peer):
            raise TransportError(f"cuda:{peer} is not reachable from cuda:{ordinal} (no peer access)")
        cu = self.cu
        here = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(
            self._check("cuDeviceGet", cu.cuDeviceGet(ordinal))))
        there = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(
            self._check("cuDeviceGet", cu.cuDeviceGet(peer))))
        self._check("cuCtxPushCurrent", cu.cuCtxPushCurrent(here))
        try:
            (err,) = cu.cuCtxEnablePeerAccess(there, 0)
            if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                raise TransportError(f"cuCtxEnablePeerAccess cuda:{ordinal} -> cuda:{peer}: CUDA error {int(err)} ({err!r})")
        finally:
            self._check("cuCtxPopCurrent", cu.cuCtxPopCurrent())


_driver: Driver | None = None


def driver() -> Driver:
    global _driver
    if _driver is None:
        _driver = Driver()
    return _driver


class Uploads:
    """Tile tables for the kernels: a ring of pinned host memory that the kernels read directly
    (mapped, over the bus: three words per program), so that a write costs a copy into the ring
    and no allocation, transfer call or device memory. A slot is reused only once the event of the
    write that read it has completed; a table too big for the ring (or a ring full of writes in
    flight) is copied to the device on its own."""

    ENTRIES = 1 << 19  # int64 words: 4 MiB pinned

    def __init__(self) -> None:
        self._host: Any = None
        self._words: np.ndarray | None = None
        self._head = 0
        self._live: list[list[Any]] = []
        """[start, end, event] of every slot in use, oldest first; event None: its kernel is not
        launched yet (a write of several kernels holds several slots before its one event)."""

    def put(self, tiles: np.ndarray, device: Any) -> tuple[Any, Any]:
        """``tiles`` where a kernel on ``device`` reads them; returns (tensor-like, slot)."""
        import torch

        n = tiles.size
        if self._host is None:
            self._host = torch.empty(self.ENTRIES, dtype=torch.int64, pin_memory=True)
            self._words = self._host.numpy()
        start = self._reserve(n + (n & 1))  # slots start 16-byte aligned
        if start is None:
            return torch.from_numpy(tiles.reshape(-1)).pin_memory().to(device, non_blocking=True), None
        assert self._words is not None
        self._words[start:start + n] = tiles.reshape(-1)
        slot = [start, start + n + (n & 1), None]
        self._live.append(slot)  # held from now: the next put of the same write must not reuse it
        return Pointer(self._host.data_ptr() + 8 * start), slot

    def used(self, slot: Any, event: Any) -> None:
        """The kernel reading ``slot`` is launched: the slot is free once ``event`` has completed."""
        if slot is not None:
            slot[2] = event

    def _reserve(self, n: int) -> int | None:
        """The start of ``n`` free words, or None. Slots are released oldest first (their writes
        run in order on one stream); the free space is after the newest slot and before the oldest."""
        if n > self.ENTRIES // 4:
            return None
        while self._live and self._live[0][2] is not None and self._live[0][2].query():
            self._live.pop(0)
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


class Pointer:
    """An int64 array at ``address`` as a kernel argument (what Triton reads of a tensor)."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address

    @property
    def dtype(self) -> Any:
        import torch

        return torch.int64
