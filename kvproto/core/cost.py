"""Direct or staged: the price of moving one room's bytes each way, from measured constants.

Theory of operation
-------------------
When a writer's pages are byte-identical to the decode rank's (same heads, block size and
layout), both paths are correct and the choice is only about time:

* **direct** posts one descriptor per run of pages that are consecutive on both sides, per
  region (layer and plane). Its cost is ``descriptors x per_descriptor_s`` on top of the wire
  time: a transport pays a fixed price per descriptor (UCX over cuda_ipc: ~5 us for each), so a
  fragmented room of a few GiB posts tens of thousands of them and runs at a few percent of
  the link.
* **staged** gathers the room into contiguous staging, moves it in a few bulk writes and
  scatters it on the decode side. Its extra cost is two copies through device (or host) memory,
  ``2 x bytes / copy_bytes_per_s``, and a fixed ``staged_fixed_s`` per room for the staging
  round trips and kernel launches.

The wire time is the same on both sides of the comparison, so it cancels: a room stages when
``descriptors x per_descriptor_s > 2 x bytes / copy_bytes_per_s + staged_fixed_s``. Contiguous
rooms (few runs) go direct, fragmented ones stage. The decision is made once per room and per
decode rank, at the room's first chunk (a writer's staged pieces must cover its tokens in
order, so a room never switches paths halfway). ``kvproto bench transfer`` prints the constants
it measures; the defaults below are per memory kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class PathCost:
    per_descriptor_s: float
    """What the transport charges per posted descriptor, beyond its bytes."""
    copy_bytes_per_s: float
    """Bandwidth of one staging copy (gather or scatter), counting the bytes moved once."""
    staged_fixed_s: float
    """Fixed cost of a staged room: staging request/grant round trip, kernel launches."""

    def stage_wins(self, descriptors: int, nbytes: int) -> bool:
        return descriptors * self.per_descriptor_s > 2 * nbytes / self.copy_bytes_per_s + self.staged_fixed_s


DEVICE_COST = PathCost(per_descriptor_s=5e-6, copy_bytes_per_s=2e12, staged_fixed_s=3e-4)
"""GPU memory over NVLink (cuda_ipc): descriptors are dear, device copies cheap."""
HOST_COST = PathCost(per_descriptor_s=1e-6, copy_bytes_per_s=5e9, staged_fixed_s=3e-4)
"""Host memory: descriptors are cheap, copies cost CPU time."""


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int], first: int, last: int) -> int:
    """Runs of consecutive pages on both sides among page indices ``[first, last)``: the
    descriptors per region that a direct write of those pages needs after merging."""
    if last <= first:
        return 0
    runs = 1
    for i in range(first + 1, last):
        if src_pages[i] != src_pages[i - 1] + 1 or dst_pages[i] != dst_pages[i - 1] + 1:
            runs += 1
    return runs
