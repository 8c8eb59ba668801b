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

What kvproto cannot do is refused here, before any room, with the reason (``refusal``):
pipeline parallelism, attention or decode context parallelism, KV cache sharding, speculative
decoding's draft KV, and cache states kvproto does not map yet (any ``KVArgs.state_types``),
compressed/custom KV layouts, and the ``prefill_complete`` decode allocation policy.
"""

from __future__ import annotations

from typing import Any

from kvproto.aio import AuxBuffer, KVCache
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
    if states:
        return f"the cache states {states} (hybrid models: kvproto maps no SGLang state type yet)"
    if getattr(kv_args, "kv_layout", None) is not None:
        return f"the KV layout {kv_args.kv_layout!r}"
    if getattr(disagg, "disaggregation_decode_allocation_policy", "early") != "early":
        return f"--disaggregation-decode-allocation-policy {disagg.disaggregation_decode_allocation_policy}"
    return None


def cache_from_kvargs(kv_args: Any, *, mla: bool, tp_size: int, tp_rank: int, total_kv_heads: int,
                      on_gpu: bool) -> KVCache:
    """kvproto's description of the rank's KV and aux memory as ``KVArgs`` gives it."""
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
    return KVCache.from_pointers(
        [ptrs[p * layers:(p + 1) * layers] for p in range(planes)], page_bytes=items[0], region_bytes=lens[0],
        block_size=int(kv_args.page_size), tp_size=tp_size, tp_rank=tp_rank, num_kv_heads=1 if mla else total_kv_heads,
        mla=mla, mem_kind=MemKind.VRAM if on_gpu else MemKind.DRAM, device_id=int(getattr(kv_args, "gpu_id", 0) or 0)
        if on_gpu else 0, aux=aux, owner=kv_args)
