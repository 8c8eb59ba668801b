"""Real prefill and decode rank processes on SGLang's own CPU memory pools, metadata buffers and
KVArgs, moving every K/V and metadata byte through kvproto (``sglang_harness``)."""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("sglang.srt")  # (a bare "sglang" may be this folder)

from sglang_harness import PAGE, Request, start_pair  # noqa: E402

from kvproto.integrations.sglang.sender import ANOTHER_RANK  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.nixl]

SUCCESS, FAILED = 4, 0


def rooms(base: int) -> list[Request]:
    """Chunked prompts of whole and partial pages, one with a decode prefix, and one room aborted
    by each side at each point, all run concurrently."""
    return [
        Request(base + 1, 5 * PAGE + 3, [2 * PAGE, 4 * PAGE, 5 * PAGE + 3]),
        Request(base + 2, 3 * PAGE, [3 * PAGE]),
        Request(base + 3, 6 * PAGE + 9, [3 * PAGE, 6 * PAGE + 9], prefix=2 * PAGE),
        Request(base + 4, 7, [7]),
        Request(base + 5, 4 * PAGE, [2 * PAGE, 4 * PAGE], abort="decode-before-metadata"),
        Request(base + 6, 4 * PAGE, [PAGE, 2 * PAGE, 4 * PAGE], abort="decode-after-metadata"),
        Request(base + 7, 4 * PAGE + 1, [PAGE, 2 * PAGE, 4 * PAGE + 1], abort="prefill-mid"),
    ]


def run(tmp_path, p_tp: int, d_tp: int, *, mla: bool = False, requests: list[Request] | None = None):
    requests = requests or rooms(1000 * (p_tp * 10 + d_tp) + (500 if mla else 0))
    _, prefill, decode = run_pair(tmp_path, p_tp, d_tp, requests, mla=mla)
    return requests, prefill, decode


def run_pair(tmp_path, p_tp: int, d_tp: int, requests: list[Request], **options):
    """Every rank's (results, untouched) of a pair that served ``requests`` (``options``: start_pair's)."""
    pair = start_pair(tmp_path, p_tp=p_tp, d_tp=d_tp, prefill=requests, decode=requests, **{"mla": False, **options})
    try:
        decode = [pair.results(("decode", r)) for r in range(d_tp)]
        prefill = [pair.results(("prefill", r)) for r in range(p_tp)]
    finally:
        pair.close()
    return pair, prefill, decode


def room_results(requests: list[Request], prefill, decode):
    """(side, request, its result on one rank) for every rank of both sides, once each rank's
    pages it never handed out are checked untouched."""
    for side, ranks in (("decode", decode), ("prefill", prefill)):
        for results, untouched in ranks:
            assert untouched
            for req in requests:
                yield side, req, results[req.room]


@pytest.mark.parametrize("p_tp, d_tp, mla", [(1, 1, False), (1, 2, False), (2, 1, False), (1, 2, True),
                                             (2, 1, True)],
                         ids=["tp1-1", "tp1-2", "tp2-1", "mla-tp1-2", "mla-tp2-1"])
def test_sglang_pair_rooms_byte_exact_and_aborts(tmp_path, p_tp, d_tp, mla):
    """Every room not aborted succeeds on every rank of both sides; every K/V (or latent) byte of
    every token past the decode's prefix, of every head each decode rank holds, and every metadata
    byte is the prefill's; no page the decode never handed out was written. A room aborted by the
    decode (before or after its metadata) or by the prefill (between chunks) fails on every rank
    of both sides, with kvproto's reason (ABORTED) through SGLang's failure_exception()."""
    requests, prefill, decode = run(tmp_path, p_tp, d_tp, mla=mla)
    for side, ranks in (("decode", decode), ("prefill", prefill)):
        for results, untouched in ranks:
            assert untouched
        for req in requests:
            got = [results[req.room] for results, _ in ranks]
            if req.abort is None:
                for r in got:
                    assert r.state == SUCCESS, (side, r)
                    assert side == "prefill" or (r.mismatches == 0 and r.checked_bytes > 0), r
                continue
            # every rank fails; a rank whose own room had not failed yet when SGLang's reduced poll
            # said FAILED names another rank (and aborted its room); some rank names the abort
            assert all(r.state == FAILED and "KVTransferError" in r.reason for r in got), (side, got)
            aborted = ["ABORTED" in r.reason or "Aborted" in r.reason for r in got]
            assert any(aborted), (side, got)
            assert all(a or ANOTHER_RANK in r.reason for a, r in zip(aborted, got)), (side, got)


def test_sglang_pair_prefill_killed_mid_transfer(tmp_path):
    """The prefill rank's process is killed (SIGKILL) after the first of three chunks: the decode's
    room fails through SGLang's poll and failure_exception(), with kvproto's reason (the prefill is
    gone), within the heartbeat timeout; it never hangs, and the decode rank keeps serving (it
    reports, and closes cleanly)."""
    req = Request(9001, 4 * PAGE, [PAGE, 2 * PAGE, 4 * PAGE], stall_after=1)
    pair = start_pair(tmp_path, p_tp=1, d_tp=1, mla=False, prefill=[req], decode=[req])
    try:
        pair.wait("stalled", ("prefill", 0))
        killed = time.monotonic()
        pair.processes[("prefill", 0)].kill()
        results, _ = pair.results(("decode", 0))
        waited = time.monotonic() - killed
    finally:
        pair.close()
    r = results[9001]
    assert r.state == FAILED
    assert "KVTransferError" in r.reason and ("PEER_GONE" in r.reason or "TRANSPORT" in r.reason), r.reason
    assert waited < 30


STATE_BYTES = {"mamba2": 2 * (48 * 3 * 2 + 4 * 8 * 4 * 4), "gdn": 2 * (32 * 3 * 2 + 4 * 4 * 4 * 4),
               "kimi": 2 * (3 * 32 * 2 + 4 * 4 * 4 * 4)}
"""Bytes of one request's state over both state layers at TP 1: per layer the conv state (channels x
kernel - 1, bf16) and the temporal state (heads x head dim x state, float32)."""


@pytest.mark.parametrize("model, p_tp, d_tp", [("mamba2", 2, 2), ("mamba2", 1, 2), ("mamba2", 2, 1), ("gdn", 1, 2),
                                               ("gdn", 2, 1), ("kimi", 1, 2), ("kimi", 2, 1)],
                         ids=["mamba2-tp2-2", "mamba2-tp1-2", "mamba2-tp2-1", "gdn-tp1-2", "gdn-tp2-1", "kimi-tp1-2",
                              "kimi-tp2-1"])
def test_sglang_pair_mamba_hybrid_moves_kv_and_state(tmp_path, model, p_tp, d_tp):
    """A hybrid model (SGLang's HybridLinearKVPool: full attention on layers 0, 2, 4, a linear
    attention or SSM state on 1, 3): every KV byte of the attention layers, every byte of the
    request's state slot and the metadata slot land; the state moved from the prefill's slot into
    another decode slot, each decode rank holding exactly its share of every conv channel and
    temporal head by the model's own split (GDN's Q | K | V and Kimi's q | k | v sub-blocks, which
    KVArgs name, and a Nemotron-H Mamba2 mixer's x | B | C, which its model config gives, each split
    over TP on its own; Kimi's conv state rows of channels), between different TP sizes both ways;
    no other state slot written; with a decode prefix too, and aborted rooms fail."""
    requests = [r for r in rooms(7000 + 100 * list(STATE_BYTES).index(model) + 10 * p_tp + d_tp)
                if r.abort in (None, "decode-after-metadata")]
    pair = start_pair(tmp_path, p_tp=p_tp, d_tp=d_tp, mla=False, prefill=requests, decode=requests, mamba=model)
    try:
        decode = [pair.results(("decode", r)) for r in range(d_tp)]
        prefill = [pair.results(("prefill", r)) for r in range(p_tp)]
    finally:
        pair.close()
    for side, ranks in (("decode", decode), ("prefill", prefill)):
        for results, untouched in ranks:
            assert untouched
            for req in requests:
                r = results[req.room]
                if req.abort:
                    assert r.state == FAILED, (side, r)
                else:
                    assert r.state == SUCCESS, (side, r)
                    assert side == "prefill" or (r.mismatches == 0 and r.state_bytes == STATE_BYTES[model] // d_tp
                                                 and r.checked_bytes > r.state_bytes), r


def test_sglang_pair_unnamed_conv_between_tp_sizes_is_refused(tmp_path):
    """A Mamba2 state whose conv sub-blocks neither KVArgs nor the model config name (a Mamba2 pool
    beside a model config SGLang does not read as a Mamba2 mixer): a decode of TP 2 meeting a prefill
    of TP 1 refuses it when it first reads the prefill's parallel info (where SGLang refuses a page
    size or KV dtype mismatch), with the reason, before any room; never a hang."""
    req = Request(8001, 2 * PAGE, [2 * PAGE])
    pair = start_pair(tmp_path, p_tp=1, d_tp=2, mla=False, prefill=[req], decode=[req], mamba="mamba2-unnamed")
    errors = []
    try:
        for rank in range(2):
            with pytest.raises(AssertionError) as info:
                pair.results(("decode", rank))
            errors.append(str(info.value))
    finally:
        pair.close()
    # Each rank refuses (SGLang's scheduler dies of it, as of a page size mismatch); a rank whose
    # peer refused first may instead see that peer gone from the TP group's poll reduction.
    refused = [re.search(r"moves this Mamba state between equal attention TP sizes only \(prefill 1, decode 2\): "
                         r"SGLang's KVArgs name no conv sub-blocks", e) is not None for e in errors]
    assert any(refused), errors
    assert all(r or "Connection closed by peer" in e for r, e in zip(refused, errors)), errors


def test_sglang_pair_mamba2_replicated_groups_between_tp_sizes_fail_naming_the_group(tmp_path):
    """A Mamba2 mixer of one group, which SGLang's mixer replicates on every rank of TP 2 (the
    group count extended to the TP size): the conv state's global sizes differ between TP 1 and 2,
    so kvproto refuses the pair at registration and the room fails on both sides with the reason
    naming the state group; nothing hangs."""
    req = Request(8101, 2 * PAGE, [2 * PAGE])
    pair = start_pair(tmp_path, p_tp=1, d_tp=2, mla=False, prefill=[req], decode=[req], mamba="mamba2-1group")
    try:
        decode = [pair.results(("decode", r))[0][8101] for r in range(2)]
        prefill = pair.results(("prefill", 0))[0][8101]
    finally:
        pair.close()
    for r in [*decode, prefill]:
        assert r.state == FAILED and "KVTransferError" in r.reason, r
    assert any("'mamba'" in r.reason and "INCOMPATIBLE_GEOMETRY" in r.reason for r in decode), decode


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1)], ids=["swa-tp1-1", "swa-tp1-2", "swa-tp2-1"])
def test_sglang_pair_sliding_window_moves_the_window_pool(tmp_path, p_tp, d_tp):
    """A sliding-window model (SGLang's SWAKVPool: full attention on layers 0, 2, 4, a window pool
    for layers 1, 3, StateType.SWA): every KV byte of the full layers past the decode's prefix, and
    every byte of the window's tokens in the window pool (the pages both servers name with the last
    chunk, from ``⌊max(prefix, length − window) / page⌋``), each decode rank holding its heads,
    between TP sizes both ways; no page of either pool the decode never handed out written; aborted
    rooms fail."""
    from sglang_harness import window_start

    requests = [r for r in rooms(9100 + 10 * p_tp + d_tp) if r.abort in (None, "decode-after-metadata")]
    requests.append(Request(9199, 9 * PAGE + 2, [3 * PAGE, 6 * PAGE, 9 * PAGE + 2], prefix=7 * PAGE))  # prefix in window
    _, prefill, decode = run_pair(tmp_path, p_tp, d_tp, requests, swa=True)
    from sglang_harness import HEADS, HEAD_DIM

    for side, req, r in room_results(requests, prefill, decode):
        if req.abort:
            assert r.state == FAILED, (side, r)
            continue
        assert r.state == SUCCESS, (side, r)
        window = (req.tokens - window_start(req)) * 2 * 2 * (HEADS // d_tp if d_tp <= HEADS else 1) * \
            HEAD_DIM * 2  # tokens x K, V x 2 layers x held heads x bf16 head
        assert side == "prefill" or (r.mismatches == 0 and r.state_bytes == window > 0
                                     and r.checked_bytes > r.state_bytes), (req, r)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1)], ids=["dsa-tp1-1", "dsa-tp1-2", "dsa-tp2-1"])
def test_sglang_pair_sparse_attention_moves_the_indexer(tmp_path, monkeypatch, p_tp, d_tp):
    """A sparse-attention model (SGLang's DSATokenToKVPool: an MLA latent and, on every layer, an
    indexer cache of index keys and scales; StateType.DSA), on SGLang's pages of 64 tokens: every
    latent byte past the decode's prefix, and every byte of the indexer's pages past it (the KV's
    pages, which both servers name with the last chunk), on every decode rank (the indexer is
    replicated over TP as the latent is), between TP sizes both ways; no page the decode never
    handed out written."""
    page = 64
    monkeypatch.setenv("KVPROTO_SGLANG_PAGE", str(page))  # (the rank processes read it at start)
    base = 9300 + 10 * p_tp + d_tp
    requests = [Request(base + 1, 3 * page + 5, [page, 2 * page, 3 * page + 5]),
                Request(base + 2, 2 * page, [2 * page]),
                Request(base + 3, 4 * page + 9, [2 * page, 4 * page + 9], prefix=page),
                Request(base + 4, 2 * page + 1, [page, 2 * page + 1], abort="decode-after-metadata")]
    _, prefill, decode = run_pair(tmp_path, p_tp, d_tp, requests, mla=True, dsa=True)
    for side, req, r in room_results(requests, prefill, decode):
        if req.abort:
            assert r.state == FAILED, (side, r)
            continue
        assert r.state == SUCCESS, (side, r)
        pages = -(-(req.tokens - req.prefix) // page)
        index = 3 * pages * page * (128 + 4)  # 3 layers x pages x (fp8 key + fp32 scale) a token
        assert side == "prefill" or (r.mismatches == 0 and r.state_bytes == index
                                     and r.checked_bytes > r.state_bytes), (req, r)


def test_sglang_pair_over_the_cuda_ipc_transport(tmp_path, monkeypatch):
    """KVPROTO_SGLANG_TRANSPORT=cuda-ipc on both servers: the kernel path where a decode rank's GPU
    memory can be mapped, NIXL for every other peer; on this CPU the pages are host memory, so the
    rooms go through its NIXL fallback, byte-exact, TP 1 -> 2."""
    monkeypatch.setenv("KVPROTO_SGLANG_TRANSPORT", "cuda-ipc")
    requests = [r for r in rooms(9500) if r.abort is None]
    pair, prefill, decode = run_pair(tmp_path, 1, 2, requests)
    assert set(pair.transports.values()) == {"CudaIpcTransport"}, pair.transports
    for side, _, r in room_results(requests, prefill, decode):
        assert r.state == SUCCESS and (side == "prefill" or (r.mismatches == 0 and r.checked_bytes > 0)), r


@pytest.mark.parametrize("p_tp, d_tp, mla, hybrid", [(1, 2, False, {}), (2, 1, False, {}), (1, 2, True, {}),
                                                     (1, 2, False, {"mamba": "gdn"}), (2, 1, False, {"swa": True})],
                         ids=["tp1-2", "tp2-1", "mla-tp1-2", "gdn-tp1-2", "swa-tp2-1"])
def test_sglang_pair_with_staging_buffers_moves_staged(tmp_path, monkeypatch, p_tp, d_tp, mla, hybrid):
    """KVPROTO_SGLANG_STAGING_MIB on both servers: kvproto sees SGLang's pools as tensors too, and
    rooms between different attention TP sizes gather into the staging buffers and move as bulk
    writes (kvproto's cost model picks the staged path for every such room here), byte-exact, with a
    decode prefix and chunks; an MLA latent, whole on every rank, still moves direct; a GDN hybrid's
    state rides in the pieces' state block, a sliding window's pool (named by the engine) in writes
    of its own, every byte checked as without staging."""
    monkeypatch.setenv("KVPROTO_SGLANG_STAGING_MIB", "8")
    base = 9600 + 10 * p_tp + d_tp + (5 if mla else 0) + (100 if hybrid else 0) + (100 if "swa" in hybrid else 0)
    requests = [r for r in rooms(base) if r.abort is None]
    _, prefill, decode = run_pair(tmp_path, p_tp, d_tp, requests, mla=mla, **hybrid)
    for side, _, r in room_results(requests, prefill, decode):
        assert r.state == SUCCESS and (side == "prefill" or (r.mismatches == 0 and r.checked_bytes > 0
                                                             and (not hybrid or r.state_bytes > 0))), r
    paths = [r.paths for results, _ in prefill for r in results.values()]
    want = "direct" if mla else "staged"  # (an MLA latent goes whole to every decode rank: one run a page)
    window = "swa" in hybrid  # (the window pool's own writes move sliced: a named window is never staged)
    assert paths and all(any(p.startswith(want) for p in ps) and (window or "sliced" not in ps) for ps in paths), paths
