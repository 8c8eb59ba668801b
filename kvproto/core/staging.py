"""The staging ring: byte regions of one registered staging buffer, granted and reclaimed in order.

Theory of operation
-------------------
A decode rank owns one staging buffer of ``capacity`` bytes. Writers ask for room to stage a
piece of a chunk (``request``: up to ``units`` units of ``unit`` bytes, a unit being one token
of the writer's head slice over every region); the ring grants, in request order, a request that
fits the ring whole only whole, in one contiguous region: before the end of the buffer, else
wrapping to its start, waiting for space if neither has room yet (split, its remainder would
queue behind every request asked meanwhile and its room would end a whole turn later). A request
larger than the ring gets as many whole units as fit in one contiguous region (at least one); a
writer that got fewer units than it asked for asks again for the rest: so a chunk larger than the
ring is split into pieces that fit, never refused and never deadlocked, as long as one unit fits
in the ring at all (``request`` refuses units larger than the ring up front).

A request may carry a *tail*: bytes that follow its units only in a grant of all of them (the
state block of the piece that ends a room's tokens, staging.md minor 3). A grant of fewer units
has no tail; the units left are asked for again, tail and all, so the region of one unit plus
the tail is what must fit in the ring (``request`` refuses it otherwise).

Positions grow monotonically; a region's buffer offset is ``position % capacity``. ``head`` is
where the next grant starts, the *watermark* is the start of the oldest region not yet
released. Space is reused only behind the watermark: a region released out of order stays
reserved until every region granted before it is released too. A grant that would straddle the
end of the buffer skips to offset 0; the skipped tail is a pad that the watermark passes over.

Invariants (property-tested): live regions never overlap; ``head - watermark <= capacity``;
grants are FIFO (a request is never overtaken by a later one); when every region is released,
``used == 0`` and nothing is left in any map. ``cancel_owner`` drops an owner's queued
requests and releases its regions: call it only when no write into them can still land.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Grant:
    key: Hashable
    owner: Hashable
    offset: int
    units: int
    length: int


@dataclass(slots=True)
class _Request:
    key: Hashable
    owner: Hashable
    unit: int
    units: int
    tail: int = 0


@dataclass(slots=True)
class _Region:
    start: int  # ring position
    size: int
    owner: Hashable | None  # None: a wrap pad
    released: bool = False


ALIGN = 64
"""Where a ring's regions start, by default (bytes)."""


class StagingRing:
    def __init__(self, capacity: int, *, align: int = ALIGN) -> None:
        if capacity <= 0 or align <= 0 or capacity % align:
            raise ValueError(f"capacity {capacity} must be a positive multiple of align {align}")
        self.capacity = capacity
        self.align = align
        self.head = 0
        self._queue: deque[_Request] = deque()
        self._live: OrderedDict[Hashable, _Region] = OrderedDict()  # in position order
        self._pads = 0

    # --- state -------------------------------------------------------------------------------
    @property
    def watermark(self) -> int:
        for region in self._live.values():
            return region.start
        return self.head

    @property
    def used(self) -> int:
        return self.head - self.watermark

    @property
    def queued(self) -> int:
        return len(self._queue)

    def live_grants(self) -> list[tuple[Hashable, int, int]]:
        """(key, offset, size) of every region granted and not yet reclaimed."""
        return [(k, r.start % self.capacity, r.size) for k, r in self._live.items() if r.owner is not None]

    def owners(self) -> set[Hashable]:
        return {r.owner for r in self._live.values() if r.owner is not None} | {q.owner for q in self._queue}

    # --- requests and grants ------------------------------------------------------------------
    def request(self, key: Hashable, owner: Hashable, *, unit: int, units: int, tail: int = 0) -> None:
        """Queue a request for up to ``units`` units of ``unit`` bytes, and ``tail`` bytes after
        them in a grant of all of them."""
        if unit <= 0 or units <= 0 or tail < 0:
            raise ValueError(f"request of {units} units of {unit} bytes and a tail of {tail}")
        if not self.fits(unit, tail):
            raise ValueError(f"a unit of {unit} bytes and a tail of {tail} exceed the staging ring of "
                             f"{self.capacity} bytes")
        if key in self._live or any(q.key == key for q in self._queue):
            raise ValueError(f"staging key {key!r} is already requested or granted")
        self._queue.append(_Request(key, owner, unit, units, tail))

    def fits(self, unit: int, tail: int = 0) -> bool:
        """Whether a grant of one unit and a tail fits in the ring at all (every request of such
        units is then eventually granted)."""
        return self._round(unit + tail) <= self.capacity

    def take_grants(self) -> list[Grant]:
        """Grant queued requests in order while space allows."""
        grants: list[Grant] = []
        while self._queue:
            grant = self._try(self._queue[0])
            if grant is None:
                break
            self._queue.popleft()
            grants.append(grant)
        return grants

    def _round(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def _fit(self, req: _Request, room: int) -> int:
        """Units of ``req`` that fit in ``room`` bytes (aligned), with its tail if they are all."""
        if room <= 0:
            return 0
        k = min(req.units, room // req.unit)
        while k > 0 and self._round(self._size(req, k)) > room:
            k -= 1
        return k

    @staticmethod
    def _size(req: _Request, k: int) -> int:
        """Bytes of a grant of ``k`` units of ``req``: its tail only with the last unit."""
        return k * req.unit + (req.tail if k == req.units else 0)

    def _try(self, req: _Request) -> Grant | None:
        if not self._live and self.head % self.capacity:
            self.head += self.capacity - self.head % self.capacity  # empty ring: start at offset 0
        free = self.capacity - self.used
        offset = self.head % self.capacity
        to_end = self.capacity - offset
        k = self._fit(req, min(free, to_end))
        at_start = self._fit(req, free - to_end) if offset and free > to_end else 0
        if k < req.units and self._round(self._size(req, req.units)) <= self.capacity:
            # The request fits the ring whole: it waits to be granted whole, at the start of the
            # buffer if not before its end. Split, its remainder would be asked for again behind
            # every request queued meanwhile, and its room would end a whole turn of the ring later.
            if at_start < req.units:
                return None
        if k < req.units and at_start == req.units or k == 0:
            # all of it fits at the start of the buffer (not before its end), or, for a request
            # larger than the ring, not even one unit fits before the end: wrap, if the start has room
            if at_start == 0:
                return None
            self._pads += 1
            self._live[("pad", self._pads)] = _Region(self.head, to_end, None, released=True)
            self.head += to_end
            k = self._fit(req, self.capacity - self.used)
        length = self._size(req, k)
        region = _Region(self.head, self._round(length), req.owner)
        self._live[req.key] = region
        self.head += region.size
        self._reclaim()
        return Grant(req.key, req.owner, region.start % self.capacity, k, length)

    # --- release ------------------------------------------------------------------------------
    def release(self, key: Hashable) -> None:
        """The region was consumed (scattered): reclaim it once it reaches the watermark."""
        region = self._live.get(key)
        if region is None or region.owner is None:
            raise KeyError(f"no live staging region {key!r}")
        region.released = True
        self._reclaim()

    def cancel_queued(self, owner: Hashable) -> None:
        """Drop ``owner``'s queued requests; its granted regions stay reserved."""
        self._queue = deque(q for q in self._queue if q.owner != owner)

    def cancel_owner(self, owner: Hashable) -> None:
        """Drop ``owner``'s queued requests and release its regions (no write may still land)."""
        self._queue = deque(q for q in self._queue if q.owner != owner)
        for region in self._live.values():
            if region.owner == owner:
                region.released = True
        self._reclaim()

    def _reclaim(self) -> None:
        while self._live:
            key, region = next(iter(self._live.items()))
            if not region.released:
                break
            del self._live[key]
