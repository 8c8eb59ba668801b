"""The concurrent-flow proxy (``examples/vllm_proxy.py``) against two stand-in vLLM servers on
loopback: both get the request at once with the same room, the decode's response reaches the client
byte for byte."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from examples import http
from examples.vllm_proxy import BOOTSTRAP, ROOM, Decode, Prefill, Proxy, plan

pytestmark = pytest.mark.timeout(60)


def test_plan_sends_one_token_to_the_prefill_and_the_room_to_both() -> None:
    """The prefill gets ``max_tokens`` 1, no streaming, ``do_remote_decode`` and the room; the decode
    gets the client's body with ``do_remote_prefill``, the room and the prefill's bootstrap address."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 30, "max_completion_tokens": 30, "stream": True,
            "stream_options": {"include_usage": True}}
    to_prefill, to_decode = plan(body, 77, "tcp://p:17557")
    assert to_prefill == {"model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1,
                          "kv_transfer_params": {"do_remote_decode": True, ROOM: 77}}
    assert to_decode == {**body, "kv_transfer_params": {"do_remote_prefill": True, ROOM: 77,
                                                        BOOTSTRAP: "tcp://p:17557"}}


@pytest.mark.asyncio
async def test_proxy_sends_to_both_at_once_and_relays_the_decodes_stream() -> None:
    """The stand-in prefill answers only once the decode's request has arrived (a sequential proxy
    would wait for it forever); the client gets the decode's streamed bytes unchanged."""
    seen: dict[str, dict[str, Any]] = {}
    decode_arrived = asyncio.Event()
    sse = b"data: {\"text\": \"a\"}\n\ndata: {\"text\": \"b\"}\n\ndata: [DONE]\n\n"

    async def prefill_server(request: http.Request) -> None:
        seen["prefill"] = request.json()
        await asyncio.wait_for(decode_arrived.wait(), 10)
        await request.reply(200, {"choices": [{"text": "x"}], "kv_transfer_params": {}})

    async def decode_server(request: http.Request) -> None:
        seen["decode"] = request.json()
        decode_arrived.set()
        request.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + sse)
        await request.writer.drain()

    p = await http.serve("127.0.0.1", 0, prefill_server)
    d = await http.serve("127.0.0.1", 0, decode_server)
    proxy = Proxy([Prefill("127.0.0.1", p.sockets[0].getsockname()[1], "tcp://127.0.0.1:17557")],
                  [Decode("127.0.0.1", d.sockets[0].getsockname()[1])])
    front = await http.serve("127.0.0.1", 0, proxy.handle)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", front.sockets[0].getsockname()[1])
        data = json.dumps({"prompt": "hello", "max_tokens": 8, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        assert answer.endswith(sse) and answer.startswith(b"HTTP/1.1 200 OK")
        room = seen["prefill"]["kv_transfer_params"][ROOM]
        assert seen["decode"]["kv_transfer_params"] == {"do_remote_prefill": True, ROOM: room,
                                                        BOOTSTRAP: "tcp://127.0.0.1:17557"}
        assert seen["prefill"]["max_tokens"] == 1 and seen["decode"]["max_tokens"] == 8
    finally:
        for server in (front, p, d):
            server.close()
            await server.wait_closed()
