"""Real prefill and decode rank processes on SGLang's own CPU memory pools, metadata buffers and
KVArgs, moving every K/V and metadata byte through kvproto (``sglang_harness``)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from sglang_harness import PAGE, Request, start_pair  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.nixl]

SUCCESS, FAILED = 4, 0


def rooms(base: int) -> list[Request]:
    """Chunked prompts of whole and partial pages, one with a decode prefix, run concurrently."""
    return [
        Request(base + 1, 5 * PAGE + 3, [2 * PAGE, 4 * PAGE, 5 * PAGE + 3]),
        Request(base + 2, 3 * PAGE, [3 * PAGE]),
        Request(base + 3, 6 * PAGE + 9, [3 * PAGE, 6 * PAGE + 9], prefix=2 * PAGE),
        Request(base + 4, 7, [7]),
    ]


def run(tmp_path, p_tp: int, d_tp: int, *, mla: bool = False, requests: list[Request] | None = None):
    requests = requests or rooms(1000 * (p_tp * 10 + d_tp) + (500 if mla else 0))
    pair = start_pair(tmp_path, p_tp=p_tp, d_tp=d_tp, mla=mla, prefill=requests, decode=requests)
    try:
        decode = [pair.results(("decode", r)) for r in range(d_tp)]
        prefill = [pair.results(("prefill", r)) for r in range(p_tp)]
    finally:
        pair.close()
    return requests, prefill, decode


@pytest.mark.parametrize("p_tp, d_tp, mla", [(1, 1, False), (1, 2, False), (2, 1, False), (1, 2, True),
                                             (2, 1, True)],
                         ids=["tp1-1", "tp1-2", "tp2-1", "mla-tp1-2", "mla-tp2-1"])
def test_sglang_pair_moves_every_byte(tmp_path, p_tp, d_tp, mla):
    """Every room succeeds on every rank of both sides; every K/V (or latent) byte of every token
    past the decode's prefix, every head each decode rank holds, and every metadata byte is the
    prefill's, and no page the decode never handed out was written."""
    requests, prefill, decode = run(tmp_path, p_tp, d_tp, mla=mla)
    for results, untouched in decode:
        assert untouched
        for req in requests:
            r = results[req.room]
            assert r.state == SUCCESS, r.reason
            assert r.mismatches == 0 and r.checked_bytes > 0
    for results, _ in prefill:
        assert all(results[req.room].state == SUCCESS for req in requests), results
