"""How the backend reads a Mamba state's layout from SGLang's KVArgs (``cache.mamba_layout``), and
what it leaves to equal attention TP sizes, without processes: KVArgs as SGLang's MambaPool fills them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt")  # (a bare "sglang" may be this folder)

from kvproto.integrations.sglang.cache import mamba_group, mamba_layout  # noqa: E402


def mamba_args(*, dims=(16, 16, 2, 2), outer=(1, 1, 1, 1), groups=([8, 8, 16], [8, 8, 16], None, None),
               items=(96, 96, 128, 128)) -> SimpleNamespace:
    """KVArgs of a GDN state on attention TP 2 (two layers: conv of 16 channels x 3 bf16, temporal 2
    heads of 4 x 4 fp32), SGLang's order: every layer of the conv tensor, then the temporal's."""
    return SimpleNamespace(state_types=["mamba"], state_data_ptrs=[[1 << 20, 2 << 20, 3 << 20, 4 << 20]],
                           state_data_lens=[[9 * n for n in items]], state_item_lens=[list(items)],
                           state_layer_ids=[[1, 3, 1, 3]], state_dim_per_tensor=[list(dims)],
                           state_slice_outer_counts=[list(outer)], state_conv_shard_groups=[list(groups)])


def test_sglang_mamba_layout_gdn_conv_sections_and_rows():
    """GDN: the conv state's slice axis in its three sub-blocks (global sizes) and the temporal
    state's heads, each index the rest of its bytes; Kimi's rows of channels keep the rows before
    the axis; a replicated tensor (slice dim 0) is whole bytes. Any attention TP size may meet it."""
    layout = mamba_layout(mamba_args(), tp_size=2)
    assert layout.shapes == [(1, 16, 6), (1, 2, 64)] and layout.shard_dims == [1, 1]
    assert layout.sections == [(8, 8, 16), None] and layout.same_tp_only is None
    kimi = mamba_layout(mamba_args(outer=(3, 3, 1, 1), groups=([16, 8, 8],) * 2 + (None, None)), tp_size=2)
    assert kimi.shapes == [(3, 16, 2), (1, 2, 64)] and kimi.sections == [(16, 8, 8), None]
    replicated = mamba_layout(mamba_args(dims=(16, 16, 0, 0)), tp_size=2)
    assert replicated.shapes[1] == (128,) and replicated.shard_dims == [1, None]
    group = mamba_group(mamba_args(), tp_size=2, tp_rank=1, on_gpu=False)
    assert group.group.tensors[0].shape == (1, 32, 6) and group.group.tensors[0].sections == (8, 8, 16)
    assert group.region_addresses == (1 << 20, 3 << 20, 2 << 20, 4 << 20) and group.layers == (1, 3)


def test_sglang_mamba_layout_mamba2_conv_sections_from_the_model():
    """A state whose KVArgs name no sub-blocks (Mamba2) takes its conv state's from the model (the
    manager reads a Mamba2 mixer's x | B | C); sub-blocks that are not the conv tensor's dim, or a
    state of more tensors than a conv and a temporal one, stay equal-TP only."""
    args = dict(dims=(24, 24, 2, 2), items=(144, 144, 256, 256), groups=(None,) * 4)
    layout = mamba_layout(mamba_args(**args), tp_size=2, conv_sections=(32, 8, 8))
    assert layout.sections == [(32, 8, 8), None] and layout.same_tp_only is None
    other = mamba_layout(mamba_args(**args), tp_size=2, conv_sections=(32, 4, 4))
    assert "name no conv sub-blocks" in other.same_tp_only
    three = mamba_args(dims=(24, 24, 2, 2, 2, 2), items=(144, 144, 256, 256, 8, 8), groups=(None,) * 6,
                       outer=(1,) * 6)
    three.state_layer_ids, three.state_data_ptrs = [[1, 3] * 3], [list(range(1, 7))]
    assert mamba_layout(three, tp_size=2, conv_sections=(32, 8, 8)).same_tp_only


@pytest.mark.parametrize("fields, reason", [
    ({"groups": (None,) * 4}, "name no conv sub-blocks for it (state_conv_shard_groups)"),
    ({"dims": ()}, "give no TP slice of each Mamba state tensor"),
    ({"groups": ([8, 8, 8],) * 2 + (None, None)}, "sub-blocks [8, 8, 8] do not add up to its slice dim 16 x "
                                                   "attention TP 2"),
    ({"dims": (16, 16, 3, 3)}, "Mamba state tensor 1: 128 bytes per slot are not 1 rows of a slice dim of 3"),
    ({"dims": (16, 8, 2, 2)}, "give no TP slice of each Mamba state tensor"),
], ids=["mamba2-no-sub-blocks", "no-dims", "sub-blocks-off", "dims-off", "layers-differ"])
def test_sglang_mamba_layout_what_kvargs_cannot_place_is_equal_tp_only(fields, reason):
    """Where KVArgs cannot say where every byte of the state belongs on another TP size, the state is
    described as bytes rank to rank (equal attention TP sizes only), with the reason."""
    layout = mamba_layout(mamba_args(**fields), tp_size=2)
    assert reason in layout.same_tp_only
    if fields.get("groups") == (None,) * 4:  # Mamba2: still described by its slice dims, moved rank to rank
        assert layout.shapes == [(1, 16, 6), (1, 2, 64)] and layout.sections == [None, None]
    else:
        assert layout.shapes is None
        group = mamba_group(mamba_args(**fields), tp_size=2, tp_rank=0, on_gpu=False)
        assert [t.shape for t in group.group.tensors] == [(192,), (256,)]


@pytest.mark.parametrize("config, sections", [("nemotron_h", (32, 8, 8)), ("llama", None)])
def test_sglang_mamba2_conv_sections_read_from_the_model_config(tmp_path, config, sections):
    """The manager reads a Mamba2 mixer model's conv sub-blocks (x | B | C) from SGLang's own
    reading of its config (Nemotron-H here); any other model gives none."""
    from sglang_harness import NEMOTRON_H, NO_BUFFER, TINY_MODEL, model_dir, server_args
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish

    from kvproto.integrations.sglang.manager import mamba2_conv_sections

    load_plugins()
    model = model_dir(tmp_path, NEMOTRON_H if config == "nemotron_h" else TINY_MODEL)
    args = server_args(model, "prefill", extra=list(NO_BUFFER))
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=None))
    assert mamba2_conv_sections(args) == sections
