"""A TCP port for a test's server to bind later.

Binding port 0 gives a port of the kernel's ephemeral range, and between that call and the
server's own bind any outgoing connection (a ZMQ or UCX connect of the same test) may take it as
its source port: a CI run failed so, "Address already in use". ``free_port`` picks a port below
that range, which only a bind takes, and checks that it binds now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` below the ephemeral range that nothing holds now."""
    low = int(_RANGE.read_text().split()[0]) if _RANGE.exists() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host}")
