"""Command-line options declared once: a settings dataclass's field is its option.

Theory of operation
-------------------
``kvproto demo``, the benches and the example servers take their settings as a dataclass, and
each setting is also a command-line flag. Written twice (the field, then an ``add_argument`` with
the same default), the two drift apart; here a field *is* its option: ``add_options(parser,
Settings)`` adds ``--field-name`` for every field, its type taken from the default (a bool is a
switch that turns it on), its help and choices from ``option(...)`` where the field declares them;
``options_of(Settings, args)`` gives the parsed values back by field name. A field made with
``option(..., cli=False)`` is a setting without a flag. Nothing here runs on a data path.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any

__all__ = ["add_options", "option", "options_of"]


def option(default: Any, help: str = "", *, choices: Sequence[Any] | None = None, cli: bool = True) -> Any:
    """A dataclass field that is also a command-line option (``add_options``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


def add_options(parser: argparse.ArgumentParser, settings: type) -> None:
    """``--name`` for every field of the dataclass ``settings`` (``option``'s help and choices)."""
    for f in fields(settings):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        kwargs: dict[str, Any] = {"default": f.default}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_true"
        elif meta.get("choices") is not None:
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["type"] = type(f.default)
        if meta.get("help"):
            kwargs["help"] = meta["help"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def options_of(settings: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of ``settings``' options, by field name (fields without a flag left out)."""
    return {f.name: getattr(args, f.name) for f in fields(settings) if hasattr(args, f.name)}
