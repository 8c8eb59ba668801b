"""The sans-IO layers import without I/O or heavy dependencies (house rule 2), checked in a
fresh interpreter so that modules other tests imported do not hide a regression."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = ("asyncio", "zmq", "torch", "nixl", "numpy", "triton")


def imported_after(statement: str) -> list[str]:
    """Top-level names of every module loaded by ``statement`` in a fresh interpreter."""
    code = (
        "import json, sys\n"
        f"{statement}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_imports_core_wire_geometry_are_io_free() -> None:
    """import kvproto.core, kvproto.wire, kvproto.geometry loads none of asyncio, zmq, torch, nixl, numpy, triton."""
    loaded = imported_after("import kvproto.core, kvproto.wire, kvproto.geometry")
    bad = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert not bad, f"sans-IO import pulled in {bad}"


@pytest.mark.parametrize("package", ["kvproto", "kvproto.core", "kvproto.wire", "kvproto.geometry"])
def test_imports_each_sans_io_package_alone_is_io_free(package: str) -> None:
    """Each sans-IO package on its own loads none of the forbidden modules."""
    loaded = imported_after(f"import {package}")
    assert not sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)


def test_imports_layering() -> None:
    """wire and geometry import no other kvproto layer; core imports only wire."""
    for package, allowed in (
        ("kvproto.wire", {"kvproto", "kvproto.wire"}),
        ("kvproto.geometry", {"kvproto", "kvproto.geometry"}),
        ("kvproto.core", {"kvproto", "kvproto.core", "kvproto.wire"}),
    ):
        loaded = imported_after(f"import {package}")
        layers = {".".join(m.split(".")[:2]) for m in loaded if m.split(".")[0] == "kvproto"}
        assert layers <= allowed, (package, sorted(layers - allowed))
