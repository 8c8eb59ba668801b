"""Requests through SGLang's own PrefillBootstrapQueue -> send_kv_chunk -> DecodePreallocQueue ->
DecodeTransferQueue on a stub scheduler (``sglang_queues``), KV moved by kvproto, byte-exact."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt")  # (a bare "sglang" may be this folder)

from sglang_harness import PAGE, Request, start_pair  # noqa: E402
from sglang_queues import run_queue_rank  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.nixl]


def test_sglang_queues_move_requests_byte_exact(tmp_path):
    """Three concurrent requests (chunked, partial last pages) leave SGLang's prefill queue, are sent
    chunk by chunk by SGLang's send_kv_chunk, preallocated and received by SGLang's decode queues:
    every K/V byte of every prompt token lands where the decode's own req_to_token row says, and the
    first output token comes through SGLang's metadata slot (room id checked by SGLang)."""
    requests = [Request(31, 2 * PAGE + 5, [PAGE, 2 * PAGE + 5]), Request(32, 3 * PAGE, [3 * PAGE]),
                Request(33, 4 * PAGE + 1, [2 * PAGE, 3 * PAGE, 4 * PAGE + 1])]
    pair = start_pair(tmp_path, p_tp=1, d_tp=1, mla=False, prefill=requests, decode=requests, entry=run_queue_rank)
    try:
        decode, _ = pair.results(("decode", 0))
        prefill, _ = pair.results(("prefill", 0))
    finally:
        pair.close()
    for r in requests:
        assert prefill[r.room].state == 4, prefill
        d = decode[r.room]
        assert d.state == 4 and d.mismatches == 0 and d.checked_bytes == r.tokens * 3 * 2 * 2 * 32, d
