"""Per-request state and the arithmetic of cache room: what an :class:`~longspec.engine.engine.Engine`
keeps for each sequence it decodes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq, Union

import numpy as np

from ..spec.tree import TreeSpec

Prompts = Union[Seq[int], Seq[Seq[int]]]
Streamer = Callable[[int, list], None]  # (row, new token ids) -> None


@dataclass
class GenerationOutput:
    sequences: list  # one list of generated token ids (new tokens only) per prompt
    stats: dict = field(default_factory=dict)


@dataclass
class Sequence:
    """One request: its prompt, stopping rule and what it generated so far."""

    prompt: list
    max_new_tokens: int
    eos: frozenset = frozenset()
    tokens: list = field(default_factory=list)
    done: bool = False
    row: int = -1
    accepted_hist: list = field(default_factory=list)  # rounds by number of accepted draft tokens
    temperature: float = 0.0  # this sequence's sampling, used by engines with per-row settings
    top_k: int = 0
    top_p: float = 1.0
    cached_tokens: int = 0  # prompt tokens read from a prefix cache instead of prefilled
    cache_namespace: object = None  # shares cached blocks only with sequences of the same (a tenant)
    plain_rounds: bool = False  # holds room for plain rounds only: its engine drafts no tree while it is active
    seed: Optional[int] = None  # its row draws from its own generator: its text does not depend on its neighbours
    _prompt_ids: Optional[np.ndarray] = field(default=None, init=False, repr=False, compare=False)

    def text(self, generated: int) -> np.ndarray:
        """The prompt and the first ``generated`` new tokens, int64 [len(prompt) + generated]: what
        the prefill and a proposer taking the row in read (the prompt converted once, not at
        every switch of tree)."""
        if self._prompt_ids is None:
            self._prompt_ids = np.asarray(self.prompt, dtype=np.int64).reshape(-1)
        return np.concatenate([self._prompt_ids, np.asarray(self.tokens[:generated], dtype=np.int64)])

    @property
    def tau(self) -> float:
        """Tokens per round: accepted draft tokens + 1, averaged over this sequence's rounds."""
        rounds = sum(self.accepted_hist)
        return sum((n + 1) * c for n, c in enumerate(self.accepted_hist)) / rounds if rounds else 1.0

    def extend(self, new: list) -> list:
        """Appends ``new`` up to the first EOS or the token budget; returns what was kept."""
        kept = []
        for t in new:
            kept.append(t)
            if t in self.eos or len(self.tokens) + len(kept) >= self.max_new_tokens:
                self.done = True
                break
        self.tokens.extend(kept)
        return kept


def round_slots(tree: Optional[TreeSpec]) -> int:
    """Cache slots one round writes: the decode token (no tree), or every tree node."""
    return 1 if tree is None else tree.num_nodes


def cache_need(prompt_len: int, max_new_tokens: int, round_slots: int) -> int:
    """Cache slots a sequence can use: its prompt, and while it still needs tokens, the committed
    ones plus what one round writes (``round_slots``: 1 for a decode step, the tree's nodes for
    a speculative round). The last token is emitted, never written; ``max_new_tokens = 1`` needs
    no round at all."""
    if max_new_tokens <= 1:
        return prompt_len
    return prompt_len + max_new_tokens - 2 + round_slots
