"""SGLang's own PrefillBootstrapQueue, DecodePreallocQueue and DecodeTransferQueue on a stub scheduler.

Theory of operation
-------------------
A rank process (``sglang_harness.Rank``: SGLang's server args, a one-rank gloo world, its CPU KV
pool and ``MetadataBuffers``) builds SGLang's real queues the way ``Scheduler`` does, on a stub of
the scheduler that holds exactly the attributes those queues read (``prefill_scheduler`` /
``decode_scheduler``: SGLang's own ``ReqToTokenPool`` / ``DecodeReqToTokenPool``,
``PagedTokenToKVPoolAllocator``, and on the decode a disabled ``UnifiedRadixCache``, as a decode
server without radix cache has). The KV manager is the one the queue builds through
``get_kv_class``: kvproto's.

Requests are SGLang ``Req`` objects carrying a bootstrap host, port and room. The prefill side
runs ``add`` / ``pop_bootstrapped`` and then, as the scheduler's forward would, takes KV slots for
the prompt, writes each chunk's bytes (``sglang_harness.expected``) into its pages and calls
SGLang's own ``send_kv_chunk`` (the scheduler mixin: page indices from ``req_to_token``, the
metadata slot filled by ``MetadataBuffers.set_buf`` with the request's first output token),
polling in-flight senders through ``poll_and_all_reduce_attn_cp_tp_group``. The decode side runs
``add`` / ``pop_preallocated`` / ``DecodeTransferQueue.extend`` / ``pop_transferred``; a
transferred request carries the first token SGLang read from the metadata slot
(``_commit_transfer_to_req``, which also checks the room id written there), and its KV, found
through its own ``req_to_token`` row, is checked byte for byte. A request the prefill aborts
between chunks fails on both sides through SGLang's own failure paths; the decode runs with
SGLang's deferred release on (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1``), so its
pages are held until kvproto's manager says no write can land, and then released: at the end the
decode's allocator holds exactly the pages of the requests that succeeded.
"""

from __future__ import annotations

import os
import time
import traceback
from array import array
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import numpy as np

from sglang_harness import HEADS, LAYERS, PAGE, POOL_PAGES, SLOTS, Rank, RankSpec, Request, Result, expected

FIRST_TOKEN = 100
"""A request's first output token is FIRST_TOKEN + (room % 1000): what the prefill samples."""


def first_token(room: int) -> int:
    return FIRST_TOKEN + room % 1000


def _req(r: Request, bootstrap_port: int) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(f"req-{r.room}", "", array("q", range(r.tokens)), SamplingParams(max_new_tokens=4),
               bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=r.room)


def _common(rank: Rank) -> tuple[Any, Any, int]:
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    size = POOL_PAGES * PAGE - PAGE
    allocator = PagedTokenToKVPoolAllocator(size, PAGE, torch.bfloat16, "cpu", rank.pool, need_sort=False)
    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(), num_hidden_layers=LAYERS,
                                   get_total_num_kv_heads=lambda: HEADS)
    return allocator, model_config, size


def prefill_scheduler(rank: Rank) -> tuple[Any, Any]:
    """(the stub scheduler, SGLang's PrefillBootstrapQueue on it)."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as Mixin
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator, model_config, size = _common(rank)
    sched = SimpleNamespace(
        rust_server=None, server_args=rank.args, model_config=model_config, kv_shard_widening=1,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16",
                                                               effective_logical_max_total_num_tokens=size)),
        token_to_kv_pool_allocator=allocator, enable_hisparse=False, processed_tokens_counter=0,
        req_to_token_pool=ReqToTokenPool(size=SLOTS, max_context_len=1024, device="cpu", enable_memory_saver=False),
        attn_cp_cpu_group=rank.parallel.attn_cp_group.cpu_group, attn_tp_cpu_group=rank.parallel.attn_tp_group.cpu_group,
        kv_checksum_computer=None, enable_staging=False, disagg_metadata_buffers=rank.metadata,
        disagg_prefill_pending_chunk_rids=set())
    queue = PrefillBootstrapQueue(rank.pool, None, ReqToMetadataIdxAllocator(SLOTS), rank.metadata, 0,
                                  rank.spec.bootstrap_port, size, sched, None, rank.backend)
    sched.disagg_prefill_bootstrap_queue = queue
    sched._send_kv_chunk = lambda *a, **k: Mixin._send_kv_chunk(sched, *a, **k)
    sched.send_kv_chunk = lambda *a, **k: Mixin.send_kv_chunk(sched, *a, **k)
    return sched, queue


def decode_scheduler(rank: Rank) -> tuple[Any, Any, Any]:
    """(the stub scheduler, SGLang's DecodePreallocQueue, its DecodeTransferQueue)."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeReqToTokenPool, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    allocator, model_config, size = _common(rank)
    streamed: list[Any] = []
    req_to_token = DecodeReqToTokenPool(size=SLOTS, max_context_len=1024, device="cpu", enable_memory_saver=False,
                                        pre_alloc_size=SLOTS)
    tree = UnifiedRadixCache(CacheInitParams(disable=True, req_to_token_pool=req_to_token,
                                             token_to_kv_pool_allocator=allocator, page_size=PAGE,
                                             tree_components=(ComponentType.FULL,)))
    sched = SimpleNamespace(
        rust_server=None, server_args=rank.args, model_config=model_config, enable_hisparse=False,
        tp_worker=SimpleNamespace(is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")),
        kv_checksum_computer=None, random_seed=0, spec_algorithm=SimpleNamespace(is_none=lambda: True),
        running_batch=SimpleNamespace(reqs=[]), waiting_queue=[], last_batch=None, enable_priority_scheduling=False,
        enable_lora=False, enable_decode_hicache=False, metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=SimpleNamespace(stream_output=lambda reqs, *a, **k: streamed.extend(reqs)),
        batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a, **k: None))
    slots = ReqToMetadataIdxAllocator(SLOTS)
    transfer = DecodeTransferQueue(slots, rank.metadata, sched, tree)
    prealloc = DecodePreallocQueue(req_to_token, allocator, None, slots, rank.metadata, sched, transfer, tree, 0,
                                   rank.spec.bootstrap_port, size, 0, rank.backend)
    sched.disagg_decode_prealloc_queue = prealloc
    sched.req_to_token_pool = req_to_token
    sched.streamed = streamed
    return sched, prealloc, transfer


def _write_chunk(rank: Rank, r: Request, row: Any, start: int, end: int) -> None:
    tokens = np.arange(start, end)
    slots = row[start:end].numpy()
    for plane in range(len(rank.planes)):
        for layer in range(LAYERS):
            for h in range(rank.local_heads):
                data = expected(r, layer, plane, rank.head_start + h, tokens, rank.head_bytes)
                for i, slot in enumerate(slots.tolist()):
                    rank.page_view(plane, layer, slot // PAGE)[slot % PAGE, h] = data[i]


def run_prefill(rank: Rank, requests: list[Request], deadline: float) -> list[Result]:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

    sched, queue = prefill_scheduler(rank)
    rank.attach(queue.kv_manager)
    by_room = {r.room: r for r in requests}
    for r in requests:
        queue.add(_req(r, rank.spec.bootstrap_port), HEADS)
    inflight, results = [], []
    while (queue.queue or inflight) and time.monotonic() < deadline:
        for req in queue.pop_bootstrapped():  # the scheduler's forward, chunk by chunk
            r = by_room[req.bootstrap_room]
            sched.req_to_token_pool.alloc([req])
            slots = sched.token_to_kv_pool_allocator.alloc(-(-r.tokens // PAGE) * PAGE)
            sched.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, len(slots))), slots)
            row = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            req.output_ids.append(first_token(r.room))
            start = req.start_send_idx
            for end in r.chunks:
                last = end == r.tokens
                req.extend_end = end
                _write_chunk(rank, r, row, start, end if last else end - end % PAGE)
                sched.send_kv_chunk(req, last_chunk=last)
                start = req.start_send_idx
                if r.abort == "prefill-mid":  # as the scheduler's abort_request does for a request in flight
                    req.disagg_kv_sender.abort()
                    break
            inflight.append(req)
        if inflight:
            polls = poll_and_all_reduce_attn_cp_tp_group([q.disagg_kv_sender for q in inflight],
                                                         sched.attn_cp_cpu_group, sched.attn_tp_cpu_group)
            still = []
            for req, poll in zip(inflight, polls):
                if poll == KVPoll.Success:
                    results.append(Result(req.bootstrap_room, int(poll)))
                    req.disagg_kv_sender.clear()
                elif poll == KVPoll.Failed:
                    try:
                        req.disagg_kv_sender.failure_exception()
                    except Exception as exc:
                        results.append(Result(req.bootstrap_room, int(poll), str(exc)))
                else:
                    still.append(req)
            inflight = still
        time.sleep(0.005)
    return results


def run_decode(rank: Rank, requests: list[Request], deadline: float) -> list[Result]:
    sched, prealloc, transfer = decode_scheduler(rank)
    rank.attach(prealloc.kv_manager)
    by_room = {r.room: r for r in requests}
    for r in requests:
        prealloc.add(_req(r, rank.spec.bootstrap_port))
    results = []
    free_before = sched.disagg_decode_prealloc_queue.token_to_kv_pool_allocator.available_size()
    holds = 0
    while (len(results) < len(requests) or transfer.has_pending_deferred_releases()) and time.monotonic() < deadline:
        ready, failed = prealloc.pop_preallocated()
        results += [Result(d.req.bootstrap_room, 0, "prealloc failed") for d in failed]
        transfer.extend(ready)
        holds = max(holds, transfer.num_pending_deferred_releases())
        transfer.resolve_deferred_releases()
        while sched.streamed:  # requests SGLang ended with an abort (a failed transfer)
            req = sched.streamed.pop()
            results.append(Result(req.bootstrap_room, 0, str(req.finished_reason.message)))
        for req in transfer.pop_transferred():
            r = by_room[req.bootstrap_room]
            row = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            result = verify_row(rank, r, row)
            if list(req.output_ids) != [first_token(r.room)]:
                result.mismatches += 1
                result.reason = f"first token {list(req.output_ids)}"
            results.append(result)
        time.sleep(0.005)
    held = sum(-(-r.tokens // PAGE) * PAGE for r in requests if r.abort is None)
    left = sched.disagg_decode_prealloc_queue.token_to_kv_pool_allocator.available_size()
    results.append(Result(-1, 4 if free_before - left == held else 0,
                          f"{free_before - left} tokens of pages held, {held} by the requests that succeeded",
                          holds=holds))
    return results


def verify_row(rank: Rank, r: Request, row: Any) -> Result:
    tokens = np.arange(r.tokens)
    slots = row[:r.tokens].numpy()
    checked = mismatches = 0
    for plane in range(len(rank.planes)):
        for layer in range(LAYERS):
            for h in range(rank.local_heads):
                want = expected(r, layer, plane, rank.head_start + h, tokens, rank.head_bytes)
                got = np.stack([rank.page_view(plane, layer, s // PAGE)[s % PAGE, h] for s in slots.tolist()])
                checked += want.size
                mismatches += int((want != got).any(axis=1).sum())
    return Result(r.room, 4, checked_bytes=checked, mismatches=mismatches)


def run_queue_rank(spec: RankSpec, conn: Any) -> None:
    """Process entry (``sglang_harness.start_pair(..., entry=run_queue_rank)``)."""
    try:
        os.environ["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] = "1"  # held until kvproto says safe
        rank = Rank(spec, manager=False)
        conn.send(("ready", spec.rank))
        deadline = time.monotonic() + spec.deadline_s
        run = run_prefill if spec.role == "prefill" else run_decode
        results = run(rank, spec.requests, deadline)
        conn.send(("results", [asdict(r) for r in results], True))
        conn.recv()
        rank.manager.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
