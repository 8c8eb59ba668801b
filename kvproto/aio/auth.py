"""The prefill rank's ZAP handler: which CURVE keys may open a control connection.

Theory of operation
-------------------
With ``EndpointConfig.curve`` a prefill rank's ROUTER is a CURVE server, and libzmq asks the
context's ZAP handler (RFC 27, a REP socket bound at ``inproc://zeromq.zap.01``) about every
client key before the handshake completes. The handler answers 200 for a key in ``allowed`` and
400 for any other (logged, and counted in ``refused``); libzmq then sends the client an ERROR
command, which the decode rank's socket monitor reports as a failed authentication at once
(``kvproto.aio.decode``: the bootstrap fails with AUTH_FAILED).

The handler's socket is served like every other control socket of the endpoint: a ``Channel``
reads it from the event loop's reader callback, and each request is answered before the next is
read (REP's strict alternation). pyzmq's ``AsyncioAuthenticator`` is not used: it serves its
socket from a poller task, and a stopped authenticator's cancelled poll removes its descriptor
from the loop one iteration later, by then the number of the next endpoint's ZAP socket (descriptors
are reused at once), so a prefill endpoint started on the same loop right after another closed
never answered a ZAP request: every decode rank's handshake hung until its bootstrap deadline,
neither accepted nor refused. A ``Channel`` removes its reader when it is closed, synchronously.
"""

from __future__ import annotations

import logging

import zmq
import zmq.utils.z85

log = logging.getLogger("kvproto.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_VERSION = b"1.0"


class KeyAuthenticator:
    """Admits the CURVE public keys in ``allowed`` (Z85-encoded), refuses and logs any other."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self.refused = 0
        """Connections refused so far."""

    def socket(self, ctx: zmq.Context) -> zmq.Socket:
        """The REP socket to serve (bound; the caller reads it and sends each ``reply``)."""
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def reply(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: ``version, request_id, domain, address, identity,
        mechanism, credentials...`` -> ``version, request_id, status, text, user_id, metadata``."""
        if len(frames) < 6 or frames[0] != _VERSION:
            request_id = frames[1] if len(frames) > 1 else b""
            return [_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        request_id, address, mechanism, credentials = frames[1], frames[3], frames[5], frames[6:]
        key = zmq.utils.z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials and \
            len(credentials[0]) == 32 else None
        if key is not None and key in self.allowed:
            return [_VERSION, request_id, b"200", b"OK", key, b""]
        self.refused += 1
        who = key.decode("ascii") if key is not None else f"(mechanism {mechanism.decode('ascii', 'replace')})"
        log.warning("refused a control connection from %s: CURVE key %s is not allowed",
                    address.decode("ascii", "replace"), who)
        return [_VERSION, request_id, b"400", b"key not allowed", b"", b""]
