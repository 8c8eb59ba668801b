"""vLLM's KV cache as kvproto groups: one plan, computed alike by the scheduler and every worker.

Theory of operation
-------------------
vLLM (0.33) describes a model's cache as *KV cache groups* (``KVCacheConfig.kv_cache_groups``):
layers that share one block table. A plain model has one group; a hybrid one has several, all
drawing block ids from one pool and overlaying one backing buffer (a block id belongs to one group
at a time). kvproto describes a cache the same way (``KVCache.with_groups``), so the mapping is one
to one, decided here from the config alone, so that the scheduler (which never sees a tensor) and
the workers (which do) name the same groups:

===========================================  ============================================  ==========
vLLM spec of the group's layers              kvproto group                                 pages
===========================================  ============================================  ==========
``FullAttentionSpec`` (K and V per head)     paged, K|V fused per head (``kv_fused``)      every token
``MLAAttentionSpec`` (a latent; an indexer)  paged, MLA (one head, the same on every rank)  every token
``SlidingWindowSpec`` (``sliding_window=W``) paged with ``window=W``                        the last W
``MambaSpec`` (GDN, Mamba2, Mamba1)          state: conv and SSM tensors of a block's page  one slot
===========================================  ============================================  ==========

A Mamba-family group keeps, per request, one block whose page holds each layer's states side by
side (``MambaBase.bind_kv_cache``: the conv state, then the SSM state, then padding up to the
pool's page size): a kvproto state group whose slots are the pool's blocks, each tensor read in
place at its offset in the page, a page apart (``StateCache.from_tensors``' strided slots). TP
shards the SSM state by heads and the conv state by channels, each of the conv's projections on
its own (GDN ``[Q | K | V]``, Mamba2 ``[x | B | C]``): the conv tensor is *sectioned* along its
channel dimension, which is the first of its shape in vLLM's ``DS`` conv layout and the last in
``SD`` (the default), so kvproto reshards both across TP sizes. A state group moves the
request's running-state block (the last of its blocks, speculative scratch blocks aside), with
the prompt's last chunk. As vLLM's own connectors do, the prefill of a model with such groups
computes all but the prompt's last token and the decode computes that token itself: the state
moved is the one *before* the last token (a decode that took the state after it would apply the
last token twice).

Anything else (other linear-attention states, chunked-local, circular, sink or encoder caches,
draft layers of speculative decoding, Mamba2 whose groups do not split over TP) is refused at
start with the group's index, its kind and its first layer, never moved wrongly. A vLLM group whose layers differ in shape (vLLM's
``UniformTypeKVCacheSpecs``: DeepSeek-V3.2's latent and its indexer cache in one table) becomes one
kvproto group per shape, each given the same block ids. A group is named ``<vLLM group>:<kind>``
(``0:full``, ``1:swa128``, ``0:mla.1``): both instances compute the same names from the same
model, and a difference is refused by kvproto's registration naming the group. The first kvproto
group must be a paged group without a window (kvproto moves the others beside it): the first
full-attention or MLA group, wherever vLLM lists it.

Each layer is read through vLLM's own per-layer view, ``[blocks, heads, tokens, content]`` in the
cache layout's physical order (``LBHNC``: head-major pages, kvproto's HND; ``LBNHC``: token-major,
NHD). Layouts that interleave layers inside a block have no dense region per layer and are refused
with the setting that fixes it. Layer ``i`` of the model is the integer in the layer's name, which
is how layer-wise sends count layers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvproto.aio import KVCache, StateCache
from kvproto.geometry import Layout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


class Unsupported(ValueError):
    """A cache kvproto cannot move, refused at start: the message names the group and why."""


@dataclass(frozen=True)
class StateLayout:
    """A Mamba-family group's states inside a block's page, one layer's: each tensor's local shape,
    dtype, offset in the page, the dimension TP splits (None: every rank holds it whole) and the
    global sizes of the sections side by side along it."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    offsets: tuple[int, ...]
    shard_dims: tuple[int | None, ...]
    sections: tuple[tuple[int, ...] | None, ...]
    spec_blocks: int = 0
    """Speculative scratch blocks vLLM keeps after a request's running-state block."""


@dataclass(frozen=True)
class GroupPlan:
    """One kvproto group: which vLLM group's block ids it takes, and what it holds."""

    name: str
    vllm_group: int
    kind: str
    """``full``, ``mla``, ``swa`` or ``state``."""
    layers: tuple[str, ...]
    """vLLM layer names, in model-layer order."""
    model_layers: tuple[int, ...]
    block_size: int
    window: int | None = None
    mla: bool = False
    state: StateLayout | None = None

    def slot(self, block_ids: list[int]) -> int:
        """A state group's slot for a request: its running-state block (speculative scratch aside)."""
        assert self.state is not None
        scratch = min(self.state.spec_blocks, len(block_ids) - 1)
        return (block_ids[:-scratch] if scratch else block_ids)[-1]

    def pages(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """The pages a decode names for a prompt of ``num_tokens``: every page holding a token it
        needs (a window's last tokens only), from the group's block ids from token 0."""
        end = -(-num_tokens // self.block_size)
        first = 0 if self.window is None or num_tokens <= self.window else (num_tokens - self.window) // self.block_size
        return list(block_ids[first:end])


def layer_index(name: str) -> int:
    """The model layer of a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = re.findall(r"\.(\d+)(?=\.|$)", name)
    if len(found) != 1:
        raise Unsupported(f"kvproto connector: cannot tell the model layer of {name!r}")
    return int(found[0])


def _kind(spec: KVCacheSpec) -> tuple[str, int | None] | None:
    """(kind, window) of a layer spec kvproto moves, None for one it cannot."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                            SlidingWindowSpec)

    exact = type(spec)
    if exact is MambaSpec:
        return "state", None
    if exact is MLAAttentionSpec:
        return "mla", None
    if exact is FullAttentionSpec and spec.attention_chunk_size is None and not spec.non_causal:
        return "full", None  # a sliding_window here means the hybrid allocator is off: every token is kept
    if exact in (SlidingWindowSpec, SlidingWindowMLASpec) and not spec.extra_retained_tokens:
        return ("swa-mla" if exact is SlidingWindowMLASpec else "swa"), spec.sliding_window
    return None


def plan_groups(kv_cache_config: KVCacheConfig, tp_size: int = 1) -> list[GroupPlan]:
    """kvproto's groups for vLLM's transfer groups, the first kvproto group first (see module doc).
    ``tp_size``: this instance's, for the global sizes of state tensors TP splits."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    plans: list[GroupPlan] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if not group.enable_kv_transfer:
            continue
        spec = group.kv_cache_spec
        by_shape: dict[tuple[Any, ...], list[tuple[int, str]]] = {}
        states: dict[tuple[Any, ...], StateLayout] = {}
        for name in group.layer_names:
            layer_spec = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            kind = _kind(layer_spec)
            if kind is None or layer_spec.is_draft:
                what = "a draft (speculative decoding) layer" if kind is not None else type(layer_spec).__name__
                raise Unsupported(f"kvproto connector: KV cache group {index} holds {what} (layer {name!r}); "
                                  "kvproto moves full-attention, MLA, sliding-window and Mamba-family caches")
            if kind[0] == "state":
                layout = state_layout(layer_spec, tp_size, f"KV cache group {index} (layer {name!r})")
                shape: tuple[Any, ...] = (kind, layer_spec.block_size, layout)
                states[shape] = layout
            else:
                shape = (kind, layer_spec.block_size, layer_spec.num_kv_heads, layer_spec.state_content_size_bytes,
                         layer_spec.dtype)
            by_shape.setdefault(shape, []).append((layer_index(name), name))
        for sub, (shape, members) in enumerate(by_shape.items()):
            (kind, window), block = shape[0], shape[1]
            layers = sorted(members)
            suffix = f".{sub}" if len(by_shape) > 1 else ""
            label = kind if window is None else f"{kind}{window}"
            plans.append(GroupPlan(f"{index}:{label}{suffix}", index, kind.removesuffix("-mla"),
                                   tuple(n for _, n in layers), tuple(i for i, _ in layers), block, window,
                                   mla=kind in ("mla", "swa-mla"), state=states.get(shape)))
    first = next((p for p in plans if p.window is None and p.state is None), None)
    if first is None:
        raise Unsupported("kvproto connector: the model has no full-attention or MLA cache group; kvproto needs one "
                          "to carry the others")
    return [first, *(p for p in plans if p is not first)]


def state_layout(spec: Any, tp_size: int, where: str) -> StateLayout:
    """How a ``MambaSpec`` lays one layer's states in a page, and how TP splits them (module doc)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Mamba

    shapes = tuple(tuple(int(n) for n in shape) for shape in spec.shapes)
    dtypes = tuple(spec.dtypes)
    offsets, at = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(at)
        at += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if spec.tp_replicated:
        return StateLayout(shapes, dtypes, tuple(offsets), (None,) * len(shapes), (None,) * len(shapes),
                           spec.num_speculative_blocks)
    kinds = {Mamba.GDN_ATTN: "gdn", Mamba.MAMBA2: "mamba2", Mamba.MAMBA1: "mamba1"}
    kind = kinds.get(spec.mamba_type)
    if kind is None or len(shapes) != 2 or len(shapes[0]) != 2:
        raise Unsupported(f"kvproto connector: {where} holds {spec.mamba_type.name} state, which kvproto does not "
                          f"split over TP; it moves GDN, Mamba2 and Mamba1 states")
    conv_dim = 0 if is_conv_state_dim_first() else 1
    channels, ssm = shapes[0][conv_dim], shapes[1]
    if kind == "gdn":  # conv [Q | K | V], Q and K alike; SSM (value heads, value dim, key dim)
        value = ssm[0] * ssm[1]
        sections = ((channels - value) // 2, (channels - value) // 2, value)
    elif kind == "mamba2":  # conv [x | B | C], B and C alike; SSM (heads, head dim, state)
        x = ssm[0] * ssm[1]
        sections = (x, (channels - x) // 2, (channels - x) // 2)
    else:  # mamba1: conv [x]; SSM (channels, state)
        sections = (channels,)
    if any(n <= 0 for n in sections) or sum(sections) != channels:
        raise Unsupported(f"kvproto connector: {where}: a {kind} conv state of {channels} channels does not split "
                          f"into its projections (SSM state {ssm})")
    return StateLayout(shapes, dtypes, tuple(offsets), (conv_dim, 0),
                       (tuple(n * tp_size for n in sections), None), spec.num_speculative_blocks)


def dense_layer(name: str, view: torch.Tensor, block_size: int) -> tuple[torch.Tensor, Layout]:
    """A vLLM layer view ``[blocks, heads, tokens, content]`` as kvproto's dense tensor and layout."""
    if view.dim() != 4:
        raise Unsupported(f"kvproto connector: layer {name} is a {view.dim()}-D view {tuple(view.shape)}; this "
                          "connector reads vLLM's [blocks, heads, tokens, content] layer views (vLLM 0.33)")
    if view.shape[2] != block_size:
        raise Unsupported(f"kvproto connector: layer {name} has {view.shape[2]}-token kernel blocks but its cache "
                          f"group has {block_size}-token blocks; kernel block splitting is not supported")
    if view.is_contiguous():
        return view, Layout.HND
    if view.transpose(1, 2).is_contiguous():
        return view.transpose(1, 2), Layout.NHD
    raise Unsupported(f"kvproto connector: layer {name} (strides {view.stride()}) is not one dense region of pages; "
                      "kvproto needs a layer-compact cache layout: set VLLM_KV_CACHE_LAYOUT to LBHNC or LBNHC")


def kv_cache_from_vllm(kv_caches: dict[str, torch.Tensor], plans: list[GroupPlan], *, tp_size: int, tp_rank: int,
                       total_kv_heads: int) -> KVCache:
    """kvproto's description of one worker's cache: a group per plan, read through vLLM's views.

    ``total_kv_heads``: the model's KV heads, for full-attention groups whose heads vLLM replicates
    over TP ranks (TP beyond the head count)."""
    if not kv_caches:
        raise Unsupported("kvproto connector: register_kv_caches got no cache tensors")
    caches: list[Any] = []
    for plan in plans:
        if plan.state is not None:
            caches.append(state_cache(kv_caches, plan, tp_size=tp_size, tp_rank=tp_rank))
            continue
        tensors, layouts = [], set()
        for name in plan.layers:
            if name not in kv_caches:
                raise Unsupported(f"kvproto connector: vLLM registered no cache for layer {name!r} of group {plan.name}")
            tensor, layout = dense_layer(name, kv_caches[name], plan.block_size)
            tensors.append(tensor)
            layouts.add(layout)
        if len(layouts) > 1:
            raise Unsupported(f"kvproto connector: the layers of group {plan.name} differ in layout (NHD and HND)")
        local_heads = tensors[0].shape[1 if layouts == {Layout.HND} else 2]
        if plan.mla and local_heads != 1:
            raise Unsupported(f"kvproto connector: MLA group {plan.name} holds {local_heads} heads per page, expected 1")
        heads = None if plan.mla else (total_kv_heads if local_heads == max(1, total_kv_heads // tp_size)
                                       else local_heads * tp_size)
        caches.append(KVCache.from_tensors([tensors], tp_size=tp_size, tp_rank=tp_rank, num_kv_heads=heads,
                                           layout=layouts.pop(), mla=plan.mla, kv_fused=not plan.mla,
                                           name=plan.name, window=plan.window, model_layers=plan.model_layers))
    first, *rest = caches
    return first.with_groups(*rest) if rest else first


def state_cache(kv_caches: dict[str, torch.Tensor], plan: GroupPlan, *, tp_size: int, tp_rank: int) -> StateCache:
    """A state group read in place: each layer's ``[blocks, 1, 1, page bytes]`` view of vLLM's pool,
    its tensors cut out of every page at their offsets (as ``MambaBase.bind_kv_cache`` does), slots a
    page apart."""
    layout = plan.state
    assert layout is not None
    layers = []
    for name in plan.layers:
        if name not in kv_caches:
            raise Unsupported(f"kvproto connector: vLLM registered no cache for layer {name!r} of group {plan.name}")
        view = kv_caches[name]
        if view.dim() != 4 or view.shape[1:3] != (1, 1) or view.stride(-1) != 1:
            raise Unsupported(f"kvproto connector: state layer {name} is a {tuple(view.shape)} view with strides "
                              f"{view.stride()}; this connector reads vLLM's [blocks, 1, 1, page bytes] state pages")
        pages = view.view(torch.uint8)[:, 0, 0]
        tensors = []
        for shape, dtype, offset in zip(layout.shapes, layout.dtypes, layout.offsets):
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            tensors.append(pages[:, offset:offset + size].view(dtype).view(pages.shape[0], *shape))
        layers.append(tensors)
    return StateCache.from_tensors(plan.name, layers, shard_dims=list(layout.shard_dims),
                                   sections=[list(x) if x else None for x in layout.sections], tp_size=tp_size,
                                   tp_rank=tp_rank, model_layers=plan.model_layers)
