"""What a vLLM operator sets: ``kv_connector_extra_config``, and what the connector reads of vLLM's config.

Theory of operation
-------------------
Everything the connector needs to know beyond vLLM's own config comes from one JSON object,
``kv_connector_extra_config``, turned here into a frozen ``Settings``; an unknown key is refused
at start, naming it, so a typo never silently falls back to a default.

Three facts are derived from vLLM's config rather than asked for:

* **Ports of data-parallel ranks.** Every DP rank of a prefill instance serves kvproto's bootstrap
  on ``bootstrap_port + data_parallel_index`` (the rule vLLM's NixlConnector uses for its side
  channel), so DP engines on one host never collide; the address a prefill request returns in its
  ``kv_transfer_params`` names the port that served it, so a decode needs no rule of its own.
* **The compatibility key.** Two instances may differ in TP size, block size and cache layout:
  kvproto converts those as it writes. What it cannot convert is a different model or different
  bytes per token: ``model_id`` is the model vLLM loaded (and its revision), ``compat_key`` lists
  the factors that decide the bytes of a KV page (model dtype, KV cache dtype, quantization, the
  attention backends where vLLM's layers are registered, and every cache group's kind). kvproto
  compares both at registration and refuses a mismatch with ``MODEL_MISMATCH`` or
  ``COMPAT_KEY_MISMATCH``, naming both values, before any byte moves. vLLM's version is left out:
  the connector reads the cache through vLLM's own per-layer views, whose bytes do not depend on it.
* **CURVE keys.** kvproto's control-plane authentication (``kvproto.aio.CurveAuth``) from keys given
  inline (Z85 text) or from ZeroMQ certificate files (``zmq.auth`` format, as ``curve_keygen``
  writes them), so an operator can keep unknown decode instances out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvproto.aio import CurveAuth, EndpointConfig
from kvproto.core import Timeouts

if TYPE_CHECKING:
    from vllm.config import VllmConfig

BOOTSTRAP = "kvproto_bootstrap"
ROOM = "kvproto_room"
ERROR = "kvproto_error"
"""The keys kvproto adds to ``kv_transfer_params`` (beside vLLM's ``do_remote_prefill`` and
``do_remote_decode``): the prefill instance's bootstrap address, the room id, and, on a prefill
request that could not hand its KV over, why (the decode then computes the prompt itself)."""

PREFILL_TIMEOUTS = Timeouts(bootstrap=30.0, parked=600.0)
"""A prefill instance's rooms: a finished request's blocks are *leased* for 30 s to a decode that
has not asked for them (``bootstrap``: NixlConnector's ``kv_lease_duration``); a decode whose request
waits in its queue renews the lease every few seconds (``ROOM_HOLD``, protocol 1.4) for as long as
it waits, and one that never comes costs the blocks 30 s (counted as an expired request). A
decode's transfer request for a room the prefill has not scheduled yet (the concurrent proxy flow)
is kept 600 s (``parked``), as long as a request may queue on the prefill."""
DECODE_TIMEOUTS = Timeouts(waiting=None)
"""A decode instance's rooms wait for their blocks as long as vLLM queues the request (``waiting``:
no deadline), holding the prefill's room meanwhile (``hold``: 10 s asked, renewed every 3.3 s)."""

CURVE_KEYS = frozenset({"public_key", "secret_key", "server_key", "allowed", "certificate", "server_certificate",
                        "allowed_dir"})


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``; an unknown key is refused at start, naming it."""

    bootstrap_host: str = "127.0.0.1"
    """Interface prefill TP rank 0 binds its bootstrap service on (``0.0.0.0``: all)."""
    bootstrap_port: int = 17557
    """Port of that service for data-parallel rank 0; DP rank ``i`` serves on ``bootstrap_port + i``."""
    advertise_host: str | None = None
    """Host name decode instances use to reach the prefill (default: ``bootstrap_host``)."""
    transport: str = "nixl"
    """kvproto data-plane adapter: ``nixl``, ``cuda-ipc`` (same host: one kernel per write), ..."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    layerwise: bool = True
    """Send each layer as its forward ends (``save_kv_layer``); False: each step's chunk at once."""
    cudagraph_piecewise: bool = False
    """Ask vLLM for piecewise CUDA graphs on this instance (see ``requires_piecewise_for_cudagraph``):
    only a prefill instance under ``cudagraph_mode: FULL`` needs it for layer-wise sends."""
    staging_mib: int | None = None
    """kvproto staging buffer per rank (None: kvproto's default; 0: none)."""
    timeouts: dict[str, float] = field(default_factory=dict)
    """``kvproto.core.Timeouts`` fields in seconds, over ``PREFILL_TIMEOUTS`` / ``DECODE_TIMEOUTS``."""
    heartbeat_timeout_s: float = 5.0
    """A peer instance silent this long is gone: its rooms fail (``PEER_GONE``)."""
    endpoint_process: bool = False
    """Run each worker's kvproto endpoint in a process of its own (``kvproto.sync.process``), so
    that its work never takes the interpreter lock from vLLM's worker thread."""
    model_id: str | None = None
    """The model both instances must serve (default: vLLM's ``model`` and ``revision``); set it when
    two instances load one model from different paths."""
    curve: dict[str, Any] | None = None
    """CURVE authentication of kvproto's control plane (see ``curve_auth``)."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvproto connector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        bad = sorted(set(extra.get("timeouts", {})) - {f.name for f in dataclasses.fields(Timeouts)})
        if bad:
            raise ValueError(f"kvproto connector: unknown timeouts {bad}")
        bad = sorted(set(extra.get("curve") or {}) - CURVE_KEYS)
        if bad:
            raise ValueError(f"kvproto connector: unknown curve keys {bad}; known: {sorted(CURVE_KEYS)}")
        return cls(**extra)

    def port(self, dp_index: int) -> int:
        """The bootstrap port of data-parallel rank ``dp_index``."""
        return self.bootstrap_port + dp_index

    def bootstrap_address(self, dp_index: int = 0) -> str:
        host = self.advertise_host or self.bootstrap_host
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.port(dp_index)}"

    def endpoint_config(self, *, instance: str, model_id: str, compat_key: str, prefill: bool,
                        serves_bootstrap: bool, dp_index: int) -> EndpointConfig:
        defaults = PREFILL_TIMEOUTS if prefill else DECODE_TIMEOUTS
        timeouts = dataclasses.replace(defaults, **self.timeouts)
        options: dict[str, Any] = dict(transport=self.transport, transport_options=dict(self.transport_options),
                                       instance=instance, timeouts=timeouts, model_id=model_id,
                                       compat_key=compat_key, heartbeat_timeout=self.heartbeat_timeout_s,
                                       heartbeat_interval=min(1.0, self.heartbeat_timeout_s / 4),
                                       curve=curve_auth(self.curve, prefill=prefill))
        if self.staging_mib is not None:
            options["staging_bytes"] = self.staging_mib << 20
        if serves_bootstrap:
            options.update(host=self.bootstrap_host, port=self.port(dp_index), advertise_host=self.advertise_host)
        return EndpointConfig(**options)


def curve_auth(curve: dict[str, Any] | None, *, prefill: bool) -> CurveAuth | None:
    """kvproto's ``CurveAuth`` from the ``curve`` setting (None: no authentication).

    Keys are Z85 text, inline or from ZeroMQ certificate files: ``public_key`` and ``secret_key``,
    or ``certificate`` (a secret certificate file holding both), are this instance's keys; a decode
    instance names the prefill instance's public key (``server_key``, or ``server_certificate``),
    and a prefill instance the decode keys it admits (``allowed``: a list, and/or ``allowed_dir``:
    a directory of public certificate files). A prefill instance that admits no key refuses every
    decode, so that is refused at start."""
    if not curve:
        return None
    import zmq.auth

    def key(value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    public, secret = curve.get("public_key"), curve.get("secret_key")
    if curve.get("certificate"):
        public, secret = zmq.auth.load_certificate(curve["certificate"])
        if secret is None:
            raise ValueError(f"kvproto connector: curve certificate {curve['certificate']} holds no secret key")
    if not public or not secret:
        raise ValueError("kvproto connector: curve needs this instance's keys: public_key and secret_key, "
                         "or certificate (a secret certificate file)")
    if prefill:
        allowed = {key(k) for k in curve.get("allowed", ())}
        if curve.get("allowed_dir"):
            allowed |= set(zmq.auth.load_certificates(str(Path(curve["allowed_dir"]))))
        if not allowed:
            raise ValueError("kvproto connector: a prefill instance with curve needs the decode keys it admits "
                             "(allowed, or allowed_dir)")
        return CurveAuth(public_key=key(public), secret_key=key(secret), allowed=frozenset(allowed))
    server = curve.get("server_key")
    if curve.get("server_certificate"):
        server = zmq.auth.load_certificate(curve["server_certificate"])[0]
    if not server:
        raise ValueError("kvproto connector: a decode instance with curve needs the prefill instance's public key "
                         "(server_key, or server_certificate)")
    return CurveAuth(public_key=key(public), secret_key=key(secret), server_key=key(server))


def model_id(vllm_config: VllmConfig, settings: Settings) -> str:
    """The model both instances must serve: the setting, else vLLM's model and its revision."""
    if settings.model_id:
        return settings.model_id
    mc = vllm_config.model_config
    return f"{mc.model}@{mc.revision}" if mc.revision else str(mc.model)


def compat_key(vllm_config: VllmConfig, group_kinds: list[str]) -> str:
    """What decides the bytes of a KV page beyond the geometry kvproto checks itself, as readable
    text (a mismatch is reported with both values): model dtype, KV cache dtype, quantization, the
    attention backends of vLLM's registered layers (none are registered outside a serving worker),
    and each cache group's kind."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    factors = [f"dtype={str(mc.dtype).removeprefix('torch.')}", f"kv_cache_dtype={cc.cache_dtype}",
               f"quantization={mc.quantization or 'none'}"]
    backends = attention_backends(vllm_config)
    if backends:
        factors.append(f"attention={','.join(backends)}")
    factors.append(f"groups={'|'.join(group_kinds)}")
    return ";".join(factors)


def attention_backends(vllm_config: VllmConfig) -> list[str]:
    """The attention backends of the model's registered layers, sorted (none before the model loads)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    try:
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
    except Exception:  # noqa: BLE001 - no forward context outside a serving worker
        return []
    return sorted({layer.get_attn_backend().get_name() for layer in layers.values()})
