"""Two hosts: prefill and decode in two network namespaces joined by a veth pair, made by the
test itself; nothing travels over 127.0.0.1 between them (the prefill binds 0.0.0.0 and
advertises its veth address; CURVE is on). The demo runs across them, and a link cut with
``ip link set down`` fails the rooms opened meanwhile by their deadlines, after which new rooms
succeed byte-exact."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
import zmq

from kvproto.testing import netns
from kvproto.transport import available_transports
from tests.faults_real.procs import SMALL, Child, RankSpec

_WHY = netns.unavailable()
pytestmark = [pytest.mark.skipif(_WHY is not None, reason=f"two hosts: {_WHY}"), pytest.mark.slow]
TRANSPORTS = [pytest.param(t, marks=[pytest.mark.nixl] if t == "nixl" else [])
              for t in ("nixl", "mooncake") if t in available_transports()]


@pytest.mark.skipif(not TRANSPORTS, reason="neither NIXL nor Mooncake is importable")
def test_two_hosts_demo_moves_every_byte_over_the_veth() -> None:
    """``kvproto demo --two-hosts`` over every real adapter in one run: every byte verified, the
    bytes crossed the veth pair, and the adapters are printed side by side."""
    names = [p.values[0] for p in TRANSPORTS]
    out = subprocess.run(
        [sys.executable, "-m", "kvproto.cli", "demo", "--two-hosts", "--transport", ",".join(names), "--rooms", "24",
         "--max-tokens", "512", "--blocks", "512"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert out.stdout.count("verified every byte: OK, 0 mismatching bytes") == len(names)
    moved = [float(m) for m in re.findall(r"moved ([\d.]+) GB", out.stdout)]
    carried = [float(m) for m in re.findall(r"veth pair carried ([\d.]+) GB", out.stdout)]
    assert len(moved) == len(carried) == len(names)
    assert all(c >= m > 0 for m, c in zip(moved, carried, strict=True))
    if len(names) > 1:
        for name in names:
            assert re.search(rf"^\| {name} \| 24 \| .* \| OK \|", out.stdout, re.M), out.stdout


ROOM_S = 3.0
"""Every room deadline in the link-cut script."""


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_hosts_link_cut_fails_rooms_by_deadline_then_new_rooms_succeed(transport: str) -> None:
    """Rooms before a cut succeed; rooms opened while the link is down fail by their deadlines
    on both sides; once the link is back, new rooms succeed byte-exact."""
    keys = {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}
    with netns.TwoHosts.create() as hosts:
        demo = dict(SMALL, transport=transport)
        common = dict(demo=demo, curve=keys, room_timeout=ROOM_S, heartbeat_interval=0.2, heartbeat_timeout=1.0)
        prefill = Child(RankSpec("prefill", netns=hosts.a, host="0.0.0.0", advertise_host=hosts.a_addr,
                                 address=hosts.a_addr, **common))
        decode = Child(RankSpec("decode", netns=hosts.b, address=hosts.b_addr, **common))
        try:
            info = await prefill.call("start")
            await decode.call("start")
            address = info["address"]
            assert address.startswith(f"tcp://{hosts.a_addr}:"), address

            async def rooms(ids: list[int]) -> tuple[dict, dict]:
                spec = [(r, 256) for r in ids]
                await decode.call("open", spec, address)
                await prefill.call("open", spec, "", True)
                wait = ROOM_S + 3.0
                return (await decode.call("wait", ids, wait, timeout=wait + 30),
                        await prefill.call("wait", ids, wait, timeout=wait + 30))

            before_d, before_p = await rooms(list(range(1, 7)))
            assert [v["state"] for v in before_d.values()] == [4] * 6, before_d
            assert [v["bad"] for v in before_d.values()] == [0] * 6
            assert [v["state"] for v in before_p.values()] == [4] * 6, before_p

            # Rooms in flight at the cut: the decode asked, the prefill sends into a dead wire.
            flight = [(r, 256) for r in range(51, 55)]
            await decode.call("open", flight, address)
            await prefill.call("open", flight, "", False)
            await asyncio.sleep(0.3)
            hosts.link(False)
            opened = time.monotonic()
            await prefill.call("send", [r for r, _ in flight])
            wait = ROOM_S + 3.0
            flight_d = await decode.call("wait", [r for r, _ in flight], wait, timeout=wait + 30)
            flight_p = await prefill.call("wait", [r for r, _ in flight], wait, timeout=wait + 30)
            # Rooms opened while the link is down.
            cut_d, cut_p = await rooms(list(range(101, 105)))
            ended = {}
            for name, side in (("in flight, decode", flight_d), ("in flight, prefill", flight_p),
                               ("opened while down, decode", cut_d), ("opened while down, prefill", cut_p)):
                for room_id, v in side.items():
                    assert v["state"] == 0, (name, room_id, v)
                    assert v["ended"] - opened <= 2 * ROOM_S + 1.0, (name, room_id, v, v["ended"] - opened)
                ended[name] = sorted({(v["code"], round(v["ended"] - opened, 1)) for v in side.values()})
            print("link down:", ended)  # what ended them, seconds after the cut (quoted in the note)

            hosts.link(True)
            await asyncio.sleep(0.5)
            after_d, after_p = await rooms(list(range(201, 207)))
            assert [v["state"] for v in after_d.values()] == [4] * 6, after_d
            assert [v["bad"] for v in after_d.values()] == [0] * 6
            assert [v["state"] for v in after_p.values()] == [4] * 6, after_p
            for child in (decode, prefill):
                snap = await child.call("close")
                assert snap["errors"] == 0, snap
        finally:
            prefill.reap()
            decode.reap()
