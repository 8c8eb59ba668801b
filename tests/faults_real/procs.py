"""Ranks for the real-fault tests: one endpoint, its CPU cache and the reference content.

Theory of operation
-------------------
A ``Rank`` is one prefill or decode endpoint over a ``kvproto.demo._Cache``: its pages are
filled (prefill) and checked (decode) against ``kvproto.demo.Content``, a pure function of
(room, layer, plane, head, token, byte), so two processes agree on every byte without sharing
anything but the room ids. A room is ``(room_id, num_tokens)``; every room moves in one chunk
(plus its aux slot, when a slot is free on both sides).

A rank runs either in the test's own event loop or in a child process started with the
``spawn`` method (``Child``), where ``child_main`` serves commands from a pipe: each command is
``(method name, *args)`` of ``Rank`` and is answered ``("ok", result)`` or ``("error", text)``.
The tests kill children with SIGKILL (and stop them with SIGSTOP) to make real faults: a dead
process's sockets and NIXL agent vanish without a word, as in a crash.

Times (``ended``) are ``time.monotonic()`` values, comparable across processes of one machine.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

# Small enough for CI; direct path (both sides share the geometry); content checked per byte.
SMALL = dict(layers=2, kv_heads=2, head_dim=16, dtype="bf16", prefill_block=16, decode_block=16, blocks=256,
             aux_bytes=16, transport="nixl", seed=3)
# Large pages (64 tokens x 8 heads x 128 x bf16 = 128 KiB per page and region, 8 regions):
# a 1,024-token room is one 16 MiB write.
BIG = dict(layers=4, kv_heads=8, head_dim=128, dtype="bf16", prefill_block=64, decode_block=64, blocks=320,
           aux_bytes=16, transport="nixl", seed=5)


@dataclass(frozen=True)
class RankSpec:
    role: str
    """``prefill`` or ``decode``."""
    demo: dict[str, Any] = field(default_factory=lambda: dict(SMALL))
    """``kvproto.demo.DemoConfig`` fields: geometry, transport, content seed."""
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.0
    instance: str | None = None
    aux_slots: int = 32
    room_timeout: float = 60.0
    """Every room deadline (bootstrap, waiting, transfer, parked): far beyond any test's wait."""
    netns: str | None = None
    """Network namespace the child process runs in (``kvproto.testing.netns``)."""
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    address: str | None = None
    """This host's address, for adapters that advertise one (``host_options``)."""
    curve: dict[str, tuple[bytes, bytes]] | None = None
    """``{"server": (public, secret), "client": (public, secret)}``: CURVE on the control plane."""


@dataclass
class _Room:
    handle: Any
    pages: list[int]
    num_tokens: int
    slot: int | None


class Rank:
    """One endpoint and its cache; the methods are the commands a child process serves."""

    def __init__(self, spec: RankSpec) -> None:
        import torch

        from kvproto.demo import DemoConfig, _Cache

        self.spec = spec
        self.torch = torch
        self.cfg = DemoConfig(**spec.demo)
        block = self.cfg.prefill_block if spec.role == "prefill" else self.cfg.decode_block
        self.cache = _Cache(torch, self.cfg, tp=1, rank=0, block=block, layout="NHD", aux_slots=spec.aux_slots)
        self.block = block
        self.slots = list(range(spec.aux_slots))
        self.rooms: dict[int, _Room] = {}
        self.ep: Any = None

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self, port: int = 0) -> dict[str, Any]:
        from kvproto.aio import CurveAuth, DecodeEndpoint, EndpointConfig, PrefillEndpoint
        from kvproto.core import Timeouts
        from kvproto.transport import host_options

        t = self.spec.room_timeout
        keys = self.spec.curve
        curve = None
        if keys and self.spec.role == "prefill":
            curve = CurveAuth(public_key=keys["server"][0], secret_key=keys["server"][1],
                              allowed=frozenset({keys["client"][0]}))
        elif keys:
            curve = CurveAuth(public_key=keys["client"][0], secret_key=keys["client"][1], server_key=keys["server"][0])
        config = EndpointConfig(
            transport=self.cfg.transport, port=port, instance=self.spec.instance, model_id="faults-real",
            heartbeat_interval=self.spec.heartbeat_interval, heartbeat_timeout=self.spec.heartbeat_timeout,
            staging_bytes=0, timeouts=Timeouts(bootstrap=t, waiting=t, transfer=t, parked=t, max_hold=t),
            host=self.spec.host, advertise_host=self.spec.advertise_host, curve=curve,
            transport_options=host_options(self.cfg.transport, self.spec.address) if self.spec.address else {},
        )
        cls = PrefillEndpoint if self.spec.role == "prefill" else DecodeEndpoint
        self.ep = cls(self.cache.kv, config=config)
        await self.ep.start()
        return self.info()

    def ping(self) -> int:
        return os.getpid()

    def info(self) -> dict[str, Any]:
        ep = self.ep
        return dict(address=getattr(ep, "address", ""), agent=ep.agent_name, boot_id=ep.boot_id, pid=os.getpid())

    async def close(self) -> dict[str, Any]:
        await self.ep.close()
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """What the endpoint still holds: links, pending writes, transport peers and handles."""
        ep = self.ep
        transport = ep.transport
        peers = getattr(transport, "_peers", ())
        return dict(
            links=len(ep._links), pending=len(getattr(ep, "_pending", ())), peers=sorted(peers),
            xfers=len(getattr(transport, "_xfers", ())), errors=ep.errors, rooms=len(ep.core.rooms),
            handles=len(ep._handles),
        )

    # --- rooms ------------------------------------------------------------------------------------
    def _take(self, num_tokens: int) -> tuple[list[int], int | None]:
        pages = self.cache.take(-(-num_tokens // self.block))
        slot = self.slots.pop() if self.slots else None
        return pages, slot

    def open(self, rooms: list[tuple[int, int]], bootstrap: str = "", send: bool = False,
             destination: bool = True) -> int:
        """Open rooms: prefill fills their pages (and sends them if ``send``); decode gives the
        destination at once (unless not ``destination``: ``set_destination`` later). Returns
        the number of rooms opened."""
        for room_id, n in rooms:
            pages, slot = self._take(n)
            if self.spec.role == "prefill":
                self.cache.fill(room_id, pages, 0, n)
                if slot is not None:
                    self.cache.aux[slot] = self._aux(room_id)
                handle = self.ep.open_room(room_id)
            elif destination:
                handle = self.ep.open_room(room_id, bootstrap, pages=pages, num_tokens=n, aux_slot=slot)
            else:
                handle = self.ep.open_room(room_id, bootstrap)
            self.rooms[room_id] = _Room(handle, pages, n, slot)
        if send:
            self.send([r for r, _ in rooms])
        return len(rooms)

    def set_destination(self, room_ids: list[int]) -> None:
        """Decode: give rooms opened without a destination their pages."""
        for room_id in room_ids:
            room = self.rooms[room_id]
            room.handle.set_destination(room.pages, room.num_tokens, aux_slot=room.slot)

    def send(self, room_ids: list[int]) -> int:
        """Prefill: submit every room's KV as one last chunk. Returns the writes now pending."""
        for room_id in room_ids:
            room = self.rooms[room_id]
            room.handle.send(room.pages, room.num_tokens, last=True, aux_slot=room.slot)
        return len(self.ep._pending)

    def abort(self, room_ids: list[int]) -> None:
        for room_id in room_ids:
            self.rooms[room_id].handle.abort()

    def states(self, room_ids: list[int]) -> dict[int, int]:
        return {r: int(self.rooms[r].handle.poll()) for r in room_ids}

    async def wait(self, room_ids: list[int], timeout: float) -> dict[int, dict[str, Any]]:
        """Wait up to ``timeout`` for the rooms to end; report each (decode: its bad bytes).
        Rooms that ended give their pages back."""
        handles = [self.rooms[r].handle for r in room_ids]
        try:
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles), return_exceptions=True), timeout)
        except asyncio.TimeoutError:
            pass
        out = {}
        for room_id, handle in zip(room_ids, handles):
            room = self.rooms[room_id]
            state = int(handle.poll())
            bad = None
            if self.spec.role == "decode" and state == 4:
                bad = self.cache.check(room_id, room.pages, room.num_tokens)
                if room.slot is not None and not self.torch.equal(self.cache.aux[room.slot], self._aux(room_id)):
                    bad += 1
            code = handle.code
            out[room_id] = dict(state=state, code=None if code is None else int(code), reason=handle.reason,
                                ended=handle.stats.ended, bad=bad, aux=room.slot is not None)
            if handle.done:
                self.cache.give(room.pages)
                if room.slot is not None:
                    self.slots.append(room.slot)
                del self.rooms[room_id]
        return out

    def _aux(self, room_id: int) -> Any:
        from kvproto.demo import aux_bytes

        return aux_bytes(self.torch, room_id, self.cfg.aux_bytes)


# --- child processes --------------------------------------------------------------------------------


def child_main(spec: RankSpec, conn: Any) -> None:
    if spec.netns:  # before any socket or thread: everything the rank starts lives there
        from kvproto.testing import netns

        netns.enter(spec.netns)
        os.environ.update(netns.HOST_ENV)
    import torch

    torch.set_num_threads(1)
    asyncio.run(_serve(spec, conn))


async def _serve(spec: RankSpec, conn: Any) -> None:
    rank = Rank(spec)
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Any] = asyncio.Queue()

    def readable() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(("_exit",))

    loop.add_reader(conn.fileno(), readable)
    conn.send(("ok", "spawned"))
    while True:
        name, *args = await inbox.get()
        if name == "_exit":
            os._exit(0)  # the test process is gone
        try:
            result = getattr(rank, name)(*args)
            if asyncio.iscoroutine(result):
                result = await result
        except Exception as exc:  # reported to the test, which fails
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))
        if name == "close":
            loop.remove_reader(conn.fileno())
            conn.close()
            return


class ChildDied(RuntimeError):
    pass


class Child:
    """A rank in a process of its own (``spawn``); commands go through a pipe."""

    def __init__(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(spec, child_conn), daemon=True,
                                name=f"faults-{spec.role}")
        self.proc.start()
        child_conn.close()
        self.spawned = False

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def _reply(self) -> Any:
        try:
            status, result = self.conn.recv()
        except EOFError:
            raise ChildDied(f"{self.proc.name} died (exit code {self.proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"{self.proc.name}: {result}")
        return result

    async def _ready(self, deadline: float) -> None:
        if not self.spawned:
            await self._await_reply(deadline)  # the child's "spawned" greeting
            self.spawned = True

    async def _await_reply(self, deadline: float) -> Any:
        while not self.conn.poll():
            if not self.proc.is_alive():
                raise ChildDied(f"{self.proc.name} died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.proc.name} did not answer in time")
            await asyncio.sleep(0.005)
        return self._reply()

    async def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        await self._ready(deadline + 60.0)  # the first call also waits for the interpreter to start
        self.conn.send((name, *args))
        return await self._await_reply(deadline)

    def call_blocking(self, name: str, *args: Any, timeout: float = 30.0) -> Any:
        """A command while the caller's event loop does not run (its endpoints stand still)."""
        assert self.spawned, "use call() first"
        self.conn.send((name, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name} did not answer in time")
        return self._reply()

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill."""
        os.kill(self.pid, signal.SIGKILL)
        t = time.monotonic()
        self.proc.join(10)
        return t

    def reap(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()
        self.proc.close()


async def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> float:
    """Poll ``predicate()`` (awaited if it is a coroutine function's result) until true; returns
    the monotonic time it became true. Fails with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
