"""kvproto as a vLLM KV connector: one flag, no code.

Theory of operation
-------------------
vLLM loads out-of-tree KV connectors by module path. Both instances of a disaggregated pair
name this one::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVProtoConnector",
        "kv_connector_module_path": "kvproto.integrations.vllm",
        "kv_role": "kv_producer",                       # "kv_consumer" on the decode instance
        "kv_connector_extra_config": {"bootstrap_port": 17557}}'

and vLLM's usual proxy (prefill with ``do_remote_decode``, then decode with the
``kv_transfer_params`` the prefill returned) works unchanged. kvproto is *push*: the prefill's
workers write into the decode's blocks, the decode issues no reads. A request's life::

    prefill scheduler              prefill workers          decode scheduler             decode workers
    first scheduled: a room id ──► open the room
    every step: the chunk's    ──► send each layer as its
      whole pages (or the end)     forward ends (event)
    request_finished: hold the
      blocks, return kv_transfer_params ─ proxy ─►  load prompt - local hit,
      {kvproto_bootstrap, kvproto_room}             asynchronously; blocks  ──► open the room with
                                                                                those blocks
    get_finished: room ended ─► finished_sending    get_finished: room ended ─► finished_recving
      (blocks freed)                                  (FAILED: failed_recving -> vLLM recomputes)

One mechanism carries everything from a scheduler to its workers: the step's ``KVProtoMetadata``
with four lists (``opens``, ``sends``, ``recvs``, ``aborts``), each entry naming the vLLM request and the
kvproto room. Workers drive a ``kvproto.sync`` facade (``SyncPrefill`` / ``SyncDecode``): every
call returns at once, and ``get_finished`` reports each room once, so a failure reaches the
scheduler as a finished request, never as a hang: a failed decode room is a failed receive
(vLLM's recompute path); a prefill room that fails (the decode never came, was aborted, died)
still frees its blocks.

Geometry comes from vLLM's own description of its cache: each layer's view as vLLM allocated it
(``[blocks, heads, tokens, K|V]``, or the MLA latent; head-major or token-major as the cache layout
orders it: kvproto's fused K/V plane, HND or NHD), TP rank and size from the parallel config, the
block size from the cache config. The two instances may differ in TP size, block size and
layout: kvproto's registration checks the pair and its writes convert. Layouts kvproto cannot
describe (layers interleaved inside a block, kernel blocks smaller than the cache's) are refused
at ``register_kv_caches`` with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvproto.aio import EndpointConfig, KVCache
from kvproto.core import RoomState, Timeouts
from kvproto.geometry import Layout
from kvproto.transport import MemKind
from kvproto.sync import EngineLoop, KVReceiver, KVSender, SyncDecode, SyncPrefill

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvproto.vllm")

BOOTSTRAP = "kvproto_bootstrap"
ROOM = "kvproto_room"
"""The keys kvproto adds to ``kv_transfer_params`` (beside vLLM's ``do_remote_prefill``)."""


# --- settings: kv_connector_extra_config ------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``; an unknown key is refused at start, naming it."""

    bootstrap_host: str = "127.0.0.1"
    """Interface prefill TP rank 0 binds its bootstrap service on (``0.0.0.0``: all)."""
    bootstrap_port: int = 17557
    """Port of that service: the decode reaches the prefill instance there."""
    advertise_host: str | None = None
    """Host name decode instances use to reach the prefill (default: ``bootstrap_host``)."""
    transport: str = "nixl"
    """kvproto data-plane adapter: ``nixl``, ``cuda-ipc`` (same host: one kernel per write), ..."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    layerwise: bool = True
    """Send each layer as its forward ends (``save_kv_layer``); False: each step's chunk at once."""
    staging_mib: int | None = None
    """kvproto staging buffer per rank (None: kvproto's default; 0: none)."""
    timeouts: dict[str, float] = field(default_factory=dict)
    """``kvproto.core.Timeouts`` fields in seconds (``bootstrap`` also bounds how long a finished
    prefill request holds its blocks for a decode that never comes)."""
    heartbeat_timeout_s: float = 5.0
    """A peer instance silent this long is gone: its rooms fail (``PEER_GONE``)."""
    endpoint_process: bool = False
    """Run each worker's kvproto endpoint in a process of its own (``kvproto.sync_process``), so
    that its work never takes the interpreter lock from vLLM's worker thread."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvproto connector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        bad = sorted(set(extra.get("timeouts", {})) - {f.name for f in dataclasses.fields(Timeouts)})
        if bad:
            raise ValueError(f"kvproto connector: unknown timeouts {bad}")
        return cls(**extra)

    @property
    def bootstrap_address(self) -> str:
        host = self.advertise_host or self.bootstrap_host
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.bootstrap_port}"

    def endpoint_config(self, *, instance: str | None, rank0_prefill: bool) -> EndpointConfig:
        timeouts = dataclasses.replace(Timeouts(bootstrap=120.0), **self.timeouts)
        options: dict[str, Any] = dict(transport=self.transport, transport_options=dict(self.transport_options),
                                       instance=instance, timeouts=timeouts,
                                       heartbeat_timeout=self.heartbeat_timeout_s,
                                       heartbeat_interval=min(1.0, self.heartbeat_timeout_s / 4))
        if self.staging_mib is not None:
            options["staging_bytes"] = self.staging_mib << 20
        if rank0_prefill:
            options.update(host=self.bootstrap_host, port=self.bootstrap_port, advertise_host=self.advertise_host)
        return EndpointConfig(**options)


# --- what a scheduler tells its workers each step ---------------------------------------------
@dataclass(frozen=True)
class Open:
    """Prefill: open ``room`` for a request of ``num_tokens`` prompt tokens (its first step)."""

    req_id: str
    room: int
    num_tokens: int


@dataclass(frozen=True)
class Send:
    """Prefill: tokens up to ``end`` of ``room`` are computed this step; ``pages`` are the
    request's blocks not given before (whole pages, or up to the prompt's end)."""

    req_id: str
    room: int
    pages: list[int]
    end: int
    num_tokens: int


@dataclass(frozen=True)
class Recv:
    """Decode: open ``room`` at ``bootstrap`` with the request's blocks (tokens from 0, the first
    ``prefix_tokens`` a local prefix hit)."""

    req_id: str
    room: int
    bootstrap: str
    pages: list[int]
    num_tokens: int
    prefix_tokens: int


@dataclass(frozen=True)
class Abort:
    """Either side: end ``room`` (``bootstrap`` set: a decode room never opened, opened only to
    release the prefill's blocks at once)."""

    req_id: str
    room: int
    bootstrap: str | None = None


class KVProtoMetadata(KVConnectorMetadata):
    def __init__(self) -> None:
        self.opens: list[Open] = []
        self.sends: list[Send] = []
        self.recvs: list[Recv] = []
        self.aborts: list[Abort] = []


# --- the cache as vLLM laid it out ------------------------------------------------------------
def kv_cache_from_vllm(kv_caches: dict[str, torch.Tensor], *, block_size: int, num_kv_heads: int,
                       head_size: int, tp_size: int, tp_rank: int, mla: bool) -> KVCache:
    """kvproto's description of vLLM's per-layer cache views (in layer order).

    vLLM (0.33) views each layer as ``[blocks, heads, tokens, content]``, ``content`` being a
    head's K then V (``head_size + head_size_v``), or the MLA latent; the physical order is the
    cache layout's: ``LBHNC`` (each block head-major: kvproto's HND), ``LBNHC`` (token-major:
    NHD). K and V side by side is kvproto's *fused* plane. Layouts that interleave layers inside
    a block (block-outermost) have no dense region per layer and are refused."""
    if not kv_caches:
        raise ValueError("kvproto connector: register_kv_caches got no cache tensors")
    layer_tensors: list[torch.Tensor] = []
    layouts = set()
    for name, v in kv_caches.items():
        if v.dim() != 4:
            raise ValueError(f"kvproto connector: layer {name} is a {v.dim()}-D view {tuple(v.shape)}; this "
                             "connector reads vLLM's [blocks, heads, tokens, content] layer views (vLLM 0.33)")
        _blocks, heads, tokens, content = v.shape
        if tokens != block_size:
            raise ValueError(f"kvproto connector: layer {name} has {tokens}-token kernel blocks but the cache "
                             f"config says {block_size}-token blocks; kernel block splitting is not supported")
        if v.is_contiguous():
            layouts.add(Layout.HND)
            layer_tensors.append(v)
        elif v.transpose(1, 2).is_contiguous():
            layouts.add(Layout.NHD)
            layer_tensors.append(v.transpose(1, 2))
        else:
            raise ValueError(
                f"kvproto connector: layer {name} (strides {v.stride()}) is not one dense region of pages; "
                "kvproto needs a layer-compact cache layout: set VLLM_KV_CACHE_LAYOUT to LBHNC or LBNHC")
        if mla and heads != 1:
            raise ValueError(f"kvproto connector: MLA layer {name} holds {heads} heads, expected 1")
        if not mla and content != 2 * head_size:
            raise ValueError(f"kvproto connector: layer {name} holds {content} elements per head and token; "
                             f"expected K and V of {head_size} each")
    if len(layouts) > 1:
        raise ValueError("kvproto connector: layers differ in layout (NHD and HND)")
    return KVCache.from_tensors([layer_tensors], tp_size=tp_size, tp_rank=tp_rank,
                                num_kv_heads=None if mla else num_kv_heads, layout=layouts.pop(), mla=mla,
                                kv_fused=not mla)


def _tp(vllm_config: VllmConfig) -> tuple[int, int]:
    """(TP rank, TP size) of this worker."""
    size = vllm_config.parallel_config.tensor_parallel_size
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        if model_parallel_is_initialized():
            return get_tensor_model_parallel_rank(), size
    except ImportError:  # pragma: no cover - older layouts of vLLM
        pass
    return vllm_config.parallel_config.rank % size, size


# --- the connector ----------------------------------------------------------------------------
class KVProtoConnector(KVConnectorBase_V1):
    """vLLM's KV connector API on kvproto (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self.settings = Settings.from_extra(cfg.kv_connector_extra_config)
        if cfg.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"kvproto connector: kv_role {cfg.kv_role!r}: an instance is either the prefill "
                             "(kv_producer) or the decode (kv_consumer)")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("kvproto connector: pipeline parallelism is not supported (TP only)")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("kvproto connector: models with several KV cache groups (hybrid or sliding-window "
                             "models) are not supported yet")
        self.producer = cfg.kv_role == "kv_producer"
        self.engine_id = cfg.engine_id or "vllm"
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(self)
        else:
            self._worker = _Worker(self, vllm_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # the registered cache is not re-registered after a remap

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise sends run between a layer's attention and the next (``save_kv_layer``); under
        full CUDA graphs they would not run, and every layer would go at ``wait_for_save``."""
        return bool((extra_config or {}).get("layerwise", True))

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.pending()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # push: a decode room succeeds only once every layer has landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.layer_done(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        self._worker.forward_done(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results(finished_req_ids)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._worker.close()


@dataclass
class _Prefilling:
    """A prefill request's room as the scheduler tracks it."""

    room: int
    prompt: int
    blocks: list[int] = field(default_factory=list)
    given: int = 0
    """Pages already given to the workers."""
    opened: bool = False
    done: bool = False
    """Its last chunk has been given (or its room aborted)."""
    cancelled: bool = False
    """Aborted because vLLM preempted the request (its blocks were freed)."""


class _Scheduler:
    """The scheduler role: decides rooms, tells workers each step, frees blocks when told."""

    def __init__(self, c: KVProtoConnector) -> None:
        self.c = c
        self.prefilling: dict[str, _Prefilling] = {}
        """Prefill: request id -> its room, from its first schedule until it has finished."""
        self.held: set[str] = set()
        """Prefill: finished requests whose blocks wait for their room to end (finished_sending)."""
        self.recving: dict[str, int] = {}
        """Decode: request id -> room, from its blocks' allocation until its room has ended."""
        self.next = KVProtoMetadata()

    # -- both roles: vLLM's scheduler calls, in the order it makes them --
    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.c.producer or not params.get("do_remote_prefill") or ROOM not in params:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if self.c.producer:
            if params.get("do_remote_decode") and rid not in self.prefilling:
                self.prefilling[rid] = _Prefilling(secrets.randbits(63) or 1, request.num_prompt_tokens)
            return
        if not params.get("do_remote_prefill") or ROOM not in params:
            return
        params["do_remote_prefill"] = False  # a rescheduled request does not open the room twice
        room, bootstrap = int(params[ROOM]), str(params[BOOTSTRAP])
        if num_external_tokens <= 0:  # all of it a local hit: release the prefill's blocks now
            self.next.aborts.append(Abort(rid, room, bootstrap))
            return
        pages = list(blocks.get_block_ids()[0])[: -(-request.num_prompt_tokens // self.c.block_size)]
        self.recving[rid] = room
        self.next.recvs.append(Recv(rid, room, bootstrap, pages, request.num_prompt_tokens,
                                    request.num_prompt_tokens - num_external_tokens))  # the rest: a local hit

    def meta(self, out: SchedulerOutput) -> KVProtoMetadata:
        meta, self.next = self.next, KVProtoMetadata()
        if not self.c.producer:
            return meta
        steps: list[tuple[str, int, list[int], bool]] = []
        for new in out.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, list(new.block_ids[0]), False))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            steps.append((rid, cached.num_computed_tokens[i], [] if ids is None else list(ids[0]),
                          rid in cached.resumed_req_ids))
        for rid, computed, ids, resumed in steps:
            p = self.prefilling.get(rid)
            if p is None or p.done:
                continue  # not a disaggregated request, or its prompt has gone (it decodes now)
            if resumed:  # preempted: vLLM freed the blocks already given, so the room cannot be finished
                p.done = p.cancelled = True
                meta.aborts.append(Abort(rid, p.room))
                continue
            if not p.opened:
                p.opened = True
                meta.opens.append(Open(rid, p.room, p.prompt))
            p.blocks += ids
            end = min(p.prompt, computed + out.num_scheduled_tokens.get(rid, 0))
            last = end >= p.prompt
            upto = -(-end // self.c.block_size) if last else end // self.c.block_size
            if not last and upto <= p.given:
                continue  # no whole page completed this step
            meta.sends.append(Send(rid, p.room, p.blocks[p.given:upto], end if last else upto * self.c.block_size,
                                   p.prompt))
            p.given = upto
            p.done = last
        return meta

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params or {}
        if not self.c.producer:
            if rid in self.recving:  # still loading: vLLM holds its blocks until the room has ended
                self.next.aborts.append(Abort(rid, self.recving[rid]))
            elif params.get("do_remote_prefill") and ROOM in params:  # never scheduled: release the prefill
                self.next.aborts.append(Abort(rid, int(params[ROOM]), str(params[BOOTSTRAP])))
            return False, None
        p = self.prefilling.pop(rid, None)
        if p is None or not p.opened:
            return False, None  # not disaggregated, or finished before its first step: no room opened
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        self.held.add(rid)  # the workers' room may still read these blocks: freed once it has ended
        if not (ok and p.done and not p.cancelled):
            if not p.cancelled:
                self.next.aborts.append(Abort(rid, p.room))
            return True, None
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      BOOTSTRAP: self.c.settings.bootstrap_address, ROOM: p.room,
                      "remote_engine_id": self.c.engine_id}

    def output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_sending or ():
            self.held.discard(rid)
        for rid in out.finished_recving or ():
            self.recving.pop(rid, None)

    def pending(self) -> bool:
        return bool(self.held)


class _Worker:
    """The worker role: one kvproto endpoint per TP rank, driven through ``kvproto.sync``."""

    def __init__(self, c: KVProtoConnector, vllm_config: VllmConfig) -> None:
        self.c = c
        self.vllm_config = vllm_config
        self.tp_rank, self.tp_size = _tp(vllm_config)
        self.endpoint: SyncPrefill | SyncDecode | None = None
        self.loop: EngineLoop | None = None
        self.layers: dict[str, int] = {}
        self.senders: dict[int, tuple[str, KVSender]] = {}
        self.receivers: dict[int, tuple[str, KVReceiver]] = {}
        self.streamed: dict[int, int] = {}
        """Prefill: room -> layers of this step's chunk sent so far."""
        self.ended: dict[str, RoomState] = {}
        """Prefill: request -> final state of its room, until vLLM has finished the request."""
        self.finished: set[str] = set()
        self.begun: KVProtoMetadata | None = None
        self.on_gpu = False

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc = self.vllm_config.model_config
        kv = kv_cache_from_vllm(kv_caches, block_size=self.c.block_size,
                                num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size(),
                                tp_size=self.tp_size, tp_rank=self.tp_rank, mla=mc.use_mla)
        self.layers = {name: i for i, name in enumerate(kv_caches)}
        self.on_gpu = kv.mem_kind is MemKind.VRAM
        s = self.c.settings
        bootstrap = None if self.tp_rank == 0 else s.bootstrap_address
        if self.c.producer:
            config = s.endpoint_config(instance=f"{self.c.engine_id}-prefill", rank0_prefill=self.tp_rank == 0)
        else:
            config = s.endpoint_config(instance=f"{self.c.engine_id}-decode", rank0_prefill=False)
        if s.endpoint_process:
            from kvproto.sync_process import ProcessDecode, ProcessPrefill

            self.endpoint = (ProcessPrefill(kv, bootstrap=bootstrap, config=config) if self.c.producer
                             else ProcessDecode(kv, config=config))
        else:
            self.loop = EngineLoop(name=f"kvproto-{self.c.engine_id}-{self.tp_rank}")
            self.endpoint = (SyncPrefill(kv, bootstrap=bootstrap, config=config, loop=self.loop) if self.c.producer
                             else SyncDecode(kv, config=config, loop=self.loop))
        log.info("kvproto connector: %s TP rank %d/%d, %s", "prefill" if self.c.producer else "decode",
                 self.tp_rank, self.tp_size, kv.geometry)

    # -- each step --
    def start(self, meta: KVProtoMetadata) -> None:
        """The step's rooms open and aborts go, once per step, at the first of ``save_kv_layer``,
        ``start_load_kv`` or ``wait_for_save`` (vLLM may start loads after the forward)."""
        if meta is self.begun:
            return
        self.begun = meta
        for a in meta.aborts:
            self._abort(a)
        if self.c.producer:
            for o in meta.opens:
                sender = self.endpoint.sender(o.room)  # type: ignore[union-attr]
                sender.init(o.num_tokens)
                self.senders[o.room] = (o.req_id, sender)
            for s in meta.sends:
                self.streamed[s.room] = 0
            return
        for r in meta.recvs:
            rx = self.endpoint.receiver(r.room, r.bootstrap, pages=r.pages, num_tokens=r.num_tokens,  # type: ignore[union-attr]
                                        prefix_tokens=r.prefix_tokens)
            self.receivers[r.room] = (r.req_id, rx)

    def _abort(self, a: Abort) -> None:
        if self.c.producer:
            entry = self.senders.get(a.room)
            if entry is not None:
                entry[1].abort()
            return
        entry = self.receivers.get(a.room)
        if entry is not None:
            entry[1].abort()
        elif a.bootstrap is not None:  # never opened here: open it only to tell the prefill to let go
            rx = self.endpoint.receiver(a.room, a.bootstrap)  # type: ignore[union-attr]
            rx.abort()

    def _event(self) -> Any:
        """A CUDA event after the work queued so far on the current stream (None for CPU caches)."""
        if self.on_gpu:
            event = torch.cuda.Event(interprocess=self.c.settings.endpoint_process)
            event.record()
            return event
        return None

    def layer_done(self, meta: KVProtoMetadata, layer_name: str) -> None:
        """A layer's forward is queued: its KV of this step's chunks moves once it has run."""
        if not self.c.producer or not self.c.settings.layerwise or not meta.sends:
            return
        self.start(meta)
        layer = self.layers.get(layer_name)
        if layer is None:
            return
        event = None
        for s in meta.sends:
            done = self.streamed.get(s.room)
            if done is None or done != layer:
                continue  # not ours, or layers came out of order: the rest goes at wait_for_save
            event = event if event is not None else self._event()
            self.senders[s.room][1].send(s.pages if layer == 0 else [], s.end, layers=range(layer, layer + 1),
                                         ready=event)
            self.streamed[s.room] = layer + 1

    def forward_done(self, meta: KVProtoMetadata) -> None:
        """The step's forward is queued: what was not streamed by layer goes now, in one span."""
        self.start(meta)
        if not self.c.producer:
            return
        total = len(self.layers)
        event = None
        for s in meta.sends:
            done = self.streamed.pop(s.room, None)
            entry = self.senders.get(s.room)
            if done is None or entry is None or done >= total:
                continue
            event = event if event is not None else self._event()
            entry[1].send(s.pages if done == 0 else [], s.end, layers=range(done, total), ready=event)

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.endpoint is None:
            return out
        for room, state, code in self.endpoint.get_finished():
            if self.c.producer:
                entry = self.senders.pop(room, None)
                if entry is not None:
                    self.ended[entry[0]] = state
                    if state is RoomState.FAILED:
                        log.info("kvproto connector: request %s: prefill room failed (%s)", entry[0], code)
                continue
            entry = self.receivers.pop(room, None)
            if entry is None:
                continue
            out.finished_recving.add(entry[0])
            if state is not RoomState.SUCCESS:
                log.warning("kvproto connector: request %s: KV transfer failed (%s); vLLM recomputes it",
                            entry[0], code)
                out.failed_recving.add(entry[0])
        if self.c.producer:
            ours = {rid for rid, _ in self.senders.values()} | set(self.ended)
            self.finished |= finished_req_ids & ours
            for rid in [r for r in self.ended if r in self.finished]:
                del self.ended[rid]
                self.finished.discard(rid)
                out.finished_sending.add(rid)
        return out

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None
