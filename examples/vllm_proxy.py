"""A proxy for vLLM instances joined by kvproto's connector, sending each request to a prefill
and a decode instance at once.

Theory of operation
-------------------
vLLM's usual proxy is sequential: the prompt goes to a prefill instance (one output token), and
only once it has finished does the request go to a decode instance with the ``kv_transfer_params``
the prefill returned. With kvproto the decode can take part from the start, because the proxy can
name the room itself (as SGLang's router names ``bootstrap_room``):

1. pick a room id (random, 63 bits) and a prefill and a decode instance (round robin);
2. send, at the same moment, the request to the prefill with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true, "kvproto_room": R}``, and to the decode with
   ``{"do_remote_prefill": true, "kvproto_room": R, "kvproto_bootstrap": <that prefill's kvproto
   bootstrap address>}``;
3. relay the decode's response to the client byte for byte (streamed or not); drop the prefill's.

The decode's connector opens room R as the request arrives and gives its blocks as soon as vLLM
allocates them; its transfer request waits at the prefill (parked) until the prefill schedules
the request, so the prefill writes each layer of each chunk into the decode's blocks as its
forward computes it, instead of after the whole prompt. If the prefill fails, the decode's room
fails and vLLM follows the decode's ``kv_load_failure_policy`` (``recompute``: it computes the
prompt itself), so the client still gets an answer or a plain error.

Run::

    python -m examples.vllm_proxy --port 8000 \\
        --prefill http://prefill-1:8100=tcp://prefill-1:17557 --decode http://decode-1:8200

(each ``--prefill`` names the instance's HTTP address and its kvproto bootstrap address: its
``advertise_host`` and ``bootstrap_port`` plus its DP rank). Standard library only; ``examples.http``
reads the client's request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from examples import http

log = logging.getLogger("kvproto.proxy")

ROOM, BOOTSTRAP = "kvproto_room", "kvproto_bootstrap"


@dataclass(frozen=True)
class Prefill:
    host: str
    port: int
    bootstrap: str
    """The instance's kvproto bootstrap address (``tcp://host:port``)."""


@dataclass(frozen=True)
class Decode:
    host: str
    port: int


def plan(body: dict[str, Any], room: int, bootstrap: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bodies of the prefill's and the decode's request for one client request."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True, ROOM: room})
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    decode = dict(body, kv_transfer_params={"do_remote_prefill": True, ROOM: room, BOOTSTRAP: bootstrap})
    return prefill, decode


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "127.0.0.1", parts.port or 80


class Proxy:
    def __init__(self, prefills: list[Prefill], decodes: list[Decode]) -> None:
        if not prefills or not decodes:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self._prefills = itertools.cycle(prefills)
        self._decodes = itertools.cycle(decodes)

    async def handle(self, request: http.Request) -> None:
        if request.method != "POST":
            await request.reply(404, {"error": f"{request.method} {request.path}: only POST is proxied"})
            return
        try:
            body = request.json()
        except json.JSONDecodeError as exc:
            await request.reply(400, {"error": f"the request body is not JSON: {exc}"})
            return
        prefill, decode = next(self._prefills), next(self._decodes)
        room = secrets.randbits(63) or 1
        to_prefill, to_decode = plan(body, room, prefill.bootstrap)
        prefilling = asyncio.ensure_future(self._prefill(prefill, request.path, to_prefill, room))
        try:
            await self._relay(decode, request, to_decode)
        finally:
            await prefilling

    @staticmethod
    async def _prefill(prefill: Prefill, path: str, body: dict[str, Any], room: int) -> None:
        try:
            status, answer = await http.call(prefill.host, prefill.port, "POST", path, body)
        except OSError as exc:
            log.warning("room %d: prefill %s:%d unreachable (%s); the decode computes the prompt", room,
                        prefill.host, prefill.port, exc)
            return
        if status >= 400:
            log.warning("room %d: prefill answered %d: %s", room, status, answer)

    @staticmethod
    async def _relay(decode: Decode, request: http.Request, body: dict[str, Any]) -> None:
        """The decode's whole response (status line, headers, body) to the client, unchanged."""
        data = json.dumps(body).encode()
        try:
            reader, writer = await asyncio.open_connection(decode.host, decode.port)
        except OSError as exc:
            await request.reply(502, {"error": f"decode {decode.host}:{decode.port} unreachable: {exc}"})
            return
        try:
            writer.write(f"POST {request.path} HTTP/1.1\r\nHost: {decode.host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
            await writer.drain()
            while chunk := await reader.read(1 << 16):
                request.writer.write(chunk)
                await request.writer.drain()
        finally:
            writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL=BOOTSTRAP",
                        help="a prefill instance: its HTTP address and its kvproto bootstrap address")
    parser.add_argument("--decode", action="append", required=True, metavar="URL")
    args = parser.parse_args()
    prefills = []
    for spec in args.prefill:
        url, _, bootstrap = spec.partition("=")
        if not bootstrap:
            parser.error(f"--prefill {spec}: give URL=BOOTSTRAP, e.g. http://p1:8100=tcp://p1:17557")
        prefills.append(Prefill(*_address(url), bootstrap))
    proxy = Proxy(prefills, [Decode(*_address(url)) for url in args.decode])
    logging.basicConfig(level=logging.INFO)

    async def run() -> None:
        server = await http.serve(args.host, args.port, proxy.handle)
        log.info("proxy on %s:%d: %d prefill, %d decode instances", args.host, args.port, len(prefills),
                 len(args.decode))
        async with server:
            await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
