"""The prefill's bootstrap server: SGLang's HTTP ``/route`` registry, as it is.

Theory of operation
-------------------
SGLang starts the backend's bootstrap server in the prefill server's main process on
``--disaggregation-bootstrap-port``; prefill ranks PUT a row each (``register_to_bootstrap``)
and decode ranks GET the instance's parallel info and a rank's row. kvproto keeps that registry
unchanged (so SGLang's embedded Rust server, which ports it, stands in for it too) and only
changes what one row means: the row of prefill attention-TP rank 0 of each DP group carries the
kvproto bootstrap address of that group (``rank_ip``, ``rank_port``); kvproto's own bootstrap
service at that address tells decode ranks every other rank. The other ranks' rows only count
towards SGLang's readiness check.
"""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer


class KVProtoBootstrapServer(CommonKVBootstrapServer):
    """SGLang's ``CommonKVBootstrapServer`` (see the module docstring)."""
