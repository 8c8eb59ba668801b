"""The sans-IO protocol core: room state machine, sender and receiver bookkeeping, timers.

Nothing here awaits, sleeps, or imports asyncio, zmq, torch or nixl; time is passed in.
"""

from kvproto.core.events import (
    CoreStats,
    DropLink,
    LinkKey,
    Output,
    PagedPart,
    PostAux,
    PostGroups,
    PostStaged,
    PostWrite,
    StatePart,
    Scatter,
    RoomEnded,
    Send,
    Timeouts,
)
from kvproto.core.cost import DEVICE_COST, HOST_COST, PathCost
from kvproto.core.groups import GroupSpec, LinkGroup
from kvproto.core.receiver import Destination, ReceiverCore, ReceiverLink, ReceiverRoom
from kvproto.core.sender import SenderCore, SenderLink, SenderRoom
from kvproto.core.state import TABLE, Effect, Input, Role, RoomState, transition
from kvproto.core.timers import Timers

__all__ = [name for name in dir() if not name.startswith("_")]
