"""Control sockets driven by the event loop's reader callbacks, without a future per frame.

Theory of operation
-------------------
A ``Channel`` owns one ZMQ socket of an endpoint. Instead of a task awaiting ``recv`` (pyzmq's
asyncio sockets create and resolve a future, and schedule callbacks, for every frame), the
channel registers the socket's file descriptor with the event loop and, when it becomes
readable, drains the socket with non-blocking receives on a synchronous *shadow* of the same
socket, handing each message to ``on_message``. One callback handles at most ``BATCH``
messages and then yields to the loop (it reschedules itself), so a burst of frames never holds
the loop for long: the serving loop's other coroutines keep their latency.

ZMQ's descriptor is edge-triggered and shared by sends and receives: after any send, or a
drain that stopped at ``BATCH``, input may be pending without the descriptor firing again. The
channel therefore checks ``EVENTS`` after every send and reschedules its drain when input is
waiting; a drain that empties the socket has consumed the edge, and the next message fires it
again.

Sends never block. Control sockets are made by ``control_socket``, with no high-water mark:
ZMQ's default of 1,000 messages per peer dropped frames when a decode rank opened a thousand
rooms at once (their requests and holds queued behind the link), and a room whose request was
dropped waited for its transfer deadline. Frames are small, so they queue in memory instead. A
send ZMQ still refuses drops the frame with a warning (the protocol's deadlines turn a lost
frame into a failed room, never a hang). Every call happens on the loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger("kvproto")

BATCH = 64
"""Messages one reader callback handles before yielding to the loop."""


def control_socket(ctx: zmq.Context, kind: int, linger: int) -> zmq.Socket:
    """A control socket of ``kind`` (ROUTER, DEALER) whose queues never drop a frame (module
    docstring); made before it binds or connects, where the marks take effect."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class Channel:
    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[list[bytes]], None]) -> None:
        self.sock = sock
        self._sync = zmq.Socket.shadow(sock.underlying)
        self._loop = loop
        self._on_message = on_message
        self._fd = self._sync.getsockopt(zmq.FD)
        self._scheduled = False
        self.closed = False
        loop.add_reader(self._fd, self._drain)
        self._schedule()  # anything queued before the reader was added

    def send(self, frames: list[bytes]) -> None:
        if self.closed:
            return
        try:
            self._sync.send_multipart(frames, flags=zmq.DONTWAIT)
        except zmq.Again:
            log.warning("control socket queue full: dropped a frame")
        except zmq.ZMQError as exc:
            log.warning("control send failed: %s", exc)
        else:
            self._check_input()

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        self.sock.close(linger=linger)

    def _check_input(self) -> None:
        try:
            if self._sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._schedule()
        except zmq.ZMQError:
            pass

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        for _ in range(BATCH):
            if self.closed:
                return
            try:
                frames = self._sync.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # the context is terminating
                log.debug("control receive stopped: %s", exc)
                return
            self._on_message(frames)
        self._schedule()  # more may be waiting: continue after the loop's other work
