"""Reference caches: one rank's cache tensors, filled with and checked against reference bytes.

Theory of operation
-------------------
``kvproto demo``, the geometry tests and the fault tests prove a transfer right by content, never
by plan: every byte a prefill rank writes is a pure function of what it is (room, group, layer,
plane, global head, token, byte; or, for state, room, group, layer, tensor and global index), and
a decode rank checks every byte it holds against the same function, computed without
``kvproto.geometry``. A byte that went to the wrong head, token, layer, page, group or slot, or
was never written, is caught whatever the two sides' TP sizes, block sizes and layouts are.

A rank's cache is the first group (K/V planes or an MLA latent) plus, for the hybrid presets
(``PRESETS``), groups shaped like the model families served in 2026:

* ``gdn``: a Gated DeltaNet hybrid: three linear-attention layers per full-attention layer; each
  linear layer keeps a conv state (sharded over its channels) and a recurrent state (sharded over
  its heads) per request;
* ``mla-indexer``: an MLA latent plus a sparse-attention indexer cache (DeepSeek V3.2 style: one
  replicated "head" of its own width, paged beside the latent, the same model layers);
* ``swa``: full-attention layers interleaved with sliding-window layers whose pool is their own
  and of which a decode rank needs only the last ``window`` tokens.

``page_layout="vllm"`` lays a cache out as vLLM 0.33 does for such hybrids: one buffer of pages per
full-attention layer, shared with one layer of every state group (``KVCacheTensor.shared_by``);
block ``b`` of the buffer is a page of the first group (fused K|V) or, for a block a state group
took as a request's slot, that layer's states side by side (conv state at offset 0, the next state
after it, padding up to the page), so every state tensor is a view of slots a page apart and the
groups' regions overlap. The pool's blocks are split between the groups so no two take one block.
With the ``gdn`` preset the model follows vLLM's grouping (four groups of equal layers: the
full-attention one, with fused K|V, and three of GDN layers, whose conv state is ``[Q | K | V]``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "u8": "uint8"}

PRESETS = ("", "gdn", "mla-indexer", "swa")
"""Cache shapes: "" is the plain one-group cache; the others add groups (module docstring)."""


class Content:
    """The reference bytes of one paged group: a function of (room, layer, plane, head, token, byte).

    A random table over (layer, plane, head, token mod period, byte) is XORed with a per-room
    key and a per-token-period key, so neighbouring rooms, heads, tokens and layers all differ,
    and generating a room's content is a cheap uint8 broadcast.
    """

    PERIOD = 2048

    def __init__(self, torch: Any, *, seed: int, layers: int, planes: int, heads: int, head_bytes: int) -> None:
        self.torch = torch
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, 256, (layers, planes, heads, self.PERIOD, head_bytes), dtype=torch.uint8,
                                   generator=gen)
        self.head_bytes = head_bytes

    def key(self, salt: int) -> Any:
        gen = self.torch.Generator().manual_seed(salt & 0x7FFFFFFFFFFFFFFF)
        return self.torch.randint(0, 256, (self.head_bytes,), dtype=self.torch.uint8, generator=gen)

    def tokens(self, room_id: int, layer: int, plane: int, heads: range, t0: int, t1: int) -> Any:
        """uint8 tensor (t1-t0, len(heads), head_bytes)."""
        torch = self.torch
        out = torch.empty((t1 - t0, len(heads), self.head_bytes), dtype=torch.uint8)
        room_key = self.key(room_id)
        t = t0
        while t < t1:
            period, off = divmod(t, self.PERIOD)
            n = min(t1 - t, self.PERIOD - off)
            part = self.table[layer, plane, heads.start:heads.stop, off:off + n].transpose(0, 1)
            torch.bitwise_xor(part, room_key ^ self.key(period + 1), out=out[t - t0:t - t0 + n])
            t += n
        return out


def state_content(torch: Any, seed: int, room_id: int, group: str, layer: int, tensor: int, shape: tuple[int, ...],
                  itemsize: int) -> Any:
    """One request's global state tensor as uint8 of shape ``(*shape, itemsize)``."""
    digest = hashlib.blake2b(repr((seed, room_id, group, layer, tensor)).encode(), digest_size=8).digest()
    salt = int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF  # the same in every process
    gen = torch.Generator().manual_seed(salt)
    return torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=gen)


def aux_bytes(torch: Any, room_id: int, n: int) -> Any:
    return ((torch.arange(n, dtype=torch.int64) * 131 + room_id * 7) % 251).to(torch.uint8)


@dataclass(frozen=True)
class PagedShape:
    """One paged group of a model: what every rank of either side agrees on."""

    name: str
    layers: tuple[int, ...]
    """Model layers of the group."""
    kv_heads: int
    head_dim: int
    mla: bool
    window: int | None = None
    salt: int = 0
    fused: bool = False
    """One plane per layer whose ``head_dim`` holds each head's K then V (vLLM's layout)."""


@dataclass(frozen=True)
class StateShape:
    """One state group: per layer, tensors of global ``shapes`` (``dtypes``), split along ``shard``."""

    name: str
    layers: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    shard: tuple[int | None, ...]
    salt: int = 0
    sections: tuple[tuple[int, ...] | None, ...] = ()
    """Per tensor, the global sizes of the projections side by side along its split dimension,
    each split over TP on its own (a GDN conv state's [Q | K | V]); empty, or None: one."""

    def section_sizes(self, t: int) -> tuple[int, ...]:
        """Tensor ``t``'s sections along its split dimension (one: the whole dimension)."""
        dim = self.shard[t]
        assert dim is not None
        return (self.sections[t] if self.sections else None) or (self.shapes[t][dim],)


def model_groups(cfg: Any) -> list[PagedShape | StateShape]:
    """The groups of ``cfg``'s model (``cfg``: a ``DemoConfig``): the first group, then the preset's."""
    n = cfg.layers
    heads = 1 if cfg.mla else cfg.kv_heads
    preset = getattr(cfg, "preset", "")
    if preset == "gdn" and getattr(cfg, "page_layout", "") == "vllm":  # vLLM's groups: 4 of n layers each
        full = tuple(4 * i + 3 for i in range(n))
        return [PagedShape("full", full, heads, 2 * cfg.head_dim, False, fused=True)] + [
            StateShape(f"gdn{k}", tuple(4 * i + k for i in range(n)), ((64, 4), (8, 16, 16)), ("bf16", "fp32"),
                       (0, 0), salt=1 + k, sections=((16, 16, 32), None)) for k in range(3)]
    if preset == "gdn":  # one full-attention layer in four: model layers 3, 7, 11, ...
        full = tuple(4 * i + 3 for i in range(n))
        linear = tuple(sorted(set(range(4 * n)) - set(full)))
        return [PagedShape("full", full, heads, cfg.head_dim, cfg.mla),
                StateShape("gdn", linear, ((64, 4), (8, 16, 16)), ("bf16", "fp32"), (0, 0), salt=1)]
    if preset == "mla-indexer":
        layers = tuple(range(n))
        return [PagedShape("latent", layers, 1, cfg.head_dim, True),
                PagedShape("indexer", layers, 1, 33, True, salt=2)]
    if preset == "swa":  # full and sliding-window layers alternate: 0, 2, 4, ... and 1, 3, 5, ...
        return [PagedShape("full", tuple(range(0, 2 * n, 2)), heads, cfg.head_dim, cfg.mla),
                PagedShape("swa", tuple(range(1, 2 * n, 2)), heads, cfg.head_dim, cfg.mla,
                           window=getattr(cfg, "window", 0) or 64, salt=3)]
    if preset:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(p for p in PRESETS if p)}")
    return [PagedShape("kv", tuple(range(n)), heads, cfg.head_dim, cfg.mla)]


class _Paged:
    """One rank's tensors of one paged group, with uint8 views to fill and check them."""

    def __init__(self, torch: Any, cfg: Any, shape: PagedShape, *, tp: int, rank: int, block: int, layout: str,
                 aux: Any = None, dtype: str | None = None, pages: list[Any] | None = None,
                 free: list[int] | None = None) -> None:
        """``pages``: per layer, a uint8 buffer to lay the group's one plane over (vLLM's page
        layout, shared with state groups); ``free``: the pool's blocks this group takes pages from
        (default: all; the others are the state groups')."""
        from kvproto.aio import KVCache
        from kvproto.geometry import Layout

        self.torch, self.shape, self.block = torch, shape, block
        self.layout = Layout[layout]
        local = 1 if shape.mla else max(1, shape.kv_heads // tp)
        dims = (cfg.blocks, block, local, shape.head_dim) if self.layout is Layout.NHD else \
            (cfg.blocks, local, block, shape.head_dim)
        planes = 1 if shape.mla or shape.fused else 2
        torch_dtype = getattr(torch, DTYPES[dtype or cfg.dtype])
        if pages is not None:
            assert planes == 1, "a page layout lays one plane per layer over its buffers"
            self.tensors = [[buf.view(torch_dtype).view(dims) for buf in pages]]
        else:
            self.tensors = [[torch.zeros(dims, dtype=torch_dtype) for _ in shape.layers] for _ in range(planes)]
        self.kv = KVCache.from_tensors(self.tensors, tp_size=tp, tp_rank=rank, num_kv_heads=shape.kv_heads,
                                       layout=self.layout, mla=shape.mla, kv_fused=shape.fused, aux=aux,
                                       name=shape.name, window=shape.window, model_layers=shape.layers)
        g = self.kv.geometry
        self.heads = range(g.head_start, g.head_start + g.local_heads)
        self.head_bytes = g.head_bytes
        self.content = Content(torch, seed=cfg.seed * 7919 + shape.salt, layers=len(shape.layers), planes=planes,
                               heads=shape.kv_heads, head_bytes=g.head_bytes)
        self.free = list(range(cfg.blocks) if free is None else free)
        random.Random(cfg.seed * 1000 + rank * 10 + shape.salt).shuffle(self.free)

    def fill(self, room_id: int, pages: list[int], t0: int, t1: int, garbage_below: int = 0) -> None:
        """Write the reference content of tokens [t0, t1) into the room's pages (``pages[i]``: the
        room's page ``i``; entries before ``t0``'s page are not read); tokens below
        ``garbage_below`` get wrong bytes instead (they must never reach the other side)."""
        torch = self.torch
        first = t0 // self.block
        idx = torch.tensor(pages[first:], dtype=torch.int64)
        for plane, layers in enumerate(self.tensors):
            for layer, tensor in enumerate(layers):
                content = self.content.tokens(room_id, layer, plane, self.heads, first * self.block, t1)
                if garbage_below > first * self.block:
                    content[: garbage_below - first * self.block] ^= 0x5A
                pad = len(idx) * self.block - content.shape[0]
                if pad:
                    content = torch.cat([content, content.new_zeros((pad,) + tuple(content.shape[1:]))])
                blocks = content.reshape(len(idx), self.block, content.shape[1], content.shape[2])
                if self.layout.name == "HND":
                    blocks = blocks.permute(0, 2, 1, 3)
                tensor.view(torch.uint8)[idx] = blocks.contiguous()

    def check(self, room_id: int, pages: list[int], n_tokens: int, t0: int = 0) -> int:
        """Mismatching bytes of tokens ``[t0, n_tokens)`` in the room's pages (``pages[i]``: the
        room's page ``i``; entries before ``t0``'s page are not read)."""
        torch = self.torch
        first = t0 // self.block
        idx = torch.tensor(pages[first:], dtype=torch.int64)
        bad = 0
        for plane in range(len(self.tensors)):
            for layer in range(len(self.tensors[plane])):
                got = self.tensors[plane][layer][idx].view(torch.uint8)
                if self.layout.name == "HND":
                    got = got.permute(0, 2, 1, 3)
                got = got.reshape(-1, got.shape[2], got.shape[3])[t0 - first * self.block:n_tokens - first * self.block]
                want = self.content.tokens(room_id, layer, plane, self.heads, t0, n_tokens)
                bad += int((got != want).sum())
        return bad

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"reference cache {self.shape.name!r} exhausted: raise --blocks or lower --concurrency")
        pages, self.free = self.free[:n], self.free[n:]
        return pages

    def give(self, pages: list[int]) -> None:
        self.free.extend(p for p in pages if p >= 0)


class _State:
    """One rank's tensors of one state group: ``(slots, *local shape)`` per (layer, tensor), each
    its own tensor or, with ``pages`` (per layer a uint8 buffer of ``page``-byte blocks), views of
    slots a page apart, the layer's tensors side by side in each page (vLLM's page layout)."""

    def __init__(self, torch: Any, cfg: Any, shape: StateShape, *, tp: int, rank: int, slots: int,
                 pages: list[Any] | None = None, page: int = 0, free: range | None = None) -> None:
        from kvproto.aio import StateCache

        self.torch, self.shape, self.tp, self.rank, self.seed = torch, shape, tp, rank, cfg.seed
        self.local = []
        for dims, dim in zip(shape.shapes, shape.shard):
            local = list(dims)
            if dim is not None:
                local[dim] //= tp
            self.local.append(tuple(local))
        dtypes = [getattr(torch, DTYPES[dt]) for dt in shape.dtypes]
        if pages is None:
            self.tensors = [[torch.zeros((slots, *local), dtype=dt) for local, dt in zip(self.local, dtypes)]
                            for _ in shape.layers]
        else:
            self.tensors = [self._paged(buf, page, dtypes) for buf in pages]
        self.cache = StateCache.from_tensors(shape.name, self.tensors, shard_dims=shape.shard,
                                             sections=shape.sections or None, tp_size=tp, tp_rank=rank,
                                             model_layers=shape.layers)
        self.free = list(range(slots) if free is None else free)

    def _paged(self, buf: Any, page: int, dtypes: list[Any]) -> list[Any]:
        """One layer's tensors as views of ``buf``'s pages: each at its offset in every page (after
        the tensors before it, aligned to its element size), slots a page apart."""
        import math

        views, at = [], 0
        slots = buf.numel() // page
        for local, dt in zip(self.local, dtypes):
            size = dt.itemsize
            at = -(-at // size) * size
            contiguous = [math.prod(local[k + 1:]) for k in range(len(local))]
            views.append(buf.view(dt).as_strided((slots, *local), (page // size, *contiguous), at // size))
            at += math.prod(local) * size
        if at > page:
            raise ValueError(f"state group {self.shape.name!r}: a layer's states of {at} bytes do not fit a "
                             f"{page}-byte page (raise the block size or head size)")
        return views

    def _want(self, room_id: int, layer: int, t: int) -> Any:
        whole = state_content(self.torch, self.seed + self.shape.salt, room_id, self.shape.name, layer, t,
                              self.shape.shapes[t], self.tensors[layer][t].element_size())
        dim = self.shape.shard[t]
        if dim is None:
            return whole
        parts, start = [], 0
        for size in self.shape.section_sizes(t):  # this rank's share of each section, side by side
            n = size // self.tp
            parts.append(whole.narrow(dim, start + self.rank * n, n))
            start += size
        return self.torch.cat(parts, dim)

    def fill(self, room_id: int, slot: int) -> None:
        for layer, tensors in enumerate(self.tensors):
            for t, tensor in enumerate(tensors):
                tensor[slot].view(self.torch.uint8).view(*self.local[t], -1).copy_(self._want(room_id, layer, t))

    def check(self, room_id: int, slot: int) -> int:
        bad = 0
        for layer, tensors in enumerate(self.tensors):
            for t, tensor in enumerate(tensors):
                got = tensor[slot].view(self.torch.uint8).view(*self.local[t], -1)
                bad += int((got != self._want(room_id, layer, t)).sum())
        return bad

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(f"reference cache {self.shape.name!r} is out of slots: lower --concurrency")
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)


class RankCache:
    """One rank's whole cache: the first group (``kv``, ``tensors``, ``fill``/``check``/``take``
    act on it, as for a plain cache) and the preset's further groups (``*_groups``)."""

    def __init__(self, torch: Any, cfg: Any, *, tp: int, rank: int, block: int, layout: str, aux_slots: int,
                 group_slots: int | None = None, shapes: list[PagedShape | StateShape] | None = None,
                 group_blocks: dict[str, int] | None = None, group_layouts: dict[str, str] | None = None,
                 page_layout: str | None = None) -> None:
        """``shapes``: the model's groups (default: ``model_groups(cfg)``); ``group_blocks`` and
        ``group_layouts``: a paged group's own block size and layout on this side (default: the
        first group's); ``page_layout``: "vllm" for vLLM's pages (module docstring; default:
        ``cfg.page_layout``)."""
        shapes = shapes or model_groups(cfg)
        self.torch = torch
        self.aux = torch.zeros((aux_slots, cfg.aux_bytes), dtype=torch.uint8)
        self.paged: dict[str, _Paged] = {}
        self.states: dict[str, _State] = {}
        if (page_layout if page_layout is not None else getattr(cfg, "page_layout", "")) == "vllm":
            self._vllm_pages(torch, cfg, shapes, tp=tp, rank=rank, block=block, layout=layout,
                             slots=group_slots or max(aux_slots, 1))
            shapes = []
        else:
            self.first = _Paged(torch, cfg, shapes[0], tp=tp, rank=rank, block=block, layout=layout, aux=self.aux)
        for shape in shapes[1:]:
            if isinstance(shape, PagedShape):
                dtype = "u8" if shape.name == "indexer" else None
                self.paged[shape.name] = _Paged(torch, cfg, shape, tp=tp, rank=rank,
                                                block=(group_blocks or {}).get(shape.name, block),
                                                layout=(group_layouts or {}).get(shape.name, layout), dtype=dtype)
            else:
                self.states[shape.name] = _State(torch, cfg, shape, tp=tp, rank=rank,
                                                 slots=group_slots or max(aux_slots, 1))
        extras = [p.kv for p in self.paged.values()] + [s.cache for s in self.states.values()]
        self.kv = self.first.kv.with_groups(*extras) if extras else self.first.kv
        self.tensors = self.first.tensors
        self.layout = self.first.layout
        self.block = block
        self.heads = self.first.heads
        self.head_bytes = self.first.head_bytes
        self.content = self.first.content

    def _vllm_pages(self, torch: Any, cfg: Any, shapes: list[PagedShape | StateShape], *, tp: int, rank: int,
                    block: int, layout: str, slots: int) -> None:
        """The first group and the state groups over one buffer of ``cfg.blocks`` pages per layer
        (module docstring): the state groups take ``slots`` blocks each from block 1 on (a slot's place
        depends on its stride), the first group's pages the others (the pool's first and last blocks
        among them)."""
        first, states = shapes[0], shapes[1:]
        if not isinstance(first, PagedShape) or not (first.fused or first.mla) or not all(
                isinstance(s, StateShape) and len(s.layers) == len(first.layers) for s in states):
            raise ValueError("vLLM's page layout takes a one-plane first group (fused K|V or MLA) and state groups "
                             "of as many layers")
        local = 1 if first.mla else max(1, first.kv_heads // tp)
        page = block * local * first.head_dim * getattr(torch, DTYPES[cfg.dtype]).itemsize  # the first group's
        taken = len(states) * slots
        if taken + 1 >= cfg.blocks:
            raise ValueError(f"{cfg.blocks} blocks leave no pages beside {len(states)} x {slots} state slots")
        buffers = [torch.zeros(cfg.blocks * page, dtype=torch.uint8) for _ in first.layers]
        self.first = _Paged(torch, cfg, first, tp=tp, rank=rank, block=block, layout=layout, aux=self.aux,
                            pages=buffers, free=[0, *range(1 + taken, cfg.blocks)])
        for k, shape in enumerate(states):
            assert isinstance(shape, StateShape)
            self.states[shape.name] = _State(torch, cfg, shape, tp=tp, rank=rank, slots=cfg.blocks, pages=buffers,
                                             page=page, free=range(1 + k * slots, 1 + (k + 1) * slots))
        self.buffers = buffers

    # --- the first group (a plain cache's whole) ------------------------------------------------
    def fill(self, room_id: int, pages: list[int], t0: int, t1: int, garbage_below: int = 0) -> None:
        self.first.fill(room_id, pages, t0, t1, garbage_below)

    def check(self, room_id: int, pages: list[int], n_tokens: int) -> int:
        return self.first.check(room_id, pages, n_tokens)

    def take(self, n: int) -> list[int]:
        return self.first.take(n)

    def give(self, pages: list[int]) -> None:
        self.first.give(pages)

    # --- groups beyond the first -------------------------------------------------------------------
    def window_start(self, name: str, n_tokens: int) -> int:
        window = self.paged[name].shape.window
        return 0 if window is None else max(0, n_tokens - window)

    def decode_group_pages(self, n_tokens: int) -> dict[str, list[int]]:
        """Fresh pages of every paged group beyond the first for a decode room of ``n_tokens``,
        indexed from the room's page 0 (-1 before a window's first page)."""
        out = {}
        for name, part in self.paged.items():
            first = self.window_start(name, n_tokens) // part.block
            out[name] = [-1] * first + part.take(-(-n_tokens // part.block) - first)
        return out

    def take_group_pages(self, held: dict[str, list[int]], end_token: int) -> dict[str, list[int]]:
        """A prefill chunk's new pages of every paged group up to ``end_token`` (appended to ``held``)."""
        new = {}
        for name, part in self.paged.items():
            pages = part.take(-(-end_token // part.block) - len(held.setdefault(name, [])))
            held[name] += pages
            new[name] = pages
        return new

    def fill_groups(self, room_id: int, group_pages: dict[str, list[int]], t0: int, t1: int,
                    garbage_below: int = 0, *, n_tokens: int | None = None) -> None:
        """Reference content of tokens ``[t0, t1)`` in every paged group beyond the first; with
        ``n_tokens`` (a decode room's prompt), only the tokens of each group's window."""
        for name, part in self.paged.items():
            start = t0 if n_tokens is None else max(t0, self.window_start(name, n_tokens))
            if start < t1:
                part.fill(room_id, group_pages[name], start, t1, garbage_below)

    def fill_states(self, room_id: int, slots: dict[str, int]) -> None:
        for name, part in self.states.items():
            part.fill(room_id, slots[name])

    def check_groups(self, room_id: int, group_pages: dict[str, list[int]], slots: dict[str, int],
                     n_tokens: int) -> int:
        """Mismatching bytes of every group beyond the first: the tokens a decode rank needs of each
        paged group (a window's last tokens), each state group's slot."""
        bad = 0
        for name, part in self.paged.items():
            bad += part.check(room_id, group_pages[name], n_tokens, self.window_start(name, n_tokens))
        for name, part in self.states.items():
            bad += part.check(room_id, slots[name])
        return bad

    def moved_bytes(self, n_tokens: int, prefix: int) -> int:
        """Bytes a decode rank receives for a room: the first group's tokens past the prefix, each
        paged group's tokens past the prefix and before its window, each state slot."""
        def paged(part: _Paged, start: int) -> int:
            return max(0, n_tokens - start) * part.head_bytes * len(part.heads) * len(part.tensors) * \
                len(part.tensors[0])

        total = paged(self.first, prefix)
        for name, part in self.paged.items():
            total += paged(part, max(prefix, self.window_start(name, n_tokens)))
        for part in self.states.values():
            total += sum(t[0].numel() * t[0].element_size() for t in part.tensors)
        return total

    def take_slots(self) -> dict[str, int]:
        return {name: part.take() for name, part in self.states.items()}

    def give_groups(self, group_pages: dict[str, list[int]], slots: dict[str, int]) -> None:
        for name, pages in group_pages.items():
            self.paged[name].give(pages)
        for name, slot in slots.items():
            self.states[name].give(slot)

    @staticmethod
    def strip(group_pages: dict[str, list[int]]) -> dict[str, list[int]]:
        """A decode room's group pages as ``open_room`` takes them: from the first page needed."""
        return {name: [p for p in pages if p >= 0] for name, pages in group_pages.items()}
