"""How many tokens a round of speculative decoding emits: the model behind ``--proposer auto``
(:mod:`longspec.decoding.auto`). A tree level holds the right token from the draft's top-w
(the draft's acceptance table, :func:`measure_acceptance`) or from prompt lookup's chain (its hit
rates on a text, :func:`lookup_acceptance`); :func:`expected_tokens` combines them."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .tree import TreeSpec

# the draft and the lookup hit on largely the same (easy) tokens: a level holding both is right
# this far between independent hits (0) and the better of the two alone (1). Fitted on held-out
# code (transformers/generation, 2k / 3k / 4k / 7.9k tokens, the step-8000 draft, the lookup's
# rates on the generated text): hybrid `4,16,16,16,16,1,1,1,1,1` measured 5.38 / - / 7.11 / 4.33
# tokens a round against 6.60 / - / 9.59 / 6.12 predicted as independent and 5.00 / - / 8.69 /
# 4.56 at 0.5; `4,4,4,4,4,1,1,1,1,1` at 3k 5.00 against 6.45 and 5.04
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
                      prior: Sequence[float] = (), prior_weight: float = 0.0) -> list:
    """Prompt lookup's conditional hit rates on a text (the prompt itself): ``q[d-1]`` = how often
    the lookup predicts the next token right at chain depth d, given it was right up to d - 1. The
    prediction for position s is what followed the most recent earlier occurrence of the longest
    (up to ``max_ngram``) suffix of ``token_ids[:s]``, as :class:`PromptLookup` ranks first;
    measured over the last ``tail`` positions. With a ``prior`` (rates per depth), each depth's
    rate counts ``prior_weight`` extra positions at the prior's rate (few positions: near it)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    hit = (lookup_predictions(ids, max_ngram) == ids)[max(0, len(ids) - tail):]
    q, runs = [], np.arange(len(hit))  # starts whose chain is right so far
    weight = prior_weight if prior else 0.0
    for d in range(depths):
        valid = runs[runs + d < len(hit)]
        ok = valid[hit[valid + d]]
        extra = weight * prior[min(d, len(prior) - 1)] if prior else 0.0
        q.append(round((len(ok) + extra) / (len(valid) + weight), 4) if len(valid) or weight else 0.0)
        runs = ok
    return q


def lookup_predictions(ids: np.ndarray, max_ngram: int = 3) -> np.ndarray:
    """ids [N] int64 -> [N]: the token prompt lookup predicts at each position s (what followed
    the most recent earlier occurrence of the longest suffix of ``ids[:s]`` of at most
    ``max_ngram`` tokens), -1 where none occurred. Sorting, not a scan: ~30 ms at 128k tokens.
    The n-grams of each length are ranked from the ranks of the one shorter and their last token,
    so equal n-grams get equal keys whatever the vocabulary."""
    guess = np.full(len(ids), -1, dtype=np.int64)
    base = int(ids.max()) + 1 if len(ids) else 1
    rank = np.zeros(len(ids), dtype=np.int64)  # of the n-gram starting at each position (n = 0: all equal)
    for n in range(1, min(max_ngram, len(ids) - 1) + 1):
        m = len(ids) - n  # the n-grams ids[j:j+n] that something follows (ids[j+n])
        key = rank[:m] * base + ids[n - 1:n - 1 + m]
        order = np.argsort(key, kind="stable")  # equal n-grams together, in text order
        same = key[order[1:]] == key[order[:-1]]
        guess[order[1:][same] + n] = ids[order[:-1][same] + n]  # a longer n-gram overrides a shorter
        rank = np.empty(m, dtype=np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(~same)))
    return guess


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
