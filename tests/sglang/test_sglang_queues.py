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
    first output token comes through SGLang's metadata slot (room id checked by SGLang). A fourth,
    aborted by the prefill between chunks, fails on both sides, and the decode releases its pages
    through SGLang's deferred release once kvproto's manager says no write can land."""
    requests = [Request(31, 2 * PAGE + 5, [PAGE, 2 * PAGE + 5]), Request(32, 3 * PAGE, [3 * PAGE]),
                Request(33, 4 * PAGE + 1, [2 * PAGE, 3 * PAGE, 4 * PAGE + 1]),
                Request(34, 3 * PAGE, [PAGE, 3 * PAGE], abort="prefill-mid")]
    pair = start_pair(tmp_path, p_tp=1, d_tp=1, mla=False, prefill=requests, decode=requests, entry=run_queue_rank)
    try:
        decode, _ = pair.results(("decode", 0))
        prefill, _ = pair.results(("prefill", 0))
    finally:
        pair.close()
    for r in requests:
        d = decode[r.room]
        if r.abort:  # aborted by the prefill between its chunks: both sides fail, through SGLang's paths
            assert prefill[r.room].state == 0 and "Aborted" in prefill[r.room].reason, prefill[r.room]
            assert d.state == 0 and "ABORTED" in d.reason, d
            continue
        assert prefill[r.room].state == 4, prefill
        assert d.state == 4 and d.mismatches == 0 and d.checked_bytes == r.tokens * 3 * 2 * 2 * 32, d
    assert decode[-1].state == 4, decode[-1].reason  # the aborted room's pages were released (once safe)
    assert decode[-1].holds >= 1  # SGLang held them for deferred release: the release went that way
