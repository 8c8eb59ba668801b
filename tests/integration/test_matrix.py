"""The geometry matrix over real NIXL and ZMQ, one process per rank, every byte verified.

Each case runs ``kvproto demo`` (``kvproto.demo.run``): prefill and decode ranks in separate
processes, rooms with random non-contiguous pages, content that is a pure function of
(room, layer, plane, head, token, byte) checked on every decode rank independently of the
geometry planner.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvproto.demo import DemoConfig, run
from kvproto.transport import available_transports

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SMALL = DemoConfig(rooms=6, layers=2, kv_heads=8, head_dim=16, blocks=256, min_tokens=1, max_tokens=300,
                   chunk_tokens=128, concurrency=3, timeout=60)

CASES = {
    "P1-D1": dict(prefill_tp=1, decode_tp=1),
    "P2-D1": dict(prefill_tp=2, decode_tp=1),
    "P4-D2": dict(prefill_tp=4, decode_tp=2),
    "P1-D2": dict(prefill_tp=1, decode_tp=2),
    "P2-D4": dict(prefill_tp=2, decode_tp=4),
    "P8-D2-4heads": dict(prefill_tp=8, decode_tp=2, kv_heads=4),
    "P2-D4-2heads": dict(prefill_tp=2, decode_tp=4, kv_heads=2),
    "MLA-P2-D1": dict(prefill_tp=2, decode_tp=1, mla=True, head_dim=72),
    "MLA-P1-D4": dict(prefill_tp=1, decode_tp=4, mla=True, head_dim=72),
    "block-16-to-64": dict(prefill_block=16, decode_block=64, chunk_tokens=128),
    "block-64-to-16": dict(prefill_block=64, decode_block=16, chunk_tokens=128),
    "HND-to-NHD-P1-D2": dict(prefill_tp=1, decode_tp=2, prefill_layout="HND", decode_layout="NHD"),
    "NHD-to-HND-P1-D2": dict(prefill_tp=1, decode_tp=2, prefill_layout="NHD", decode_layout="HND"),
    "3-chunk-prefill": dict(tokens=300, chunk_tokens=128),
    "prefix-hit-4-of-7-blocks": dict(tokens=7 * 16, prefix_tokens=4 * 16),
    "full-prefix-hit": dict(tokens=5 * 16, prefix_tokens=5 * 16),
    "exact-multiple-prompt": dict(tokens=8 * 16),
}


@pytest.mark.parametrize("path", ["auto", "sliced"])
@pytest.mark.parametrize("case", list(CASES))
def test_matrix_geometry_moves_every_byte(case: str, path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every decode rank holds exactly the reference bytes of every head it owns, on the default
    path (direct where pages match byte for byte, else staged) and on the sliced fallback."""
    cfg = dataclasses.replace(SMALL, path=path, staging_mb=1, **CASES[case])
    code = run(cfg)
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    assert f"in {cfg.rooms} rooms" in out and "OK, 0 mismatching bytes" in out
    paths = out.split("paths: ", 1)[1].split(";", 1)[0]
    if case == "full-prefix-hit":
        assert paths == "none"  # nothing to move, yet every room completed
    elif path == "sliced":
        assert paths == "sliced"
    else:
        assert paths in ("direct", "staged-cpu"), paths


@pytest.mark.skipif("mooncake" not in available_transports(), reason="Mooncake's Transfer Engine is not importable")
@pytest.mark.parametrize("case", list(CASES))
def test_matrix_geometry_over_mooncake(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The same matrix over the second real adapter (Mooncake's Transfer Engine over TCP), on the
    default path: the protocol above the adapter is the same code."""
    cfg = dataclasses.replace(SMALL, transport="mooncake", staging_mb=1, **CASES[case])
    code = run(cfg)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert f"in {cfg.rooms} rooms" in captured.out and "OK, 0 mismatching bytes" in captured.out


HYBRID = {
    "P1-D2": dict(prefill_tp=1, decode_tp=2),
    "P2-D1": dict(prefill_tp=2, decode_tp=1),
    "block-16-to-32-HND": dict(prefill_tp=2, decode_tp=1, decode_block=32, decode_layout="HND"),
}


@pytest.mark.parametrize("case", list(HYBRID))
@pytest.mark.parametrize("preset", ["gdn", "mla-indexer", "swa"])
def test_matrix_hybrid_presets_move_every_group(preset: str, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The three hybrid families, one process per rank over NIXL: every group of every room (full
    attention and Gated DeltaNet state; an MLA latent and its indexer cache; full and sliding-window
    layers) holds exactly the reference bytes on every decode rank, TP both ways and across a block
    size and layout mismatch."""
    cfg = dataclasses.replace(SMALL, preset=preset, staging_mb=1, kv_heads=4, prefix_tokens=32, window=100,
                              **HYBRID[case])
    code = run(cfg)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert f"hybrid cache ({preset})" in captured.out
    assert f"in {cfg.rooms} rooms" in captured.out and "OK, 0 mismatching bytes" in captured.out
