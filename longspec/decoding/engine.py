"""The generation loop: prefill, then autoregressive decoding (no proposer) or speculative
rounds (propose a tree -> verify it in one target forward -> commit the accepted K/V)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import GenerationConfig
from ..models.target import TargetModel
from .sampling import sample, warp_probs
from .tree import TreeSpec
from .verify import verify_tree

DEFAULT_TREE = "4,16,16,16,16"

Prompts = Union[Sequence[int], Sequence[Sequence[int]]]
Streamer = Callable[[int, list], None]  # (row, new token ids) -> None


@dataclass
class GenerationOutput:
    sequences: list  # one list of generated token ids (new tokens only) per prompt
    stats: dict = field(default_factory=dict)


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
    ``max_position_embeddings``."""

    def __init__(self, target: TargetModel, proposer=None, tree=None, max_len: Optional[int] = None):
        if proposer is None and tree is not None:
            raise ValueError("a tree shape needs a proposer (Generator(target, proposer=..., tree=...))")
        if proposer is not None:
            tree = TreeSpec.parse(tree or DEFAULT_TREE) if not isinstance(tree, TreeSpec) else tree
            tree.validate(target.config.vocab_size)
        self.target, self.proposer, self.tree = target, proposer, tree
        self.max_len = max_len or target.config.max_position_embeddings

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
        room = self.proposer_room()
        need = longest + config.max_new_tokens + room
        if need > self.max_len:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {config.max_new_tokens}"
                + (f" + {room} tree slots" if room else "")
                + f" = {need} exceeds the maximum length {self.max_len} (the model's context; "
                "shorten the prompt or pass Generator(max_len=...))")
        device = self.target.device
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts])
        return prompts, ids.to(device), lens.to(device), need

    def proposer_room(self) -> int:
        """Extra cache slots a speculative round may write beyond the committed tokens."""
        return 0 if self.proposer is None else int(self.tree.num_nodes)

    def _next_token(self, logits: torch.Tensor, config: GenerationConfig, rng) -> torch.Tensor:
        if config.greedy:
            return logits.argmax(-1)
        return sample(warp_probs(logits, config.temperature, config.top_k, config.top_p), rng)

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
        prompts, ids, lens, need = self._prepare(prompts, config)
        device = self.target.device
        rng = None
        if config.seed is not None:
            rng = torch.Generator(device=device).manual_seed(config.seed)
        clock = _Clock(device)
        t0 = clock()
        cache = self.target.new_cache(len(lens), need)
        logits = self.target.prefill(ids, lens, cache)
        run = _Run(len(lens), config, config.eos_ids(self.target.config), streamer)
        root = self._next_token(logits, config, rng)
        first = [[t] for t in root.tolist()]
        run.emit(first)
        t_prefill = clock()
        if self.proposer is None:
            self._autoregressive(root, cache, run, rng)
        else:
            self.proposer.begin(self.target, cache, prompts, self.tree, config, rng)
            self.proposer.accepted(first)  # the prefill's token
            self._speculative(root, cache, run, rng, clock)
        t_end = clock()
        n_new = sum(map(len, run.out))
        decoded = n_new - len(run.out)  # the first token of each row comes from the prefill
        run.stats.update(prompt_tokens=int(lens.sum()), new_tokens=n_new, prefill_s=t_prefill - t0,
                         decode_s=t_end - t_prefill, wall_s=t_end - t0,
                         tokens_per_s=decoded / max(t_end - t_prefill, 1e-9))
        return GenerationOutput(run.out, run.stats)

    def _autoregressive(self, token, cache, run, rng):
        steps = 0
        while True:
            token = run.drop_finished(token, cache, None)
            if token is None:
                break
            logits = self.target.decode(token, cache)
            token = self._next_token(logits, run.config, rng)
            run.emit([[t] for t in token.tolist()])
            steps += 1
        run.stats["steps"] = steps

    def _speculative(self, root, cache, run, rng, clock):
        config, proposer, depth = run.config, self.proposer, self.tree.depth
        hist = [0] * (depth + 1)
        steps, times = 0, {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}
        while True:
            t0 = clock()
            root = run.drop_finished(root, cache, proposer)
            if root is None:
                break
            tree = proposer.propose(root)
            t1 = clock()
            positions = cache.lengths[:, None] + tree.depths
            logits = self.target.verify(tree.tokens, positions, tree.mask, cache)
            result = verify_tree(tree, logits, config.temperature, config.top_k, config.top_p, rng)
            cache.commit(result.accepted_nodes.clamp(min=0), result.num_accepted + 1)
            t2 = clock()
            emitted, counts = result.emitted()
            rows = [row[:n] for row, n in zip(emitted.tolist(), counts.tolist())]
            for n in counts.tolist():
                hist[n - 1] += 1
            proposer.accepted(rows)
            run.emit(rows)
            root = result.bonus_token
            steps += 1
            t3 = clock()
            times["draft_s"] += t1 - t0
            times["verify_s"] += t2 - t1
            times["other_s"] += t3 - t2
        rounds = sum(hist)
        run.stats.update(steps=steps, tau=sum((n + 1) * c for n, c in enumerate(hist)) / max(rounds, 1),
                         accepted_hist=hist, **times)


class _Run:
    """Book-keeping of one generate call: outputs per original row, EOS / length stopping, the
    map from batch rows to original rows, streaming."""

    def __init__(self, batch: int, config: GenerationConfig, eos_ids: list, streamer):
        self.config, self.eos, self.streamer = config, set(eos_ids), streamer
        self.out = [[] for _ in range(batch)]
        self.rows = list(range(batch))  # original row of each active batch row
        self.done = [False] * batch
        self.stats: dict = {}

    def emit(self, tokens: list) -> None:
        """tokens: per active batch row, the new tokens in order."""
        for batch_row, new in enumerate(tokens):
            row = self.rows[batch_row]
            if self.done[row]:
                continue
            kept = []
            for t in new:
                kept.append(t)
                if t in self.eos or len(self.out[row]) + len(kept) >= self.config.max_new_tokens:
                    self.done[row] = True
                    break
            self.out[row].extend(kept)
            if self.streamer is not None and kept:
                self.streamer(row, kept)

    def drop_finished(self, token, cache, proposer):
        """Removes finished rows from the batch; returns the next input tokens of the rest, or
        None when all are done."""
        keep = [i for i, row in enumerate(self.rows) if not self.done[row]]
        if not keep:
            return None
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=token.device)
            cache.select_rows(index)
            if proposer is not None:
                proposer.select_rows(index)
            token = token[index]
            self.rows = [self.rows[i] for i in keep]
        return token
