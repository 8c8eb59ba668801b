"""Registration through SGLang's real plugin loader and argument parser, and the signature drift
check of every backend method SGLang calls against kvproto's."""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

sglang = pytest.importorskip("sglang.srt")  # (a bare "sglang" may be this folder)

from sglang_harness import TINY_MODEL, model_dir, server_args  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    """SGLang's own load_plugins(): entry points of the group sglang.srt.plugins, hooks applied."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.disaggregation.utils as utils

    return utils, prefill, decode


def test_plugin_load_plugins_adds_the_backend(loaded):
    """After load_plugins(): the CLI choice, TransferBackend.KVPROTO, and get_kv_class mapping it to
    kvproto's classes wherever SGLang's queues look it up; other backends keep SGLang's classes."""
    utils, prefill, decode = loaded
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.nixl import NixlKVManager

    from kvproto.integrations.sglang.bootstrap import KVProtoBootstrapServer
    from kvproto.integrations.sglang.manager import KVProtoManager
    from kvproto.integrations.sglang.receiver import KVProtoReceiver
    from kvproto.integrations.sglang.sender import KVProtoSender

    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvproto") == 1
    backend = utils.TransferBackend("kvproto")
    assert backend is utils.TransferBackend.KVPROTO and backend in list(utils.TransferBackend)
    assert pickle.loads(pickle.dumps(backend)) is backend
    K = utils.KVClassType
    for lookup in (utils.get_kv_class, prefill.get_kv_class, decode.get_kv_class):
        assert lookup(backend, K.MANAGER) is KVProtoManager
        assert lookup(backend, K.SENDER) is KVProtoSender
        assert lookup(backend, K.RECEIVER) is KVProtoReceiver
        assert lookup(backend, K.BOOTSTRAP_SERVER) is KVProtoBootstrapServer
        assert lookup(backend, K.KVARGS) is KVArgs
        assert lookup(utils.TransferBackend.NIXL, K.MANAGER) is NixlKVManager


def test_plugin_server_args_parse_the_flag(loaded, tmp_path):
    """SGLang's own parser and resolution take --disaggregation-transfer-backend kvproto, and its
    bootstrap service is SGLang's HTTP registry (so the embedded Rust server may stand in)."""
    from sglang.srt.managers.disagg_service import rust_server_serves_kv_bootstrap

    for mode in ("prefill", "decode"):
        args = server_args(model_dir(tmp_path, TINY_MODEL), mode)
        args.resolve_once()
        assert args.disaggregation_transfer_backend == "kvproto"
        assert args.disaggregation_mode == mode
    assert rust_server_serves_kv_bootstrap("kvproto")


def test_plugin_left_out_the_flag_is_refused(tmp_path):
    """With the plugin excluded (SGLANG_PLUGINS naming another), SGLang's parser refuses the name:
    what the registration does not cover fails loudly at start."""
    code = ("import sglang_cpu_env as cpu_env; cpu_env.prepare()\n"
            "from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.server_args import prepare_server_args\n"
            f"prepare_server_args(['--model-path', {str(model_dir(tmp_path, TINY_MODEL))!r}, "
            "'--disaggregation-mode', 'prefill', '--disaggregation-transfer-backend', 'kvproto'])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SGLANG_PLUGINS": "someone-else",
                              "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.getcwd()])})
    assert run.returncode == 2
    assert "invalid choice: 'kvproto'" in run.stderr


# --- drift: SGLang's backend interface against kvproto's classes --------------------------------

def _pairs():
    from sglang.srt.disaggregation.base import conn as base
    from sglang.srt.disaggregation.common import conn as common

    from kvproto.integrations.sglang.bootstrap import KVProtoBootstrapServer
    from kvproto.integrations.sglang.manager import KVProtoManager
    from kvproto.integrations.sglang.receiver import KVProtoReceiver
    from kvproto.integrations.sglang.sender import KVProtoSender

    return [(base.BaseKVManager, common.CommonKVManager, KVProtoManager),
            (base.BaseKVSender, common.CommonKVSender, KVProtoSender),
            (base.BaseKVReceiver, common.CommonKVReceiver, KVProtoReceiver),
            (base.BaseKVBootstrapServer, common.CommonKVBootstrapServer, KVProtoBootstrapServer)]


def _accepts(ours: inspect.Signature, theirs: inspect.Signature) -> list[str]:
    """What a call made to ``theirs`` could pass that ``ours`` would not take the same way."""
    problems = []
    mine = list(ours.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in mine)
    positional = [p for p in mine if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(q for q in theirs.parameters.values() if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)):
        match = ours.parameters.get(p.name)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if i >= len(positional) or positional[i].name != p.name:
                problems.append(f"positional parameter {i} is {p.name!r} there, "
                                f"{positional[i].name if i < len(positional) else 'missing'!r} here")
                continue
        if match is None:
            if not var_kw:
                problems.append(f"parameter {p.name!r} is not taken")
            continue
        if match.default is not p.default and match.default != p.default:
            problems.append(f"parameter {p.name!r} defaults to {match.default!r} here, {p.default!r} there")
        if p.default is inspect.Parameter.empty and match.default is not inspect.Parameter.empty:
            problems.append(f"parameter {p.name!r} is required there, optional here")
    return problems


def test_plugin_signatures_match_sglangs_backend_interface():
    """Every method of SGLang's Base* backend classes, and of the Common* classes kvproto's extend,
    that kvproto's classes define, takes the same parameters (names, order, defaults) as SGLang's;
    no abstract method is left; the KVPoll values are kvproto's RoomState values."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvproto.core import RoomState

    checked = 0
    problems = []
    for base, common, ours in _pairs():
        assert not getattr(ours, "__abstractmethods__", None), f"{ours.__name__} leaves abstract methods"
        assert issubclass(ours, common) and issubclass(common, base)
        for name, _ in inspect.getmembers(ours, inspect.isfunction):
            if name.startswith("_") and name != "__init__":
                continue
            if ours.__dict__.get(name) is None:
                continue  # inherited from SGLang as it is
            for ref in (base, common):
                theirs = getattr(ref, name, None)
                if theirs is None or not inspect.isfunction(theirs):
                    continue
                for problem in _accepts(inspect.signature(ours.__dict__[name]), inspect.signature(theirs)):
                    problems.append(f"{ours.__name__}.{name} vs {ref.__name__}: {problem}")
                checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 15
    assert {k: getattr(KVPoll, k) for k in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring",
                                             "Success")} == {"Failed": RoomState.FAILED, "Bootstrapping":
                                                             RoomState.BOOTSTRAPPING, "WaitingForInput":
                                                             RoomState.WAITING_FOR_INPUT, "Transferring":
                                                             RoomState.TRANSFERRING, "Success": RoomState.SUCCESS}
