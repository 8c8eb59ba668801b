"""A small decoder-only transformer with a paged KV cache, written so that disaggregation can be
checked token for token.

Theory of operation
-------------------
The model is a byte-level language model: vocabulary 256, ``LAYERS`` layers, 32 query heads
sharing 8 KV heads (GQA, 4 query heads per KV head), head dim 16, RoPE, RMSNorm and a SiLU MLP,
with seeded random weights (no downloads). Its KV cache is paged: per layer a K and a V tensor
of ``(blocks, block, heads, dim)`` (NHD) or ``(blocks, heads, block, dim)`` (HND), and a request
names its pages in a block table, exactly the layout kvproto moves.

*Exactness.* Disaggregation must not change a single token, so the arithmetic is made the same
whatever the tensor-parallel split, block size or layout:

* everything that touches heads is computed one KV-head *group* at a time (its 4 query heads,
  its K and V) with the same shapes whatever the TP size, and a group's attention output goes
  through its slice of the output projection on its own;
* the 8 groups' projected outputs are summed in group order, always: a TP rank computes its
  groups, the ranks exchange them (``Ranks.all_gather``: torch.distributed over gloo), and every
  rank sums all 8 in the same order, so the hidden state is bitwise the same on every rank and
  in the single-process model;
* attention reads K and V through the block table into dense tensors first, so block size and
  layout never enter the arithmetic; torch runs single-threaded (``torch.set_num_threads(1)``).

The prompt is processed in chunks of ``chunk`` tokens (chunked prefill); the chunk boundaries are
part of the arithmetic, so the single-process reference uses the same chunk size. Generation is
greedy.

*Hybrid variant* (``hybrid=True``, a linear-attention hybrid as Qwen3-Next or Jamba are built):
layer 0 is linear attention, which keeps no K/V pages but a recurrent state per request and per
KV-head group (``S = sum phi(k) v^T`` and ``z = sum phi(k)``, ``phi = elu + 1``, updated token by
token), and layer 1 is full attention over paged K/V. The cache is then two kvproto groups: the
pages of layer 1, and a state group of layer 0's per-request slots, split over TP by KV-head
group; a disaggregated request moves both in one room, and its tokens equal the single-process
hybrid model's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 256
LAYERS = 2
DIM = 512
Q_HEADS = 32
KV_HEADS = 8
HEAD_DIM = 16
GROUP = Q_HEADS // KV_HEADS
FFN = 1024
SEED = 1234


@dataclass(frozen=True)
class Shard:
    """Which KV-head groups (and their query heads) this rank computes."""

    tp_size: int = 1
    tp_rank: int = 0

    @property
    def groups(self) -> range:
        per = KV_HEADS // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)


class Ranks:
    """The ranks of one instance exchanging group outputs (a single rank exchanges nothing)."""

    def __init__(self, shard: Shard, group: Any = None) -> None:
        self.shard = shard
        self.group = group

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        """(my groups, tokens, DIM) -> (all KV_HEADS groups, tokens, DIM), in group order."""
        if self.shard.tp_size == 1:
            return mine
        import torch.distributed as dist

        parts = [torch.empty_like(mine) for _ in range(self.shard.tp_size)]
        dist.all_gather(parts, mine.contiguous(), group=self.group)
        return torch.cat(parts)


def weights(seed: int = SEED) -> dict[str, torch.Tensor]:
    """The model's parameters, the same in every process."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    w: dict[str, torch.Tensor] = {"embed": rand(VOCAB, DIM, scale=1.0), "norm": torch.ones(DIM),
                                  "out": rand(DIM, VOCAB, scale=1 / math.sqrt(DIM))}
    for layer in range(LAYERS):
        w[f"{layer}.q"] = rand(KV_HEADS, DIM, GROUP * HEAD_DIM, scale=1 / math.sqrt(DIM))
        w[f"{layer}.k"] = rand(KV_HEADS, DIM, HEAD_DIM, scale=1 / math.sqrt(DIM))
        w[f"{layer}.v"] = rand(KV_HEADS, DIM, HEAD_DIM, scale=1 / math.sqrt(DIM))
        w[f"{layer}.o"] = rand(KV_HEADS, GROUP * HEAD_DIM, DIM, scale=2 / math.sqrt(GROUP * HEAD_DIM))
        w[f"{layer}.up"] = rand(DIM, 2 * FFN, scale=1 / math.sqrt(DIM))
        w[f"{layer}.down"] = rand(FFN, DIM, scale=2 / math.sqrt(FFN))
        w[f"{layer}.norm1"] = torch.ones(DIM)
        w[f"{layer}.norm2"] = torch.ones(DIM)
    return w


class PagedCache:
    """One rank's KV cache: per full-attention layer, K and V tensors of pages holding this rank's
    KV heads; per linear-attention layer (the hybrid variant), a recurrent state per request slot."""

    def __init__(self, shard: Shard, *, blocks: int, block: int, layout: str = "NHD", hybrid: bool = False,
                 slots: int = 64) -> None:
        self.shard, self.block, self.layout, self.hybrid = shard, block, layout, hybrid
        heads = len(shard.groups)
        shape = (blocks, block, heads, HEAD_DIM) if layout == "NHD" else (blocks, heads, block, HEAD_DIM)
        self.full = [1] if hybrid else list(range(LAYERS))
        """The model layers with K/V pages."""
        self.linear = [0] if hybrid else []
        """The model layers with a recurrent state (hybrid)."""
        self.k = [torch.zeros(shape) for _ in self.full]
        self.v = [torch.zeros(shape) for _ in self.full]
        self.state = [torch.zeros((slots, heads, HEAD_DIM, HEAD_DIM + 1)) for _ in self.linear]
        """Per linear layer: (slots, this rank's KV-head groups, S | z)."""
        self.free = list(range(blocks))

    def kv_cache(self, aux: torch.Tensor | None = None) -> Any:
        """This cache as kvproto's ``KVCache`` (the hybrid variant: the K/V pages, then the state)."""
        from kvproto.aio import KVCache, StateCache

        tp = dict(tp_size=self.shard.tp_size, tp_rank=self.shard.tp_rank)
        kv = KVCache.from_tensors([self.k, self.v], num_kv_heads=KV_HEADS, layout=self.layout, aux=aux,
                                  model_layers=self.full, **tp)
        if not self.hybrid:
            return kv
        return kv.with_groups(StateCache.from_tensors("linear", [[s] for s in self.state], shard_dims=[0],
                                                      model_layers=self.linear, **tp))

    def reset(self, slot: int) -> None:
        """A new request's recurrent state starts at zero."""
        for s in self.state:
            s[slot].zero_()

    def take(self, n: int) -> list[int]:
        if len(self.free) < n:
            raise RuntimeError(f"KV cache full: {n} pages wanted, {len(self.free)} free")
        pages, self.free = self.free[:n], self.free[n:]
        return pages

    def give(self, pages: Sequence[int]) -> None:
        self.free.extend(pages)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.block)

    def write(self, layer: int, pages: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V of tokens [start, start + len) (shape (tokens, heads, dim)) into the pages."""
        layer = self.full.index(layer)
        for t in range(k.shape[0]):
            page, slot = pages[(start + t) // self.block], (start + t) % self.block
            if self.layout == "NHD":
                self.k[layer][page, slot] = k[t]
                self.v[layer][page, slot] = v[t]
            else:
                self.k[layer][page, :, slot] = k[t]
                self.v[layer][page, :, slot] = v[t]

    def read(self, layer: int, pages: Sequence[int], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V (tokens, heads, dim) of tokens [0, end)."""
        index = torch.tensor(list(pages[:self.pages_for(end)]), dtype=torch.int64)
        layer = self.full.index(layer)
        k, v = self.k[layer][index], self.v[layer][index]
        if self.layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k.reshape(-1, k.shape[2], HEAD_DIM)[:end], v.reshape(-1, v.shape[2], HEAD_DIM)[:end]


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (tokens, heads, HEAD_DIM) at ``positions``."""
    half = HEAD_DIM // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = positions.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Model:
    """The model as one rank of a tensor-parallel instance runs it (TP 1: the whole model)."""

    def __init__(self, ranks: Ranks, w: dict[str, torch.Tensor] | None = None) -> None:
        self.ranks = ranks
        self.w = w or weights()

    def forward(self, tokens: Sequence[int], start: int, cache: PagedCache, pages: Sequence[int],
                on_layer: Callable[[int], None] | None = None, slot: int = 0) -> torch.Tensor:
        """Run tokens at positions [start, start + len), writing their K and V into ``pages`` (and a
        linear layer's state into ``slot``); returns the logits of the last token. ``on_layer(l)``
        runs once layer ``l``'s K and V (or state) are written (a serving loop streams them to the
        decode while the next layers compute)."""
        w = self.w
        x = w["embed"][torch.tensor(list(tokens), dtype=torch.int64)]
        positions = torch.arange(start, start + len(tokens))
        end = start + len(tokens)
        groups = self.ranks.shard.groups
        for layer in range(LAYERS):
            h = _rms(x, w[f"{layer}.norm1"])
            if layer in cache.linear:
                outs = self._linear(layer, h, cache.state[cache.linear.index(layer)][slot])
                if on_layer is not None:
                    on_layer(layer)
                x = self._mix(x, layer, outs)
                continue
            new_k = torch.stack([_rope((h @ w[f"{layer}.k"][g])[:, None], positions)[:, 0] for g in groups], 1)
            new_v = torch.stack([h @ w[f"{layer}.v"][g] for g in groups], 1)
            cache.write(layer, pages, start, new_k, new_v)
            if on_layer is not None:
                on_layer(layer)
            keys, values = cache.read(layer, pages, end)
            outs = []
            for i, g in enumerate(groups):
                q = _rope((h @ w[f"{layer}.q"][g]).view(-1, GROUP, HEAD_DIM), positions)  # (t, GROUP, d)
                scores = torch.einsum("tgd,sd->gts", q, keys[:, i]) / math.sqrt(HEAD_DIM)
                mask = torch.arange(end)[None, :] > positions[:, None]
                scores = scores.masked_fill(mask[None], float("-inf"))
                attn = torch.einsum("gts,sd->tgd", scores.softmax(-1), values[:, i]).reshape(-1, GROUP * HEAD_DIM)
                outs.append(attn @ w[f"{layer}.o"][g])
            x = self._mix(x, layer, outs)
        return (_rms(x[-1:], w["norm"]) @ w["out"])[0]

    def _mix(self, x: torch.Tensor, layer: int, outs: list[torch.Tensor]) -> torch.Tensor:
        """Sum the groups' projected outputs in group order (every rank, every split), then the MLP."""
        w = self.w
        projected = self.ranks.all_gather(torch.stack(outs))  # (KV_HEADS, t, DIM), group order
        total = projected[0]
        for g in range(1, KV_HEADS):
            total = total + projected[g]
        x = x + total
        h = _rms(x, w[f"{layer}.norm2"])
        gate, up = (h @ w[f"{layer}.up"]).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ w[f"{layer}.down"]

    def _linear(self, layer: int, h: torch.Tensor, state: torch.Tensor) -> list[torch.Tensor]:
        """Linear attention of this rank's groups, token by token from ``state`` (updated in place):
        ``S += phi(k) v^T``, ``z += phi(k)``, ``out = phi(q) S / (phi(q) . z)``."""
        w = self.w
        outs = []
        for i, g in enumerate(self.ranks.shard.groups):
            k = torch.nn.functional.elu(h @ w[f"{layer}.k"][g]) + 1  # (t, d)
            v = h @ w[f"{layer}.v"][g]
            q = torch.nn.functional.elu((h @ w[f"{layer}.q"][g]).view(-1, GROUP, HEAD_DIM)) + 1  # (t, GROUP, d)
            s, z = state[i, :, :HEAD_DIM].clone(), state[i, :, HEAD_DIM].clone()
            rows = []
            for t in range(h.shape[0]):
                s = s + k[t][:, None] * v[t][None, :]
                z = z + k[t]
                rows.append(((q[t] @ s) / (q[t] @ z)[:, None]).reshape(-1))
            state[i, :, :HEAD_DIM] = s
            state[i, :, HEAD_DIM] = z
            outs.append(torch.stack(rows) @ w[f"{layer}.o"][g])
        return outs

    def prefill(self, prompt: Sequence[int], cache: PagedCache, pages: Sequence[int], *, chunk: int,
                start: int = 0, slot: int = 0) -> tuple[int, list[int]]:
        """Chunked prefill of ``prompt[start:]`` (tokens before ``start`` are cached already);
        returns the first generated token and the chunk end positions."""
        ends = []
        logits = None
        for begin in range(start, len(prompt), chunk):
            stop = min(len(prompt), begin + chunk)
            logits = self.forward(prompt[begin:stop], begin, cache, pages, slot=slot)
            ends.append(stop)
        assert logits is not None, "nothing to prefill"
        return int(logits.argmax()), ends

    def decode(self, first: int, length: int, cache: PagedCache, pages: Sequence[int], max_new: int,
               slot: int = 0) -> list[int]:
        """Greedy tokens after the prompt: ``first`` (from prefill), then ``max_new - 1`` more."""
        out = [first]
        while len(out) < max_new:
            position = length + len(out) - 1
            logits = self.forward([out[-1]], position, cache, pages, slot=slot)
            out.append(int(logits.argmax()))
        return out


def generate(prompt: Sequence[int], max_new: int, *, chunk: int = 64, block: int = 16,
             hybrid: bool = False) -> list[int]:
    """Monolithic greedy generation in one process (TP 1): the reference tokens."""
    torch.set_num_threads(1)
    model = Model(Ranks(Shard()))
    cache = PagedCache(Shard(), blocks=-(-(len(prompt) + max_new) // block) + 1, block=block, hybrid=hybrid,
                       slots=1)
    pages = cache.take(cache.pages_for(len(prompt) + max_new))
    first, _ = model.prefill(prompt, cache, pages, chunk=chunk)
    return model.decode(first, len(prompt), cache, pages, max_new)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_text(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")
