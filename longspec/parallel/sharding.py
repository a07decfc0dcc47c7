"""What each rank of a tensor-parallel target holds, and the layers that combine the shares.

Megatron's split of a Llama-family decoder over ``world`` ranks:

* attention: rank r computes query heads ``r * Hq/world ..`` and holds the KV heads they read
  (GQA: ``Hkv/world`` KV heads each; with fewer KV heads than ranks, each KV head is held by the
  ``world/Hkv`` ranks whose query heads use it); q/k/v are column shares, ``o_proj`` a row share
  followed by a sum over ranks (:class:`RowParallelLinear`);
* MLP: gate and up column shares of the intermediate size, ``down_proj`` a row share + a sum;
* vocabulary: the embedding and the LM head hold ``ceil(V/world)`` rows each (the last rank
  fewer); an embedding lookup is a sum of the shares (one rank contributes, exactly), the logits
  a gather (:class:`VocabParallelHead`).

Norms, RoPE and biases of row-parallel layers (added once, after the sum) are whole on every rank.
Each rank reads only its slices from the safetensors files (:func:`shard_slice`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from .group import TensorParallel


@dataclass(frozen=True)
class Shard:
    """Rank ``tp.rank``'s share of a model: ranges ``(start, stop)`` of query heads, KV heads,
    intermediate (MLP) columns and vocabulary rows; ``vocab_chunk``: rows per rank (the logits'
    gather pads every share to it)."""

    tp: TensorParallel
    q_heads: tuple
    kv_heads: tuple
    ffn: tuple
    vocab: tuple
    vocab_chunk: int
    head_dim: int

    @classmethod
    def of(cls, config, tp: TensorParallel) -> "Shard":
        """The share of rank ``tp.rank`` of a model of ``config`` (a ModelConfig); ValueError when
        the heads or the MLP do not divide over ``tp.world`` ranks."""
        world, rank = tp.world, tp.rank
        hq, hkv, ffn, vocab = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world} ranks")
        if hq % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs the attention heads ({hq}) to divide by {world}")
        if hkv % world and world % hkv:
            raise ValueError(f"tensor parallelism over {world} ranks needs the KV heads ({hkv}) to divide by {world}, "
                             f"or {world} by them")
        if ffn % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs intermediate_size ({ffn}) to divide by {world}")
        q = hq // world
        if hkv >= world:
            kv = (rank * hkv // world, (rank + 1) * hkv // world)
        else:  # replicated: the one KV head this rank's query heads read
            kv = (rank * q // (hq // hkv), rank * q // (hq // hkv) + 1)
        chunk = -(-vocab // world)
        return cls(tp, (rank * q, (rank + 1) * q), kv, (rank * ffn // world, (rank + 1) * ffn // world),
                   (min(rank * chunk, vocab), min((rank + 1) * chunk, vocab)), chunk, config.head_dim)

    @property
    def n_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_ffn(self) -> int:
        return self.ffn[1] - self.ffn[0]

    @property
    def n_vocab(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def rows_of(self, name: str) -> Optional[tuple]:
        """(dim, start, stop) of checkpoint tensor ``name`` (HF naming) this rank holds; None
        for a tensor every rank holds whole."""
        d = self.head_dim
        part = name.rsplit(".", 2)
        module, kind = (part[-2], part[-1]) if len(part) >= 2 else ("", name)
        if module in ("embed_tokens", "lm_head"):
            return 0, *self.vocab
        if module == "q_proj":
            return 0, self.q_heads[0] * d, self.q_heads[1] * d
        if module in ("k_proj", "v_proj"):
            return 0, self.kv_heads[0] * d, self.kv_heads[1] * d
        if module in ("gate_proj", "up_proj"):
            return 0, *self.ffn
        if module == "o_proj" and kind == "weight":
            return 1, self.q_heads[0] * d, self.q_heads[1] * d
        if module == "down_proj" and kind == "weight":
            return 1, *self.ffn
        return None


def shard_slice(shard: Shard, name: str, tensor_slice):
    """Reads rank ``shard``'s part of checkpoint tensor ``name`` from a safetensors slice
    (``safe_open(...).get_slice(key)``): only those bytes are read."""
    rows = shard.rows_of(name)
    if rows is None:
        return tensor_slice[:]
    dim, start, stop = rows
    return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]


class RowParallelLinear(nn.Linear):
    """A linear layer over a share of the input features: each rank's partial product, summed
    over the ranks, plus the (whole) bias once. ``weight`` [out, in / world]."""

    def __init__(self, in_share: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_share, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The rows ``start..stop-1`` of an embedding; a lookup sums every rank's (one rank holds each
    token, the others add zeros: exact)."""

    def __init__(self, shard: Shard, hidden: int):
        super().__init__(shard.n_vocab, hidden)
        self.tp, self.start = shard.tp, shard.vocab[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(~inside[..., None], 0))


class VocabParallelHead(nn.Linear):
    """The LM head's rows ``start..stop-1``; the output is every rank's logits gathered: [..., V]
    on every rank."""

    def __init__(self, shard: Shard, hidden: int, vocab: int):
        super().__init__(hidden, shard.n_vocab, bias=False)
        self.tp, self.chunk, self.vocab = shard.tp, shard.vocab_chunk, vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight)
        if local.shape[-1] < self.chunk:  # the last rank's short share
            local = F.pad(local, (0, self.chunk - local.shape[-1]))
        return self.tp.gather_last(local, self.vocab)
