"""Two vLLM instances, driven step by step: vLLM's real ``Scheduler`` with the kvproto connector in
its scheduler role, and worker-role connectors on CPU caches that vLLM's own allocator laid out.

The model runner is played by ``Instance.step``, in the order vLLM's ``KVConnectorModelRunnerMixin``
calls a worker connector (bind metadata, the forward's ``save_kv_layer`` per layer, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results``, clear), with outputs merged across TP ranks by vLLM's
``KVOutputAggregator``. The forward computes nothing: prefill caches are filled with random bytes
at start, so that every byte a decode block holds can be traced to the prefill block it came from.
"""

from __future__ import annotations

import functools
import json
import socket
import time
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
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvproto.integrations.vllm import KVProtoMetadata

LAYERS, KV_HEADS, HEAD = 3, 4, 16
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 8, "num_key_value_heads": KV_HEADS, "head_dim": HEAD, "num_hidden_layers": LAYERS,
         "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
         "tie_word_embeddings": False}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MLA_MODEL = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
             "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 4, "num_hidden_layers": LAYERS, "vocab_size": 1000,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "kv_lora_rank": 64,
             "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
             "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
             "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 1.0, "scoring_func": "softmax", "norm_topk_prob": False,
             "tie_word_embeddings": False}
MLA_LATENT = 64 + 16  # kv_lora_rank + qk_rope_head_dim


@functools.cache
def model_dir(mla: bool = False) -> str:
    d = Path("/tmp") / ("kvproto-vllm-test-mla" if mla else "kvproto-vllm-test-model")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(MLA_MODEL if mla else MODEL))
    return str(d)


@functools.cache
def model_config(mla: bool = False) -> ModelConfig:
    mc = ModelConfig(model=model_dir(mla), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                     enforce_eager=True)
    assert mc.use_mla == mla
    return mc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Instance:
    """One vLLM instance (prefill: ``kv_producer``; decode: ``kv_consumer``) of ``tp`` ranks."""

    def __init__(self, role: str, *, tp: int = 1, block: int = 16, layout: str = "LBNHC", blocks: int = 96,
                 batch_tokens: int = 256, extra: dict[str, Any] | None = None, seed: int = 0,
                 prefix_caching: bool = True, policy: str = "fail", mla: bool = False) -> None:
        self.role, self.tp, self.block, self.mla = role, tp, block, mla
        self.producer = role == "kv_producer"
        self.configs = []
        for rank in range(tp):
            cache = CacheConfig(block_size=block, enable_prefix_caching=prefix_caching)
            cache.kv_cache_layout = layout
            cache.num_gpu_blocks = blocks
            cache.num_gpu_blocks_override = blocks
            kt = KVTransferConfig(kv_connector="KVProtoConnector", kv_connector_module_path="kvproto.integrations.vllm",
                                  kv_role=role, engine_id=f"{role}-{seed}", kv_connector_extra_config=dict(extra or {}),
                                  kv_load_failure_policy=policy)
            self.configs.append(VllmConfig(
                model_config=model_config(mla), cache_config=cache, device_config=DeviceConfig("cpu"),
                parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank), kv_transfer_config=kt,
                scheduler_config=SchedulerConfig(max_num_batched_tokens=batch_tokens, max_num_seqs=16,
                                                 max_model_len=4096, is_encoder_decoder=False,
                                                 enable_chunked_prefill=True)))
        cfg = self.configs[0]
        if mla:
            spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=MLA_LATENT, dtype=torch.bfloat16)
        else:
            spec = FullAttentionSpec(block_size=block, num_kv_heads=max(1, KV_HEADS // tp), head_size=HEAD,
                                     dtype=torch.bfloat16)
        self.kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYER_NAMES, spec)], 1 << 40)
        self.scheduler = Scheduler(vllm_config=cfg, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(cfg), block_size=block,
                                   log_stats=False)
        self.free_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        gen = torch.Generator().manual_seed(seed)
        self.caches: list[dict[str, torch.Tensor]] = []
        self.workers = []
        for rank, c in enumerate(self.configs):
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [block])
            backing = next(iter(caches.values())).untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8).set_(backing)
            if self.producer:
                flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
            self.caches.append(caches)
            worker = KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER, self.kv_cache_config)
            worker.register_kv_caches(caches)
            self.workers.append(worker)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.metas: list[KVProtoMetadata] = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}
        self.failed_recving: set[str] = set()
        self.landed: list[str] = []
        """Decode: requests whose KV every rank reported received (vLLM's merged ``finished_recving``,
        not failed), in the step order they landed. Until the next ``step`` their blocks hold what
        the room wrote: vLLM runs the request (and may preempt it, freeing its blocks) only after."""

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

    # --- one engine step -----------------------------------------------------------------------
    def step(self) -> None:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVProtoMetadata)
        self.metas.append(meta)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            done = request.num_computed_tokens >= request.num_tokens  # schedule() has counted this step
            sampled.append([7 + len(self.outputs.get(rid, []))] if done else [])
        outputs = []
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(meta)
            if req_ids:  # the forward: each attention layer hands its KV to the connector
                for name in LAYER_NAMES:
                    worker.save_kv_layer(name, self.caches[rank][name], None)
            worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            kvo = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                    finished_recving=results.finished_recving or None,
                                    failed_recving=results.failed_recving,
                                    invalid_block_ids=worker.get_block_ids_with_load_errors())
            worker.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                             sampled_token_ids=[list(s) for s in sampled], kv_connector_output=kvo))
        merged = self.aggregator.aggregate(outputs)
        kvo = merged.kv_connector_output
        if kvo is not None:
            failed = set(kvo.failed_recving or ())
            self.failed_recving |= failed
            self.landed += sorted(set(kvo.finished_recving or ()) - failed)
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for eo in engine_outputs.values():
            for o in eo.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        self.last_outputs = engine_outputs

    def busy(self) -> bool:
        return self.scheduler.has_requests()

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def run_until(instances: list[Instance], done: Any, timeout: float = 60.0, pause: float = 0.002) -> None:
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
