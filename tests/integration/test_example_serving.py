"""The serving-loop example end to end: every rank a process, requests through the router, and
the disaggregated tokens equal to the single-process model's, token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

import pytest

from examples.http import call, lines
from examples.model import encode, generate
from examples.serve import Running, ServeConfig, run_router, start

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BASE = ServeConfig(chunk=16, blocks=256, heartbeat_timeout=1.0, room_timeout=20.0)
PROMPTS = ["Hello, world", "The quick brown fox jumps over the lazy dog.", "kvproto", "a" * 45]
MAX_NEW = 8


async def ask(port: int, prompt: str, max_tokens: int = MAX_NEW, **extra: Any) -> dict[str, Any]:
    last: dict[str, Any] = {}
    streamed = []
    async for line in lines("127.0.0.1", port, "POST", "/generate", {"prompt": prompt, "max_tokens": max_tokens,
                                                                       **extra}):
        if "token" in line:
            streamed.append(line["token"])
        last = line
    if "tokens" in last:
        assert last["tokens"] == streamed, "the stream and the summary disagree"
    return last


def serving(cfg: ServeConfig, body: Any) -> Any:
    """Start the set and a router, run ``body(running, router_port)``, stop everything."""
    running = start(cfg)

    async def main() -> Any:
        server = await run_router(running, "127.0.0.1", 0)
        try:
            return await body(running, server.sockets[0].getsockname()[1])
        finally:
            server.close()

    try:
        return asyncio.run(main())
    finally:
        running.stop()


def reference(prompt: str, cfg: ServeConfig, max_new: int = MAX_NEW) -> list[int]:
    return generate(encode(prompt), max_new, chunk=cfg.chunk, hybrid=cfg.hybrid)


@pytest.mark.parametrize("case", [
    dict(prefill_tp=2, decode_tp=1),
    dict(prefill_tp=1, decode_tp=2),
    dict(decode_block=32),
    dict(decode_layout="HND"),
    dict(prefill_tp=2, decode_tp=1, hybrid=True),
    dict(prefill_tp=1, decode_tp=2, decode_block=32, hybrid=True),
], ids=["P2-D1", "P1-D2", "block-16-to-32", "NHD-to-HND", "hybrid-P2-D1", "hybrid-P1-D2-block-16-to-32"])
def test_example_tokens_equal_monolithic(case: dict[str, Any]) -> None:
    """A batch of prompts (one of 3 prefill chunks) through the router: each stream's tokens are
    exactly the single-process model's, whatever the TP split, block size or layout of decode; the
    hybrid model's too (its linear layer's recurrent state moves in the room beside the pages)."""
    cfg = dataclasses.replace(BASE, **case)

    async def body(running: Running, port: int) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(ask(port, p) for p in PROMPTS)))

    results = serving(cfg, body)
    for prompt, result in zip(PROMPTS, results):
        assert result.get("tokens") == reference(prompt, cfg), (prompt, result)


def test_example_p1_d1_concurrency_chunks_prefix_hit_metrics_and_killed_prefill() -> None:
    """P1-D1: 32 concurrent requests all equal the reference; a 3-chunk prompt and a decode
    prefix hit (the decode computes the first 32 tokens itself, kvproto moves the rest) too;
    /metrics reports the rooms; then the prefill is killed: the next request gets an error line
    and the decode gives every page back."""
    cfg = BASE
    many = [f"request {i}: {'xyz' * (i % 7)}" for i in range(32)]
    long = "0123456789" * 4 + "abcdefgh"  # 48 tokens: 3 chunks of 16

    async def body(running: Running, port: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        started = time.monotonic()
        out["many"] = await asyncio.gather(*(ask(port, p) for p in many))
        out["many_s"] = time.monotonic() - started
        out["long"] = await ask(port, long)
        out["prefix"] = await ask(port, long, prefix=32)
        status, out["metrics"] = await call("127.0.0.1", port, "GET", "/metrics")
        assert status == 200
        for proc in running.prefill_procs[0]:
            os.kill(proc.pid, signal.SIGKILL)
        out["killed"] = await asyncio.wait_for(ask(port, "after the prefill died"), 30)
        deadline = time.monotonic() + 10
        while True:
            status, out["status"] = await call("127.0.0.1", running.decodes[0], "GET", "/status")
            if out["status"]["free_pages"] == out["status"]["total_pages"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        return out

    out = serving(cfg, body)
    for prompt, result in zip(many, out["many"]):
        assert result.get("tokens") == reference(prompt, cfg), (prompt, result)
    assert out["long"].get("tokens") == reference(long, cfg)
    assert out["prefix"].get("tokens") == reference(long, cfg)
    metrics = out["metrics"]
    assert 'kvproto_rooms_ended_total{agent="kvproto-decode' in metrics and 'state="SUCCESS"' in metrics
    assert "router_requests_total 34.0" in metrics
    assert "error" in out["killed"], out["killed"]
    assert out["status"]["free_pages"] == out["status"]["total_pages"], out["status"]
    print(f"32 concurrent requests through the router in {out['many_s']:.2f}s; killed prefill -> {out['killed']}")


def test_example_router_answers_bad_requests_400_at_once_and_opens_nothing() -> None:
    """A body that is not JSON, a prompt that is a number, a negative max_tokens: each gets a 400
    naming the problem at once (no room opened, no bootstrap timeout); then a good request works."""
    cfg = BASE

    async def body(running: Running, port: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, payload in (("not-json", b"{not json"), ("prompt-5", {"prompt": 5}),
                              ("max-tokens", {"prompt": "hi", "max_tokens": -3})):
            started = time.monotonic()
            out[name] = await call("127.0.0.1", port, "POST", "/generate", payload)
            out[name + "_s"] = time.monotonic() - started
        _, out["status"] = await call("127.0.0.1", running.decodes[0], "GET", "/status")
        out["good"] = await ask(port, "Hello, world")
        return out

    out = serving(cfg, body)
    for name, words in (("not-json", "not JSON"), ("prompt-5", '"prompt"'), ("max-tokens", '"max_tokens"')):
        status, answer = out[name]
        assert status == 400 and words in answer["error"], (name, out[name])
        assert out[name + "_s"] < 1.0, (name, out[name + "_s"])
    assert out["status"]["free_pages"] == out["status"]["total_pages"], out["status"]
    assert out["good"].get("tokens") == reference("Hello, world", cfg)
