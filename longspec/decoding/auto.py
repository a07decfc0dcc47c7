"""``--proposer auto``: the speculative setting with the most expected tokens per second on the
device at hand, from a measured cost model.

* **Costs** (measured, cached per device; :mod:`~longspec.decoding.step_costs`): the target's
  step time for M tokens verified at once, ``target_ms[M]``, and the proposer's time to draft
  each candidate tree, ``draft_ms[tree]``, at two contexts, interpolated in the prompt's length;
  only the first run on a machine pays the measurement (a few seconds).
* **Acceptance** (measured once per draft, stored in its config as ``acceptance``): ``a[d][k]``,
  the fraction of held-out positions where the true token at tree depth d+1 is among the draft's
  k best (teacher forcing at the lag that depth queries); :func:`measure_acceptance`.
* **Lookup**: prompt lookup's hit rate per chain depth, measured on the prompt itself
  (:func:`lookup_acceptance`).
* **Model**: a tree of widths w_1..w_D emits ``1 + sum_d prod_{j<=d} h_j`` tokens per round, where
  level j holds the right token with probability h_j: from the draft's top-w_j (one slot fewer
  when the hybrid's lookup chain takes one) or, independently, from the lookup chain
  (:func:`expected_tokens`); plain decoding emits 1 per target step. The choice maximises tokens /
  (draft + verify time).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..spec.acceptance import LookupIndex, expected_tokens, lookup_acceptance
from ..spec.prompt_lookup import DECODE_BELOW
from ..spec.proposers import LongSpecProposer, PromptLookup
from ..spec.tree import DEFAULT_TREE, HYBRID_TREE, TreeSpec
from .step_costs import choose, cost_contexts, cost_key, fastest, read_costs

# hybrid trees; the "1,1,1,1,1" tails are levels the lookup chain fills alone when it has a candidate
# (else the draft's best path continues there): long verbatim repeats get accepted past depth 5
# deeper beams at about the default's node count: on held-out code a depth-8 beam drafted more
# tokens a round than the default's depth 5 (docs/benchmarks.md)
CANDIDATE_TREES = ("2,2,2", "2,2,2,2,2", "3,3,3,3", "4,4,4,4,4", "4,8,8,8,8", DEFAULT_TREE,
                   "4,8,8,8,8,8,8,8", "4,4,4,4,4,1,1,1,1,1", "4,8,8,8,8,8,8,8,1,1", HYBRID_TREE)
# what ``--proposer auto`` weighs on a CPU (its controller measures them while generating; the
# cost model measures each once per device, so few: the first run's measurement stays short).
# Chains of 4, 6 and 8 tokens verified: a CPU's matrix kernels take a step's rows in blocks whose
# size differs between CPUs (on one a 9th row cost a round a fifth more, on another a 7th row cost
# a tenth more), so the cost model's measured steps, not one fixed length, pick the chain
# (docs/benchmarks.md, "Generation on a CPU")
LOOKUP_CHAINS = (3, 5, 7)
# the lookup's hit rates at which the chains' lengths are compared where the prompt's are lower (a
# chain that pays: its first token right half of the time, each next one four times in five)
PAYING_HITS = (0.5,) + (0.8,) * 9
# on a CPU a chain's rounds draft only where the lookup matched DECODE_BELOW tokens or more (elsewhere
# they are decode steps): their hit rates are measured there, each depth counting this many positions
# at PAYING_HITS' rate too (a prompt with few such matches, e.g. a short one, says little of them)
CHAIN_PRIOR_POSITIONS = 8.0
AUTO_TREES = ("2,2,2", "4,4,4,4,4,1,1,1,1,1")
# on CUDA: the default hybrid tree and two narrower, shallower beams with a lookup tail (cheaper
# rounds, for where the draft's deep levels are rarely right, e.g. sampled calls: at temperature 1
# the two-level beam's round pays best; docs/benchmarks.md has the rounds' costs and tokens)
GPU_CANDIDATE_TREES = (HYBRID_TREE, "4,8,8,1,1,1,1,1,1,1", "4,4,1,1,1,1,1")
GPU_LOOKUP_CHAINS = (5,)


# the lookup's hit rates are predicted from the prompt's last this many tokens (their n-grams
# matched there): a plan then costs the same at 8k and at 1M tokens, which matters where the
# prefill hides it poorly (a long prompt mostly in the prefix cache)
PLAN_WINDOW = 4096


def costs_measured(target, draft, costs_file: Optional[str] = None) -> bool:
    """Whether ``--proposer auto``'s step costs for ``target`` (with ``draft``) on this device
    are cached already: no measurement before the first call."""
    labels = _candidates([], draft if draft is None or draft.config.acceptance else None, [],
                         target.device.type == "cuda")
    cached = read_costs(costs_file)
    return all(set(labels) <= set(cached.get(cost_key(target, c), {}).get("draft_ms", {}))
               for c in cost_contexts(target))


def _candidates(ids: Sequence[int], draft, hits: Sequence[float], on_cuda: bool = False,
                chain_hits: Optional[Sequence[float]] = None) -> dict:
    """``--proposer auto``'s candidates for a text with lookup hit rates ``hits`` (``chain_hits``:
    those of the rounds the chains draft in, where not every round: a CPU's; default ``hits``):
    {label: (tree, make_proposer, expected tokens per round)}: prompt-lookup chains of
    ``LOOKUP_CHAINS`` tokens and, with a ``draft``, the hybrid with each of ``CANDIDATE_TREES``.
    On CUDA (``on_cuda``) fewer, those of :func:`candidate_trees`: each tree an engine drafts is
    captured once per process and kind of round. With a draft the lookup chains are the hybrid's (labelled "hybrid
    chain:N"): its lookup drafts them alone in the hybrid's engine
    (:meth:`LongSpecProposer.propose`), so one engine, one KV pool, serves every choice."""
    candidates, chain_hits = {}, hits if chain_hits is None else chain_hits
    chains, trees = (LOOKUP_CHAINS, AUTO_TREES) if not on_cuda else (GPU_LOOKUP_CHAINS, GPU_CANDIDATE_TREES)
    for n in chains:
        tree = _tree(f"chain:{n}")
        if draft is not None:
            candidates[f"hybrid {tree}"] = (tree, lambda: LongSpecProposer(draft, PromptLookup()),
                                            expected_tokens(tree, lookup=chain_hits))
        else:
            candidates[f"pld {tree}"] = (tree, PromptLookup, expected_tokens(tree, lookup=chain_hits))
    for shape in trees if draft is not None else ():
        tree = _tree(shape)
        candidates[f"hybrid {tree}"] = (tree, lambda: LongSpecProposer(draft, PromptLookup()),
                                        expected_tokens(tree, draft.config.acceptance, hits))
    return candidates


@functools.lru_cache(maxsize=None)
def _tree(shape: str) -> TreeSpec:
    """The candidates' trees, parsed once (a call's plan builds its candidates several times)."""
    return TreeSpec.parse(shape)


def candidate_trees(draft, on_cuda: bool = True) -> list:
    """Every tree ``--proposer auto`` may run (``on_cuda``: on CUDA, else on a CPU), biggest
    first: its candidates' (with a ``draft``: the hybrid's trees and its lookup's chains, else
    prompt lookup's chains; a draft without an acceptance table: the hybrid's default tree alone),
    whatever the prompt: the engine drafts the first one, and on CUDA captures them all on auto's
    first call of each kind of round, so that no later call captures (with plain rounds)."""
    if draft is not None and not draft.config.acceptance:
        return [TreeSpec.parse(HYBRID_TREE)]
    trees = [tree for tree, _, _ in _candidates([], draft, [], on_cuda=on_cuda).values()]
    return sorted(trees, key=lambda t: (-t.num_nodes, -t.depth))


def predictions(candidates: dict, costs: dict) -> str:
    """What the cost model predicted, for a call's stats: tokens and milliseconds per round of
    each candidate, and plain decoding's milliseconds per token."""
    rounds = [f"{label}: {tokens:.2f} tokens in {costs['draft_ms'][label] + costs['target_ms'][str(tree.num_nodes)]:.2f} ms"
              for label, (tree, _, tokens) in candidates.items()]
    return "; ".join(rounds + [f"plain: 1 token in {costs['target_ms']['1']:.2f} ms"])


@dataclass
class Plan:
    """What a ``Generator.generate`` call runs. ``name``: the proposer's ("pld" or "hybrid" for
    ``--proposer auto``, which runs every candidate with it; "" for a Generator's own proposer);
    ``tree``: the engine's (the biggest its rounds may draft, which every candidate fits in);
    ``start``: the first rounds' tree (auto: the cost model's pick; None: plain rounds); ``draft``:
    the hybrid's; ``note``: why (auto); ``predicted``: {tree or None: (tokens per round, round
    ms)} of every candidate, the :class:`~longspec.decoding.controller.Controller`'s start (None:
    no cost model, ``start`` runs throughout; a CPU's chains: the rounds they draft in, as its
    rounds are measured). ``hits``: the lookup's hit rates on the prompt (``chain_hits``: where
    the chains draft, from matches of ``min_match`` tokens),
    ``acceptance`` the draft's table and ``index`` the prompt's
    :class:`~longspec.spec.acceptance.LookupIndex`, for :meth:`repredict`. ``proposer``: the
    proposer object the engine runs (None: plain decoding; :func:`resolve` leaves it to the
    caller, which owns the proposers); ``controller``: one given to the Generator; ``choices``:
    the trees auto's controller may run (None: plain rounds), captured on a first call."""

    name: str
    tree: Optional[TreeSpec]
    start: Optional[TreeSpec]
    draft: object = None
    note: str = ""
    predicted: Optional[dict] = None
    hits: tuple = ()
    chain_hits: tuple = ()
    min_match: int = 1
    acceptance: tuple = ()
    index: Optional[LookupIndex] = None
    proposer: object = None
    controller: object = None
    choices: tuple = ()

    def repredict(self, ids: Sequence[int], n_prompt: int) -> dict:
        """{tree: tokens per round} predicted from the lookup's hit rates on the generated part of
        ``ids`` (each depth pulled towards the prompt's rate by a few positions): a model
        continuing code repeats the prompt far more than the prompt repeats itself
        (docs/benchmarks.md, "Generation on a CPU")."""
        start = max(0, n_prompt - PLAN_WINDOW)  # (the index holds the prompt's last PLAN_WINDOW tokens)
        def rates(prior, min_match):
            return lookup_acceptance(ids[start:], tail=len(ids) - n_prompt, prior=prior, prior_weight=8.0,
                                     index=self.index, min_match=min_match)

        hits = rates(self.hits, 1)
        chain_hits = hits if self.min_match <= 1 else rates(self.chain_hits, self.min_match)
        return {tree: expected_tokens(tree, lookup=chain_hits) if tree.kind == "chain" else
                expected_tokens(tree, self.acceptance, hits) for tree in self.predicted or {} if tree is not None}


_LOOKUPS: "OrderedDict[bytes, tuple]" = OrderedDict()  # the last texts' (LookupIndex, hit rates), by content
LOOKUPS_KEPT = 8


def _lookup_of(recent: np.ndarray) -> tuple:
    """(:class:`LookupIndex`, :func:`lookup_acceptance`) of a prompt's last tokens ``recent``
    (the index: re-predicting from the generated text then costs little), kept for the last few
    texts: the same document asked again (another sample, a regenerated answer) is planned
    without sorting its n-grams again, most of a plan's time (it is not hidden where the prompt
    is in the prefix cache: its prefill is then shorter)."""
    key = hashlib.blake2b(recent.tobytes(), digest_size=16).digest()
    found = _LOOKUPS.pop(key, None)
    if found is None:
        index = LookupIndex(recent)
        found = index, lookup_acceptance(recent, index=index)
    _LOOKUPS[key] = found
    while len(_LOOKUPS) > LOOKUPS_KEPT:
        _LOOKUPS.popitem(last=False)
    return found


def _one_chain(candidates: dict, costs: dict, hits: Sequence[float]) -> dict:
    """``candidates`` with one lookup chain: the one of most expected tokens per millisecond under
    ``costs`` at the lookup's hit rates ``hits`` or, where those are lower, at :data:`PAYING_HITS`
    (the chains differ in length only, and their length matters where a chain pays: a prompt
    that repeats nothing, e.g. a short one, says nothing of it; and a controller weighing several
    on the few rounds of a call takes turns among them on the noise of those rounds)."""
    at = [max(h, p) for h, p in itertools.zip_longest(hits, PAYING_HITS, fillvalue=0.0)]
    chains = {name: (tree, expected_tokens(tree, lookup=at)) for name, (tree, _, _) in candidates.items()
              if tree.kind == "chain"}
    best, _ = fastest(chains, costs, allow_plain=False)
    return {name: c for name, c in candidates.items() if name == best or name not in chains}


def resolve(target, ids: Sequence[int], draft, costs_file: Optional[str] = None) -> Plan:
    """``--proposer auto`` for prompt ``ids``: the candidates (:func:`_candidates`; on CUDA
    fewer) with their predicted tokens and times per round (:func:`choose`'s cost model), and
    plain rounds. A ``draft`` without an acceptance table: its default hybrid tree throughout."""
    if draft is not None and not draft.config.acceptance:
        tree = TreeSpec.parse(HYBRID_TREE)
        return Plan("hybrid", tree, tree, draft, "the draft has no acceptance table: default tree")
    recent = np.asarray(ids[-PLAN_WINDOW:], dtype=np.int64)
    index, hits = _lookup_of(recent)
    on_cuda = target.device.type == "cuda"
    min_match = 1 if on_cuda else DECODE_BELOW  # (PromptLookup: a CPU's chain rounds draft only from such matches)
    chain_hits = hits if on_cuda else lookup_acceptance(recent, index=index, min_match=min_match, prior=PAYING_HITS,
                                                        prior_weight=CHAIN_PRIOR_POSITIONS)
    candidates = _candidates(recent, draft, hits, on_cuda, chain_hits)
    _, _, costs = choose(target, candidates, len(ids), costs_file)
    steps = costs["target_ms"]
    note = predictions(candidates, costs)
    candidates = _one_chain(candidates, costs, chain_hits)  # (the first tree: the fastest of those kept)
    label, gain = fastest({name: (tree, tokens) for name, (tree, _, tokens) in candidates.items()}, costs)
    predicted = {tree: (tokens, costs["draft_ms"][name] + steps[str(tree.num_nodes)])
                 for name, (tree, _, tokens) in candidates.items()}
    predicted[None] = (1.0, steps["1"])
    biggest = max(predicted, key=lambda t: (-1, -1) if t is None else (t.num_nodes, t.depth))
    if not all(t is None or t.fits_in(biggest) for t in predicted):
        raise ValueError(f"auto's candidates must all fit the biggest one ({biggest})")
    start = None if label is None else candidates[label][0]
    why = ("cost model: plain decoding is fastest here" if label is None else
           f"cost model: {gain:.2f}x plain decoding predicted")
    return Plan("hybrid" if draft is not None else "pld", biggest, start, draft,
                f"{why} ({note}); measured while generating", predicted, tuple(hits), tuple(chain_hits), min_match,
                tuple(map(tuple, draft.config.acceptance)) if draft is not None else (), index)
