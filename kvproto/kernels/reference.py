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
without waiting). It is also the "naive torch indexing" baseline of the benchmark. Like every
backend it takes a checked ``CopyPlan`` (``kvproto.kernels.plan``); ``kvproto.kernels.gather(...,
backend="torch")`` runs it.
"""

from __future__ import annotations

import torch

from kvproto.geometry.model import Layout
from kvproto.kernels.plan import CopyPlan

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy(plan: CopyPlan, pages: torch.Tensor, staging: torch.Tensor, *, to_staging: bool) -> None:
    """A checked copy (``kvproto.kernels.gather`` and ``scatter``): gather or scatter."""
    (gather if to_staging else scatter)(plan, pages, staging)


def gather(plan: CopyPlan, pages: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the heads and tokens of every region of ``plan`` into ``out[r, t, h, :]``."""
    page, slot = _cells(plan, pages)
    heads = slice(plan.head_offset, plan.head_offset + plan.head_count)
    for r, region in enumerate(plan.regions):
        bits = _bits(region)
        rows = bits[page, slot, heads] if plan.layout is Layout.NHD else bits[page, heads, slot]
        _bits(out[r]).copy_(rows, non_blocking=True)


def scatter(plan: CopyPlan, pages: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy ``staging[r, t, h, :]`` into the cells of every region of ``plan``; nothing else."""
    page, slot = _cells(plan, pages)
    heads = slice(plan.head_offset, plan.head_offset + plan.head_count)
    for r, region in enumerate(plan.regions):
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
