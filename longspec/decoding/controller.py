"""``--proposer auto`` while it generates: an online choice, after every round, among the rounds
one engine can run (plain rounds, prompt lookup's chain alone, the hybrid's trees), by measured
tokens per second. A policy above the engine: it chooses, the engine runs what it is told
(:meth:`~longspec.decoding.engine.Engine.use_tree`).

* **Round times** are measured on every round (wall clock: drafting, verifying, the host's work)
  and kept across calls as an exponential average per candidate: they depend on the model, the
  device and the context, not on the text. Until a candidate has run, the cost model's
  prediction stands in (:mod:`~longspec.decoding.auto`), scaled by how the measured rounds of
  the others compare with their predictions (the cost model times uncompiled steps without the
  host's work).
* **Tokens per round** are estimated per call: the cost model's prediction for this prompt,
  worth :data:`PRIOR_ROUNDS` rounds, then the call's own rounds. What earlier calls measured at
  the same sampling settings replaces the prediction for sampled calls (the cost model knows
  greedy acceptance only) and is averaged with it for greedy ones (where the text decides).
* **The choice**: the candidate with the most expected tokens per second, where it beats the one
  running by :data:`SWITCH_MARGIN`. Plain decoding (one token a round, its time measured) is
  always a candidate, so rounds that do not pay lose their place within a few rounds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .tree import TreeSpec

PRIOR_ROUNDS = 3.0  # rounds the prediction of tokens per round is worth against measured ones
SETTLED_ROUNDS = 3  # a candidate measured fewer rounds than this is not predicted slower than the cost model says
OUTLIER = 1.5  # a round measured this much slower than the estimate counts as this much (a hiccup of the host)
SWITCH_MARGIN = 1.03  # a candidate takes over when it is predicted this much faster (with DWELL: no flapping)
DWELL = 4  # rounds a candidate runs before another may take over (each switch costs host work) ...
CLEAR_MARGIN = 1.3  # ... unless that one is predicted this much faster (long rounds, e.g. a CPU's: leave at once)
TIME_DECAY = 0.7  # weight of the earlier estimate of a round's time against a newly measured round
LEARNED_DECAY = 0.5  # weight of earlier calls' tokens per round against this call's, in the prior of the next


def label(tree: Optional[TreeSpec]) -> str:
    return "plain" if tree is None else str(tree)


def sampled(sampling) -> bool:
    """Whether a call's sampling key (temperature first, or "greedy") samples."""
    return isinstance(sampling, tuple) and sampling[0] > 0


@dataclass
class Candidate:
    """One kind of round: ``tree`` (None: plain rounds), its round time ``ms`` (estimated), the
    tokens per round predicted for this call (``prior``) and the rounds it ran in it."""

    tree: Optional[TreeSpec]
    ms: float
    prior: float
    tokens: float = 0.0
    rounds: int = 0
    predicted_ms: float = 0.0  # the cost model's

    @property
    def tokens_per_round(self) -> float:
        return (PRIOR_ROUNDS * self.prior + self.tokens) / (PRIOR_ROUNDS + self.rounds)

    @property
    def rate(self) -> float:
        """Expected tokens per millisecond."""
        return self.tokens_per_round / max(self.ms, 1e-6)


class Controller:
    """The choice of rounds for the calls of one engine (see the module docstring). Per call:
    :meth:`begin` with the cost model's predictions, then :meth:`observe` after every round (it
    returns the tree to run next), then :meth:`end`."""

    def __init__(self):
        self.ms: dict = {}  # label -> round time (ms), across calls
        self.rounds: dict = {}  # label -> rounds measured, across calls
        self.learned: dict = {}  # (label, sampling key) -> tokens per round measured by earlier calls
        self.candidates: dict = {}
        self.current: Optional[Candidate] = None
        self.dwell = 0  # rounds the current candidate has run since it took over
        self.sampling = None
        self.captured_kinds: set = set()  # kinds of round (greedy, truncating) whose every candidate is captured

    def begin(self, predicted: dict, sampling=None) -> Optional[TreeSpec]:
        """``predicted``: {tree or None: (tokens per round, round ms)} from the cost model;
        ``sampling``: what acceptance depends on (e.g. (temperature, top_k, top_p)), the key of
        what earlier calls measured. Returns the tree of the call's first rounds."""
        if not predicted:
            raise ValueError("the controller starts from the cost model's predictions ({tree: (tokens, ms)}); "
                             "Generator(proposer='auto') gives them")
        self.sampling, self.candidates = sampling, {}
        for tree, (tokens, ms) in predicted.items():
            name = label(tree)
            learned = self.learned.get((name, sampling))
            prior = (1.0 if tree is None else tokens if learned is None else learned if sampled(sampling)
                     else (tokens + learned) / 2)
            self.candidates[name] = Candidate(tree, self.ms.get(name, ms), prior, predicted_ms=ms)
        self._calibrate()
        self.current, self.dwell = self._best(), 0
        return self.current.tree

    def repredict(self, tokens: dict) -> None:
        """New predictions of tokens per round ({tree: tokens}; e.g. from the lookup's hit rate on
        the text generated so far), for candidates that have not run in this call."""
        for tree, value in tokens.items():
            c = self.candidates.get(label(tree))
            if c is not None and c.rounds == 0 and tree is not None:
                c.prior = value

    def observe(self, tokens: float, seconds: float) -> Optional[TreeSpec]:
        """The round just run emitted ``tokens`` per row in ``seconds``: returns the tree for the
        next rounds (the current one, or the candidate that now looks faster)."""
        c, name = self.current, label(self.current.tree)
        ms = min(1e3 * seconds, OUTLIER * c.ms)
        c.ms = ms if name not in self.ms else TIME_DECAY * c.ms + (1 - TIME_DECAY) * ms
        self.ms[name] = c.ms
        self.rounds[name] = self.rounds.get(name, 0) + 1
        c.tokens += tokens
        c.rounds += 1
        self.dwell += 1
        self._calibrate()
        best = self._best()
        if best is not c and (best.rate > CLEAR_MARGIN * c.rate or best.rate > SWITCH_MARGIN * c.rate
                              and self.dwell >= DWELL):
            self.current, self.dwell = best, 0
        return self.current.tree

    def end(self) -> None:
        """Folds this call's measured tokens per round into the predictions of later calls."""
        for name, c in self.candidates.items():
            if c.rounds and c.tree is not None:
                key, measured = (name, self.sampling), c.tokens / c.rounds
                old = self.learned.get(key)
                self.learned[key] = measured if old is None else LEARNED_DECAY * old + (1 - LEARNED_DECAY) * measured

    def summary(self) -> str:
        """What each candidate measured in this call (for a call's stats)."""
        return "; ".join(f"{name}: {c.rounds} rounds, {c.tokens_per_round:.2f} tokens in {c.ms:.2f} ms"
                         for name, c in self.candidates.items())

    def _calibrate(self) -> None:
        """Candidates never measured on this engine: their predicted time, scaled by the measured
        over the predicted time of those that were (their median ratio); candidates measured in
        fewer than :data:`SETTLED_ROUNDS` rounds: no slower than that (one slow round must not
        keep a candidate out for good: nothing would measure it again)."""
        ratios = sorted(self.ms[name] / c.predicted_ms for name, c in self.candidates.items()
                        if self.rounds.get(name, 0) >= SETTLED_ROUNDS and c.predicted_ms > 0)
        scale = ratios[len(ratios) // 2] if ratios else 1.0
        for name, c in self.candidates.items():
            if name not in self.ms:
                c.ms = scale * c.predicted_ms
            elif self.rounds[name] < SETTLED_ROUNDS:
                c.ms = min(self.ms[name], scale * c.predicted_ms)

    def _best(self) -> Candidate:
        return max(self.candidates.values(), key=lambda c: c.rate)
