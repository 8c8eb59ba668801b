"""vLLM instances driven step by step: vLLM's real ``Scheduler`` (or ``AsyncScheduler``) with the
kvproto connector in its scheduler role, worker-role connectors on CPU caches that vLLM's own
allocator laid out, and a model runner that computes KV the way a GPU does: late.

The model runner is played by ``Instance.step``, in the order vLLM's model runner calls a worker
connector (bind metadata, the forward's ``save_kv_layer`` after each attention layer, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results``, ``get_kv_connector_stats``, clear), with outputs merged across
TP ranks by vLLM's ``KVOutputAggregator``. Its forward *queues* each layer's KV writes on a stream
of its own (``Stream``, a thread that runs them in order, each no sooner than ``lag`` after it was
queued) and calls ``save_kv_layer`` once the layer is queued, as an engine's forward returns
before its kernels ran; the worker's CUDA events are the stream's events (``Stream.record``). A
send that does not wait for its event, or a block read after vLLM reused it, reads other bytes.

Every KV byte is a pure function of what it holds (``kv_bytes``): the prompt's tokens up to the
token (a rolling hash, so a prefix shared by two prompts has the same KV, as in a real model), the
model layer, the group, the global head and the position in the head. ``check_landed`` compares,
when vLLM reports a request's KV received, every byte a decode rank needs of every group with that
function: the decode's block ids are read from its own KV cache manager, not from the connector.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec,
                                        SparseCacheRole, UniformTypeKVCacheSpecs)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvproto.integrations.vllm import KVProtoMetadata, KVProtoStats, plan_groups
from kvproto.integrations.vllm.worker import Worker
from kvproto.testing.ports import free_port

LAYERS, KV_HEADS, HEAD = 4, 4, 16
WINDOW = 32
"""The sliding window of the ``swa`` model: short, so that prompts outrun it."""
ATTN = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
INDEXER = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(LAYERS)]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 8, "num_key_value_heads": KV_HEADS, "head_dim": HEAD, "num_hidden_layers": LAYERS,
         "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
         "tie_word_embeddings": False}
DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": LAYERS, "vocab_size": 1000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "kv_lora_rank": 64,
            "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "scoring_func": "softmax", "norm_topk_prob": False,
            "tie_word_embeddings": False}
MLA_LATENT = 64 + 16  # kv_lora_rank + qk_rope_head_dim
INDEX_BYTES = 132  # DeepSeek-V3.2's indexer key: 128 fp8 values and a 4-byte scale per token

GDN = [f"model.layers.{i}.linear_attn" for i in range(LAYERS)]
GDN_K_HEADS, GDN_V_HEADS, GDN_K_DIM, GDN_V_DIM, GDN_CONV = 2, 4, 8, 8, 4
"""Gated DeltaNet layers: Q and K of 2 heads x 8, V of 4 heads x 8 (conv channels [16 | 16 | 32]),
a 4-wide convolution (3 rows of state), SSM state (4 value heads, 8, 8) in fp32."""

MODELS = ("gqa", "mla", "swa", "mla-indexer", "gdn")
"""``gqa``: one full-attention group; ``mla``: one MLA latent group; ``swa``: full attention on even
layers and a sliding window on odd ones (two groups, vLLM's hybrid allocator); ``mla-indexer``: an
MLA latent and DeepSeek-V3.2's indexer cache on every layer (one vLLM group of two shapes); ``gdn``: Gated DeltaNet layers 0-2 (a state group each, in
vLLM's pages: conv state sectioned [Q | K | V] in vLLM's default SD layout, SSM state) and full
attention on layer 3 (Qwen3-Next's pattern)."""


@functools.cache
def model_config(mla: bool = False) -> ModelConfig:
    d = Path("/tmp") / ("kvproto-vllm-test-mla" if mla else "kvproto-vllm-test-model")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(DEEPSEEK if mla else LLAMA))
    mc = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, enforce_eager=True)
    assert mc.use_mla == mla
    return mc


def cache_groups(model: str, block: int, tp: int) -> list[KVCacheGroupSpec]:
    """vLLM's KV cache groups of one TP rank of ``model`` (see ``MODELS``)."""
    heads = max(1, KV_HEADS // tp)
    full = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16)
    latent = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=MLA_LATENT, dtype=torch.bfloat16)
    if model == "gqa":
        return [KVCacheGroupSpec(ATTN, full)]
    if model == "mla":
        return [KVCacheGroupSpec(ATTN, latent)]
    if model == "swa":
        swa = SlidingWindowSpec(block_size=block, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16,
                                sliding_window=WINDOW)
        return [KVCacheGroupSpec(ATTN[0::2], full), KVCacheGroupSpec(ATTN[1::2], swa)]
    if model == "gdn":
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import MambaSpec

        conv = (GDN_CONV - 1, (2 * GDN_K_HEADS * GDN_K_DIM + GDN_V_HEADS * GDN_V_DIM) // tp)
        ssm = (GDN_V_HEADS // tp, GDN_V_DIM, GDN_K_DIM)
        state = MambaSpec(block_size=block, shapes=(conv, ssm), dtypes=(torch.bfloat16, torch.float32),
                          mamba_type=MambaAttentionBackendEnum.GDN_ATTN, page_size_padded=full.page_size_bytes)
        return [KVCacheGroupSpec(ATTN[3:4], full), *(KVCacheGroupSpec([GDN[i]], state) for i in range(3))]
    if model == "mla-indexer":
        index = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=INDEX_BYTES, dtype=torch.uint8,
                                 max_tp_shards=1, cache_role=SparseCacheRole.INDEXER)
        specs = {name: spec for a, i in zip(ATTN, INDEXER) for name, spec in ((a, latent), (i, index))}
        return [KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs.from_specs(specs))]
    raise ValueError(model)


# --- KV as a pure function of what it holds ----------------------------------------------------
def prefix_hashes(tokens: list[int]) -> torch.Tensor:
    """A rolling hash of the tokens up to each position: the KV of position t depends on tokens 0..t."""
    out, h = [], 1469598103934665603
    for t in tokens:
        h = (h * 1099511628211 + t + 1) & 0x7FFFFFFFFFFFFFFF
        out.append(h)
    return torch.tensor(out, dtype=torch.int64)


def kv_bytes(hashes: torch.Tensor, layer: int, group: str, heads: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes ``(tokens, heads, width)`` of ``group``'s layer ``layer`` for tokens of those prefix hashes."""
    salt = sum(ord(c) * 31 ** i for i, c in enumerate(group)) & 0xFFFF
    x = (hashes.view(-1, 1, 1) * 6364136223846793005 + (layer * 1442695040888963407 + salt * 2654435761)
         + heads.view(1, -1, 1) * 40503 * 65537 + torch.arange(width).view(1, 1, -1) * 2246822519)
    return ((x >> 29) & 0xFF).to(torch.uint8)


class Stream:
    """A GPU stream stand-in: ``enqueue``d work runs in order on a thread of its own, each piece no
    sooner than ``lag`` seconds after it was queued; ``record()`` gives an event whose ``query()``
    is true once everything queued before it has run."""

    def __init__(self, lag: float) -> None:
        self.lag = lag
        self.queued = 0
        self.done = 0
        self._work: deque[tuple[float, Callable[[], None]]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-gpu-stream")
        self._thread.start()

    def enqueue(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self.queued += 1
            self._work.append((time.monotonic() + self.lag, fn))
            self._cv.notify()

    def record(self) -> Any:
        stream, seq = self, self.queued

        class Event:
            def query(self) -> bool:
                return stream.done >= seq

        return Event()

    def synchronize(self) -> None:
        while self.done < self.queued:
            time.sleep(0.0005)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._work and not self._stop:
                    self._cv.wait()
                if self._stop and not self._work:
                    return
                at, fn = self._work.popleft()
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            fn()
            self.done += 1

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)


class Instance:
    """One vLLM instance (``kv_producer``, ``kv_consumer`` or ``kv_both``) of ``tp`` ranks."""

    def __init__(self, role: str, *, tp: int = 1, block: int = 16, layout: str = "LBNHC", blocks: int = 96,
                 batch_tokens: int = 256, extra: dict[str, Any] | None = None, engine: str = "e",
                 prefix_caching: bool = True, policy: str = "fail", model: str = "gqa", scheduler: str = "sync",
                 lag: float = 0.002, dp: tuple[int, int] = (0, 1), log_stats: bool = False,
                 cache_dtype: str = "auto", chunk_tokens: int = 0) -> None:
        self.role, self.tp, self.block, self.model = role, tp, block, model
        prefix_caching = prefix_caching and model != "gdn"  # vLLM's Mamba prefix caching needs its align mode
        self.mla = model in ("mla", "mla-indexer")
        self.in_process = bool((extra or {}).get("endpoint_process"))
        """Endpoints in processes of their own take only interprocess CUDA events: the forward then
        waits for its stream before each ``save_kv_layer``, as a CPU engine does."""
        self.configs = []
        for rank in range(tp):
            cache = CacheConfig(block_size=block, enable_prefix_caching=prefix_caching, cache_dtype=cache_dtype)
            cache.kv_cache_layout = layout
            cache.num_gpu_blocks = blocks
            cache.num_gpu_blocks_override = blocks
            kt = KVTransferConfig(kv_connector="KVProtoConnector", kv_connector_module_path="kvproto.integrations.vllm",
                                  kv_role=role, engine_id=engine, kv_connector_extra_config=dict(extra or {}),
                                  kv_load_failure_policy=policy)
            parallel = ParallelConfig(tensor_parallel_size=tp, rank=rank)
            parallel.data_parallel_index, parallel.data_parallel_size = dp
            self.configs.append(VllmConfig(
                model_config=model_config(self.mla), cache_config=cache, device_config=DeviceConfig("cpu"),
                parallel_config=parallel, kv_transfer_config=kt,
                scheduler_config=SchedulerConfig(max_num_batched_tokens=batch_tokens, max_num_seqs=16,
                                                 max_model_len=4096, is_encoder_decoder=False,
                                                 enable_chunked_prefill=True,
                                                 long_prefill_token_threshold=chunk_tokens)))
        cfg = self.configs[0]
        self.kv_cache_config = get_kv_cache_config_from_groups(cfg, cache_groups(model, block, tp), 1 << 40)
        self.plans = plan_groups(self.kv_cache_config, tp)
        cls = AsyncScheduler if scheduler == "async" else Scheduler
        self.scheduler = cls(vllm_config=cfg, kv_cache_config=generate_scheduler_kv_cache_config([self.kv_cache_config]),
                             structured_output_manager=StructuredOutputManager(cfg), block_size=block,
                             log_stats=log_stats)
        self.free_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.caches: list[dict[str, torch.Tensor]] = []
        self.streams: list[Stream] = []
        self.workers = []
        for c in self.configs:
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout],
                                       [block] * len(self.kv_cache_config.kv_cache_groups))
            self.caches.append(caches)
            stream = Stream(lag)
            self.streams.append(stream)
            worker = KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER, self.kv_cache_config)
            if not self.in_process:
                worker._worker._event = stream.record  # the worker's "CUDA events" are this stream's
            worker.register_kv_caches(caches)
            self.workers.append(worker)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.metas: list[KVProtoMetadata] = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}
        self.failed_recving: set[str] = set()
        self.landed: list[str] = []
        """Requests whose KV every rank reported received (vLLM's merged ``finished_recving``, not
        failed), in the step order they landed."""
        self.on_landed: Callable[[Instance, str], None] | None = None
        """Called for each landed request in the step it landed, before vLLM runs it."""
        self.stats: list[dict[str, Any]] = []
        """The ``kv_connector_stats`` payloads of vLLM's ``SchedulerStats`` (with ``log_stats``)."""

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    # --- requests ------------------------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params or {}})
        request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                          block_hasher=self._hasher())
        self.scheduler.add_request(request)
        return request

    def _hasher(self) -> Any:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        return get_request_block_hasher(self.block, sha256)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # --- the model: a layer's KV of the step's tokens, queued -----------------------------------
    def _heads(self, rank: int, plan: Any) -> torch.Tensor:
        """The global heads rank ``rank`` holds in ``plan``'s group (MLA: head 0 on every rank)."""
        if plan.mla:
            return torch.zeros(1, dtype=torch.int64)
        local = max(1, KV_HEADS // self.tp)
        first = rank * KV_HEADS // self.tp if self.tp <= KV_HEADS else rank // (self.tp // KV_HEADS)
        return torch.arange(first, first + local)

    def _queue_layer(self, rank: int, layer: int, work: list[tuple[str, list[int], int, int]]) -> None:
        """Queue the KV writes of model layer ``layer`` for each (request, its blocks per group, first
        token, end token) of the step, on rank ``rank``'s stream (a state group: the state after
        the step's last token, into the request's running-state block)."""
        caches = self.caches[rank]
        for rid, tokens, start, end in work:
            hashes = prefix_hashes(tokens)[start:end]
            positions = torch.arange(start, end)
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)
            for plan in self.plans:
                if layer not in plan.model_layers:
                    continue
                name = plan.layers[plan.model_layers.index(layer)]
                if plan.state is not None:
                    page = caches[name].view(torch.uint8)[plan.slot(list(blocks[plan.vllm_group])), 0, 0]
                    state = state_bytes(hashes[-1:], layer, plan, rank, self.tp)

                    def write_state(page: torch.Tensor = page, state: torch.Tensor = state) -> None:
                        page[:len(state)] = state

                    self.streams[rank].enqueue(write_state)
                    continue
                view = caches[name].view(torch.uint8)  # [B, H, N, bytes]
                ids = torch.tensor(blocks[plan.vllm_group])[positions // self.block]
                values = kv_bytes(hashes, layer, plan.name, self._heads(rank, plan), view.shape[-1])

                def write(view: torch.Tensor = view, ids: torch.Tensor = ids, offsets: torch.Tensor = positions % self.block,
                          values: torch.Tensor = values) -> None:
                    view[ids, :, offsets] = values

                self.streams[rank].enqueue(write)

    # --- one engine step -----------------------------------------------------------------------
    def step(self) -> None:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVProtoMetadata)
        self.metas.append(meta)
        req_ids = list(out.num_scheduled_tokens)
        work = []
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            n = out.num_scheduled_tokens[rid]
            end = request.num_computed_tokens  # schedule() has counted this step
            work.append((rid, list(request.all_token_ids), end - n, min(end, len(request.all_token_ids))))
            done = end >= request.num_tokens
            sampled.append([7 + len(self.outputs.get(rid, []))] if done else [])
        layers = sorted({layer for plan in self.plans for layer in plan.model_layers})
        attention = {layer for plan in self.plans if plan.state is None for layer in plan.model_layers}
        outputs = []
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(meta)
            if req_ids:  # the forward: each layer queues its KV; an attention layer then hands it over
                for layer in layers:
                    self._queue_layer(rank, layer, work)
                    if self.in_process:
                        self.streams[rank].synchronize()
                    if layer in attention:
                        worker.save_kv_layer(ATTN[layer], self.caches[rank][ATTN[layer]], None)
            worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            kvo = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                    finished_recving=results.finished_recving or None,
                                    failed_recving=results.failed_recving,
                                    invalid_block_ids=worker.get_block_ids_with_load_errors(),
                                    kv_connector_stats=worker.get_kv_connector_stats())
            worker.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                             sampled_token_ids=[list(s) for s in sampled], kv_connector_output=kvo))
        merged = self.aggregator.aggregate(outputs)
        kvo = merged.kv_connector_output
        if kvo is not None:
            failed = set(kvo.failed_recving or ())
            self.failed_recving |= failed
            landed = sorted(set(kvo.finished_recving or ()) - failed)
            self.landed += landed
            if self.on_landed is not None:
                for rid in landed:
                    self.on_landed(self, rid)
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o

    def busy(self) -> bool:
        return self.scheduler.has_requests() or self.connector.has_pending_push_work()

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        for s in self.streams:
            s.close()


def state_bytes(hashes: torch.Tensor, layer: int, plan: Any, rank: int, tp: int) -> torch.Tensor:
    """A GDN layer's state bytes on TP rank ``rank`` after the token of prefix hash ``hashes[0]``, as
    they lie in the page: the conv state (SD: rows x channels, each channel a pure function of its
    *global* index, the sections [Q | K | V] each split over TP), then the SSM state (each value
    head's rows a function of its global head)."""
    layout = plan.state
    rows, local = layout.shapes[0]
    channels = []
    base = 0
    for size in layout.sections[0]:
        part = size // tp
        channels.append(torch.arange(base + rank * part, base + (rank + 1) * part))
        base += size
    conv = kv_bytes(hashes, layer, plan.name + ":conv", torch.cat(channels), rows * 2)[0]  # (channels, rows x 2)
    conv = conv.view(local, rows, 2).transpose(0, 1).reshape(-1)
    heads, dv, dk = layout.shapes[1]
    ssm = kv_bytes(hashes, layer, plan.name + ":ssm", torch.arange(rank * heads, (rank + 1) * heads), dv * dk * 4)
    return torch.cat([conv, ssm.reshape(-1)])


def check_landed(decode: Instance, rid: str, prompt: list[int]) -> int:
    """Every byte of every group a decode rank needs for ``rid`` (full attention and MLA: every
    prompt token; a sliding window: its last tokens; a state group: the state before the prompt's
    last token, which a state model's decode computes itself) equals ``kv_bytes`` / ``state_bytes``;
    returns bytes checked. The block ids are the decode's own, from vLLM's KV cache manager."""
    hashes = prefix_hashes(prompt)
    backoff = 1 if any(plan.state is not None for plan in decode.plans) and len(prompt) > 1 else 0
    n = len(prompt) - backoff
    blocks = decode.scheduler.kv_cache_manager.get_block_ids(rid)
    checked = 0
    for rank in range(decode.tp):
        for plan in decode.plans:
            if plan.state is not None:
                for layer, name in zip(plan.model_layers, plan.layers):
                    want = state_bytes(hashes[n - 1:n], layer, plan, rank, decode.tp)
                    page = decode.caches[rank][name].view(torch.uint8)[plan.slot(list(blocks[plan.vllm_group])), 0, 0]
                    if not torch.equal(page[:len(want)], want):
                        raise AssertionError(f"{rid}: decode rank {rank}, state group {plan.name}, layer {layer}: "
                                             f"{int((page[:len(want)] != want).sum())} of {len(want)} bytes differ")
                    checked += len(want)
                continue
            start = 0 if plan.window is None else max(0, n - plan.window)
            positions = torch.arange(start, n)
            ids = torch.tensor(blocks[plan.vllm_group])[positions // decode.block]
            for layer, name in zip(plan.model_layers, plan.layers):
                got = decode.caches[rank][name].view(torch.uint8)[ids, :, positions % decode.block]
                want = kv_bytes(hashes[start:n], layer, plan.name, decode._heads(rank, plan), got.shape[-1])
                if not torch.equal(got, want):
                    bad = (got != want).any(-1).any(-1).nonzero().flatten()
                    raise AssertionError(f"{rid}: decode rank {rank}, group {plan.name}, layer {layer}: tokens "
                                         f"{(positions[bad]).tolist()[:8]} differ ({len(bad)} of {len(positions)})")
                checked += got.numel()
    return checked


def run_until(instances: list[Instance], done: Callable[[], bool], timeout: float = 60.0, pause: float = 0.002) -> None:
    """Step every instance (as their engines would) until ``done()``; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the instances did not get there in time (a hang)")
        for i in instances:
            i.step()
        time.sleep(pause)


def kv_params(prefill: Instance, req_id: str) -> dict[str, Any]:
    """The kv_transfer_params the prefill returned for ``req_id`` (what a proxy forwards)."""
    out = prefill.finished[req_id]
    assert out.kv_transfer_params, f"{req_id}: no kv_transfer_params"
    return dict(out.kv_transfer_params)


def assert_empty(*instances: Instance) -> None:
    """Nothing leaked, as strictly as vLLM's own connector tests check (``assert_scheduler_empty``)
    and then some: no request, no finished or received id, no block held by a request or cached as
    one's, every block's reference count 0 and every block free; the connector's scheduler and
    worker roles hold no room; kvproto's endpoints hold no room."""
    for inst in instances:
        s = inst.scheduler
        where = f"{inst.role} ({inst.model}, TP {inst.tp})"
        assert not s.requests and not s.waiting and not s.running, f"{where}: requests left {list(s.requests)}"
        assert not s.finished_req_ids, f"{where}: finished ids left {s.finished_req_ids}"
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids, f"{where}: received ids left"
        for manager in s.kv_cache_manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks, f"{where}: blocks held for {list(manager.req_to_blocks)}"
            assert not manager.num_cached_block, f"{where}: cached-block counts left {manager.num_cached_block}"
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1, f"{where}: blocks not free"
        assert all(b.ref_cnt == 0 for b in pool.blocks), f"{where}: a block is still referenced"
        sched = inst.connector._scheduler
        assert not (sched.prefilling or sched.held or sched.recving or sched.destined), \
            f"{where}: connector scheduler holds {sched.prefilling, sched.held, sched.recving, sched.destined}"
        for w in inst.workers:
            worker: Worker = w._worker
            left = {k: getattr(worker, k) for k in ("senders", "receivers", "destined", "early", "dropped", "ended",
                                                    "finished", "streamed", "late_ends") if getattr(worker, k)}
            assert not left, f"{where}: connector worker holds {left}"
            for facade in (worker.prefill, worker.decode):
                if facade is not None and hasattr(facade, "_endpoint"):
                    deadline = time.monotonic() + 5
                    while facade._endpoint.core.rooms and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert not facade._endpoint.core.rooms, f"{where}: kvproto rooms left {list(facade._endpoint.core.rooms)}"


def stats_of(instance: Instance) -> KVProtoStats:
    """Everything the instance's connector reported through vLLM's stats, aggregated as vLLM's
    logger does (``build_kv_connector_stats`` then ``aggregate``)."""
    total = KVProtoStats()
    for payload in instance.stats:
        total.aggregate(type(instance.connector).build_kv_connector_stats(payload))
    return total
