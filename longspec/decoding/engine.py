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
    """Generates with a target model, autoregressively when ``proposer`` is None.

    ``max_len`` caps the KV cache (prompt + new tokens); it defaults to the target's
    ``max_position_embeddings``."""

    def __init__(self, target: TargetModel, proposer=None, tree=None, max_len: Optional[int] = None):
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
        return ids.to(device), lens.to(device), need

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
        which is included in its output. ``streamer(row, tokens)`` is called as tokens appear."""
        config = config or GenerationConfig()
        ids, lens, need = self._prepare(prompts, config)
        device = self.target.device
        rng = None
        if config.seed is not None:
            rng = torch.Generator(device=device).manual_seed(config.seed)
        eos = torch.tensor(config.eos_ids(self.target.config), dtype=torch.long, device=device)
        clock = _Clock(device)
        t0 = clock()
        cache = self.target.new_cache(len(lens), need)
        logits = self.target.prefill(ids, lens, cache)
        t_prefill = clock()
        if self.proposer is not None:
            raise NotImplementedError("speculative decoding lands with the speculative core")
        out, stats = self._autoregressive(logits, cache, config, eos, rng, streamer)
        t_end = clock()
        n_new = sum(map(len, out))
        stats.update(prompt_tokens=int(lens.sum()), new_tokens=n_new, prefill_s=t_prefill - t0,
                     decode_s=t_end - t_prefill, wall_s=t_end - t0,
                     tokens_per_s=n_new / max(t_end - t_prefill, 1e-9))
        return GenerationOutput(out, stats)

    def _autoregressive(self, logits, cache, config, eos, rng, streamer):
        batch = logits.shape[0]
        out = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool, device=logits.device)
        steps = 0
        for step in range(config.max_new_tokens):
            token = self._next_token(logits, config, rng)
            host_tokens, host_done = token.tolist(), done.tolist()
            for row in range(batch):
                if not host_done[row]:
                    out[row].append(host_tokens[row])
                    if streamer is not None:
                        streamer(row, [host_tokens[row]])
            done |= torch.isin(token, eos)
            if step == config.max_new_tokens - 1 or bool(done.all()):
                break
            logits = self.target.decode(token, cache)
            steps += 1
        return out, {"steps": steps + 1}
