"""The KV cache and aux buffer of one rank, as the endpoints see them.

A ``KVCache`` names the geometry and the base address of every region (region
``r = layer * planes + plane``); ``from_tensors`` builds one from the per-layer torch tensors
a serving engine already owns (the tensors are kept alive by the cache object). An optional
``AuxBuffer`` holds fixed-size slots for per-request metadata (first output token, ...).

Hybrid models keep more than one cache (``kvproto.geometry.groups``): ``kv.with_groups(...)``
adds, after the first group (``kv`` itself), further paged groups (``KVCache.from_tensors(...,
name=, window=)``: sliding-window layers, an indexer cache) and state groups
(``StateCache.from_tensors``: per-request slots of linear-attention or SSM state). Each group
may say which model layers its layers are (``model_layers=``), which layer-wise chunks use.

A state tensor's slots may lie further apart than its bytes (vLLM keeps a layer's conv and
temporal state of one block in one page, padded to the attention page size: the conv tensor is a
``(blocks, *shape)`` view whose dim-0 stride is the page), and its sharded dimension may be several
projections sharded each on its own (``sections=``: a GDN conv state's ``[Q | K | V]``). Groups may
then overlay one buffer (a state group's pages inside an attention layer's buffer, paged groups
aliasing one layer's tensor): ``memory_regions`` gives the transport each range once, the union of
the regions that overlap, while ``wire_regions`` still lists every region on its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvproto.core.groups import GroupSpec
from kvproto.geometry import DType, GeometryError, KVGeometry, Layout
from kvproto.geometry.groups import CacheGeometry, PagedGroup, StateGroup, StateTensor
from kvproto.transport.base import MemKind, MemoryRegion, merge_regions
from kvproto.wire import (NAMED_WINDOW, NO_SHARD, NO_SLOT, GroupKind, LocalProtocolError, RegionKind, WireGeometry, WireGroup,
                          WireGroupLayout, WireRegion, WireStateTensor, WireTensorLayout)

LAYOUT_MINOR = 4
"""The first minor version whose ``CACHE_GROUPS`` carries the groups' layouts (sections, slot
strides): a peer of an older one describes every state tensor as one section with slots back to
back, and cannot address slots that lie further apart (``older_peer_refusal``)."""

NAMED_MINOR = 5
"""The first minor version that knows windows the engine names (``NAMED_WINDOW``): an older peer
takes that value of ``window`` for a window of 2**32 - 1 tokens (``older_peer_refusal``)."""

_TORCH_DTYPES = {
    "torch.float16": DType.FLOAT16,
    "torch.bfloat16": DType.BFLOAT16,
    "torch.float32": DType.FLOAT32,
    "torch.float8_e4m3fn": DType.FLOAT8_E4M3FN,
    "torch.float8_e5m2": DType.FLOAT8_E5M2,
    "torch.uint8": DType.UINT8,
    "torch.int8": DType.INT8,
}


@dataclass(frozen=True, slots=True)
class AuxBuffer:
    """Fixed-size per-request slots moved with a room's last chunk. One buffer (``address``,
    ``slot_bytes`` per slot), or several that share one slot index (``parts``: SGLang's metadata
    buffers, one for the first token, one for logprobs, one for hidden states, ...): slot ``s`` of
    the room is slot ``s`` of every part, moved in one write, and ``slot_bytes`` is their sum."""

    address: int
    slot_bytes: int
    slots: int
    owner: Any = field(default=None, compare=False, repr=False)
    parts: tuple[tuple[int, int], ...] = ()
    """(address, bytes per slot) of each buffer when there are several (the first is ``address``)."""

    @property
    def buffers(self) -> tuple[tuple[int, int], ...]:
        """(address, bytes per slot) of every buffer, in order."""
        return self.parts or ((self.address, self.slot_bytes),)

    @classmethod
    def from_tensor(cls, tensor: Any) -> AuxBuffer:
        """A ``(slots, slot_bytes)``-shaped contiguous tensor (any dtype) as aux slots."""
        if not tensor.is_contiguous() or tensor.dim() < 1:
            raise ValueError("aux tensor must be contiguous with slots along dim 0")
        slots = tensor.shape[0]
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size() // slots, slots, tensor)

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any]) -> AuxBuffer:
        """Several contiguous tensors of ``(slots, ...)`` (any dtype and shape beyond the first
        dimension, the same ``slots``) as one aux slot index."""
        if not tensors:
            raise ValueError("no aux tensors given")
        parts = [cls.from_tensor(t) for t in tensors]
        slots = {p.slots for p in parts}
        if len(slots) != 1:
            raise ValueError(f"aux tensors hold different numbers of slots: {sorted(slots)}")
        if len(parts) == 1:
            return parts[0]
        return cls.from_pointers([(p.address, p.slot_bytes) for p in parts], slots.pop(), owner=tuple(tensors))

    @classmethod
    def from_pointers(cls, buffers: Sequence[tuple[int, int]], slots: int, *, owner: Any = None) -> AuxBuffer:
        """Buffers given as (address, bytes per slot), each holding ``slots`` slots, as one aux
        slot index (the memory is the caller's: keep it alive, or pass it as ``owner``)."""
        buffers = tuple((int(a), int(n)) for a, n in buffers)
        if not buffers or slots <= 0 or any(n <= 0 for _, n in buffers):
            raise ValueError(f"aux buffers {buffers} of {slots} slots describe no slot")
        return cls(buffers[0][0], sum(n for _, n in buffers), slots, owner, buffers if len(buffers) > 1 else ())

    def regions(self) -> list[tuple[int, int]]:
        """(address, length) of every buffer."""
        return [(a, n * self.slots) for a, n in self.buffers]


class _DeviceBytes:
    """``n`` bytes of device memory at ``address``, for ``torch.as_tensor`` (CUDA array interface)."""

    def __init__(self, address: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (address, False), "version": 3}


def bytes_at(address: int, n: int, device: Any) -> Any:
    """A uint8 tensor over ``n`` bytes of this process's memory at ``address`` on ``device`` (a
    ``torch.device``): a view, no copy; the memory must outlive it."""
    import ctypes

    import torch

    if device.type == "cuda":
        return torch.as_tensor(_DeviceBytes(address, n), device=device)
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(address), dtype=torch.uint8)


def _torch_dtype(dtype: Any) -> DType:
    try:
        return _TORCH_DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unsupported cache dtype {dtype}") from None


def _slot_stride(t: Any) -> int | None:
    """Bytes from one slot's start to the next's in a ``(slots, *shape)`` tensor whose every slot is
    C-contiguous (dim 0 may stride further: slots inside pages), or None where a slot is not."""
    want = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != want:
            return None
        want *= size
    return (t.stride(0) if t.shape[0] > 1 else want) * t.element_size()


@dataclass(frozen=True, slots=True)
class StateCache:
    """A state group's memory on one rank: one region per (layer, tensor), layer-major, each
    ``num_slots`` slots of the tensor's local bytes (one request's state per slot), slot ``s`` at
    ``s`` times the tensor's slot stride (``slot_strides``) from the region's base."""

    group: StateGroup
    tp_size: int
    tp_rank: int
    region_addresses: tuple[int, ...]
    mem_kind: MemKind = MemKind.DRAM
    device_id: int = 0
    layers: tuple[int, ...] | None = None
    """The model layer of each of the group's layers (None: after the groups before it)."""
    owner: Any = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def slot_strides(self) -> list[int]:
        """Per tensor, the bytes from one slot's start to the next's in its regions."""
        return self.group.strides(self.tp_size)

    @classmethod
    def from_tensors(cls, name: str, layers: Sequence[Sequence[Any]], *, shard_dims: Sequence[int | None],
                     sections: Sequence[Sequence[int] | None] | None = None, tp_size: int = 1, tp_rank: int = 0,
                     model_layers: Sequence[int] | None = None) -> StateCache:
        """Describe a state group: ``layers[l][t]`` is tensor ``t`` of layer ``l``, shaped ``(slots,
        *local_shape)``, each slot C-contiguous, slots evenly apart (back to back, or further: a view
        of slots inside pages, every layer's tensor ``t`` with the same stride); ``shard_dims[t]`` is
        the dimension of the per-slot shape split over TP (None: replicated); ``sections[t]`` the
        global sizes of the projections side by side along it, each split over TP on its own (None:
        one); ``model_layers``: the model layer of each layer."""
        if not layers or not layers[0]:
            raise ValueError(f"state group {name!r}: no tensors given")
        first = layers[0]
        if len(shard_dims) != len(first) or (sections is not None and len(sections) != len(first)):
            raise ValueError(f"state group {name!r}: {len(shard_dims)} shard dims and "
                             f"{len(first) if sections is None else len(sections)} sections for {len(first)} "
                             f"tensors per layer")
        tensors = []
        for i, (t, dim) in enumerate(zip(first, shard_dims)):
            shape = list(t.shape[1:])
            if dim is not None:
                shape[dim] *= tp_size
            tensors.append(StateTensor(tuple(shape), _torch_dtype(t.dtype), dim,
                                       tuple(sections[i] or ()) if sections is not None else ()))
        slots = first[0].shape[0]
        strides = [_slot_stride(t) for t in first]
        addresses = []
        for index, layer in enumerate(layers):
            if len(layer) != len(first):
                raise ValueError(f"state group {name!r}: layer {index} has {len(layer)} tensors, layer 0 {len(first)}")
            for t, ref, stride in zip(layer, first, strides):
                if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                    raise ValueError(f"state group {name!r}: layer {index}'s tensors differ from layer 0's")
                if stride is None or _slot_stride(t) != stride:
                    raise ValueError(f"state group {name!r}: layer {index}'s tensors are not slots of C-contiguous "
                                     f"state evenly apart, as far apart as layer 0's")
                if t.shape[0] != slots:
                    raise ValueError(f"state group {name!r}: every tensor holds the same number of slots")
                addresses.append(t.data_ptr())
        device = first[0].device
        is_cuda = device.type == "cuda"
        sizes = [math.prod(t.shape[1:]) * t.element_size() for t in first]  # one slot's bytes
        if any(stride < size for stride, size in zip(strides, sizes)):  # (a stride of 0: one slot expanded)
            raise ValueError(f"state group {name!r}: slots of {sizes} bytes lie {strides} bytes apart: they overlap")
        group = StateGroup(name, len(layers), tuple(tensors), slots,
                           tuple(0 if stride == size else stride for stride, size in zip(strides, sizes)))
        try:
            group.strides(tp_size)  # raises where a dimension or section does not split over TP
        except GeometryError as exc:
            raise GeometryError(f"state group {name!r}: {exc}") from None
        return cls(group, tp_size, tp_rank, tuple(addresses), MemKind.VRAM if is_cuda else MemKind.DRAM,
                   (device.index or 0) if is_cuda else 0, None if model_layers is None else tuple(model_layers),
                   owner=layers)

    @classmethod
    def from_pointers(cls, name: str, layers: Sequence[Sequence[int]], *, slot_bytes: Sequence[int], num_slots: int,
                      shapes: Sequence[Sequence[int]] | None = None, shard_dims: Sequence[int | None] | None = None,
                      sections: Sequence[Sequence[int] | None] | None = None, tp_size: int = 1, tp_rank: int = 0,
                      model_layers: Sequence[int] | None = None, mem_kind: MemKind = MemKind.DRAM,
                      device_id: int = 0, owner: Any = None) -> StateCache:
        """A state group an engine gives as raw addresses (SGLang's ``KVArgs`` state entries):
        ``layers[l][t]`` is the address of tensor ``t`` of layer ``l``, ``num_slots`` slots of
        ``slot_bytes[t]`` bytes back to back. ``shapes[t]`` is this rank's per-slot shape of tensor
        ``t`` counted in bytes (its last dimension holds an element's bytes times the elements), its
        product ``slot_bytes[t]``; ``shard_dims[t]`` the dimension of it split over TP (None:
        replicated) and ``sections[t]`` the global sizes of the projections side by side along it
        (as ``from_tensors``). Without them a tensor is one vector of bytes split over TP in rank
        order (shape ``(slot_bytes[t],)``, ``shard_dims[t]`` 0): rank ``r`` of one side pairs with
        rank ``r`` of the other, which between different TP sizes matches a state only where its
        split axis is outermost and one section (the caller refuses the rest)."""
        if not layers or not layers[0] or len(slot_bytes) != len(layers[0]):
            raise ValueError(f"state group {name!r}: {len(slot_bytes)} slot sizes for "
                             f"{len(layers[0]) if layers else 0} tensors per layer")
        if any(len(layer) != len(slot_bytes) for layer in layers):
            raise ValueError(f"state group {name!r}: every layer lists {len(slot_bytes)} tensors")
        count = len(slot_bytes)
        shapes = [(int(n),) for n in slot_bytes] if shapes is None else [tuple(int(d) for d in s) for s in shapes]
        shard_dims = [0] * count if shard_dims is None else list(shard_dims)
        sections = [None] * count if sections is None else list(sections)
        if not len(shapes) == len(shard_dims) == len(sections) == count:
            raise ValueError(f"state group {name!r}: {len(shapes)} shapes, {len(shard_dims)} shard dims and "
                             f"{len(sections)} sections for {count} tensors per layer")
        tensors = []
        for t, (shape, dim, parts, nbytes) in enumerate(zip(shapes, shard_dims, sections, slot_bytes)):
            if math.prod(shape) != nbytes:
                raise ValueError(f"state group {name!r}: tensor {t}'s per-slot shape {shape} is not its "
                                 f"{nbytes} bytes")
            glob = list(shape)
            if dim is not None:
                if not 0 <= dim < len(shape):
                    raise ValueError(f"state group {name!r}: tensor {t} splits dimension {dim} of {shape}")
                glob[dim] *= tp_size
            tensors.append(StateTensor(tuple(glob), DType.UINT8, dim, tuple(parts or ())))
        group = StateGroup(name, len(layers), tuple(tensors), int(num_slots))
        try:
            group.strides(tp_size)  # raises where a dimension or section does not split over TP
        except GeometryError as exc:
            raise GeometryError(f"state group {name!r}: {exc}") from None
        return cls(group, tp_size, tp_rank, tuple(int(a) for layer in layers for a in layer), mem_kind, device_id,
                   None if model_layers is None else tuple(model_layers), owner=owner)

    def region_lengths(self) -> list[int]:
        sizes = self.group.region_bytes(self.tp_size)
        return [sizes[i % len(sizes)] for i in range(len(self.region_addresses))]

    def regions(self) -> list[MemoryRegion]:
        """Each (layer, tensor) region, in order: from its base to its last slot's end."""
        return [MemoryRegion(a, n, self.device_id, self.mem_kind)
                for a, n in zip(self.region_addresses, self.region_lengths())]

    def memory_regions(self) -> list[MemoryRegion]:
        """What a transport registers: the regions, those that overlap (a layer's tensors in one
        page) joined."""
        return merge_regions(self.regions())


@dataclass(frozen=True, slots=True)
class KVCache:
    geometry: KVGeometry
    region_addresses: tuple[int, ...]
    mem_kind: MemKind = MemKind.DRAM
    device_id: int = 0
    aux: AuxBuffer | None = None
    owner: Any = field(default=None, compare=False, repr=False)
    tensors: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    """Region tensors, 4-D in the geometry's layout (needed by the staged path's kernels)."""
    name: str = "kv"
    """The group's name (a one-group cache never needs one)."""
    window: int | None = None
    """A paged group beyond the first: the decode needs only the prompt's last ``window`` tokens."""
    layers: tuple[int, ...] | None = None
    """The model layer of each of this group's layers (None: the first group's are ``0..n-1``,
    a later group's follow the groups before it)."""
    groups: tuple[KVCache | StateCache, ...] = ()
    """The cache's groups beyond this first one (``with_groups``)."""
    group_kinds: tuple[tuple[str, bool], ...] = field(init=False, default=(), compare=False, repr=False)
    """Each group's (name, whether it is a state group), in order: what ``group_args`` reads for
    every chunk and room, made once."""

    def __post_init__(self) -> None:
        if len(self.region_addresses) != self.geometry.num_regions:
            raise ValueError(
                f"{len(self.region_addresses)} region addresses for {self.geometry.num_regions} regions"
            )
        object.__setattr__(self, "group_kinds", tuple((g.name, isinstance(g, StateCache)) for g in self.groups))

    # --- groups -------------------------------------------------------------------------------
    def with_groups(self, *groups: KVCache | StateCache) -> KVCache:
        """This cache as the first group of a cache of several (a hybrid model's), with ``groups``
        after it; names, TP, windows and layer maps are checked here."""
        for g in groups:
            if isinstance(g, KVCache) and (g.groups or g.aux is not None):
                raise ValueError(f"group {g.name!r}: a group beyond the first has no groups or aux buffer of its own")
            if (g.mem_kind, g.device_id) != (self.mem_kind, self.device_id):
                raise ValueError(f"group {g.name!r} is in {g.mem_kind.name} of device {g.device_id}, the first "
                                 f"group in {self.mem_kind.name} of device {self.device_id}: a cache's groups share "
                                 f"one device (a write carries several groups at once)")
        cache = replace(self, groups=tuple(groups))
        cache.cache_geometry  # noqa: B018 - raises GeometryError for an inconsistent cache
        cache.layer_map()
        return cache

    @property
    def cache_geometry(self) -> CacheGeometry:
        """The cache as groups (``kvproto.geometry.groups``); one group for a plain cache."""
        g = self.geometry
        out: list[PagedGroup | StateGroup] = [PagedGroup(self.name, g, self.window)]
        for extra in self.groups:
            if isinstance(extra, StateCache):
                if (extra.tp_size, extra.tp_rank) != (g.tp_size, g.tp_rank):
                    raise GeometryError(f"state group {extra.name!r} is for TP rank {extra.tp_rank}/{extra.tp_size}, "
                                        f"the cache for {g.tp_rank}/{g.tp_size}")
                out.append(extra.group)
            else:
                out.append(PagedGroup(extra.name, extra.geometry, extra.window))
        return CacheGeometry(g.tp_size, g.tp_rank, tuple(out))

    def layer_map(self) -> tuple[tuple[int, ...], ...]:
        """The model layer of every layer of every group (the first group's first); together they
        cover the model's layers ``0..L-1``, each group's ascending."""
        maps: list[tuple[int, ...]] = []
        nxt = 0
        for group in (self, *self.groups):
            count = group.group.num_layers if isinstance(group, StateCache) else group.geometry.num_layers
            ids = group.layers if group.layers is not None else tuple(range(nxt, nxt + count))
            if len(ids) != count or list(ids) != sorted(set(ids)) or ids[0] < 0:
                raise ValueError(f"group {group.name!r}: layers {ids} are not {count} distinct ascending model layers")
            maps.append(tuple(ids))
            nxt = max(nxt, ids[-1] + 1)
        covered = set().union(*maps)
        if covered != set(range(len(covered))):
            raise ValueError(f"the groups' layers {sorted(covered)} do not cover the model's layers "
                             f"0..{max(covered)} once each")
        return tuple(maps)

    @property
    def model_layers(self) -> int:
        """The model's layers: what layer-wise chunks count."""
        return 1 + max(ids[-1] for ids in self.layer_map())

    def group_specs(self) -> tuple[GroupSpec, ...]:
        """The groups beyond the first, as the cores see them."""
        maps = self.layer_map()
        specs = []
        for extra, layers in zip(self.groups, maps[1:]):
            if isinstance(extra, StateCache):
                specs.append(GroupSpec(extra.name, True, extra.group.num_slots, layers=layers))
            else:
                g = extra.geometry
                specs.append(GroupSpec(extra.name, False, g.num_blocks, g.block_size, extra.window, layers))
        return tuple(specs)

    def group_args(self, group_pages: Mapping[str, Sequence[int]] | None, state_slots: Mapping[str, int] | None,
                   *, need_slots: bool = False, first: tuple[Any, list[int]] | None = None
                   ) -> tuple[list[Sequence[int]], list[int] | None]:
        """A room's per-group arguments by group name, as the cores take them (in group order): the
        pages of each paged group and, if given (or ``need_slots``), the slot of each state group.
        ``first``: (the first group's pages as given, the list the core takes for them): a group
        given that very object gets that list, so the core knows by identity that they are one."""
        given_pages, given_slots = group_pages or {}, state_slots or {}
        pages: list[Sequence[int]] = []
        slots: list[int] = []
        named, missing = 0, None
        given, taken = first or (None, None)
        for name, state in self.group_kinds:  # one pass: this runs for every chunk and room of a hybrid cache
            listed = given_pages.get(name)
            if listed is None:
                pages.append(())
            else:  # as the first group's pages: checked (and copied) by the core, a list or tuple as given
                named += 1
                pages.append(taken if listed is given else listed if listed.__class__ is list or
                             listed.__class__ is tuple else list(listed))
            slot = given_slots.get(name)
            if slot is not None:
                named += 1
                slots.append(int(slot))
            else:
                slots.append(NO_SLOT)
                if missing is None and state:
                    missing = name
        if named != len(given_pages) + len(given_slots):
            names = [name for name, _ in self.group_kinds]
            unknown = sorted((set(given_pages) | set(given_slots)) - set(names))
            raise LocalProtocolError(f"the cache has no group {unknown[0]!r} beyond its first "
                                     f"(it has {', '.join(map(repr, names)) or 'none'})")
        if not given_slots and not need_slots:
            return pages, None  # None, or {} from a cache with no state group
        if missing is not None:
            raise LocalProtocolError(f"state group {missing!r} needs a slot: state_slots={{{missing!r}: ...}}")
        return pages, slots

    def wire_groups(self) -> tuple[WireGroup, ...]:
        """The groups beyond the first, as ``CACHE_GROUPS`` lists them."""
        return tuple(group_to_wire(g) for g in self.cache_geometry.groups[1:])

    def wire_layouts(self) -> tuple[WireGroupLayout, ...]:
        """The layouts ``CACHE_GROUPS`` gives (minor 4): one per group beyond the first where some
        state tensor has sections or strided slots, else none (the message as minor 3 encoded it)."""
        groups = self.cache_geometry.groups[1:]
        if not any(isinstance(g, StateGroup) and (g.slot_strides or any(t.sections for t in g.tensors))
                   for g in groups):
            return ()
        return tuple(layout_to_wire(g) for g in groups)

    @classmethod
    def from_tensors(
        cls,
        planes: Sequence[Sequence[Any]],
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        num_kv_heads: int | None = None,
        layout: Layout | str = Layout.NHD,
        mla: bool = False,
        kv_fused: bool = False,
        aux: Any = None,
        name: str = "kv",
        window: int | None = None,
        model_layers: Sequence[int] | None = None,
    ) -> KVCache:
        """Describe per-layer cache tensors.

        ``planes`` is ``[k_layers, v_layers]`` (or ``[latent_layers]`` for MLA); each layer tensor
        has shape ``(num_blocks, block_size, heads, head_dim)`` for NHD or
        ``(num_blocks, heads, block_size, head_dim)`` for HND, and must be contiguous.
        ``num_kv_heads`` is the model's total (defaults to local heads x tp_size).
        ``kv_fused``: one plane ``[layers]`` whose ``head_dim`` holds each head's K then V (vLLM's
        layout since 0.33). ``name``, ``window``, ``model_layers``: for a group of a hybrid cache
        (``with_groups``).
        """
        layout = Layout[layout.upper()] if isinstance(layout, str) else Layout(layout)
        if not planes or not planes[0]:
            raise ValueError("no cache tensors given")
        one = mla or kv_fused
        if len(planes) != (1 if one else 2):
            what = "1 plane (MLA)" if mla else "1 plane (fused K/V)" if kv_fused else "2 planes (K, V)"
            raise ValueError(f"expected {what}, got {len(planes)}")
        num_layers = len(planes[0])
        if any(len(p) != num_layers for p in planes):
            raise ValueError("every plane needs one tensor per layer")
        first = planes[0][0]
        if first.dim() == 3 and mla:
            nb, bs, hd = first.shape
            heads = 1
        else:
            if first.dim() != 4:
                raise ValueError(f"cache tensors must be 4-D, got shape {tuple(first.shape)}")
            nb, a, b, hd = first.shape
            bs, heads = (a, b) if layout is Layout.NHD else (b, a)
        dtype = _torch_dtype(first.dtype)
        addresses = []
        tensors = []
        for layer in range(num_layers):
            for plane in planes:
                t = plane[layer]
                if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(f"layer {layer} tensor differs in shape, dtype or device from layer 0")
                if not t.is_contiguous():
                    raise ValueError(f"layer {layer} tensor is not contiguous")
                addresses.append(t.data_ptr())
                tensors.append(t if t.dim() == 4 else t.view(nb, bs, 1, hd))
        geometry = KVGeometry(
            tp_size=tp_size,
            tp_rank=tp_rank,
            num_layers=num_layers,
            num_kv_heads=1 if mla else (num_kv_heads or heads * tp_size),
            head_dim=hd,
            dtype=dtype,
            block_size=bs,
            layout=layout,
            mla=mla,
            num_blocks=nb,
            kv_fused=kv_fused,
        )
        if geometry.local_heads != heads:
            raise ValueError(f"tensors hold {heads} heads but the geometry gives {geometry.local_heads} per rank")
        is_cuda = first.device.type == "cuda"
        return cls(
            geometry=geometry,
            region_addresses=tuple(addresses),
            mem_kind=MemKind.VRAM if is_cuda else MemKind.DRAM,
            device_id=(first.device.index or 0) if is_cuda else 0,
            aux=AuxBuffer.from_tensor(aux) if aux is not None else None,
            owner=(planes, aux),
            tensors=tuple(tensors),
            name=name,
            window=window,
            layers=None if model_layers is None else tuple(model_layers),
        )

    @classmethod
    def from_pointers(
        cls,
        planes: Sequence[Sequence[int]],
        *,
        page_bytes: int,
        region_bytes: int,
        block_size: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        num_kv_heads: int = 1,
        mla: bool = False,
        mem_kind: MemKind = MemKind.DRAM,
        device_id: int = 0,
        aux: AuxBuffer | None = None,
        owner: Any = None,
        model_layers: Sequence[int] | None = None,
        name: str = "kv",
        window: int | None = None,
        views: bool = False,
    ) -> KVCache:
        """Describe a cache an engine gives as raw addresses (SGLang's ``KVArgs``): ``planes`` is
        ``[k_addresses, v_addresses]`` (``[latent_addresses]`` for MLA), one per layer; each layer
        of each plane is ``region_bytes`` of pages of ``page_bytes``, a page holding ``block_size``
        tokens of this rank's heads, token-major (NHD). The head size is what the page holds per
        token and head, in bytes (the cache is described as bytes: both sides describe it so, and
        the engine checks the element type); ``num_kv_heads`` is the model's total; ``model_layers``
        the model layer of each layer (a hybrid model's first group); ``name`` and ``window`` a
        group's beyond the first (as ``from_tensors``). The memory is the
        caller's (keep it alive, or pass it as ``owner``). The staged path needs tensors: with
        ``views`` each region is also given as a uint8 tensor over its pages (``bytes_at``: a view,
        on ``device_id`` for VRAM), so the cache can stage; without, it moves direct or sliced
        (``EndpointConfig.staging_bytes=0``)."""
        if not planes or not planes[0] or len(planes) != (1 if mla else 2):
            raise ValueError(f"expected {'1 plane (MLA)' if mla else '2 planes (K, V)'} of layer addresses")
        layers = len(planes[0])
        if any(len(p) != layers for p in planes):
            raise ValueError("every plane needs one address per layer")
        heads = 1 if mla else max(1, num_kv_heads // tp_size)
        if page_bytes <= 0 or region_bytes % page_bytes or page_bytes % (block_size * heads):
            raise ValueError(f"pages of {page_bytes} bytes do not hold {block_size} tokens of {heads} heads, or "
                             f"do not tile a {region_bytes}-byte layer")
        geometry = KVGeometry(
            tp_size=tp_size, tp_rank=tp_rank, num_layers=layers, num_kv_heads=1 if mla else num_kv_heads,
            head_dim=page_bytes // (block_size * heads), dtype=DType.UINT8, block_size=block_size,
            layout=Layout.NHD, mla=mla, num_blocks=region_bytes // page_bytes,
        )
        addresses = tuple(int(plane[layer]) for layer in range(layers) for plane in planes)
        tensors: tuple[Any, ...] = ()
        if views:
            import torch

            device = torch.device("cuda", device_id) if mem_kind == MemKind.VRAM else torch.device("cpu")
            shape = (geometry.num_blocks, block_size, heads, geometry.head_dim)
            tensors = tuple(bytes_at(a, geometry.num_blocks * page_bytes, device).view(shape) for a in addresses)
        return cls(geometry=geometry, region_addresses=addresses, mem_kind=mem_kind, device_id=device_id, aux=aux,
                   owner=owner, tensors=tensors, layers=None if model_layers is None else tuple(model_layers),
                   name=name, window=window)

    # --- what gets registered and advertised ------------------------------------------------
    def regions(self) -> list[MemoryRegion]:
        """This group's regions (layer x plane), in order."""
        size = self.geometry.region_bytes
        return [MemoryRegion(a, size, self.device_id, self.mem_kind) for a in self.region_addresses]

    def memory_regions(self) -> list[MemoryRegion]:
        """What a transport registers: every group's regions and the aux buffer, ranges that
        overlap (groups overlaying one buffer) joined into their union (``merge_regions``)."""
        regions = self.regions()
        if self.aux is not None:
            regions += [MemoryRegion(a, n, 0, MemKind.DRAM) for a, n in self.aux.regions()]
        for extra in self.groups:
            regions += extra.regions()
        return merge_regions(regions)

    @property
    def torch_dtype(self) -> Any:
        return self.tensors[0].dtype if self.tensors else None

    def wire_regions(self) -> tuple[WireRegion, ...]:
        size = self.geometry.region_bytes
        rows = [
            WireRegion(kind=RegionKind.KV, index=i, address=a, length=size, device_id=self.device_id,
                       mem_kind=self.mem_kind)
            for i, a in enumerate(self.region_addresses)
        ]
        if self.aux is not None:  # one AUX region per aux buffer, in order (messages.md, REGISTER)
            rows += [WireRegion(kind=RegionKind.AUX, index=i, address=a, length=n, device_id=0, mem_kind=MemKind.DRAM)
                     for i, (a, n) in enumerate(self.aux.regions())]
        for number, extra in enumerate(self.groups, start=1):
            for r, region in enumerate(extra.regions()):
                rows.append(WireRegion(kind=RegionKind.GROUP, index=number << 24 | r, address=region.address,
                                       length=region.length, device_id=region.device_id, mem_kind=region.kind))
        return tuple(rows)


def geometry_to_wire(g: KVGeometry) -> WireGeometry:
    return WireGeometry(
        tp_size=g.tp_size, tp_rank=g.tp_rank, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim, dtype=int(g.dtype), block_size=g.block_size, layout=int(g.layout),
        mla=2 if g.kv_fused else int(g.mla), num_blocks=g.num_blocks,
    )


def geometry_from_wire(w: WireGeometry) -> KVGeometry:
    """Raises ``GeometryError`` (a ValueError) for values that describe no real cache."""
    return KVGeometry(
        tp_size=w.tp_size, tp_rank=w.tp_rank, num_layers=w.num_layers, num_kv_heads=w.num_kv_heads,
        head_dim=w.head_dim, dtype=DType(w.dtype), block_size=w.block_size, layout=Layout(w.layout),
        mla=w.mla == 1 or w.mla > 2, num_blocks=w.num_blocks, kv_fused=w.mla == 2,
    )


def group_to_wire(group: PagedGroup | StateGroup) -> WireGroup:
    if isinstance(group, PagedGroup):
        return WireGroup(name=group.name, kind=GroupKind.PAGED, geometry=geometry_to_wire(group.geometry),
                         window=group.window or 0, num_layers=0, num_slots=0, tensors=())
    zero = WireGeometry(tp_size=0, tp_rank=0, num_layers=0, num_kv_heads=0, head_dim=0, dtype=0, block_size=0,
                        layout=0, mla=0, num_blocks=0)
    return WireGroup(name=group.name, kind=GroupKind.STATE, geometry=zero, window=0, num_layers=group.num_layers,
                     num_slots=group.num_slots, tensors=tuple(
                         WireStateTensor(shape=t.shape, dtype=int(t.dtype),
                                         shard_dim=NO_SHARD if t.shard_dim is None else t.shard_dim)
                         for t in group.tensors))


def older_peer_refusal(mine: CacheGeometry, peer_minor: int) -> str | None:
    """Why a decode cache ``mine`` cannot take writes from a prefill rank of minor ``peer_minor``
    (None: it can): a peer older than ``LAYOUT_MINOR`` never learns that a state group's slots lie
    further apart than their bytes, and would write them back to back. (Sections need no rule of
    their own: such a peer lists one section, which ``check_groups`` refuses beside ours.) Nor does
    a peer older than ``NAMED_MINOR`` know a window the engine names: it would refuse every room
    whose window starts past page 0."""
    if peer_minor >= NAMED_MINOR:
        return None
    for g in mine.groups:
        if isinstance(g, PagedGroup) and g.window == NAMED_WINDOW:
            return (f"group {g.name!r}: its window is named by the engine, which a peer of version 1.{peer_minor} "
                    f"does not know (version 1.{NAMED_MINOR})")
    if peer_minor >= LAYOUT_MINOR:
        return None
    for g in mine.groups:
        if isinstance(g, StateGroup) and g.slot_strides:
            return (f"group {g.name!r}: its slots lie {g.strides(mine.tp_size)} bytes apart (slots inside pages), "
                    f"which a peer of version 1.{peer_minor} cannot address (it writes them back to back)")
    return None


def layout_to_wire(group: PagedGroup | StateGroup) -> WireGroupLayout:
    """A group's entry of ``CACHE_GROUPS.layouts``: a state group's sections and slot strides."""
    if isinstance(group, PagedGroup):
        return WireGroupLayout(tensors=())
    strides = group.slot_strides or (0,) * len(group.tensors)
    return WireGroupLayout(tensors=tuple(WireTensorLayout(sections=t.sections, slot_stride=stride)
                                         for t, stride in zip(group.tensors, strides)))


def groups_from_wire(first: PagedGroup, groups: Sequence[WireGroup],
                     layouts: Sequence[WireGroupLayout] = ()) -> CacheGeometry:
    """A peer's cache: its first group (``first``: named as ours, since only the groups beyond it
    are listed) and its ``CACHE_GROUPS``: the groups and (minor 4) their layouts, none meaning one
    section and slots back to back everywhere (what a peer of minor 3 or older has). Raises
    ``GeometryError`` (a ValueError) for groups that describe no real cache."""
    if layouts and len(layouts) != len(groups):
        raise GeometryError(f"{len(layouts)} group layouts for {len(groups)} groups")
    out: list[PagedGroup | StateGroup] = [first]
    for i, w in enumerate(groups):
        layout = layouts[i].tensors if layouts else None
        if w.kind == GroupKind.PAGED:
            if layout:
                raise GeometryError(f"group {w.name!r}: a paged group's layout lists state tensors")
            out.append(PagedGroup(w.name, geometry_from_wire(w.geometry), w.window or None))
        elif w.kind == GroupKind.STATE:
            if layout is not None and len(layout) != len(w.tensors):
                raise GeometryError(f"group {w.name!r}: a layout of {len(layout)} tensors for {len(w.tensors)}")
            try:
                tensors = tuple(StateTensor(t.shape, DType(t.dtype), None if t.shard_dim == NO_SHARD else t.shard_dim,
                                            layout[k].sections if layout else ())
                                for k, t in enumerate(w.tensors))
                out.append(StateGroup(w.name, w.num_layers, tensors, w.num_slots,
                                      tuple(t.slot_stride for t in layout) if layout else ()))
            except ValueError as exc:
                raise GeometryError(f"group {w.name!r}: {exc}") from None
        else:
            raise GeometryError(f"group {w.name!r} is of unknown kind {w.kind}")
    return CacheGeometry(first.geometry.tp_size, first.geometry.tp_rank, tuple(out))
