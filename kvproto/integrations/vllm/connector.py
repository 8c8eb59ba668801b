"""``KVProtoConnector``: vLLM's KV connector API, split between its scheduler and worker roles.

Theory of operation
-------------------
vLLM makes one connector object per process and role: the scheduler process gets the SCHEDULER
role (``kvproto.integrations.vllm.scheduler``), every worker the WORKER role
(``kvproto.integrations.vllm.worker``); each call below forwards to its role. What both roles
share is decided once, here, from vLLM's config: the settings, the instance's sides
(``kv_producer``: prefill, ``kv_consumer``: decode, ``kv_both``: either, per request), its
data-parallel index, and the plan of kvproto groups for vLLM's KV cache groups
(``kvproto.integrations.vllm.cache``), which is what makes the connector ``SupportsHMA``: vLLM keeps
its hybrid allocator on, and every group of a hybrid model moves.

CUDA graphs: ``requires_piecewise_for_cudagraph`` answers False unless ``cudagraph_piecewise`` is
set. A decode instance never sends. A prefill instance sends a layer from ``save_kv_layer``, which
vLLM calls from the attention op: under vLLM's default ``FULL_AND_PIECEWISE`` mode every batch with
prompt tokens runs piecewise (the attention op outside the graph), so layer-wise sends happen;
only uniform decode batches replay full graphs, and those send nothing. Where a forward does
replay a full graph (``cudagraph_mode: FULL``), ``save_kv_layer`` is not called and the worker sends
the chunk's layers at ``wait_for_save``, behind an event recorded after the forward: correct, not
early. Setting ``cudagraph_piecewise`` on such a prefill instance buys back the early sends at
the cost of piecewise graphs for its decode batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvproto.integrations.vllm.cache import plan_groups
from kvproto.integrations.vllm.scheduler import Scheduler
from kvproto.integrations.vllm.settings import Settings
from kvproto.integrations.vllm.stats import KVProtoPromMetrics, KVProtoStats
from kvproto.integrations.vllm.worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVProtoConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector API on kvproto (see ``kvproto.integrations.vllm``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        cfg = vllm_config.kv_transfer_config
        self.settings = Settings.from_extra(cfg.kv_connector_extra_config)
        if cfg.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kvproto connector: kv_role {cfg.kv_role!r}: an instance is the prefill (kv_producer), "
                             "the decode (kv_consumer) or either, per request (kv_both)")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("kvproto connector: pipeline parallelism is not supported (TP only)")
        if vllm_config.parallel_config.decode_context_parallel_size != 1:
            raise ValueError("kvproto connector: decode context parallelism is not supported")
        if kv_cache_config is None:
            raise ValueError("kvproto connector: vLLM gave no KV cache config (vLLM 0.33 or newer is needed)")
        self.producer = cfg.kv_role in ("kv_producer", "kv_both")
        self.consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = cfg.engine_id or "vllm"
        self.dp_index = vllm_config.parallel_config.data_parallel_index
        self.plans = plan_groups(kv_cache_config, vllm_config.parallel_config.tensor_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            blocks = {p.vllm_group: p.block_size for p in self.plans if p.state is None}
            states = {p.vllm_group: p.state.spec_blocks for p in self.plans if p.state is not None}
            self._scheduler = Scheduler(producer=self.producer, consumer=self.consumer, blocks=blocks, states=states,
                                        bootstrap_address=self.settings.bootstrap_address(self.dp_index),
                                        engine_id=self.engine_id)
            self._preempted_seen = 0
        else:
            self._worker = Worker(vllm_config, self.settings, self.plans, producer=self.producer,
                                  consumer=self.consumer, engine_id=self.engine_id, dp_index=self.dp_index)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # the registered cache is not re-registered after a remap

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False unless ``cudagraph_piecewise`` is set (see the module docstring)."""
        return bool((extra_config or {}).get("cudagraph_piecewise", False))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVProtoStats:
        return KVProtoStats(data={key: list(value) for key, value in data.items()}) if data else KVProtoStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVProtoPromMetrics:
        return KVProtoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # scheduler side
    def on_new_request(self, request: Request) -> None:
        self._scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(sorted({p.vllm_group for p in self.plans}))  # a room restores every group it moves

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.pending()

    def get_kv_connector_stats(self) -> KVProtoStats | None:
        if self._role == KVConnectorRole.SCHEDULER:
            new = self._scheduler.preempted - self._preempted_seen
            if not new:
                return None
            self._preempted_seen = self._scheduler.preempted
            stats = KVProtoStats()
            stats.data["preempted"] = [1] * new
            return stats
        return self._worker.stats.take()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())  # type: ignore[arg-type]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # push: a decode room succeeds only once every layer has landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.layer_done(self._get_connector_metadata(), layer_name)  # type: ignore[arg-type]

    def wait_for_save(self) -> None:
        self._worker.forward_done(self._get_connector_metadata())  # type: ignore[arg-type]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results(finished_req_ids)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._worker.close()
