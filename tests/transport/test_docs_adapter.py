"""The smallest complete adapter of ``docs/adapters.md`` passes the public conformance suite as
printed there (its code block is run here, not copied)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from kvproto.testing.conformance import TransportConformance

DOC = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


def _load() -> types.ModuleType:
    """The python block under "The smallest complete adapter", as a module."""
    text = DOC.read_text()
    section = text[text.index("## The smallest complete adapter"):]
    source = re.search(r"```python\n(.*?)```", section, re.S)
    assert source is not None, "the adapter's code block is missing from docs/adapters.md"
    module = types.ModuleType("docs_memcpy_adapter")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source.group(1), str(DOC), "exec"), module.__dict__)  # noqa: S102 - our own document
    return module


_ADAPTER = _load()


class TestDocsAdapter(TransportConformance):
    """The suite, unchanged, on the document's ``MemcpyTransport``."""

    def make(self, agent_name: str):  # type: ignore[no-untyped-def]
        return _ADAPTER.MemcpyTransport(agent_name)
