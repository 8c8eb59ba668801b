"""The staged path's I/O half: staging buffers, gathers and scatters, CUDA events polled.

Theory of operation
-------------------
A ``StagingBuffer`` is one contiguous byte tensor registered with the transport: on the decode
rank it is the region its ``StagingRing`` grants from; on the prefill rank it is where pieces
are gathered before their one bulk WRITE. It lives in device memory (GPU staging) or in pinned
host memory (host staging: for memory the transport cannot register, or where PCIe beats the
fabric); CPU caches use plain host memory.

Copies are asynchronous on CUDA: a gather or scatter is enqueued on a side stream that first
waits for the current stream, an event is recorded after it, and ``Copies.poll()`` (called
by the endpoint's progress task) runs the continuation once ``event.query()`` is true. Nothing
waits on the device and the event loop never blocks. On the CPU the copy runs at once and the
continuation is called from ``poll`` as well, so both look the same to the endpoint.

The prefill side keeps its own ``StagingRing`` over its buffer: a piece's region is reused only
after the WRITE from it is DONE (``Stager.release``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvproto import kernels
from kvproto.aio.memory import KVCache
from kvproto.core.staging import StagingRing
from kvproto.transport.base import MemKind, MemoryRegion


class StagingBuffer:
    """``capacity`` bytes for staged pieces, on ``kv``'s device or in (pinned) host memory."""

    def __init__(self, kv: KVCache, capacity: int, *, host: bool = False) -> None:
        if not kv.tensors:
            raise ValueError("the staged path needs the cache's tensors (KVCache.from_tensors)")
        device = kv.tensors[0].device
        on_host = host or device.type == "cpu"
        pin = on_host and device.type == "cuda"
        self.tensor = torch.empty(capacity, dtype=torch.uint8, device="cpu" if on_host else device, pin_memory=pin)
        self.capacity = capacity
        self.address = self.tensor.data_ptr()
        self.kind = MemKind.DRAM if on_host else MemKind.VRAM
        self.device_id = 0 if on_host else (device.index or 0)
        self.where = "host" if on_host and device.type == "cuda" else ("cpu" if on_host else "device")

    def region(self) -> MemoryRegion:
        return MemoryRegion(self.address, self.capacity, self.device_id, self.kind)

    def view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for n in shape:
            nbytes *= n
        return self.tensor[offset:offset + nbytes].view(dtype).view(*shape)


class Copies:
    """Gathers and scatters in flight, each with the continuation to run when it is done."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._pending: deque[tuple[Any, Callable[[], None]]] = deque()

    def run(self, copy: Callable[[Any], None], then: Callable[[], None]) -> None:
        """Enqueue ``copy(stream)``; ``then()`` runs from ``poll`` once it has completed."""
        if not self.cuda:
            copy(None)
            self._pending.append((None, then))
            return
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            copy(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._pending.append((event, then))

    def poll(self) -> int:
        """Run the continuations of finished copies, in order; returns how many ran."""
        ran = 0
        while self._pending:
            event, then = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            then()
            ran += 1
        return ran

    def __len__(self) -> int:
        return len(self._pending)


@dataclass(frozen=True, slots=True)
class PieceShape:
    """What one staged token of a peer pair holds: regions x heads x head_dim elements."""

    regions: int
    head_count: int
    head_dim: int
    itemsize: int

    @property
    def unit(self) -> int:
        return self.regions * self.head_count * self.head_dim * self.itemsize

    def shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (self.regions, tokens, self.head_count, self.head_dim)


def gather_piece(kv: KVCache, regions: kernels.Regions, buf: StagingBuffer, offset: int, piece: PieceShape,
                 *, pages: Sequence[int], start: int, end: int, head_offset: int, stream: Any) -> None:
    out = buf.view(offset, piece.shape(end - start), kv.torch_dtype)
    kernels.gather(regions, layout=kv.geometry.layout, pages=_pages(pages, kv), start_token=start, end_token=end,
                   head_offset=head_offset, head_count=piece.head_count, out=out, stream=stream)


def scatter_piece(kv: KVCache, regions: kernels.Regions, buf: StagingBuffer, offset: int, piece: PieceShape,
                  *, pages: Sequence[int], start: int, end: int, head_offset: int, stream: Any) -> None:
    staging = buf.view(offset, piece.shape(end - start), kv.torch_dtype)
    kernels.scatter(staging, regions, layout=kv.geometry.layout, pages=_pages(pages, kv), start_token=start,
                    end_token=end, head_offset=head_offset, stream=stream)


def _pages(pages: Sequence[int], kv: KVCache) -> torch.Tensor:
    # Page tables go to the kernels as host tensors: they are range-checked there (and by the core).
    return torch.as_tensor(pages, dtype=torch.int64)


class Stager:
    """Prefill side: local staging regions for pieces, reused only after their WRITE is DONE."""

    def __init__(self, buf: StagingBuffer) -> None:
        self.buf = buf
        self.ring = StagingRing(buf.capacity)
        self._waiting: deque[tuple[Any, Callable[[int, Any], None]]] = deque()
        self._keys = 0

    def acquire(self, nbytes: int, start: Callable[[int, Any], None]) -> None:
        """Reserve ``nbytes``; ``start(offset, key)`` runs once the region is free (maybe at once);
        ``release(key)`` returns it."""
        self._keys += 1
        key = ("piece", self._keys)
        self.ring.request(key, key, unit=nbytes, units=1)
        self._waiting.append((key, start))
        self._pump()

    def release(self, key: Any) -> None:
        self.ring.release(key)
        self._pump()

    def _pump(self) -> None:
        for grant in self.ring.take_grants():
            key, start = self._waiting.popleft()
            assert key == grant.key
            start(grant.offset, key)
