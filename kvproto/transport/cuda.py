"""CUDA helpers of the kernel path: the driver calls (IPC) and the kernels' tables in pinned memory.

Theory of operation
-------------------
``driver()`` wraps the few driver calls the kernel path needs, through NVIDIA's ``cuda-bindings``
(``cuda.bindings.driver``): the driver API's own, versioned binding, where IPC is public
(PyTorch's IPC helpers are ``torch.multiprocessing`` internals). Errors become
``TransportError``; without the binding or a GPU, ``available()`` is False and callers fall back.

The kernels' small tables (tiles, page lists) go up through ``kvproto.kernels.uploads.Uploads``,
which the staged path shares (re-exported here).
"""

from __future__ import annotations

from typing import Any

from kvproto.kernels.uploads import Pointer, Uploads
from kvproto.transport.base import TransportError

__all__ = ["Driver", "Pointer", "Uploads", "driver"]

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
