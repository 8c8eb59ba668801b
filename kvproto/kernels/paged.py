"""The kernel path's kernels: pattern copies and paged-to-paged rows, for memory this process addresses.

Theory of operation
-------------------
Two kernels move a kernel-path write (``kvproto.transport.cuda_ipc``) straight between two paged
caches, without staging: ``_copy_pattern`` copies tiles of a ``PatternPlan`` (the same extents in
every region pair, ``kvproto.kernels.pattern``), and ``_copy_paged`` copies the rows of a
``RowsPlan``, each program computing both addresses from the two page lists, so head slices, block
sizes and layouts convert in the kernel. A state slot may ride in a rows launch (``SlotTiles``):
the grid's first rows copy the slot's tiles, moved by the write's two slot numbers, as the
staging kernel's state block does (``kvproto.kernels.triton_kernels``).

A link's writes of one shape share everything but their page lists and slots, so a rows launch is
bound once (``PagedLaunch``) and made again per write with those alone, through the launcher's
direct call (``kvproto.kernels.launcher``). This is the kernel path's launch: its host cost per
write was measured call by call (see the git log of ``kvproto/kernels``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kvproto.kernels.launcher import NUM_WARPS, _address, _call, _jit, _jit_only, _launch, _word_tensor


class SlotTiles(NamedTuple):
    """A state slot's copy inside a rows launch (``copy_paged``): ``tiles`` ``(count, 5)`` int64
    where the kernel reads them (in vectors of ``plan``: source and destination of slot 0 as
    absolute addresses, length, and how far one slot moves each side), a table whose first entry
    is 0 (the base the addresses are taken from). The tiles are the link's, uploaded once; a
    write names only its two slots (``copy_paged``'s ``src_slot`` and ``dst_slot``)."""

    plan: Any
    tiles: Any
    count: int
    zero: Any



def _copy_pattern(src_table, dst_table, tiles, word_ptr, TILE_WORDS: tl.constexpr, VEC: tl.constexpr,
                  ALIGN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    region = tl.program_id(1)
    src_off = tl.load(tiles + t * 3) * VEC
    dst_off = tl.load(tiles + t * 3 + 1) * VEC
    count = tl.load(tiles + t * 3 + 2) * VEC
    src = tl.multiple_of(tl.load(src_table + region).to(tl.pointer_type(word_ptr.dtype.element_ty)), ALIGN)
    dst = tl.multiple_of(tl.load(dst_table + region).to(tl.pointer_type(word_ptr.dtype.element_ty)), ALIGN)
    words = tl.arange(0, TILE_WORDS)
    mask = words < count
    tl.store(dst + dst_off + words, tl.load(src + src_off + words, mask=mask), mask=mask)


@functools.cache
def _pattern_kernel(interpret: bool) -> Any:
    if interpret:
        return InterpretedFunction(_copy_pattern)
    return JITFunction(_copy_pattern)




def copy_pattern(plan: Any, src_table: torch.Tensor, dst_table: torch.Tensor, tiles: torch.Tensor,
                 stream: Any = None) -> None:
    """Launch one ``kvproto.kernels.pattern.PatternPlan`` on the current stream or ``stream`` (grid:
    tiles x regions); the tables and tiles live on the device that runs it (CPU: the interpreter)."""
    device = src_table.device
    interpret = device.type != "cuda"
    constants: dict[str, Any] = {"TILE_WORDS": plan.tile_words, "VEC": plan.vec, "ALIGN": plan.word * plan.vec}
    if not interpret:
        constants["num_warps"] = NUM_WARPS if plan.tile_words * plan.word >= 8192 else 4
    _launch(_pattern_kernel(interpret), (len(plan.tiles), plan.regions),
            (src_table, dst_table, tiles, _word_tensor(plan.word, device)), constants, stream)


# --- paged-to-paged rows (the kernel path's conversions: ``kvproto.kernels.pattern.plan_rows``) --------
def _copy_paged(src_table, dst_table, src_pages, dst_pages, lists, batch, start_token, num_rows, num_regions,
                word_ptr, slot_tiles, num_slot_tiles, slot_base, slot_word_ptr, src_slot, dst_slot,
                LISTS: tl.constexpr, SLOTS: tl.constexpr, BATCH: tl.constexpr, S_TILE_WORDS: tl.constexpr, S_VEC: tl.constexpr,
                S_ALIGN: tl.constexpr, HEAD_COUNT: tl.constexpr, HEAD_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                ROW_BLOCK: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
                SRC_BLOCK: tl.constexpr, SRC_HEADS: tl.constexpr, SRC_HEAD0: tl.constexpr,
                SRC_PAGE_WORDS: tl.constexpr, SRC_HND: tl.constexpr,
                DST_BLOCK: tl.constexpr, DST_HEADS: tl.constexpr, DST_HEAD0: tl.constexpr,
                DST_PAGE_WORDS: tl.constexpr, DST_HND: tl.constexpr):
    region = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    limit = num_rows
    if BATCH:  # several writes of one shape in one launch (``PagedBatch``): the grid's second axis is
        # writes x regions; write w reads its token range and where its two page lists start (from
        # ``src_pages``, which is the batch's table) in entry w of ``batch``
        entry = batch + (region // num_regions).to(tl.int64) * 4
        region = region % num_regions
        start_token = tl.load(entry)
        limit = tl.load(entry + 1)
        dst_pages += tl.load(entry + 3)
        src_pages += tl.load(entry + 2)
    if SLOTS:  # the grid's first rows copy a state slot's tiles (``copy_paged``), the regions' rows
        # follow (as ``_copy_rows``); a tile moves ``src_slot`` / ``dst_slot`` of its row's strides
        slot_rows = (num_slot_tiles + tl.num_programs(0) - 1) // tl.num_programs(0)
        if region < slot_rows:  # only the slot's programs read its tiles (``_copy_rows``)
            t = region.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
            on = (t < num_slot_tiles).to(tl.int64)
            t = tl.minimum(t, num_slot_tiles - 1)  # a tile there is (no scalar masks)
            tile = slot_tiles + t * 5
            s_src = (tl.load(tile) + src_slot * tl.load(tile + 3)) * S_VEC
            s_dst = (tl.load(tile + 1) + dst_slot * tl.load(tile + 4)) * S_VEC
            s_count = tl.load(tile + 2) * S_VEC * on  # 0 words past the slot's last tile
            zero = tl.multiple_of(tl.load(slot_base).to(tl.pointer_type(slot_word_ptr.dtype.element_ty)), S_ALIGN)
            s_words = tl.arange(0, S_TILE_WORDS)
            s_mask = s_words < s_count
            tl.store(zero + s_dst + s_words, tl.load(zero + s_src + s_words, mask=s_mask), mask=s_mask)
        limit = num_rows * (region >= slot_rows).to(tl.int64)  # the state's rows copy no paged rows
        region = tl.maximum(region - slot_rows, 0)
    live = rows < limit
    token = start_token + rows // HEAD_COUNT
    head = rows % HEAD_COUNT
    if LISTS:  # each region reads its own group's page lists: offsets lists[r] and lists[regions + r]
        src_pages += tl.load(lists + region)
        dst_pages += tl.load(lists + num_regions + region)
    s_page = tl.load(src_pages + token // SRC_BLOCK, mask=live, other=0)
    s_slot = token % SRC_BLOCK
    d_page = tl.load(dst_pages + token // DST_BLOCK, mask=live, other=0)
    d_slot = token % DST_BLOCK
    if SRC_HND:
        s_cell = (SRC_HEAD0 + head) * SRC_BLOCK + s_slot
    else:
        s_cell = s_slot * SRC_HEADS + SRC_HEAD0 + head
    if DST_HND:
        d_cell = (DST_HEAD0 + head) * DST_BLOCK + d_slot
    else:
        d_cell = d_slot * DST_HEADS + DST_HEAD0 + head
    s_row = s_page * SRC_PAGE_WORDS + s_cell * HEAD_WORDS
    d_row = d_page * DST_PAGE_WORDS + d_cell * HEAD_WORDS
    words = tl.arange(0, ROW_BLOCK)
    if ROW_BLOCK == ROW_WORDS:
        mask = live[:, None]
    else:
        mask = live[:, None] & (words < ROW_WORDS)[None, :]
    src = tl.multiple_of(tl.load(src_table + region).to(tl.pointer_type(word_ptr.dtype.element_ty)), ALIGN)
    dst = tl.multiple_of(tl.load(dst_table + region).to(tl.pointer_type(word_ptr.dtype.element_ty)), ALIGN)
    values = tl.load(src + s_row[:, None] + words[None, :], mask=mask)
    tl.store(dst + d_row[:, None] + words[None, :], values, mask=mask)


@functools.cache
def _paged_kernel(interpret: bool) -> Any:
    if interpret:
        return InterpretedFunction(_copy_paged)
    return JITFunction(_copy_paged, do_not_specialize=("start_token", "num_rows", "num_regions", "num_slot_tiles",
                                                       "src_slot", "dst_slot"))


def copy_paged(plan: Any, src_table: torch.Tensor, dst_table: Any, src_pages: Any, dst_pages: Any,
               lists: Any = None, slots: SlotTiles | None = None, src_slot: int = 0, dst_slot: int = 0,
               stream: Any = None) -> None:
    """Launch one ``kvproto.kernels.pattern.RowsPlan`` on the current stream or ``stream`` (grid: row
    tiles x regions); tables and page lists are where the kernel reads them (CPU: the interpreter).
    ``lists``: where regions of several groups share a launch, int64 offsets into the page lists,
    ``regions`` for the source lists then ``regions`` for the destination lists. ``slots``: a
    state slot's copy in the same launch (``SlotTiles``): the grid's first rows copy its tiles over
    one region of base 0, each moved by the write's two slot numbers (``src_slot``, ``dst_slot``).
    The launch is bound once per plan, tables, lists and tiles (``PagedLaunch.of``); a write gives
    its pages and slots."""
    PagedLaunch.of(plan, src_table, dst_table, lists, slots)(src_pages, dst_pages, src_slot, dst_slot, stream)


class PagedLaunch:
    """A ``copy_paged`` launch bound once, made again per write with only its pages and slots.

    The kernel path launches one rows kernel per write, and a link's writes of one shape (every
    room of a prompt length) share everything but their page lists and state slots: the plan, the
    region tables, the lists' offsets, the slot's tiles. Binding them once keeps the constexprs,
    the grid and the fixed arguments; a write then costs the lookup of its specialisation (the
    16-byte alignment and dtype of its two page lists, the device: at most a few per binding) and
    the launcher's call. ``of`` keeps the bindings by the identity of what they bind (the objects
    are held, so an id is never reused while its binding is kept), at most ``KEPT``, oldest out."""

    KEPT = 256
    __slots__ = ("kernel", "grid", "constants", "args", "lists", "addresses", "_known")
    _bound: OrderedDict[tuple[int, ...], tuple[tuple[Any, ...], PagedLaunch]] = OrderedDict()

    def __init__(self, plan: Any, src_table: torch.Tensor, dst_table: Any, lists: Any = None,
                 slots: SlotTiles | None = None) -> None:
        device = src_table.device
        interpret = device.type != "cuda"
        constants = dict(plan.constants)
        constants.update(LISTS=int(lists is not None), SLOTS=int(slots is not None), BATCH=0)
        programs, regions = plan.programs_x, plan.regions
        word = _word_tensor(plan.word, device)
        if slots is None:
            slot_args: tuple[Any, ...] = (src_table, 0, src_table, word)
            constants.update(S_TILE_WORDS=1, S_VEC=1, S_ALIGN=1)
        else:
            slot_plan = slots.plan
            slot_args = (slots.tiles, slots.count, slots.zero, _word_tensor(slot_plan.word, device))
            constants.update(S_TILE_WORDS=slot_plan.tile_words, S_VEC=slot_plan.vec,
                             S_ALIGN=slot_plan.word * slot_plan.vec)
            regions += -(-slots.count // programs)  # the slot's tiles in rows before the regions' rows
        if not interpret:
            constants["num_warps"] = NUM_WARPS
        self.kernel = _paged_kernel(interpret)
        self.grid = (programs, regions)
        self.constants = constants
        self.lists = lists
        self.args = ((src_table, dst_table), (plan.start, plan.num_rows, plan.regions, word, *slot_args))
        """The arguments before the page lists, and those between them and the two slot numbers."""
        head, mid = self.args
        self.addresses = (tuple(map(_address, head)), tuple(map(_address, mid)),
                          None if lists is None else _address(lists))
        """``args`` with every array as its address (and the lists' address), for the compiled
        kernel's launcher: given an object, it calls its ``data_ptr`` and then asks the driver
        what memory the address is (``cuPointerGetAttribute``), once per array argument and
        launch; an int it takes as it is. The arrays are held by ``args`` and were checked by the
        first launch of each specialisation, which takes ``args`` themselves."""
        self._known: dict[tuple[Any, ...], Any] = {}
        """``_launch``'s answer per specialisation of the page lists (and device)."""

    @classmethod
    def of(cls, plan: Any, src_table: Any, dst_table: Any, lists: Any = None,
           slots: SlotTiles | None = None) -> PagedLaunch:
        """The binding of these objects, made on first use."""
        held = (plan, src_table, dst_table, lists, None if slots is None else slots.tiles,
                None if slots is None else slots.zero)
        key = tuple(map(id, held))
        hit = cls._bound.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], held)):
            return hit[1]
        bound = cls(plan, src_table, dst_table, lists, slots)
        if len(cls._bound) >= cls.KEPT:
            cls._bound.popitem(last=False)
        cls._bound[key] = (held, bound)
        return bound

    @classmethod
    def forget(cls, tables: Iterable[Any]) -> int:
        """Drop the bindings that hold any of ``tables`` or a view of one (a transport's region
        tables, as it unmaps a peer or closes), so that nothing of a closed link stays held here;
        the number dropped."""
        gone = {id(t) for t in tables}
        stale = [key for key, (held, _) in cls._bound.items()
                 if any(id(x) in gone or id(getattr(x, "_base", None)) in gone for x in held if x is not None)]
        for key in stale:
            del cls._bound[key]
        return len(stale)

    def __call__(self, src_pages: Any, dst_pages: Any, src_slot: int = 0, dst_slot: int = 0,
                 stream: Any = None) -> None:
        """Launch for these page lists (int64 from token 0, where the kernel reads them) and slots,
        on the current stream or ``stream``."""
        kernel = self.kernel
        if isinstance(kernel, InterpretedFunction) or _jit_only():
            _jit(kernel, self.grid, self._args(src_pages, dst_pages, src_slot, dst_slot), self.constants, stream)
            return
        device = torch.cuda.current_device()
        src, dst = src_pages.data_ptr(), dst_pages.data_ptr()
        spec = (device, src_pages.dtype, not src & 15, dst_pages.dtype, not dst & 15,
                src_slot < 0x80000000 and dst_slot < 0x80000000)
        known = self._known.get(spec)
        if known is None:  # the first launch of this specialisation here: the JIT's (or ``_launch``'s kept)
            args = self._args(src_pages, dst_pages, src_slot, dst_slot)
            self._known[spec] = _launch(kernel, self.grid, args, self.constants, stream)
        elif known is False:
            _jit(kernel, self.grid, self._args(src_pages, dst_pages, src_slot, dst_slot), self.constants, stream)
        else:  # the launcher takes addresses (``addresses``): the page lists are ours, on the device
            head_at, mid_at, lists_at = self.addresses
            _call(known, self.grid, (*head_at, src, dst, src if lists_at is None else lists_at, src, *mid_at,
                                     src_slot, dst_slot), device, stream)

    def _args(self, src_pages: Any, dst_pages: Any, src_slot: int, dst_slot: int) -> tuple[Any, ...]:
        """The launch's arguments as objects (the JIT's, and the first launch of a specialisation)."""
        head, mid = self.args
        return (*head, src_pages, dst_pages, src_pages if self.lists is None else self.lists, src_pages, *mid,
                src_slot, dst_slot)


class PagedBatch:
    """Several writes of one rows shape as one ``copy_paged`` launch (``BATCH``).

    Rooms that become ready together (one forward pass, one layer's event, one progress pass)
    write into one peer with the same plan but their own pages and token ranges. Launching them
    one by one pays the launch's host cost per room; here they go as one launch whose second grid
    axis is writes x regions. Its one table holds a four-word entry per write (first token, rows,
    where its source and destination page lists start in the table) followed by the writes' own
    tables (``batch_table``); the plan's constexprs (``ROWS`` with them) are those of every write in
    the batch. Made per shape (the region tables, the lists' offsets, the constexprs) and called
    with the table and the grid."""

    __slots__ = ("kernel", "constants", "regions", "rows_per_program", "args")

    def __init__(self, plan: Any, src_table: torch.Tensor, dst_table: Any, lists: Any = None) -> None:
        device = src_table.device
        interpret = device.type != "cuda"
        self.kernel = _paged_kernel(interpret)
        self.constants = dict(plan.constants, LISTS=int(lists is not None), SLOTS=0, BATCH=1,
                              S_TILE_WORDS=1, S_VEC=1, S_ALIGN=1)
        if not interpret:
            self.constants["num_warps"] = NUM_WARPS
        self.regions, self.rows_per_program = plan.regions, plan.rows_per_program
        word = _word_tensor(plan.word, device)
        self.args = (src_table, dst_table, lists, word)

    def __call__(self, table: Any, entries: np.ndarray, stream: Any = None) -> None:
        """Launch the writes of ``entries`` (``batch_table``'s second answer) reading ``table``
        (its first, where the kernel reads it), on the current stream or ``stream``."""
        src_table, dst_table, lists, word = self.args
        programs = max(1, -(-int(entries[:, 1].max()) // self.rows_per_program))
        args = (src_table, dst_table, table, table, table if lists is None else lists, table, 0, 0, self.regions,
                word, src_table, 0, src_table, word, 0, 0)
        _launch(self.kernel, (programs, len(entries) * self.regions), args, self.constants, stream)


def batch_table(writes: Iterable[tuple[int, int, int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The one table of a ``PagedBatch`` launch, and its entries, from each write's (first token,
    rows, where its destination lists start in its own table, that table): an ``(N, 4)`` int64
    entry per write (first token, rows, source and destination lists' offsets in the batch's
    table), then the writes' tables one after another."""
    writes = list(writes)
    head = 4 * len(writes)
    entries = np.empty((len(writes), 4), dtype=np.int64)
    at = head
    for i, (start, rows, split, table) in enumerate(writes):
        entries[i] = start, rows, at, at + split
        at += len(table)
    return np.concatenate([entries.reshape(-1), *(w[3] for w in writes)]), entries


def warm_up_rows(plans: Iterable[Any], device: torch.device) -> int:
    """Compile the rows kernels of ``plans`` (``RowsPlan``s; one per distinct set of constexprs),
    each as one write's launch (``PagedLaunch``) and as a batch's (``PagedBatch``), by running
    them with no rows over one region of dummy tables: every program is masked, nothing is read
    or written but those tables. Meant for a background thread when a rank starts, so that no
    room waits for Triton (a process's first compile also hashes Triton's own sources: about
    0.4 s). Returns how many variants ran."""
    import dataclasses

    table = torch.zeros(8, dtype=torch.int64, device=device)
    entry = np.zeros((1, 4), dtype=np.int64)
    entry[0, 2:] = 4  # the (empty) lists after the entry
    seen: set[tuple[Any, ...]] = set()
    ran = 0
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for plan in plans:
            key = (plan.word, *plan.constants.items())
            if key in seen:
                continue
            seen.add(key)
            empty = dataclasses.replace(plan, num_rows=0, regions=1)
            alone = PagedLaunch(empty, table, table)
            alone.grid = (1, 1)
            alone(table, table)
            PagedBatch(empty, table, table)(table, entry)
            ran += 2
    stream.synchronize()
    return ran

