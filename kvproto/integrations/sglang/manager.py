"""The KV manager: one kvproto endpoint per SGLang scheduler rank.

Theory of operation
-------------------
SGLang makes one manager per scheduler process (``PrefillBootstrapQueue`` /
``DecodePreallocQueue``), from the rank's ``KVArgs``. This one subclasses SGLang's
``CommonKVManager`` for what SGLang's queues read of a manager (request bookkeeping, DP-rank
resolution, ``prefill_info_table`` and ``try_ensure_parallel_info`` on the decode, the HTTP
registration of prefill ranks) and runs a kvproto endpoint on an event-loop thread
(``kvproto.sync``) for everything that moves bytes.

Start order on the prefill (``register_to_bootstrap``, called from ``CommonKVManager.__init__``):
attention-TP rank 0 of a DP group starts its endpoint (its own kvproto bootstrap service) and
registers that address as its row in SGLang's ``/route`` table; every other rank registers a row,
waits until SGLang's registry is complete (all ranks in), reads rank 0's row and starts its
endpoint with that bootstrap address. On the decode the endpoint starts at once; a receiver finds
the kvproto bootstrap address of its prefill DP group in that group's rank-0 row
(``kvproto_bootstrap``, cached per prefill server and DP rank). The TP ranks of one decode DP
group share one kvproto ``instance`` name (the engine's address and DP rank).

What kvproto cannot serve is refused here, before anything starts, with the reason
(``cache.refusal``). ``close`` stops the endpoint (its live rooms fail, peers are told).

The transport is NIXL unless ``KVPROTO_SGLANG_TRANSPORT`` names another (SGLang has no place for a
backend's own settings): ``cuda-ipc`` writes into a decode rank on the same machine with one kernel
per write (the kernel path) and takes NIXL for every other peer; ``KVPROTO_SGLANG_TRANSPORT_OPTIONS``
(JSON) passes the transport's options. Both servers' ranks read them at start (``transport_choice``).
``KVPROTO_SGLANG_STAGING_MIB`` gives each rank a staging buffer of that size (0, the default: none):
rooms between different attention TP sizes then gather into it and move as a few bulk writes, where
without it they move sliced, a descriptor per head and page (kvproto's cost model picks per room).
The buffer is memory beside SGLang's pools (on the rank's GPU), which SGLang does not count: leave
room for it (``--mem-fraction-static``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import requests
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel, get_serving
from sglang.srt.utils.network import NetworkAddress

from kvproto.aio import EndpointConfig
from kvproto.core import RoomState, Timeouts
from kvproto.integrations.sglang.cache import MAMBA, cache_from_kvargs, mamba_layout, refusal
from kvproto.sync import EngineLoop, SyncDecode, SyncPrefill

log = logging.getLogger("kvproto.sglang")


def _total_kv_heads(args: Any, server_args: Any, mla: bool) -> int:
    if mla:
        return 1
    heads = getattr(args, "total_kv_head_num", None)
    if heads:
        return int(heads)
    from sglang.srt.configs.model_config import ModelConfig  # the decode's KVArgs leaves it unset

    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


def mamba2_conv_sections(server_args: Any) -> tuple[int, ...] | None:
    """The conv state's sub-blocks (global sizes) of a model whose Mamba layers are SGLang's
    ``MambaMixer2`` (Nemotron-H, Falcon-H1, Mamba2, Granite hybrids: their configs build the pool
    from ``Mamba2StateShape.create``), which SGLang's ``KVArgs`` do not name: the mixer's conv1d is a
    ``MergedColumnParallelLinear`` of ``[intermediate_size | groups x state | groups x state]``
    (``x | B | C``), each split over attention TP on its own, and its conv state's channels follow it.
    None for any other model, or where the config cannot be read (the state then moves between
    equal attention TP sizes only). Groups a TP size does not divide are replicated by the mixer
    (``n_groups`` extended to the TP size), which makes the global sizes differ between two such TP
    sizes: kvproto's registration refuses that pair, naming the group."""
    try:
        from sglang.srt.configs import FalconH1Config, GraniteMoeHybridConfig, Mamba2Config, NemotronHConfig
        from sglang.srt.configs.hybrid_arch import mamba2_config
        from sglang.srt.configs.model_config import ModelConfig

        config = mamba2_config(ModelConfig.from_server_args(server_args))
        if not isinstance(config, (NemotronHConfig, FalconH1Config, Mamba2Config, GraniteMoeHybridConfig)):
            return None
        shape = config.mamba2_cache_params.shape
    except Exception as exc:  # an unreadable config: no sub-blocks known, equal TP sizes only
        log.warning("kvproto: the model's Mamba2 conv layout could not be read (%s: %s)", type(exc).__name__, exc)
        return None
    inner, conv = int(shape.intermediate_size), int(shape.conv_dim)
    if shape.conv_shard_groups or len(shape.conv) != 1 or conv <= inner or (conv - inner) % 2:
        return None
    return inner, (conv - inner) // 2, (conv - inner) // 2


TRANSPORT_ENV = "KVPROTO_SGLANG_TRANSPORT"
TRANSPORT_OPTIONS_ENV = "KVPROTO_SGLANG_TRANSPORT_OPTIONS"
STAGING_ENV = "KVPROTO_SGLANG_STAGING_MIB"


def staging_bytes(environ: Any = os.environ) -> int:
    """Each rank's staging buffer in bytes (module docstring); a value that is not a whole number of
    MiB ≥ 0 raises ``ValueError`` naming the variable."""
    raw = environ.get(STAGING_ENV, "").strip() or "0"
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"{STAGING_ENV}={raw!r}: a whole number of MiB, 0 for none")
    return mib << 20


def transport_choice(environ: Any = os.environ) -> tuple[str, dict[str, Any]]:
    """The transport and its options this rank's endpoint uses (module docstring); a value that is
    not a known transport or not a JSON object raises ``ValueError`` naming the variable."""
    from kvproto.transport import adapters

    name = environ.get(TRANSPORT_ENV, "").strip() or "nixl"
    known = adapters()
    if name not in known:
        raise ValueError(f"{TRANSPORT_ENV}={name!r}: kvproto knows the transports {sorted(known)}")
    raw = environ.get(TRANSPORT_OPTIONS_ENV, "").strip()
    try:
        options = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{TRANSPORT_OPTIONS_ENV} is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(f"{TRANSPORT_OPTIONS_ENV} must be a JSON object, got {raw!r}")
    return name, options


def _route_host(dist_init_addr: str | None, bootstrap_host: str) -> str:
    """The host of SGLang's bootstrap registry, as ``CommonKVManager.register_to_bootstrap`` finds it."""
    if dist_init_addr:
        return NetworkAddress.parse(dist_init_addr).resolved().host
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bootstrap_host, bootstrap_host)


def _row_address(row: dict[str, Any]) -> str:
    return NetworkAddress(str(row["rank_ip"]), int(row["rank_port"])).to_tcp()


class KVProtoManager(CommonKVManager):
    """SGLang's KV manager on a kvproto endpoint (see the module docstring)."""

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        parallel = get_parallel()
        reason = refusal(args, parallel=parallel, disagg=get_disagg())
        if reason is not None:
            raise ValueError(f"--disaggregation-transfer-backend kvproto does not support {reason}")
        self.endpoint: SyncPrefill | SyncDecode | None = None
        self._engine_loop: EngineLoop | None = None
        self._bootstraps: dict[tuple[str, int], str] = {}
        self._bootstraps_lock = threading.Lock()
        self._decode_rooms: dict[int, Any] = {}
        """Decode rooms SGLang may still hold pages for (``is_abort_release_safe``)."""
        conv_sections, self._same_tp_only = None, None
        """Why this rank's Mamba state moves between equal attention TP sizes only (None: any)."""
        if [getattr(s, "value", str(s)) for s in getattr(args, "state_types", None) or []] == [MAMBA]:
            layout = mamba_layout(args, tp_size=parallel.attn_tp_size)
            if layout.same_tp_only and layout.shapes is not None:  # no conv sub-blocks: the model's, if known
                conv_sections = mamba2_conv_sections(server_args)
                layout = mamba_layout(args, tp_size=parallel.attn_tp_size, conv_sections=conv_sections)
            self._same_tp_only = layout.same_tp_only
        self._staging = staging_bytes()
        self.kvproto_cache = cache_from_kvargs(
            args, mla=bool(is_mla_backend), tp_size=parallel.attn_tp_size, tp_rank=parallel.attn_tp_rank,
            total_kv_heads=_total_kv_heads(args, server_args, bool(is_mla_backend)),
            on_gpu=str(get_device().device).startswith("cuda"), conv_sections=conv_sections,
            views=self._staging > 0)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)  # prefill: register_to_bootstrap
        if disaggregation_mode == DisaggregationMode.DECODE:
            where = self.dist_init_addr or f"{self.local_ip}:{get_serving().port}"
            self.endpoint = SyncDecode(self.kvproto_cache, config=self._config(f"sglang-decode-{where}-dp"
                                                                               f"{self.attn_dp_rank}"),
                                       loop=self._loop())
            log.info("kvproto decode rank %d/%d started", self.attn_tp_rank, self.attn_tp_size)

    # --- endpoints -----------------------------------------------------------------------------
    def _loop(self) -> EngineLoop:
        if self._engine_loop is None:
            self._engine_loop = EngineLoop(name=f"kvproto-sglang-{self.attn_tp_rank}")
        return self._engine_loop

    def _config(self, instance: str | None = None, **options: Any) -> EndpointConfig:
        waiting = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        bootstrap = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get())
        decode = self.disaggregation_mode == DisaggregationMode.DECODE
        # The decode waits for KV space as long as SGLang does (no deadline); the prefill for its
        # chunks, and both for progress once transferring, SGLang's waiting timeout.
        timeouts = Timeouts(bootstrap=bootstrap, waiting=None if decode else waiting, transfer=waiting,
                            parked=bootstrap)
        transport, transport_options = transport_choice()
        return EndpointConfig(instance=instance, timeouts=timeouts, staging_bytes=self._staging, transport=transport,
                              transport_options=transport_options,
                              compat_key=f"sglang-kv-{self.kv_cache_dtype_str}", **options)

    def register_to_bootstrap(self) -> None:
        """Start this prefill rank's endpoint and register its row (module docstring)."""
        if self.attn_tp_rank == 0:
            endpoint = SyncPrefill(self.kvproto_cache, config=self._config(host=self.local_ip), loop=self._loop())
            self.endpoint = endpoint
            address = NetworkAddress.parse(endpoint.address.removeprefix("tcp://"))
            saved = self.local_ip, self.rank_port
            self.local_ip, self.rank_port = address.host, address.port  # the row names kvproto's address
            try:
                super().register_to_bootstrap()
            finally:
                self.local_ip, self.rank_port = saved
            log.info("kvproto prefill rank 0 of DP %d serves %s", self.attn_dp_rank, endpoint.address)
            return
        super().register_to_bootstrap()
        rank0 = self._wait_for_rank0_row()
        self.endpoint = SyncPrefill(self.kvproto_cache, bootstrap=rank0, config=self._config(host=self.local_ip),
                                    loop=self._loop())
        log.info("kvproto prefill rank %d of DP %d bootstraps at %s", self.attn_tp_rank, self.attn_dp_rank, rank0)

    def _dp_group(self) -> int:
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    def _wait_for_rank0_row(self) -> str:
        host = _route_host(self.dist_init_addr, self.bootstrap_host)
        url = f"{NetworkAddress(host, self.bootstrap_port).to_url()}/route"
        params = dict(prefill_dp_rank=self._dp_group(), prefill_cp_rank=0, target_tp_rank=0, target_pp_rank=0)
        deadline = time.monotonic() + float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get())
        last = ""
        while time.monotonic() < deadline:
            try:
                response = requests.get(url, params=params, timeout=5)
                if response.status_code == 200:
                    return _row_address(response.json())
                last = f"{response.status_code} {response.text}"
            except requests.RequestException as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"kvproto: prefill rank {self.attn_tp_rank} found no row of attention-TP rank 0 of DP "
                           f"group {self._dp_group()} at {url} ({last})")

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's (its checks: page size, KV dtype, ...), and for a hybrid model's Mamba state that
        ``KVArgs`` do not fully describe the same attention TP size on both servers (kvproto then
        moves that state rank to rank: ``cache.mamba_layout``)."""
        known = bootstrap_addr in self.prefill_info_table
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        info = self.prefill_info_table[bootstrap_addr]
        if not known and self._same_tp_only and info.attn_tp_size != self.attn_tp_size:
            del self.prefill_info_table[bootstrap_addr]
            raise RuntimeError(f"--disaggregation-transfer-backend kvproto moves this Mamba state between equal "
                               f"attention TP sizes only (prefill {info.attn_tp_size}, decode {self.attn_tp_size}): "
                               f"{self._same_tp_only}")
        return True

    def kvproto_bootstrap(self, bootstrap_addr: str, prefill_dp_rank: int) -> str | None:
        """The kvproto bootstrap address of DP group ``prefill_dp_rank`` of the prefill server at
        ``bootstrap_addr`` (its rank-0 row in SGLang's registry); None if it cannot be read."""
        key = (bootstrap_addr, prefill_dp_rank)
        with self._bootstraps_lock:
            known = self._bootstraps.get(key)
        if known is not None:
            return known
        url = (f"http://{bootstrap_addr}/route?prefill_dp_rank={prefill_dp_rank}&prefill_cp_rank=0"
               f"&target_tp_rank=0&target_pp_rank=0")
        try:
            response = requests.get(url, timeout=5)
        except requests.RequestException as exc:
            log.error("kvproto: no bootstrap row at %s: %s", url, exc)
            return None
        if response.status_code != 200:
            log.error("kvproto: no bootstrap row at %s: %s %s", url, response.status_code, response.text)
            return None
        address = _row_address(response.json())
        with self._bootstraps_lock:
            self._bootstraps[key] = address
        return address

    # --- deferred release of a failed room's pages (SGLang's decode transfer queue) ---------------
    supports_deferred_decode_kv_release = True
    """A room's pages are safe to free once its kvproto room has ended (no write can land then)."""

    def watch_room(self, room_id: int, room: Any) -> None:
        rooms = self._decode_rooms
        if len(rooms) >= 4096 and not len(rooms) % 1024:  # rooms SGLang dropped without asking: ended ones go
            for ended in [r for r, h in rooms.items() if h.poll() in (RoomState.SUCCESS, RoomState.FAILED)]:
                del rooms[ended]
        rooms[room_id] = room

    def forget_room(self, room_id: int) -> None:
        self._decode_rooms.pop(room_id, None)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether no write into the room's pages can still land: its kvproto room has ended (SGLang
        asks this for a failed room whose pages it holds; kvproto needs no acks of its own)."""
        room = self._decode_rooms.get(bootstrap_room)
        if room is None or room.poll() in (RoomState.SUCCESS, RoomState.FAILED):
            self._decode_rooms.pop(bootstrap_room, None)
            return True
        return False

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        self._decode_rooms.pop(bootstrap_room, None)

    def forget_bootstrap(self, bootstrap_addr: str, prefill_dp_rank: int) -> None:
        """Drop a cached address (its prefill server restarted: the next receiver reads it anew)."""
        with self._bootstraps_lock:
            self._bootstraps.pop((bootstrap_addr, prefill_dp_rank), None)

    def close(self) -> None:
        """Close the endpoint (live rooms fail, peers are told) and its loop thread. Idempotent."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self._engine_loop is not None:
            self._engine_loop.close()
            self._engine_loop = None
