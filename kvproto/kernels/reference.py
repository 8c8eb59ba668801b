"""Plain-torch staging copies: the reference every fast backend is tested against.

Theory of operation
-------------------
For the copy's tokens, ``page = pages[t // B]`` and ``slot = t % B`` name each token's cell;
one advanced-indexing expression per region then reads (gather) or writes (scatter) the
``(T, head_count, head_dim)`` block of that region: ``region[page, slot, heads]`` for NHD,
``region[page, heads, slot]`` for HND (PyTorch puts the broadcast index dimension first in both
cases). Tensors are viewed as integers of the same width, so every dtype (fp8 included) is
copied bit for bit.

This is deliberately the obvious code: one gather/scatter per region, an intermediate tensor
per region, any device (pinned host staging for a CUDA cache included; copies are enqueued
without waiting). It is also the "naive torch indexing" baseline of the benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvproto.geometry.model import Layout
from kvproto.kernels.plan import CopyPlan, check_staging, plan_copy, staging_heads

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
) -> torch.Tensor:
    """Copy the heads and tokens of every region of ``src`` into ``out[r, t, h, :]``."""
    plan = plan_copy(
        src,
        layout=layout,
        pages=pages,
        start_token=start_token,
        end_token=end_token,
        head_offset=head_offset,
        head_count=head_count,
    )
    if out is None:
        out = torch.empty(plan.staging_shape, dtype=plan.dtype, device=plan.device)
    else:
        check_staging(plan, out)
    page, slot = _cells(plan, pages)
    heads = slice(plan.head_offset, plan.head_offset + plan.head_count)
    for r, region in enumerate(src):
        bits = _bits(region)
        rows = bits[page, slot, heads] if plan.layout is Layout.NHD else bits[page, heads, slot]
        _bits(out[r]).copy_(rows, non_blocking=True)
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
) -> None:
    """Copy ``staging[r, t, h, :]`` into the cells of every region of ``dst``; nothing else."""
    plan = plan_copy(
        dst,
        layout=layout,
        pages=pages,
        start_token=start_token,
        end_token=end_token,
        head_offset=head_offset,
        head_count=staging_heads(staging),
    )
    check_staging(plan, staging)
    page, slot = _cells(plan, pages)
    heads = slice(plan.head_offset, plan.head_offset + plan.head_count)
    for r, region in enumerate(dst):
        rows = _bits(staging[r]).to(plan.device, non_blocking=True)
        bits = _bits(region)
        if plan.layout is Layout.NHD:
            bits[page, slot, heads] = rows
        else:
            bits[page, heads, slot] = rows


def _cells(plan: CopyPlan, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and slot of every token of the copy, on the cache's device."""
    tokens = torch.arange(plan.start_token, plan.end_token, device=plan.device)
    page = pages.to(device=plan.device, non_blocking=True).long()[tokens // plan.block_size]
    return page, tokens % plan.block_size


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS[tensor.element_size()])
