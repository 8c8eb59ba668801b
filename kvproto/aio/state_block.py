"""A staged piece's state block: a hybrid room's state slots riding at the end of its last piece.

Theory of operation
-------------------
Between peers of minor 3, the staged piece that carries a request's last token ends with the
pair's *state block* (``kvproto.geometry.groups.state_block``): the state slots the prefill rank
writes into the decode rank, gathered after the piece's token blocks and scattered from there, so
that a hybrid room's last piece is still one descriptor. ``StateBlock`` is one side's view of it:
where each run lies in this rank's state slots (``side``: "prefill" reads the runs' sources,
"decode" writes their destinations) and in the block.

It moves three ways, fastest first: riding in the piece's last staging launch (``fused``: the
block's tiles put on the device once per direction, a piece passing only each group's slot and
the block's place, ``kvproto.kernels.triton_kernels.Slots``); one pattern launch of its own
(``tiles``, ``copy``: the tiles shifted per choice of slots, kept); or run by run (a memmove per
run between host memories). ``kvproto.aio.staging`` plans the pieces that carry it (``Piece``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvproto.aio.memory import StateCache, bytes_at
from kvproto.geometry.groups import BlockRun, block_bytes
from kvproto.transport import MemKind

if TYPE_CHECKING:
    from kvproto.aio.staging import StagingBuffer


_BLOCK_SIDE = {True: np.array([0, 1, 0], dtype=np.int64), False: np.array([1, 0, 0], dtype=np.int64)}
"""The column of a state block's tiles (source, destination, length) that lies in the block."""


class StateBlock:
    """One side's view of a pair's state block (``kvproto.geometry.groups.state_block``): where
    each run lies in this rank's state slots (``side``: "prefill" reads the runs' sources, "decode"
    writes their destinations) and in the block; ``copy`` moves a piece's block between the slots
    and the staging buffer. ``unit``: the pair's bytes per token (a block starts ``tokens x unit``
    bytes into its piece, and the kernel's plan must divide every such start)."""

    SHIFTED = 4096
    """Most choices of slots whose tiles a block keeps (all forgotten at once beyond that)."""

    def __init__(self, runs: Sequence[BlockRun], states: dict[int, StateCache], *, side: str, unit: int,
                 buf: StagingBuffer, kernel: bool | None = None) -> None:
        """``kernel``: move the block with the pattern kernel (None: where the state and the staging
        share a CUDA device and Triton is installed; True on CPU memory runs Triton's interpreter)."""
        if not runs:
            raise ValueError("a state block needs at least one run")
        self.nbytes = block_bytes(runs)
        self.groups = sorted({r.group for r in runs})
        self._group = np.array([r.group for r in runs], dtype=np.int64)
        address, stride = [], []
        strides = {g: states[g].slot_strides for g in self.groups}  # per tensor: slots may lie inside pages
        for r in runs:
            cache = states[r.group]
            tensors = len(cache.group.tensors)
            address.append(cache.region_addresses[r.run.region] + (r.run.src if side == "prefill" else r.run.dst))
            stride.append(strides[r.group][r.run.region % tensors])
        self._address = np.array(address, dtype=np.int64)
        self._stride = np.array(stride, dtype=np.int64)
        self._offset = np.array([r.offset for r in runs], dtype=np.int64)
        self._length = np.array([r.run.length for r in runs], dtype=np.int64)
        first = states[runs[0].group]
        self.device = torch.device("cuda", first.device_id) if first.mem_kind is MemKind.VRAM else torch.device("cpu")
        if any((states[g].mem_kind, states[g].device_id) != (first.mem_kind, first.device_id) for g in self.groups):
            raise ValueError("a state block's groups live on one device")
        self._kernel: dict[bool, Any] = {}
        self._shifted: dict[tuple[bool, tuple[int, ...]], np.ndarray] = {}
        self._fixed: dict[bool, torch.Tensor] = {}
        """Per direction, the tiles a staging launch reads for every piece (``fused``)."""
        self._slots: Any = None
        """``triton_kernels.Slots``, once a launch carries the block (imported where Triton is)."""
        if kernel is None:
            from kvproto.aio import staging  # (its _joins: whether staged copies on ``buf`` launch kernels)

            kernel = staging._joins(buf) and buf.tensor.device == self.device
        if kernel:
            from kvproto.kernels import pattern

            base = pattern.alignment([buf.address, unit, 64])  # every block start is a multiple of it
            zeros = np.zeros(len(runs), dtype=np.int64)
            for gather in (True, False):  # slot rows -> block, and back; the block's side moves by its base
                src, src_stride, dst, dst_stride = (self._address, self._stride, self._offset, zeros) if gather \
                    else (self._offset, zeros, self._address, self._stride)
                self._kernel[gather] = pattern.plan_strided_rows(src, src_stride, dst, dst_stride, self._length,
                                                                 base_align=base)
            self._zero = torch.zeros(2, dtype=torch.int64, device=self.device)

    def plan(self, gather: bool) -> Any:
        """The kernel's pattern plan of the block in this direction (None: the block has no kernel)."""
        strided = self._kernel.get(gather)
        return None if strided is None else strided.plan

    def fused(self, buf: StagingBuffer, at: int, slots: dict[int, int], *, gather: bool) -> Any:
        """The block at byte ``at`` of ``buf`` for a staging launch to move as well
        (``triton_kernels.Slots``): its tiles, made and put where the kernel reads them once per
        direction (on the current stream: the copy's), and per piece only scalars, each group's
        slot and the block's place; None where the block has no kernel or more state groups than
        a launch takes (``copy`` moves it)."""
        strided = self._kernel.get(gather)
        if strided is None:
            return None
        tiles = self._fixed.get(gather)
        if tiles is None:
            from kvproto.kernels.triton_kernels import SLOT_GROUPS, Slots

            if len(self.groups) > SLOT_GROUPS:
                return None
            self._slots = Slots
            wide = np.empty((len(strided.plan.tiles), 5), dtype=np.int64)
            wide[:, :3] = strided.plan.tiles
            wide[:, 3] = strided.src_step[:, 0] if gather else strided.dst_step[:, 1]
            wide[:, 4] = np.searchsorted(self.groups, self._group[strided.rows])
            tiles = torch.from_numpy(wide)
            if self.device.type == "cuda":
                tiles = tiles.pin_memory().to(self.device, non_blocking=True)
            self._fixed[gather] = tiles
        block = buf.address + at
        if block % strided.align:
            raise ValueError(f"a state block at {block:#x} is not a multiple of the plan's {strided.align} bytes")
        return self._slots(strided.plan, tiles, self._zero, tuple([slots[g] for g in self.groups]),
                           block // strided.align)

    def tiles(self, buf: StagingBuffer, at: int, slots: dict[int, int], *, gather: bool
              ) -> tuple[Any, np.ndarray, torch.Tensor] | None:
        """The block at byte ``at`` of ``buf`` for a pattern launch of its own (``copy``): its
        pattern plan, its tiles of absolute addresses for these slots, a device table whose first
        entry is 0; None where the block has no kernel."""
        strided = self._kernel.get(gather)
        if strided is None:
            return None
        chosen = (slots[self.groups[0]],) if len(self.groups) == 1 else tuple(slots[g] for g in self.groups)
        shifted = self._shifted.get((gather, chosen))
        if shifted is None:  # the slots' tiles at block 0, kept per slots (a slot serves many rooms)
            if len(self.groups) == 1:  # the common case: one slot for every tile
                per_tile: Any = chosen[0]
            else:
                per_tile = np.array([slots[g] for g in self._group.tolist()], dtype=np.int64)[strided.rows][:, None]
            shifted = strided.tiles(src_slot=per_tile) if gather else strided.tiles(dst_slot=per_tile)
            if len(self._shifted) >= self.SHIFTED:
                self._shifted.clear()
            self._shifted[(gather, chosen)] = shifted
        block = buf.address + at
        if block % strided.align:
            raise ValueError(f"a state block at {block:#x} is not a multiple of the plan's {strided.align} bytes")
        # the block's side of every tile moves by the block's address: the destination's when gathering
        return strided.plan, shifted + _BLOCK_SIDE[gather] * (block // strided.align), self._zero

    def copy(self, buf: StagingBuffer, at: int, slots: dict[int, int], *, gather: bool, stream: Any) -> None:
        """Gather (``gather``) this side's ``slots`` (slot by group number) into the block at byte
        ``at`` of ``buf``, or scatter the block from there into them, on ``stream``: one pattern
        launch where the block has a kernel, else run by run."""
        fused = self.tiles(buf, at, slots, gather=gather)
        if fused is not None:
            from kvproto.kernels import pattern

            plan, tiles, zero = fused
            table = torch.from_numpy(np.ascontiguousarray(tiles))
            if self.device.type == "cuda":
                table = table.pin_memory().to(self.device, non_blocking=True)
            pattern.launch(plan, zero[:1], zero[1:], table, stream=stream)
            return
        slot = np.array([slots[g] for g in self._group.tolist()], dtype=np.int64)
        slot_at = self._address + slot * self._stride
        if self.device.type == "cpu" and not buf.on_gpu:  # host to host: a memmove per run, no tensors
            block = buf.address + at
            for state, offset, length in zip(slot_at.tolist(), self._offset.tolist(), self._length.tolist()):
                if gather:
                    ctypes.memmove(block + offset, state, length)
                else:
                    ctypes.memmove(state, block + offset, length)
            return
        for state, offset, length in zip(slot_at.tolist(), self._offset.tolist(), self._length.tolist()):
            staged = buf.tensor[at + offset:at + offset + length]
            mine = bytes_at(state, length, self.device)
            if gather:
                staged.copy_(mine, non_blocking=True)
            else:
                mine.copy_(staged, non_blocking=True)
