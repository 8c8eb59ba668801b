"""Synchronous facade: kvproto for schedulers that run in a plain thread (SGLang, vLLM).

Theory of operation
-------------------
An engine's scheduler calls its KV-transfer layer every step and must never block, while
kvproto's endpoints live on an asyncio event loop. The facade joins the two in one of two faces,
with the same calls (``kvproto.sync.calls``: a facade per rank, a handle per room shaped like
SGLang's ``KVSender`` / ``KVReceiver``, ``get_finished`` once per step):

* the *thread face* (``kvproto.sync.thread``: ``SyncPrefill``, ``SyncDecode``) runs the endpoint on
  an ``EngineLoop`` in a daemon thread of the engine's process; a call is posted to the loop and
  returns at once;
* the *process face* (``kvproto.sync.process``: ``ProcessPrefill``, ``ProcessDecode``) runs it in a
  child process, calls going down a pipe in batches and room events coming up one, so the
  endpoint's Python never takes the interpreter lock from the engine's thread.

``kvproto.sync`` names the thread face's classes (as it always has) and the process face's;
``kvproto.sync_process`` is the process face's module under its older name.
"""

from kvproto.sync.calls import (
    DecodeCalls,
    FacadeCalls,
    Finished,
    KVPoll,
    PrefillCalls,
    ReceiverCalls,
    SenderCalls,
)
from kvproto.sync.process import ProcessDecode, ProcessPrefill, ProcessReceiver, ProcessSender
from kvproto.sync.thread import EngineLoop, KVReceiver, KVSender, SyncDecode, SyncPrefill

__all__ = [
    "DecodeCalls",
    "EngineLoop",
    "FacadeCalls",
    "Finished",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "PrefillCalls",
    "ProcessDecode",
    "ProcessPrefill",
    "ProcessReceiver",
    "ProcessSender",
    "ReceiverCalls",
    "SenderCalls",
    "SyncDecode",
    "SyncPrefill",
]
