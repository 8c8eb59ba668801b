"""Staging copies for caches in host memory: whole-page selects and page-run slices.

Theory of operation
-------------------
The reference indexes every (token, head) cell, which the CPU does slowly (one gather per
element). Here a copy walks the request's tokens in *page runs* (the tokens of one page):

* gather selects the head slice of the touched pages of a region in one ``index_select``, then
  copies the run's tokens out of that block into the staging tensor;
* scatter writes each page run's head slice with one strided slice assignment.

Both copy exactly the cells of the contract (a checked ``CopyPlan``: ``kvproto.kernels.plan``):
gather reads a little more than it keeps (whole pages), scatter writes exactly the staged cells
and nothing else.
Tensors are viewed as same-width integers, so every dtype is copied bit for bit.
"""

from __future__ import annotations

import torch

from kvproto.geometry.model import Layout
from kvproto.kernels.plan import CopyPlan

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS[tensor.element_size()])


def copy(plan: CopyPlan, pages: torch.Tensor, staging: torch.Tensor, *, to_staging: bool) -> None:
    """A checked copy (``kvproto.kernels.gather`` and ``scatter``): gather or scatter."""
    (gather if to_staging else scatter)(plan, pages, staging)


def gather(plan: CopyPlan, pages: torch.Tensor, out: torch.Tensor) -> None:
    start_token, end_token, head_count = plan.start_token, plan.end_token, plan.head_count
    if end_token == start_token:
        return
    block = plan.block_size
    first, last = start_token // block, (end_token - 1) // block
    index = pages[first:last + 1].to(torch.long)
    skip = start_token - first * block
    heads = slice(plan.head_offset, plan.head_offset + head_count)
    for r, region in enumerate(plan.regions):
        bits = _bits(region)
        if plan.layout is Layout.HND:  # the pages' head slice only, (P, hc, B, D) -> (P, B, hc, D)
            sel = bits[:, heads].index_select(0, index).transpose(1, 2)
        else:  # (P, B, hc, D)
            sel = bits[:, :, heads].index_select(0, index)
        rows = sel.reshape(-1, head_count, sel.shape[-1])[skip:skip + end_token - start_token]
        _bits(out[r]).copy_(rows)


def scatter(plan: CopyPlan, pages: torch.Tensor, staging: torch.Tensor) -> None:
    start_token, end_token = plan.start_token, plan.end_token
    block = plan.block_size
    heads = slice(plan.head_offset, plan.head_offset + plan.head_count)
    runs = []
    t = start_token
    page_list = pages.tolist()
    while t < end_token:
        index, slot = divmod(t, block)
        n = min(end_token - t, block - slot)
        runs.append((page_list[index], slot, t - start_token, n))
        t += n
    for r, region in enumerate(plan.regions):
        bits, rows = _bits(region), _bits(staging[r])
        for page, slot, offset, n in runs:
            if plan.layout is Layout.NHD:
                bits[page, slot:slot + n, heads] = rows[offset:offset + n]
            else:
                bits[page, heads, slot:slot + n] = rows[offset:offset + n].transpose(0, 1)
