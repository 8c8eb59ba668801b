"""kvproto's vLLM connector, driven by vLLM's own scheduler (``harness.py``): requests go prefill ->
kv_transfer_params -> decode, real NIXL and ZMQ on loopback; the prefill's forward writes KV late,
on a stream of its own, and every byte a decode needs of every cache group is checked against a
pure function of the prompt when vLLM reports it received; nothing leaks (``assert_empty``)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from kvproto.integrations.vllm import BOOTSTRAP, ROOM, KVProtoMetadata, Settings, Unsupported  # noqa: E402

from .harness import ATTN, Instance, assert_empty, check_landed, free_port, kv_params, run_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def pair(p_tp: int = 1, d_tp: int = 1, *, p_block: int = 16, d_block: int = 16, p_layout: str = "LBNHC",
         d_layout: str = "LBNHC", d_blocks: int = 96, timeouts: dict[str, float] | None = None,
         batch_tokens: int = 256, heartbeat: float = 5.0, decode_timeouts: dict[str, float] | None = None,
         policy: str = "fail", layerwise: bool = True, model: str = "gqa", endpoint_process: bool = False,
         scheduler: str = "sync", lag: float = 0.002, d_extra: dict[str, Any] | None = None,
         p_extra: dict[str, Any] | None = None, log_stats: bool = False, d_kw: dict[str, Any] | None = None
         ) -> tuple[Instance, Instance]:
    port = free_port()
    prefill = Instance("kv_producer", tp=p_tp, block=p_block, layout=p_layout, batch_tokens=batch_tokens,
                       extra={"bootstrap_port": port, "timeouts": dict(timeouts or {}), "heartbeat_timeout_s": heartbeat,
                              "layerwise": layerwise, "endpoint_process": endpoint_process, **(p_extra or {})},
                       engine="prefill", model=model, scheduler=scheduler, lag=lag, log_stats=log_stats)
    decode = Instance("kv_consumer", tp=d_tp, block=d_block, layout=d_layout, blocks=d_blocks,
                      extra={"heartbeat_timeout_s": heartbeat, "timeouts": dict(decode_timeouts or {}),
                             "endpoint_process": endpoint_process, **(d_extra or {})},
                      engine="decode", policy=policy, model=model, scheduler=scheduler, lag=lag, log_stats=log_stats,
                      **(d_kw or {}))
    return prefill, decode


def checking(decode: Instance, prompts: dict[str, list[int]]) -> dict[str, int]:
    """Check each request's bytes in the step vLLM reports them received (before it runs them)."""
    checked: dict[str, int] = {}

    def on_landed(inst: Instance, rid: str) -> None:
        checked[rid] = check_landed(inst, rid, prompts[rid])

    decode.on_landed = on_landed
    return checked


def disaggregated(prefill: Instance, decode: Instance, prompts: dict[str, list[int]], max_tokens: int = 4,
                  timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """vLLM's proxy pattern: each prompt to the prefill (max_tokens 1, do_remote_decode), then to the
    decode with the kv_transfer_params the prefill returned."""
    for rid, prompt in prompts.items():
        prefill.add(rid, prompt, 1, {"do_remote_decode": True})
    run_until([prefill], lambda: all(r in prefill.finished for r in prompts), timeout)
    params = {rid: kv_params(prefill, rid) for rid in prompts}
    for rid, prompt in prompts.items():
        decode.add(rid, prompt, max_tokens, params[rid])
    run_until([prefill, decode], lambda: all(r in decode.finished for r in prompts) and not prefill.busy()
              and not decode.busy(), timeout)
    return params


CASES = {
    "gqa-tp1-nhd": dict(),
    "gqa-tp1-hnd-to-nhd": dict(p_layout="LBHNC"),
    "gqa-tp1-to-2": dict(d_tp=2),
    "gqa-tp2-to-1-async-scheduler": dict(p_tp=2, scheduler="async"),
    "gqa-block16-to-32": dict(d_block=32),
    "gqa-tp2-to-1-block32-to-16-hnd": dict(p_tp=2, p_block=32, p_layout="LBHNC"),
    "gqa-tp1-to-2-whole-chunks": dict(d_tp=2, layerwise=False),
    "mla-tp2-to-1-block16-to-32": dict(p_tp=2, d_block=32, model="mla"),
    "mla-tp1-to-2-hnd-to-nhd": dict(d_tp=2, p_layout="LBHNC", model="mla"),
    "swa-tp1": dict(model="swa"),
    "swa-tp1-to-2-async-scheduler": dict(d_tp=2, model="swa", scheduler="async"),
    "swa-tp2-to-1-block16-to-32": dict(p_tp=2, d_block=32, model="swa"),
    "mla-indexer-tp1-to-2": dict(d_tp=2, model="mla-indexer"),
    "mla-indexer-tp2-to-1-block16-to-32": dict(p_tp=2, d_block=32, model="mla-indexer"),
    "gqa-tp2-to-1-endpoints-in-processes": dict(p_tp=2, endpoint_process=True),
    "gdn-tp1": dict(model="gdn"),
    "gdn-tp1-to-2": dict(d_tp=2, model="gdn"),
    "gdn-tp2-to-1-block16-to-32-async-scheduler": dict(p_tp=2, d_block=32, model="gdn", scheduler="async"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_requests_move_prefill_to_decode_byte_exact(case: str) -> None:
    """Prompts of several lengths (one block, partial blocks, several chunks of chunked prefill)
    go through both schedulers; when vLLM reports each received, every byte of every group the
    decode needs holds the prefill's KV (a sliding window's last tokens, a latent and its indexer
    cache, every head across TP sizes, block sizes and layouts); the decode samples its tokens;
    nothing leaks on either side."""
    prefill, decode = pair(**CASES[case], batch_tokens=48)
    try:
        rng = random.Random(case)
        prompts = {f"r{i}": [rng.randrange(1, 999) for _ in range(n)] for i, n in enumerate([16, 37, 100, 5, 130])}
        checked = checking(decode, prompts)
        params = disaggregated(prefill, decode, prompts)
        for rid in prompts:
            assert set(params[rid]) >= {BOOTSTRAP, ROOM, "do_remote_prefill"}
            assert decode.finished[rid].finish_reason is not None and len(decode.outputs[rid]) == 4
        assert set(checked) == set(prompts) and all(checked.values()), checked
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_the_byte_check_catches_a_send_that_does_not_wait_for_the_forward() -> None:
    """The check bites: a worker that sends a layer without waiting for its forward (no event)
    while the prefill's stream runs 50 ms behind moves bytes the forward has not written yet, and
    the decode's check finds them wrong."""
    prefill, decode = pair(lag=0.05)
    try:
        for w in prefill.workers:
            w._worker._event = lambda: None
        prompts = {"early": list(range(1, 70))}
        checking(decode, prompts)
        with pytest.raises(AssertionError, match="differ"):
            disaggregated(prefill, decode, prompts)
    finally:
        prefill.close()
        decode.close()


def test_full_cuda_graph_forwards_send_every_layer_at_wait_for_save() -> None:
    """A forward replayed from a full CUDA graph calls no ``save_kv_layer``: the chunk's layers go
    at ``wait_for_save``, behind an event recorded after the forward, and the bytes are exact."""
    prefill, decode = pair(lag=0.01)
    try:
        for w in prefill.workers:
            w.save_kv_layer = lambda *a, **k: None
        prompts = {"graph": list(range(1, 90)), "graph2": list(range(500, 540))}
        checked = checking(decode, prompts)
        disaggregated(prefill, decode, prompts)
        assert set(checked) == set(prompts)
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_decode_prefix_hit_moves_only_the_rest() -> None:
    """A second prompt sharing 64 tokens with the first: the decode scheduler's prefix cache holds
    them, the room moves the rest only, and the whole prompt's blocks hold the right bytes."""
    prefill, decode = pair()
    try:
        shared = list(range(1, 65))
        prompts = {"a": shared + [500, 501, 502], "b": shared + [600] * 40}
        checked = checking(decode, prompts)
        disaggregated(prefill, decode, {"a": prompts["a"]})
        second = disaggregated(prefill, decode, {"b": prompts["b"]})
        r = [r for m in decode.metas for r in m.recvs if r.room == int(second["b"][ROOM])]
        assert len(r) == 1 and r[0].prefix_tokens == 64, r
        assert set(checked) == {"a", "b"}
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("policy,d_tp", [("fail", 1), ("recompute", 1), ("recompute", 2)])
def test_prefill_dies_the_decode_request_ends_through_vllms_load_failure_path(policy: str, d_tp: int) -> None:
    """The prefill instance goes silent (its endpoints' loop stops, as in a crash) before the decode
    opens the room: the decode's room cannot bootstrap and fails after its bootstrap timeout (3 s
    here); vLLM takes it as a failed receive and follows its ``kv_load_failure_policy``: ``fail``
    ends the request with an error, ``recompute`` computes the prompt itself. Nothing hangs or
    leaks (with decode TP 2, vLLM's aggregator sees both ranks' failure)."""
    prefill, decode = pair(d_tp=d_tp, heartbeat=1.0, decode_timeouts={"bootstrap": 3.0}, policy=policy)
    try:
        prefill.add("x", list(range(1, 90)), 1, {"do_remote_decode": True})
        run_until([prefill], lambda: "x" in prefill.finished)
        params = kv_params(prefill, "x")
        for w in prefill.workers:  # a crash: no goodbye, no answers, heartbeats stop
            loop = w._worker.loop.loop
            loop.call_soon_threadsafe(loop.stop)
        decode.add("x", list(range(1, 90)), 3, params)
        run_until([decode], lambda: "x" in decode.finished and not decode.busy(), timeout=30)
        if policy == "recompute":
            assert len(decode.outputs["x"]) == 3
            assert decode.finished["x"].finish_reason.name == "LENGTH"
        else:
            assert decode.outputs.get("x", []) == []
            assert decode.finished["x"].finish_reason.name == "ERROR"
        assert_empty(decode)
    finally:
        decode.close()
        for w in prefill.workers:  # bring the silent loops back, only to close them cleanly
            engine_loop = w._worker.loop
            engine_loop._thread = threading.Thread(target=engine_loop._run, daemon=True)
            engine_loop._thread.start()
        prefill.close()


def test_a_failed_load_leaves_nothing_in_the_decode_prefix_cache() -> None:
    """A load that fails (the prefill is gone) must not leave its never-written blocks in the
    decode's prefix cache: the same prompt sent again, through a live prefill, finds no local hit
    (its room moves the whole prompt) and its bytes are exact."""
    prefill, decode = pair(heartbeat=1.0, decode_timeouts={"bootstrap": 2.0})
    prompt = list(range(1, 97))
    try:
        prefill.add("lost", prompt, 1, {"do_remote_decode": True})
        run_until([prefill], lambda: "lost" in prefill.finished)
        params = kv_params(prefill, "lost")
        prefill.close()  # gone before the decode asks
        decode.add("lost", prompt, 2, params)
        run_until([decode], lambda: "lost" in decode.finished and not decode.busy(), timeout=30)
        assert decode.finished["lost"].finish_reason.name == "ERROR"
        again = Instance("kv_producer", extra={"bootstrap_port": free_port()}, engine="prefill-2")
        try:
            checked = checking(decode, {"again": prompt})
            again.add("again", prompt, 1, {"do_remote_decode": True})
            run_until([again], lambda: "again" in again.finished)
            decode.add("again", prompt, 2, kv_params(again, "again"))
            run_until([again, decode], lambda: "again" in decode.finished and not decode.busy() and not again.busy())
            r = [r for m in decode.metas for r in m.recvs if r.req_id == "again"]
            assert len(r) == 1 and r[0].prefix_tokens == 0, r
            assert set(checked) == {"again"}
            assert_empty(again, decode)
        finally:
            again.close()
    finally:
        prefill.close()
        decode.close()


def test_prefill_abort_mid_prompt_frees_its_blocks() -> None:
    """A request aborted on the prefill while its prompt is half computed (chunked prefill): its
    room is aborted and its blocks are freed once the room has ended; nothing is returned to send."""
    prefill, _decode = pair(batch_tokens=32)
    _decode.close()
    try:
        prefill.add("y", list(range(1, 200)), 1, {"do_remote_decode": True})
        prefill.step()
        prefill.step()
        assert prefill.free_blocks() < prefill.free_at_start
        prefill.abort("y")
        run_until([prefill], lambda: not prefill.busy(), timeout=30)
        assert any(a.req_id == "y" for m in prefill.metas for a in m.aborts)
        assert_empty(prefill)
    finally:
        prefill.close()


def test_decode_abort_while_waiting_for_kv_frees_blocks_and_releases_nothing_twice() -> None:
    """A decode request aborted while it waits for its KV (here: a room the prefill does not know
    yet, so nothing arrives): the room is aborted, vLLM frees the blocks when the connector reports
    the room ended (finished receiving), and nothing is left on either side."""
    prefill, decode = pair()
    try:
        address = Settings(bootstrap_port=prefill.configs[0].kv_transfer_config
                           .kv_connector_extra_config["bootstrap_port"]).bootstrap_address()
        decode.add("z", list(range(1, 50)), 3, {"do_remote_prefill": True, BOOTSTRAP: address, ROOM: 12345})
        decode.step()
        decode.step()
        assert decode.scheduler.requests["z"].status.name == "WAITING_FOR_REMOTE_KVS"
        decode.abort("z")
        run_until([decode, prefill], lambda: not decode.busy(), timeout=30)
        assert_empty(decode, prefill)
    finally:
        prefill.close()
        decode.close()


def test_decode_request_aborted_before_it_had_blocks_leaves_nothing() -> None:
    """A decode request whose room the connector opened on arrival is aborted while it still
    queues for blocks: the room ends, the prefill lets go of its blocks at once (the decode's abort
    reaches it), and neither side keeps anything."""
    prefill, decode = pair(d_blocks=12)
    try:
        prompts = {"big1": list(range(1, 120)), "big2": list(range(200, 320))}
        for rid, prompt in prompts.items():
            prefill.add(rid, prompt, 1, {"do_remote_decode": True})
        run_until([prefill], lambda: all(r in prefill.finished for r in prompts))
        for rid, prompt in prompts.items():
            decode.add(rid, prompt, 40, kv_params(prefill, rid))
        decode.step()
        assert decode.scheduler.requests["big2"].status.name == "WAITING", "big2 should wait for blocks"
        decode.abort("big2")
        held = prefill.connector._scheduler.held
        run_until([prefill, decode], lambda: "big2" not in held, timeout=10)  # the prefill let go at once
        decode.abort("big1")
        run_until([prefill, decode], lambda: not prefill.busy() and not decode.busy(), timeout=30)
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_a_decode_request_queued_longer_than_the_lease_keeps_the_prefills_blocks() -> None:
    """The decode has blocks for one of two requests: the second waits in vLLM's queue (no blocks)
    three times longer than the prefill's lease (2 s): its room, open since it arrived, renews the
    lease (``ROOM_HOLD``: 3 s asked every second), so the prefill keeps its blocks; once the first request is done the second
    gets blocks and its KV moves byte-exact. Nothing leaks."""
    prefill, decode = pair(d_blocks=12, timeouts={"bootstrap": 2.0}, decode_timeouts={"hold": 3.0})
    try:
        prompts = {"big1": list(range(1, 100)), "big2": list(range(200, 299))}
        checked = checking(decode, prompts)
        for rid, prompt in prompts.items():
            prefill.add(rid, prompt, 1, {"do_remote_decode": True})
        run_until([prefill], lambda: all(r in prefill.finished for r in prompts))
        decode.add("big1", prompts["big1"], 40, kv_params(prefill, "big1"))
        decode.add("big2", prompts["big2"], 40, kv_params(prefill, "big2"))
        decode.step()  # big1 takes the blocks; big2 queues, its room open
        assert decode.scheduler.requests["big2"].status.name == "WAITING", "big2 should wait for blocks"
        time.sleep(6.0)  # three leases: the engines are busy elsewhere, kvproto's loops hold the room
        room = int(kv_params(prefill, "big2")[ROOM])
        state = prefill.workers[0]._worker.prefill._endpoint.core.room_state(room)
        assert state is not None and not state.terminal, f"the prefill's room for big2 ended ({state})"
        run_until([prefill, decode], lambda: all(r in decode.finished for r in prompts) and not prefill.busy()
                  and not decode.busy(), timeout=60)
        assert not decode.failed_recving and set(checked) == set(prompts)
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_a_decode_that_never_comes_costs_the_prefill_its_lease() -> None:
    """A finished prefill request whose decode never asks for it holds its blocks for the lease
    (``bootstrap``, 2 s here) and no longer; its room fails as expired (BOOTSTRAP_TIMEOUT)."""
    prefill, decode = pair(timeouts={"bootstrap": 2.0})
    decode.close()
    try:
        prefill.add("orphan", list(range(1, 70)), 1, {"do_remote_decode": True})
        run_until([prefill], lambda: "orphan" in prefill.finished)
        began = time.monotonic()
        run_until([prefill], lambda: not prefill.busy(), timeout=20)
        assert 1.5 < time.monotonic() - began < 6.0
        assert_empty(prefill)
    finally:
        prefill.close()


def test_unknown_extra_config_key_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['bootstrap_prot'\\]"):
        Settings.from_extra({"bootstrap_prot": 1})


def test_metadata_is_kvproto_metadata() -> None:
    assert isinstance(KVProtoMetadata(), vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata)


def test_a_layout_without_a_dense_region_per_layer_is_refused_at_start() -> None:
    """A block-outermost cache layout (every layer's page of a block side by side) has no dense
    region per layer: register_kv_caches refuses it, naming the setting that fixes it."""
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT to LBHNC or LBNHC"):
        Instance("kv_consumer", layout="BLNHC", extra={})


def test_a_cache_group_kvproto_cannot_move_is_refused_at_start_with_its_name() -> None:
    """A cache group kvproto cannot move (chunked-local attention; a linear-attention state it does
    not know how TP splits) is refused when the connector is made, naming the group, its kind and a
    layer, instead of being skipped (the decode would compute from a cache it never got)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec)

    from kvproto.integrations.vllm import plan_groups

    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.bfloat16)
    local = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.bfloat16,
                                      attention_chunk_size=64)
    linear = MambaSpec(block_size=16, shapes=((4, 16, 16),), dtypes=(torch.float32,),
                       mamba_type=MambaAttentionBackendEnum.LINEAR)

    def config(other: Any) -> Any:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.3.self_attn.attn"], full),
            KVCacheGroupSpec(["model.layers.0.attn", "model.layers.1.attn"], other)])

    with pytest.raises(Unsupported, match="KV cache group 1 holds ChunkedLocalAttentionSpec \\(layer 'model.layers.0.attn'"):
        plan_groups(config(local))
    with pytest.raises(Unsupported, match="KV cache group 1 \\(layer 'model.layers.0.attn'\\) holds LINEAR state"):
        plan_groups(config(linear))


def test_layerwise_sends_each_layer_as_its_forward_ends_and_whole_chunks_at_once(monkeypatch: Any) -> None:
    """With ``layerwise`` (the default) the connector gives kvproto each layer of a chunk from
    ``save_kv_layer``, one span per layer in order; without it, the chunk's layers in one span at
    ``wait_for_save``. Bytes are exact either way (the parametrized test above)."""
    from kvproto.sync import KVSender

    spans: list[tuple[int, int]] = []
    original = KVSender.send

    def send(self: Any, pages: Any, end_token: Any = None, *, layers: Any = None, ready: Any = None,
             group_pages: Any = None) -> None:
        spans.append((layers.start, layers.stop))
        original(self, pages, end_token, layers=layers, ready=ready, group_pages=group_pages)

    monkeypatch.setattr(KVSender, "send", send)
    got = {}
    for layerwise in (True, False):
        spans.clear()
        prefill, decode = pair(layerwise=layerwise)
        try:
            disaggregated(prefill, decode, {"w": list(range(1, 40))})
        finally:
            prefill.close()
            decode.close()
        got[layerwise] = list(spans)
    assert got[True] == [(layer, layer + 1) for layer in range(len(ATTN))]
    assert got[False] == [(0, len(ATTN))]


@pytest.mark.parametrize("case", ["gqa-tp2-to-1", "swa-tp1-to-2"])
def test_many_requests_interleaved_like_a_proxy(case: str) -> None:
    """Forty requests of random lengths (1 to 300 tokens) arrive over time; each goes to the
    decode as soon as its prefill has finished, both engines stepping all along with chunked
    prefill on a small token budget. Every request's bytes are exact, checked as its KV lands on the
    decode, before the request runs: the decode's blocks run short here, and a request vLLM
    preempts later gives up its blocks (another request's room may write them) and recomputes its
    last, partial block, as an engine does. Nothing leaks."""
    kw = {"gqa-tp2-to-1": dict(p_tp=2), "swa-tp1-to-2": dict(d_tp=2, model="swa")}[case]
    prefill, decode = pair(**kw, batch_tokens=64)
    try:
        rng = random.Random(case)
        prompts = {f"q{i}": [rng.randrange(1, 999) for _ in range(rng.randrange(1, 300))] for i in range(40)}
        checked = checking(decode, prompts)
        pending = list(prompts)
        forwarded: set[str] = set()

        def progress() -> bool:
            if pending and rng.random() < 0.5:
                rid = pending.pop(0)
                prefill.add(rid, prompts[rid], 1, {"do_remote_decode": True})
            for rid in list(prefill.finished):
                if rid not in forwarded:
                    forwarded.add(rid)
                    decode.add(rid, prompts[rid], 2, kv_params(prefill, rid))
            return not pending and len(decode.finished) == len(prompts) and not prefill.busy() and not decode.busy()

        run_until([prefill, decode], progress, timeout=120)
        assert set(checked) == set(prompts)
        assert all(len(decode.outputs[rid]) == 2 for rid in prompts)
        assert not decode.failed_recving
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()
