"""A hostile decode peer on a real ZMQ socket: coded errors, only its rooms fail, others go on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from kvproto.aio import DecodeEndpoint, PrefillEndpoint, TransferFailed
from kvproto.aio.memory import geometry_to_wire
from kvproto.core import RoomState
from kvproto.transport import load_transport
from kvproto.wire import (
    NO_SLOT,
    Abort,
    ErrorCode,
    Message,
    Register,
    RegisterAccept,
    RegisterReject,
    StagingGrant,
    TransferRequest,
    decode,
    encode,
)

from .conftest import TRANSPORTS, config, make_cache

pytestmark = pytest.mark.asyncio


class RawPeer:
    """A decode rank spoken by hand over a DEALER socket."""

    def __init__(self, transport: str, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.cache = make_cache(seed=11)
        self.transport = load_transport(transport, "raw-decode-peer")
        self.transport.register(self.cache.kv.memory_regions())
        self.transport_name = transport

    async def send(self, frame: bytes) -> None:
        await self.sock.send(frame)

    async def recv(self) -> Message:
        return decode(await asyncio.wait_for(self.sock.recv(), 5))

    def register_message(self, **overrides) -> Register:
        fields = dict(
            boot_id=1, instance="raw", link_id=42, agent_name=self.transport.name, model_id="", compat_key="",
            geometry=geometry_to_wire(self.cache.kv.geometry), aux_slots=4, aux_slot_bytes=16,
            transport=self.transport_name, transport_metadata=self.transport.metadata(),
            regions=self.cache.kv.wire_regions(),
        )
        fields.update(overrides)
        return Register(**fields)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        self.transport.close()


@pytest_asyncio.fixture(params=TRANSPORTS)
async def setup(request: pytest.FixtureRequest) -> AsyncIterator[tuple[PrefillEndpoint, DecodeEndpoint, RawPeer]]:
    src, dst = make_cache(seed=1), make_cache(seed=2)
    async with PrefillEndpoint(src.kv, config=config(request.param)) as prefill, \
            DecodeEndpoint(dst.kv, config=config(request.param)) as decode:
        raw = RawPeer(request.param, prefill.address)
        try:
            yield prefill, decode, raw
        finally:
            raw.close()


async def good_room(prefill: PrefillEndpoint, decode: DecodeEndpoint, room_id: int) -> None:
    d = decode.open_room(room_id, prefill.bootstrap_address, pages=[1, 2], num_tokens=8)
    p = prefill.open_room(room_id)
    p.send([3, 4], 8)
    await asyncio.wait_for(asyncio.gather(d.wait(), p.wait()), 10)


async def test_prefill_answers_garbage_with_malformed_frame(setup) -> None:
    """Random bytes get ABORT(MALFORMED_FRAME); the endpoint keeps serving real rooms."""
    prefill, decode, raw = setup
    await raw.send(b"\x00garbage that is not a frame")
    reply = await raw.recv()
    assert isinstance(reply, Abort) and reply.code == ErrorCode.MALFORMED_FRAME
    await good_room(prefill, decode, 1)


async def test_prefill_rejects_unknown_major_version(setup) -> None:
    """A REGISTER with major version 2 is refused with UNSUPPORTED_VERSION."""
    prefill, decode, raw = setup
    frame = bytearray(encode(raw.register_message()))
    frame[2] = 2
    await raw.send(bytes(frame))
    reply = await raw.recv()
    assert isinstance(reply, RegisterReject) and reply.code == ErrorCode.UNSUPPORTED_VERSION
    await good_room(prefill, decode, 2)


async def test_prefill_rejects_incompatible_registration(setup) -> None:
    """A model mismatch and a short memory table are refused with their codes."""
    _prefill, _decode, raw = setup
    await raw.send(encode(raw.register_message(model_id="other-model")))
    reply = await raw.recv()
    assert isinstance(reply, RegisterReject) and reply.code == ErrorCode.MODEL_MISMATCH
    await raw.send(encode(raw.register_message(regions=raw.cache.kv.wire_regions()[:1])))
    reply = await raw.recv()
    assert isinstance(reply, RegisterReject) and reply.code == ErrorCode.INDEX_OUT_OF_RANGE


async def test_prefill_out_of_range_page_fails_only_that_room(setup) -> None:
    """A request naming an unregistered page fails that room with INDEX_OUT_OF_RANGE, writes
    nothing, and a concurrent room of a well-behaved decode succeeds."""
    prefill, decode, raw = setup
    await raw.send(encode(raw.register_message()))
    assert isinstance(await raw.recv(), RegisterAccept)
    victim = prefill.open_room(10)
    victim.send([5, 6], 8)
    before = [t.clone() for t in raw.cache.planes[0]]
    await raw.send(encode(TransferRequest(room_id=10, generation=3, num_tokens=8, prefix_tokens=0,
                                          aux_slot=NO_SLOT, expected_writers=1, dst_pages=(1, 1_000_000))))
    reply = await raw.recv()
    assert isinstance(reply, Abort) and reply.code == ErrorCode.INDEX_OUT_OF_RANGE and reply.room_id == 10
    with pytest.raises(TransferFailed) as failed:
        await asyncio.wait_for(victim.wait(), 5)
    assert failed.value.code is ErrorCode.INDEX_OUT_OF_RANGE
    assert all(t.equal(b) for t, b in zip(raw.cache.planes[0], before))
    await good_room(prefill, decode, 11)


async def test_prefill_truncated_request_fails_its_room(setup) -> None:
    """A truncated TRANSFER_REQUEST for a live room fails that room with MALFORMED_FRAME."""
    prefill, decode, raw = setup
    await raw.send(encode(raw.register_message()))
    assert isinstance(await raw.recv(), RegisterAccept)
    victim = prefill.open_room(20)
    frame = encode(TransferRequest(room_id=20, generation=3, num_tokens=8, prefix_tokens=0, aux_slot=NO_SLOT,
                                   expected_writers=1, dst_pages=(1, 2)))
    await raw.send(frame[:-3])
    with pytest.raises(TransferFailed) as failed:
        await asyncio.wait_for(victim.wait(), 5)
    assert failed.value.code is ErrorCode.MALFORMED_FRAME
    await good_room(prefill, decode, 21)


async def test_prefill_unknown_room_messages_are_absorbed(setup) -> None:
    """A STAGING_GRANT for a room that never existed is counted and dropped; an ABORT for a room
    not yet open fails it at once when it opens; other rooms are untouched."""
    prefill, decode, raw = setup
    await raw.send(encode(raw.register_message()))
    assert isinstance(await raw.recv(), RegisterAccept)
    await raw.send(encode(StagingGrant(room_id=999, generation=1, seq=0, start_token=0, end_token=1, offset=0)))
    await raw.send(encode(Abort(room_id=12345, generation=1, code=ErrorCode.ABORTED, reason="x")))
    await asyncio.sleep(0.1)
    assert prefill.core.stats.unknown_room_messages == 1
    late = prefill.open_room(12345)
    with pytest.raises(TransferFailed) as failed:
        await asyncio.wait_for(late.wait(), 5)
    assert failed.value.code is ErrorCode.ABORTED
    await good_room(prefill, decode, 30)
    assert prefill.core.room_state(30) is RoomState.SUCCESS
