"""The decode side of one request: SGLang's ``KVReceiver`` on a kvproto room.

Theory of operation
-------------------
SGLang's decode scheduler (``disaggregation/decode.py``) makes a receiver when the request
arrives, resolves the prefill DP rank (``try_ensure_parallel_info``, SGLang's), calls
``init(prefill_dp_rank)`` (the kvproto room opens at that DP group's kvproto bootstrap address:
BOOTSTRAPPING, then WAITING_FOR_INPUT once the handshake with the prefill ranks is done), and,
once it has allocated KV space, ``send_metadata(page_indices, aux_index, state_indices,
decode_prefix_len)``: the pages for the tokens past the decode's own prefix hit. ``poll()`` is
MIN-reduced over the attention TP group.

SGLang names only the pages past the prefix; kvproto's destination names a page for every token
from 0. The prefix's pages are never written (the prefill sends from the prefix on), so the
receiver names placeholders for them: distinct pages of the pool not among the room's
(``placeholder_pages``). The room's token count is the prefix plus whole pages, as on the
prefill (``sender``).

A decode room reports FAILED only once no write into its pages can still land (kvproto's
guarantee), so SGLang may free the pages as soon as ``poll()`` says FAILED; after ``abort()``
the room says TRANSFERRING until its prefill ranks have answered (or the drain deadline). The
poll SGLang acts on is MIN-reduced over the TP group, so a room may fail on another rank while
this rank's is still live: ``failure_exception`` then aborts it, and with SGLang's deferred
release (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1``) the manager's
``is_abort_release_safe`` holds the pages until that room has ended too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from kvproto.core import RoomState
from kvproto.wire import ErrorCode
from kvproto.integrations.sglang.cache import state_args
from kvproto.integrations.sglang.sender import failure
from kvproto.sync import KVReceiver


_PEER_LOST = frozenset({ErrorCode.PEER_GONE, ErrorCode.BOOTSTRAP_TIMEOUT, ErrorCode.TRANSPORT_ERROR})


def placeholder_pages(count: int, pages: Sequence[int], num_blocks: int) -> list[int]:
    """``count`` distinct pages below ``num_blocks`` not in ``pages`` (destinations no write reaches)."""
    taken = set(pages)
    out: list[int] = []
    page = 0
    while len(out) < count:
        if page >= num_blocks:
            raise ValueError(f"kvproto: no {count} spare pages for the prefix's placeholders in a pool of {num_blocks}")
        if page not in taken:
            out.append(page)
        page += 1
    return out


class KVProtoReceiver(CommonKVReceiver):
    """SGLang's KV receiver on a kvproto decode room (see the module docstring)."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._room: KVReceiver | None = None
        self.bootstrap_infos: list[dict[str, Any]] | None = None
        self.prefill_dp_rank = 0

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        address = self.kv_mgr.kvproto_bootstrap(self.bootstrap_addr, prefill_dp_rank)
        if address is None:
            self._fail(f"kvproto: no kvproto bootstrap address for DP rank {prefill_dp_rank} of the prefill server "
                       f"at {self.bootstrap_addr}")
            return
        self.prefill_dp_rank = prefill_dp_rank
        self.bootstrap_infos = [{"kvproto_bootstrap": address, "is_dummy": False}]
        self._room = self.kv_mgr.endpoint.receiver(self.bootstrap_room, address)
        self.kv_mgr.watch_room(self.bootstrap_room, self._room)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: list | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices: Any = None) -> None:
        if destination != KVTransferDestination.DEVICE or device_kv_indices is not None:
            raise NotImplementedError("kvproto: host KV destinations (HiSparse, host receive) are not supported")
        if self._room is None:
            if self.conclude_state is None:
                self._fail("kvproto: send_metadata before the room was bootstrapped")
            return
        states = state_args(self.kv_mgr.kv_args, state_indices)
        block = self.kv_mgr.kv_args.page_size
        prefix = int(decode_prefix_len or 0)
        if prefix % block:
            self._room.abort()
            self._fail(f"kvproto: a decode prefix of {prefix} tokens is not whole pages of {block}")
            return
        pages = kv_indices.tolist() if hasattr(kv_indices, "tolist") else list(kv_indices)
        skipped = placeholder_pages(prefix // block, pages, self.kv_mgr.kvproto_cache.geometry.num_blocks)
        self._room.init(skipped + pages, prefix + len(pages) * block, prefix_tokens=prefix, aux_slot=aux_index,
                        state_slots=states.slots, group_pages=states.group_pages)
        self.init_time = time.time()

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._room is None:
            return KVPoll.Bootstrapping
        state = self._room.poll()
        if state is RoomState.SUCCESS:
            self.kv_mgr.forget_room(self.bootstrap_room)
        if state is RoomState.SUCCESS or state is RoomState.FAILED:
            self.conclude_state = int(state)
        return int(state)

    def abort(self) -> None:
        """Stop the room and tell the prefill; FAILED follows once no write can land."""
        if self.conclude_state is not None:
            return
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.abort_notified = True
        if self._room is None:
            self.conclude_state = KVPoll.Failed
            return
        self._room.abort()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self.abort_notified and self._room is not None:
            self._room.abort()
        self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        return self._room is None or self._room.poll() in (RoomState.SUCCESS, RoomState.FAILED)

    def failure_exception(self) -> None:
        with self.kv_mgr.failure_lock:
            recorded = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        error = failure(self.bootstrap_room, self._room, recorded)
        if self._room is not None and self._room.code in _PEER_LOST:
            # the prefill server may have restarted elsewhere: read its address anew next time
            self.kv_mgr.forget_bootstrap(self.bootstrap_addr, self.prefill_dp_rank)
        if not self.kv_mgr.enable_deferred_decode_kv_release:
            self.kv_mgr.forget_room(self.bootstrap_room)  # SGLang frees the pages now, whatever we say
        self.conclude_state = KVPoll.Failed
        self.clear()
        raise error

    def clear(self) -> None:
        if not self.kv_mgr.enable_deferred_decode_kv_release or self.is_abort_release_safe():
            self.kv_mgr.forget_room(self.bootstrap_room)  # else held for is_abort_release_safe
        super().clear()

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
