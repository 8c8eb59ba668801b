"""Staging kernels: gather KV heads of every region into a contiguous tensor, scatter them back.

Theory of operation
-------------------
The staging format of one (chunk, peer pair) is a contiguous ``(R, T, head_count, head_dim)``
tensor in the cache dtype: every region ``r = layer * planes + plane`` in order, the tokens
``[start_token, end_token)``, the heads ``[head_offset, head_offset + head_count)`` of the
rank's local heads. The prefill side gathers with its own block size and layout, the decode
side scatters with its own, so block size and layout are converted on the way.
:func:`scatter` writes exactly the staged cells of ``dst`` and no other byte.

Three backends implement one contract (:mod:`kvproto.kernels.plan`): :func:`gather` and
:func:`scatter` check a copy's arguments once (a ``CopyPlan`` and its staging tensor) and hand the
plan to the Triton kernels (:mod:`kvproto.kernels.triton_kernels`, one launch for all regions),
page-run copies for host-memory caches (:mod:`kvproto.kernels.cpu`), or the plain-torch reference
(:mod:`kvproto.kernels.reference`), which only move its bytes; the tests compare every backend with
the reference through these two functions. ``backend="auto"`` picks Triton for CUDA tensors when Triton
is installed, the page-run copies for CPU tensors, the reference otherwise; ``backend="triton"`` on CPU tensors runs the
Triton interpreter and requires ``TRITON_INTERPRET=1`` in the environment. Importing this
package does not import Triton.

Pass the cache as a :class:`Regions` (validated once) to keep the per-call host cost
independent of the number of regions; a plain list of tensors works too.

Host staging: for a CUDA cache, the staging tensor may be pinned host memory (gather writes
device-to-host, scatter reads host-to-device). Work is enqueued on the current CUDA stream of
the cache's device, or on ``stream`` when given; nothing blocks on the device. The caller
records an event after the call and keeps ``staging`` (and ``pages``) alive until it fires.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch

from kvproto.geometry.model import Layout
from kvproto.kernels.plan import JOIN_MAX, CopyPlan, Regions, StagingError, check_staging, plan_copy, staging_heads

__all__ = ["JOIN_MAX", "Backend", "CopyPlan", "Regions", "StagingError", "copy_joined", "gather", "on", "plan_copy",
           "scatter", "triton_available", "warm_up"]

Backend = Literal["auto", "triton", "torch", "cpu"]


def gather(
    src: Sequence[torch.Tensor],
    *,
    layout: Layout | int,
    pages: torch.Tensor,
    start_token: int,
    end_token: int,
    head_offset: int,
    head_count: int,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
    stream: torch.cuda.Stream | None = None,
    slots: tuple | None = None,
    **options: Any,
) -> torch.Tensor:
    """Copy local heads ``[head_offset, +head_count)`` of tokens ``[start_token, end_token)``
    of every region ``src[r]`` into ``out[r, t - start_token, h - head_offset, :]``.

    ``src[r]`` is ``(num_blocks, B, H, D)`` (NHD) or ``(num_blocks, H, B, D)`` (HND);
    ``pages[i]`` holds request tokens ``[i*B, (i+1)*B)``. ``out`` (allocated on the cache's
    device when omitted) may be pinned host memory for a CUDA cache. Returns ``out``. ``slots``: a
    staged piece's state block moved in the same Triton launch (``triton_kernels.Slots``);
    ``options``: the Triton backend's tuning (``host_path``, ``tile_bytes``, ``num_warps``).
    """
    device = _device(src)
    with on(device, stream):  # (a new ``out`` is allocated on the stream that writes it)
        plan = plan_copy(src, layout=layout, pages=pages, start_token=start_token, end_token=end_token,
                         head_offset=head_offset, head_count=head_count)
        out = plan.output(out)
        _backend(backend, device, out, slots, options).copy(plan, pages, out, to_staging=True, **options)
    return out


def scatter(
    staging: torch.Tensor,
    dst: Sequence[torch.Tensor],
    *,
    layout: Layout | int,
    pages: torch.Tensor,
    start_token: int,
    end_token: int,
    head_offset: int,
    backend: Backend = "auto",
    stream: torch.cuda.Stream | None = None,
    slots: tuple | None = None,
    **options: Any,
) -> None:
    """Inverse of :func:`gather` into ``dst`` with its own block size and layout.

    ``staging[r, t, h, :]`` lands in local head ``head_offset + h`` of token
    ``start_token + t`` of region ``dst[r]``; no other byte of ``dst`` is written. Page numbers
    must be distinct (each token has one cell).
    """
    device = _device(dst)
    with on(device, stream):
        plan = plan_copy(dst, layout=layout, pages=pages, start_token=start_token, end_token=end_token,
                         head_offset=head_offset, head_count=staging_heads(staging))
        check_staging(plan, staging)
        _backend(backend, device, staging, slots, options).copy(plan, pages, staging, to_staging=False, **options)


def copy_joined(
    groups: Sequence[Regions],
    staging: torch.Tensor,
    table: torch.Tensor,
    *,
    layout: Layout | int,
    start_token: int,
    end_token: int,
    head_offset: int,
    to_staging: bool,
    stream: torch.cuda.Stream | None = None,
    slots: tuple | None = None,
    starts: Sequence[int] | None = None,
) -> None:
    """:func:`gather` (``to_staging``) or :func:`scatter` of several groups whose pages look
    alike, in one Triton launch: ``staging`` holds their blocks back to back; ``table`` is every
    group's pages from token 0 back to back, ``starts`` where each group's start (without it: a
    host table ending with each region's offset into them;
    ``kvproto.kernels.triton_kernels.prepare``). CPU tensors run in Triton's interpreter."""
    device = _device(groups[0])
    with on(device, stream):
        from kvproto.kernels import triton_kernels

        launch = triton_kernels.prepare(groups, staging, table, layout=layout, start_token=start_token,
                                        end_token=end_token, head_offset=head_offset, to_staging=to_staging,
                                        interpret=device.type != "cuda", slots=slots, starts=starts)
        if launch is not None:
            launch.run(0, launch.regions)


def triton_available() -> bool:
    """Whether the Triton kernels can run on CUDA tensors here."""
    return _have_triton()


def warm_up(regions: Regions, *, layout: Layout | int, head_counts: Sequence[int], to_staging: bool,
            host_staging: bool = False, joined: bool = False, slot_launches: Sequence[tuple[Any, int, bool]] = ()
            ) -> int:
    """Compile the Triton kernels that staged copies of ``regions`` will launch, by running each
    once on small dummy tensors of the same dtype, page shape and page stride (so the cache
    itself is never touched), on a stream of their own; returns how many variants ran.

    The kernels specialize on the head count moved and on the tile of rows a launch covers, so
    one copy of at least a tile's rows per head count compiles what a piece of any size uses.
    Meant to run in a background thread when an endpoint starts, so that the first room of a
    new link does not pay for compilation; CUDA regions with Triton only (else returns 0).
    ``joined``: also the variant that moves several groups in one launch (``copy_joined``).
    ``slot_launches``: launches that carry a state block, ``(its pattern plan, head count, joined)``
    each (``kvproto.aio.staging.state_launches``), run with one tile of no bytes: nothing is moved."""
    device = regions.device
    if device.type != "cuda" or not _have_triton():
        return 0
    from kvproto.kernels.triton_kernels import TILE_BYTES

    layout = Layout(layout)
    nb, a, b, head_dim = regions.shape
    block, heads = (a, b) if layout is Layout.NHD else (b, a)
    row_bytes = head_dim * regions.dtype.itemsize
    stream = torch.cuda.Stream(device)
    ran = 0

    def dummy_of(count: int) -> tuple[int, int, Regions, torch.Tensor]:
        """Tokens, pages, regions of the cache's page shape and stride, and their page table, for
        one copy of at least a tile's rows at ``count`` heads."""
        tokens = max(block, -(-max(1, TILE_BYTES // row_bytes) // count))
        pages = -(-tokens // block)
        dummy = Regions([torch.empty_strided((pages, *regions.shape[1:]), regions[0].stride(),
                                             dtype=regions.dtype, device=device)])
        return tokens, pages, dummy, torch.arange(pages, dtype=torch.int64)

    with torch.cuda.device(device), torch.cuda.stream(stream):
        for count in head_counts:
            tokens, pages, dummy, table = dummy_of(count)
            staging = torch.empty((1, tokens, count, head_dim), dtype=regions.dtype, device="cpu" if host_staging
                                  else device, pin_memory=host_staging)
            if to_staging:
                gather(dummy, layout=layout, pages=table, start_token=0, end_token=tokens, head_offset=0,
                       head_count=count, out=staging, stream=stream)
            else:
                scatter(staging, dummy, layout=layout, pages=table, start_token=0, end_token=tokens, head_offset=0,
                        stream=stream)
            ran += 1
            if joined and not host_staging:
                both = torch.empty((2, tokens, count, head_dim), dtype=regions.dtype, device=device)
                copy_joined([dummy, dummy], both, torch.cat([table, table, torch.tensor([0, pages])]), layout=layout,
                            start_token=0, end_token=tokens, head_offset=0, to_staging=to_staging, stream=stream)
                ran += 1
        if slot_launches:
            from kvproto.kernels.triton_kernels import Slots

            empty_tile = torch.zeros((1, 5), dtype=torch.int64, device=device)  # 0 words: the block moves nothing
            zero = torch.zeros(2, dtype=torch.int64, device=device)
        for plan, count, join in slot_launches:
            tokens, pages, dummy, table = dummy_of(count)
            n = 2 if join else 1
            staging = torch.empty((n, tokens, count, head_dim), dtype=regions.dtype, device=device)
            # a block's place in device memory is past 2**31 vectors (the shift an int64, as in a piece)
            slots = Slots(plan, empty_tile, zero, shift=1 << 40)
            copy_joined([dummy] * n, staging, torch.cat([table] * n).to(device), layout=layout, start_token=0,
                        end_token=tokens, head_offset=0, to_staging=to_staging, stream=stream, slots=slots,
                        starts=[0, pages] if join else None)
            ran += 1
    stream.synchronize()
    return ran


def _backend(backend: Backend, device: torch.device, staging: torch.Tensor, slots: tuple | None,
             options: dict[str, Any]) -> Any:
    """The module that runs a checked copy (its ``copy(plan, pages, staging, to_staging=...,
    **options)``); ``options`` gains what the Triton kernels take of the call (the interpreter for
    CPU tensors, a state block)."""
    if _use_triton(backend, device):
        from kvproto.kernels import triton_kernels

        options.update(interpret=device.type != "cuda", slots=slots)
        return triton_kernels
    if slots is not None:
        raise StagingError("a state block rides only in a Triton launch")
    if options:
        raise StagingError(f"{', '.join(options)}: options of the Triton kernels only")
    if _use_cpu(backend, device, staging):
        from kvproto.kernels import cpu

        return cpu
    from kvproto.kernels import reference

    return reference


def _device(cache: Sequence[torch.Tensor]) -> torch.device:
    return cache[0].device if len(cache) else torch.device("cpu")


def _use_cpu(backend: Backend, device: torch.device, staging: torch.Tensor | None) -> bool:
    """Whether ``backend`` means the host-memory copies (a CPU cache and CPU staging)."""
    if backend == "cpu":
        return True
    return backend == "auto" and device.type == "cpu" and (staging is None or staging.device.type == "cpu")


def _use_triton(backend: Backend, device: torch.device) -> bool:
    """Whether ``backend`` means the Triton kernels for a cache on ``device``."""
    if backend in ("torch", "cpu"):
        return False
    if backend == "auto":
        return device.type == "cuda" and _have_triton()
    if backend != "triton":
        raise StagingError(f"unknown backend {backend!r}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise StagingError(f"backend 'triton' on {device} tensors needs TRITON_INTERPRET=1")
    return True


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def on(device: torch.device, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[None]:
    """Make ``device`` current (for CUDA) and ``stream`` its current stream, if given; nothing to do
    (the common case: a staged copy runs inside its ``Copies`` stream) costs no context switch."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.current_device() == index and (
            stream is None or torch._C._cuda_getCurrentRawStream(index) == stream.cuda_stream):
        return contextlib.nullcontext()
    return _switch(device, stream)


@contextlib.contextmanager
def _switch(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.cuda.device(device))
        if stream is not None:
            stack.enter_context(torch.cuda.stream(stream))
        yield
