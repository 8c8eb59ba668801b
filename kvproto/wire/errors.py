"""Error codes carried on the wire, and the exceptions of the protocol layers.

Codes are wire numbers: never renumber or reuse one (house rule 5). ``spec/v1/errors.md``
lists the same registry; a test checks the two agree.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Why a room, a registration or a frame failed. Values are forever."""

    PEER_PROTOCOL_ERROR = 1
    """The peer sent something the protocol forbids in the room's state."""
    MALFORMED_FRAME = 2
    """A frame could not be decoded."""
    UNSUPPORTED_VERSION = 3
    """The frame's major version is not spoken here."""
    UNKNOWN_ROOM = 4
    """A message named a room this endpoint does not have."""
    INDEX_OUT_OF_RANGE = 5
    """A page, slot, offset or length lies outside what was registered or granted."""
    INCOMPATIBLE_GEOMETRY = 6
    """dtype, head_dim, layer count, head count or MLA differ between the sides."""
    TOKEN_COUNT_MISMATCH = 7
    """The sides disagree on how many tokens (or pages) the room holds."""
    BOOTSTRAP_TIMEOUT = 8
    """The room did not finish its handshake in time."""
    TRANSFER_TIMEOUT = 9
    """The room's bytes did not all arrive in time."""
    ABORTED = 10
    """The application aborted the room."""
    PEER_GONE = 11
    """The peer stopped answering heartbeats, closed, or restarted."""
    TRANSPORT_ERROR = 12
    """The data plane reported a failed write."""
    NOT_REGISTERED = 13
    """A room message arrived on a link that has not completed registration."""
    DUPLICATE_ROOM = 14
    """A room id that is already live was opened or requested again."""
    ENDPOINT_CLOSED = 15
    """The endpoint closed while the room was live."""
    FRAME_TOO_LARGE = 16
    """A frame exceeded the size bound."""
    MODEL_MISMATCH = 17
    """The sides serve different models."""
    COMPAT_KEY_MISMATCH = 18
    """The sides' explicit compatibility keys differ."""
    STAGING_STALLED = 19
    """No staging space was granted or released in time."""
    AUTH_FAILED = 20
    """Control-plane authentication failed."""
    WAITING_TIMEOUT = 21
    """The application did not supply the room's input in time."""
    INTERNAL_ERROR = 22
    """An unexpected error inside this endpoint; the room was failed to keep others safe."""

    @classmethod
    def coerce(cls, value: int) -> ErrorCode | int:
        """The enum member for ``value``, or the raw int for a code newer than this build."""
        try:
            return cls(value)
        except ValueError:
            return value


class ProtocolError(Exception):
    """Base of protocol errors; carries an ``ErrorCode``."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PEER_PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}: {self})"


class LocalProtocolError(ProtocolError):
    """This side misused the API (wrong state, bad argument). Raised to the caller."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol. Becomes a room failure and an Abort, never a crash."""


class MalformedFrame(RemoteProtocolError):
    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.MALFORMED_FRAME)


class UnsupportedVersion(RemoteProtocolError):
    def __init__(self, message: str, major: int) -> None:
        super().__init__(message, ErrorCode.UNSUPPORTED_VERSION)
        self.major = major


class FrameTooLarge(RemoteProtocolError):
    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.FRAME_TOO_LARGE)
