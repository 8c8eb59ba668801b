"""The process facades (``kvproto.sync_process``) on CUDA caches: shared tensors and events."""

from __future__ import annotations

import time

import pytest
import torch

from kvproto.core import RoomState
from kvproto.geometry import Layout

from .conftest import config
from .test_gpu import cuda_cache, token_heads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nixl,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]



def test_gpu_process_facades_share_cuda_caches_and_layer_events() -> None:
    """ProcessPrefill / ProcessDecode on CUDA caches: the children map the engine's own tensors
    (CUDA IPC through torch.multiprocessing), a layer's ``ready`` is an interprocess CUDA event the
    engine records after ~0.15 s of GPU work: ``send`` returns at once, nothing lands before the
    event, and the room lands byte-exact."""
    from kvproto.sync_process import ProcessDecode, ProcessPrefill

    src_kv, src = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=11)
    dst_kv, dst = cuda_cache(8, 1, 0, Layout.NHD, 16, seed=12)
    n, src_pages, dst_pages = 32, [9, 3], [12, 40]
    cfg = config("nixl", staging_bytes=0)
    with ProcessPrefill(src_kv, config=cfg) as prefill, ProcessDecode(dst_kv, config=cfg) as decode:
        rx = decode.receiver(5, prefill.bootstrap_address, pages=dst_pages, num_tokens=n)
        tx = prefill.sender(5)
        tx.init(n)
        engine = torch.cuda.Stream()
        events = []
        with torch.cuda.stream(engine):
            for _ in range(2):
                torch.cuda._sleep(300_000_000)
                events.append(torch.cuda.Event(interprocess=True))
                events[-1].record(engine)
        began = time.monotonic()
        tx.send(src_pages, n, layers=range(0, 1), ready=events[0])
        tx.send([], n, layers=range(1, 2), ready=events[1])
        assert time.monotonic() - began < 0.05, "send() waited"
        assert rx.poll() is not RoomState.SUCCESS
        deadline = time.monotonic() + 30
        while rx.poll() not in (RoomState.SUCCESS, RoomState.FAILED):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert rx.poll() is RoomState.SUCCESS and events[1].query()
    torch.cuda.synchronize()
    for r in range(4):
        want = token_heads(src[r], src_pages, n, Layout.NHD)
        assert torch.equal(want, token_heads(dst[r], dst_pages, n, Layout.NHD))
