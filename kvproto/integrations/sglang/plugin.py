"""Registration with SGLang: the ``sglang.srt.plugins`` entry point.

Theory of operation
-------------------
SGLang has no loader for transfer backends by module path; its general plugin system is the way
in. ``register`` runs inside ``load_plugins()`` (the launcher, ``Engine``, each scheduler,
detokenizer and DP-controller process call it before reading their arguments) and does three
things, each idempotent:

1. adds ``kvproto`` to ``DISAGG_TRANSFER_BACKEND_CHOICES`` through
   ``add_disagg_transfer_backend_choices``, the hook SGLang provides for it, so that argparse
   accepts ``--disaggregation-transfer-backend kvproto``;
2. adds the member ``TransferBackend.KVPROTO`` to SGLang's enum in place (an ``Enum`` cannot be
   subclassed with members, and SGLang builds ``TransferBackend(name)`` from the flag), so that
   ``TransferBackend("kvproto")`` works everywhere, pickling included;
3. registers an AROUND hook on ``get_kv_class``: the KVPROTO member maps to this package's
   classes, every other backend to SGLang's. ``HookRegistry.apply_hooks`` patches the function
   and every module that imported it by name.

What it does not cover: a process that never calls ``load_plugins()`` (a custom launcher that
builds ``ServerArgs`` itself) rejects the flag at parsing; ``SGLANG_PLUGINS`` set without
``kvproto`` leaves the plugin out; SGLang's own checks that name backends (``decode DCP
requires mooncake, nixl, ...``) refuse kvproto as they refuse any backend not listed.
"""

from __future__ import annotations

from typing import Any

from kvproto.integrations.sglang import BACKEND

MEMBER = "KVPROTO"
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def register() -> None:
    """The entry point's function (``load_plugins()`` calls it once per process)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    add_enum_member(TransferBackend, MEMBER, BACKEND)
    if not any(hook is get_kv_class for _, hook, _ in HookRegistry._hooks.get(TARGET, ())):
        HookRegistry.register(TARGET, get_kv_class, HookType.AROUND)


def add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """Add ``name = value`` to an existing plain ``Enum`` in place (idempotent); returns the member."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)  # EnumType.__setattr__ refuses new members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def get_kv_class(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of SGLang's ``get_kv_class(transfer_backend, class_type)``."""
    from sglang.srt.disaggregation.utils import KVClassType

    backend = args[0] if args else kwargs.get("transfer_backend")
    class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
    if getattr(backend, "value", backend) != BACKEND or class_type == KVClassType.KVARGS:
        return original(*args, **kwargs)
    from kvproto.integrations.sglang.bootstrap import KVProtoBootstrapServer
    from kvproto.integrations.sglang.manager import KVProtoManager
    from kvproto.integrations.sglang.receiver import KVProtoReceiver
    from kvproto.integrations.sglang.sender import KVProtoSender

    return {
        KVClassType.MANAGER: KVProtoManager,
        KVClassType.SENDER: KVProtoSender,
        KVClassType.RECEIVER: KVProtoReceiver,
        KVClassType.BOOTSTRAP_SERVER: KVProtoBootstrapServer,
    }.get(class_type)
