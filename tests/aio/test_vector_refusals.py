"""The ``refuse`` vectors of spec/v1/vectors (vectors/README.md: refused frames) against kvproto's
prefill rank: given the frames of a vector's link in order, its registration check and its core
answer the last with the listed message and code and act on nothing in it, while the released
vectors the refuse vectors were made from pass the same steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvproto.aio import KVCache
from kvproto.aio.endpoint import EndpointConfig
from kvproto.aio.memory import geometry_from_wire, groups_from_wire
from kvproto.aio.registration import Reject, Remote, check_register
from kvproto.core import GroupSpec, LinkGroup, PostWrite, RoomEnded, RoomState, Send, SenderCore, SenderLink
from kvproto.geometry.groups import CacheGeometry, PagedGroup
from kvproto.transport import MemKind
from kvproto.wire import CacheGroups, ErrorCode, Register, TransferRequest, decode

from tests.wire.test_vectors import FRAMES_REFUSE, ids, read_vector

T0 = 100.0
LINK = "decode-1"


@dataclass
class Answer:
    """What the prefill rank did with the last frame of a link: the message it answered with (its
    type's wire name and code), or None; and, for a request, the state the room is left in."""

    answer: str | None
    code: ErrorCode | int | None = None
    room: RoomState | None = None
    remote: Remote | None = None


def prefill_side() -> tuple[EndpointConfig, KVCache, CacheGeometry]:
    """The prefill rank the refuse vectors expect: register_groups.hex's transport, model, key and
    geometry (as the same TP rank, with a pool of its own), and cache_groups.hex's groups."""
    register = decode(read_vector("register_groups.hex"))
    g = geometry_from_wire(register.geometry)
    heads = g.num_kv_heads // g.tp_size
    planes = [[torch.zeros((2, g.block_size, heads, g.head_dim), dtype=torch.bfloat16) for _ in range(g.num_layers)]
              for _ in range(2)]
    kv = KVCache.from_tensors(planes, tp_size=g.tp_size, tp_rank=g.tp_rank, num_kv_heads=g.num_kv_heads,
                              aux=torch.zeros((4, register.aux_slot_bytes), dtype=torch.uint8))
    cache = groups_from_wire(PagedGroup(kv.name, kv.geometry), decode(read_vector("cache_groups.hex")).groups)
    config = EndpointConfig(transport=register.transport, model_id=register.model_id, compat_key=register.compat_key)
    return config, kv, cache


def receive(files: list[str]) -> Answer:
    """A prefill rank receiving ``files`` on one link, in order: a CACHE_GROUPS is kept for the
    REGISTER of its link id; a REGISTER is checked; a TRANSFER_REQUEST is checked by a core with the
    room open. The answer to the last frame."""
    config, kv, cache = prefill_side()
    kept: Any = None
    remote: Remote | None = None
    answer = Answer(None)
    for name in files:
        msg = decode(read_vector(name))
        if isinstance(msg, CacheGroups):
            kept = msg
        elif isinstance(msg, Register):
            groups = kept.groups if kept is not None and kept.link_id == msg.link_id else ()
            try:
                remote = check_register(msg, groups, config=config, kv=kv, cache=cache,
                                        reachable=frozenset({MemKind.DRAM, MemKind.VRAM}))
            except Reject as exc:
                return Answer("REGISTER_REJECT", exc.code)
            answer = Answer(None, remote=remote)
        else:
            assert isinstance(msg, TransferRequest) and remote is not None, name
            answer = request(remote, kv, cache, msg)
    return answer


def request(remote: Remote, kv: KVCache, cache: CacheGeometry, msg: TransferRequest) -> Answer:
    """``msg`` from the registered decode rank of ``remote`` to a prefill core with the room open."""
    def group(g: Any, own: bool) -> Any:
        if isinstance(g, PagedGroup):
            return (GroupSpec(g.name, False, g.geometry.num_blocks, g.geometry.block_size, g.window) if own
                    else LinkGroup(True, g.geometry.num_blocks, g.geometry.block_size))
        return GroupSpec(g.name, True, g.num_slots) if own else LinkGroup(True, g.num_slots)

    d = remote.geometry
    core = SenderCore(block_size=kv.geometry.block_size, num_blocks=kv.geometry.num_blocks, aux_slots=4,
                      groups=[group(g, True) for g in cache.groups[1:]])
    core.add_link(SenderLink(key=LINK, link_id=7, instance="decode", decode_rank=d.tp_rank, num_blocks=d.num_blocks,
                             block_size=d.block_size, aux_slots=remote.aux[1] if remote.aux else 0,
                             paired_ranks=frozenset({d.tp_rank}), writer=True, aux_owner=True,
                             groups=tuple(group(g, False) for g in remote.cache.groups[1:])))
    core.open_room(msg.room_id, T0)
    core.on_message(LINK, msg, T0)
    outs = core.pop_outputs()
    assert not any(isinstance(o, PostWrite) for o in outs)
    sent = [o.message for o in outs if isinstance(o, Send)]
    ended = [o for o in outs if isinstance(o, RoomEnded)]
    if not sent:
        return Answer(None, room=core.room_state(msg.room_id))
    (abort,) = sent
    assert [(e.state, e.code) for e in ended] == [(RoomState.FAILED, abort.code)]
    return Answer(type(abort).MSG_TYPE.name, abort.code, RoomState.FAILED)


@pytest.mark.parametrize("entry", FRAMES_REFUSE, ids=ids(FRAMES_REFUSE))
def test_vector_refusals_answer_the_last_frame_with_the_listed_code(entry: dict[str, Any]) -> None:
    """The frames a refuse vector lists, received in order, end with the listed answer and code;
    the room of a refused request fails before anything is written."""
    got = receive(entry["frames"])
    assert (got.answer, got.code) == (entry["answer"], ErrorCode[entry["code"]]), entry["file"]


def test_vector_refusals_the_released_frames_they_differ_from_are_accepted() -> None:
    """The released link the refuse vectors are made from is accepted: cache_groups.hex, then
    register_groups.hex, then transfer_request_groups.hex, which leaves the room waiting for its KV."""
    assert receive(["cache_groups.hex", "register_groups.hex"]).answer is None
    got = receive(["cache_groups.hex", "register_groups.hex", "transfer_request_groups.hex"])
    assert got.answer is None and got.room is RoomState.WAITING_FOR_INPUT


def test_vector_refusals_fields_fixed_for_the_other_kind_are_ignored() -> None:
    """cache_groups_other_kind_fields.hex (values in the fields the table fixes for the other kind)
    registers the very groups cache_groups.hex does, and the same request is accepted after it."""
    plain = receive(["cache_groups.hex", "register_groups.hex"]).remote
    other = receive(["cache_groups_other_kind_fields.hex", "register_groups.hex"]).remote
    assert plain is not None and other is not None and other.cache == plain.cache
    got = receive(["cache_groups_other_kind_fields.hex", "register_groups.hex", "transfer_request_groups.hex"])
    assert got.answer is None and got.room is RoomState.WAITING_FOR_INPUT
