"""Two hosts on one Linux machine: network namespaces joined by a veth pair.

Theory of operation
-------------------
``TwoHosts.create()`` makes two network namespaces, each with its own loopback and one end of
a veth pair, addressed ``10.X.Y.1/24`` and ``10.X.Y.2/24`` (X, Y random, so concurrent runs do
not meet). A process enters one with ``enter(name)`` before it opens any socket; threads it
starts later (ZMQ's, UCX's) inherit the namespace. Between the two the only route is the veth
pair, so nothing travels over 127.0.0.1, and ``link(False)`` cuts it the way a pulled cable
does: packets are dropped, no connection is reset.

The namespaces share the machine's memory and file system, which real hosts do not: a data
plane that would take a same-host shortcut must be told not to (for NIXL, ``UCX_TLS=tcp``;
``HOST_ENV``). Needs root and ``ip`` (iproute2); ``unavailable()`` says why not otherwise.
``close()`` deletes both namespaces (the veth pair goes with them).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2
HOST_ENV = {"UCX_TLS": "tcp"}
"""Environment for processes on a simulated host: UCX over TCP only (no shared-memory or
cross-memory-attach shortcut between namespaces)."""


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"kvprobe{random.randrange(1 << 24):06x}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def enter(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into namespace ``name``, as
    ``ip netns exec`` does: the network namespace, and a private mount of ``/sys`` that shows
    that namespace's interfaces (UCX lists interfaces from ``/sys/class/net``)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ok: bool, what: str) -> None:
        if not ok:
            err = ctypes.get_errno()
            raise OSError(err, f"entering network namespace {name!r}: {what}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET) == 0, "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS) == 0, "unshare the mount namespace")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) == 0, "make / a slave mount")
    check(libc.umount2(b"/sys", MNT_DETACH) == 0, "unmount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None) == 0, "mount sysfs")


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@dataclass
class TwoHosts:
    """Namespaces ``a`` and ``b`` with addresses ``a_addr``/``b_addr`` on veth ``a_dev``/``b_dev``."""

    a: str
    b: str
    a_addr: str
    b_addr: str
    a_dev: str
    b_dev: str

    @classmethod
    def create(cls) -> TwoHosts:
        tag = f"{random.randrange(1 << 24):06x}"
        net = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
        hosts = cls(f"kvproto-{tag}-a", f"kvproto-{tag}-b", f"{net}.1", f"{net}.2", f"kv{tag}a", f"kv{tag}b")
        try:
            _ip("netns", "add", hosts.a)
            _ip("netns", "add", hosts.b)
            _ip("link", "add", hosts.a_dev, "type", "veth", "peer", "name", hosts.b_dev)
            for ns, dev, addr in ((hosts.a, hosts.a_dev, hosts.a_addr), (hosts.b, hosts.b_dev, hosts.b_addr)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            hosts.close()
            raise
        return hosts

    def link(self, up: bool) -> None:
        """Bring host a's end of the wire up or down (a cut: packets dropped, nothing reset)."""
        _ip("-n", self.a, "link", "set", self.a_dev, "up" if up else "down")

    def tx_bytes(self) -> int:
        """Bytes host a has sent into the wire so far."""
        out = subprocess.run(["ip", "netns", "exec", self.a, "cat", f"/sys/class/net/{self.a_dev}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True)
        return int(out.stdout)

    def close(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
