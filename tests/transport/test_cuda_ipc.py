"""The kernel-path adapter (``cuda-ipc``) on the CPU: the public conformance suite unchanged, once
with every peer on its fallback and once with the kernel path itself running on DRAM peers of
this process (``cpu_kernels``: Triton's interpreter); then its routes, bounds and pattern writes,
and endpoints over it. The GPU half (IPC between processes) is ``tests/aio/test_gpu.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.kernels import pattern as kernels
from kvproto.testing.conformance import TransportConformance, pattern, region
from kvproto.transport import MemKind, TransportError, XferState, load_transport
from kvproto.transport.base import route_of

DRAM = MemKind.DRAM
KERNELS = {"fallback": "loopback", "cpu_kernels": True}


class TestCudaIpcFallback(TransportConformance):
    """No peer can be mapped (DRAM, no cpu_kernels): every call goes to the fallback."""

    transport = "cuda-ipc"
    options = {"fallback": "loopback"}


class TestCudaIpcKernels(TransportConformance):
    """Peers of this process, DRAM: every write is one (interpreted) pattern kernel."""

    transport = "cuda-ipc"
    options = KERNELS


def _agents(**options):
    a = load_transport("cuda-ipc", "a", **options)
    b = load_transport("cuda-ipc", "b", **options)
    return a, b


def _finish(a, b, xfer, limit: int = 1000) -> list:
    got = []
    for _ in range(limit):
        state = a.poll(xfer)
        got += b.drain_notifications()
        if state is not XferState.PENDING:
            return got
    raise AssertionError("the write never ended")


def test_cuda_ipc_route_is_kernel_for_mapped_peers_else_fallback() -> None:
    """A peer of this process is mapped by an agent with cpu_kernels (route "kernel", pattern);
    an agent without them sends DRAM through the fallback; a peer of another host always goes there."""
    a, b = _agents(**KERNELS)
    c = load_transport("cuda-ipc", "c", fallback="loopback")
    try:
        buf = np.zeros(4096, np.uint8)
        b.register([region(buf)])
        a.add_peer(b.metadata())
        assert route_of(a, "b").name == "kernel" and route_of(a, "b").pattern
        c.add_peer(b.metadata())
        assert route_of(c, "b").name == "loopback" and not route_of(c, "b").pattern
        doc = json.loads(b.metadata())
        doc["host"] = "elsewhere/boot"
        a.remove_peer("b")
        a.add_peer(json.dumps(doc).encode())
        assert route_of(a, "b").name == "loopback"
        with pytest.raises(TransportError, match="not mapped"):
            a.post_pattern("b", [buf.ctypes.data], DRAM, [buf.ctypes.data], DRAM, np.array([[0, 0, 16]]), b"t")
    finally:
        for t in (a, b, c):
            t.close()


def test_cuda_ipc_garbage_or_foreign_metadata_raises() -> None:
    """Metadata that is not this adapter's, or whose agent differs from its fallback's, is refused:
    at ``add_peer`` for a peer that goes through the fallback, and for a mapped peer (added to the
    fallback only when something first goes through it there) by the first thing that would."""
    a, b = _agents()  # no kernels for host memory: b goes through the fallback, added at once
    try:
        b.register([region(np.zeros(4096, np.uint8))])
        with pytest.raises(TransportError, match="kvproto-cuda-ipc"):
            a.add_peer(b'{"format": "other"}')
        doc = json.loads(b.metadata())
        doc["agent"] = "impostor"
        with pytest.raises(TransportError, match="impostor"):
            a.add_peer(json.dumps(doc).encode())
    finally:
        a.close()
        b.close()
    a, b = _agents(**KERNELS)
    try:
        buf = np.zeros(4096, np.uint8)
        b.register([region(buf)])
        doc = json.loads(b.metadata())
        doc["agent"] = "impostor"
        assert a.add_peer(json.dumps(doc).encode()) == "impostor" and route_of(a, "impostor").pattern
        a._peers["impostor"].tags = None  # a tag its channel cannot carry goes through the fallback
        with pytest.raises(TransportError, match="notify 'impostor'.*carries agent 'b'"):
            a.notify("impostor", b"t")
    finally:
        a.close()
        b.close()


def test_cuda_ipc_mapped_peer_joins_the_fallback_only_when_used() -> None:
    """A mapped peer's writes and tags never touch the fallback, so the peer is not loaded into it
    (tens of milliseconds of a new link with NIXL) until something goes through it; removing a peer
    never added there touches nothing."""
    a, b = _agents(**KERNELS)
    try:
        buf = np.zeros(4096, np.uint8)
        b.register([region(buf)])
        src = pattern(4096, seed=5)
        a.register([region(src)])
        assert a.add_peer(b.metadata()) == "b" and route_of(a, "b").pattern
        assert "b" not in a._fallback._peers
        xfer = a.post_pattern("b", [src.ctypes.data], DRAM, [buf.ctypes.data], DRAM, np.array([[0, 0, 16]]), b"t")
        assert _finish(a, b, xfer) and "b" not in a._fallback._peers
        assert (buf[:16] == src[:16]).all()
        a._peers["b"].tags = None
        a.notify("b", b"u")
        assert "b" in a._fallback._peers
        a.remove_peer("b")
        a.add_peer(b.metadata())
        a.remove_peer("b")  # (never added to the fallback this time)
        assert "b" not in a._fallback._peers
    finally:
        a.close()
        b.close()


def _regions(n: int, size: int, seed: int) -> list[np.ndarray]:
    return [pattern(size, seed=seed + i) for i in range(n)]


def test_cuda_ipc_post_pattern_moves_every_region_byte_exact() -> None:
    """One pattern write of three extents over four region pairs lands exactly like the torch
    reference, touches nothing else, and its tag arrives once, after the bytes."""
    import torch

    a, b = _agents(**KERNELS)
    try:
        src, dst = _regions(4, 8192, 1), [np.zeros(8192, np.uint8) for _ in range(4)]
        a.register([region(x) for x in src])
        b.register([region(x) for x in dst])
        a.add_peer(b.metadata())
        extents = np.array([[0, 4096, 1024], [6144, 0, 2048], [2048, 7168, 1024]], dtype=np.int64)
        want = [torch.zeros(8192, dtype=torch.uint8) for _ in range(4)]
        kernels.copy_reference(extents, [torch.from_numpy(x) for x in src], want)
        xfer = a.post_pattern("b", [x.ctypes.data for x in src], DRAM, [x.ctypes.data for x in dst], DRAM,
                              extents, b"tag")
        got = _finish(a, b, xfer)
        assert [n.tag for n in got] == [b"tag"]
        for d, w in zip(dst, want, strict=True):
            assert np.array_equal(d, w.numpy())
        assert (a.stats.writes, a.stats.bytes) == (1, 4 * 4096)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("where", ["remote end", "remote start", "local", "unregistered region"])
def test_cuda_ipc_post_pattern_out_of_bounds_is_refused_and_writes_nothing(where: str) -> None:
    """An extent reaching past a registered region (either side), or a base the peer never
    registered, raises TransportError naming the row before any kernel runs."""
    a, b = _agents(**KERNELS)
    try:
        src, dst = _regions(2, 4096, 1), [np.zeros(4096, np.uint8) for _ in range(2)]
        stray = np.zeros(4096, np.uint8)
        a.register([region(x) for x in src])
        b.register([region(x) for x in dst])
        a.add_peer(b.metadata())
        extents = np.array([[0, 0, 1024], [1024, 3072, 1024]], dtype=np.int64)
        local = [x.ctypes.data for x in src]
        remote = [x.ctypes.data for x in dst]
        if where == "remote end":
            extents[1, 1] = 3584
        elif where == "remote start":
            remote[1] -= 16
        elif where == "local":
            extents[0, 0] = 3584
        else:
            remote[0] = stray.ctypes.data
        with pytest.raises(TransportError, match="not inside"):
            a.post_pattern("b", local, DRAM, remote, DRAM, extents, b"t")
        assert all(not d.any() for d in dst) and not stray.any()
        assert a.stats.writes == 0
    finally:
        a.close()
        b.close()


def test_cuda_ipc_remove_peer_ends_its_writes_and_unmaps() -> None:
    """After remove_peer, lists prepared for it and new writes to it are refused."""
    a, b = _agents(**KERNELS)
    try:
        src, dst = pattern(4096), np.zeros(4096, np.uint8)
        a.register([region(src)])
        b.register([region(dst)])
        a.add_peer(b.metadata())
        remote = a.prepare("b", np.array([[dst.ctypes.data, 4096, 0]]), DRAM)
        a.remove_peer("b")
        with pytest.raises(TransportError):
            a.post_prepared("b", a.prepare(None, np.array([[src.ctypes.data, 4096, 0]]), DRAM), np.array([0]),
                            remote, np.array([0]), b"t")
    finally:
        a.close()
        b.close()


def _geometry(tp: int, rank: int, block: int, layout: str, blocks: int = 8):
    from kvproto.geometry import KVGeometry, Layout
    from kvproto.geometry.model import DType

    return KVGeometry(tp_size=tp, tp_rank=rank, num_layers=1, num_kv_heads=4, head_dim=8, dtype=DType.BFLOAT16,
                      block_size=block, layout=Layout[layout], mla=False, num_blocks=blocks)


@pytest.mark.parametrize("dst", [(2, 0, 4, "NHD"), (1, 0, 8, "HND"), (2, 1, 2, "HND")])
def test_cuda_ipc_post_plan_converts_heads_blocks_and_layouts_byte_exact(dst) -> None:
    """One post_plan write (TP 1 -> 2, block 4 -> 8 or 2, NHD -> HND) lands exactly the tokens'
    moved heads where the decode geometry puts them, in every region, and nothing else."""
    import dataclasses

    import torch

    from kvproto.geometry import plan_pair

    src_g, dst_g = _geometry(1, 0, 4, "NHD"), _geometry(*dst)
    plan = plan_pair(src_g, dst_g)
    a, b = _agents(**KERNELS)
    try:
        src = _regions(2, src_g.num_blocks * src_g.page_bytes, 1)
        dst_bufs = [np.zeros(dst_g.num_blocks * dst_g.page_bytes, np.uint8) for _ in range(2)]
        a.register([region(x) for x in src])
        b.register([region(x) for x in dst_bufs])
        a.add_peer(b.metadata())
        src_pages, dst_pages = [5, 2, 7, 0], [3, 6, 1, 4, 0, 2, 5, 7][:-(-15 // dst_g.block_size)]
        want = [torch.zeros_like(torch.from_numpy(d)) for d in dst_bufs]
        exact = dataclasses.replace(plan, direct=False)
        kernels.copy_reference(kernels.pair_extents(exact, src_pages, dst_pages, 3, 15),
                               [torch.from_numpy(x) for x in src], want)
        xfer = a.post_plan("b", plan, [x.ctypes.data for x in src], DRAM, [x.ctypes.data for x in dst_bufs], DRAM,
                           src_pages, dst_pages, 3, 15, b"rows")
        assert [n.tag for n in _finish(a, b, xfer)] == [b"rows"]
        for d, w in zip(dst_bufs, want, strict=True):
            assert np.array_equal(d, w.numpy())
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dst", [(2, 1, 4, "NHD"), (1, 0, 8, "HND")])
def test_cuda_ipc_post_parts_joins_groups_of_one_page_geometry_in_one_launch(dst, monkeypatch) -> None:
    """Two groups whose pages look alike (own pools of different sizes, own page lists) and a
    third of another geometry, as one ``post_parts`` write: the first two share one rows launch,
    each region reading its own group's pages, the third has its own; every byte lands as the
    torch reference puts it, nothing else changes, one tag. A page outside the smaller pool is
    refused although the larger pool would hold it."""
    import dataclasses

    import torch

    from kvproto.aio.paths import Part
    from kvproto.geometry import plan_pair

    src_a, dst_a = _geometry(1, 0, 4, "NHD", blocks=8), _geometry(*dst, blocks=8)
    src_b, dst_b = (dataclasses.replace(g, num_blocks=5) for g in (src_a, dst_a))
    src_c, dst_c = _geometry(1, 0, 2, "NHD", blocks=16), _geometry(1, 0, 2, "NHD", blocks=16)
    groups = [(src_a, dst_a, 2, [5, 2, 7, 0], [3, 6, 1, 4, 0, 2, 5, 7]),
              (src_b, dst_b, 3, [4, 0, 3, 1], [2, 4, 0, 3, 1, 2, 4, 0]),
              (src_c, dst_c, 1, [9, 3, 14, 0, 7, 5, 11, 2], [1, 15, 4, 8, 0, 12, 6, 3])]
    launches = []
    real = kernels.launch_rows
    monkeypatch.setattr(kernels, "launch_rows", lambda rows, *a, **k: (launches.append(rows.regions),
                                                                      real(rows, *a, **k)))
    a, b = _agents(**KERNELS)
    try:
        parts, want, dst_all, src_all = [], [], [], []
        for i, (sg, dg, n, sp, dp) in enumerate(groups):
            src = _regions(n, sg.num_blocks * sg.page_bytes, 10 * i)
            src_all += src  # registered memory must outlive the write
            dst_bufs = [np.zeros(dg.num_blocks * dg.page_bytes, np.uint8) for _ in range(n)]
            a.register([region(x) for x in src])
            b.register([region(x) for x in dst_bufs])
            plan = plan_pair(sg, dg)
            dp = dp[:-(-15 // dg.block_size)]
            ref = [torch.zeros_like(torch.from_numpy(d)) for d in dst_bufs]
            kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan, direct=False), sp, dp, 3, 15),
                                   [torch.from_numpy(x) for x in src], ref)
            moved = 12 * plan.head_count * sg.head_bytes * n
            parts.append(Part(moved, DRAM, DRAM, plan=(plan, np.array([x.ctypes.data for x in src]), DRAM,
                                                       np.array([x.ctypes.data for x in dst_bufs]), DRAM, sp, dp,
                                                       3, 15)))
            want += ref
            dst_all += dst_bufs
        a.add_peer(b.metadata())
        xfer = a.post_parts("b", parts, b"groups")
        assert [n.tag for n in _finish(a, b, xfer)] == [b"groups"]
        assert launches == [5, 1]  # groups a and b side by side, then c
        for d, w in zip(dst_all, want, strict=True):
            assert np.array_equal(d, w.numpy())
        bad = parts[1].plan
        parts[1] = dataclasses.replace(parts[1], plan=bad[:5] + ([4, 0, 5, 1],) + bad[6:])  # page 5: pool of 5
        with pytest.raises(TransportError, match="not inside registered memory"):
            a.post_parts("b", parts, b"bad")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("same", [True, False], ids=["same-objects", "equal-copies"])
def test_cuda_ipc_joined_groups_naming_the_same_page_lists_list_them_once(same: bool, monkeypatch) -> None:
    """Two groups of one page geometry (pools of 8 and 5 pages) whose parts name the very same
    page lists (a group that shares the first group's pages): one launch whose table lists the
    pages once per side; equal lists that are copies are listed for each group. Either way every
    byte lands as the torch reference puts it. A shared page that the larger pool holds but the
    smaller does not is refused, and nothing is written."""
    import dataclasses

    import torch

    from kvproto.aio.paths import Part
    from kvproto.geometry import plan_pair

    src_a, dst_a = _geometry(1, 0, 4, "NHD", blocks=8), _geometry(2, 1, 4, "NHD", blocks=8)
    src_b, dst_b = (dataclasses.replace(g, num_blocks=5) for g in (src_a, dst_a))
    sp, dp = [4, 0, 3, 1], [2, 4, 0, 3]
    tables = []
    real = kernels.launch_rows
    monkeypatch.setattr(kernels, "launch_rows", lambda rows, st, dt, s, d, **k: (
        tables.append((len(s), len(d))), real(rows, st, dt, s, d, **k)))
    a, b = _agents(**KERNELS)
    try:
        parts, want, dst_all, src_all = [], [], [], []
        for i, (sg, dg) in enumerate([(src_a, dst_a), (src_b, dst_b)]):
            src = _regions(2, sg.num_blocks * sg.page_bytes, 10 * i)
            src_all += src
            dst_bufs = [np.zeros(dg.num_blocks * dg.page_bytes, np.uint8) for _ in range(2)]
            a.register([region(x) for x in src])
            b.register([region(x) for x in dst_bufs])
            plan = plan_pair(sg, dg)
            ref = [torch.zeros_like(torch.from_numpy(d)) for d in dst_bufs]
            kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan, direct=False), sp, dp, 0, 15),
                                   [torch.from_numpy(x) for x in src], ref)
            pages = (sp, dp) if same or i == 0 else (list(sp), list(dp))
            parts.append(Part(1, DRAM, DRAM, plan=(plan, np.array([x.ctypes.data for x in src]), DRAM,
                                                   np.array([x.ctypes.data for x in dst_bufs]), DRAM, *pages, 0, 15)))
            want += ref
            dst_all += dst_bufs
        a.add_peer(b.metadata())
        prepared = a.prepare_parts("b", parts)
        xfer = prepared.post([(p.plan[5], p.plan[6]) for p in parts], b"shared")
        assert [n.tag for n in _finish(a, b, xfer)] == [b"shared"]
        assert tables == ([(4, 4)] if same else [(8, 8)])  # (source, destination) pages in the table
        for d, w in zip(dst_all, want, strict=True):
            assert np.array_equal(d, w.numpy())
        for d in dst_all:
            d[:] = 0
        far = [4, 0, 3, 5]  # page 5: inside the pool of 8, outside the pool of 5
        with pytest.raises(TransportError, match="not inside registered memory"):
            prepared.post([(far, dp), (far if same else list(far), dp if same else list(dp))], b"far")
        assert not any(d.any() for d in dst_all)
    finally:
        a.close()
        b.close()


def _paged_and_state(a, b, half: int):
    """Memory for a write of a paged group (TP 1 -> 2, block 4 -> 8, NHD -> HND, two regions) and a
    state slot (three regions, slots of ``half`` bytes, four local and six remote), registered
    on ``a`` and ``b`` with ``b`` added as a peer, and the two parts: pages [5, 2, 7, 0] into
    [3, 6] for tokens [3, 15), slot 2 into slot 5."""
    from types import SimpleNamespace

    from kvproto.aio.paths import Part, SlotRows
    from kvproto.geometry import plan_pair

    src_g, dst_g = _geometry(1, 0, 4, "NHD"), _geometry(2, 1, 8, "HND")
    plan = plan_pair(src_g, dst_g)
    src = _regions(2, src_g.num_blocks * src_g.page_bytes, 3)
    dst = [np.zeros(dst_g.num_blocks * dst_g.page_bytes, np.uint8) for _ in range(2)]
    s_src = [pattern(4 * 2 * half, seed=20 + i) for i in range(3)]
    s_dst = [np.zeros(6 * half, np.uint8) for _ in range(3)]
    a.register([region(x) for x in src + s_src])
    b.register([region(x) for x in dst + s_dst])
    a.add_peer(b.metadata())
    paged = Part(1, DRAM, DRAM, plan=(plan, np.array([x.ctypes.data for x in src]), DRAM,
                                      np.array([x.ctypes.data for x in dst]), DRAM, [5, 2, 7, 0], [3, 6], 3, 15))
    rows = SlotRows(np.array([x.ctypes.data + half for x in s_src]), np.full(3, 2 * half),
                    np.array([x.ctypes.data for x in s_dst]), np.full(3, half), np.full(3, half))
    return SimpleNamespace(plan=plan, src=src, dst=dst, s_src=s_src, s_dst=s_dst, paged=paged, rows=rows,
                           state=Part(3 * half, DRAM, DRAM, slots=rows, src_slot=2, dst_slot=5))


@pytest.mark.parametrize("half,fail", [(48, False), (4096, False), (48, True)],
                         ids=["48B", "4KiB-split-in-tiles", "variant-fails-to-build"])
def test_cuda_ipc_state_slot_rides_in_the_rows_launch(half: int, fail: bool, monkeypatch) -> None:
    """A write of a paged group and a state slot (``post_parts``) is one kernel launch: the rows
    kernel's grid gets one more row that copies the slot's tiles. Pages and slot land as the
    references put them, nothing else changes; a second state group gets a launch of its own.
    If that kernel variant fails to build, the write still lands (the slot launched apart) and
    later writes launch it apart at once."""
    import dataclasses

    import torch

    launches = []
    rows_launch, pattern_launch = kernels.launch_rows, kernels.launch
    monkeypatch.setattr(kernels, "launch_rows", lambda rows, *a, **k: (
        launches.append(("rows", k.get("slots") is not None)), rows_launch(rows, *a, **k)))
    monkeypatch.setattr(kernels, "launch", lambda *a, **k: (launches.append(("pattern", False)),
                                                           pattern_launch(*a, **k)))
    a, b = _agents(**KERNELS)
    try:
        m = _paged_and_state(a, b, half)
        plan, src, dst, s_src, s_dst, paged, state = m.plan, m.src, m.dst, m.s_src, m.s_dst, m.paged, m.state
        want = [torch.zeros_like(torch.from_numpy(d)) for d in dst]
        kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan, direct=False), [5, 2, 7, 0], [3, 6],
                                                    3, 15), [torch.from_numpy(x) for x in src], want)
        xfer = a.post_parts("b", [paged, state], b"one-launch")
        assert [n.tag for n in _finish(a, b, xfer)] == [b"one-launch"]
        assert launches == [("rows", True)]
        for d, w in zip(dst, want, strict=True):
            assert np.array_equal(d, w.numpy())
        for x, d in zip(s_src, s_dst, strict=True):
            expect = np.zeros_like(d)
            expect[5 * half:6 * half] = x[2 * 2 * half + half:3 * 2 * half]
            assert np.array_equal(d, expect)
        launches.clear()
        other = dataclasses.replace(state, src_slot=0, dst_slot=1)
        if fail:  # the fused variant fails to build: this write and later ones launch the slot apart
            from kvproto.kernels import paged as paged_kernels
            from kvproto.transport.cuda_ipc import launches as cuda_ipc  # where _FUSE_SLOTS lives

            real = paged_kernels.copy_paged

            def broken(*args, **kwargs):
                if len(args) > 6 and args[6] is not None:
                    raise RuntimeError("no such kernel")
                return real(*args, **kwargs)

            monkeypatch.setattr(paged_kernels, "copy_paged", broken)
            monkeypatch.setattr(cuda_ipc, "_FUSE_SLOTS", True)
            for d in s_dst:
                d[:] = 0
            xfer = a.post_parts("b", [paged, state], b"fallback")
            assert [n.tag for n in _finish(a, b, xfer)] == [b"fallback"]
            assert launches == [("rows", True), ("rows", False), ("pattern", False)] and not cuda_ipc._FUSE_SLOTS
            assert all(np.array_equal(d[5 * half:], x[2 * 2 * half + half:3 * 2 * half]) for x, d in zip(s_src, s_dst))
            launches.clear()
            xfer = a.post_parts("b", [paged, state], b"apart")
            assert [n.tag for n in _finish(a, b, xfer)] == [b"apart"]
            assert launches == [("rows", False), ("pattern", False)]
            return
        xfer = a.post_parts("b", [paged, state, other], b"two-states")
        assert [n.tag for n in _finish(a, b, xfer)] == [b"two-states"]
        assert launches == [("rows", True), ("pattern", False)]
        assert all(np.array_equal(d[half:2 * half], x[half:2 * half]) for x, d in zip(s_src, s_dst, strict=True))
    finally:
        a.close()
        b.close()


def test_cuda_ipc_rows_launches_bound_to_a_peer_are_dropped_when_it_is_removed_or_the_agent_closes(
        monkeypatch) -> None:
    """The rows launches bound for a peer's writes (``PagedLaunch``: they hold the region tables)
    are dropped when the peer is removed, and every binding the agent made when it closes: a
    closed link leaves nothing of its own held by the kernels' module."""
    from collections import OrderedDict

    from kvproto.kernels import paged as paged_kernels

    monkeypatch.setattr(paged_kernels.PagedLaunch, "_bound", OrderedDict())
    bound = paged_kernels.PagedLaunch._bound
    a, b = _agents(**KERNELS)
    c = load_transport("cuda-ipc", "c", **KERNELS)
    try:
        m = _paged_and_state(a, b, 2)
        xfer = a.post_parts("b", [m.paged, m.state], b"slot")
        assert [n.tag for n in _finish(a, b, xfer)] == [b"slot"]
        dst_c = [np.zeros_like(d) for d in m.dst]
        c.register([region(x) for x in dst_c])
        a.add_peer(c.metadata())
        xfer = a.post_plan("c", m.plan, [x.ctypes.data for x in m.src], DRAM, [x.ctypes.data for x in dst_c], DRAM,
                           [5, 2, 7, 0], [3, 6], 3, 15, b"plain")
        assert [n.tag for n in _finish(a, c, xfer)] == [b"plain"]
        assert len(bound) == 2  # one binding per peer's tables (with and without the slot)
        held = [entry[0] for entry in bound.values()]
        a.remove_peer("b")
        assert len(bound) == 1  # the slot write to "b" is gone, the write to "c" is kept
        assert [entry[0] for entry in bound.values()] == [h for h in held if h[4] is None]
        xfer = a.post_plan("c", m.plan, [x.ctypes.data for x in m.src], DRAM, [x.ctypes.data for x in dst_c], DRAM,
                           [5, 2, 7, 0], [3, 6], 3, 15, b"again")
        assert [n.tag for n in _finish(a, c, xfer)] == [b"again"]  # the link to "c" still writes
        assert all(np.array_equal(x, y) for x, y in zip(dst_c, m.dst, strict=True))  # as the write to "b" put it
        a.close()
        assert not bound
    finally:
        a.close()
        b.close()
        c.close()


def test_cuda_ipc_prepared_parts_post_other_pages_and_slots_checked_each_time() -> None:
    """A write's shape prepared once (``prepare_parts``: a paged group and a state slot) and
    posted with other pages and slots each time: every write lands as the references put it,
    a page or slot outside registered memory is refused on the write that names it (and moves
    nothing), and after the peer is removed and added again the same object plans anew and
    writes into the new mapping; with the peer gone it raises."""
    import dataclasses

    import torch

    from kvproto.transport.cuda_ipc import part_values

    half = 48
    a, b = _agents(**KERNELS)
    try:
        m = _paged_and_state(a, b, half)
        plan, src, dst, s_src, s_dst, paged, state = m.plan, m.src, m.dst, m.s_src, m.s_dst, m.paged, m.state
        prepared = a.prepare_parts("b", [paged, state])
        assert part_values(paged) == ([5, 2, 7, 0], [3, 6]) and part_values(state) == (2, 5)
        for n, (src_pages, dst_pages, src_slot, dst_slot) in enumerate(
                [([5, 2, 7, 0], [3, 6], 2, 5), ([1, 4, 6, 3], [7, 0], 0, 1), ([0, 1, 2, 3], [2, 4], 3, 0)]):
            if n == 2:  # the peer goes and comes back: the same object plans anew
                a.remove_peer("b")
                a.add_peer(b.metadata())
            for d in dst + s_dst:
                d[:] = 0
            want = [torch.zeros_like(torch.from_numpy(d)) for d in dst]
            kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan, direct=False), src_pages,
                                                        dst_pages, 3, 15), [torch.from_numpy(x) for x in src], want)
            xfer = prepared.post([(src_pages, dst_pages), (src_slot, dst_slot)], b"w%d" % n)
            assert [m.tag for m in _finish(a, b, xfer)] == [b"w%d" % n]
            for d, w in zip(dst, want, strict=True):
                assert np.array_equal(d, w.numpy())
            for x, d in zip(s_src, s_dst, strict=True):
                assert np.array_equal(d[dst_slot * half:(dst_slot + 1) * half],
                                      x[src_slot * 2 * half + half:(src_slot + 1) * 2 * half])
                assert not d[:dst_slot * half].any() and not d[(dst_slot + 1) * half:].any()
        for d in dst + s_dst:
            d[:] = 0
        for pages, slots in ((([5, 2, 7, 8], [3, 6]), (2, 5)), (([5, 2, 7, 0], [3, 6]), (2, 6)),
                             (([5, 2, 7, 0], [3, 6]), (4, 0))):  # page 8 of 8, slot 6 of 6, slot 4 of 4
            with pytest.raises(TransportError, match="not inside registered memory"):
                prepared.post([pages, slots], b"bad")
        assert not any(d.any() for d in dst + s_dst)
        a.remove_peer("b")
        with pytest.raises(TransportError, match="unknown"):
            prepared.post([([5, 2, 7, 0], [3, 6]), (2, 5)], b"gone")
    finally:
        a.close()
        b.close()


@settings(max_examples=200, deadline=None)
@given(data=st.data(), count=st.integers(1, 300), lists=st.integers(1, 4))
def test_cuda_ipc_page_rows_as_integers_and_as_an_array_agree(data, count: int, lists: int) -> None:
    """The two ways ``_page_rows`` checks a write's lists (plain integers up to ``_FEW_PAGES``, one
    array past it) give the same answer for any lists: the same table, or both None for a list of
    another length or a page outside ``[0, limit)`` (negative ones included)."""
    from kvproto.transport.cuda_ipc import launches as cuda_ipc  # the page-list checks

    limits = data.draw(st.lists(st.integers(1, 1 << 40), min_size=lists, max_size=lists))
    listed = []
    for limit in limits:
        n = data.draw(st.sampled_from([count, count, count, count - 1, count + 1]))
        pages = data.draw(st.lists(st.integers(-3, limit + 2) | st.integers(0, limit - 1), min_size=max(0, n),
                                   max_size=max(0, n)))
        listed.append(tuple(pages) if data.draw(st.booleans()) else pages)
    answers = []
    for few in (0, 1 << 20):
        cuda_ipc._FEW_PAGES, kept = few, cuda_ipc._FEW_PAGES
        try:
            answers.append(cuda_ipc._page_rows(listed, count, limits))
        finally:
            cuda_ipc._FEW_PAGES = kept
    array, integers = answers
    fits = all(len(p) == count and all(0 <= x < lim for x in p) for p, lim in zip(listed, limits))
    if not fits:
        assert array is None and integers is None
    else:
        assert array is not None and integers is not None and array.dtype == integers.dtype == np.int64
        assert array.tolist() == integers.tolist() == [x for p in listed for x in p]


@pytest.mark.parametrize("few", [8, None], ids=["as-an-array", "as-integers"])
def test_cuda_ipc_prepared_rows_of_many_pages_are_one_table_checked_list_by_list(few: int | None,
                                                                                 monkeypatch) -> None:
    """Two groups of one page geometry and 40 pages a list (the launch's lists become its table
    in one conversion: checked as one array past ``_FEW_PAGES``, as plain integers up to it),
    prepared once and posted with other pages each time: every write lands as the torch
    reference puts it; a page past the smaller pool, in the last list, and a list one page short
    are each refused on the write that names them, naming the list's side, and move nothing."""
    import dataclasses

    import torch

    from kvproto.aio.paths import Part
    from kvproto.geometry import plan_pair
    from kvproto.transport.cuda_ipc import launches as cuda_ipc  # the page-list checks
    from kvproto.transport.cuda_ipc import part_values

    if few is not None:
        monkeypatch.setattr(cuda_ipc, "_FEW_PAGES", few)
    tables = []
    real = cuda_ipc._page_rows
    monkeypatch.setattr(cuda_ipc, "_page_rows", lambda *args: tables.append(real(*args)) or tables[-1])
    pools, tokens = (48, 40), 160
    a, b = _agents(**KERNELS)
    try:
        geometry, memory = [], []
        for i, blocks in enumerate(pools):
            sg, dg = _geometry(1, 0, 4, "NHD", blocks=blocks), _geometry(2, 1, 4, "NHD", blocks=blocks)
            src = _regions(2, sg.num_blocks * sg.page_bytes, 30 + 10 * i)
            dst = [np.zeros(dg.num_blocks * dg.page_bytes, np.uint8) for _ in range(2)]
            a.register([region(x) for x in src])
            b.register([region(x) for x in dst])
            geometry.append(plan_pair(sg, dg))
            memory.append((src, dst))
        a.add_peer(b.metadata())

        def parts(pages):
            return [Part(1, DRAM, DRAM, plan=(plan, np.array([x.ctypes.data for x in src]), DRAM,
                                              np.array([x.ctypes.data for x in dst]), DRAM, sp, dp, 0, tokens))
                    for plan, (src, dst), (sp, dp) in zip(geometry, memory, pages, strict=True)]

        rng = np.random.default_rng(7)
        draw = lambda: [(rng.permutation(n)[:40].tolist(), rng.permutation(n)[:40].tolist()) for n in pools]  # noqa: E731
        first = draw()
        prepared = a.prepare_parts("b", parts(first))
        for n, pages in enumerate([first, draw(), draw()]):
            want = []
            for plan, (src, dst), (sp, dp) in zip(geometry, memory, pages, strict=True):
                for d in dst:
                    d[:] = 0
                ref = [torch.zeros_like(torch.from_numpy(d)) for d in dst]
                kernels.copy_reference(kernels.pair_extents(dataclasses.replace(plan, direct=False), sp, dp, 0,
                                                            tokens), [torch.from_numpy(x) for x in src], ref)
                want += [(d, w) for d, w in zip(dst, ref, strict=True)]
            xfer = prepared.post([part_values(p) for p in parts(pages)], b"m%d" % n)
            assert [m.tag for m in _finish(a, b, xfer)] == [b"m%d" % n]
            for d, w in want:
                assert np.array_equal(d, w.numpy())
        assert len(tables) == 3 and all(t is not None and t.shape == (160,) for t in tables)  # one table a write
        for _, dst in memory:
            for d in dst:
                d[:] = 0
        good = draw()
        past = [good[0], (good[1][0], good[1][1][:-1] + [40])]  # page 40 of the 40-page pool
        short = [good[0], (good[1][0][:-1], good[1][1])]
        for pages, why in ((past, "remote page .* not inside registered memory"), (short, "39 local pages")):
            with pytest.raises(TransportError, match=why):
                prepared.post([part_values(p) for p in parts(pages)], b"bad")
        assert not any(d.any() for _, dst in memory for d in dst)
        assert len(tables) == 5 and tables[3:] == [None, None]  # refused rows: the lists one by one say which
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("half", [48, 6, 4096], ids=["48B", "6B", "4KiB-split-in-tiles"])
def test_cuda_ipc_slot_rows_move_one_slot_of_every_region_and_stay_inside(half: int) -> None:
    """A state part (``SlotRows``: slot 0's rows and per-row strides) moves exactly slot ``s`` of
    every region into slot ``d`` on the peer, whatever the rows' alignment and whether a row spans
    several tiles; a slot past what the registered regions hold, on either side, raises
    TransportError before anything moves."""
    from kvproto.aio.paths import Part, SlotRows

    a, b = _agents(**KERNELS)
    try:
        src = [pattern(4 * 2 * half, seed=i) for i in range(3)]  # 4 slots of 2 halves; 3 regions
        dst = [np.zeros(6 * half, np.uint8) for _ in range(3)]  # 6 slots of one half: this rank's
        a.register([region(x) for x in src])
        b.register([region(x) for x in dst])
        a.add_peer(b.metadata())
        rows = SlotRows(np.array([x.ctypes.data + half for x in src]), np.full(3, 2 * half),
                        np.array([x.ctypes.data for x in dst]), np.full(3, half), np.full(3, half))
        for src_slot, dst_slot in ((2, 5), (0, 1)):
            xfer = a.post_parts("b", [Part(3 * half, DRAM, DRAM, slots=rows, src_slot=src_slot, dst_slot=dst_slot)],
                                b"state")
            assert [n.tag for n in _finish(a, b, xfer)] == [b"state"]
        for s, d in zip(src, dst, strict=True):
            want = np.zeros_like(d)
            want[5 * half:6 * half] = s[2 * 2 * half + half:3 * 2 * half]
            want[1 * half:2 * half] = s[half:2 * half]
            assert np.array_equal(d, want)
        for src_slot, dst_slot in ((4, 0), (0, 6), (-1, 0)):
            with pytest.raises(TransportError, match="not inside registered memory"):
                a.post_parts("b", [Part(3 * half, DRAM, DRAM, slots=rows, src_slot=src_slot, dst_slot=dst_slot)],
                             b"x")
        assert a.stats.writes == 2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", [list, tuple, np.array, lambda pages: list(range(40)) + list(pages)],
                         ids=["list", "tuple", "array", "long-list"])
def test_cuda_ipc_post_plan_page_outside_registered_memory_is_refused(kind) -> None:
    """A destination page past the peer's registered region (or a page list too short) raises
    TransportError before any kernel runs, whatever holds the page numbers (short lists are
    checked with plain integers, long ones and arrays with numpy)."""
    from kvproto.geometry import plan_pair

    src_g, dst_g = _geometry(1, 0, 4, "NHD"), _geometry(2, 0, 4, "NHD")
    plan = plan_pair(src_g, dst_g)
    a, b = _agents(**KERNELS)
    try:
        src = _regions(1, src_g.num_blocks * src_g.page_bytes, 1)
        dst = np.zeros(4 * dst_g.page_bytes, np.uint8)  # registered: 4 pages only
        a.register([region(x) for x in src])
        b.register([region(dst)])
        a.add_peer(b.metadata())
        args = ("b", plan, [src[0].ctypes.data], DRAM, [dst.ctypes.data], DRAM)
        skip = 40 * 4 if kind not in (list, tuple, np.array) else 0  # the long list's tokens start at page 40
        with pytest.raises(TransportError, match="not inside registered memory"):
            a.post_plan(*args, kind([0, 1]), kind([1, 5]), skip, skip + 8, b"t")
        with pytest.raises(TransportError, match="not inside registered memory"):
            a.post_plan(*args, kind([0, 1]), kind([-1, 2]), skip, skip + 8, b"t")
        with pytest.raises(TransportError, match="pages"):
            a.post_plan(*args, kind([0, 1]), kind([1]), skip, skip + 8, b"t")
        assert not dst.any() and a.stats.writes == 0
    finally:
        a.close()
        b.close()


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_uploads_keep_every_table_of_a_write_until_its_event() -> None:
    """A write of several kernels (``post_parts``) puts a table per kernel before its one event
    exists: no two tables of in-flight kernels share words of the ring, and a slot is reused only
    once the event of its write has completed."""
    import torch

    from kvproto.transport.cuda import Uploads

    up = Uploads()
    up._host = torch.zeros(Uploads.ENTRIES, dtype=torch.int64)  # pinned on a GPU host; plain memory here
    up._words = up._host.numpy()
    a, b = np.arange(10, dtype=np.int64), np.arange(100, 110, dtype=np.int64)
    _, first = up.put(a, "cpu")
    _, second = up.put(b, "cpu")  # the same write: the first kernel may not have read its table yet
    assert first[1] <= second[0]
    assert (up._words[first[0]:first[0] + 10] == a).all() and (up._words[second[0]:second[0] + 10] == b).all()
    event = _Event(False)
    up.used(first, event)
    up.used(second, event)
    _, third = up.put(a, "cpu")
    assert third[0] >= second[1]  # the write still runs: its slots are not reused
    event.done = True
    up.used(third, _Event(True))
    ptr, fourth = up.put(b, "cpu")
    assert fourth[0] == 0  # every write has run: the ring starts over
    # the kernels read the mirror (on the device; here plain memory too), which holds the same words
    assert ptr.data_ptr() == up._mirror.data_ptr() + 8 * fourth[0] and len(ptr) == 10
    assert (up._mirror[:10].numpy() == b).all()
