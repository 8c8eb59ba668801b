"""The asyncio drivers: endpoints, room handles, memory descriptions."""

from kvproto.aio.decode import ConnectFailed, DecodeEndpoint
from kvproto.aio.endpoint import CurveAuth, EndpointClosed, EndpointConfig
from kvproto.aio.memory import AuxBuffer, KVCache, StateCache
from kvproto.aio.prefill import PrefillEndpoint
from kvproto.aio.room import ReceiverRoomHandle, RoomStats, SenderRoomHandle, TransferFailed

__all__ = [name for name in dir() if not name.startswith("_")]
