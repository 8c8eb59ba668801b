"""The call set both synchronous faces give an engine, and what they share to give it.

Theory of operation
-------------------
An engine's scheduler drives kvproto through two objects: a *facade* per rank (``sender`` /
``receiver`` to open rooms, ``get_finished`` once per step, ``close``) and a *room handle* per
request (``init``, ``send``, ``poll``, ``failure_exception``, ``code``, ``abort``), shaped like
SGLang's ``KVSender`` / ``KVReceiver``. The thread face (``kvproto.sync.thread``) and the process
face (``kvproto.sync.process``) implement the same calls; the protocols below say which, so that
an integration written against them takes either face (``kvproto.integrations.vllm`` picks one
by a setting). No call blocks: each is posted (to the endpoint's loop, or down a pipe to its
process) and returns.

Both faces copy what the engine hands them before the call returns (``group_lists``,
``slot_dict``): the engine may reuse its lists at once, and the endpoint reads them later, on
another thread or in another process. Both keep the rooms that ended since the last step in a
queue that ``get_finished`` empties (``FinishedRooms``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvproto.core import RoomState
from kvproto.wire import ErrorCode

KVPoll = RoomState
"""SGLang's name for the room states; the values are the same (FAILED 0 ... SUCCESS 4)."""

Finished = tuple[int, RoomState, "ErrorCode | int | None"]
"""(room id, final state, code) of a room that ended: what ``get_finished`` lists."""


def group_lists(group_pages: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]] | None:
    """A hybrid cache's pages by group, copied (None stays None)."""
    return None if group_pages is None else {name: list(pages) for name, pages in group_pages.items()}


def slot_dict(state_slots: Mapping[str, int] | None) -> dict[str, int] | None:
    """A hybrid cache's state slots by group, copied (None stays None)."""
    return None if state_slots is None else dict(state_slots)


class FinishedRooms:
    """What every facade keeps of the rooms that ended: a queue, emptied by ``get_finished``; and
    the context manager that closes the facade."""

    _finished: collections.deque[Finished]

    def close(self) -> None:
        raise NotImplementedError

    def _take_finished(self) -> list[Finished]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RoomCalls(Protocol):
    """The calls of every room handle, on both faces."""

    room_id: int

    def poll(self) -> RoomState:
        """The room's state, without waiting."""
        ...

    def failure_exception(self) -> None:
        """Raise why the room failed; return if it has not failed (yet)."""
        ...

    @property
    def code(self) -> ErrorCode | int | None: ...

    def abort(self) -> None:
        """Stop the room and tell the peer (posted; idempotent)."""
        ...


class SenderCalls(RoomCalls, Protocol):
    """A prefill room (``KVSender``, ``ProcessSender``)."""

    def init(self, num_tokens: int, aux_slot: int | None = None, *,
             state_slots: Mapping[str, int] | None = None) -> None: ...

    def send(self, pages: Sequence[int], end_token: int | None = None, *, layers: range | None = None,
             ready: Any = None, group_pages: Mapping[str, Sequence[int]] | None = None) -> None: ...


class ReceiverCalls(RoomCalls, Protocol):
    """A decode room (``KVReceiver``, ``ProcessReceiver``)."""

    def init(self, pages: Sequence[int], num_tokens: int, *, prefix_tokens: int = 0,
             aux_slot: int | None = None, group_pages: Mapping[str, Sequence[int]] | None = None,
             state_slots: Mapping[str, int] | None = None) -> None: ...


class FacadeCalls(Protocol):
    """The calls of every facade, on both faces."""

    def get_finished(self) -> list[Finished]:
        """The rooms that ended since the last call, in order."""
        ...

    def close(self) -> None: ...


class PrefillCalls(FacadeCalls, Protocol):
    """A prefill rank (``SyncPrefill``, ``ProcessPrefill``)."""

    address: str
    bootstrap_address: str

    @property
    def rooms_expired(self) -> int: ...

    def sender(self, room_id: int) -> SenderCalls: ...


class DecodeCalls(FacadeCalls, Protocol):
    """A decode rank (``SyncDecode``, ``ProcessDecode``)."""

    def receiver(self, room_id: int, bootstrap: str, *, pages: Sequence[int] | None = None,
                 num_tokens: int | None = None, prefix_tokens: int = 0, aux_slot: int | None = None,
                 group_pages: Mapping[str, Sequence[int]] | None = None,
                 state_slots: Mapping[str, int] | None = None) -> ReceiverCalls: ...
