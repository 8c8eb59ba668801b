"""Host-memory staging copies run from the progress pass a slice of time at a time, so that a rank
with many pieces to gather still answers its peers between them."""

from __future__ import annotations

import time

import pytest
import torch

from kvproto.aio.staging import Copies


def test_copies_host_copies_run_a_slice_per_poll_in_order() -> None:
    """Ten 20 ms copies: ``run`` returns at once, each ``poll`` runs one (its first always, then no
    more once its 5 ms slice is spent), continuations follow their copies in order, and ``finish``
    runs what is left."""
    copies = Copies(torch.device("cpu"))
    done: list[tuple[str, int]] = []
    began = time.perf_counter()
    for i in range(10):
        copies.run(lambda _stream, i=i: (time.sleep(0.02), done.append(("copy", i))),
                   lambda i=i: done.append(("then", i)))
    assert time.perf_counter() - began < 0.01 and not done and len(copies) == 10
    assert copies.poll() == 1 and done == [("copy", 0), ("then", 0)] and len(copies) == 9
    assert copies.poll() == 1 and len(copies) == 8
    assert copies.finish() == 8 and len(copies) == 0
    assert done == [(kind, i) for i in range(10) for kind in ("copy", "then")]


def test_copies_a_failed_host_copy_calls_failed_not_then() -> None:
    """A copy that raises calls its ``failed`` (the region can be released) instead of its
    continuation; without ``failed`` the exception leaves ``poll``."""
    copies = Copies(torch.device("cpu"))
    seen: list[object] = []

    def broken(_stream: object) -> None:
        raise RuntimeError("gather failed")

    copies.run(broken, lambda: seen.append("then"), lambda exc: seen.append(str(exc)))
    copies.poll()
    assert seen == ["gather failed"]
    copies.run(broken, lambda: seen.append("then"))
    with pytest.raises(RuntimeError, match="gather failed"):
        copies.poll()
    assert seen == ["gather failed"] and len(copies) == 0
