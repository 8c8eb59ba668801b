"""Just enough HTTP/1.1 on asyncio streams for the example servers: JSON requests, JSON or
newline-delimited JSON (chunked) responses, one request per connection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

Handler = Callable[["Request"], Awaitable[None]]


class Request:
    def __init__(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        self.method, self.path, self.body, self.writer = method, path, body, writer
        self._streaming = False

    def json(self) -> Any:
        return json.loads(self.body or b"{}")

    async def reply(self, status: int, payload: Any, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        head = (f"HTTP/1.1 {status} {'OK' if status < 400 else 'Error'}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
        self.writer.write(head.encode() + data)
        await self.writer.drain()

    async def stream(self, line: Any) -> None:
        """Send one JSON line of a chunked response (the first call sends the headers)."""
        if not self._streaming:
            self._streaming = True
            self.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                              b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        data = json.dumps(line).encode() + b"\n"
        self.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await self.writer.drain()

    async def end_stream(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


async def serve(host: str, port: int, handler: Handler) -> asyncio.AbstractServer:
    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return
            method, path, _ = line.decode().split(" ", 2)
            length = 0
            while True:
                header = await reader.readline()
                if header in (b"\r\n", b"\n", b""):
                    break
                name, _, value = header.decode().partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            await handler(Request(method, path, body, writer))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(on_connection, host, port)


async def _send(host: str, port: int, method: str, path: str, payload: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode() if payload is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


async def _headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return status, headers
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()


async def call(host: str, port: int, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
    """One request; (status, decoded JSON body, or text for other content types)."""
    reader, writer = await _send(host, port, method, path, payload)
    try:
        status, headers = await _headers(reader)
        body = await reader.read()
        if headers.get("content-type", "").startswith("application/json"):
            return status, json.loads(body or b"null")
        return status, body.decode()
    finally:
        writer.close()


async def lines(host: str, port: int, method: str, path: str, payload: Any = None) -> AsyncIterator[Any]:
    """The JSON lines of a streamed (chunked) response, as they arrive."""
    reader, writer = await _send(host, port, method, path, payload)
    try:
        status, headers = await _headers(reader)
        if headers.get("transfer-encoding") != "chunked":
            body = await reader.read()
            yield json.loads(body) if body else {"error": f"HTTP {status}"}
            return
        buffered = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                break
            buffered += await reader.readexactly(size)
            await reader.readexactly(2)
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                yield json.loads(line)
    finally:
        writer.close()
