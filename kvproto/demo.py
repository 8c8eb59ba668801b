"""``kvproto demo``: prefill and decode ranks in separate processes, moving verified KV.

Every rank is its own process with its own CPU KV cache, NIXL agent (or loopback) and ZMQ
sockets on 127.0.0.1. All processes derive the same room schedule from ``--seed``. For each
room, every prefill rank fills fresh, non-contiguous pages with bytes that are a function of
(room, layer, plane, global head, token, byte) only, and sends them in chunks; every decode
rank receives into its own random pages and checks every byte of every head it holds against
the same function, computed independently of any geometry plan. So a byte that went to the
wrong head, token, layer or page, or was never written, is caught whatever the two sides' TP
sizes, block sizes and layouts are.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import random
import sys
import time
from dataclasses import asdict, dataclass

from kvproto.options import add_options, option, options_of
from kvproto.testing.reference import (  # noqa: F401 - Content, DTYPES and aux_bytes are re-exported
    DTYPES,
    PRESETS,
    Content,
    PagedShape,
    RankCache,
    StateShape,
    aux_bytes,
    model_groups,
)

_Cache = RankCache
"""One rank's reference cache (``kvproto.reference.RankCache``)."""


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings; each is also its ``kvproto demo`` flag (``kvproto.options``)."""

    rooms: int = option(200, "number of rooms (requests) to move")
    layers: int = option(4)
    kv_heads: int = option(8, "KV heads of the model (ignored with --mla)")
    head_dim: int = option(64, "elements per head (the latent size with --mla)")
    dtype: str = option("bf16", choices=sorted(DTYPES))
    prefill_tp: int = option(1)
    decode_tp: int = option(1)
    prefill_block: int = option(16, "tokens per page on prefill")
    decode_block: int = option(16, "tokens per page on decode")
    prefill_layout: str = option("NHD", choices=["NHD", "HND"])
    decode_layout: str = option("NHD", choices=["NHD", "HND"])
    mla: bool = option(False, "one latent plane replicated on every rank")
    blocks: int = option(2048, "pages per layer and plane on every rank")
    min_tokens: int = option(64)
    max_tokens: int = option(2048)
    tokens: int = option(0, "fixed prompt length (default: random in [min, max])")
    """Every room's prompt length (0: random in [min_tokens, max_tokens])."""
    prefix_tokens: int = option(0, "tokens decode already holds (prefix-cache hit): only the rest moves")
    """Tokens each decode rank already holds (a prefix-cache hit; whole decode blocks)."""
    chunk_tokens: int = option(1024, "chunked-prefill chunk size")
    concurrency: int = option(16, "rooms in flight per rank")
    transport: str = option(
        "nixl", "data-plane adapter by name: nixl, mooncake, or any adapter an installed package declares in the "
                "kvproto.transports entry-point group (loopback cannot cross processes); a comma-separated list "
                "runs the same rooms over each and prints them side by side")
    path: str = option("auto", "auto: direct where pages match byte for byte, else staged, else sliced",
                       choices=["auto", "sliced", "staged"])
    """auto (direct, else staged, else sliced), sliced, or staged."""
    staging_mb: int = option(64, "staging buffer per rank, MiB")
    two_hosts: bool = option(False, "run prefill and decode in two network namespaces joined by a veth pair, "
                                    "nothing on 127.0.0.1 between them, CURVE on (Linux, root)")
    """Prefill and decode in two network namespaces joined by a veth pair (root; Linux)."""
    curve: bool = option(False, "authenticate and encrypt the control plane with ZMQ CURVE")
    """Authenticate and encrypt the control plane with ZMQ CURVE (always on with two_hosts)."""
    preset: str = option(
        "", "a hybrid model's cache, moved in one room: gdn (3 Gated DeltaNet layers with conv and recurrent state "
            "per full-attention layer), mla-indexer (an MLA latent plus a sparse-attention indexer cache), swa (full "
            "and sliding-window layers, each with its own pool); --layers counts full-attention layers",
        choices=list(PRESETS))
    """A hybrid model's cache (``kvproto.reference.PRESETS``): gdn, mla-indexer or swa."""
    window: int = option(0, "the swa preset's sliding window in tokens (default 64)")
    """The sliding window of the swa preset, in tokens (0: 64)."""
    page_layout: str = option(
        "", "vllm: the gdn preset as vLLM 0.33 lays it out: fused K|V pages shared with three groups of GDN layers "
            "whose states sit in those pages (slots a page apart, the conv state [Q | K | V] sharded per section)",
        choices=["", "vllm"])
    """"vllm": the gdn preset laid out in vLLM's pages (``kvproto.reference``): four groups of equal
    layers over one buffer per full-attention layer, state slots a page apart, conv [Q | K | V]."""
    seed: int = option(0)
    timeout: float = option(120.0, "per-room deadline in seconds")
    aux_bytes: int = option(64, cli=False)


def schedule(cfg: DemoConfig) -> list[tuple[int, int]]:
    """(room_id, num_tokens) for every room; identical in every process."""
    rng = random.Random(cfg.seed)
    base = rng.randrange(1, 2**40)
    rooms = []
    for i in range(cfg.rooms):
        n = rng.randint(cfg.min_tokens, cfg.max_tokens)
        rooms.append((base + i, cfg.tokens or n))
    return rooms


def prefix_of(cfg: DemoConfig, num_tokens: int) -> int:
    """Decode's prefix hit for a room: whole decode blocks, at most the prompt."""
    prefix = min(cfg.prefix_tokens, num_tokens)
    return prefix - prefix % cfg.decode_block


# --- rank processes ---------------------------------------------------------------------------------


def _endpoint_config(cfg: DemoConfig, instance: str, place: dict):
    from kvproto.aio import CurveAuth, EndpointConfig
    from kvproto.core import Timeouts

    curve = None
    if place.get("curve"):
        keys = place["curve"]
        if instance == "prefill":
            curve = CurveAuth(public_key=keys["server"][0], secret_key=keys["server"][1],
                              allowed=frozenset({keys["client"][0]}))
        else:
            curve = CurveAuth(public_key=keys["client"][0], secret_key=keys["client"][1], server_key=keys["server"][0])
    from kvproto.transport import host_options

    options = host_options(cfg.transport, place["address"]) if place.get("address") else {}
    return EndpointConfig(transport=cfg.transport, instance=instance, model_id="kvproto-demo", path=cfg.path,
                          transport_options=options, staging_bytes=cfg.staging_mb << 20, host=place.get("host", "127.0.0.1"),
                          advertise_host=place.get("advertise"), curve=curve,
                          timeouts=Timeouts(bootstrap=cfg.timeout, waiting=cfg.timeout, transfer=cfg.timeout))


async def _prefill(cfg: DemoConfig, rank: int, bootstrap: str | None, report, place: dict) -> None:
    import torch

    from kvproto.aio import PrefillEndpoint

    cache = _Cache(torch, cfg, tp=cfg.prefill_tp, rank=rank, block=cfg.prefill_block,
                   layout=cfg.prefill_layout, aux_slots=cfg.concurrency)
    slots = list(range(cfg.concurrency))
    async with PrefillEndpoint(cache.kv, bootstrap=bootstrap, config=_endpoint_config(cfg, "prefill", place)) as ep:
        report.put(("address", rank, ep.address))
        sem = asyncio.Semaphore(cfg.concurrency)
        paths: set[str] = set()
        descriptors = [0]

        async def one(room_id: int, n: int) -> None:
            async with sem:
                pages: list[int] = []
                held: dict[str, list[int]] = {}
                room = ep.open_room(room_id)
                slot = slots.pop()
                states = cache.take_slots()
                cache.fill_states(room_id, states)
                cache.aux[slot] = aux_bytes(torch, room_id, cfg.aux_bytes)
                t = 0
                try:
                    while t < n:
                        end = min(n, t + cfg.chunk_tokens)
                        new = cache.take(-(-end // cfg.prefill_block) - len(pages))
                        pages += new
                        new_groups = cache.take_group_pages(held, end)
                        cache.fill(room_id, pages, t, end, garbage_below=prefix_of(cfg, n))
                        cache.fill_groups(room_id, held, t, end, garbage_below=prefix_of(cfg, n))
                        room.send(new, end, last=end == n, aux_slot=slot if end == n else None,
                                  group_pages=new_groups or None, state_slots=states if end == n and states else None)
                        t = end
                        await asyncio.sleep(0)
                    await room.wait()
                finally:
                    cache.give(pages)
                    cache.give_groups(held, states)
                    slots.append(slot)
                paths.update(room.stats.paths - {"aux"})
                descriptors[0] += room.stats.descriptors

        await asyncio.gather(*(one(r, n) for r, n in schedule(cfg)))
        report.put(("prefill-done", rank, sorted(paths), descriptors[0]))
        # Stay up until every decode rank finished (they may still need heartbeats answered).
        while True:
            await asyncio.sleep(0.05)
            if os.getppid() == 1:
                return


async def _decode(cfg: DemoConfig, rank: int, bootstrap: str, report, go, place: dict) -> None:
    import torch

    from kvproto.aio import DecodeEndpoint

    cache = _Cache(torch, cfg, tp=cfg.decode_tp, rank=rank, block=cfg.decode_block,
                   layout=cfg.decode_layout, aux_slots=cfg.concurrency)
    slots = list(range(cfg.concurrency))
    async with DecodeEndpoint(cache.kv, config=_endpoint_config(cfg, "decode", place)) as ep:
        sem = asyncio.Semaphore(cfg.concurrency)
        totals = {"bytes": 0, "bad": 0, "done": 0}
        go.wait()
        start = time.perf_counter()

        async def one(room_id: int, n: int) -> None:
            async with sem:
                pages = cache.take(-(-n // cfg.decode_block))
                group_pages = cache.decode_group_pages(n)
                states = cache.take_slots()
                slot = slots.pop()
                prefix = prefix_of(cfg, n)
                if prefix:  # the prefix-cache hit, already here
                    cache.fill(room_id, pages, 0, prefix)
                    cache.fill_groups(room_id, group_pages, 0, prefix, n_tokens=n)
                try:
                    room = ep.open_room(room_id, bootstrap, pages=pages, num_tokens=n, prefix_tokens=prefix,
                                        aux_slot=slot, group_pages=cache.strip(group_pages) or None,
                                        state_slots=states or None)
                    await room.wait()
                    bad = cache.check(room_id, pages, n) + cache.check_groups(room_id, group_pages, states, n)
                    if rank == 0 and not torch.equal(cache.aux[slot], aux_bytes(torch, room_id, cfg.aux_bytes)):
                        bad += 1
                    totals["bad"] += bad
                    totals["bytes"] += cache.moved_bytes(n, prefix)
                    totals["done"] += 1
                    report.put(("room", rank, room_id, bad))
                finally:
                    cache.give(pages)
                    cache.give_groups(group_pages, states)
                    slots.append(slot)

        await asyncio.gather(*(one(r, n) for r, n in schedule(cfg)))
        elapsed = time.perf_counter() - start
        report.put(("decode-done", rank, elapsed, totals["bytes"], totals["bad"], totals["done"]))


def _rank_main(role: str, rank: int, cfg_dict: dict, bootstrap: str | None, report, go, place: dict) -> None:
    cfg = DemoConfig(**cfg_dict)
    if place.get("netns"):  # before any socket or thread exists: everything after lives there
        from kvproto.testing import netns

        netns.enter(place["netns"])
        os.environ.update(netns.HOST_ENV)
    import torch

    torch.set_num_threads(1)  # one process per rank already fills the cores
    try:
        if role == "prefill":
            asyncio.run(_prefill(cfg, rank, bootstrap, report, place))
        else:
            asyncio.run(_decode(cfg, rank, bootstrap, report, go, place))  # type: ignore[arg-type]
    except Exception as exc:  # surfaced to the parent, which fails the demo
        report.put(("error", f"{role} rank {rank}", f"{type(exc).__name__}: {exc}"))
        raise


# --- the parent --------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, done: int, start: float) -> None:
        now = time.perf_counter()
        if done < self.total and now - self.last < (0.1 if self.tty else 2.0):
            return
        self.last = now
        width = 30
        fill = width * done // max(1, self.total)
        rate = done / max(now - start, 1e-9)
        line = f"[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} rooms  {rate:7.1f} rooms/s"
        if self.tty:
            print("\r" + line, end="" if done < self.total else "\n", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def run(cfg: DemoConfig, summary: dict | None = None) -> int:
    """Run the demo; ``summary`` (if given) receives rooms, seconds, bytes and bad bytes."""
    summary = {} if summary is None else summary
    hosts = None
    places: dict[str, dict] = {"prefill": {}, "decode": {}}
    if cfg.two_hosts:
        from kvproto.testing import netns

        why = netns.unavailable()
        if why:
            print(f"--two-hosts: {why}", file=sys.stderr)
            return 2
        hosts = netns.TwoHosts.create()
        places = {"prefill": {"netns": hosts.a, "host": "0.0.0.0", "advertise": hosts.a_addr, "address": hosts.a_addr},
                  "decode": {"netns": hosts.b, "address": hosts.b_addr}}
        print(f"two hosts: prefill ranks in network namespace {hosts.a} ({hosts.a_addr}, bound to 0.0.0.0), "
              f"decode ranks in {hosts.b} ({hosts.b_addr}), joined by a veth pair; CURVE on; "
              f"{' '.join(f'{k}={v}' for k, v in netns.HOST_ENV.items())}", flush=True)
    if cfg.curve or cfg.two_hosts:
        import zmq

        keys = {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}
        for place in places.values():
            place["curve"] = keys
    try:
        rc = _run(cfg, places, summary)
        if hosts is not None:
            summary["wire_bytes"] = hosts.tx_bytes()
            print(f"the veth pair carried {summary['wire_bytes'] / 1e9:.3f} GB from the prefill host to the decode host")
        return rc
    finally:
        if hosts is not None:
            hosts.close()


def _run(cfg: DemoConfig, places: dict[str, dict], summary: dict) -> int:
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    go = ctx.Event()
    procs: list[mp.process.BaseProcess] = []
    cfg_dict = asdict(cfg)

    def start(role: str, rank: int, bootstrap: str | None) -> None:
        p = ctx.Process(target=_rank_main, args=(role, rank, cfg_dict, bootstrap, report, go, places[role]),
                        name=f"{role}-{rank}", daemon=True)
        p.start()
        procs.append(p)

    def next_msg(deadline: float):
        while True:
            try:
                msg = report.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}")
                if time.perf_counter() > deadline:
                    raise TimeoutError("demo timed out")
                continue
            if msg[0] == "error":
                raise RuntimeError(f"{msg[1]}: {msg[2]}")
            return msg

    print(f"kvproto demo: {cfg.rooms} rooms, prefill TP {cfg.prefill_tp} (block {cfg.prefill_block}, "
          f"{cfg.prefill_layout}) -> decode TP {cfg.decode_tp} (block {cfg.decode_block}, {cfg.decode_layout}), "
          f"{'MLA, ' if cfg.mla else ''}{cfg.layers} layers x {1 if cfg.mla else cfg.kv_heads} KV heads x "
          f"{cfg.head_dim} {cfg.dtype}, transport {cfg.transport}, one process per rank", flush=True)
    if cfg.preset:
        print(f"hybrid cache ({cfg.preset}): " + "; ".join(_describe(g) for g in model_groups(cfg)), flush=True)
    t_begin = time.perf_counter()
    deadline = t_begin + cfg.timeout + 60
    try:
        start("prefill", 0, None)
        msg = next_msg(deadline)
        bootstrap = msg[2]
        for r in range(1, cfg.prefill_tp):
            start("prefill", r, bootstrap)
        for r in range(cfg.decode_tp):
            start("decode", r, bootstrap)
        ready = 1
        while ready < cfg.prefill_tp:
            if next_msg(deadline)[0] == "address":
                ready += 1
        go.set()
        start_t = time.perf_counter()
        progress = _Progress(cfg.rooms)
        progress.update(0, start_t)
        done_rank0 = bad = 0
        finished = []
        senders = []
        while len(finished) < cfg.decode_tp or len(senders) < cfg.prefill_tp:
            msg = next_msg(deadline)
            if msg[0] == "room":
                bad += msg[3]
                if msg[1] == 0:
                    done_rank0 += 1
                    progress.update(done_rank0, start_t)
            elif msg[0] == "decode-done":
                finished.append(msg)
            elif msg[0] == "prefill-done":
                senders.append(msg)
        elapsed = max(m[2] for m in finished)
        total_bytes = sum(m[3] for m in finished)
        rooms_ok = min(m[5] for m in finished)
        print(f"moved {total_bytes / 1e9:.3f} GB of KV in {rooms_ok} rooms to {cfg.decode_tp} decode rank(s) "
              f"in {elapsed:.2f} s (page fill and byte checks included)")
        print(f"throughput: {rooms_ok / elapsed:.1f} rooms/s, {total_bytes / elapsed / 1e9:.3f} GB/s")
        paths = sorted({p for m in senders for p in m[2]})
        descs = sum(m[3] for m in senders)
        print(f"paths: {', '.join(paths) or 'none'}; {descs / max(1, cfg.rooms):.0f} descriptors per room "
              f"(all prefill ranks, after merging)")
        print(f"verified every byte: {'OK, 0 mismatching bytes' if bad == 0 else f'FAILED, {bad} mismatching bytes'}")
        summary.update(rooms=rooms_ok, seconds=elapsed, bytes=total_bytes, bad=bad)
        return 0 if bad == 0 and rooms_ok == cfg.rooms else 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvproto demo``'s flags: one per ``DemoConfig`` setting."""
    add_options(parser, DemoConfig)


def _describe(group: PagedShape | StateShape) -> str:
    if isinstance(group, StateShape):
        sections = group.sections or (None,) * len(group.shapes)
        tensors = ", ".join(f"{'x'.join(map(str, s))} {d}" + ("" if k is None else f" split on dim {k}") +
                            (f" in sections {'+'.join(map(str, c))}" if c else "")
                            for s, d, k, c in zip(group.shapes, group.dtypes, group.shard, sections))
        return f"{group.name}: state of {len(group.layers)} layers ({tensors})"
    kind = "latent" if group.mla else f"{group.kv_heads} KV heads"
    window = f", window {group.window}" if group.window else ""
    return f"{group.name}: {len(group.layers)} layers of {kind} x {group.head_dim}{window}"


def main(args: argparse.Namespace) -> int:
    fields = options_of(DemoConfig, args)
    names = [t.strip() for t in fields.pop("transport", DemoConfig.transport).split(",") if t.strip()]
    configs = [DemoConfig(**fields, transport=name) for name in names]
    from kvproto.transport import adapters

    for cfg in configs:
        if cfg.transport not in adapters():
            print(f"unknown transport {cfg.transport!r}; known: {', '.join(sorted(adapters()))}", file=sys.stderr)
            return 2
        if cfg.transport in ("loopback", "simulated"):
            print("the demo runs one process per rank: loopback cannot cross processes; use --transport nixl",
                  file=sys.stderr)
            return 2
    if not configs:
        print("--transport names no adapter", file=sys.stderr)
        return 2
    if configs[0].chunk_tokens % configs[0].prefill_block:
        print("--chunk-tokens must be a multiple of --prefill-block", file=sys.stderr)
        return 2
    if configs[0].page_layout and configs[0].preset != "gdn":
        print("--page-layout vllm lays out the gdn preset (--preset gdn)", file=sys.stderr)
        return 2
    if len(configs) == 1:
        return run(configs[0])
    rows = []
    for cfg in configs:  # the same rooms, one adapter after the other, then side by side
        summary: dict = {}
        rc = run(cfg, summary)
        rows.append((cfg.transport, rc, summary))
        print()
    wire = any("wire_bytes" in m for _, _, m in rows)
    print("| transport | rooms | GB moved | seconds | GB/s | rooms/s | bytes checked |" + (" GB on the veth |" if wire else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if wire else ""))
    for name, rc, m in rows:
        if "seconds" not in m:
            print(f"| {name} | failed | | | | | |" + (" |" if wire else ""))
            continue
        print(f"| {name} | {m['rooms']} | {m['bytes'] / 1e9:.3f} | {m['seconds']:.2f} | "
              f"{m['bytes'] / m['seconds'] / 1e9:.3f} | {m['rooms'] / m['seconds']:.1f} | "
              f"{'OK' if m['bad'] == 0 and rc == 0 else 'FAILED'} |"
              + (f" {m.get('wire_bytes', 0) / 1e9:.3f} |" if wire else ""))
    return max(rc for _, rc, _ in rows)
