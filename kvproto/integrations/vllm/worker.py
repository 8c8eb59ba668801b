"""The connector's worker role: one kvproto endpoint per side per TP rank, driven each step.

Theory of operation
-------------------
A vLLM worker calls its connector in a fixed order every step: ``bind_connector_metadata``, the
forward (``save_kv_layer`` after each attention layer), ``wait_for_save``, ``get_transfer_results``,
``clear_connector_metadata``. This role turns the step's ``KVProtoMetadata`` into calls on kvproto's
synchronous facade (``kvproto.sync``, or ``kvproto.sync.process`` with ``endpoint_process``), whose
calls never block, and reports each room's end exactly once:

* the step's aborts, opens, holds and destinations go at the first hook of the step
  (``start``), before the forward;
* layer-wise (``layerwise``): when ``save_kv_layer`` reports model layer ``l`` queued, every
  chunk of the step sends the layers up to ``l`` it has not sent, once a CUDA event recorded then
  has fired (kvproto polls it; the engine's stream is never synchronized). Layers without an
  attention call (Mamba, indexer caches) ride with the next attention layer's span;
  ``wait_for_save`` sends what is left of every chunk in one span. Under full CUDA graphs vLLM
  replays whole forwards without calling ``save_kv_layer``: every layer then goes at
  ``wait_for_save``, still after an event recorded behind the forward — correct, only not early;
* ``get_transfer_results`` reports rooms that ended: a decode room as a finished receive (a
  failed one also as ``failed_recving``: vLLM recomputes or fails the request, per its
  ``kv_load_failure_policy``); a prefill room as a finished send once vLLM has also finished the
  request (vLLM frees its blocks then). A decode room that ended before its destination came (its
  prefill went away while the request queued) is reported once vLLM waits for it.

An instance of ``kv_both`` runs a prefill and a decode endpoint on one event loop, both over the
same cache; requests choose per their ``kv_transfer_params``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvproto.core import RoomState
from kvproto.integrations.vllm.cache import GroupPlan, kv_cache_from_vllm, layer_index
from kvproto.integrations.vllm.scheduler import Abort, KVProtoMetadata
from kvproto.integrations.vllm.settings import Settings, compat_key, model_id
from kvproto.integrations.vllm.stats import KVProtoStats
from kvproto.sync import EngineLoop
from kvproto.transport import MemKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvproto.vllm")


def tp_of(vllm_config: VllmConfig) -> tuple[int, int]:
    """(TP rank, TP size) of this worker."""
    size = vllm_config.parallel_config.tensor_parallel_size
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        if model_parallel_is_initialized():
            return get_tensor_model_parallel_rank(), size
    except ImportError:  # pragma: no cover - older layouts of vLLM
        pass
    return vllm_config.parallel_config.rank % size, size


class Worker:
    """The worker role (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, settings: Settings, plans: list[GroupPlan], *, producer: bool,
                 consumer: bool, engine_id: str, dp_index: int) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.plans = plans
        self.producer, self.consumer = producer, consumer
        self.engine_id = engine_id
        self.dp_index = dp_index
        self.tp_rank, self.tp_size = tp_of(vllm_config)
        self.prefill: Any = None
        self.decode: Any = None
        self.loop: EngineLoop | None = None
        self.layers: dict[str, int] = {}
        """vLLM layer name -> model layer."""
        self.num_layers = 0
        self.senders: dict[int, tuple[str, Any]] = {}
        self.receivers: dict[int, tuple[str, Any]] = {}
        self.destined: set[int] = set()
        """Decode rooms given their destination (vLLM waits for their end)."""
        self.early: dict[int, RoomState] = {}
        """Decode rooms that ended before their destination came, until it does."""
        self.dropped: set[int] = set()
        """Decode rooms aborted before their destination came: vLLM never waits for their end."""
        self.late_ends: list[tuple[str, RoomState]] = []
        """Ends to report at the next results (early ends whose destination came this step)."""
        self.streamed: dict[int, int] = {}
        """Prefill: room -> model layers of this step's chunk sent so far."""
        self.ended: dict[str, RoomState] = {}
        """Prefill: request -> final state of its room, until vLLM has finished the request."""
        self.finished: set[str] = set()
        self.begun: KVProtoMetadata | None = None
        self.on_gpu = False
        self.stats = KVProtoStats()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc = self.vllm_config.model_config
        kv = kv_cache_from_vllm(kv_caches, self.plans, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                total_kv_heads=mc.get_total_num_kv_heads())
        self.layers = {name: layer_index(name) for plan in self.plans for name in plan.layers}
        self.num_layers = kv.model_layers
        self.on_gpu = kv.mem_kind is MemKind.VRAM
        s = self.settings
        ident = dict(model_id=model_id(self.vllm_config, s),
                     compat_key=compat_key(self.vllm_config, [p.name for p in self.plans]), dp_index=self.dp_index)
        instance = f"{self.engine_id}-dp{self.dp_index}"
        bootstrap = None if self.tp_rank == 0 else s.bootstrap_address(self.dp_index)
        prefill_cfg = s.endpoint_config(instance=f"{instance}-prefill", prefill=True, serves_bootstrap=self.tp_rank == 0,
                                        **ident) if self.producer else None
        decode_cfg = s.endpoint_config(instance=f"{instance}-decode", prefill=False, serves_bootstrap=False,
                                       **ident) if self.consumer else None
        if s.endpoint_process:
            from kvproto.sync import ProcessDecode, ProcessPrefill

            self.prefill = prefill_cfg and ProcessPrefill(kv, bootstrap=bootstrap, config=prefill_cfg)
            self.decode = decode_cfg and ProcessDecode(kv, config=decode_cfg)
        else:
            from kvproto.sync import SyncDecode, SyncPrefill

            self.loop = EngineLoop(name=f"kvproto-{self.engine_id}-{self.tp_rank}")
            self.prefill = prefill_cfg and SyncPrefill(kv, bootstrap=bootstrap, config=prefill_cfg, loop=self.loop)
            self.decode = decode_cfg and SyncDecode(kv, config=decode_cfg, loop=self.loop)
        log.info("kvproto connector: %s TP rank %d/%d, DP rank %d, groups %s, %s",
                 "prefill and decode" if self.producer and self.consumer else "prefill" if self.producer else "decode",
                 self.tp_rank, self.tp_size, self.dp_index, [p.name for p in self.plans], kv.geometry)

    # -- each step --
    def start(self, meta: KVProtoMetadata) -> None:
        """The step's aborts, opens, holds and destinations, once per step, at the first of
        ``save_kv_layer``, ``start_load_kv`` or ``wait_for_save``."""
        if meta is self.begun:
            return
        self.begun = meta
        for a in meta.aborts:
            self._abort(a)
        for o in meta.opens:
            sender = self.prefill.sender(o.room)
            sender.init(o.num_tokens)
            self.senders[o.room] = (o.req_id, sender)
        for s in meta.sends:
            self.streamed[s.room] = 0
        for h in meta.holds:
            self.receivers[h.room] = (h.req_id, self.decode.receiver(h.room, h.bootstrap))
        first, *rest = self.plans
        for r in meta.recvs:
            pages = first.pages(r.pages[first.vllm_group], r.num_tokens)
            groups = {p.name: p.pages(r.pages[p.vllm_group], r.num_tokens) for p in rest if p.state is None} or None
            slots = {p.name: r.slots[p.vllm_group] for p in rest if p.state is not None} or None
            self.destined.add(r.room)
            state = self.early.pop(r.room, None)
            if state is not None:  # the room ended while the request queued: vLLM learns it now
                self.late_ends.append((r.req_id, state))
                continue
            entry = self.receivers.get(r.room)
            if entry is None:
                rx = self.decode.receiver(r.room, r.bootstrap, pages=pages, num_tokens=r.num_tokens,
                                          prefix_tokens=r.prefix_tokens, group_pages=groups, state_slots=slots)
                self.receivers[r.room] = (r.req_id, rx)
            else:
                entry[1].init(pages, r.num_tokens, prefix_tokens=r.prefix_tokens, group_pages=groups,
                              state_slots=slots)

    def _abort(self, a: Abort) -> None:
        if a.prefill:
            entry = self.senders.get(a.room)
            if entry is not None:
                entry[1].abort()
            return
        entry = self.receivers.get(a.room)
        if a.room not in self.destined and self.early.pop(a.room, None) is None and entry is not None:
            self.dropped.add(a.room)  # its end, when it comes, concerns nobody
        if entry is not None:
            entry[1].abort()
        elif a.bootstrap is not None:  # never opened here: open it only to tell the prefill to let go
            self.decode.receiver(a.room, a.bootstrap).abort()

    def _event(self) -> Any:
        """A CUDA event after the work queued so far on the current stream (None for CPU caches)."""
        if self.on_gpu:
            event = torch.cuda.Event(interprocess=self.settings.endpoint_process)
            event.record()
            return event
        return None

    def layer_done(self, meta: KVProtoMetadata, layer_name: str) -> None:
        """An attention layer's forward is queued: its KV (and that of the layers before it) of this
        step's chunks moves once it has run."""
        if not self.producer or not self.settings.layerwise or not meta.sends:
            return
        self.start(meta)
        layer = self.layers.get(layer_name)
        if layer is None:
            return
        event = None
        for s in meta.sends:
            done = self.streamed.get(s.room)
            entry = self.senders.get(s.room)
            if done is None or entry is None or layer < done:
                continue  # not ours, or a layer already sent: the rest goes at wait_for_save
            event = event if event is not None else self._event()
            self._send(entry[1], s, done, layer + 1, event)
            self.streamed[s.room] = layer + 1

    def forward_done(self, meta: KVProtoMetadata) -> None:
        """The step's forward is queued: what was not streamed by layer goes now, in one span."""
        self.start(meta)
        if not self.producer:
            return
        event = None
        for s in meta.sends:
            done = self.streamed.pop(s.room, None)
            entry = self.senders.get(s.room)
            if done is None or entry is None or done >= self.num_layers:
                continue
            event = event if event is not None else self._event()
            self._send(entry[1], s, done, self.num_layers, event)

    def _send(self, sender: Any, s: Any, start: int, stop: int, event: Any) -> None:
        """Layers ``[start, stop)`` of chunk ``s``: its pages with its first span, none after (each
        kvproto group takes its vLLM group's blocks)."""
        first, *rest = self.plans
        if start:
            sender.send([], s.end, layers=range(start, stop), ready=event)
            return
        if s.slots:  # the last chunk: its state slots go with its first span
            sender.init(s.num_tokens, state_slots={p.name: s.slots[p.vllm_group] for p in rest if p.state is not None})
        groups = {p.name: s.pages.get(p.vllm_group, []) for p in rest if p.state is None} or None
        sender.send(s.pages.get(first.vllm_group, []), s.end, layers=range(start, stop), ready=event,
                    group_pages=groups)

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        for rid, state in self.late_ends:
            self._received(out, rid, state)
        self.late_ends.clear()
        if self.prefill is not None:
            for room, state, code in self.prefill.get_finished():
                entry = self.senders.pop(room, None)
                if entry is None:
                    continue
                self.ended[entry[0]] = state
                self.stats.room_ended(entry[1], state, code, sending=True)
                if state is RoomState.FAILED:
                    log.info("kvproto connector: request %s: prefill room failed (%s)", entry[0], code)
            live = {rid for rid, _ in self.senders.values()}  # a preempted request's fresh room may be live
            self.finished |= finished_req_ids & (live | set(self.ended))
            for rid in [r for r in self.ended if r in self.finished and r not in live]:
                del self.ended[rid]
                self.finished.discard(rid)
                out.finished_sending.add(rid)
        if self.decode is not None:
            for room, state, code in self.decode.get_finished():
                entry = self.receivers.pop(room, None)
                if entry is None:
                    continue
                self.stats.room_ended(entry[1], state, code, sending=False)
                if state is not RoomState.SUCCESS:
                    log.warning("kvproto connector: request %s: KV transfer failed (%s)", entry[0], code)
                if room in self.destined:
                    self.destined.discard(room)
                    self._received(out, entry[0], state)
                elif room in self.dropped:
                    self.dropped.discard(room)
                else:
                    self.early[room] = state
        return out

    @staticmethod
    def _received(out: KVConnectorTransferResults, rid: str, state: RoomState) -> None:
        out.finished_recving.add(rid)
        if state is not RoomState.SUCCESS:
            out.failed_recving.add(rid)

    def close(self) -> None:
        for facade in (self.prefill, self.decode):
            if facade is not None:
                facade.close()
        self.prefill = self.decode = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None
