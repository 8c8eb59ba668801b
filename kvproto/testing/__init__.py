"""What tests need of kvproto: fault injection (a simulated transport, control-frame faults, a
jumping clock), the adapters' conformance suite (``kvproto.testing.conformance``) and reference
caches whose every byte is a function of what it is (``kvproto.testing.reference``).

Nothing here is used in production; the endpoints only accept these through
``EndpointConfig(transport="simulated", transport_options={"faults": FaultPlan(...)},
control_faults=SeededFaults(...), clock=JumpClock())``.
"""

from kvproto.testing.faults import CONTROL_FAULT_KINDS, FrameFaults, JumpClock, SeededFaults
from kvproto.testing.simulated import (
    FAULT_KINDS,
    FaultPlan,
    PendingWrite,
    SimulatedTransport,
    SimulatedXfer,
    pending_writes,
)

__all__ = [
    "CONTROL_FAULT_KINDS",
    "FAULT_KINDS",
    "FaultPlan",
    "FrameFaults",
    "JumpClock",
    "PendingWrite",
    "SeededFaults",
    "SimulatedTransport",
    "SimulatedXfer",
    "pending_writes",
]
