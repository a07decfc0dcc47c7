"""The candidates :class:`~longspec.decoding.controller.Controller` weighs: one kind of round
each (plain rounds, or a tree's), with what the call expects of it, and the keys its round times
are kept under."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..spec.tree import TreeSpec

PRIOR_ROUNDS = 3.0  # rounds the prediction of tokens per round is worth against measured ones
SETTLED_ROUNDS = 3  # a candidate measured fewer rounds than this is not predicted slower than the cost model says
RETREAT_MARGIN = 1.03  # plain rounds take over when this much faster (a call must never be slower than plain decoding)
CLEAR_MARGIN = 1.3  # a candidate predicted this much faster takes over at once (long rounds, e.g. a CPU's)


def label(tree: Optional[TreeSpec]) -> str:
    return "plain" if tree is None else str(tree)


def round_kind(sampling):
    """What a round's time depends on in a call's sampling settings ((temperature, top_k, top_p);
    another key as it is): "greedy", "sampled", or "truncated" (top-k or top-p: their work on
    every node's distribution made a tree's round a third dearer)."""
    if isinstance(sampling, tuple) and len(sampling) == 3:
        temperature, top_k, top_p = sampling
        return "greedy" if not temperature else "truncated" if top_k or top_p < 1.0 else "sampled"
    return sampling


@dataclass
class Candidate:
    """One kind of round: ``tree`` (None: plain rounds), its round time ``ms`` (estimated), the
    tokens per round predicted for this call (``prior``) and the rounds it ran in it."""

    tree: Optional[TreeSpec]
    ms: float
    prior: float
    predicted: float = 1.0  # the cost model's tokens per round on the prompt (before the correction)
    tokens: float = 0.0
    rounds: int = 0
    predicted_ms: float = 0.0  # the cost model's
    base: float = 1.0  # the prior from the prediction, before this call's measured shares lower it
    hoped: float = 1.0  # tokens per round predicted without a correction below 1 (a probe's hope)
    retried: bool = False  # re-predicted from the generated text after it ran (its rounds start again)
    earlier: tuple = (0.0, 0)  # (tokens, rounds) it ran before that

    @property
    def tokens_per_round(self) -> float:
        return (PRIOR_ROUNDS * self.prior + self.tokens) / (PRIOR_ROUNDS + self.rounds)

    @property
    def rate(self) -> float:
        """Expected tokens per millisecond."""
        return self.tokens_per_round / max(self.ms, 1e-6)
