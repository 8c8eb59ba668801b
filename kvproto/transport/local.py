"""What adapters of one host share: the host's identity and a tag channel between processes.

Theory of operation
-------------------
``host_id()`` names this machine (host name and kernel boot id): two agents whose metadata carry
the same id run on one host, where memory can be shared (CUDA IPC) and tags can take a local
socket. ``TagChannel`` is that socket: a non-blocking UNIX datagram socket in the abstract
namespace (Linux), one per agent, whose address travels in the agent's metadata. A tag is one
``sendto`` (microseconds), arrives in order, and turns the receiver's descriptor readable, which
an endpoint watches (``Transport.wakeup_fd``) so that a waiting rank wakes at once. The kernel
attaches each sender's credentials; datagrams from another user are dropped and counted.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import sys

from kvproto.transport.base import Notification

_HOST_ID: str | None = None


def host_id() -> str:
    """This machine's identity for the same-host test: host name and kernel boot id."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        _HOST_ID = f"{socket.gethostname()}/{boot}"
    return _HOST_ID


class TagChannel:
    """A non-blocking UNIX datagram socket in the abstract namespace (Linux): a kernel write's tag
    reaches a mapped peer in one ``sendto`` (microseconds) and wakes its event loop through
    ``fileno()`` (``wakeup_fd``), instead of a round through the fallback's progress engine. The
    kernel attaches each sender's credentials; datagrams from another user are dropped. Not
    available (``address`` None) where the platform has no abstract sockets."""

    HEADER = struct.Struct("<H")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.address: str | None = None
        self.dropped = 0
        """Datagrams refused: from another user, or malformed."""
        if not sys.platform.startswith("linux"):
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            address = f"\0kvproto-cuda-ipc/{os.getpid()}/{secrets.token_hex(8)}"
            sock.bind(address)
        except OSError:
            sock.close()
            return
        self.sock, self.address = sock, address

    def send(self, address: str, sender: bytes, tag: bytes) -> bool:
        """Send; False when the peer's queue is full (try again later). Raises ``OSError`` when the
        peer cannot be reached at all."""
        assert self.sock is not None
        try:
            self.sock.sendto(self.HEADER.pack(len(sender)) + sender + tag, address)
        except BlockingIOError:
            return False
        return True

    def drain(self) -> list[Notification]:
        if self.sock is None:
            return []
        out = []
        space = socket.CMSG_SPACE(struct.calcsize("3i"))
        uid = os.getuid()
        while True:
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(65536, space)
            except (BlockingIOError, InterruptedError):
                return out
            creds = next((struct.unpack("3i", d[:12]) for level, kind, d in ancdata
                          if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            if creds is None or creds[1] != uid or len(data) < 2:
                self.dropped += 1
                continue
            (n,) = self.HEADER.unpack_from(data)
            name, tag = data[2:2 + n], data[2 + n:]
            if len(name) != n or not tag:
                self.dropped += 1
                continue
            out.append(Notification(name.decode(errors="replace"), bytes(tag)))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
