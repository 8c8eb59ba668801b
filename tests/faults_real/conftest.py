"""Fixtures of the real-fault tests: child processes that are always reaped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .procs import Child, RankSpec


@pytest.fixture
def spawn() -> Iterator[Callable[[RankSpec], Child]]:
    """Start a rank in a child process; every child is killed and reaped at teardown."""
    children: list[Child] = []

    def start(spec: RankSpec) -> Child:
        child = Child(spec)
        children.append(child)
        return child

    yield start
    for child in children:
        child.reap()
