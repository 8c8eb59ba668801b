"""SGLang's ``KVArgs`` as a kvproto cache, and what kvproto refuses at start.

Theory of operation
-------------------
A backend is given the rank's memory as raw addresses (``KVArgs``): ``kv_data_ptrs`` lists every
layer's K buffer, then every layer's V buffer (MHA) or every layer's latent (MLA), each
``kv_data_lens`` bytes of pages of ``kv_item_lens`` bytes; ``aux_data_ptrs`` lists SGLang's
metadata buffers (first token, cached-token counts, logprobs, hidden states, the room id), which
share one slot index. kvproto describes the pages as bytes (``KVCache.from_pointers``): a
page holds ``page_size`` tokens of this rank's heads, token-major, each head
``item_len / (page_size x heads)`` bytes; the head count is the model's (``KVArgs`` carries it
on the prefill; the decode reads the model config, as SGLang's pool did). SGLang itself checks
that both servers use the same page size and KV dtype; kvproto's registration checks the rest
(heads, head bytes, layers, MLA) and converts TP sizes both ways.

A hybrid model's Mamba state (``StateType.MAMBA``: conv and temporal tensors per layer, one slot
per request) becomes a kvproto state group named ``mamba`` after the attention layers' group,
each group carrying the model layers SGLang names (``kv_layer_ids``, ``state_layer_ids``); the
request's slot comes with the last chunk (prefill) and the metadata (decode) as SGLang's
``state_indices``. Each tensor is described as ``KVArgs`` describe it for SGLang's own backends
(``mamba_layout``): per slot, ``state_slice_outer_counts`` rows of the TP slice axis, whose size on
this rank is ``state_dim_per_tensor`` (0: the tensor is replicated over attention TP), each index
the rest of the row's bytes; the axis is split over attention TP, as one range or, where
``state_conv_shard_groups`` lists them (a GDN conv state's ``[Q | K | V]``, Kimi's ``[q | k | v]``),
as those sub-blocks each split on its own (kvproto's sections). Both layouts of a conv state
(channels outer, or rows of channels: Kimi's ``(kernel - 1, channels)``) are the same rule. So the
state moves between any attention TP sizes whose split its dims allow, each decode rank's slot
written with exactly its share. Where KVArgs cannot say where every byte belongs, it moves between
equal attention TP sizes only, each rank's slot to the same rank, and a decode meeting a prefill of
another TP size refuses it with the reason (``MambaLayout.same_tp_only``): KVArgs without usable
slice dims (the tensors then described as bytes), or a state that names no conv sub-blocks at all,
since a conv state may be several projections split each on its own where KVArgs say nothing of
them: a Mamba2 mixer's is ``[x | B | C]``, on which one range would put ``x`` channels where ``B``
belongs. For SGLang's own Mamba2 mixer models the manager reads those sub-blocks from the model
config (``manager.mamba2_conv_sections``).

A sliding-window model's window pool (``StateType.SWA``: SGLang's ``SWAKVPool`` of MHA pools, K
then V of each sliding-window layer, pages of the window pool) and a sparse-attention model's
indexer (``StateType.DSA``: ``DSATokenToKVPool``'s index keys with their scales, one buffer per
layer, pages of the KV's page table, replicated over attention TP as the latent is) become paged
groups named ``swa`` and ``dsa`` whose window the engine names (``NAMED_WINDOW``, protocol 1.5):
SGLang keeps no window size a backend can read, and names those pages only with the last chunk, on
both sides by one rule (the window's: from ``⌊max(prefix, length − window) / page⌋``; the indexer's:
those past the decode's prefix). The prefill gives them with its last chunk, the decode with its
metadata (``state_args``), and kvproto moves the tokens the decode names, with the last chunk; the
window's heads split over TP as the KV's do (SGLang's own NIXL backend slices them so, in NHD pages).
An indexer layer SGLang keeps no rows for (its shared-top-k layers: ``item_len`` 0) is left out on
both sides alike.

What kvproto cannot do is refused here, before any room, with the reason (``refusal``):
pipeline parallelism, attention or decode context parallelism, KV cache sharding, speculative
decoding's draft KV, cache states other than these (DeepSeek-V4's SWA ring and request state, the
indexer's compressed tail, MiniMax's sparse pools, block scales, ...), a window pool SGLang gives no
NHD layout for, compressed/custom KV layouts, and the ``prefill_complete`` decode allocation
policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvproto.aio import AuxBuffer, KVCache, StateCache
from kvproto.geometry import NAMED_WINDOW
from kvproto.transport import MemKind


def refusal(kv_args: Any, *, parallel: Any, disagg: Any) -> str | None:
    """Why kvproto cannot serve this SGLang configuration (None: it can)."""
    if parallel.pp_size > 1:
        return f"pipeline parallelism (--pp-size {parallel.pp_size}); kvproto moves TP ranks only"
    if parallel.attn_cp_size > 1:
        return f"attention context parallelism (attention CP size {parallel.attn_cp_size})"
    if getattr(parallel, "attn_dcp_size", 1) > 1:
        return f"decode context parallelism (--dcp-size {parallel.attn_dcp_size})"
    if getattr(parallel, "enable_kv_cache_sharding", False):
        return "KV cache sharding (--enable-kv-cache-sharding)"
    if getattr(kv_args, "num_draft_entries", 0):
        return "speculative decoding's draft KV cache"
    states = [getattr(s, "value", str(s)) for s in getattr(kv_args, "state_types", None) or []]
    if states and states not in ([MAMBA], [SWA], [DSA]):
        return (f"the cache states {states} (kvproto maps SGLang's {MAMBA!r}, {SWA!r} and {DSA!r} states, one "
                f"at a time)")
    if states == [SWA] and str(getattr(kv_args, "swa_kv_cache_layout", None) or "").lower() != "nhd":
        return (f"a sliding-window pool of layout {getattr(kv_args, 'swa_kv_cache_layout', None)!r} (kvproto moves "
                f"SGLang's SWAKVPool of MHA pools, NHD pages)")
    if states == [MAMBA] and getattr(kv_args, "is_hybrid_mla_backend", False):
        return "a Mamba state beside an MLA cache"
    if getattr(kv_args, "kv_layout", None) is not None:
        return f"the KV layout {kv_args.kv_layout!r}"
    if getattr(disagg, "disaggregation_decode_allocation_policy", "early") != "early":
        return f"--disaggregation-decode-allocation-policy {disagg.disaggregation_decode_allocation_policy}"
    return None


MAMBA = "mamba"
"""SGLang's ``StateType.MAMBA`` (Mamba2, GDN, Kimi linear attention: conv and temporal state per
request slot), the kvproto state group of that name."""
SWA = "swa"
"""SGLang's ``StateType.SWA`` (a sliding-window pool), the kvproto paged group of that name."""
DSA = "dsa"
"""SGLang's ``StateType.DSA`` (a sparse-attention indexer), the kvproto paged group of that name."""
NAMED = (SWA, DSA)
"""The states that are paged groups whose window the engine names (module docstring)."""


class MambaLayout(NamedTuple):
    """How SGLang's ``KVArgs`` describe a Mamba state's tensors (one entry per tensor, in the order
    of a layer's tensors), as ``StateCache.from_pointers`` takes them."""

    shapes: list[tuple[int, ...]] | None
    """Per tensor, this rank's per-slot shape in bytes: ``(rows before the slice axis, slice dim,
    bytes per index)``, or ``(bytes,)`` for a replicated tensor; None: each tensor one vector of
    bytes (what KVArgs cannot describe better)."""
    shard_dims: list[int | None] | None
    sections: list[tuple[int, ...] | None] | None
    same_tp_only: str | None
    """Why this state moves between equal attention TP sizes only (None: between any)."""


def mamba_layout(kv_args: Any, *, tp_size: int, conv_sections: Sequence[int] | None = None) -> MambaLayout:
    """The Mamba state's tensors as ``KVArgs`` describe them (module docstring): per tensor the TP
    slice dim (``state_dim_per_tensor``, this rank's; 0: replicated), the rows before it
    (``state_slice_outer_counts``) and its sub-blocks (``state_conv_shard_groups``, global), each
    alike over the tensor's layers. ``conv_sections``: the conv state's sub-blocks as the model says
    them where KVArgs name none (a Mamba2 mixer's ``[x | B | C]``: ``KVProtoManager``), for a state
    of a conv tensor first and at most a temporal one after it."""
    i = [getattr(s, "value", str(s)) for s in kv_args.state_types].index(MAMBA)
    items, layer_ids = kv_args.state_item_lens[i], list(kv_args.state_layer_ids[i])
    layers = len(dict.fromkeys(layer_ids))
    tensors = len(items) // layers

    def per_tensor(field: str, default: Any = None) -> list[Any] | None:
        components = list(getattr(kv_args, field, None) or [])
        values = list(components[i] or []) if i < len(components) else []
        if not values and default is not None:
            values = [default] * len(items)
        if len(values) != len(items):
            return None
        rows = [values[t * layers:(t + 1) * layers] for t in range(tensors)]
        if any(any(v != row[0] for v in row) for row in rows):
            return None
        return [row[0] for row in rows]

    sizes, dims, outer = per_tensor("state_item_lens"), per_tensor("state_dim_per_tensor"), \
        per_tensor("state_slice_outer_counts", 1)
    groups = per_tensor("state_conv_shard_groups", [None])
    if sizes is None:
        raise ValueError(f"kvproto: the Mamba state's entries of one tensor differ in bytes per slot over its layers: "
                         f"{list(items)}")
    if dims is None or outer is None or groups is None:
        return MambaLayout(None, None, None, "SGLang's KVArgs give no TP slice of each Mamba state tensor "
                                             "(state_dim_per_tensor, state_slice_outer_counts)")
    shapes, shard_dims, sections = [], [], []
    for t, (nbytes, dim, rows, blocks) in enumerate(zip(sizes, dims, outer, groups)):
        dim, rows, nbytes = int(dim), int(rows or 1), int(nbytes)
        if dim == 0:  # replicated over the attention TP group
            shapes.append((nbytes,))
            shard_dims.append(None)
            sections.append(None)
            continue
        if dim < 0 or rows < 1 or nbytes % (dim * rows):
            return MambaLayout(None, None, None, f"Mamba state tensor {t}: {nbytes} bytes per slot are not "
                                                 f"{rows} rows of a slice dim of {dim}")
        blocks = [int(b) for b in blocks] if blocks else None
        if blocks is not None and sum(blocks) != dim * tp_size:
            return MambaLayout(None, None, None, f"Mamba state tensor {t}: sub-blocks {blocks} do not add up to its "
                                                 f"slice dim {dim} x attention TP {tp_size}")
        shapes.append((rows, dim, nbytes // (dim * rows)))
        shard_dims.append(1)
        sections.append(tuple(blocks) if blocks else None)
    same_tp_only = None
    if any(d is not None for d in shard_dims) and not any(sections):
        conv = tuple(int(n) for n in conv_sections or ())
        if conv and len(shapes) <= 2 and shard_dims[0] == 1 and shapes[0][1] * tp_size == sum(conv):
            sections[0] = conv
        else:
            same_tp_only = ("SGLang's KVArgs name no conv sub-blocks for it (state_conv_shard_groups), nor is its "
                            "model one of SGLang's Mamba2 mixers ([x | B | C]), and a conv state may hold several "
                            "projections each split over TP on its own, which one slice would misplace")
    return MambaLayout(shapes, shard_dims, sections, same_tp_only)


def mamba_group(kv_args: Any, *, tp_size: int, tp_rank: int, on_gpu: bool,
                conv_sections: Sequence[int] | None = None) -> StateCache:
    """SGLang's Mamba state entries (tensor-major: every layer of the first tensor, then the next
    tensor's) as a kvproto state group, layer-major, each tensor described by ``mamba_layout``
    (as bytes per slot where KVArgs do not describe it: ``KVProtoManager.try_ensure_parallel_info``
    then refuses another TP size)."""
    i = [getattr(s, "value", str(s)) for s in kv_args.state_types].index(MAMBA)
    ptrs, lens, items = kv_args.state_data_ptrs[i], kv_args.state_data_lens[i], kv_args.state_item_lens[i]
    layer_ids = list(kv_args.state_layer_ids[i])
    layers = list(dict.fromkeys(layer_ids))
    if not ptrs or len(ptrs) % len(layers) or len(items) != len(ptrs) or len(lens) != len(ptrs):
        raise ValueError(f"kvproto: {len(ptrs)} Mamba state entries for {len(layers)} layers")
    tensors = len(ptrs) // len(layers)
    slots = {n // b for n, b in zip(lens, items)}
    if len(slots) != 1:
        raise ValueError(f"kvproto: Mamba state tensors hold different numbers of slots: {sorted(slots)}")
    layout = mamba_layout(kv_args, tp_size=tp_size, conv_sections=conv_sections)
    rows = [[ptrs[t * len(layers) + l] for t in range(tensors)] for l in range(len(layers))]
    return StateCache.from_pointers(MAMBA, rows, slot_bytes=[items[t * len(layers)] for t in range(tensors)],
                                    num_slots=slots.pop(), shapes=layout.shapes, shard_dims=layout.shard_dims,
                                    sections=layout.sections, tp_size=tp_size, tp_rank=tp_rank, model_layers=layers,
                                    mem_kind=MemKind.VRAM if on_gpu else MemKind.DRAM,
                                    device_id=int(getattr(kv_args, "gpu_id", 0) or 0) if on_gpu else 0)


class StateArgs(NamedTuple):
    """What SGLang's ``state_indices`` give kvproto's room: each state group's slot, each named
    group's pages (None where there is none of that kind)."""

    slots: dict[str, int] | None
    group_pages: dict[str, list[int]] | None


def state_args(kv_args: Any, state_indices: list | None) -> StateArgs:
    """SGLang's ``state_indices`` (one entry per ``KVArgs.state_types``: for Mamba a one-element
    array of the request's state slot; for a window or indexer pool the pages it names) as a
    kvproto room takes them."""
    if not state_indices:
        return StateArgs(None, None)
    names = [getattr(s, "value", str(s)) for s in kv_args.state_types]
    slots: dict[str, int] = {}
    pages: dict[str, list[int]] = {}
    for name, indices in zip(names, state_indices):
        values = [int(v) for v in (indices.tolist() if hasattr(indices, "tolist") else indices)]
        if name in NAMED:
            pages[name] = values
        elif name == MAMBA and len(values) == 1:
            slots[name] = values[0]
        else:
            raise ValueError(f"kvproto: state {name!r} with indices {values}: one Mamba slot expected")
    return StateArgs(slots or None, pages or None)


def named_group(kv_args: Any, name: str, *, tp_size: int, tp_rank: int, total_kv_heads: int, on_gpu: bool,
                views: bool = False) -> KVCache:
    """A window or indexer pool (``SWA``, ``DSA``) as a kvproto paged group whose window the engine
    names: the window pool's K then V of each sliding-window layer (the model's heads, as the KV's),
    or the indexer's one buffer per layer (one head of its page's bytes per token, replicated); the
    indexer's layers without rows left out."""
    i = [getattr(s, "value", str(s)) for s in kv_args.state_types].index(name)
    ptrs, lens, items = list(kv_args.state_data_ptrs[i]), list(kv_args.state_data_lens[i]), \
        list(kv_args.state_item_lens[i])
    if name == DSA:
        keep = [k for k, item in enumerate(items) if item]
        ptrs, lens, items = [ptrs[k] for k in keep], [lens[k] for k in keep], [items[k] for k in keep]
    planes = 2 if name == SWA else 1
    if not ptrs or len(ptrs) % planes or len(set(lens)) != 1 or len(set(items)) != 1:
        raise ValueError(f"kvproto: KVArgs' {name!r} state lists {len(ptrs)} buffers of lengths {sorted(set(lens))} "
                         f"and pages of {sorted(set(items))} bytes; expected {'K and V per layer' if planes == 2 else 'one per layer'}, alike")
    layers = len(ptrs) // planes
    return KVCache.from_pointers(
        [ptrs[p * layers:(p + 1) * layers] for p in range(planes)], page_bytes=items[0], region_bytes=lens[0],
        block_size=int(kv_args.page_size), tp_size=tp_size, tp_rank=tp_rank,
        num_kv_heads=total_kv_heads if name == SWA else 1, mla=name == DSA,
        mem_kind=MemKind.VRAM if on_gpu else MemKind.DRAM,
        device_id=int(getattr(kv_args, "gpu_id", 0) or 0) if on_gpu else 0, owner=kv_args, name=name,
        window=NAMED_WINDOW, views=views)


def cache_from_kvargs(kv_args: Any, *, mla: bool, tp_size: int, tp_rank: int, total_kv_heads: int,
                      on_gpu: bool, conv_sections: Sequence[int] | None = None, views: bool = False) -> KVCache:
    """kvproto's description of the rank's KV and aux memory as ``KVArgs`` gives it, with the group
    of its one cache state after the attention layers' KV: a Mamba state group (``mamba_layout``),
    or a window or indexer pool (``named_group``). ``views``: the paged groups' regions as tensors
    too (``KVCache.from_pointers``), which the staged path needs."""
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    planes = 1 if mla else 2
    if not ptrs or len(ptrs) % planes or len(set(lens)) != 1 or len(set(items)) != 1:
        raise ValueError(f"kvproto: KVArgs lists {len(ptrs)} KV buffers of lengths {sorted(set(lens))} and pages of "
                         f"{sorted(set(items))} bytes; expected {'one latent' if mla else 'K and V'} per layer, alike")
    layers = len(ptrs) // planes
    aux = None
    aux_ptrs = list(getattr(kv_args, "aux_data_ptrs", None) or [])
    if aux_ptrs:
        slot_bytes = list(kv_args.aux_item_lens)
        slots = {n // b for n, b in zip(kv_args.aux_data_lens, slot_bytes)}
        if len(slots) != 1:
            raise ValueError(f"kvproto: the metadata buffers hold different numbers of slots: {sorted(slots)}")
        aux = AuxBuffer.from_pointers(list(zip(aux_ptrs, slot_bytes)), slots.pop())
    hybrid = bool(getattr(kv_args, "state_types", None))
    ids = list(getattr(kv_args, "kv_layer_ids", None) or []) if hybrid else []
    kv = KVCache.from_pointers(
        [ptrs[p * layers:(p + 1) * layers] for p in range(planes)], page_bytes=items[0], region_bytes=lens[0],
        block_size=int(kv_args.page_size), tp_size=tp_size, tp_rank=tp_rank, num_kv_heads=1 if mla else total_kv_heads,
        mla=mla, mem_kind=MemKind.VRAM if on_gpu else MemKind.DRAM, device_id=int(getattr(kv_args, "gpu_id", 0) or 0)
        if on_gpu else 0, aux=aux, owner=kv_args, model_layers=ids[:layers] if hybrid and ids else None, views=views)
    if not hybrid:
        return kv
    (state,) = [getattr(s, "value", str(s)) for s in kv_args.state_types]  # (``refusal``: one at a time)
    if state in NAMED:
        return kv.with_groups(named_group(kv_args, state, tp_size=tp_size, tp_rank=tp_rank,
                                          total_kv_heads=total_kv_heads, on_gpu=on_gpu, views=views))
    return kv.with_groups(mamba_group(kv_args, tp_size=tp_size, tp_rank=tp_rank, on_gpu=on_gpu,
                                      conv_sections=conv_sections))
