"""The kernel path's batched launches, on the CPU (``cpu_kernels``: Triton's interpreter).

Writes posted to a mapped peer wait until the next poll, drain or flush, and the consecutive ones
of one rows shape go as one kernel (``kvproto.kernels.paged.PagedBatch``). What must hold: every
room's bytes land exactly where its own pages and token range put them (as the torch reference
does), each write's tag arrives once and in posting order, a failed launch fails only the writes
it carried, and nothing waits forever (a removed peer, a closed agent)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.geometry import KVGeometry, Layout, plan_pair
from kvproto.geometry.model import DType
from kvproto.kernels import pattern as kernels
from kvproto.kernels import paged
from kvproto.testing.conformance import pattern
from kvproto.transport import MemKind, MemoryRegion, XferState, available_transports, load_transport

DRAM = MemKind.DRAM
BLOCKS = 64


def _geometry(tp: int, rank: int, block: int, layout: str) -> KVGeometry:
    return KVGeometry(tp_size=tp, tp_rank=rank, num_layers=1, num_kv_heads=4, head_dim=8, dtype=DType.BFLOAT16,
                      block_size=block, layout=Layout[layout], mla=False, num_blocks=BLOCKS)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")])]
"""Where the two caches are: host memory (the interpreter), and one GPU (compiled kernels; the peer
in this process, so no IPC mapping)."""


class _Pair:
    """Two agents of this process, a source cache of two regions and a destination cache."""

    def __init__(self, src_g: KVGeometry, dst_g: KVGeometry, device: str = "cpu") -> None:
        options = {"fallback": "loopback", "cpu_kernels": True} if device == "cpu" else {}  # (NIXL takes VRAM)
        self.a = load_transport("cuda-ipc", "a", **options)
        self.b = load_transport("cuda-ipc", "b", **options)
        self.host = [torch.from_numpy(pattern(BLOCKS * src_g.page_bytes, seed=3 + i)) for i in range(2)]
        self.src = [x.to(device) for x in self.host]
        self.dst = [torch.zeros(BLOCKS * dst_g.page_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        kind = DRAM if device == "cpu" else MemKind.VRAM
        self.kind = kind
        self.a.register([MemoryRegion(x.data_ptr(), x.numel(), x.device.index or 0, kind) for x in self.src])
        self.b.register([MemoryRegion(x.data_ptr(), x.numel(), x.device.index or 0, kind) for x in self.dst])
        self.a.add_peer(self.b.metadata())
        self.plan = plan_pair(src_g, dst_g)
        self.want = [torch.zeros(d.numel(), dtype=torch.uint8) for d in self.dst]
        self.bases = ([x.data_ptr() for x in self.src], [x.data_ptr() for x in self.dst])
        self.free = list(range(BLOCKS))

    def pages(self, rng: np.random.Generator, count: int) -> list[int]:
        """Destination pages no other room of this pair has: rooms never share one (a batch's
        writes run at once, so the reference could not order two writes of one page)."""
        taken = rng.choice(len(self.free), size=count, replace=False).tolist()
        pages = [self.free[i] for i in taken]
        self.free = [p for p in self.free if p not in pages]
        return pages

    def post(self, src_pages: list[int], dst_pages: list[int], start: int, end: int, tag: bytes, plan=None):
        plan = plan or self.plan
        exact = dataclasses.replace(plan, direct=False)
        kernels.copy_reference(kernels.pair_extents(exact, src_pages, dst_pages, start, end), self.host, self.want)
        return self.a.post_plan("b", plan, self.bases[0], self.kind, self.bases[1], self.kind, src_pages, dst_pages,
                                start, end, tag)

    def finish(self, xfers: list, limit: int = 1000) -> list[bytes]:
        tags: list[bytes] = []
        for _ in range(limit):
            states = [self.a.poll(x) for x in xfers]
            tags += [n.tag for n in self.b.drain_notifications()]
            if all(s is not XferState.PENDING for s in states):
                assert all(s is XferState.DONE for s in states), states
                return tags
        raise AssertionError("the writes never ended")

    def exact(self) -> bool:
        return all(torch.equal(d.cpu(), w) for d, w in zip(self.dst, self.want, strict=True))

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.mark.parametrize("device", DEVICES)
def test_rooms_posted_in_one_pass_go_as_one_launch_each_landing_its_own_pages(device: str) -> None:
    """Six rooms of one shape (TP 1 -> 2, block 4 -> 2, NHD -> HND), each its own pages and token
    range, posted before any poll: one kernel; every room's heads land where its own pages say,
    nothing else is written, six tags in posting order."""
    pair = _Pair(_geometry(1, 0, 4, "NHD"), _geometry(2, 1, 2, "HND"), device)
    try:
        rng = np.random.default_rng(7)
        xfers, tags = [], []
        for room in range(6):
            src_pages = rng.permutation(BLOCKS)[:4].tolist()
            dst_pages = pair.pages(rng, 8)
            tag = f"room-{room}".encode()
            start, end = (3, 13) if room == 4 else (0, 16)  # another token range, the same kernel
            xfers.append(pair.post(src_pages, dst_pages, start, end, tag))
            tags.append(tag)
        assert pair.a.launches == 0  # nothing launched before the pass ends
        assert pair.finish(xfers) == tags
        assert pair.a.launches == 1 and pair.a.stats.writes == 6
        assert pair.exact()
    finally:
        pair.close()


def test_a_write_of_another_shape_splits_the_batch_and_keeps_the_order(monkeypatch) -> None:
    """Rooms A1 A2 B A3 (B into another page geometry, hence another kernel): three launches, A1
    and A2 together, and the tags leave as posted."""
    pair = _Pair(_geometry(1, 0, 4, "NHD"), _geometry(1, 0, 4, "NHD"))
    other = plan_pair(_geometry(1, 0, 4, "NHD"), _geometry(1, 0, 2, "NHD"))
    batches: list[int] = []
    real = paged.PagedBatch.__call__
    monkeypatch.setattr(paged.PagedBatch, "__call__",
                        lambda self, table, entries, stream=None: (batches.append(len(entries)),
                                                                   real(self, table, entries, stream)))
    try:
        xfers = [pair.post([0, 1, 2, 3], [4, 5, 6, 7], 0, 16, b"A1"),
                 pair.post([4, 5, 6, 7], [0, 1, 2, 3], 0, 16, b"A2"),
                 pair.post([1, 2], [16, 17, 18], 0, 5, b"B", other),
                 pair.post([7, 6, 5, 4], [13, 12, 11, 10], 0, 16, b"A3")]
        pair.a.flush()
        assert pair.a.launches == 3 and batches == [2]
        assert pair.finish(xfers) == [b"A1", b"A2", b"B", b"A3"]
        assert pair.exact()
    finally:
        pair.close()


def test_a_failed_batched_launch_fails_only_its_writes(monkeypatch) -> None:
    """A batch whose kernel cannot be launched: its writes poll ERROR naming the cause and send no
    tag; the agent goes on, and the next room lands."""
    pair = _Pair(_geometry(1, 0, 4, "NHD"), _geometry(1, 0, 4, "NHD"))
    real = paged.PagedBatch.__call__

    def broken(self, table, entries, stream=None):
        raise RuntimeError("no kernel today")

    try:
        monkeypatch.setattr(paged.PagedBatch, "__call__", broken)
        bad = [pair.a.post_plan("b", pair.plan, pair.bases[0], DRAM, pair.bases[1], DRAM, [0, 1, 2, 3],
                                [0, 1, 2, 3], 0, 16, f"bad{i}".encode()) for i in range(3)]
        assert {pair.a.poll(x) for x in bad} == {XferState.ERROR}
        assert all("no kernel today" in x.error for x in bad)
        assert pair.b.drain_notifications() == []
        monkeypatch.setattr(paged.PagedBatch, "__call__", real)
        good = [pair.post([3, 2, 1, 0], [4, 5, 6, 7], 0, 16, b"g1"), pair.post([4, 5], [9, 8], 2, 7, b"g2")]
        assert pair.finish(good) == [b"g1", b"g2"]
        assert pair.exact()
    finally:
        pair.close()


def test_removing_the_peer_or_closing_ends_writes_still_waiting() -> None:
    """Writes posted and not yet launched when their peer is removed end ERROR (no tag); an
    agent closed with writes waiting ends them too, without hanging."""
    pair = _Pair(_geometry(1, 0, 4, "NHD"), _geometry(1, 0, 4, "NHD"))
    try:
        xfers = [pair.post([0, 1, 2, 3], [0, 1, 2, 3], 0, 16, f"r{i}".encode()) for i in range(3)]
        pair.a.remove_peer("b")
        assert [pair.a.poll(x) for x in xfers] == [XferState.ERROR] * 3
        assert all("removed" in x.error for x in xfers)
        pair.a.add_peer(pair.b.metadata())
        waiting = pair.post([1, 2, 3, 4], [8, 9, 10, 11], 0, 16, b"late")
        pair.a.close()
        assert waiting.event is not None and waiting.event.query()  # launched at close, and ran
    finally:
        pair.close()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batched_rooms_of_random_pages_ranges_and_passes_land_byte_exact(device: str, data) -> None:
    """Rooms of two geometries (TP 1 -> 2 NHD -> HND, and 1 -> 1 with other blocks), random pages,
    random token ranges, posted in random passes (a poll between them or not): every byte as the
    reference puts it, every tag once, in posting order."""
    src_g = _geometry(1, 0, 4, "NHD")
    pair = _Pair(src_g, _geometry(2, 0, 4, "HND"), device)
    other = plan_pair(src_g, _geometry(2, 0, 2, "NHD"))
    try:
        xfers, tags = [], []
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        for room in range(data.draw(st.integers(2, 7))):
            start = data.draw(st.integers(0, 12))
            end = data.draw(st.integers(start + 1, 16))
            plan = other if data.draw(st.booleans()) else None
            dst_block = 2 if plan is other else 4
            src_pages = rng.permutation(BLOCKS)[:-(-end // 4)].tolist()
            dst_pages = pair.pages(rng, -(-end // dst_block))
            tag = f"t{room}".encode()
            xfers.append(pair.post(src_pages, dst_pages, start, end, tag, plan))
            tags.append(tag)
            if data.draw(st.booleans()):
                pair.a.poll(xfers[-1])  # the pass ends here: what waits launches
        assert pair.finish(xfers) == tags
        assert pair.exact()
        assert pair.a.launches <= len(xfers)
    finally:
        pair.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif("nixl" not in available_transports(), reason="NIXL is not importable")
def test_rows_warm_up_compiles_what_rooms_then_launch(monkeypatch) -> None:
    """After ``warm_up_rows`` for a pair's plans (long rooms and short ones), a room alone and a
    batch of rooms of that pair launch without the JIT (it is made to fail), byte-exact."""
    from kvproto.kernels import launcher
    from kvproto.kernels.pattern import plan_rows

    src_g, dst_g = _geometry(1, 0, 4, "NHD"), _geometry(2, 1, 2, "HND")
    pair = _Pair(src_g, dst_g, "cuda")
    try:
        plan = plan_rows(pair.plan, 0, 16, regions=2)
        assert paged.warm_up_rows([plan], torch.device("cuda")) == 2

        def no_jit(*args, **kwargs):
            raise AssertionError("a room compiled its kernel")

        monkeypatch.setattr(launcher, "_jit", no_jit)
        rng = np.random.default_rng(3)
        alone = pair.post(rng.permutation(BLOCKS)[:4].tolist(), pair.pages(rng, 8), 0, 16, b"alone")
        assert pair.finish([alone]) == [b"alone"]
        batch = [pair.post(rng.permutation(BLOCKS)[:4].tolist(), pair.pages(rng, 8), 0, 16, f"b{i}".encode())
                 for i in range(3)]
        assert pair.finish(batch) == [b"b0", b"b1", b"b2"]
        assert pair.exact()
    finally:
        pair.close()


def test_writes_alternating_between_two_peers_batch_per_peer_in_order() -> None:
    """A prefill rank writing every room to two decode ranks (TP 1 -> 2) posts to peers b and c in
    turn: one launch per peer, each peer's tags in posting order, every byte where it belongs."""
    pair = _Pair(_geometry(1, 0, 4, "NHD"), _geometry(2, 0, 4, "NHD"))
    c = load_transport("cuda-ipc", "c", fallback="loopback", cpu_kernels=True)
    try:
        plan_c = plan_pair(_geometry(1, 0, 4, "NHD"), _geometry(2, 1, 4, "NHD"))
        dst_c = [torch.zeros_like(d) for d in pair.dst]
        c.register([MemoryRegion(x.data_ptr(), x.numel(), 0, DRAM) for x in dst_c])
        pair.a.add_peer(c.metadata())
        want_c = [torch.zeros(d.numel(), dtype=torch.uint8) for d in dst_c]
        rng = np.random.default_rng(11)
        xfers, free_c = [], list(range(BLOCKS))
        for room in range(4):
            src_pages = rng.permutation(BLOCKS)[:4].tolist()
            xfers.append(pair.post(src_pages, pair.pages(rng, 4), 0, 16, f"b{room}".encode()))
            dst_pages, free_c = free_c[:4], free_c[4:]
            kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan_c, direct=False), src_pages,
                                                        dst_pages, 0, 16), pair.host, want_c)
            xfers.append(pair.a.post_plan("c", plan_c, pair.bases[0], DRAM, [x.data_ptr() for x in dst_c], DRAM,
                                          src_pages, dst_pages, 0, 16, f"c{room}".encode()))
        pair.a.flush()
        assert pair.a.launches == 2
        tags_c: list[bytes] = []
        for _ in range(100):
            states = [pair.a.poll(x) for x in xfers]
            tags_c += [n.tag for n in c.drain_notifications()]
            if XferState.PENDING not in states:
                break
        assert states == [XferState.DONE] * 8
        assert [n.tag for n in pair.b.drain_notifications()] == [b"b0", b"b1", b"b2", b"b3"]
        assert tags_c == [b"c0", b"c1", b"c2", b"c3"]
        assert pair.exact() and all(torch.equal(d, w) for d, w in zip(dst_c, want_c, strict=True))
    finally:
        c.close()
        pair.close()


def test_rooms_of_two_joined_groups_batch_each_group_reading_its_own_lists() -> None:
    """Rooms of a hybrid cache whose two groups share one rows launch (pools of 8 and 5 pages, each
    region reading its own group's page lists): three rooms posted in one pass are one kernel, and
    every byte of both groups lands where each room's own lists say."""
    from kvproto.aio.paths import Part

    src_a, dst_a = _geometry(1, 0, 4, "NHD"), _geometry(2, 1, 4, "NHD")
    src_b, dst_b = (dataclasses.replace(g, num_blocks=5) for g in (src_a, dst_a))
    a = load_transport("cuda-ipc", "a", fallback="loopback", cpu_kernels=True)
    b = load_transport("cuda-ipc", "b", fallback="loopback", cpu_kernels=True)
    try:
        groups = []
        for i, (sg, dg, n) in enumerate(((src_a, dst_a, 2), (src_b, dst_b, 3))):
            host = [torch.from_numpy(pattern(sg.num_blocks * sg.page_bytes, seed=20 + 5 * i + r)) for r in range(n)]
            dst = [torch.zeros(dg.num_blocks * dg.page_bytes, dtype=torch.uint8) for _ in range(n)]
            a.register([MemoryRegion(x.data_ptr(), x.numel(), 0, DRAM) for x in host])
            b.register([MemoryRegion(x.data_ptr(), x.numel(), 0, DRAM) for x in dst])
            bases = (np.array([x.data_ptr() for x in host]), np.array([x.data_ptr() for x in dst]))  # a link's, kept
            groups.append((plan_pair(sg, dg), host, dst, [torch.zeros_like(d) for d in dst], sg.num_blocks, bases))
        a.add_peer(b.metadata())
        rng = np.random.default_rng(5)
        free = [list(range(8)), list(range(5))]
        xfers = []
        for room in range(3):
            parts = []
            for g, (plan, host, dst, want, blocks, bases) in enumerate(groups):
                sp = rng.permutation(blocks)[:1].tolist()
                dp, free[g] = free[g][:1], free[g][1:]  # one page a room: rooms never share one
                kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan, direct=False), sp, dp, 0, 4),
                                       host, want)
                parts.append(Part(4 * plan.head_count * src_a.head_bytes * len(host), DRAM, DRAM,
                                  plan=(plan, bases[0], DRAM, bases[1], DRAM, sp, dp, 0, 4)))
            xfers.append(a.post_parts("b", parts, f"room{room}".encode()))
        a.flush()
        assert a.launches == 1
        got: list[bytes] = []
        for _ in range(100):
            states = [a.poll(x) for x in xfers]
            got += [n.tag for n in b.drain_notifications()]
            if XferState.PENDING not in states:
                break
        assert states == [XferState.DONE] * 3 and got == [b"room0", b"room1", b"room2"]
        for _plan, _host, dst, want, _blocks, _bases in groups:
            assert all(torch.equal(d, w) for d, w in zip(dst, want, strict=True))
    finally:
        a.close()
        b.close()
