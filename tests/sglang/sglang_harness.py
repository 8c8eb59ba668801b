"""Real SGLang scheduler ranks, one process each, moving KV through kvproto's backend.

Theory of operation
-------------------
Each rank process does what an SGLang scheduler process does before serving, with SGLang's own
code: ``load_plugins()``, ``prepare_server_args`` (a tiny local model config, offline), ``publish``
with its rank, a gloo world of the side's TP ranks (``init_distributed_environment`` and
``initialize_model_parallel``, so ``poll`` is MIN-reduced over the attention TP group as SGLang
does it), its KV pool on CPU memory (``MHATokenToKVPool`` or ``MLATokenToKVPool``),
``MetadataBuffers``, and the KV manager built by SGLang's own ``PrefillBootstrapQueue`` /
``DecodePreallocQueue._init_kv_manager`` on a stub of the scheduler (so ``KVArgs`` is filled by
SGLang's helpers and the manager class comes from ``get_kv_class``). The prefill server's
bootstrap registry (``KVProtoBootstrapServer``, SGLang's HTTP ``/route``) runs in the test
process, as it runs in the prefill server's main process.

Then every rank steps its requests as SGLang's scheduler does (``prefill_steps`` /
``decode_steps``), all requests of a rank in one loop whose polls go through SGLang's
``poll_and_all_reduce*``. The prefill writes each chunk's bytes, a function of (room, chunk,
layer, plane, global head, token, byte) (``expected``), into its pages just before that chunk's
``send``, and the request's metadata slot (every buffer, every byte) before the last; pages of
later chunks hold other bytes until then, so a backend that read ahead would move wrong bytes.
The decode checks every byte of every token past its prefix in every layer, plane and head it
holds, and every byte of the metadata slot, and at the end that no page it never handed out
was written. Results go back to the test over a pipe.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import sglang_cpu_env

sglang_cpu_env.prepare()  # before anything imports SGLang (this module is the spawned ranks' entry)

os.environ["SGLANG_HOST_IP"] = "127.0.0.1"  # every socket on loopback (SGLang's rank address, kvproto's)

PAGE = int(os.environ.get("KVPROTO_SGLANG_PAGE", "16"))
"""Tokens a page (SGLang's --page-size); a sparse-attention indexer needs pages of 64 (``dsa_pair``)."""
LAYERS = 3
HEADS = 2
HEAD_DIM = 16
KV_LORA, ROPE = 24, 8
POOL_PAGES = 48
SLOTS = 8
FULL_LAYERS, MAMBA_LAYERS = [0, 2, 4], [1, 3]
SWA_LAYERS = MAMBA_LAYERS
"""A sliding-window model's window layers (SGLang's SWAKVPool: full attention on FULL_LAYERS)."""
WINDOW = 2 * PAGE + 5
"""The sliding window both servers name the window pool's pages by (SGLang's scheduler's)."""
UNTOUCHED = 0xEE
RESERVED = 4
"""Pages at the pool's end that no request is given: no write may reach them."""

TINY_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
              "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 256,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
              "num_hidden_layers": LAYERS + 2, "hybrid_override_pattern": "*M*M*", "mamba_num_heads": 4,
              "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 4, "conv_kernel": 4, "vocab_size": 256,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
"""A Nemotron-H hybrid as SGLang reads it: attention on layers 0, 2, 4, its Mamba2 mixer on 1, 3
(4 heads of 8, 2 groups of state 4: conv channels x 32 | B 8 | C 8)."""


@dataclass(frozen=True)
class StateModel:
    """A linear-attention or SSM state as SGLang's model config describes it to its MambaPool, and
    where each of its channels belongs: the conv state's projections along its split axis (global
    sizes, each split over TP on its own, as the model's weights are), that axis (0: channels
    outer, SGLang's ``(channels, kernel - 1)``; 1: Kimi's ``(kernel - 1, channels)``), and the
    model config the servers read (the tiny Llama's where the state's own model does not matter)."""

    kind: str
    conv_sections: tuple[int, ...]
    conv_axis: int = 0
    config: dict[str, Any] = field(default_factory=lambda: TINY_MODEL)
    groups: int = 2
    args: tuple[str, ...] = ()
    """Server arguments the model needs on this CPU platform."""

    def params(self, tp: int) -> Any:
        from sglang.srt.configs import mamba_utils as mu

        if self.kind == "mamba2":  # x 32 | B 8 | C 8 (2 groups of state 4), 4 heads of 8 x 4: NEMOTRON_H's
            return mu.Mamba2CacheParams(shape=mu.Mamba2StateShape.create(
                tp_world_size=tp, intermediate_size=32, n_groups=self.groups, num_heads=4, head_dim=8, state_size=4,
                conv_kernel=4), layers=MAMBA_LAYERS)
        if self.kind == "gdn":  # Qwen3-Next's: Q 8 | K 8 | V 16 (2 key heads, 4 value heads of 4)
            return mu.Mamba2CacheParams(shape=mu.Mamba2StateShape.create(
                tp_world_size=tp, intermediate_size=16, n_groups=2, num_heads=4, head_dim=4, state_size=4,
                conv_kernel=4, conv_shard_groups=[8, 8, 16]), layers=MAMBA_LAYERS)
        if self.kind == "kimi":  # Kimi linear attention: q 16 | k 8 | v 8 (SGLang's order), rows of channels
            return mu.KimiLinearCacheParams(shape=mu.KimiLinearStateShape.create(
                tp_world_size=tp, num_heads=4, head_dim=4, num_k_heads=2, head_k_dim=4, conv_kernel_size=4),
                layers=MAMBA_LAYERS)
        raise ValueError(self.kind)


NO_BUFFER = ("--disable-radix-cache",)
"""(A Mamba2 model's prefill would keep Mamba state snapshots for its radix cache, which needs a GPU
or pages of one token.)"""

STATE_MODELS = {
    "mamba2": StateModel("mamba2", (32, 8, 8), config=NEMOTRON_H, args=NO_BUFFER),
    "gdn": StateModel("gdn", (8, 8, 16)),
    "kimi": StateModel("kimi", (16, 8, 8), conv_axis=1),
    "mamba2-1group": StateModel("mamba2", (32, 4, 4), config={**NEMOTRON_H, "n_groups": 1}, groups=1, args=NO_BUFFER),
    # a Mamba2 pool whose model config SGLang does not read as a Mamba2 mixer: KVArgs name no sub-blocks
    "mamba2-unnamed": StateModel("mamba2", (32, 8, 8)),
}


def model_dir(root: Path, config: dict[str, Any]) -> Path:
    path = Path(root) / "model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def server_args(model: Path, mode: str, *, tp: int = 1, port: int = 30000, bootstrap_port: int = 8998,
                extra: list[str] | None = None) -> Any:
    """SGLang's ServerArgs as its CLI parses them (load_plugins() must have run)."""
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args([
        "--model-path", str(model), "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "kvproto",
        "--device", "cpu", "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
        "--disaggregation-bootstrap-port", str(bootstrap_port), "--tp-size", str(tp), "--page-size", str(PAGE),
        *(extra or [])])


# --- what a request is and what its bytes are -----------------------------------------------------
@dataclass
class Request:
    room: int
    tokens: int
    chunks: list[int]
    """End token of each prefill chunk (the last: ``tokens``)."""
    prefix: int = 0
    """Tokens the decode holds already (whole pages), sent as decode_prefix_len."""
    abort: str | None = None
    """``decode-before-metadata``, ``decode-after-metadata``, ``prefill-mid``: who aborts, when."""
    stall_after: int | None = None
    """Prefill: after sending this many chunks, tell the test and stop stepping (to be killed)."""


@dataclass
class Result:
    room: int
    state: int
    reason: str = ""
    checked_bytes: int = 0
    mismatches: int = 0
    holds: int = 0
    """(The queue test's summary row) the most requests SGLang held for deferred release at once."""
    state_bytes: int = 0
    """Of ``checked_bytes``, those of the request's Mamba state slot."""
    paths: list[str] = field(default_factory=list)
    """(Prefill) the paths kvproto's room took: direct, sliced, staged-..."""


def _mix(*parts: np.ndarray) -> np.ndarray:
    x = np.zeros(np.broadcast_shapes(*(np.shape(p) for p in parts)), dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        for i, p in enumerate(parts):
            x ^= (np.asarray(p, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15 + i)) * np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(31)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def state_slot(req: Request, side: str) -> int:
    """The request's Mamba state slot on each side (different, as two servers' allocators give)."""
    return (req.room + (3 if side == "decode" else 0)) % SLOTS


def chunk_of(req: Request, tokens: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(req.chunks), tokens, side="right")


def expected(req: Request, layer: int, plane: int, head: int, tokens: np.ndarray, head_bytes: int) -> np.ndarray:
    """The bytes of ``tokens`` of one head of one layer and plane: (len(tokens), head_bytes)."""
    t = tokens[:, None]
    return _mix(req.room, chunk_of(req, t), layer, plane, head, t, np.arange(head_bytes)[None, :])


def window_start(req: Request) -> int:
    """The first token of the window pool's pages a request's servers name, by SGLang's rule (both
    sides): ``⌊max(prefix, length − window) / page⌋ · page``."""
    return max(req.prefix, req.tokens - WINDOW) // PAGE * PAGE


def window_tokens(rank: Rank, req: Request, pages: list[int], write: bool) -> tuple[int, int]:
    """Write (prefill) or check (decode) every byte of the window's tokens ``[window_start, tokens)``
    in ``pages`` (the window pool's, from the window's first page) of every window layer, plane and
    held head; returns (bytes, mismatching tokens x heads)."""
    start = window_start(req)
    tokens = np.arange(start, req.tokens)
    checked = bad = 0
    for plane in range(2):
        for li, layer in enumerate(SWA_LAYERS):
            for h in range(rank.local_heads):
                want = expected(req, 100 + layer, plane, rank.head_start + h, tokens, rank.head_bytes)
                for page in sorted(set(((tokens - start) // PAGE).tolist())):
                    sel = (tokens - start) // PAGE == page
                    view = rank.swa_page_view(plane, li, pages[page])
                    if write:
                        view[tokens[sel] % PAGE, h] = want[sel]
                    else:
                        bad += int((view[tokens[sel] % PAGE, h] != want[sel]).any(axis=1).sum())
                        checked += want[sel].size
    return checked, bad


def index_pages(rank: Rank, req: Request, pages: list[int], write: bool) -> tuple[int, int]:
    """Write (prefill) or check (decode) every byte of the indexer's pages past the decode's prefix
    (``pages``: the request's, from that prefix), every layer; returns (bytes, mismatching pages)."""
    checked = bad = 0
    for layer in range(len(rank.index_pages)):
        for i, page in enumerate(pages):
            view = rank.index_page(layer, page)
            want = _mix(req.room, 3333, layer, req.prefix // PAGE + i, np.arange(view.size))
            if write:
                view[:] = want
            else:
                checked += view.size
                bad += int((view != want).any())
    return checked, bad


def aux_expected(room: int, buffer: int, nbytes: int) -> np.ndarray:
    return _mix(room, 7777, buffer, np.arange(nbytes))


def raw(address: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def held(size: int, sections: tuple[int, ...] | None, tp: int, rank: int) -> np.ndarray | None:
    """The global indices along a split axis of ``size`` (per rank) that TP rank ``rank`` holds, in
    its own order: each section's ``rank``-th share, the sections one after another (None where the
    axis is not the sections split: a Mamba2 mixer's groups replicated on every rank)."""
    out, start = [], 0
    for n in sections or (size * tp,):
        out += range(start + rank * n // tp, start + (rank + 1) * n // tp)
        start += n
    return np.asarray(out) if len(out) == size else None


def state_views(rank: Rank, slot: int):
    """Per (model layer, state tensor): the slot's bytes in SGLang's pool as ``(rows before the
    split axis, split axis, bytes per index)`` and the global index of each position on that axis."""
    import torch

    for t, (tensor, axis, sections) in enumerate(rank.state_tensors):
        for li, layer in enumerate(MAMBA_LAYERS):
            x = tensor[li, slot]
            rows = int(np.prod(x.shape[:axis], dtype=np.int64))
            view = x.view(torch.uint8).reshape(rows, x.shape[axis], -1).numpy()
            yield layer, t, view, held(x.shape[axis], sections, rank.spec.tp, rank.spec.rank)


def state_expected(room: int, layer: int, tensor: int, index: np.ndarray, rows: int, nbytes: int) -> np.ndarray:
    """A state tensor's bytes of a request at the given global indices: (rows, len(index), nbytes)."""
    return _mix(room, 5555, layer, tensor, np.arange(rows)[:, None, None], index[None, :, None],
                np.arange(nbytes)[None, None, :])


# --- a rank: SGLang's scheduler set-up, on CPU ------------------------------------------------------
@dataclass
class RankSpec:
    role: str
    rank: int
    tp: int
    model: str
    port: int
    bootstrap_port: int
    dist_port: int
    mla: bool = False
    requests: list[Request] = field(default_factory=list)
    seed: int = 0
    deadline_s: float = 150.0
    mamba: str | None = None
    """A hybrid model (a key of ``STATE_MODELS``): SGLang's HybridLinearKVPool, full attention on
    model layers 0, 2, 4 and that model's state (conv and temporal tensors, one slot per request)
    on layers 1 and 3."""
    dsa: bool = False
    """A sparse-attention model: SGLang's DSATokenToKVPool (an MLA latent and an indexer cache of
    index keys with their scales on every layer, KVArgs' ``StateType.DSA``); pages of 64 tokens."""
    swa: bool = False
    """A sliding-window model: SGLang's SWAKVPool, full attention on FULL_LAYERS, a window of WINDOW
    tokens on SWA_LAYERS in a pool of its own (KVArgs' ``StateType.SWA``)."""


class Rank:
    """One scheduler rank's SGLang objects (module docstring)."""

    def __init__(self, spec: RankSpec, *, manager: bool = True) -> None:
        import torch
        from sglang.srt.plugins import load_plugins

        load_plugins()
        from sglang.srt.disaggregation.utils import MetadataBuffers, TransferBackend
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

        self.spec = spec
        self.args = server_args(Path(spec.model), spec.role, tp=spec.tp, port=spec.port,
                                bootstrap_port=spec.bootstrap_port,
                                extra=list(STATE_MODELS[spec.mamba].args) if spec.mamba else None)
        publish(self.args, role="scheduler", ranks=SpawnRanks(world_rank=spec.rank, dp_rank=None, gpu_id=None))
        init_distributed_environment(world_size=spec.tp, rank=spec.rank, local_rank=spec.rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{spec.dist_port}")
        initialize_model_parallel(backend="gloo")
        self.parallel = get_parallel()
        self.backend = TransferBackend("kvproto")
        if spec.mamba:
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

            self.local_heads = max(1, HEADS // spec.tp)
            self.head_start = spec.rank * self.local_heads if spec.tp <= HEADS else spec.rank * HEADS // spec.tp
            model = STATE_MODELS[spec.mamba]
            mamba = MambaPool(size=SLOTS, spec_state_size=0, cache_params=model.params(spec.tp),
                              mamba_layer_ids=MAMBA_LAYERS, device="cpu")
            self.pool = HybridLinearKVPool(size=POOL_PAGES * PAGE - PAGE, dtype=torch.bfloat16, page_size=PAGE,
                                           head_num=self.local_heads, head_dim=HEAD_DIM,
                                           full_attention_layer_ids=FULL_LAYERS, device="cpu", mamba_pool=mamba)
            cache = mamba.mamba_cache
            self.state_tensors = [(cache.conv[0], model.conv_axis, model.conv_sections), (cache.temporal, 0, None)]
            """Per state tensor: SGLang's ``(layers, slots + 1, *per-slot shape)`` tensor, the axis split
            over TP and the model's projections along it (global sizes; None: one)."""
        elif spec.swa:
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            self.local_heads = max(1, HEADS // spec.tp)
            self.head_start = spec.rank * self.local_heads if spec.tp <= HEADS else spec.rank * HEADS // spec.tp
            self.pool = SWAKVPool(size=POOL_PAGES * PAGE - PAGE, size_swa=POOL_PAGES * PAGE - PAGE, page_size=PAGE,
                                  dtype=torch.bfloat16, head_num=self.local_heads, head_dim=HEAD_DIM,
                                  swa_attention_layer_ids=SWA_LAYERS, full_attention_layer_ids=FULL_LAYERS,
                                  device="cpu", enable_memory_saver=False)
        elif spec.dsa:
            from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

            self.pool = DSATokenToKVPool(size=POOL_PAGES * PAGE - PAGE, page_size=PAGE, kv_lora_rank=KV_LORA,
                                         dtype=torch.bfloat16, qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu",
                                         index_head_dim=128, enable_memory_saver=False, kv_cache_dim=KV_LORA + ROPE)
            self.local_heads, self.head_start = 1, 0
        elif spec.mla:
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

            self.pool = MLATokenToKVPool(size=POOL_PAGES * PAGE - PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                         kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu",
                                         enable_memory_saver=False)
            self.local_heads, self.head_start = 1, 0
        else:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            self.local_heads = max(1, HEADS // spec.tp)
            self.head_start = spec.rank * self.local_heads if spec.tp <= HEADS else spec.rank * HEADS // spec.tp
            self.pool = MHATokenToKVPool(size=POOL_PAGES * PAGE - PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                         head_num=self.local_heads, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                                         enable_memory_saver=False)
        self.metadata = MetadataBuffers(SLOTS, hidden_size=32, hidden_states_dtype=torch.bfloat16,
                                        max_sampling_mask_tokens=4, max_top_logprobs_num=4)
        if manager:
            self.attach(self._kv_manager())

    def attach(self, manager: Any) -> None:
        """The rank's KV manager (built here, or by SGLang's queue): where its memory is."""
        import torch

        spec = self.spec
        self.manager = manager
        ptrs, lens, items = self.manager.kv_args.kv_data_ptrs, self.manager.kv_args.kv_data_lens, \
            self.manager.kv_args.kv_item_lens
        self.planes = [ptrs[p * LAYERS:(p + 1) * LAYERS] for p in range(1 if spec.mla else 2)]
        self.region_bytes, self.page_bytes = lens[0], items[0]
        self.head_bytes = self.page_bytes // (PAGE * self.local_heads)
        self.aux = list(zip(self.manager.kv_args.aux_data_ptrs, self.manager.kv_args.aux_item_lens))
        args = self.manager.kv_args
        self.states = spec.mamba is not None
        """Whether the rank keeps a Mamba state (``state_tensors``)."""
        self.swa_planes: list[list[int]] = []
        """A sliding-window model's window pool: per plane (K, V), each window layer's buffer."""
        self.index_pages: list[tuple[int, int]] = []
        """A sparse-attention model's indexer: per layer, (address, bytes a page)."""
        if spec.dsa:
            (index_ptrs,), (index_lens,), (index_items,) = args.state_data_ptrs, args.state_data_lens, \
                args.state_item_lens
            self.index_pages = list(zip(index_ptrs, index_items))
            for address, nbytes in zip(index_ptrs, index_lens):
                raw(address, nbytes)[:] = UNTOUCHED
        if spec.swa:
            (swa_ptrs,), (swa_lens,), (swa_items,) = args.state_data_ptrs, args.state_data_lens, args.state_item_lens
            self.swa_planes = [swa_ptrs[p * len(SWA_LAYERS):(p + 1) * len(SWA_LAYERS)] for p in range(2)]
            self.swa_region_bytes, self.swa_page_bytes = swa_lens[0], swa_items[0]
        for plane in self.planes + self.swa_planes:
            for address in plane:
                raw(address, self.region_bytes if plane in self.planes else self.swa_region_bytes)[:] = UNTOUCHED
        if spec.role == "decode":
            for tensor, _, _ in getattr(self, "state_tensors", []):
                tensor.view(-1).view(torch.uint8)[:] = UNTOUCHED
        self.rng = random.Random(spec.seed * 1000 + spec.rank)

    def _kv_manager(self) -> Any:
        from types import SimpleNamespace

        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        model_config = SimpleNamespace(hf_text_config=SimpleNamespace(full_attention_layer_ids=FULL_LAYERS),
                                       num_hidden_layers=LAYERS + len(MAMBA_LAYERS) if self.spec.mamba or self.spec.swa else LAYERS,
                                       get_total_num_kv_heads=lambda: HEADS)
        scheduler = SimpleNamespace(rust_server=None, server_args=self.args, model_config=model_config,
                                    tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")),
                                    enable_hisparse=False, req_to_token_pool=None)
        stub = SimpleNamespace(transfer_backend=self.backend, tp_rank=self.spec.rank, pp_rank=0, scheduler=scheduler,
                               token_to_kv_pool=self.pool, draft_token_to_kv_pool=None, is_mla_backend=self.spec.mla,
                               metadata_buffers=self.metadata, tree_cache=None, enable_staging=False)
        queue = PrefillBootstrapQueue if self.spec.role == "prefill" else DecodePreallocQueue
        return queue._init_kv_manager(stub)

    def page_view(self, plane: int, layer: int, page: int) -> np.ndarray:
        """(PAGE, local heads, head bytes) of one page."""
        region = raw(self.planes[plane][layer], self.region_bytes)
        return region[page * self.page_bytes:(page + 1) * self.page_bytes].reshape(PAGE, self.local_heads,
                                                                                  self.head_bytes)

    def swa_page_view(self, plane: int, layer: int, page: int) -> np.ndarray:
        """(PAGE, local heads, head bytes) of one page of the window pool (``layer``: its index in SWA_LAYERS)."""
        region = raw(self.swa_planes[plane][layer], self.swa_region_bytes)
        return region[page * self.swa_page_bytes:(page + 1) * self.swa_page_bytes].reshape(
            PAGE, self.local_heads, self.head_bytes)

    def index_page(self, layer: int, page: int) -> np.ndarray:
        """One page of a sparse-attention model's indexer cache (its bytes)."""
        address, nbytes = self.index_pages[layer]
        return raw(address + page * nbytes, nbytes)

    def bootstrap_addr(self) -> str:
        return f"127.0.0.1:{self.spec.bootstrap_port}"


# --- the prefill scheduler's calls, per request -------------------------------------------------
def prefill_steps(rank: Rank, req: Request, free: list[int], conn: Any, results: list[Result]):
    """A generator stepping one request as SGLang's prefill does; yields the sender to poll and
    is sent the poll MIN-reduced over the TP group."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    sender = get_kv_class(rank.backend, KVClassType.SENDER)(mgr=rank.manager, bootstrap_addr=rank.bootstrap_addr(),
                                                             bootstrap_room=req.room)
    pages = [free.pop() for _ in range(-(-req.tokens // PAGE))]
    for page in pages:  # bytes no chunk has written yet: what a read-ahead would move
        for plane in range(len(rank.planes)):
            for layer in range(LAYERS):
                rank.page_view(plane, layer, page)[:] = rank.rng.randrange(256)
        for layer in range(len(rank.index_pages)):
            rank.index_page(layer, page)[:] = rank.rng.randrange(256)
    if rank.states:  # bytes the last chunk has not written yet: what a read-ahead would move
        for _, _, view, _ in state_views(rank, state_slot(req, "prefill")):
            view[:] = rank.rng.randrange(256)
    slot = free_slot = req.room % SLOTS
    swa_pages = [rank.swa_free.pop() for _ in range(-(-req.tokens // PAGE) - window_start(req) // PAGE)] \
        if rank.swa_planes else []
    for page in swa_pages:  # what a read-ahead of the window would move
        for plane in range(2):
            for li in range(len(SWA_LAYERS)):
                rank.swa_page_view(plane, li, page)[:] = rank.rng.randrange(256)
    poll = yield sender
    while poll == KVPoll.Bootstrapping:
        poll = yield sender
    if poll == KVPoll.Failed:
        results.append(_failed(req.room, sender))
        return
    prefix = sender.pop_decode_prefix_len()
    sender.init(-(-(req.tokens - prefix) // PAGE), free_slot)
    start, sent = prefix, 0
    for i, end in enumerate(req.chunks):
        last = i == len(req.chunks) - 1
        end = end if last else end - end % PAGE
        if end <= start and not last:
            continue
        tokens = np.arange(start, end)
        for plane in range(len(rank.planes)):
            for layer in range(LAYERS):
                for h in range(rank.local_heads):
                    data = expected(req, layer, plane, rank.head_start + h, tokens, rank.head_bytes)
                    for page in set((tokens // PAGE).tolist()):
                        sel = tokens // PAGE == page
                        rank.page_view(plane, layer, pages[page])[tokens[sel] % PAGE, h] = data[sel]
        states = None
        if last:
            for b, (address, nbytes) in enumerate(rank.aux):
                raw(address + slot * nbytes, nbytes)[:] = aux_expected(req.room, b, nbytes)
            if rank.states:  # this rank's share of the request's state, by global channel (head) index
                for layer, t, view, index in state_views(rank, state_slot(req, "prefill")):
                    view[:] = state_expected(req.room, layer, t, index, view.shape[0], view.shape[2])
            states = [np.asarray([state_slot(req, "prefill")])] if rank.states else []
            if rank.index_pages:  # the indexer's pages past the decode's prefix: the KV's page table
                index_pages(rank, req, pages[prefix // PAGE:], write=True)
                states = [np.asarray(pages[prefix // PAGE:], dtype=np.int64)]
            if swa_pages:  # the window's pages, written now (SGLang keeps only the window's)
                window_tokens(rank, req, swa_pages, write=True)
                states = [np.asarray(swa_pages, dtype=np.int64)]
        chunk_pages = pages[start // PAGE:(-(-end // PAGE)) if last else end // PAGE]
        sender.send(np.asarray(chunk_pages, dtype=np.int64), states, num_kv_tokens=end - start)
        start, sent = end, sent + 1
        if req.stall_after is not None and sent == req.stall_after:
            conn.send(("stalled", req.room))
            while True:  # the test kills this process now
                time.sleep(1)
        if req.abort == "prefill-mid" and not last:
            sender.abort()
        poll = yield sender
        if poll == KVPoll.Failed:
            break
    while poll not in (KVPoll.Success, KVPoll.Failed):
        poll = yield sender
    handle = getattr(getattr(sender, "_room", None), "_handle", None)
    paths = sorted(handle.stats.paths) if handle is not None else []
    results.append(Result(req.room, int(poll), paths=paths) if poll == KVPoll.Success else _failed(req.room, sender))
    sender.clear()
    free.extend(pages)
    rank.swa_free.extend(swa_pages)


def _failed(room: int, party: Any) -> Result:
    try:
        party.failure_exception()
    except Exception as exc:
        return Result(room, 0, f"{type(exc).__name__}: {exc}")
    return Result(room, 0, "failure_exception() did not raise")


# --- the decode scheduler's calls, per request --------------------------------------------------
def decode_steps(rank: Rank, req: Request, free: list[int], conn: Any, results: list[Result]):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    addr = rank.bootstrap_addr()
    receiver = get_kv_class(rank.backend, KVClassType.RECEIVER)(mgr=rank.manager, bootstrap_addr=addr,
                                                                 bootstrap_room=req.room)
    while not rank.manager.try_ensure_parallel_info(addr):  # SGLang retries once a second
        next_try = time.monotonic() + 0.5
        while time.monotonic() < next_try:
            if (yield receiver) == KVPoll.Failed:  # another rank's room failed already: SGLang's reduced poll
                results.append(_failed(req.room, receiver))
                receiver.clear()
                return
    receiver.init(0)
    poll = yield receiver
    while poll == KVPoll.Bootstrapping:
        poll = yield receiver
    pages: list[int] = []
    swa_pages: list[int] = []
    if poll != KVPoll.Failed:
        if req.abort == "decode-before-metadata":
            receiver.abort()
        else:
            pages = [free.pop() for _ in range(-(-(req.tokens - req.prefix) // PAGE))]
            states = [np.asarray([state_slot(req, "decode")])] if rank.states else []
            if rank.index_pages:  # (SGLang: suffix_page_indices, the KV's pages past the prefix)
                states = [np.asarray(pages, dtype=np.int64)]
            if rank.swa_planes:
                swa_pages = [rank.swa_free.pop() for _ in range(-(-req.tokens // PAGE) - window_start(req) // PAGE)]
                states = [np.asarray(swa_pages, dtype=np.int64)]
            receiver.send_metadata(np.asarray(pages, dtype=np.int64), req.room % SLOTS, states,
                                   decode_prefix_len=req.prefix)
            if req.abort == "decode-after-metadata":
                receiver.abort()
        poll = yield receiver
        while poll not in (KVPoll.Success, KVPoll.Failed):
            poll = yield receiver
    if poll == KVPoll.Success:
        results.append(verify(rank, req, pages, swa_pages))
    else:
        results.append(_failed(req.room, receiver))
    receiver.clear()
    free.extend(pages)
    rank.swa_free.extend(swa_pages)


def verify(rank: Rank, req: Request, pages: list[int], swa_pages: list[int]) -> Result:
    """Every byte of every token past the prefix, every layer, plane and held head; the metadata
    slot; a sliding-window model's window, in every window layer (``state_bytes``)."""
    tokens = np.arange(req.prefix, req.tokens)
    local = tokens - req.prefix
    checked = mismatches = 0
    for plane in range(len(rank.planes)):
        for layer in range(LAYERS):
            for h in range(rank.local_heads):
                want = expected(req, layer, plane, rank.head_start + h, tokens, rank.head_bytes)
                got = np.stack([rank.page_view(plane, layer, pages[t // PAGE])[t % PAGE, h] for t in local.tolist()])
                checked += want.size
                mismatches += int((want != got).any(axis=1).sum())
    slot = req.room % SLOTS
    for b, (address, nbytes) in enumerate(rank.aux):
        got = raw(address + slot * nbytes, nbytes)
        checked += nbytes
        mismatches += int((got != aux_expected(req.room, b, nbytes)).any())
    states = 0
    if rank.states:  # every byte of the decode rank's share of every state tensor, by global index
        for layer, t, view, index in state_views(rank, state_slot(req, "decode")):
            want = state_expected(req.room, layer, t, index, view.shape[0], view.shape[2])
            checked += view.size
            states += view.size
            mismatches += int((view != want).any(axis=2).sum())
    if rank.index_pages:
        index, bad = index_pages(rank, req, pages, write=False)
        checked, states, mismatches = checked + index, states + index, mismatches + bad
    if rank.swa_planes:
        window, bad = window_tokens(rank, req, swa_pages, write=False)
        checked, states, mismatches = checked + window, states + window, mismatches + bad
    return Result(req.room, 4, checked_bytes=checked, mismatches=mismatches, state_bytes=states)


# --- a rank's main loop -------------------------------------------------------------------------
def run_rank(spec: RankSpec, conn: Any) -> None:
    """Process entry: set up, step every request to its end, report results (or the error)."""
    try:
        rank = Rank(spec)
        conn.send(("ready", spec.rank))
        from sglang.srt.disaggregation.utils import poll_and_all_reduce, poll_and_all_reduce_attn_cp_tp_group

        steps = prefill_steps if spec.role == "prefill" else decode_steps
        free = list(range(1, POOL_PAGES - RESERVED))
        rank.rng.shuffle(free)
        rank.swa_free = list(range(1, POOL_PAGES - RESERVED))
        rank.rng.shuffle(rank.swa_free)
        results: list[Result] = []
        active = []
        for req in spec.requests:
            gen = steps(rank, req, free, conn, results)
            active.append([gen, next(gen)])
        deadline = time.monotonic() + spec.deadline_s
        while active:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.role} rank {spec.rank}: rooms did not end in {spec.deadline_s} s: "
                                   f"{_stuck(rank, [a[1] for a in active])}")
            pollers = [a[1] for a in active]
            if spec.role == "prefill":
                polls = poll_and_all_reduce_attn_cp_tp_group(pollers, rank.parallel.attn_cp_group.cpu_group,
                                                             rank.parallel.attn_tp_group.cpu_group)
            else:
                polls = poll_and_all_reduce(pollers, rank.parallel.attn_tp_group.cpu_group)
            still = []
            for entry, poll in zip(active, polls):
                try:
                    entry[1] = entry[0].send(poll)
                    still.append(entry)
                except StopIteration:
                    pass
            active = still
            time.sleep(0.002)
        untouched = True
        if spec.role == "decode":  # pages never handed out were never written
            never = range(POOL_PAGES - RESERVED, POOL_PAGES)
            for plane in range(len(rank.planes)):
                for layer in range(LAYERS):
                    for page in never:
                        untouched &= bool((rank.page_view(plane, layer, page) == UNTOUCHED).all())
            for layer in range(len(rank.index_pages)):  # indexer pages never handed out
                for page in never:
                    untouched &= bool((rank.index_page(layer, page) == UNTOUCHED).all())
            for plane in range(len(rank.swa_planes)):  # window pages never handed out
                for li in range(len(SWA_LAYERS)):
                    for page in never:
                        untouched &= bool((rank.swa_page_view(plane, li, page) == UNTOUCHED).all())
            if rank.states:  # state slots no request was given
                given = {state_slot(req, "decode") for req in spec.requests}
                for slot in set(range(SLOTS + 1)) - given:
                    untouched &= all(bool((view == UNTOUCHED).all()) for *_, view, _ in state_views(rank, slot))
        transport = type(rank.manager.endpoint._endpoint.transport).__name__
        conn.send(("results", [asdict(r) for r in results], untouched, transport))
        conn.recv()  # the test says when to close (the peers may still need this rank)
        rank.manager.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _stuck(rank: Rank, parties: list[Any]) -> str:
    """What each unfinished room's objects say (for a test that timed out)."""
    out = []
    for party in parties:
        room = getattr(party, "_room", None)
        handle = getattr(room, "_handle", None)
        core = rank.manager.endpoint._endpoint.core if rank.manager.endpoint is not None else None
        state = core.room_state(party.bootstrap_room) if core is not None else None
        out.append(f"room {party.bootstrap_room}: poll={party.poll()} kvproto={state} handle={handle is not None} "
                   f"error={getattr(room, '_error', None)!r}")
    out.append(f"prefill_info_table={list(getattr(rank.manager, 'prefill_info_table', {}))}")
    return "; ".join(out)


@dataclass
class Pair:
    """A prefill and a decode server of real rank processes (the test's side of the harness)."""

    processes: dict[tuple[str, int], Any]
    conns: dict[tuple[str, int], Any]
    server: Any
    transports: dict[tuple[str, int], str] = field(default_factory=dict)
    """Each rank's transport class, as it reported with its results."""

    def wait(self, kind: str, who: tuple[str, int], timeout: float = 120.0) -> tuple:
        conn = self.conns[who]
        deadline = time.monotonic() + timeout
        while True:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{who} sent no {kind!r} in {timeout} s")
            msg = conn.recv()
            if msg[0] == "error":
                raise AssertionError(f"{who} failed:\n{msg[1]}")
            if msg[0] == kind:
                return msg
            assert msg[0] in ("ready", "stalled"), msg

    def results(self, who: tuple[str, int], timeout: float = 240.0) -> tuple[dict[int, Result], bool]:
        msg = self.wait("results", who, timeout)
        if len(msg) > 3:
            self.transports[who] = msg[3]
        return {r["room"]: Result(**r) for r in msg[1]}, msg[2]

    def close(self) -> None:
        for who, conn in self.conns.items():
            if self.processes[who].is_alive():
                try:
                    conn.send("close")
                except (BrokenPipeError, OSError):
                    pass
        for who, proc in self.processes.items():
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.server.close()


def start_pair(tmp: Path, *, p_tp: int, d_tp: int, mla: bool, prefill: list[Request], decode: list[Request],
               seed: int = 0, entry: Any = None, mamba: str | None = None, swa: bool = False,
               dsa: bool = False) -> Pair:
    """Start the bootstrap registry here and every rank process (module docstring)."""
    from kvproto.integrations.sglang.bootstrap import KVProtoBootstrapServer
    from kvproto.testing.ports import free_port

    model = model_dir(tmp, STATE_MODELS[mamba].config if mamba else TINY_MODEL)
    bport, port = free_port(), free_port()
    server = KVProtoBootstrapServer("127.0.0.1", bport)
    ctx = mp.get_context("spawn")
    processes, conns = {}, {}
    for role, tp, reqs in (("prefill", p_tp, prefill), ("decode", d_tp, decode)):
        dist = free_port()
        for rank in range(tp):
            spec = RankSpec(role, rank, tp, str(model), port, bport, dist, mla, reqs, seed, mamba=mamba, swa=swa, dsa=dsa)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=entry or run_rank, args=(spec, theirs), name=f"sglang-{role}-{rank}",
                               daemon=True)
            proc.start()
            processes[(role, rank)], conns[(role, rank)] = proc, ours
    return Pair(processes, conns, server)

