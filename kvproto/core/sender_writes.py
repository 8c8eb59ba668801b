"""How a prefill room's chunks become writes: ``SenderCore``'s write side.

Theory of operation
-------------------
Each chunk the application gives becomes, per writer link, at most one write of its tokens
(``_post_chunks``): a ``PostWrite`` for a one-group cache, a ``PostGroups`` carrying every group's
part for a hybrid one (``_group_parts``), the aux slot's ``PostAux`` with the chunk that completes
the last token range (``_post_aux``). Writes of a link are numbered by ``seq`` and tagged
(``_tag``). A staged link asks the decode rank's ring for staging (STAGING_REQUEST, one piece
outstanding at a time: ``_request_staging``), checks every grant against what it asked for and the
region it registered (``_on_grant``: house rule 7), and posts the piece as a ``PostStaged``; the
decode's watermarks count the pieces it scattered (``_on_watermark``). A writer link whose request
and groups are alike another's gets that link's very parts (``_alike``: module note of
``kvproto.core.sender``).

``SenderWrites`` is a mixin of ``SenderCore``: it reads the core's rooms, links and groups, and
changes a room's state only through ``apply`` (the table). This is the prefill's per-room host
path: every call here was measured and trimmed (see the git log of ``core/sender.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvproto.core.cost import page_runs
from kvproto.core.events import (
    LinkKey,
    PagedPart,
    Part,
    PostAux,
    PostGroups,
    PostStaged,
    PostWrite,
    StatePart,
    new_part,
)
from kvproto.core.groups import local_span, pages_from_zero
from kvproto.core.sender_room import SenderRoom, _Chunk, _Peer
from kvproto.core.state import Input
from kvproto.wire import (
    NAMED_WINDOW,
    NO_SLOT,
    ErrorCode,
    StagingGrant,
    StagingRequest,
    StagingWatermark,
    Tag,
    TagKind,
)


class SenderWrites:
    """``SenderCore``'s part: chunks into writes, staging requests, grants and watermarks."""

    # what ``SenderCore`` (through ``CoreBase``) provides
    rooms: dict[int, Any]
    stats: Any
    groups: tuple[Any, ...]
    layers: tuple[int, ...]
    _group_rows: tuple[tuple[Any, ...], ...]
    _outputs: list[Any]
    send: Callable[..., None]
    apply: Callable[..., None]
    _count_missing_room: Callable[[int], None]
    _peer_by_key: Callable[[SenderRoom, LinkKey], _Peer | None]

    # --- staging -------------------------------------------------------------------------------
    def _stage_up_to(self, room: SenderRoom, peer: _Peer, end: int) -> None:
        """Let the writer ask for staging up to token ``end``. On a link whose pieces end with the
        state block the request's last token waits for the state slots (they come with the last
        chunk, which may add no token): the piece that ends the request must carry them."""
        if peer.link.stage_tail and end == peer.request.num_tokens and room.state_slots is None:
            end -= 1
        peer.stage_end = max(peer.stage_end, end)
        self._request_staging(room, peer)

    def _request_staging(self, room: SenderRoom, peer: _Peer) -> None:
        """Ask for the next staged piece of ``peer``'s tokens, if any is available and none asked."""
        if peer.outstanding is not None or peer.stage_next >= peer.stage_end:
            return
        link = peer.link
        end = min(peer.stage_end, peer.stage_next + max(1, link.stage_max_units or peer.stage_end))
        seq = peer.posted
        peer.posted += 1  # the seq is reserved now; its write is posted once granted
        peer.outstanding = (seq, peer.stage_next, end)
        self.send(link.key, StagingRequest(room_id=room.room_id, generation=peer.request.generation, seq=seq,
                                           start_token=peer.stage_next, end_token=end))

    def _on_grant(self, key: LinkKey, msg: StagingGrant, now: float) -> None:
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        if room is None:
            self._count_missing_room(msg.room_id)
            return
        peer = self._peer_by_key(room, key)
        if peer is None or peer.request.generation != msg.generation:
            self.stats.stale_tags += 1
            return
        link, want = peer.link, peer.outstanding
        problem = None
        if want is None or want[0] != msg.seq or want[1] != msg.start_token:
            problem = ErrorCode.PEER_PROTOCOL_ERROR, f"grant for write {msg.seq} at token {msg.start_token} was not asked for"
        elif not want[1] < msg.end_token <= want[2]:
            problem = ErrorCode.INDEX_OUT_OF_RANGE, (
                f"grant of tokens [{msg.start_token}, {msg.end_token}) outside the request [{want[1]}, {want[2]})")
        elif msg.offset + self._piece_bytes(peer, msg.start_token, msg.end_token) > link.stage_capacity:
            problem = ErrorCode.INDEX_OUT_OF_RANGE, (
                f"grant at offset {msg.offset} overruns the {link.stage_capacity}-byte staging region")
        if problem is not None:
            self.apply(room, Input.PEER_VIOLATION, now, code=problem[0], reason=problem[1])
            return
        peer.outstanding = None
        peer.stage_next = msg.end_token
        self._outputs.append(PostStaged(
            room_id=room.room_id, link=key, seq=msg.seq,
            tag=self._tag(room.room_id, peer, msg.seq, TagKind.STAGED),
            start_token=msg.start_token, end_token=msg.end_token, src_pages=tuple(room.src_pages),
            remote_offset=msg.offset,
            ready=tuple(c.ready for c in room.chunks if c.ready is not None and c.start < msg.end_token),
            group_pages=tuple(tuple(p) for p in room.group_pages),
            states=self._piece_states(room, peer, msg.end_token)))
        peer.inflight.add(msg.seq)
        peer.staged_seqs.add(msg.seq)
        self._request_staging(room, peer)

    @staticmethod
    def _piece_bytes(peer: _Peer, start: int, end: int) -> int:
        """Bytes of the staged piece of tokens ``[start, end)`` to ``peer``: its units, and the
        state block where it carries the request's last token."""
        link = peer.link
        return (end - start) * link.stage_unit + (link.stage_tail if end == peer.request.num_tokens else 0)

    def _on_watermark(self, key: LinkKey, msg: StagingWatermark, now: float) -> None:
        room: SenderRoom | None = self.rooms.get(msg.room_id)
        peer = self._peer_by_key(room, key) if room is not None else None
        if peer is None or peer.request.generation != msg.generation:
            self._count_missing_room(msg.room_id)
            return
        if msg.seq not in peer.staged_seqs:
            self.apply(room, Input.PEER_VIOLATION, now, code=ErrorCode.PEER_PROTOCOL_ERROR,  # type: ignore[arg-type]
                       reason=f"watermark for write {msg.seq}, which was not staged")
            return
        peer.staged_seqs.discard(msg.seq)
        peer.consumed += 1


    def _post_chunks(self, room: SenderRoom) -> None:
        while room.posted_chunks < len(room.chunks):
            chunk = room.chunks[room.posted_chunks]
            room.posted_chunks += 1
            ready = () if chunk.ready is None else (chunk.ready,)
            src: tuple[int, ...] | None = None  # made once, by the first part that names the room's pages
            made: tuple[_Peer, tuple[Part, ...]] | None = None  # a link's parts (not staged), for links alike
            for peer in room.peers.values():
                link, req = peer.link, peer.request
                if not link.writes_any:
                    continue
                start = max(chunk.start, req.prefix_tokens)
                end = min(chunk.end, req.num_tokens)
                if link.writer and start < end and peer.staged is None:
                    peer.staged = self._stages(room, peer, start, end)
                if made is not None and self._alike(made[0], peer):
                    if made[1]:
                        self._post(room, peer, PostGroups, parts=made[1], ready=ready)
                    self._post_aux(room, chunk, peer)
                    continue
                span = local_span(self.layers, chunk.layers)
                parts: list[Part] = []
                if link.writer and start < end:
                    if peer.staged:
                        if chunk.completes:  # staged pieces carry every layer: the range waits for its last
                            self._stage_up_to(room, peer, end)
                    elif span is None or span[0] < span[1]:  # the span holds some of the first group's layers
                        if src is None:
                            src = tuple(room.src_pages)
                        if not self.groups:
                            self._post(room, peer, PostWrite, start_token=start, end_token=end,
                                       src_pages=src, dst_pages=req.dst_pages, layers=span, ready=ready)
                        else:
                            parts.append(new_part(PagedPart, (0, start, end, span, src, req.dst_pages)))
                elif peer.staged and chunk.last and chunk.completes:  # an empty last chunk: it gives the slots
                    self._stage_up_to(room, peer, end)
                if self.groups:
                    self._group_parts(parts, room, peer, chunk, start, end, src)
                posted = tuple(parts)
                if self.groups and peer.staged is not True:
                    made = (peer, posted)
                if posted:
                    self._post(room, peer, PostGroups, parts=posted, ready=ready)
                self._post_aux(room, chunk, peer)

    def _post_aux(self, room: SenderRoom, chunk: _Chunk, peer: _Peer) -> None:
        """The aux slot's write to ``peer``, with the chunk that completes the last token range."""
        if chunk.last and chunk.completes and peer.link.aux_owner and chunk.aux_slot is not None and \
                peer.request.aux_slot != NO_SLOT:
            self._post(room, peer, PostAux, src_slot=chunk.aux_slot, dst_slot=peer.request.aux_slot)

    @staticmethod
    def _alike(made: _Peer, peer: _Peer) -> bool:
        """Whether a chunk's write to ``peer`` has the very parts of the write to ``made`` (neither
        staged): the same request lists (identity) and token counts, a link of the same role and
        groups. The parts name groups, tokens, pages and slots, none of the link's own geometry."""
        a, b = made.request, peer.request
        return peer.staged is made.staged and b.dst_pages is a.dst_pages and b.groups is a.groups and \
            b.num_tokens == a.num_tokens and b.prefix_tokens == a.prefix_tokens and \
            peer.link.writer == made.link.writer and peer.link.groups == made.link.groups

    def _group_parts(self, parts: list[Part], room: SenderRoom, peer: _Peer, chunk: _Chunk, start: int, end: int,
                     src: tuple[int, ...] | None) -> None:
        """Add to ``parts`` the parts of groups beyond the first that a chunk's write to ``peer``
        carries: each paged group's tokens (clipped to its window; none where the link's staged
        pieces carry the group) and, with the last token range, each state slot, unless the piece
        that ends the request's tokens is still to be granted on a staged link: the slots then ride
        in it.
        A group whose pages are the first group's (``src``, that group's part's, if the write has
        one; the request's ``dst_pages``) names the same objects, so that a transport can tell by
        identity that the lists are one (``kvproto.transport.cuda_ipc`` then lists them once in its
        launch)."""
        req = peer.request
        states = chunk.last and room.state_slots is not None and not (peer.staged and peer.link.stage_tail > 0)
        layers, staged, dests = chunk.layers, peer.staged, req.groups
        for (g, state, window, own_layers), lg in zip(self._group_rows, peer.link.groups):
            if not lg.writes or (not states if state else lg.staged and staged):
                continue  # (a paged group the link's staged pieces carry)
            span = None if layers is None else local_span(own_layers, layers)
            if span is not None and span[0] == span[1]:
                continue  # none of the group's layers in this chunk
            dest = dests[g]
            if state:  # (group, layers, src_slot, dst_slot): the part's group counts the first as 0
                parts.append(new_part(StatePart, (g + 1, span, room.state_slots[g], dest.slot)))  # type: ignore[index]
                continue
            if window == NAMED_WINDOW:  # with the last chunk: the tokens the decode names, past its prefix
                if chunk.last:
                    self._named_part(parts, room, g, lg.block_size, dest, req.prefix_tokens, span, end)
                continue
            first = start if window is None else max(start, self.groups[g].window_start(req.num_tokens))
            if first < end:  # (group, start_token, end_token, layers, src_pages, dst_pages)
                held = room.group_pages[g]
                own = src if src is not None and (held is room.src_pages or held == room.src_pages) else tuple(held)
                pages = dest.pages
                to = req.dst_pages if dest.first_page == 0 and (pages is req.dst_pages or
                                                                pages == req.dst_pages) else pages_from_zero(dest)
                parts.append(new_part(PagedPart, (g + 1, first, end, span, own, to)))

    def _named_part(self, parts: list[Part], room: SenderRoom, g: int, dst_block: int, dest: Any, prefix: int,
                    span: tuple[int, int] | None, end: int) -> None:
        """A group whose window the engine names: the tokens from the decode's first named page (or
        its prefix) to the end, from the last pages the prefill's engine named (``_token_mismatch``
        failed the room before any write if they do not reach that far back)."""
        first = max(prefix, dest.first_page * dst_block)
        if first < end:
            held = room.group_pages[g]
            own = (0,) * self.groups[g].named_from(end, len(held)) + tuple(held)
            parts.append(new_part(PagedPart, (g + 1, first, end, span, own, pages_from_zero(dest))))

    def _piece_states(self, room: SenderRoom, peer: _Peer, end_token: int) -> tuple[StatePart, ...]:
        """The state slots gathered into a staged piece's state block: every state group the link
        writes, all its layers, in the piece that ends the request's tokens on a link whose pieces
        end with one (``stage_tail``). That piece is asked for only once the last chunk was given,
        and the last chunk gives the slots (``_state_slots``), so they are always known here."""
        req = peer.request
        if not peer.link.stage_tail or end_token != req.num_tokens:
            return ()
        assert room.state_slots is not None, "the piece that ends a request is asked for after its last chunk"
        writes = peer.link.groups
        return tuple([StatePart(g + 1, None, room.state_slots[g], req.groups[g].slot)
                      for g in self._states if writes[g].writes])

    def _post(self, room: SenderRoom, peer: _Peer, output: type, **fields: object) -> None:
        """Emit one tagged write to ``peer`` as its next ``seq``."""
        self._outputs.append(output(room_id=room.room_id, link=peer.link.key, seq=peer.posted,
                                    tag=self._tag(room.room_id, peer), **fields))
        peer.inflight.add(peer.posted)
        peer.posted += 1

    @staticmethod
    def _stages(room: SenderRoom, peer: _Peer, start: int, end: int) -> bool:
        """Whether the room's writes to ``peer`` stage (see ``kvproto.core.cost``)."""
        link = peer.link
        if not link.stage_unit:
            return False
        if link.cost is None:
            return True
        block = link.block_size
        runs = page_runs(room.src_pages, peer.request.dst_pages, start // block, -(-end // block))
        return link.cost.stage_wins(runs * link.regions, (end - start) * link.stage_unit)

    @staticmethod
    def _tag(room_id: int, peer: _Peer, seq: int | None = None, kind: TagKind = TagKind.KV) -> bytes:
        return Tag(kind=kind, room_id=room_id, generation=peer.request.generation,
                   link_id=peer.link.link_id, seq=peer.posted if seq is None else seq).encode()
