"""The engine of ``longspec serve`` and the calls its worker makes on it.

:class:`EngineCalls` is every state-changing call the server's worker makes on its engine, made
between rounds (never from a streamer inside one) with plain arguments: rows, prompts and
settings, not the worker's own objects. Under tensor parallelism
(:class:`~longspec.parallel.mirror.Driver`) every rank holds an ``EngineCalls`` and rank 0's
calls are repeated on the others in the same order, so their engines stay the same; each call
returns the tokens it emitted, which the ranks compare."""
from __future__ import annotations

from typing import Optional

import torch

from ..engine.engine import Engine
from ..spec.sampling import RowSampling
from ..spec.tree import TreeSpec


def build_engine(target, proposer=None, tree=None, max_batch: int = 8, max_len: int = 4096, buckets=None,
                 bucket_trees=None, prefill_chunk: Optional[int] = None, prefix_cache: bool = True,
                 pool_tokens: Optional[int] = None) -> Engine:
    """A serving engine: ``max_batch`` rows of ``max_len`` slots with per-request sampling (see
    :func:`~longspec.serving.server.build_server`); with compiled steps its proposals are compiled too (a
    server lives long enough to repay the compilation). Raises ValueError for a ``max_len`` beyond
    the model's positions."""
    positions = target.config.max_position_embeddings
    if max_len > positions:
        raise ValueError(f"--max-len {max_len} exceeds the model's {positions} positions (max_position_embeddings)")
    tree = TreeSpec.coerce(tree) if proposer is not None else None
    sampling = RowSampling.zeros(max_batch, target.device)
    return Engine(target, proposer, tree, max_batch=max_batch, max_len=max_len, config=sampling, buckets=buckets,
                  bucket_trees=bucket_trees, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                  pool_tokens=pool_tokens, compile_proposals=True)


class EngineCalls:
    """The calls a server's worker makes on ``engine`` (see the module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def add(self, seqs: list, streamer=None) -> list:
        """Prefills ``seqs`` (``Engine.add``; a sequence with a ``seed`` draws from its own
        generator in the row it takes). Returns [(row, tokens)] of the sequences."""
        self.engine.add(seqs, streamer=streamer)
        return [(s.row, s.tokens) for s in seqs]

    def step(self, streamer=None) -> list:
        """One round (``Engine.step``). Returns [(row, its new tokens)]."""
        seqs = [s for s in self.engine.rows if s is not None]
        before = [len(s.tokens) for s in seqs]
        self.engine.step(streamer=streamer)
        return [(s.row, s.tokens[n:]) for s, n in zip(seqs, before)]

    def cancel(self, row: int) -> None:
        """Ends the sequence in ``row`` now (``Engine.cancel``: its row, blocks and generator go)."""
        self.engine.cancel(self.engine.rows[row])

    def warm_up(self, sampled: bool = False, trees: Optional[list] = None) -> None:
        """``Engine.warm_up`` (the seconds it took differ between ranks: not returned)."""
        self.engine.warm_up(sampled, trees)

    def seed_shared(self, seed: int) -> None:
        """The rows without their own generator draw from one seeded with ``seed`` (the same on
        every rank of a tensor-parallel group: their samples agree)."""
        self.engine.uniforms.generator = torch.Generator(device=self.engine.target.device).manual_seed(seed)
