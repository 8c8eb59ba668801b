"""Data-plane adapters, loaded by name.

``load_transport("nixl", "prefill-0")`` imports the adapter's module only when it is first
asked for, so importing ``kvproto.transport`` never imports NIXL. ``available_transports()``
lists the adapters whose module imports on this machine. ``simulated`` is the loopback adapter
with seeded faults, for tests (``kvproto.testing``; option ``faults=FaultPlan(...)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvproto.transport.base import (
    DescList,
    MemKind,
    MemoryRegion,
    Notification,
    Registration,
    Transport,
    TransportClosed,
    TransportError,
    TransportStats,
    Xfer,
    XferState,
    as_descs,
)

__all__ = [
    "DescList",
    "MemKind",
    "MemoryRegion",
    "Notification",
    "Registration",
    "Transport",
    "TransportClosed",
    "TransportError",
    "TransportStats",
    "Xfer",
    "XferState",
    "as_descs",
    "available_transports",
    "load_transport",
]

_ADAPTERS: dict[str, tuple[str, str]] = {
    "loopback": ("kvproto.transport.loopback", "LoopbackTransport"),
    "nixl": ("kvproto.transport.nixl", "NixlTransport"),
    "simulated": ("kvproto.testing.simulated", "SimulatedTransport"),
}


def available_transports() -> list[str]:
    """Names of the adapters that can be loaded here, sorted."""
    names = []
    for name, (module, _) in sorted(_ADAPTERS.items()):
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        names.append(name)
    return names


def load_transport(name: str, agent_name: str, **options: Any) -> Transport:
    """Create the adapter called ``name`` for the agent ``agent_name``."""
    try:
        module, cls = _ADAPTERS[name]
    except KeyError:
        raise TransportError(
            f"unknown transport {name!r}; known: {', '.join(sorted(_ADAPTERS))}"
        ) from None
    try:
        factory: Callable[..., Transport] = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TransportError(f"transport {name!r} is not available: {e}") from e
    return factory(agent_name, **options)
