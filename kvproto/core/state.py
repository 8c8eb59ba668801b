"""The room state machine: one literal table, and nothing else assigns a room's state.

Theory of operation
-------------------
A *room* is one request's KV transfer, seen from one rank. The prefill rank plays the SENDER,
the decode rank the RECEIVER. Both walk the same five states, whose values equal SGLang's
``KVPoll`` so that serving loops written against it read ours unchanged::

    FAILED 0   BOOTSTRAPPING 1   WAITING_FOR_INPUT 2   TRANSFERRING 3   SUCCESS 4

SENDER:   BOOTSTRAPPING   waiting for the transfer requests of every paired decode rank
          WAITING_FOR_INPUT  requests complete, waiting for the application's first KV chunk
          TRANSFERRING    writes posted, waiting for the last chunk's writes to be DONE
RECEIVER: BOOTSTRAPPING   waiting for links to every paired prefill rank to be registered
          WAITING_FOR_INPUT  links ready, waiting for the application's destination pages
          TRANSFERRING    requests sent, waiting for every expected writer's writes

Rooms classify what happened into an ``Input`` (e.g. a request that completes the set is
``REQUEST_COMPLETE``, one that does not is ``REQUEST_PARTIAL``) and look up
``TABLE[(role, state, input)] -> (effect, next_state)``. The table is total: every
(role, state, input) triple of the role's inputs has a row (a test checks this, and that
``spec/v1/states.md`` lists the same rows). Terminal states absorb every input: a late
message for an ended room is dropped and counted, never raised (house rule 4).

A RECEIVER that fails while TRANSFERRING with writers that may still be writing into its
pages (or staging regions) does not enter FAILED at once: the failure is classified ``DRAIN``,
which sends ABORT to the writers and keeps the room TRANSFERRING, its memory out of reuse, while
every later event is classified ``DRAIN_PROGRESS`` until each writer has *settled* (sent its
TRANSFER_DONE, which follows all its writes; answered with its own ABORT, which a prefill rank sends only once none of its writes into this
rank remains in flight; or gone) and no local scatter is running, or the drain deadline
passes (then the writers still owing an answer are dropped as untrustworthy); then ``DRAINED``
enters FAILED and the failure is reported, once, with the original code. The application therefore
never sees FAILED while a write may still land in the pages it would free.

*Room holds* (protocol 1.4). A SENDER room waits in BOOTSTRAPPING for decode ranks that may sit in
their engine's queue far longer than any fixed deadline, while a decode that never comes should
pin the prefill's pages only briefly. So the BOOTSTRAPPING deadline is a *lease*: ``HOLD`` (a
ROOM_HOLD from a decode rank that may still send the room's request) pushes it out (``EXTEND``:
to at most the hold's end, never earlier than it was), and a room that no decode holds expires at
the lease it opened with. A RECEIVER room sends those holds while it waits for its destination:
``HOLD_DUE`` (on entering WAITING_FOR_INPUT, then every hold interval) is ``SEND_HOLD`` there and
nowhere else, so holds stop the moment the room sends its requests or ends. A hold changes no
state: it moves a deadline or sends a frame, and a SENDER room past BOOTSTRAPPING has no use for
one (``NONE``).

Effects name what the room must do on the way; the room carries the data (which chunk, which
code). ``LOCAL_ERROR`` means the application misused the API: the room raises
``LocalProtocolError`` and keeps its state. ``INTERNAL_ERROR`` marks triples that the
classifier never produces; if one ever happens the room fails safely instead of crashing the
endpoint.
"""

from __future__ import annotations

import enum


class RoomState(enum.IntEnum):
    """Values equal SGLang's KVPoll."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in (RoomState.FAILED, RoomState.SUCCESS)


class Role(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class Input(enum.Enum):
    # sender: from the control plane
    REQUEST_PARTIAL = "request_partial"
    REQUEST_COMPLETE = "request_complete"
    REQUEST_COMPLETE_WITH_INPUT = "request_complete_with_input"
    # sender: from the application
    CHUNK = "chunk"
    # sender: from the data plane
    WRITE_DONE = "write_done"
    ALL_WRITES_DONE = "all_writes_done"
    WRITE_ERROR = "write_error"
    # receiver: from the control plane
    LINKS_READY = "links_ready"
    LINKS_READY_WITH_INPUT = "links_ready_with_input"
    WRITER_DONE = "writer_done"
    # receiver: from the application
    DESTINATION = "destination"
    # receiver: from the data plane
    ARRIVAL = "arrival"
    ALL_ARRIVED = "all_arrived"
    # receiver: failing while writes may still land in its memory
    DRAIN = "drain"
    DRAIN_PROGRESS = "drain_progress"
    DRAINED = "drained"
    # both
    PEER_ABORT = "peer_abort"
    PEER_GONE = "peer_gone"
    PEER_VIOLATION = "peer_violation"
    LOCAL_ABORT = "local_abort"
    TIMEOUT = "timeout"
    CLOSE = "close"
    # sender (1.4): a ROOM_HOLD from a decode rank that may still send the room's request
    HOLD = "hold"
    # receiver (1.4): the room's next ROOM_HOLD is due (on entering WAITING_FOR_INPUT, then each interval)
    HOLD_DUE = "hold_due"


class Effect(enum.Enum):
    NONE = "none"
    QUEUE = "queue"  # keep the application's input until the room can use it
    RECORD = "record"  # note progress; stay
    SEND_REQUESTS = "send_requests"  # receiver: send TRANSFER_REQUEST to every paired link
    POST_QUEUED = "post_queued"  # sender: post the chunks queued while bootstrapping
    POST_CHUNK = "post_chunk"  # sender: post this chunk's writes
    SEND_DONE = "send_done"  # sender: every write DONE; TRANSFER_DONE to the writers
    COMPLETE = "complete"  # receiver: every expected writer's bytes arrived
    ABORT_PEERS = "abort_peers"  # fail, and send ABORT with the code to the other links
    ABORT_AND_DRAIN = "abort_and_drain"  # receiver: send ABORT, keep memory until writers settle
    ABSORB = "absorb"  # input after the end: drop and count
    LOCAL_ERROR = "local_error"  # raise LocalProtocolError; state unchanged
    INTERNAL_ERROR = "internal_error"  # unreachable by construction; fail safely
    EXTEND = "extend"  # sender (1.4): push the BOOTSTRAPPING deadline out to the hold's end
    SEND_HOLD = "send_hold"  # receiver (1.4): ROOM_HOLD to every paired link of minor >= 4; re-arm


S, R = Role.SENDER, Role.RECEIVER
B, W, T = RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING
OK, FAILED = RoomState.SUCCESS, RoomState.FAILED
I, E = Input, Effect

SENDER_INPUTS = frozenset({
    I.REQUEST_PARTIAL, I.REQUEST_COMPLETE, I.REQUEST_COMPLETE_WITH_INPUT, I.CHUNK,
    I.WRITE_DONE, I.ALL_WRITES_DONE, I.WRITE_ERROR,
    I.PEER_ABORT, I.PEER_GONE, I.PEER_VIOLATION, I.LOCAL_ABORT, I.TIMEOUT, I.CLOSE,
    I.HOLD,
})
RECEIVER_INPUTS = frozenset({
    I.LINKS_READY, I.LINKS_READY_WITH_INPUT, I.WRITER_DONE, I.DESTINATION, I.ARRIVAL,
    I.ALL_ARRIVED, I.DRAIN, I.DRAIN_PROGRESS, I.DRAINED,
    I.PEER_ABORT, I.PEER_GONE, I.PEER_VIOLATION, I.LOCAL_ABORT, I.TIMEOUT, I.CLOSE,
    I.HOLD_DUE,
})
INPUTS = {S: SENDER_INPUTS, R: RECEIVER_INPUTS}

# fmt: off
TABLE: dict[tuple[Role, RoomState, Input], tuple[Effect, RoomState]] = {
    # ---- SENDER (prefill rank) ------------------------------------------------------------
    (S, B, I.REQUEST_PARTIAL):             (E.RECORD,         B),
    (S, B, I.REQUEST_COMPLETE):            (E.NONE,           W),
    (S, B, I.REQUEST_COMPLETE_WITH_INPUT): (E.POST_QUEUED,    T),
    (S, B, I.CHUNK):                       (E.QUEUE,          B),
    (S, B, I.WRITE_DONE):                  (E.INTERNAL_ERROR, FAILED),
    (S, B, I.ALL_WRITES_DONE):             (E.INTERNAL_ERROR, FAILED),
    (S, B, I.WRITE_ERROR):                 (E.INTERNAL_ERROR, FAILED),
    (S, B, I.PEER_ABORT):                  (E.ABORT_PEERS,    FAILED),
    (S, B, I.PEER_GONE):                   (E.ABORT_PEERS,    FAILED),
    (S, B, I.PEER_VIOLATION):              (E.ABORT_PEERS,    FAILED),
    (S, B, I.LOCAL_ABORT):                 (E.ABORT_PEERS,    FAILED),
    (S, B, I.TIMEOUT):                     (E.ABORT_PEERS,    FAILED),
    (S, B, I.CLOSE):                       (E.ABORT_PEERS,    FAILED),

    (S, W, I.REQUEST_PARTIAL):             (E.INTERNAL_ERROR, FAILED),
    (S, W, I.REQUEST_COMPLETE):            (E.INTERNAL_ERROR, FAILED),
    (S, W, I.REQUEST_COMPLETE_WITH_INPUT): (E.INTERNAL_ERROR, FAILED),
    (S, W, I.CHUNK):                       (E.POST_CHUNK,     T),
    (S, W, I.WRITE_DONE):                  (E.INTERNAL_ERROR, FAILED),
    (S, W, I.ALL_WRITES_DONE):             (E.INTERNAL_ERROR, FAILED),
    (S, W, I.WRITE_ERROR):                 (E.INTERNAL_ERROR, FAILED),
    (S, W, I.PEER_ABORT):                  (E.ABORT_PEERS,    FAILED),
    (S, W, I.PEER_GONE):                   (E.ABORT_PEERS,    FAILED),
    (S, W, I.PEER_VIOLATION):              (E.ABORT_PEERS,    FAILED),
    (S, W, I.LOCAL_ABORT):                 (E.ABORT_PEERS,    FAILED),
    (S, W, I.TIMEOUT):                     (E.ABORT_PEERS,    FAILED),
    (S, W, I.CLOSE):                       (E.ABORT_PEERS,    FAILED),

    (S, T, I.REQUEST_PARTIAL):             (E.INTERNAL_ERROR, FAILED),
    (S, T, I.REQUEST_COMPLETE):            (E.INTERNAL_ERROR, FAILED),
    (S, T, I.REQUEST_COMPLETE_WITH_INPUT): (E.INTERNAL_ERROR, FAILED),
    (S, T, I.CHUNK):                       (E.POST_CHUNK,     T),
    (S, T, I.WRITE_DONE):                  (E.RECORD,         T),
    (S, T, I.ALL_WRITES_DONE):             (E.SEND_DONE,      OK),
    (S, T, I.WRITE_ERROR):                 (E.ABORT_PEERS,    FAILED),
    (S, T, I.PEER_ABORT):                  (E.ABORT_PEERS,    FAILED),
    (S, T, I.PEER_GONE):                   (E.ABORT_PEERS,    FAILED),
    (S, T, I.PEER_VIOLATION):              (E.ABORT_PEERS,    FAILED),
    (S, T, I.LOCAL_ABORT):                 (E.ABORT_PEERS,    FAILED),
    (S, T, I.TIMEOUT):                     (E.ABORT_PEERS,    FAILED),
    (S, T, I.CLOSE):                       (E.ABORT_PEERS,    FAILED),

    # ---- RECEIVER (decode rank) ---------------------------------------------------------
    (R, B, I.LINKS_READY):                 (E.NONE,           W),
    (R, B, I.LINKS_READY_WITH_INPUT):      (E.SEND_REQUESTS,  T),
    (R, B, I.DESTINATION):                 (E.QUEUE,          B),
    (R, B, I.WRITER_DONE):                 (E.INTERNAL_ERROR, FAILED),
    (R, B, I.ARRIVAL):                     (E.INTERNAL_ERROR, FAILED),
    (R, B, I.ALL_ARRIVED):                 (E.INTERNAL_ERROR, FAILED),
    (R, B, I.DRAIN):                       (E.INTERNAL_ERROR, FAILED),
    (R, B, I.DRAIN_PROGRESS):              (E.INTERNAL_ERROR, FAILED),
    (R, B, I.DRAINED):                     (E.INTERNAL_ERROR, FAILED),
    (R, B, I.PEER_ABORT):                  (E.ABORT_PEERS,    FAILED),
    (R, B, I.PEER_GONE):                   (E.ABORT_PEERS,    FAILED),
    (R, B, I.PEER_VIOLATION):              (E.ABORT_PEERS,    FAILED),
    (R, B, I.LOCAL_ABORT):                 (E.ABORT_PEERS,    FAILED),
    (R, B, I.TIMEOUT):                     (E.ABORT_PEERS,    FAILED),
    (R, B, I.CLOSE):                       (E.ABORT_PEERS,    FAILED),

    (R, W, I.LINKS_READY):                 (E.INTERNAL_ERROR, FAILED),
    (R, W, I.LINKS_READY_WITH_INPUT):      (E.INTERNAL_ERROR, FAILED),
    (R, W, I.DESTINATION):                 (E.SEND_REQUESTS,  T),
    (R, W, I.WRITER_DONE):                 (E.INTERNAL_ERROR, FAILED),
    (R, W, I.ARRIVAL):                     (E.INTERNAL_ERROR, FAILED),
    (R, W, I.ALL_ARRIVED):                 (E.INTERNAL_ERROR, FAILED),
    (R, W, I.DRAIN):                       (E.INTERNAL_ERROR, FAILED),
    (R, W, I.DRAIN_PROGRESS):              (E.INTERNAL_ERROR, FAILED),
    (R, W, I.DRAINED):                     (E.INTERNAL_ERROR, FAILED),
    (R, W, I.PEER_ABORT):                  (E.ABORT_PEERS,    FAILED),
    (R, W, I.PEER_GONE):                   (E.ABORT_PEERS,    FAILED),
    (R, W, I.PEER_VIOLATION):              (E.ABORT_PEERS,    FAILED),
    (R, W, I.LOCAL_ABORT):                 (E.ABORT_PEERS,    FAILED),
    (R, W, I.TIMEOUT):                     (E.ABORT_PEERS,    FAILED),
    (R, W, I.CLOSE):                       (E.ABORT_PEERS,    FAILED),

    (R, T, I.LINKS_READY):                 (E.INTERNAL_ERROR, FAILED),
    (R, T, I.LINKS_READY_WITH_INPUT):      (E.INTERNAL_ERROR, FAILED),
    (R, T, I.DESTINATION):                 (E.LOCAL_ERROR,    T),
    (R, T, I.WRITER_DONE):                 (E.RECORD,         T),
    (R, T, I.ARRIVAL):                     (E.RECORD,         T),
    (R, T, I.ALL_ARRIVED):                 (E.COMPLETE,       OK),
    (R, T, I.DRAIN):                       (E.ABORT_AND_DRAIN, T),
    (R, T, I.DRAIN_PROGRESS):              (E.RECORD,         T),
    (R, T, I.DRAINED):                     (E.NONE,           FAILED),
    (R, T, I.PEER_ABORT):                  (E.ABORT_PEERS,    FAILED),
    (R, T, I.PEER_GONE):                   (E.ABORT_PEERS,    FAILED),
    (R, T, I.PEER_VIOLATION):              (E.ABORT_PEERS,    FAILED),
    (R, T, I.LOCAL_ABORT):                 (E.ABORT_PEERS,    FAILED),
    (R, T, I.TIMEOUT):                     (E.ABORT_PEERS,    FAILED),
    (R, T, I.CLOSE):                       (E.ABORT_PEERS,    FAILED),

    # ---- room holds (1.4) -----------------------------------------------------------------
    (S, B, I.HOLD):                        (E.EXTEND,         B),
    (S, W, I.HOLD):                        (E.NONE,           W),
    (S, T, I.HOLD):                        (E.NONE,           T),
    (R, B, I.HOLD_DUE):                    (E.INTERNAL_ERROR, FAILED),
    (R, W, I.HOLD_DUE):                    (E.SEND_HOLD,      W),
    (R, T, I.HOLD_DUE):                    (E.INTERNAL_ERROR, FAILED),
}
# Terminal states absorb every input of their role.
TABLE.update({
    (role, state, inp): (E.ABSORB, state)
    for role, inputs in INPUTS.items()
    for state in (OK, FAILED)
    for inp in inputs
})
# fmt: on


def transition(role: Role, state: RoomState, inp: Input) -> tuple[Effect, RoomState]:
    return TABLE[(role, state, inp)]
