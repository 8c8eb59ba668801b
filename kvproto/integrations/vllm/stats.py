"""kvproto's room figures in vLLM's metrics: the periodic log line and ``/metrics``.

Theory of operation
-------------------
vLLM collects connector figures through three hooks: each worker's ``get_kv_connector_stats``
(and the scheduler's) returns a ``KVConnectorStats`` every step; vLLM aggregates them across the
engine's TP ranks with ``aggregate`` and ships the ``data`` dict to its logger process, which
rebuilds the object with the connector's ``build_kv_connector_stats``, prints ``reduce()`` as the
"KV Transfer metrics" line every interval, and feeds ``/metrics`` through the object that
``build_prom_metrics`` made. ``KVProtoStats`` is that object: plain lists, one entry per room end
(per TP rank: a room of a TP-2 instance counts twice, as each rank moves its share), appended as
each room ends and taken (then reset) once per step. Bytes and seconds come from kvproto's
``RoomStats`` (the in-thread facade; rooms of ``endpoint_process`` report their ends and codes
only).

What it records, by the side of the room: seconds of the transfer phase (from the decode's
request, or the first chunk, to the end) and bytes of every room that succeeded; the error code of
every room that failed; prefill rooms that *expired* (no decode asked for them before their
bootstrap deadline: ``BOOTSTRAP_TIMEOUT`` on the prefill side, the autoscaling signal vLLM's
NixlConnector reports as ``num_kv_expired_reqs``); prefill requests whose room was lost to a
preemption (counted by the scheduler role).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvproto.core import RoomState
from kvproto.wire import ErrorCode

KEYS = ("send_seconds", "send_bytes", "recv_seconds", "recv_bytes", "send_failed", "recv_failed", "expired",
        "preempted")
"""Every list of ``KVProtoStats.data``: seconds and bytes of rooms that succeeded, by side; the
code names of rooms that failed, by side; expired prefill rooms and preempted prefill requests (1 each)."""


@dataclass
class KVProtoStats(KVConnectorStats):
    """Room figures of one interval (see the module docstring); serializable as plain lists."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {key: [] for key in KEYS}

    def room_ended(self, room: Any, state: RoomState, code: Any, *, sending: bool) -> None:
        """A room of this worker ended (``room``: the facade's handle; ``sending``: the prefill side)."""
        side = "send" if sending else "recv"
        if state is RoomState.SUCCESS:
            stats = getattr(room, "stats", None)
            if stats is not None:
                self.data[f"{side}_seconds"].append(stats.phases.get("transfer", 0.0))
                self.data[f"{side}_bytes"].append(stats.nbytes)
            return
        name = code.name if isinstance(code, ErrorCode) else str(code)
        self.data[f"{side}_failed"].append(name)
        if sending and code == ErrorCode.BOOTSTRAP_TIMEOUT:
            self.data["expired"].append(1)

    def take(self) -> KVProtoStats | None:
        """This interval's figures (None if there are none), and a fresh interval."""
        if self.is_empty():
            return None
        taken = KVProtoStats(data=self.data)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for side, label in (("send", "sent"), ("recv", "received")):
            seconds, nbytes = self.data[f"{side}_seconds"], self.data[f"{side}_bytes"]
            if seconds:
                mb = sum(nbytes) / 2**20
                ordered = sorted(seconds)
                out[f"Rooms {label}"] = len(seconds)
                out[f"Avg {side} time (ms)"] = round(1e3 * sum(seconds) / len(seconds), 3)
                out[f"P90 {side} time (ms)"] = round(1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3)
                out[f"MB {label}"] = round(mb, 3)
                out[f"Throughput {side} (MB/s)"] = round(mb / sum(seconds), 3) if sum(seconds) else 0.0
            if self.data[f"{side}_failed"]:
                out[f"Rooms failed ({side})"] = len(self.data[f"{side}_failed"])
        out["Num KV expired reqs"] = len(self.data["expired"])
        if self.data["preempted"]:
            out["Preempted prefill reqs"] = len(self.data["preempted"])
        return out


class KVProtoPromMetrics(KVConnectorPromMetrics):
    """``/metrics`` series: ``vllm:kvproto_transfer_seconds`` and ``vllm:kvproto_bytes`` (by side),
    ``vllm:kvproto_rooms_failed`` (by side and code), ``vllm:kvproto_num_kv_expired_reqs`` and
    ``vllm:kvproto_preempted_reqs``."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.seconds = self._histogram_cls(
            name="vllm:kvproto_transfer_seconds", documentation="Seconds a kvproto room spent transferring, per side",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
            labelnames=[*labelnames, "side"])
        self.bytes = self._counter_cls(name="vllm:kvproto_bytes", documentation="KV bytes moved by kvproto rooms",
                                       labelnames=[*labelnames, "side"])
        self.failed = self._counter_cls(name="vllm:kvproto_rooms_failed",
                                        documentation="kvproto rooms that failed, by side and error code",
                                        labelnames=[*labelnames, "side", "code"])
        self.expired = self._counter_cls(
            name="vllm:kvproto_num_kv_expired_reqs",
            documentation="Prefill requests whose blocks no decode asked for before the lease ran out",
            labelnames=labelnames)
        self.preempted = self._counter_cls(
            name="vllm:kvproto_preempted_reqs",
            documentation="Prefill requests preempted mid-prompt (their room was aborted)", labelnames=labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for side in ("send", "recv"):
            hist = self.seconds.labels(*labels, side)
            for s in transfer_stats_data.get(f"{side}_seconds", ()):
                hist.observe(s)
            moved = sum(transfer_stats_data.get(f"{side}_bytes", ()))
            if moved:
                self.bytes.labels(*labels, side).inc(moved)
            for code in transfer_stats_data.get(f"{side}_failed", ()):
                self.failed.labels(*labels, side, code).inc()
        if n := len(transfer_stats_data.get("expired", ())):
            self.expired.labels(*labels).inc(n)
        if n := len(transfer_stats_data.get("preempted", ())):
            self.preempted.labels(*labels).inc(n)
