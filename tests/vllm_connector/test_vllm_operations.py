"""What a vLLM operator meets beyond moving bytes, on vLLM's real scheduler (``harness.py``): CUDA
graph modes, the compatibility check, CURVE keys, vLLM's metrics, data-parallel ranks, ``kv_both``,
leases and preemption, and the concurrent proxy flow in which the decode's room opens before the
prefill's forward."""

from __future__ import annotations

import functools
import logging
import random
import time
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

import zmq  # noqa: E402

from kvproto.integrations.vllm import BOOTSTRAP, ERROR, ROOM, KVProtoConnector, Settings  # noqa: E402

from .harness import Instance, assert_empty, free_port, kv_params, run_until, stats_of  # noqa: E402
from .test_vllm_connector import checking, disaggregated, pair  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# --- CUDA graphs ---------------------------------------------------------------------------------
def test_vllm_keeps_full_cuda_graphs_unless_cudagraph_piecewise_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks the connector whether it needs piecewise graphs and, if so, drops the full ones on
    that instance. With kvproto's defaults neither a prefill nor a decode instance loses vLLM's
    default FULL_AND_PIECEWISE mode; ``cudagraph_piecewise`` asks for piecewise graphs. (The CPU
    platform turns graphs off altogether: its graph support is patched in, as on a CUDA host.)"""
    from vllm.config import CompilationConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    from .harness import model_config

    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))
    monkeypatch.setattr(type(current_platform), "check_and_update_config", classmethod(lambda cls, c: None))
    mc = ModelConfig(model=model_config().model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                     enforce_eager=False)
    modes = {}
    for extra in ({}, {"layerwise": True}, {"cudagraph_piecewise": True}):
        for role in ("kv_producer", "kv_consumer", "kv_both"):
            kt = KVTransferConfig(kv_connector="KVProtoConnector", kv_connector_module_path="kvproto.integrations.vllm",
                                  kv_role=role, kv_connector_extra_config=extra)
            vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"), kv_transfer_config=kt,
                            compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE))
            modes[(role, tuple(extra))] = vc.compilation_config.cudagraph_mode
    assert {m for (role, keys), m in modes.items() if "cudagraph_piecewise" not in keys} == {
        CUDAGraphMode.FULL_AND_PIECEWISE}, modes
    assert {m for (role, keys), m in modes.items() if "cudagraph_piecewise" in keys} == {CUDAGraphMode.PIECEWISE}
    assert not KVProtoConnector.requires_piecewise_for_cudagraph({"layerwise": True})


# --- compatibility -------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["model", "kv_cache_dtype"])
def test_instances_of_different_models_or_cache_dtypes_are_refused_before_any_byte_moves(
        what: str, caplog: pytest.LogCaptureFixture) -> None:
    """A decode serving another model (here: another ``model_id``), or the same model with another
    KV cache dtype, is refused at registration with ``MODEL_MISMATCH`` / ``COMPAT_KEY_MISMATCH``
    naming both values: the decode's request fails (vLLM's ``kv_load_failure_policy`` fail), no
    byte moves, and nothing leaks."""
    d_extra = {"model_id": "another-model"} if what == "model" else {}
    d_kw = {"cache_dtype": "fp8_e5m2"} if what == "kv_cache_dtype" else {}  # the geometry alone would agree
    prefill, decode = pair(d_extra=d_extra, d_kw=d_kw, timeouts={"bootstrap": 60.0}, log_stats=True)
    try:
        caplog.set_level(logging.INFO, logger="kvproto")
        prompts = {"m": list(range(1, 60))}
        checked = checking(decode, prompts)
        began = time.monotonic()
        disaggregated(prefill, decode, prompts, timeout=30)  # waits for the prefill to let go, too
        assert time.monotonic() - began < 15, "the prefill kept the refused request's blocks for its lease"
        assert decode.finished["m"].finish_reason.name == "ERROR" and not checked
        code = "MODEL_MISMATCH" if what == "model" else "COMPAT_KEY_MISMATCH"
        assert stats_of(decode).data["recv_failed"] == [code]
        assert not stats_of(prefill).data["send_bytes"]
        refusals = [r.getMessage() for r in caplog.records if code.lower() in r.getMessage().lower()
                    or ("differs" in r.getMessage() or "serves model" in r.getMessage())]
        text = " ".join(refusals)
        if what == "model":
            assert "another-model" in text and "kvproto-vllm-test-model" in text, refusals
        else:
            assert "kv_cache_dtype=fp8_e5m2" in text and "kv_cache_dtype=auto" in text, refusals
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


# --- CURVE ---------------------------------------------------------------------------------------
def test_curve_keys_admit_the_known_decode_and_refuse_an_unknown_one(tmp_path: Any) -> None:
    """The prefill admits only the decode keys it lists (here from a directory of certificate
    files, as ``curve_keygen`` writes them): the known decode moves its request byte-exact; an
    unknown decode's request fails with ``AUTH_FAILED`` and nothing leaks."""
    import zmq.auth

    server_pub, server_sec = zmq.curve_keypair()
    known_pub, known_sec = zmq.curve_keypair()
    stranger_pub, stranger_sec = zmq.curve_keypair()
    (tmp_path / "allowed").mkdir()
    zmq.auth.create_certificates(str(tmp_path / "allowed"), "decode")
    allowed_pub, allowed_sec = zmq.auth.load_certificate(str(tmp_path / "allowed" / "decode.key_secret"))
    p_curve = {"public_key": server_pub.decode(), "secret_key": server_sec.decode(),
               "allowed": [known_pub.decode()], "allowed_dir": str(tmp_path / "allowed")}
    prefill, decode = pair(p_extra={"curve": p_curve}, timeouts={"bootstrap": 3.0}, log_stats=True,
                           d_extra={"curve": {"certificate": str(tmp_path / "allowed" / "decode.key_secret"),
                                              "server_key": server_pub.decode()}})
    stranger = Instance("kv_consumer", engine="stranger", log_stats=True,
                        extra={"curve": {"public_key": stranger_pub.decode(), "secret_key": stranger_sec.decode(),
                                         "server_key": server_pub.decode()}, "timeouts": {"bootstrap": 60.0}})
    try:
        prompts = {"ok": list(range(1, 70)), "no": list(range(100, 170))}
        checked = checking(decode, prompts)
        disaggregated(prefill, decode, {"ok": prompts["ok"]})
        assert set(checked) == {"ok"}
        prefill.add("no", prompts["no"], 1, {"do_remote_decode": True})
        run_until([prefill], lambda: "no" in prefill.finished)
        stranger.add("no", prompts["no"], 2, kv_params(prefill, "no"))
        began = time.monotonic()
        run_until([stranger], lambda: "no" in stranger.finished and not stranger.busy(), timeout=30)
        assert time.monotonic() - began < 10, "the refused decode waited for its bootstrap deadline"
        run_until([prefill], lambda: not prefill.busy(), timeout=30)  # its lease (3 s): no decode took it
        assert stranger.finished["no"].finish_reason.name == "ERROR"
        assert stats_of(stranger).data["recv_failed"] == ["AUTH_FAILED"]
        assert_empty(prefill, decode, stranger)
    finally:
        for inst in (prefill, decode, stranger):
            inst.close()


def test_curve_settings_are_checked_at_start() -> None:
    with pytest.raises(ValueError, match="unknown curve keys \\['secret'\\]"):
        Settings.from_extra({"curve": {"secret": "x"}})
    pub, sec = zmq.curve_keypair()
    from kvproto.integrations.vllm import curve_auth

    with pytest.raises(ValueError, match="needs the decode keys it admits"):
        curve_auth({"public_key": pub.decode(), "secret_key": sec.decode()}, prefill=True)
    with pytest.raises(ValueError, match="needs the prefill instance's public key"):
        curve_auth({"public_key": pub.decode(), "secret_key": sec.decode()}, prefill=False)


# --- metrics -------------------------------------------------------------------------------------
def _registry_metric_types() -> tuple[Any, dict[Any, Any]]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    return registry, {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}


def test_room_figures_reach_vllms_log_line_and_prometheus() -> None:
    """Rooms that moved report bytes and seconds through vLLM's stats path (worker
    ``get_kv_connector_stats``, merged over TP by vLLM's aggregator, shipped in ``SchedulerStats``,
    rebuilt by ``build_kv_connector_stats``); vLLM's periodic "KV Transfer metrics" line and the
    ``build_prom_metrics`` series show them; a prefill request no decode asked for expires at its
    lease and counts as expired."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    prefill, decode = pair(d_tp=2, timeouts={"bootstrap": 1.5}, log_stats=True)
    try:
        prompts = {f"s{i}": list(range(10 * i + 1, 10 * i + 60)) for i in range(3)}
        disaggregated(prefill, decode, prompts)
        prefill.add("orphan", list(range(1, 40)), 1, {"do_remote_decode": True})
        run_until([prefill], lambda: "orphan" in prefill.finished and not prefill.busy(), timeout=20)
        sent, received = stats_of(prefill), stats_of(decode)
        assert len(sent.data["send_seconds"]) == 3 and sum(sent.data["send_bytes"]) > 0
        assert len(received.data["recv_seconds"]) == 3 * 2  # each decode rank's room
        assert sum(received.data["recv_bytes"]) == sum(sent.data["send_bytes"])
        assert sent.data["expired"] == [1] and sent.data["send_failed"] == ["BOOTSTRAP_TIMEOUT"]

        lines: list[str] = []
        logging_ = KVConnectorLogging(prefill.configs[0].kv_transfer_config)
        for payload in prefill.stats:
            logging_.observe(payload)
        logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert lines and "Rooms sent=3" in lines[0] and "Num KV expired reqs=1" in lines[0], lines

        registry, types = _registry_metric_types()
        prom = KVProtoConnector.build_prom_metrics(decode.configs[0], types, ["engine"], {0: ["0"]})
        for payload in decode.stats:
            prom.observe(payload, 0)
        assert registry.get_sample_value("vllm:kvproto_transfer_seconds_count", {"engine": "0", "side": "recv"}) == 6
        assert registry.get_sample_value("vllm:kvproto_bytes_total", {"engine": "0", "side": "recv"}) == \
            sum(received.data["recv_bytes"])
        registry, types = _registry_metric_types()
        prom = KVProtoConnector.build_prom_metrics(prefill.configs[0], types, ["engine"], {0: ["0"]})
        for payload in prefill.stats:
            prom.observe(payload, 0)
        assert registry.get_sample_value("vllm:kvproto_num_kv_expired_reqs_total", {"engine": "0"}) == 1
        assert registry.get_sample_value("vllm:kvproto_rooms_failed_total",
                                         {"engine": "0", "side": "send", "code": "BOOTSTRAP_TIMEOUT"}) == 1
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


# --- topology ------------------------------------------------------------------------------------
def test_data_parallel_prefill_ranks_on_one_host_take_ports_of_their_own() -> None:
    """Two data-parallel prefill engines configured with the same ``bootstrap_port`` serve on
    ``bootstrap_port + DP index``; a decode takes requests from both, byte-exact."""
    port = free_port()
    while True:  # two free ports in a row
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    extra = {"bootstrap_port": port}
    dp = [Instance("kv_producer", extra=extra, engine="p", dp=(i, 2)) for i in range(2)]
    decode = Instance("kv_consumer", engine="d", extra={})
    try:
        prompts = {"dp0": list(range(1, 50)), "dp1": list(range(300, 380))}
        checked = checking(decode, prompts)
        for inst, rid in zip(dp, prompts):
            inst.add(rid, prompts[rid], 1, {"do_remote_decode": True})
        run_until(dp, lambda: all(r in i.finished for i, r in zip(dp, prompts)))
        params = {rid: kv_params(inst, rid) for inst, rid in zip(dp, prompts)}
        assert params["dp0"][BOOTSTRAP].endswith(f":{port}") and params["dp1"][BOOTSTRAP].endswith(f":{port + 1}")
        for rid in prompts:
            decode.add(rid, prompts[rid], 2, params[rid])
        run_until([*dp, decode], lambda: all(r in decode.finished for r in prompts) and not decode.busy()
                  and not any(i.busy() for i in dp))
        assert set(checked) == set(prompts)
        assert_empty(*dp, decode)
    finally:
        for inst in (*dp, decode):
            inst.close()


def test_kv_both_instances_prefill_for_each_other() -> None:
    """Two ``kv_both`` instances: each prefills a request for the other at the same time, by the
    request's ``kv_transfer_params``; both move byte-exact."""
    a = Instance("kv_both", extra={"bootstrap_port": free_port()}, engine="a", batch_tokens=48)
    b = Instance("kv_both", extra={"bootstrap_port": free_port()}, engine="b", batch_tokens=48)
    try:
        prompts = {"a-to-b": list(range(1, 90)), "b-to-a": list(range(400, 470))}
        checked_b, checked_a = checking(b, {"a-to-b": prompts["a-to-b"]}), checking(a, {"b-to-a": prompts["b-to-a"]})
        a.add("a-to-b", prompts["a-to-b"], 1, {"do_remote_decode": True})
        b.add("b-to-a", prompts["b-to-a"], 1, {"do_remote_decode": True})
        run_until([a, b], lambda: "a-to-b" in a.finished and "b-to-a" in b.finished)
        b.add("a-to-b", prompts["a-to-b"], 3, kv_params(a, "a-to-b"))
        a.add("b-to-a", prompts["b-to-a"], 3, kv_params(b, "b-to-a"))
        run_until([a, b], lambda: "a-to-b" in b.finished and "b-to-a" in a.finished and not a.busy() and not b.busy())
        assert set(checked_b) == {"a-to-b"} and set(checked_a) == {"b-to-a"}
        assert len(b.outputs["a-to-b"]) == 3 and len(a.outputs["b-to-a"]) == 3
        assert_empty(a, b)
    finally:
        a.close()
        b.close()


# --- the concurrent proxy flow -------------------------------------------------------------------
def test_concurrent_proxy_flow_opens_the_decode_room_before_the_prefill_forward() -> None:
    """The proxy picks the room id and sends the request to both instances at once: the decode
    opens the room and gives its blocks before the prefill has scheduled the request (its
    transfer request waits, parked, at the prefill), and the prefill's layers land in the
    decode's blocks while its chunked prefill still runs, before the prefill request finishes."""
    port = free_port()
    prefill = Instance("kv_producer", extra={"bootstrap_port": port}, engine="p", batch_tokens=48, lag=0.005)
    decode = Instance("kv_consumer", extra={}, engine="d")
    try:
        room, prompt = 0x5EED, list(range(1, 220))
        checked = checking(decode, {"c": prompt})
        decode.add("c", prompt, 3, {"do_remote_prefill": True, ROOM: room,
                                    BOOTSTRAP: Settings(bootstrap_port=port).bootstrap_address()})
        for _ in range(3):
            decode.step()
        assert any(r.room == room for m in decode.metas for r in m.recvs), "the decode gave its blocks"
        core = decode.workers[0]._worker.decode._endpoint.core
        prefill.add("c", prompt, 1, {"do_remote_decode": True, ROOM: room})
        landed_during_prefill = 0
        while "c" not in prefill.finished:
            prefill.step()
            decode.step()
            time.sleep(0.01)
            r = core.rooms.get(room)
            if "c" not in prefill.finished and r is not None:
                landed_during_prefill = max(landed_during_prefill, sum(len(w.seqs) for w in r.writers.values()))
        assert landed_during_prefill > 0, "no layer landed while the prefill computed the prompt"
        run_until([prefill, decode], lambda: "c" in decode.finished and not decode.busy() and not prefill.busy())
        assert set(checked) == {"c"} and len(decode.outputs["c"]) == 3
        assert kv_params(prefill, "c")[ROOM] == room
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_a_preempted_prefill_request_still_hands_its_kv_over() -> None:
    """The prefill runs out of blocks for two long prompts computed side by side (32 tokens of each
    per step), and vLLM preempts one mid-prompt, freeing the blocks its room read: that room is
    aborted at once and the resumed request opens a fresh one, which its finished output names;
    the decode receives both byte-exact, and the preemption is counted in vLLM's stats."""
    port = free_port()
    prefill = Instance("kv_producer", extra={"bootstrap_port": port}, engine="p", blocks=14, batch_tokens=64,
                       chunk_tokens=32, log_stats=True)
    decode = Instance("kv_consumer", extra={}, engine="d")
    try:
        rng = random.Random(7)
        prompts = {"x": [rng.randrange(1, 999) for _ in range(150)], "y": [rng.randrange(1, 999) for _ in range(150)]}
        checked = checking(decode, prompts)
        for rid, prompt in prompts.items():
            prefill.add(rid, prompt, 1, {"do_remote_decode": True})
        forwarded: set[str] = set()

        def proxy() -> bool:
            for rid in set(prefill.finished) - forwarded:
                forwarded.add(rid)
                decode.add(rid, prompts[rid], 2, kv_params(prefill, rid))
            return len(decode.finished) == 2 and not prefill.busy() and not decode.busy()

        run_until([prefill, decode], proxy)
        preempted = [a for m in prefill.metas for a in m.aborts if "preempted" in a.reason]
        assert len(preempted) >= 1, "vLLM preempted neither request: the scenario needs fewer blocks"
        assert sum(len(p.get("preempted", ())) for p in prefill.stats) == len(preempted)
        lost = preempted[0]
        params = kv_params(prefill, lost.req_id)
        assert ERROR not in params and int(params[ROOM]) != lost.room, "the resumed request names a fresh room"
        assert set(checked) == set(prompts)
        assert_empty(prefill, decode)
    finally:
        prefill.close()
        decode.close()
