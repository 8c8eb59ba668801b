"""The staging copies' one contract: what a copy is, checked once before any backend runs it.

Theory of operation
-------------------
A staging copy moves the tokens ``[start_token, end_token)`` of the local heads
``[head_offset, head_offset + head_count)`` between a paged KV cache and a contiguous
*staging* tensor of shape ``(R, T, head_count, head_dim)``: region ``r`` (``layer * planes +
plane``) of the cache becomes ``staging[r]``, token ``start_token + t`` becomes row ``t``.

The cache is a sequence of ``R`` region tensors, each a separate allocation of the same shape,
``(num_blocks, block_size, heads, head_dim)`` for NHD or ``(num_blocks, heads, block_size,
head_dim)`` for HND, whose last three dimensions are dense (the page dimension may be strided).
``pages[i]`` is the page holding request tokens ``[i * block_size, (i + 1) * block_size)``.
:class:`Regions` is such a sequence checked once and then reused: the per-region checks are
the only host work that grows with the number of regions.

:func:`plan_copy` turns the arguments into a :class:`CopyPlan` or raises :class:`StagingError`
before anything is launched, and :meth:`CopyPlan.output` / :func:`check_staging` do the same for
the staging tensor: ``kvproto.kernels.gather`` and ``scatter`` check a copy once, here, and hand
the plan to a backend (the Triton kernels, the host-memory page runs, the torch reference), which
only moves its bytes: ``backend.copy(plan, pages, staging, to_staging=...)``. Page
numbers are range-checked when the page table is on the CPU; a page table already on the GPU
is trusted (reading it back would stall the stream), so callers must check indices received
from a peer before they reach a device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvproto.geometry.model import Layout


JOIN_MAX = 4
"""Most groups one staging launch moves (``copy_joined``): where each group's regions start and
where its pages start in the table are scalar arguments of the kernel, not a table it reads first."""


class StagingError(ValueError):
    """Arguments that do not describe a valid staging copy."""


class Regions(tuple[torch.Tensor, ...]):
    """An immutable, validated list of one cache's region tensors.

    Building it checks every region once (same shape, dtype, device and page stride; dense
    pages), which costs O(regions) host time; passing the same ``Regions`` to every copy makes
    the per-call host cost independent of the number of regions. A plain sequence is wrapped
    (and checked) on each call.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    page_stride: int
    table: object  # a backend's per-list state (the Triton region table), set on first use
    joined: dict  # the Triton tables of joined launches this list starts, set on first use

    def __new__(cls, tensors: Sequence[torch.Tensor]) -> Regions:
        self = super().__new__(cls, tensors)
        if len(self) == 0:
            raise StagingError("a cache needs at least one region")
        first = self[0]
        if first.dim() != 4 or first.shape[0] == 0:
            raise StagingError(f"a region must be 4-D with at least one page, got shape {tuple(first.shape)}")
        dense = (first.shape[2] * first.shape[3], first.shape[3], 1)
        for r, region in enumerate(self):
            if region.shape != first.shape or region.dtype != first.dtype or region.device != first.device:
                raise StagingError(
                    f"region {r} is {tuple(region.shape)} {region.dtype} on {region.device}, "
                    f"region 0 is {tuple(first.shape)} {first.dtype} on {first.device}"
                )
            if region.stride(0) != first.stride(0) or not _dense(region, dense):
                raise StagingError(f"region {r}: pages must be dense and share one page stride")
        self.shape, self.dtype, self.device = first.shape, first.dtype, first.device
        self.page_stride = first.stride(0)
        self.table = None
        return self


def as_regions(cache: Sequence[torch.Tensor]) -> Regions:
    """``cache`` itself when already validated, else a new :class:`Regions`."""
    return cache if isinstance(cache, Regions) else Regions(cache)


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyPlan:
    """A validated staging copy between one cache (all regions) and one staging tensor."""

    regions: Regions
    layout: Layout
    block_size: int
    heads: int
    start_token: int
    end_token: int
    head_offset: int
    head_count: int

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    @property
    def num_blocks(self) -> int:
        return self.regions.shape[0]

    @property
    def head_dim(self) -> int:
        return self.regions.shape[3]

    @property
    def page_stride(self) -> int:
        """Elements between consecutive pages of a region."""
        return self.regions.page_stride

    @property
    def dtype(self) -> torch.dtype:
        return self.regions.dtype

    @property
    def device(self) -> torch.device:
        return self.regions.device

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token

    @property
    def staging_shape(self) -> tuple[int, int, int, int]:
        return (self.num_regions, self.num_tokens, self.head_count, self.head_dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one head of one token: the unit every backend copies."""
        return self.head_dim * self.dtype.itemsize

    def output(self, out: torch.Tensor | None) -> torch.Tensor:
        """A gather's staging tensor: ``out`` checked (``check_staging``), or a new one on the
        cache's device."""
        if out is None:
            return torch.empty(self.staging_shape, dtype=self.dtype, device=self.device)
        check_staging(self, out)
        return out


def plan_copy(
    cache: Sequence[torch.Tensor],
    *,
    layout: Layout | int,
    pages: torch.Tensor,
    start_token: int,
    end_token: int,
    head_offset: int,
    head_count: int,
) -> CopyPlan:
    """Validate a copy's cache side and return its plan."""
    regions = as_regions(cache)
    layout = Layout(layout)
    _, a, b, _ = regions.shape
    block_size, heads = (a, b) if layout is Layout.NHD else (b, a)
    if not 0 <= start_token <= end_token:
        raise StagingError(f"token range [{start_token}, {end_token}) is not a range")
    if head_count <= 0 or head_offset < 0 or head_offset + head_count > heads:
        raise StagingError(f"heads [{head_offset}, {head_offset + head_count}) outside [0, {heads})")
    _check_pages(pages, block_size, regions.shape[0], start_token, end_token, regions.device)
    return CopyPlan(
        regions=regions,
        layout=layout,
        block_size=block_size,
        heads=heads,
        start_token=start_token,
        end_token=end_token,
        head_offset=head_offset,
        head_count=head_count,
    )


def check_staging(plan: CopyPlan, staging: torch.Tensor) -> None:
    """Raise unless ``staging`` can hold ``plan``'s rows (on the cache's device or pinned)."""
    if tuple(staging.shape) != plan.staging_shape or staging.dtype != plan.dtype:
        raise StagingError(
            f"staging is {tuple(staging.shape)} {staging.dtype}, "
            f"the copy needs {plan.staging_shape} {plan.dtype}"
        )
    if not staging.is_contiguous():
        raise StagingError("staging must be contiguous")
    if staging.device != plan.device and not (
        plan.device.type == "cuda" and staging.device.type == "cpu" and staging.is_pinned()
    ):
        raise StagingError(
            f"staging on {staging.device} for a cache on {plan.device}: "
            "it must be on the cache's device, or in pinned host memory for a CUDA cache"
        )


def staging_heads(staging: torch.Tensor) -> int:
    """``head_count`` of a staging tensor, checking that it is 4-D."""
    if staging.dim() != 4:
        raise StagingError(f"staging must be 4-D (R, T, heads, head_dim), got {tuple(staging.shape)}")
    return staging.shape[2]


def _dense(region: torch.Tensor, strides: tuple[int, int, int]) -> bool:
    """Whether a region's pages are dense (strides of size-1 dimensions do not matter)."""
    tail = zip(region.shape[1:], region.stride()[1:], strides, strict=True)
    return all(size == 1 or stride == want for size, stride, want in tail)


def _check_pages(
    pages: torch.Tensor,
    block_size: int,
    num_blocks: int,
    start_token: int,
    end_token: int,
    device: torch.device,
) -> None:
    if pages.dim() != 1 or pages.dtype not in (torch.int32, torch.int64):
        raise StagingError(f"pages must be a 1-D int32/int64 tensor, got {pages.dtype} {tuple(pages.shape)}")
    if pages.device.type != "cpu" and pages.device != device:
        raise StagingError(f"pages on {pages.device} for a cache on {device}")
    if start_token == end_token:
        return
    first, last = start_token // block_size, (end_token - 1) // block_size
    if pages.numel() <= last:
        raise StagingError(f"token {end_token - 1} needs page entry {last}, pages has {pages.numel()}")
    if pages.device.type == "cpu":
        used = pages[first : last + 1]
        low, high = int(used.min()), int(used.max())
        if low < 0 or high >= num_blocks:
            raise StagingError(f"page numbers [{low}, {high}] outside [0, {num_blocks})")
