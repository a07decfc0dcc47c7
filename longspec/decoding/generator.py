"""The public generation API: :class:`Generator`, a thin loop over an
:class:`~longspec.decoding.engine.Engine` (prefill, rounds until every row is done, statistics)."""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..config import GenerationConfig
from ..models.target import TargetModel
from .engine import Engine, owner_of
from .sequence import DEFAULT_TREE, GenerationOutput, Prompts, Sequence, Streamer, cache_need, round_slots
from .tree import TreeSpec


class _Clock:
    """Wall-clock timer that waits for the device first, so GPU time is counted."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Generator:
    """Generates with a target model, autoregressively when ``proposer`` is None, else
    speculatively with ``proposer`` drafting trees of shape ``tree`` (a :class:`TreeSpec` or its
    string form; default the paper's beam tree ``4,16,16,16,16``).

    ``max_len`` caps the KV cache (prompt + new tokens + tree); it defaults to the target's
    ``max_position_embeddings``. ``cuda_graphs``: see :class:`Engine`. ``retune``: a
    :class:`~longspec.decoding.auto.Retuner` (``--proposer auto`` on a CPU): a lone prompt starts
    with its ``start`` tree and switches trees as it says while generating (``tree`` is then the
    biggest it may pick). The last engine is kept
    and reused by a call with the same batch size, cache size and sampling settings (its CUDA
    graphs too)."""

    def __init__(self, target: TargetModel, proposer=None, tree=None, max_len: Optional[int] = None,
                 cuda_graphs: Optional[bool] = None, retune=None):
        if proposer is None and tree is not None:
            raise ValueError("a tree shape needs a proposer (Generator(target, proposer=..., tree=...))")
        if proposer is not None:
            tree = TreeSpec.coerce(DEFAULT_TREE if tree is None else tree)
            tree.validate(target.config.vocab_size)
        self.target, self.proposer, self.tree, self.retune = target, proposer, tree, retune
        self.max_len = max_len or target.config.max_position_embeddings
        self.cuda_graphs = cuda_graphs
        self._engine: Optional[Engine] = None
        self._engine_key = None

    def _prepare(self, prompts: Prompts, config: GenerationConfig):
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        if isinstance(prompts[0], int) or (torch.is_tensor(prompts) and prompts.dim() == 1):
            prompts = [prompts]
        prompts = [list(map(int, p)) for p in prompts]
        vocab = self.target.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (size {vocab})")
        longest = max(map(len, prompts))
        need = cache_need(longest, config.max_new_tokens, round_slots(self.tree))
        if need > self.max_len:
            tree = f" and {round_slots(self.tree)} tree slots" if self.proposer is not None else ""
            raise ValueError(
                f"prompt of {longest} tokens with max_new_tokens {config.max_new_tokens}{tree} needs {need} "
                f"positions, over the maximum length {self.max_len} (the model's context; shorten the prompt, "
                "lower max_new_tokens, use a smaller tree, or pass Generator(max_len=...))")
        return prompts, need

    def engine(self, batch: int, need: int, config: GenerationConfig) -> Engine:
        """An engine for ``batch`` rows of ``need`` slots (the kept one when it fits exactly)."""
        sampling = (config.temperature, config.top_k, config.top_p)
        key = (batch, need, sampling)
        taken = self.proposer is not None and owner_of(self.proposer) is not self._engine
        if self._engine is None or self._engine_key != key or taken:  # (taken: begun by another engine)
            if self._engine is not None:  # free the old caches first
                self._engine.close()
            self._engine = None
            # one bucket: rows that finish early stay in the batch (no second capture / compile)
            self._engine = Engine(self.target, self.proposer, self.tree, batch, need, config, self.cuda_graphs,
                                  buckets=[batch])
            self._engine_key = key
        engine = self._engine
        engine.config = config
        if config.seed is not None:
            engine.uniforms.generator = torch.Generator(device=self.target.device).manual_seed(config.seed)
        return engine

    @torch.inference_mode()
    def generate(self, prompts: Prompts, config: Optional[GenerationConfig] = None,
                 streamer: Optional[Streamer] = None) -> GenerationOutput:
        """Generates up to ``config.max_new_tokens`` tokens after each prompt (a list of token ids
        or a list of such lists; rows may differ in length). A row stops at its first EOS token,
        which is included in its output. ``streamer(row, tokens)`` is called as tokens appear.

        With a proposer, each round drafts a tree, verifies it in one target forward and commits
        the accepted tokens' K/V; the output is the target's own (greedy: token for token;
        sampling: the same distribution). Finished rows leave the batch."""
        config = config or GenerationConfig()
        prompts, need = self._prepare(prompts, config)
        engine = self.engine(len(prompts), max(need, round_slots(self.tree)), config)
        eos = frozenset(config.eos_ids(self.target.config))
        seqs = [Sequence(p, config.max_new_tokens, eos) for p in prompts]
        clock = _Clock(self.target.device)
        times_before = engine.phase_times()
        trees, retune = [], self.retune
        if retune is not None:  # the start tree for every batch; switches follow one prompt only
            engine.use_tree(retune.start)
            trees, check = [(0, str(retune.start))], retune.first
            retune = retune if len(seqs) == 1 else None
        t0 = clock()
        engine.add(seqs, streamer)
        t_prefill = clock()
        rounds = 0
        while engine.has_active:
            engine.step(streamer)
            rounds += 1
            if retune is not None and len(seqs[0].tokens) >= check and engine.has_active:
                tree = retune(seqs[0].prompt + seqs[0].tokens, len(seqs[0].prompt))
                if str(tree) != trees[-1][1]:
                    engine.use_tree(tree)
                    trees.append((len(seqs[0].tokens), str(tree)))
                check *= 2
        t_end = clock()
        n_new = sum(len(s.tokens) for s in seqs)
        decoded = n_new - len(seqs)  # the first token of each row comes from the prefill
        stats = dict(prompt_tokens=sum(map(len, prompts)), new_tokens=n_new, prefill_s=t_prefill - t0,
                     decode_s=t_end - t_prefill, wall_s=t_end - t0, steps=rounds,
                     tokens_per_s=decoded / max(t_end - t_prefill, 1e-9),
                     capture_s=sum(r.capture_s for r in engine.all_runners),
                     cuda_graphs=any(r.graphs is not None for r in engine.all_runners))
        if trees:
            stats["trees"] = trees  # (tokens generated, tree from then on: "None" = plain rounds)
        phase_s = [a - b for a, b in zip(engine.phase_times(), times_before)]
        if self.proposer is not None:
            hist = [0] * (self.tree.depth + 1)
            for s in seqs:
                for n, c in enumerate(s.accepted_hist):
                    hist[n] += c
            n_rounds = sum(hist)
            stats.update(tau=sum((n + 1) * c for n, c in enumerate(hist)) / max(n_rounds, 1), accepted_hist=hist,
                         draft_s=phase_s[0], verify_s=phase_s[1],
                         other_s=max(t_end - t_prefill - phase_s[0] - phase_s[1], 0.0))
        return GenerationOutput([s.tokens for s in seqs], stats)
