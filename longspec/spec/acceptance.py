"""How many tokens a round of speculative decoding emits: the model behind ``--proposer auto``
(:mod:`longspec.decoding.auto`). A tree level holds the right token from the draft's top-w
(the draft's acceptance table, :func:`measure_acceptance`) or from prompt lookup's chain (its hit
rates on a text, :func:`lookup_acceptance`); :func:`expected_tokens` combines them."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .tree import TreeSpec

# the draft and the lookup hit on largely the same (easy) tokens: a level holding both is right
# this far between independent hits (0) and the better of the two alone (1); fitted on held-out
# code (docs/benchmarks.md, "The measurements behind the code's choices")
HIT_CORRELATION = 0.5
ACCEPTANCE_WIDTHS = (1, 2, 3, 4, 8, 16)


def expected_tokens(tree: TreeSpec, acceptance: Sequence[Sequence[float]] = (),
                    lookup: Sequence[float] = ()) -> float:
    """Tokens a round of ``tree`` emits on average: 1 + sum over depths of the probability that
    every level so far holds the right token. Level d holds it from the draft's top w_d
    (``acceptance`` rows: depth 1.., columns ``ACCEPTANCE_WIDTHS``, interpolated; deeper levels
    reuse the last row) or from the lookup chain (``lookup[d-1]``: its hit rate at depth d given a
    right path so far), which takes one of the level's slots when both are given; the two are
    combined with :data:`HIT_CORRELATION` (a level of one slot holds either: the better of the two
    rates is assumed); with both, the tree's lookup tail (:attr:`TreeSpec.lookup_tail`) holds the
    lookup's token alone."""
    total, alive = 1.0, 1.0
    drafted = tree.depth - (tree.lookup_tail if lookup else 0)
    for depth, width in enumerate(tree.widths):
        hit_lookup = lookup[min(depth, len(lookup) - 1)] if lookup else 0.0
        draft_width = width - 1 if lookup and width > 1 else width
        hit_draft = _at_width(acceptance[min(depth, len(acceptance) - 1)], draft_width) if acceptance else 0.0
        if depth >= drafted:
            alive *= hit_lookup
        elif width == 1 and lookup:
            alive *= max(hit_draft, hit_lookup)
        else:
            either = 1.0 - (1.0 - hit_draft) * (1.0 - hit_lookup)  # were they independent
            alive *= HIT_CORRELATION * max(hit_draft, hit_lookup) + (1.0 - HIT_CORRELATION) * either
        total += alive
    return total


def lookup_acceptance(token_ids: Sequence[int], depths: int = 10, max_ngram: int = 3, tail: int = 1024,
                      prior: Sequence[float] = (), prior_weight: float = 0.0, index: "LookupIndex" = None,
                      min_match: int = 1) -> list:
    """Prompt lookup's conditional hit rates on a text (the prompt itself): ``q[d-1]`` = how often
    the lookup predicts the next token right at chain depth d, given it was right up to d - 1. The
    prediction for position s is what followed the most recent earlier occurrence of the longest
    (up to ``max_ngram``) suffix of ``token_ids[:s]``, as :class:`PromptLookup` ranks first;
    measured over the last ``tail`` positions (a position where nothing matched is a miss); with
    ``min_match`` above 1, over those where that suffix is ``min_match`` tokens long or longer (a
    CPU's chain rounds draft only there, the others are decode steps:
    :data:`~longspec.spec.prompt_lookup.DECODE_BELOW`). With a ``prior`` (rates per depth), each
    depth's rate counts ``prior_weight`` extra positions at the prior's rate (few positions: near
    it). ``index``: a :class:`LookupIndex` of ``token_ids`` or of a prompt they continue (its
    predictions on the continuation cost little)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    found = index.last_predictions(ids, tail) if index is not None and index.max_ngram == max_ngram else None
    if found is None:
        found = [a[max(0, len(ids) - tail):] for a in lookup_predictions(ids, max_ngram, lengths=True)]
    guess, matched = found
    hit = guess == ids[len(ids) - len(guess):]
    # starts whose chain is right so far
    q, runs = [], np.arange(len(hit)) if min_match <= 1 else np.flatnonzero(matched >= min_match)
    weight = prior_weight if prior else 0.0
    for d in range(depths):
        valid = runs[runs + d < len(hit)]
        ok = valid[hit[valid + d]]
        extra = weight * prior[min(d, len(prior) - 1)] if prior else 0.0
        q.append(round((len(ok) + extra) / (len(valid) + weight), 4) if len(valid) or weight else 0.0)
        runs = ok
    return q


def lookup_predictions(ids: np.ndarray, max_ngram: int = 3, lengths: bool = False):
    """ids [N] int64 -> [N]: the token prompt lookup predicts at each position s (what followed
    the most recent earlier occurrence of the longest suffix of ``ids[:s]`` of at most
    ``max_ngram`` tokens), -1 where none occurred; with ``lengths``, (that, and [N] the length of
    that suffix, 0 where none occurred). Sorting (N log N), not a scan.
    The n-grams of each length are ranked from the ranks of the one shorter and their last token,
    so equal n-grams get equal keys whatever the vocabulary."""
    guess, matched = np.full(len(ids), -1, dtype=np.int64), np.zeros(len(ids), dtype=np.int64)
    base = int(ids.max()) + 1 if len(ids) else 1
    rank = np.zeros(len(ids), dtype=np.int64)  # of the n-gram starting at each position (n = 0: all equal)
    for n in range(1, min(max_ngram, len(ids) - 1) + 1):
        m = len(ids) - n  # the n-grams ids[j:j+n] that something follows (ids[j+n])
        key = rank[:m] * base + ids[n - 1:n - 1 + m]
        order = np.argsort(key, kind="stable")  # equal n-grams together, in text order
        same = key[order[1:]] == key[order[:-1]]
        guess[order[1:][same] + n] = ids[order[:-1][same] + n]  # a longer n-gram overrides a shorter
        matched[order[1:][same] + n] = n
        rank = np.empty(m, dtype=np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(~same)))
    return (guess, matched) if lengths else guess


class LookupIndex:
    """Prompt lookup's predictions (:func:`lookup_predictions`) on the positions a text gains
    after ``prompt``, for re-predicting while generating: the prompt's n-grams are sorted once
    (each one's last occurrence with a follower in the prompt), the gained part is compared with
    itself directly (few positions), so a query costs little whatever the prompt's length. An
    n-gram's key is its tokens' bits side by side (exact: ``max_ngram`` x 21 bits fit an int64);
    texts it cannot key exactly fall back to :func:`lookup_predictions`."""

    BITS = 21

    def __init__(self, prompt: Sequence[int], max_ngram: int = 3):
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        self.prompt_len, self.max_ngram = len(ids), max_ngram
        self.exact = (max_ngram * self.BITS < 64 and len(ids) > max_ngram
                      and 0 <= int(ids.min()) and int(ids.max()) < 1 << self.BITS)
        self.last = []  # per n: (sorted keys of the prompt's n-grams, the start of each one's last occurrence)
        # the predictions on the prompt itself and their matches' lengths, from the same sorts (as
        # lookup_predictions)
        self.prompt_guess, self.prompt_matched = (
            (np.full(len(ids), -1, dtype=np.int64), np.zeros(len(ids), dtype=np.int64)) if self.exact
            else lookup_predictions(ids, max_ngram, lengths=True))
        for n in range(1, max_ngram + 1) if self.exact else ():
            keys = self._keys(ids, n)[:len(ids) - n]  # (the n-grams a prompt token follows)
            # equal n-grams together, in text order: sorted by (n-gram's rank, position), two
            # plain sorts (a stable sort of the keys takes several times as long)
            distinct, rank = np.unique(keys, return_inverse=True)
            order = np.argsort(rank.reshape(-1) * len(keys) + np.arange(len(keys)))
            same = rank[order[1:]] == rank[order[:-1]]
            self.prompt_guess[order[1:][same] + n] = ids[order[:-1][same] + n]
            self.prompt_matched[order[1:][same] + n] = n
            self.last.append((distinct, order[np.append(~same, True)]))

    def last_predictions(self, token_ids: np.ndarray, tail: int) -> Optional[tuple]:
        """(predictions, their matches' lengths) on the last ``tail`` positions of ``token_ids``
        (the prompt, or the prompt and more), or None where they reach back into a longer text's
        prompt."""
        gained = len(token_ids) - self.prompt_len
        if gained == 0:
            start = max(0, self.prompt_len - tail)
            return self.prompt_guess[start:], self.prompt_matched[start:]
        if not 0 < tail <= gained:
            return None
        return tuple(a[gained - tail:] for a in self.predictions(token_ids, lengths=True))

    @classmethod
    def _keys(cls, ids: np.ndarray, n: int) -> np.ndarray:
        """[len(ids) - n + 1]: the key of the n-gram starting at each position."""
        key = np.zeros(len(ids) - n + 1, dtype=np.int64)
        for i in range(n):
            key = (key << cls.BITS) | ids[i:len(ids) - n + 1 + i]
        return key

    def predictions(self, token_ids: Sequence[int], lengths: bool = False):
        """``token_ids`` [N] (the prompt, then more) -> [N - prompt length]: the token prompt
        lookup predicts at each position after the prompt (-1 where nothing matches); with
        ``lengths``, (that, the lengths of the matches: as :func:`lookup_predictions`)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        p, total = self.prompt_len, len(ids)
        if not self.exact or total == p or int(ids[p:].min()) < 0 or int(ids[p:].max()) >= 1 << self.BITS:
            found = lookup_predictions(ids, self.max_ngram, lengths=True)
            return tuple(a[p:] for a in found) if lengths else found[0][p:]
        guess, matched = np.full(total - p, -1, dtype=np.int64), np.zeros(total - p, dtype=np.int64)
        for n, (keys, starts) in enumerate(self.last, start=1):  # (a longer n-gram overrides a shorter)
            region = p - n  # n-grams starting here or later have their follower after the prompt
            gained = self._keys(ids[region:], n)  # [total - p + 1]: keys of those starting at region..
            query = gained[:-1]  # the n-gram before each gained position s starts at s - n
            order = np.argsort(query, kind="stable")  # equal n-grams together, in text order
            same = query[order[1:]] == query[order[:-1]]
            found = np.full(len(query), -1, dtype=np.int64)
            found[order[1:][same]] = order[:-1][same]  # each one's previous occurrence
            j = np.where(found >= 0, region + found, -1)  # the most recent occurrence after the prompt's ...
            at = np.searchsorted(keys, query).clip(max=len(keys) - 1)  # ... else the prompt's last
            j = np.where((j < 0) & (keys[at] == query), starts[at], j)
            guess = np.where(j >= 0, ids[(j + n).clip(min=0)], guess)
            matched = np.where(j >= 0, n, matched)
        return (guess, matched) if lengths else guess


def _at_width(row: Sequence[float], width: int) -> float:
    for (w0, a0), (w1, a1) in zip(zip(ACCEPTANCE_WIDTHS, row), zip(ACCEPTANCE_WIDTHS[1:], row[1:])):
        if width <= w1:
            return a0 + (a1 - a0) * (min(max(width, w0), w1) - w0) / (w1 - w0)
    return row[-1]


@torch.inference_mode()
def measure_acceptance(draft, target, token_ids: Sequence[int], depths: int = 6, chunk: int = 2048) -> list:
    """``a[d][k]`` for d = 1..``depths`` and k in ``ACCEPTANCE_WIDTHS``: teacher-forced top-k hit
    rates of ``draft`` on ``token_ids`` (held-out text; chunks of ``chunk`` tokens), each depth at
    the lag its tree nodes query (depth d: lag d), over the reduced draft vocabulary if any."""
    hits = torch.zeros(depths, len(ACCEPTANCE_WIDTHS))
    counts = torch.zeros(depths, 1)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=target.device)
    widths = torch.tensor(ACCEPTANCE_WIDTHS, device=ids.device)
    for start in range(0, ids.numel() - 1, chunk):
        piece = ids[start:start + chunk + 1]
        if piece.numel() < depths + 2:
            break
        inputs, nxt = piece[None, :-1], piece[1:]
        cache = target.new_cache(1, inputs.shape[1])
        target.prefill(inputs, torch.tensor([inputs.shape[1]]), cache)
        k, v = target.last_layer_kv(cache).dense(inputs.shape[1])
        positions = torch.arange(inputs.shape[1], device=ids.device)[None]
        for d in range(depths):
            logits = draft.logits(draft.forward_train(inputs, positions, k, v, lag=d + 1), reduced=True)[0]
            true = logits.gather(1, nxt[:, None])
            ranks = (logits > true).sum(1).masked_fill(true[:, 0] == float("-inf"), logits.shape[1])
            ranks = ranks[d + 1:]  # the true token's rank (never drafted: outside the draft vocabulary)
            hits[d] += (ranks[:, None] < widths[None, :]).sum(0).float().cpu()
            counts[d] += ranks.numel()
    if counts.min() == 0:
        raise ValueError(f"measure_acceptance needs at least {depths + 2} tokens")
    return [[round(float(x), 4) for x in row] for row in hits / counts]
