"""The connector's scheduler role: which rooms exist, and what each step tells the workers.

Theory of operation
-------------------
vLLM's scheduler process never touches KV memory; it decides, every step, what its workers do.
This role turns vLLM's scheduler calls into one ``KVProtoMetadata`` per step (five lists, each
entry naming the vLLM request and the kvproto room) and frees a request's blocks only once its
workers report the room ended. A request takes the prefill side when its ``kv_transfer_params``
ask for ``do_remote_decode`` (on a ``kv_producer`` or ``kv_both`` instance), the decode side when
they carry ``do_remote_prefill`` and a room (``kv_consumer`` or ``kv_both``)::

    prefill side                                     decode side
    allocated: a room (the proxy's, or a new id)     on_new_request: Hold (open the room at once:
    each step: Open once, then Send the chunk's        its links bootstrap while it queues)
      new pages of every group (whole pages, or      allocated: Recv (the destination: every group's
      up to the prompt's end)                          pages, the local prefix hit)
    preempted: Abort (vLLM freed the blocks)         finished before its KV came: Abort
    finished: hold the blocks, return the room       room ended (workers): the request's KV landed
    room ended (workers): free the blocks              or failed (vLLM recomputes, or fails it)

A preempted prefill request loses the blocks its room was reading, so that room can never
succeed: it is aborted at once (its decode fails and recomputes, told why). If the room id was the
connector's own, the resumed request opens a fresh room that its finished output will name; if the
proxy chose the id (the decode may already hold the room), the finished output says
``kvproto_error: preempted`` instead, so the proxy is told plainly. Both count in the metrics.

Steps give whole pages: a chunk that completes no page of a group gives none of it (kvproto moves
it with a later chunk); the last chunk gives everything up to the prompt's end.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvproto.integrations.vllm.settings import BOOTSTRAP, ERROR, ROOM

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvproto.vllm")


# --- what a scheduler tells its workers each step ---------------------------------------------
@dataclass(frozen=True)
class Step:
    """What every step a scheduler tells its workers names first: the vLLM request and its
    kvproto room (the fields of each kind of step follow)."""

    req_id: str
    room: int


@dataclass(frozen=True)
class Open(Step):
    """Prefill: open ``room`` for a request of ``num_tokens`` prompt tokens (its first step)."""

    num_tokens: int


@dataclass(frozen=True)
class Send(Step):
    """Prefill: tokens up to ``end`` of ``room`` are computed this step; ``pages`` gives, per vLLM KV
    cache group, the request's blocks not given before (whole pages, or up to the prompt's end)."""

    pages: dict[int, list[int]]
    end: int
    num_tokens: int
    slots: dict[int, int] = field(default_factory=dict)
    """The last chunk: per vLLM state group, the request's running-state block."""


@dataclass(frozen=True)
class Hold(Step):
    """Decode: open ``room`` at ``bootstrap`` now (its destination comes with a ``Recv``)."""

    bootstrap: str


@dataclass(frozen=True)
class Recv(Step):
    """Decode: ``room``'s destination: per vLLM KV cache group, the request's blocks from token 0
    to the prompt's end (the first ``prefix_tokens`` a local prefix hit; the worker takes of each
    kvproto group's blocks those holding tokens it needs: a sliding window's last)."""

    bootstrap: str
    pages: dict[int, list[int]]
    num_tokens: int
    prefix_tokens: int
    slots: dict[int, int] = field(default_factory=dict)
    """Per vLLM state group, the block the request's state goes to."""


@dataclass(frozen=True)
class Abort(Step):
    """End ``room`` on the prefill (``prefill``) or the decode side. A decode room never opened here
    is opened only to tell the prefill at ``bootstrap`` to let go of it."""

    prefill: bool
    bootstrap: str | None = None
    reason: str = ""


class KVProtoMetadata(KVConnectorMetadata):
    def __init__(self) -> None:
        self.opens: list[Open] = []
        self.sends: list[Send] = []
        self.holds: list[Hold] = []
        self.recvs: list[Recv] = []
        self.aborts: list[Abort] = []


@dataclass
class _Prefilling:
    """A prefill request's room as the scheduler tracks it."""

    room: int
    prompt: int
    proxy_room: bool
    """The proxy chose the room id (the decode may hold it already)."""
    blocks: dict[int, list[int]] = field(default_factory=dict)
    """vLLM group -> the request's block ids from token 0."""
    given: dict[int, int] = field(default_factory=dict)
    """vLLM group -> blocks already given to the workers."""
    opened: bool = False
    done: bool = False
    """Its last chunk has been given (or its room aborted)."""
    preempted: bool = False
    """vLLM preempted it after its room saw blocks: that room was aborted."""


class Scheduler:
    """The scheduler role (see the module docstring)."""

    def __init__(self, *, producer: bool, consumer: bool, blocks: dict[int, int], bootstrap_address: str,
                 engine_id: str, states: dict[int, int] | None = None) -> None:
        self.producer, self.consumer = producer, consumer
        self.blocks = blocks
        """vLLM group -> its block size, for every paged group a room moves."""
        self.states = dict(states or {})
        """vLLM state group -> the speculative scratch blocks after a request's running-state block."""
        self.backoff = 1 if self.states else 0
        """Prompt tokens the prefill leaves to the decode (a state model's last: see ``cache``)."""
        self.bootstrap_address = bootstrap_address
        self.engine_id = engine_id
        self.align = math.lcm(*blocks.values())
        """A chunk that does not end the prompt ends on a page boundary of every group."""
        self.prefilling: dict[str, _Prefilling] = {}
        """Prefill: request id -> its room, from its first allocation until it has finished."""
        self.held: set[str] = set()
        """Prefill: finished requests whose blocks wait for their room to end (finished_sending)."""
        self.recving: dict[str, int] = {}
        """Decode: request id -> room, from its arrival until its room has ended."""
        self.destined: set[str] = set()
        """Decode: requests whose room was given its destination (vLLM waits for their KV)."""
        self.next = KVProtoMetadata()
        self.preempted = 0
        """Prefill rooms aborted because vLLM preempted their request (the stats report them)."""

    # -- which side a request takes --
    def _prefill_side(self, params: dict[str, Any]) -> bool:
        return self.producer and bool(params.get("do_remote_decode"))

    def _decode_side(self, params: dict[str, Any]) -> bool:
        return self.consumer and bool(params.get("do_remote_prefill")) and ROOM in params and BOOTSTRAP in params

    def _slot(self, group: int, blocks: list[int]) -> int:
        scratch = min(self.states[group], len(blocks) - 1)
        return (blocks[:-scratch] if scratch else blocks)[-1]

    # -- vLLM's scheduler calls, in the order it makes them --
    def new_request(self, request: Request) -> None:
        """Decode: a request whose prompt another instance computes opens its room at once, so its
        links bootstrap (and the prefill learns it is wanted) while it waits for blocks. Prefill, a
        model with state groups: the prompt's last token is left to the decode (vLLM's rule, as its
        NixlConnector applies it)."""
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if self.backoff and self._prefill_side(params) and not params.get("_kvproto_truncated") \
                and request.num_prompt_tokens > self.backoff and request.prompt_token_ids is not None:
            params["_kvproto_truncated"] = True
            del request.prompt_token_ids[-self.backoff:]
            del request._all_token_ids[-self.backoff:]
            request.num_prompt_tokens -= self.backoff
            request.max_tokens = 1
        if self._decode_side(params) and rid not in self.recving:
            room = int(params[ROOM])
            self.recving[rid] = room
            self.next.holds.append(Hold(rid, room, str(params[BOOTSTRAP])))

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not self._decode_side(params):
            return 0, False
        count = self._remote_tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if self._prefill_side(params):
            if rid not in self.prefilling:
                proxy = ROOM in params
                room = int(params[ROOM]) if proxy else secrets.randbits(63) or 1
                self.prefilling[rid] = _Prefilling(room, request.num_prompt_tokens, proxy)
            return
        if not self._decode_side(params):
            return
        params["do_remote_prefill"] = False  # a rescheduled request does not take the room twice
        room, bootstrap = int(params[ROOM]), str(params[BOOTSTRAP])
        if rid not in self.recving:  # arrived before this connector (or the hold was dropped): open it now
            self.recving[rid] = room
        if num_external_tokens <= 0:  # all of it a local hit: release the prefill's blocks now
            self.recving.pop(rid, None)
            self.next.aborts.append(Abort(rid, room, False, bootstrap, "the decode holds the whole prompt"))
            return
        n = self._remote_tokens(request)
        ids = blocks.get_block_ids()
        pages = {g: list(ids[g][:-(-n // size)]) for g, size in self.blocks.items()}
        slots = {g: self._slot(g, list(ids[g])) for g in self.states}
        self.destined.add(rid)
        self.next.recvs.append(Recv(rid, room, bootstrap, pages, n, n - num_external_tokens, slots))

    def meta(self, out: SchedulerOutput) -> KVProtoMetadata:
        meta, self.next = self.next, KVProtoMetadata()
        if not self.prefilling:
            return meta
        for rid in out.preempted_req_ids or ():
            p = self.prefilling.get(rid)
            if p is not None and p.opened and not p.done:
                self._preempt(rid, p, meta)
        steps: list[tuple[str, int, tuple[list[int], ...] | None, bool]] = []
        for new in out.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, new.block_ids, True))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            steps.append((rid, cached.num_computed_tokens[i], cached.new_block_ids[i], rid in cached.resumed_req_ids))
        for rid, computed, ids, in_full in steps:
            p = self.prefilling.get(rid)
            if p is None:
                continue  # not a request whose prompt goes to another instance
            if in_full and p.opened:  # scheduled again after a preemption: its block ids come in full
                if not p.done:
                    self._preempt(rid, p, meta)  # preempted without vLLM saying so: its blocks were freed
                if p.preempted and not p.proxy_room:  # recomputed: a fresh room carries it
                    p = self.prefilling[rid] = _Prefilling(secrets.randbits(63) or 1, p.prompt, False)
                p.blocks = {}
            if p.done:
                continue  # its prompt has gone (it decodes now), or its room was given up
            if not p.opened:
                p.opened = True
                meta.opens.append(Open(rid, p.room, p.prompt))
            for group, new in enumerate(ids or ()):
                p.blocks.setdefault(group, []).extend(new)
            end = min(p.prompt, computed + out.num_scheduled_tokens.get(rid, 0))
            last = end >= p.prompt
            if not last:
                end -= end % self.align
            pages: dict[int, list[int]] = {}
            for g, size in self.blocks.items():
                upto = -(-end // size)
                pages[g] = p.blocks.get(g, [])[p.given.get(g, 0):upto]
                p.given[g] = upto
            if not last and not any(pages.values()):
                continue  # no whole page completed this step
            slots = {g: self._slot(g, p.blocks.get(g, [])) for g in self.states} if last else {}
            meta.sends.append(Send(rid, p.room, pages, end, p.prompt, slots))
            p.done = last
        return meta

    def _preempt(self, rid: str, p: _Prefilling, meta: KVProtoMetadata) -> None:
        log.warning("kvproto connector: prefill request %s was preempted mid-prompt; its room %d is aborted%s", rid,
                    p.room, " (the proxy chose it: the decode computes the prompt itself)" if p.proxy_room
                    else ", a fresh room carries the recomputed prompt")
        meta.aborts.append(Abort(rid, p.room, True, reason="the prefill request was preempted"))
        p.done = p.preempted = True
        self.preempted += 1

    def _remote_tokens(self, request: Request) -> int:
        """The prompt tokens a decode takes from the prefill: all but the last ``backoff``."""
        n = request.num_prompt_tokens
        return n - self.backoff if self.backoff and n > self.backoff else n

    def finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params or {}
        room = self.recving.pop(rid, None)
        if room is not None:  # decode: still loading, or never given blocks: its room ends now
            self.destined.discard(rid)
            self.next.aborts.append(Abort(rid, room, False, str(params.get(BOOTSTRAP)),
                                          "the decode request finished before its KV"))
            return False, None
        p = self.prefilling.pop(rid, None)
        if p is None or not p.opened:
            return False, None  # not disaggregated, or finished before its first step: no room opened
        self.held.add(rid)  # the workers' room may still read these blocks: freed once it has ended
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if p.preempted and p.proxy_room:
            return True, {"do_remote_prefill": False, "do_remote_decode": False, ERROR: "preempted",
                          ROOM: p.room, BOOTSTRAP: self.bootstrap_address}
        if not (ok and p.done and not p.preempted):
            if not p.preempted:
                self.next.aborts.append(Abort(rid, p.room, True, reason="the prefill request did not finish"))
            return True, None
        return True, {"do_remote_prefill": True, "do_remote_decode": False, BOOTSTRAP: self.bootstrap_address,
                      ROOM: p.room, "remote_engine_id": self.engine_id}

    def output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_sending or ():
            self.held.discard(rid)
        for rid in out.finished_recving or ():
            self.recving.pop(rid, None)
            self.destined.discard(rid)

    def pending(self) -> bool:
        return bool(self.held)
