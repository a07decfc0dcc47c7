"""What ``--proposer auto``'s calls learned of the cost model's predictions of tokens per round
(:mod:`~longspec.decoding.controller`): per candidate and sampling settings, the extra tokens a
round made (beyond the one a plain round emits) against the extra tokens predicted, as sums over
rounds that decay call by call, kept across a process's calls and, with a store, in a JSON file
for the next process (the next ``longspec generate``)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from ..models.checkpoint import write_atomic

LEARNED_DECAY = 0.5  # weight of earlier calls' measurements against a call's, in the correction of the next
MAX_CORRECTION = 8.0  # the most a correction scales a prediction's extra tokens by (ones predicted near zero) ...
MIN_CORRECTION = 0.2  # ... and the least (a candidate predicted to pay much on a prompt gets a few rounds again)
SAVE_EVERY_S = 10.0  # a store is written after a call at most this often
# extra tokens, as predicted, that every correction starts from: a few rounds of one call weigh
# little (on a CPU four rounds of a chain on a text it missed, with no prior, held it out of the
# next calls' copying prompts: the probe that would test it costs too much on a CPU)
PRIOR_EXTRA = 8.0
PROBE_CALLS = 2  # a correction measured in fewer calls than this is uncertain: its candidate may be probed


def kind_of(name: str) -> str:
    """A candidate's kind, by its label: "plain" (rounds), "chain" (the lookup's chain alone), else
    "tree" (the draft's)."""
    return "plain" if name == "plain" else "chain" if name.startswith("chain") else "tree"


def learned_as(name: str) -> str:
    """Under which name candidate ``name``'s correction is learned: a tree's own label; "chain"
    for every lookup chain (one lookup on one text, whatever the chain's length, which a CPU's
    step costs pick per machine: what one length learned holds for the next)."""
    return "chain" if kind_of(name) == "chain" else name


class Corrections:
    """{(label, sampling key): (extra tokens measured, extra tokens predicted)} and the number of
    calls that measured each; ``store``: the JSON file that keeps them under ``key`` (the model
    and draft), other keys' entries left as they are."""

    def __init__(self, store: Optional[str] = None, key: str = ""):
        self.pairs: dict = {}
        self.calls: dict = {}
        self.store, self.key, self.saved_at = store, key, None
        stored = self._stored().get(key)
        for text, entry in stored.items() if isinstance(stored, dict) else ():
            try:
                name, sampling = json.loads(text)
                measured, predicted, *calls = map(float, entry)
            except (ValueError, TypeError):
                continue  # (an entry this version cannot read: learned again)
            learned = learned_as(name), tuple(sampling) if isinstance(sampling, list) else sampling
            old_measured, old_predicted = self.pairs.get(learned, (0.0, 0.0))  # (older files: a key per chain)
            self.pairs[learned] = (old_measured + measured, old_predicted + predicted)
            self.calls[learned] = self.calls.get(learned, 0) + (int(calls[0]) if calls else PROBE_CALLS)

    def of(self, name: str, sampling) -> float:
        """How much of the cost model's extra tokens per round candidate ``name`` made in earlier
        calls at ``sampling`` (1: none measured; none of its own: those of its kind, pooled, the
        draft's trees or the lookup's chains), within [MIN_CORRECTION, MAX_CORRECTION]: the
        prediction reads the prompt, the correction what the cost model misses (a sampled call's
        lower acceptance; a model continuing code repeats its prompt far more than the prompt
        repeats itself), the sums each started from :data:`PRIOR_EXTRA` as predicted."""
        name = learned_as(name)
        measured, predicted = self.pairs.get((name, sampling), (0.0, 0.0))
        if predicted <= 0.0:
            pairs = [(m, p) for (other, s), (m, p) in self.pairs.items()
                     if s == sampling and kind_of(other) == kind_of(name) and p > 0.0]
            measured, predicted = sum(m for m, _ in pairs), sum(p for _, p in pairs)
        if predicted <= 0.0:
            return 1.0
        measured, predicted = measured + PRIOR_EXTRA, predicted + PRIOR_EXTRA
        return min(max(measured / predicted, MIN_CORRECTION), MAX_CORRECTION)

    def certain(self, name: str, sampling) -> bool:
        """Whether ``name``'s correction at ``sampling`` was measured in PROBE_CALLS calls or more."""
        return self.calls.get((learned_as(name), sampling), 0) >= PROBE_CALLS

    def fold(self, name: str, sampling, measured: float, predicted: float) -> None:
        """A call's extra tokens ``measured`` against ``predicted`` (sums over its rounds of
        ``name``), added to the earlier calls' decayed by LEARNED_DECAY."""
        name = learned_as(name)
        old_measured, old_predicted = self.pairs.get((name, sampling), (0.0, 0.0))
        self.pairs[name, sampling] = (LEARNED_DECAY * old_measured + measured,
                                      LEARNED_DECAY * old_predicted + predicted)
        self.calls[name, sampling] = self.calls.get((name, sampling), 0) + 1

    def keep(self) -> None:
        """After a call: writes the store where there is one, at most every SAVE_EVERY_S (a
        read-only home: what was learned serves this process only)."""
        if self.store is not None and (self.saved_at is None or time.monotonic() - self.saved_at > SAVE_EVERY_S):
            try:
                self.save()
            except OSError:
                self.saved_at = time.monotonic()

    def _stored(self) -> dict:
        try:
            data = json.loads(Path(self.store).read_text()) if self.store is not None else {}
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: learn again

    def save(self) -> None:
        """Writes the corrections to the store (other keys' kept)."""
        data = self._stored()
        data[self.key] = {json.dumps([name, sampling]): [*pair, self.calls.get((name, sampling), PROBE_CALLS)]
                          for (name, sampling), pair in self.pairs.items()}
        path = Path(self.store)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True)))
        self.saved_at = time.monotonic()
