"""kvproto as an SGLang PD transfer backend: ``--disaggregation-transfer-backend kvproto``.

Theory of operation
-------------------
SGLang picks a transfer backend by name from a closed list and maps it to classes in
``sglang.srt.disaggregation.utils.get_kv_class``. kvproto registers under SGLang's plugin entry
point (``sglang.srt.plugins``, ``plugin.register``): ``load_plugins()``, which SGLang runs in
the launcher, in ``Engine`` and in every scheduler process before it parses or reads its
arguments, adds ``kvproto`` to the CLI choices, a ``TransferBackend.KVPROTO`` member, and wraps
``get_kv_class`` so that the member maps to the classes here. Installing kvproto and passing the
flag to the prefill and the decode server is all a user does.

The classes subclass SGLang's ``Common*`` backend classes, so that what SGLang's queues read of a
backend (the HTTP bootstrap server on ``--disaggregation-bootstrap-port``, DP-rank resolution,
``prefill_info_table`` and ``try_ensure_parallel_info`` on the decode) is SGLang's own; the data
path is kvproto's. Each scheduler rank runs one kvproto endpoint (``kvproto.sync``: calls post
to an event loop thread and never block the scheduler). A prefill attention DP group is one
kvproto prefill instance: its TP rank 0's row in SGLang's ``/route`` table carries that
instance's kvproto bootstrap address, which the other ranks and every decode rank read. One
SGLang room (``bootstrap_room``) is one kvproto room.

Modules: ``plugin`` (registration), ``cache`` (``KVArgs`` as a kvproto cache, and what is
refused at start), ``manager``, ``sender``, ``receiver``, ``bootstrap``.
"""

from __future__ import annotations

BACKEND = "kvproto"
"""The value of ``--disaggregation-transfer-backend``."""

__all__ = ["BACKEND"]
