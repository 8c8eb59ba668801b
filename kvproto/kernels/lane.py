"""A CUDA stream that the host drives at the driver's cost: the kernel path's calls per write.

Theory of operation
-------------------
A write on the kernel path costs the GPU microseconds (at the 1.5 TB/s a device copy reaches on
an H100, 64 MiB take about 45 us) and the host a fixed set of stream calls: wait for the work
already queued on the caller's stream, upload the write's small table, launch, record the event
that says it is over. Through torch's Python API (``torch.cuda.stream(s)`` around the launch,
``wait_stream``, ``torch.cuda.Event().record``, a tensor slice's ``copy_``) those calls took
56 us on an H100 host in a loop of their own, and two to three times that inside the transfer
bench's prefill ranks: more than the copy itself, and a third of a prefill rank's time per room
on the kernel path. The staged path's gathers and scatters take their stream from here too
(``kvproto.aio.staging.Copies``). A ``Lane`` makes the
same calls on the driver with raw handles (``cuda.bindings.driver``: ``cuEventRecord``,
``cuStreamWaitEvent``, ``cuMemcpyHtoDAsync``; 1-4 us each there), and a launch names the lane's
stream to Triton's launcher directly (``kvproto.kernels.launcher._call``) instead of making it torch's
current stream. One mechanism, three calls:

* ``follow()``: what is launched on the lane from now on runs after the work queued so far on
  the calling thread's current stream of the device (one event recorded there, waited for here);
* ``upload(dst, src, nbytes)``: an asynchronous host-to-device copy on the lane (pinned source);
* ``record()``: an event after everything launched on the lane so far (``LaneEvent``: ``query``,
  ``synchronize``). Events are reused once ``recycle`` hands them back (their write is known to
  be over). Recording a reused event again only moves the point it marks later, so a holder of
  an old reference who queries it waits longer, never less. Events are made with blocking sync:
  a thread waiting in ``synchronize()`` (an endpoint waiting for its writes, ``kvproto.aio.ready``)
  sleeps until the device signals, instead of spinning a core in CUDA's default wait.

Without the driver binding, ``follow`` and ``record`` go through torch, and callers launch and
upload with the lane's stream made torch's current one (``raw`` says which): slower, the same
order. The lane's stream is a ``torch.cuda.Stream``, so torch's allocator and profilers know it.
"""

from __future__ import annotations

from typing import Any


class LaneEvent:
    """An event recorded on a lane: ``query()`` (has everything before it run?), ``synchronize()``.

    ``query`` runs on every pass of an endpoint's progress loop while a write is in flight, so it
    calls the driver's ``cuEventQuery`` through ``ctypes`` where ``libcuda`` loads: about 1 us on
    an H100 host, against 2.3 us through the binding (which makes an enum of every result)."""

    __slots__ = ("handle", "_cu", "_address")

    def __init__(self, handle: Any, cu: Any) -> None:
        self.handle = handle
        self._cu = cu
        self._address = int(handle)

    def query(self) -> bool:
        query = _QUERY
        if query is not None:
            err = query(self._address)
            if err == 0:
                return True
            if err == 600:  # CUDA_ERROR_NOT_READY
                return False
            raise RuntimeError(f"cuEventQuery: CUDA error {err}")
        (err,) = self._cu.cuEventQuery(self.handle)
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery: CUDA error {int(err)} ({err!r})")

    def synchronize(self) -> None:
        (err,) = self._cu.cuEventSynchronize(self.handle)
        if err != _SUCCESS:
            raise RuntimeError(f"cuEventSynchronize: CUDA error {int(err)} ({err!r})")


_SUCCESS: Any = 0
_NOT_READY: Any = 600
"""``CUDA_SUCCESS`` and ``CUDA_ERROR_NOT_READY`` as the binding returns them (set by ``_binding``)."""
_QUERY: Any = None
"""``cuEventQuery`` of ``libcuda`` through ``ctypes`` (set by ``_binding`` where it loads)."""


class Lane:
    """One stream of this process on ``device``, driven through the driver where it can be
    (module docstring)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = torch.cuda.Stream(device=device)
        """The lane's stream, as torch knows it."""
        self.handle: int = self.stream.cuda_stream
        """Its raw ``CUstream``, as launchers take it."""
        self._cu = _binding()
        self._join: Any = None
        self._free: list[LaneEvent] = []
        """Events whose writes are over, to be recorded again (``recycle``)."""
        self._made: list[Any] = []
        """Every event handle created, destroyed by ``close``."""
        if self._cu is not None:
            self._join = self._event()

    @property
    def raw(self) -> bool:
        """Whether the lane's calls go to the driver (else through torch)."""
        return self._cu is not None

    def follow(self) -> None:
        """Work launched on the lane from now on runs after the work queued so far on the calling
        thread's current stream of the device."""
        import torch

        if self._cu is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            return
        current = torch._C._cuda_getCurrentRawStream(self.index)
        if current != self.handle:
            self._check("cuEventRecord", self._cu.cuEventRecord(self._join, current))
            self._check("cuStreamWaitEvent", self._cu.cuStreamWaitEvent(self.handle, self._join, 0))

    def wait_events(self, events: Any) -> None:
        """Work launched on the lane from now on runs after each of ``events`` (CUDA events of any
        stream: ``torch.cuda.Event``) completes; the host does not wait."""
        for event in events:
            if self._cu is None:
                self.stream.wait_event(event)
            else:
                handle = self._cu.CUevent(int(event.cuda_event))
                self._check("cuStreamWaitEvent", self._cu.cuStreamWaitEvent(self.handle, handle, 0))

    def upload(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from pinned host memory at ``src`` to device memory at ``dst``, on the lane
        (asynchronously: ``src`` must stay as it is until an event recorded after it completes).
        Only where ``raw``; otherwise callers copy through torch, with the lane's stream current."""
        self._check("cuMemcpyHtoDAsync", self._cu.cuMemcpyHtoDAsync(dst, src, nbytes, self.handle))

    def record(self) -> Any:
        """An event after everything launched on the lane so far (``LaneEvent``, or a
        ``torch.cuda.Event`` without the driver binding)."""
        if self._cu is None:
            import torch

            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
            return event
        event = self._free.pop() if self._free else LaneEvent(self._event(), self._cu)
        self._check("cuEventRecord", self._cu.cuEventRecord(event.handle, self.handle))
        return event

    def recycle(self, event: Any) -> None:
        """``event`` (of ``record``) has completed and its write is over: it may be recorded again."""
        if event.__class__ is LaneEvent and len(self._free) < 256:
            self._free.append(event)

    def close(self) -> None:
        """Wait for the lane's work, then destroy its events (none may be used after this)."""
        self.stream.synchronize()
        if self._cu is not None:
            for handle in self._made:
                self._cu.cuEventDestroy(handle)
        self._made.clear()
        self._free.clear()

    def _event(self) -> Any:
        cu = self._cu
        flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        handle = self._check("cuEventCreate", cu.cuEventCreate(flags))
        self._made.append(handle)
        return handle

    @staticmethod
    def _check(what: str, result: Any) -> Any:
        err, *rest = result
        if err != _SUCCESS:
            raise RuntimeError(f"{what}: CUDA error {int(err)} ({err!r})")
        return rest[0] if rest else None


def _binding() -> Any:
    """``cuda.bindings.driver`` where it imports (None: torch makes the lane's calls); its two
    result codes that the lane tells apart are kept for ``LaneEvent.query``."""
    global _SUCCESS, _NOT_READY
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    _SUCCESS, _NOT_READY = driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_NOT_READY
    global _QUERY
    if _QUERY is None:
        try:
            import ctypes

            query = ctypes.CDLL("libcuda.so.1").cuEventQuery
            query.argtypes, query.restype = [ctypes.c_void_p], ctypes.c_int
            _QUERY = query
        except (OSError, AttributeError):
            pass
    return driver
