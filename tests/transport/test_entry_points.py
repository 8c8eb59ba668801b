"""Adapters are found by name through the ``kvproto.transports`` entry-point group: the example
adapter package in ``examples/adapter`` is built and installed as a user would, and then runs
the public conformance suite and the demo without any change to kvproto."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproto.transport import ENTRY_POINT_GROUP, adapters

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "adapter"


def _env(path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example adapter package, built and installed into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        check=True, timeout=300,
    )
    yield target


def test_entry_points_example_adapter_is_found_by_name(installed: Path) -> None:
    """An installed package's entry point makes its adapter loadable by name."""
    code = ("from kvproto.transport import adapters, available_transports, load_transport\n"
            "assert adapters()['vmwrite'] == 'kvproto_vmwrite:VmWriteTransport', adapters()\n"
            "assert 'vmwrite' in available_transports()\n"
            "t = load_transport('vmwrite', 'x'); print(type(t).__name__); t.close()\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(installed), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VmWriteTransport"


def test_entry_points_example_adapter_passes_the_public_suite(installed: Path) -> None:
    """The example adapter's own few-line test module runs kvproto's conformance suite: all pass."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "test_kvproto_vmwrite.py")],
        env=_env(installed), capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout and "skipped" not in out.stdout


@pytest.mark.slow
def test_entry_points_demo_runs_over_the_example_adapter(installed: Path) -> None:
    """``kvproto demo --transport vmwrite``: prefill and decode processes, every byte verified."""
    out = subprocess.run(
        [sys.executable, "-m", "kvproto.cli", "demo", "--transport", "vmwrite", "--rooms", "12",
         "--max-tokens", "512", "--blocks", "512"],
        env=_env(installed), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified every byte: OK, 0 mismatching bytes" in out.stdout


def test_entry_points_cannot_take_over_a_builtin_name(tmp_path: Path) -> None:
    """A package declaring a built-in adapter's name is ignored with a warning."""
    dist = tmp_path / "evil-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nloopback = evil:Nope\n"
                                           "other = evil:Nope\n")
    code = ("import logging; logging.basicConfig()\n"
            "from kvproto.transport import adapters, load_transport\n"
            "known = adapters(); print(known['loopback'], known['other'])\n"
            "load_transport('loopback', 'x').close()\n"
            "try: load_transport('other', 'y')\n"
            "except Exception as e: print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "kvproto.transport.loopback:LoopbackTransport evil:Nope"
    assert lines[1].startswith("TransportError transport 'other' is not available")
    assert "is a built-in kvproto transport" in out.stderr


def test_entry_points_builtins_are_declared_in_pyproject() -> None:
    """kvproto declares its own adapters in the group it reads (an installed kvproto lists them)."""
    text = (ROOT / "pyproject.toml").read_text()
    for name, target in adapters().items():
        if target.startswith("kvproto."):
            assert f'{name} = "{target}"' in text



def test_entry_points_required_transports_load() -> None:
    """Where ``KVPROTO_REQUIRE_TRANSPORTS`` names adapters (CI names both real ones), each loads:
    a missing engine fails the run instead of skipping its tests."""
    required = [n for n in os.environ.get("KVPROTO_REQUIRE_TRANSPORTS", "").split(",") if n]
    if not required:
        pytest.skip("KVPROTO_REQUIRE_TRANSPORTS is not set")
    from kvproto.transport import transport_class

    for name in required:
        transport_class(name)  # raises TransportError naming the import failure
