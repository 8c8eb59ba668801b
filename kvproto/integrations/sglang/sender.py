"""The prefill side of one request: SGLang's ``KVSender`` on a kvproto room.

Theory of operation
-------------------
SGLang's prefill scheduler drives a sender thus (``disaggregation/prefill.py``): it is made when
the request arrives (the kvproto room opens: BOOTSTRAPPING); ``poll()`` (MIN-reduced over the
attention TP group) says WAITING_FOR_INPUT once every paired decode rank's request has come;
then ``pop_decode_prefix_len()`` (the decode's prefix, which the kvproto room knows from those
requests), ``init(num_pages, aux_index)`` (the pages still to send, counted from that prefix),
and ``send(page_indices, state_indices, num_kv_tokens)`` per chunk as its prefill forward
finishes, the chunk that completes ``num_pages`` being the last: it carries the metadata slot.

kvproto knows a room by tokens; SGLang by pages. The sender counts the room as the decode's
prefix plus ``num_pages`` whole pages (the decode does the same: both sides move whole pages,
the last page's tail included, as SGLang's own backends do), starts its first chunk at the
prefix (``first_token``: no page is named for it) and gives each chunk the end of its pages.
SGLang's ``state_indices`` (``[]`` for a cache without states) give a hybrid model's Mamba slot, or
the pages of its window or indexer pool, with the last chunk (``cache.state_args``). ``poll`` maps kvproto's state to ``KVPoll`` (equal values); ``failure_exception`` raises
SGLang's ``KVTransferError`` with kvproto's code and reason (a failure SGLang saw on another
rank of the TP group, through the MIN-reduced poll, aborts this rank's room and is marked
``is_from_another_rank``); ``abort`` fails the room and tells the decode.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import CommonKVSender, KVTransferError

from kvproto.core import RoomState
from kvproto.integrations.sglang.cache import state_args
from kvproto.sync import KVSender


ANOTHER_RANK = "kvproto: the room failed on another rank of this TP group"


def failure(room_id: int, room: Any, recorded: str | None) -> KVTransferError:
    """SGLang's exception for a room SGLang saw fail: this rank's reason, or (the poll is
    MIN-reduced over the TP group) another rank's, in which case this rank's room, which may still
    be live, is aborted here (SGLang releases the request next) and the exception says so."""
    if recorded is not None:
        return KVTransferError(room_id, recorded)
    if room is None:
        return KVTransferError(room_id, "kvproto: no room was opened")
    try:
        room.failure_exception()
    except Exception as exc:  # TransferFailed or the LocalProtocolError that refused a call
        return KVTransferError(room_id, f"kvproto: {exc}")
    room.abort()
    return KVTransferError(room_id, ANOTHER_RANK, is_from_another_rank=True)


class KVProtoSender(CommonKVSender):
    """SGLang's KV sender on a kvproto prefill room (see the module docstring)."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._room: KVSender | None = None
        self._prefix: int | None = None
        self._pages = 0
        if self.conclude_state is None:
            self._room = mgr.endpoint.sender(bootstrap_room)

    # --- SGLang's calls, in the order its scheduler makes them ----------------------------------
    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._room is None or self.kv_mgr.request_status.get(self.bootstrap_room) == KVPoll.Failed:
            return self._conclude_failed()  # refused by SGLang's own checks (DP routing)
        state = self._room.poll()
        if state is RoomState.SUCCESS or state is RoomState.FAILED:
            self.conclude_state = int(state)
        return int(state)

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        if self._prefix is None and self._room is not None:
            self._prefix = self._room.decode_prefix
        return self._prefix or 0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        if self._room is None:
            return
        prefix = self.pop_decode_prefix_len()
        self._room.init(prefix + int(num_kv_indices) * self.kv_mgr.kv_args.page_size, aux_index, start_token=prefix)

    def send(self, kv_indices: Any, state_indices: list | None = None, num_kv_tokens: int | None = None,
             indices_event: Any = None) -> None:
        """One chunk's pages (SGLang's page indices, from where the last chunk ended). SGLang passes
        ``indices_event`` only to senders with ``supports_host_tensor_indices``, which this is not."""
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed) or self._room is None:
            return
        states = state_args(self.kv_mgr.kv_args, state_indices)  # the last chunk's (a hybrid model's)
        pages = kv_indices.tolist() if hasattr(kv_indices, "tolist") else list(kv_indices)
        self._pages += len(pages)
        self._room.send(pages, (self._prefix or 0) + self._pages * self.kv_mgr.kv_args.page_size,
                        state_slots=states.slots, group_pages=states.group_pages)

    def abort(self) -> None:
        if self._room is not None:
            self._room.abort()
        super().abort()

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        with self.kv_mgr.failure_lock:
            recorded = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        error = failure(self.bootstrap_room, self._room, recorded)
        self.clear()
        raise error

    def get_transfer_metric(self) -> KVTransferMetric:
        metric = KVTransferMetric()
        handle = None if self._room is None else self._room._handle
        if handle is not None and handle.stats.nbytes:
            metric.transfer_total_bytes = handle.stats.nbytes
            if handle.stats.elapsed is not None:
                metric.transfer_latency_s = handle.stats.phases.get("transfer")
        return metric

    # --- ---------------------------------------------------------------------------------------
    def _conclude_failed(self) -> int:
        if self._room is not None:
            self._room.abort()
        self.conclude_state = KVPoll.Failed
        return KVPoll.Failed
