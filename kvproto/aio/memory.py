"""The KV cache and aux buffer of one rank, as the endpoints see them.

A ``KVCache`` names the geometry and the base address of every region (region
``r = layer * planes + plane``); ``from_tensors`` builds one from the per-layer torch tensors
a serving engine already owns (the tensors are kept alive by the cache object). An optional
``AuxBuffer`` holds fixed-size slots for per-request metadata (first output token, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproto.geometry import DType, KVGeometry, Layout
from kvproto.transport.base import MemKind, MemoryRegion
from kvproto.wire import RegionKind, WireGeometry, WireRegion

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
    address: int
    slot_bytes: int
    slots: int
    owner: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_tensor(cls, tensor: Any) -> AuxBuffer:
        """A ``(slots, slot_bytes)``-shaped contiguous tensor (any dtype) as aux slots."""
        if not tensor.is_contiguous() or tensor.dim() < 1:
            raise ValueError("aux tensor must be contiguous with slots along dim 0")
        slots = tensor.shape[0]
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size() // slots, slots, tensor)


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

    def __post_init__(self) -> None:
        if len(self.region_addresses) != self.geometry.num_regions:
            raise ValueError(
                f"{len(self.region_addresses)} region addresses for {self.geometry.num_regions} regions"
            )

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
    ) -> KVCache:
        """Describe per-layer cache tensors.

        ``planes`` is ``[k_layers, v_layers]`` (or ``[latent_layers]`` for MLA); each layer tensor
        has shape ``(num_blocks, block_size, heads, head_dim)`` for NHD or
        ``(num_blocks, heads, block_size, head_dim)`` for HND, and must be contiguous.
        ``num_kv_heads`` is the model's total (defaults to local heads x tp_size).
        ``kv_fused``: one plane ``[layers]`` whose ``head_dim`` holds each head's K then V (vLLM's
        layout since 0.33).
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
        try:
            dtype = _TORCH_DTYPES[str(first.dtype)]
        except KeyError:
            raise ValueError(f"unsupported cache dtype {first.dtype}") from None
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
        )

    # --- what gets registered and advertised ------------------------------------------------
    def memory_regions(self) -> list[MemoryRegion]:
        size = self.geometry.region_bytes
        regions = [MemoryRegion(a, size, self.device_id, self.mem_kind) for a in self.region_addresses]
        if self.aux is not None:
            regions.append(MemoryRegion(self.aux.address, self.aux.slot_bytes * self.aux.slots, 0, MemKind.DRAM))
        return regions

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
        if self.aux is not None:
            rows.append(WireRegion(kind=RegionKind.AUX, index=0, address=self.aux.address,
                                   length=self.aux.slot_bytes * self.aux.slots, device_id=0,
                                   mem_kind=MemKind.DRAM))
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
