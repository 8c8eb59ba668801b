"""A disaggregated serving set on kvproto: prefill servers, decode servers and a router.

    python -m examples.serve                 # 1 prefill (TP 1) + 1 decode (TP 1) + router on :8000
    python -m examples.serve --prefill-tp 2 --decode-tp 2 --port 8000
    curl -N localhost:8000/generate -d '{"prompt": "Hello, world", "max_tokens": 16}'
    curl localhost:8000/metrics

Theory of operation
-------------------
Every TP rank of every instance is a process. The ranks of one instance run the model in lockstep
(``examples.model``: each rank computes its KV-head groups, torch.distributed over gloo gathers
the groups' outputs); rank 0 of each instance also serves HTTP for the router.

* **Prefill (await style)**: an asyncio loop per rank with a ``PrefillEndpoint``. Rank 0 takes a
  request, hands it to the other ranks (broadcast), and every rank computes the prompt chunk by
  chunk, giving each chunk's pages to kvproto as soon as it is written (``room.send``), the first
  sampled token in the aux slot of the last; a coroutine per request awaits ``room.wait()`` and
  frees the pages.
* **Decode (step style)**: a synchronous scheduler loop per rank, driving kvproto through
  ``kvproto.sync.SyncDecode`` as SGLang's and vLLM's schedulers drive theirs. Each step rank 0
  decides (new requests, aborts) and tells the others; every rank opens receivers, polls its
  rooms, agrees with the others on which are done (all-reduce), reads the first token from the
  aux slot, and runs one greedy decode step per generating request. A request whose room fails
  gets an error and its pages back. Rank 0's HTTP server runs on the facade's event loop and
  streams tokens as the scheduler produces them.
* **Router**: takes ``POST /generate``, picks a prefill and a decode instance (round robin),
  gives them a fresh room id, and streams the decode's tokens back as JSON lines; if either side
  fails, the client gets an error line and the other side is told to abort.

Every server serves ``GET /metrics`` (kvproto's metrics and its own, Prometheus text) and
``GET /status`` (free pages, live requests); logs carry the room id.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from kvproto.options import add_options, option

log = logging.getLogger("examples.serve")


@dataclass(frozen=True)
class ServeConfig:
    """The serving set's settings; each is also its command-line flag (``kvproto.options``)."""

    prefill_tp: int = option(1, "TP ranks of each prefill instance (a process each)")
    decode_tp: int = option(1, "TP ranks of each decode instance (a process each)")
    prefill_instances: int = option(1, "prefill instances behind the router")
    decode_instances: int = option(1, "decode instances behind the router")
    prefill_block: int = option(16, "tokens per page on prefill")
    decode_block: int = option(16, "tokens per page on decode")
    prefill_layout: str = option("NHD", "prefill cache layout: NHD or HND")
    decode_layout: str = option("NHD", "decode cache layout: NHD or HND")
    chunk: int = option(64, "prefill chunk size in tokens (a multiple of both block sizes)")
    blocks: int = option(512, "pages of every rank's cache")
    transport: str = option("nixl", "kvproto's data-plane adapter, by name")
    host: str = option("127.0.0.1", "the router's address")
    port: int = option(8000, "the router's port")
    heartbeat_timeout: float = option(2.0, "seconds of a link's silence before its rooms fail")
    room_timeout: float = option(30.0, "seconds a room may spend bootstrapping, waiting or transferring")
    hybrid: bool = option(False, "the hybrid model: each room moves the K/V pages and the request's state slot")
    """The hybrid model (a linear-attention layer with a recurrent state, then full attention): each
    room moves the K/V pages and the request's state slot."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def endpoint_config(cfg: ServeConfig, instance: str) -> Any:
    from kvproto.aio import EndpointConfig
    from kvproto.core import Timeouts

    t = cfg.room_timeout
    return EndpointConfig(transport=cfg.transport, model_id="examples.model", instance=instance,
                          heartbeat_interval=0.2, heartbeat_timeout=cfg.heartbeat_timeout, staging_bytes=16 << 20,
                          timeouts=Timeouts(bootstrap=t, waiting=t, transfer=t, parked=t))


def metrics_text(endpoints: list[Any], extra: Any = None) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvproto.metrics import PrometheusCollector

    registry = CollectorRegistry()
    registry.register(PrometheusCollector(endpoints))
    if extra is not None:
        registry.register(extra)
    return generate_latest(registry)


class _Lockstep:
    """Rank 0 tells the other ranks of its instance what to do; all agree on room outcomes."""

    def __init__(self, tp: int, rank: int, port: int) -> None:
        self.tp, self.rank = tp, rank
        if tp > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=tp, rank=rank)

    def broadcast(self, obj: Any) -> Any:
        if self.tp == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, done: list[int], failed: list[int]) -> tuple[list[bool], list[bool]]:
        """Per room: done on every rank; failed on any rank."""
        if self.tp == 1 or not done:
            return [bool(d) for d in done], [bool(f) for f in failed]
        import torch
        import torch.distributed as dist

        counts = torch.tensor([done, failed], dtype=torch.int64)
        dist.all_reduce(counts)
        return [int(c) == self.tp for c in counts[0]], [int(c) > 0 for c in counts[1]]


# --- what a rank of either side sets up -----------------------------------------------------------


def _rank_setup(cfg: ServeConfig, role: str, rank: int, dist_port: int) -> tuple[Any, ...]:
    """A ``role`` rank's model shard, its lockstep with the instance's other ranks, its model, its
    paged cache (the side's block size and layout) with 64 aux slots, and those slots' numbers."""
    import torch

    from examples.model import Model, PagedCache, Ranks, Shard

    tp = getattr(cfg, f"{role}_tp")
    shard = Shard(tp, rank)
    lockstep = _Lockstep(tp, rank, dist_port)
    model = Model(Ranks(shard))
    cache = PagedCache(shard, blocks=cfg.blocks, block=getattr(cfg, f"{role}_block"),
                       layout=getattr(cfg, f"{role}_layout"), hybrid=cfg.hybrid)
    aux = torch.zeros((64, 8), dtype=torch.uint8)
    return lockstep, model, cache, aux, list(range(64))


# --- prefill: await style ------------------------------------------------------------------------


async def _prefill_rank(cfg: ServeConfig, index: int, rank: int, dist_port: int, conn: Any) -> None:
    from examples.http import serve
    from examples.model import LAYERS
    from kvproto.aio import PrefillEndpoint

    lockstep, model, cache, aux, slots = _rank_setup(cfg, "prefill", rank, dist_port)
    loop = asyncio.get_running_loop()
    config, kv = endpoint_config(cfg, f"prefill-{index}"), cache.kv_cache(aux)
    if rank == 0:  # rank 0 serves the bootstrap; the other ranks announce themselves to it
        endpoint = PrefillEndpoint(kv, config=config)
        await endpoint.start()
        lockstep.broadcast(endpoint.bootstrap_address)
    else:
        address = await loop.run_in_executor(None, lockstep.broadcast, None)
        endpoint = PrefillEndpoint(kv, bootstrap=address, config=config)
        await endpoint.start()
    async with endpoint:
        jobs: asyncio.Queue[tuple[dict[str, Any], asyncio.Future[Any]]] = asyncio.Queue()
        server = None
        if rank == 0:
            async def handle(req: Any) -> None:
                if req.path == "/metrics":
                    return await req.reply(200, metrics_text([endpoint]), "text/plain; version=0.0.4")
                if req.path == "/status":
                    return await req.reply(200, {"free_pages": len(cache.free), "total_pages": cfg.blocks})
                done: asyncio.Future[Any] = loop.create_future()
                await jobs.put((req.json(), done))
                await req.reply(200, await done)

            http_port = free_port()
            server = await serve("127.0.0.1", http_port, handle)
            conn.send(("ready", endpoint.bootstrap_address, http_port, os.getpid()))
        else:
            conn.send(("ready", "", 0, os.getpid()))

        async def finish(room: Any, pages: list[int], slot: int, done: asyncio.Future[Any] | None) -> None:
            try:
                await room.wait()
                result: dict[str, Any] = {"ok": True}
            except Exception as exc:  # noqa: BLE001 - reported to the router
                result = {"error": str(exc)}
                log.warning("prefill room %d: %s", room.room_id, exc)
            cache.give(pages)
            slots.append(slot)
            if done is not None and not done.done():
                done.set_result(result)

        async def run(job: dict[str, Any], done: asyncio.Future[Any] | None) -> None:
            prompt, room_id = job["prompt"], job["room"]
            pages = cache.take(cache.pages_for(len(prompt)))
            slot = slots.pop()
            cache.reset(slot)
            room = endpoint.open_room(room_id)
            given = 0
            for begin in range(0, len(prompt), cfg.chunk):
                end = min(len(prompt), begin + cfg.chunk)
                last = end == len(prompt)
                upto = cache.pages_for(end) if last else end // cfg.prefill_block
                chunk_pages = pages[given:upto]

                # The hybrid model's state slot goes with the last chunk's first call (its state group
                # moves with its layer's span of that chunk).
                state = {"state_slots": {"linear": slot}} if cfg.hybrid and last else {}

                def layer_done(layer: int, end: int = end, last: bool = last, chunk_pages: list = chunk_pages,
                               state: dict = state) -> None:
                    # Stream each layer as the forward finishes it (the last one goes with the aux slot,
                    # once the logits are known); a CUDA model would pass ready=<its stream's event>.
                    if layer < LAYERS - 1:
                        room.send(chunk_pages if layer == 0 else [], end, last=last, layers=range(layer, layer + 1),
                                  **(state if layer == 0 else {}))

                logits = model.forward(prompt[begin:end], begin, cache, pages, on_layer=layer_done, slot=slot)
                if last:
                    aux[slot].zero_()
                    aux[slot][0] = int(logits.argmax())
                room.send(chunk_pages if LAYERS == 1 else [], end, last=last, layers=range(LAYERS - 1, LAYERS),
                          aux_slot=slot if last else None, **(state if LAYERS == 1 else {}))
                given = upto
                await asyncio.sleep(0)  # let kvproto move this chunk while the next computes
            asyncio.ensure_future(finish(room, pages, slot, done))

        while True:
            if rank == 0:
                job, done = await jobs.get()
                lockstep.broadcast(job)
            else:
                job, done = await loop.run_in_executor(None, lockstep.broadcast, None), None
            try:
                await run(job, done)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
                log.exception("prefill room %s failed", job.get("room"))
                if done is not None and not done.done():
                    done.set_result({"error": f"{type(exc).__name__}: {exc}"})
        if server is not None:  # pragma: no cover - the loop above runs until the process ends
            server.close()


def prefill_rank_main(cfg: ServeConfig, index: int, rank: int, dist_port: int, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_prefill_rank(cfg, index, rank, dist_port, conn))


def _generate_request(raw: bytes, encode: Any) -> tuple[list[int], int, int]:
    """(prompt tokens, max_tokens, prefix) of a /generate body; ValueError naming what is wrong."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise ValueError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = encode(prompt)
    elif not (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise ValueError('"prompt" must be a string or a list of token ids')
    if not prompt:
        raise ValueError('"prompt" is empty')
    max_tokens, prefix = body.get("max_tokens", 16), body.get("prefix", 0)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f'"max_tokens" must be a positive integer, got {max_tokens!r}')
    if not isinstance(prefix, int) or isinstance(prefix, bool) or not 0 <= prefix <= len(prompt):
        raise ValueError(f'"prefix" must be an integer in [0, {len(prompt)}], got {prefix!r}')
    return prompt, max_tokens, prefix


# --- decode: step style -----------------------------------------------------------------------------


@dataclass
class _Request:
    room: int
    prompt: list[int]
    bootstrap: str
    max_tokens: int
    prefix: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int = 0
    receiver: Any = None
    tokens: list[int] = field(default_factory=list)
    out: Any = None
    """Rank 0: the asyncio queue the HTTP handler streams from."""


def decode_rank_main(cfg: ServeConfig, index: int, rank: int, dist_port: int, conn: Any) -> None:
    import torch

    from examples.http import serve
    from kvproto.core import RoomState
    from kvproto.sync import EngineLoop, SyncDecode

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    lockstep, model, cache, aux, slots = _rank_setup(cfg, "decode", rank, dist_port)
    engine = EngineLoop()
    decode = SyncDecode(cache.kv_cache(aux), config=endpoint_config(cfg, f"decode-{index}"), loop=engine)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    streams: dict[int, asyncio.Queue[Any]] = {}

    if rank == 0:
        async def handle(req: Any) -> None:
            if req.path == "/metrics":
                return await req.reply(200, metrics_text([decode._endpoint]), "text/plain; version=0.0.4")
            if req.path == "/status":
                return await req.reply(200, {"free_pages": len(cache.free), "total_pages": cfg.blocks,
                                             "live": len(streams)})
            body = req.json()
            if req.path == "/abort":
                inbox.put(("abort", body["room"]))
                return await req.reply(200, {"ok": True})
            out: asyncio.Queue[Any] = asyncio.Queue()
            streams[body["room"]] = out
            inbox.put(("new", body))
            while True:
                line = await out.get()
                await req.stream(line)
                if "done" in line or "error" in line:
                    break
            streams.pop(body["room"], None)
            await req.end_stream()

        http_port = free_port()
        engine.run(serve("127.0.0.1", http_port, handle))
        conn.send(("ready", "", http_port, os.getpid()))
    else:
        conn.send(("ready", "", 0, os.getpid()))

    def emit(request: _Request, line: dict[str, Any]) -> None:
        if rank == 0 and request.out is not None:
            engine.loop.call_soon_threadsafe(request.out.put_nowait, line)

    def release(request: _Request) -> None:
        cache.give(request.pages)
        slots.append(request.slot)

    active: list[_Request] = []
    while True:
        decision: dict[str, Any] = {"new": [], "abort": []}
        if rank == 0:
            while True:
                try:
                    kind, body = inbox.get_nowait()
                except queue.Empty:
                    break
                decision["new" if kind == "new" else "abort"].append(body)
        decision = lockstep.broadcast(decision)
        for body in decision["new"]:
            r = _Request(body["room"], body["prompt"], body["bootstrap"], body["max_tokens"], body.get("prefix", 0))
            r.out = streams.get(r.room) if rank == 0 else None
            r.pages = cache.take(cache.pages_for(len(r.prompt) + r.max_tokens))
            r.slot = slots.pop()
            cache.reset(r.slot)
            if r.prefix:  # a prefix-cache hit: this instance computes (holds) the prefix itself
                model.prefill(r.prompt[:r.prefix], cache, r.pages, chunk=cfg.chunk, slot=r.slot)
            r.receiver = decode.receiver(r.room, r.bootstrap, pages=r.pages[:cache.pages_for(len(r.prompt))],
                                         num_tokens=len(r.prompt), prefix_tokens=r.prefix, aux_slot=r.slot,
                                         state_slots={"linear": r.slot} if cfg.hybrid else None)
            active.append(r)
        for room_id in decision["abort"]:
            for r in active:
                if r.room == room_id and not r.tokens:
                    r.receiver.abort()
        waiting = [r for r in active if not r.tokens]
        states = [r.receiver.poll() for r in waiting]
        done, failed = lockstep.agree([int(s is RoomState.SUCCESS) for s in states],
                                      [int(s is RoomState.FAILED) for s in states])
        for r, ok, bad in zip(waiting, done, failed):
            if bad:
                code = getattr(r.receiver.code, "name", r.receiver.code)
                log.warning("decode room %d failed: %s", r.room, code)
                emit(r, {"error": f"KV transfer failed: {code}", "room": r.room})
                release(r)
                active.remove(r)
            elif ok:
                r.tokens.append(int(aux[r.slot][0]))
                emit(r, {"token": r.tokens[-1], "room": r.room})
        for r in [r for r in active if r.tokens]:
            if len(r.tokens) < r.max_tokens:
                logits = model.forward([r.tokens[-1]], len(r.prompt) + len(r.tokens) - 1, cache, r.pages,
                                       slot=r.slot)
                r.tokens.append(int(logits.argmax()))
                emit(r, {"token": r.tokens[-1], "room": r.room})
            if len(r.tokens) >= r.max_tokens:
                emit(r, {"done": True, "room": r.room, "tokens": r.tokens})
                release(r)
                active.remove(r)
        if not active:
            time.sleep(0.002)


# --- router -------------------------------------------------------------------------------------------


class Router:
    def __init__(self, prefills: list[tuple[str, int]], decodes: list[int]) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.prefills, self.decodes = prefills, decodes
        self._next = itertools.count()
        self._room = itertools.count(int(time.time() * 1000) % (1 << 40) * 1000 + 1)
        self.registry = CollectorRegistry()
        self.requests = Counter("router_requests", "Requests taken", registry=self.registry)
        self.errors = Counter("router_errors", "Requests answered with an error", registry=self.registry)

    async def handle(self, req: Any) -> None:
        from prometheus_client import generate_latest

        from examples.http import call
        from examples.model import decode_text, encode

        if req.path == "/metrics":
            parts = [generate_latest(self.registry)]
            for port in [p for _, p in self.prefills] + self.decodes:
                status, text = await call("127.0.0.1", port, "GET", "/metrics")
                parts.append(text.encode() if status == 200 else b"")
            return await req.reply(200, b"".join(parts), "text/plain; version=0.0.4")
        if req.path != "/generate":
            return await req.reply(404, {"error": f"no route {req.path}"})
        self.requests.inc()
        try:
            prompt, max_tokens, prefix = _generate_request(req.body, encode)
        except ValueError as exc:  # nothing is opened for a request that cannot run
            self.errors.inc()
            return await req.reply(400, {"error": str(exc)})
        turn = next(self._next)
        bootstrap, prefill_port = self.prefills[turn % len(self.prefills)]
        decode_port = self.decodes[turn % len(self.decodes)]
        room = next(self._room)
        job = {"room": room, "prompt": prompt, "bootstrap": bootstrap, "max_tokens": max_tokens, "prefix": prefix}
        failure = await self.relay(req, room, job, prefill_port, decode_port, decode_text)
        if failure:
            self.errors.inc()
            log.warning("room %d: %s", room, failure)

    async def relay(self, req: Any, room: int, job: dict[str, Any], prefill_port: int, decode_port: int,
                    decode_text: Any) -> str | None:
        from examples.http import call, lines

        async def prefill() -> str | None:
            try:
                status, answer = await call("127.0.0.1", prefill_port, "POST", "/prefill", job)
            except OSError as exc:
                return f"prefill unreachable: {exc}"
            return None if status == 200 and answer.get("ok") else f"prefill failed: {answer}"

        prefill_task = asyncio.ensure_future(prefill())

        async def abort_decode_if_prefill_fails() -> None:
            if await prefill_task:  # the KV will never come: the decode frees the room's pages now
                await call("127.0.0.1", decode_port, "POST", "/abort", {"room": room})

        watcher = asyncio.ensure_future(abort_decode_if_prefill_fails())
        failure = None
        tokens: list[int] = []
        try:
            async for line in lines("127.0.0.1", decode_port, "POST", "/generate", job):
                if "token" in line:
                    tokens.append(line["token"])
                    await req.stream({"token": line["token"], "text": decode_text([line["token"]])})
                if "error" in line:
                    failure = line["error"]
                if "done" in line or "error" in line:
                    break
        except OSError as exc:
            failure = f"decode unreachable: {exc}"
        prefill_failure = await prefill_task
        await watcher
        failure = prefill_failure or failure
        if failure:
            await req.stream({"error": failure, "room": room})
        else:
            await req.stream({"done": True, "room": room, "tokens": tokens, "text": decode_text(tokens)})
        await req.end_stream()
        return failure


# --- launcher ---------------------------------------------------------------------------------------


@dataclass
class Running:
    """The processes of a serving set, and where to reach them."""

    cfg: ServeConfig
    prefill_procs: list[list[Any]]
    decode_procs: list[list[Any]]
    prefills: list[tuple[str, int]]
    decodes: list[int]

    def stop(self) -> None:
        for proc in [p for group in self.prefill_procs + self.decode_procs for p in group]:
            if proc.is_alive():
                proc.terminate()
        for proc in [p for group in self.prefill_procs + self.decode_procs for p in group]:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def _ready(conn: Any, proc: Any, timeout: float = 120.0) -> tuple[str, int]:
    if not conn.poll(timeout):
        raise RuntimeError(f"{proc.name} did not start within {timeout}s (exit code {proc.exitcode})")
    _, bootstrap, port, _pid = conn.recv()
    return bootstrap, port


def _instance(ctx: Any, target: Any, cfg: ServeConfig, role: str, index: int, tp: int) -> tuple[list[Any], tuple[str, int]]:
    """Start the ``tp`` rank processes of one instance; (processes, rank 0's (bootstrap, HTTP port))."""
    dist_port, procs = free_port(), []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(cfg, index, rank, dist_port, child), daemon=True,
                           name=f"{role}{index}-rank{rank}")
        proc.start()
        procs.append((proc, parent))
    ready = [_ready(parent, proc) for proc, parent in procs]
    return [proc for proc, _ in procs], ready[0]


def start(cfg: ServeConfig) -> Running:
    """Start every prefill and decode rank process; return once all are ready."""
    ctx = mp.get_context("spawn")
    running = Running(cfg, [], [], [], [])
    try:
        for index in range(cfg.prefill_instances):
            procs, rank0 = _instance(ctx, prefill_rank_main, cfg, "prefill", index, cfg.prefill_tp)
            running.prefill_procs.append(procs)
            running.prefills.append(rank0)
        for index in range(cfg.decode_instances):
            procs, rank0 = _instance(ctx, decode_rank_main, cfg, "decode", index, cfg.decode_tp)
            running.decode_procs.append(procs)
            running.decodes.append(rank0[1])
    except Exception:
        running.stop()
        raise
    return running


async def run_router(running: Running, host: str, port: int) -> asyncio.AbstractServer:
    from examples.http import serve

    router = Router(running.prefills, running.decodes)
    return await serve(host, port, router.handle)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.serve", description=__doc__.split("\n\n")[0])
    add_options(ap, ServeConfig)
    args = ap.parse_args(argv)
    cfg = ServeConfig(**vars(args))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"starting {cfg.prefill_instances} prefill (TP {cfg.prefill_tp}) and {cfg.decode_instances} decode "
          f"(TP {cfg.decode_tp}) instances ...", flush=True)
    running = start(cfg)

    async def serve_forever() -> None:
        server = await run_router(running, cfg.host, cfg.port)
        print(f"router on http://{cfg.host}:{cfg.port}: curl -N {cfg.host}:{cfg.port}/generate "
              f"-d '{json.dumps({'prompt': 'Hello, world', 'max_tokens': 16})}'", flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve_forever())
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
