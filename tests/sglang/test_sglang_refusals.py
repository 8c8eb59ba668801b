"""What kvproto cannot serve is refused when SGLang builds the KV manager, before any socket or
room, with the reason (``kvproto.integrations.sglang.cache.refusal``)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt")  # (a bare "sglang" may be this folder)

from sglang_harness import TINY_MODEL, model_dir, server_args  # noqa: E402


@pytest.fixture(scope="module")
def sglang_env():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    manager = get_kv_class(TransferBackend("kvproto"), KVClassType.MANAGER)
    return manager, KVArgs, StateType, DisaggregationMode


def kv_args(KVArgs, **fields):
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = [1, 2], [4096, 4096], [1024, 1024]
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.page_size, args.engine_rank, args.pp_rank, args.system_dp_rank = 16, 0, 0, 0
    args.kv_cache_dtype_str, args.state_types, args.num_draft_entries = "bfloat16", [], 0
    for k, v in fields.items():
        setattr(args, k, v)
    return args


def published(tmp_path, mode: str, extra: list[str]):
    from sglang.srt.runtime_context import SpawnRanks, publish

    args = server_args(model_dir(tmp_path, TINY_MODEL), mode, extra=extra)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=None))
    return args


STATES = "(kvproto maps SGLang's 'mamba', 'swa' and 'dsa' states, one at a time)"


@pytest.mark.parametrize("mode, extra, fields, reason", [
    ("prefill", ["--pp-size", "2"], {}, "pipeline parallelism (--pp-size 2); kvproto moves TP ranks only"),
    ("decode", [], {"state_types": ["MAMBA", "SWA"]}, f"the cache states ['mamba', 'swa'] {STATES}"),
    ("prefill", [], {"state_types": ["SWA", "SWA_RING"]}, f"the cache states ['swa', 'swa_ring'] {STATES}"),
    ("prefill", [], {"state_types": ["DSA", "DSA_TAIL"]}, f"the cache states ['dsa', 'dsa_tail'] {STATES}"),
    ("decode", [], {"state_types": ["SWA"], "swa_kv_cache_layout": None},
     "a sliding-window pool of layout None (kvproto moves SGLang's SWAKVPool of MHA pools, NHD pages)"),
    ("prefill", [], {"state_types": ["MAMBA", "DSA"]}, f"the cache states ['mamba', 'dsa'] {STATES}"),
    ("decode", [], {"num_draft_entries": 2}, "speculative decoding's draft KV cache"),
    ("prefill", [], {"kv_layout": "dsv4"}, "the KV layout 'dsv4'"),
], ids=["pp", "mamba-swa", "swa-ring", "dsa-tail", "swa-not-nhd", "mamba-dsa", "draft", "layout"])
def test_sglang_refusal_at_start_names_the_reason(sglang_env, tmp_path, mode, extra, fields, reason):
    """The manager SGLang builds refuses at once with a ValueError naming what is not supported."""
    manager, KVArgs, StateType, Mode = sglang_env
    args = published(tmp_path, mode, extra)
    if "state_types" in fields:
        fields = {**fields, "state_types": [StateType[s] for s in fields["state_types"]]}
    with pytest.raises(ValueError) as info:
        manager(kv_args(KVArgs, **fields), Mode(mode), args, False)
    assert str(info.value) == f"--disaggregation-transfer-backend kvproto does not support {reason}"


def test_sglang_refusal_decode_context_parallelism(sglang_env, tmp_path):
    """Decode context parallelism: SGLang's own argument checks refuse kvproto for it at start, with
    the reason; were they to let it through, the manager refuses it too."""
    from sglang.srt.runtime_context import get_parallel

    manager, KVArgs, _, Mode = sglang_env
    with pytest.raises(ValueError, match="PD decode DCP requires"):
        published(tmp_path, "decode", ["--tp-size", "2", "--dcp-size", "2"]).resolve_once()
    args = published(tmp_path, "decode", [])
    with get_parallel().override(attn_dcp_size=2):
        with pytest.raises(ValueError, match="decode context parallelism"):
            manager(kv_args(KVArgs), Mode("decode"), args, False)


def test_sglang_transport_choice_reads_the_environment_and_names_a_bad_value():
    """KVPROTO_SGLANG_TRANSPORT picks the transport (NIXL by default; cuda-ipc: the kernel path on
    one machine), KVPROTO_SGLANG_TRANSPORT_OPTIONS its options; a bad value names the variable."""
    from kvproto.integrations.sglang.manager import transport_choice

    assert transport_choice({}) == ("nixl", {})
    assert transport_choice({"KVPROTO_SGLANG_TRANSPORT": "cuda-ipc",
                             "KVPROTO_SGLANG_TRANSPORT_OPTIONS": '{"fallback": "nixl"}'}) == \
        ("cuda-ipc", {"fallback": "nixl"})
    with pytest.raises(ValueError, match="KVPROTO_SGLANG_TRANSPORT='rdma-magic': kvproto knows the transports"):
        transport_choice({"KVPROTO_SGLANG_TRANSPORT": "rdma-magic"})
    with pytest.raises(ValueError, match="KVPROTO_SGLANG_TRANSPORT_OPTIONS must be a JSON object"):
        transport_choice({"KVPROTO_SGLANG_TRANSPORT_OPTIONS": "[1]"})
