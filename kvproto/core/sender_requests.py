"""A decode rank's TRANSFER_REQUEST on the prefill rank: checked, parked or recorded.

Theory of operation
-------------------
A room waits in BOOTSTRAPPING until every decode rank of one decode instance that pairs with
this prefill rank has sent its request (``_on_request``). A request for a room the application
has not opened yet is *parked*, bounded in number and kept ``Timeouts.parked`` (``_park``), and
replayed when the room opens. Every index a request names is checked against what its link
registered before it is recorded (``_check_request``: house rule 7), and the sides' token counts
must agree (``_token_mismatch``); a bad request fails the room with its code and writes nothing.
The TP ranks of one decode engine send the same body, which the codec decodes to the very lists
it gave the first: a request naming those lists against a link of no more pages passes on that
identity (``_checked_by``), so a room is checked once, not once per rank.

``SenderRequests`` is a mixin of ``SenderCore``; it records a request as the room's ``_Peer`` and
moves the room only through ``apply`` (the table). It runs once per room and rank on the
prefill's per-room host path (see the git log of ``core/sender.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvproto.core.base import duplicate_page
from kvproto.core.events import LinkKey
from kvproto.core.groups import check_destinations
from kvproto.core.sender_room import SenderLink, SenderRoom, _Peer, _pages_for
from kvproto.core.state import Input
from kvproto.wire import NO_SLOT, ErrorCode, TransferRequest


class SenderRequests:
    """``SenderCore``'s part: the decode ranks' requests for its rooms."""

    # what ``SenderCore`` (through ``CoreBase``) provides
    rooms: dict[int, Any]
    links: dict[LinkKey, Any]
    groups: tuple[Any, ...]
    stats: Any
    timers: Any
    timeouts: Any
    closed: bool
    max_parked: int
    _parked: dict[int, list[tuple[LinkKey, TransferRequest]]]
    _parked_count: int
    send: Callable[..., None]
    apply: Callable[..., None]
    _abort_message: Callable[..., Any]
    _answer_late: Callable[[LinkKey, int, int], bool]

    def _on_request(self, key: LinkKey, msg: TransferRequest, now: float) -> None:
        link = self.links.get(key)
        if link is None:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.NOT_REGISTERED,
                                               "transfer request before registration"))
            return
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        if room is None:
            self._park(key, msg, now)
            return
        if room.state.terminal:  # pragma: no cover - ended rooms leave self.rooms
            return
        if msg.generation in room.stale_generations:
            self.stats.stale_tags += 1  # a late copy of a request the previous incarnation already settled
            return
        if room.instance is not None and room.instance != link.instance:
            self.stats.peer_violations += 1
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.DUPLICATE_ROOM,
                                               f"room {msg.room_id} is already bound to decode instance {room.instance!r}, "
                                               f"not {link.instance!r} (the TP ranks of one decode engine must share EndpointConfig.instance)"))
            return
        known = room.peers.get(link.decode_rank)
        if known is not None and known.link.key == key and known.request == msg:
            self.stats.late_messages += 1  # the same request twice (a duplicated frame): idempotent
            return
        problem = self._check_request(room, link, msg)
        if problem is not None:
            code, reason = problem
            if known is None or known.link.key != key:
                # Not a peer of the room: nothing of ours is in flight to it, tell it now. A peer
                # hears the code through ABORT_PEERS, after its writes in flight are over.
                self.send(key, self._abort_message(msg.room_id, msg.generation, code, reason))
            self.apply(room, Input.PEER_VIOLATION, now, code=code, reason=reason, origin=key)
            return
        room.instance = link.instance
        room.expected = link.paired_ranks
        room.peers[link.decode_rank] = _Peer(link, msg, stage_next=msg.prefix_tokens, stage_end=msg.prefix_tokens)
        mismatch = self._token_mismatch(room)
        if mismatch:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.TOKEN_COUNT_MISMATCH, reason=mismatch)
            return
        if len(room.peers) < len(room.expected):
            self.apply(room, Input.REQUEST_PARTIAL, now)
            return
        room.decode_prefix = min(p.request.prefix_tokens for p in room.peers.values())
        if room.chunks:
            self.apply(room, Input.REQUEST_COMPLETE_WITH_INPUT, now)
        else:
            self.apply(room, Input.REQUEST_COMPLETE, now)

    def _check_request(self, room: SenderRoom, link: SenderLink, msg: TransferRequest) -> tuple[ErrorCode, str] | None:
        if link.decode_rank not in link.paired_ranks:
            return ErrorCode.PEER_PROTOCOL_ERROR, f"decode rank {link.decode_rank} does not pair with this prefill rank"
        if link.decode_rank in room.peers:
            return ErrorCode.PEER_PROTOCOL_ERROR, f"second transfer request from decode rank {link.decode_rank}"
        if msg.prefix_tokens > msg.num_tokens or msg.prefix_tokens % link.block_size:
            return ErrorCode.INDEX_OUT_OF_RANGE, (
                f"prefix of {msg.prefix_tokens} tokens is not a whole number of decode blocks within {msg.num_tokens}")
        need = _pages_for(msg.num_tokens, link.block_size)
        if len(msg.dst_pages) != need:
            return ErrorCode.TOKEN_COUNT_MISMATCH, (
                f"{msg.num_tokens} tokens need {need} decode pages, the request lists {len(msg.dst_pages)}")
        pages_checked, groups_checked = self._checked_by(room, link, msg)
        if not pages_checked:
            if msg.dst_pages and max(msg.dst_pages) >= link.num_blocks:
                return ErrorCode.INDEX_OUT_OF_RANGE, (
                    f"destination page {max(msg.dst_pages)} outside the {link.num_blocks} registered pages")
            twice = duplicate_page(msg.dst_pages)
            if twice is not None:
                return ErrorCode.INDEX_OUT_OF_RANGE, (
                    f"destination page {twice} is listed twice: two token ranges would share it")
        if msg.aux_slot != NO_SLOT and msg.aux_slot >= link.aux_slots:
            return ErrorCode.INDEX_OUT_OF_RANGE, f"aux slot {msg.aux_slot} outside the {link.aux_slots} registered slots"
        if msg.generation == 0:
            return ErrorCode.PEER_PROTOCOL_ERROR, "transfer request without a generation"
        if (self.groups or msg.groups) and not groups_checked:
            return check_destinations(self.groups, link.groups, msg.groups, msg.num_tokens, msg.prefix_tokens,
                                      (msg.dst_pages, link.num_blocks))
        return None

    @staticmethod
    def _checked_by(room: SenderRoom, link: SenderLink, msg: TransferRequest) -> tuple[bool, bool]:
        """Whether a request of ``room`` already checked (a peer's) names ``msg``'s very page list
        (the same object) against a link of no more pages, and its very group destinations for the
        same token counts against a link that registered the same groups: then ``msg``'s pages,
        and its groups, pass the checks that one passed (module docstring)."""
        peer = next(iter(room.peers.values()), None)  # any checked request will do: take the first
        if peer is None:
            return False, False
        seen, other = peer.request, peer.link
        pages = seen.dst_pages is msg.dst_pages and other.num_blocks <= link.num_blocks
        groups = pages and seen.groups is msg.groups and seen.num_tokens == msg.num_tokens and \
            seen.prefix_tokens == msg.prefix_tokens and other.groups == link.groups
        return pages, groups

    def _token_mismatch(self, room: SenderRoom) -> str | None:
        counts = {p.request.num_tokens for p in room.peers.values()}
        if len(counts) > 1:
            return f"decode ranks disagree on the token count: {sorted(counts)}"
        if room.first_page and room.chunks:
            skipped = room.chunks[0].start
            short = [p.request.prefix_tokens for p in room.peers.values() if p.request.prefix_tokens < skipped]
            if short:
                return (f"the prefill sends tokens from {skipped} on (first_token), a decode rank's prefix holds "
                        f"only {min(short)}")
        if counts and room.chunks:
            (n,) = counts
            if room.end_token > n:
                return f"prefill reached token {room.end_token}, decode expects {n} tokens"
            if room.last_given and room.end_token != n:
                return f"prefill's last chunk ends at token {room.end_token}, decode expects {n} tokens"
            if room.last_given:
                return self._named_short(room)
        return None

    def _named_short(self, room: SenderRoom) -> str | None:
        """Why a decode rank needs tokens of a group whose window the engine names that the
        prefill's engine did not name (the first token it named is later), or None."""
        for g, spec in enumerate(self.groups):
            if not spec.named:
                continue
            held_from = spec.named_from(room.end_token, len(room.group_pages[g])) * spec.block_size
            for peer in room.peers.values():
                lg, req = peer.link.groups[g], peer.request
                needed = max(req.prefix_tokens, req.groups[g].first_page * lg.block_size)
                if lg.writes and needed < min(held_from, req.num_tokens):
                    return (f"group {spec.name!r}: the decode needs its tokens from {needed}, the prefill's engine "
                            f"named them from {held_from}")
        return None

    def _park(self, key: LinkKey, msg: TransferRequest, now: float) -> None:
        if self.closed:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.ENDPOINT_CLOSED,
                                               "endpoint closed"))
            return
        if self._answer_late(key, msg.room_id, msg.generation):
            return
        if self._parked_count >= self.max_parked:
            self.send(key, self._abort_message(msg.room_id, msg.generation, ErrorCode.UNKNOWN_ROOM,
                                               "too many requests for rooms not yet opened"))
            return
        parked = self._parked.setdefault(msg.room_id, [])
        if not parked:
            self.timers.schedule(("parked", msg.room_id), now + self.timeouts.parked)
        parked.append((key, msg))
        self._parked_count += 1
