"""The kernel path's stream (``kvproto.kernels.lane.Lane``): what it launches runs after the caller's
stream's work, its uploads land, its events say when its work is over; driven through the driver
where ``cuda-bindings`` imports, through torch otherwise (both checked on the GPU)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from kvproto.kernels import lane as L
from kvproto.kernels.uploads import Uploads

@pytest.fixture(params=["driver", "torch"])
def lane(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(L, "_binding", lambda: None)
    elif L._binding() is None:
        pytest.skip("cuda-bindings is not installed")
    made = L.Lane(torch.device("cuda", 0))
    assert made.raw is (request.param == "driver")
    return made


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lane_runs_after_the_callers_stream_and_its_event_says_when_it_is_over(lane) -> None:
    """Long copies queued on the caller's stream, then (on the lane, after ``follow``) a table put
    through ``Uploads`` and copied over their destination: it lands last, and the lane's event
    completes only once all of it has run."""
    n = 1 << 24
    src = torch.full((n,), 7, dtype=torch.int64, device="cuda")
    dst = torch.zeros(n, dtype=torch.int64, device="cuda")
    table = np.arange(1, 65, dtype=np.int64)
    ups = Uploads()
    torch.cuda.synchronize()
    for _ in range(8):
        dst.copy_(src)  # the caller's work: milliseconds of copies on the current stream
    lane.follow()
    with contextlib.nullcontext() if lane.raw else torch.cuda.stream(lane.stream):
        got, slot = ups.put(table, torch.device("cuda", 0), lane if lane.raw else None)
        mirror = ups._mirror[slot[0]:slot[0] + 64]
        assert got.data_ptr() == mirror.data_ptr()
        with torch.cuda.stream(lane.stream):
            dst[:64].copy_(mirror)
    event = lane.record()
    ups.used(slot, event)
    event.synchronize()
    assert event.query()
    assert torch.equal(dst[:64].cpu(), torch.from_numpy(table)), "the lane ran before the caller's copies"
    assert int(dst[64:].min()) == 7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_recycled_event_marks_the_newer_point() -> None:
    """An event handed back is recorded again for the next write: a query then speaks of the newer
    work (never of less)."""
    if L._binding() is None:
        pytest.skip("cuda-bindings is not installed")
    lane = L.Lane(torch.device("cuda", 0))
    first = lane.record()
    first.synchronize()
    lane.recycle(first)
    big = torch.zeros(1 << 26, dtype=torch.int64, device="cuda")
    with torch.cuda.stream(lane.stream):
        for _ in range(20):
            big.add_(1)
    second = lane.record()
    assert second is first
    assert L._QUERY is not None, "libcuda's cuEventQuery did not load"
    assert not second.query(), "the event reads complete while 20 passes over 512 MiB are queued"
    second.synchronize()
    assert second.query() and int(big[0]) == 20
    lane.close()  # waits for the stream, destroys every event it made
    assert not lane._made and not lane._free
