"""Data-plane adapters, loaded by name.

``load_transport("nixl", "prefill-0")`` imports the adapter's module only when it is first
asked for, so importing ``kvproto.transport`` never imports NIXL. Adapters are found by name
in the entry-point group ``kvproto.transports`` (``name = "module:Class"``), so a package
outside kvproto adds one by declaring an entry point, without changing kvproto; kvproto's own
adapters are declared there too, and are also known without installed package metadata (a
source checkout). A built-in name cannot be taken over by another package. The class is
called as ``Class(agent_name, **options)`` and must satisfy ``Transport``; the suite in
``kvproto.testing.conformance`` checks that it does (``docs/adapters.md``).

``available_transports()`` lists the adapters whose module imports on this machine.
``simulated`` is the loopback adapter with seeded faults, for tests (``kvproto.testing``;
option ``faults=FaultPlan(...)``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
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
    merge_regions,
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
    "ENTRY_POINT_GROUP",
    "adapters",
    "as_descs",
    "merge_regions",
    "available_transports",
    "host_options",
    "transport_class",
    "load_transport",
]

ENTRY_POINT_GROUP = "kvproto.transports"

_BUILTIN: dict[str, str] = {
    "cuda-ipc": "kvproto.transport.cuda_ipc:CudaIpcTransport",
    "loopback": "kvproto.transport.loopback:LoopbackTransport",
    "mooncake": "kvproto.transport.mooncake:MooncakeTransport",
    "nixl": "kvproto.transport.nixl:NixlTransport",
    "simulated": "kvproto.testing.simulated:SimulatedTransport",
}

log = logging.getLogger(__name__)


def adapters() -> dict[str, str]:
    """Every adapter name known here, with its ``module:Class``: the built-in ones and those
    other packages declare in the ``kvproto.transports`` entry-point group."""
    found = dict(_BUILTIN)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTIN:
            if ep.value != _BUILTIN[ep.name]:
                log.warning("ignoring entry point %s = %s: %r is a built-in kvproto transport",
                            ep.name, ep.value, ep.name)
            continue
        found.setdefault(ep.name, ep.value)
    return found


def _resolve(name: str, target: str) -> Callable[..., Transport]:
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except ImportError as e:
        raise TransportError(f"transport {name!r} is not available: {e}") from e
    except AttributeError as e:
        raise TransportError(f"transport {name!r}: {target} does not exist ({e})") from e
    return obj  # type: ignore[return-value]


def available_transports() -> list[str]:
    """Names of the adapters that can be loaded here, sorted."""
    names = []
    for name, target in sorted(adapters().items()):
        try:
            _resolve(name, target)
        except TransportError:
            continue
        names.append(name)
    return names


def transport_class(name: str) -> Callable[..., Transport]:
    """The class (factory) registered under ``name``."""
    known = adapters()
    try:
        target = known[name]
    except KeyError:
        raise TransportError(f"unknown transport {name!r}; known: {', '.join(sorted(known))}") from None
    return _resolve(name, target)


def host_options(name: str, host: str) -> dict[str, Any]:
    """``{"host": host}`` for an adapter that takes the address to advertise as its ``host``
    option (such as ``mooncake``), else ``{}`` (NIXL's UCX finds its interfaces itself)."""
    import inspect

    try:
        params = inspect.signature(transport_class(name)).parameters
    except (TransportError, TypeError, ValueError):
        return {}
    return {"host": host} if "host" in params else {}


def load_transport(name: str, agent_name: str, **options: Any) -> Transport:
    """Create the adapter called ``name`` for the agent ``agent_name``."""
    return transport_class(name)(agent_name, **options)
