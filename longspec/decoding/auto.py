"""``--proposer auto``: the speculative setting with the most expected tokens per second on the
device at hand, from a measured cost model.

* **Costs** (measured, cached per device): the target's step time for M tokens verified at once,
  ``target_ms[M]``, and the proposer's time to draft each candidate tree, ``draft_ms[tree]``, at a
  context of the prompt's length (rounded up to a power of two). On CUDA each is a CUDA graph
  replay (as the engine runs it); on a CPU a median of eager calls. Cached in
  ``<longspec home>/costs.json`` under the device, threads, model and dtype, so only the first
  run on a machine pays the measurement (a few seconds).
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
import json
import os
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..config import GenerationConfig
from ..convert import home_dir
from ..engine.runner import time_graph
from ..models.checkpoint import write_atomic
from ..spec.acceptance import LookupIndex, expected_tokens, lookup_acceptance
from ..spec.proposers import LongSpecProposer, PromptLookup
from ..spec.sampling import Uniforms
from ..spec.tree import DEFAULT_TREE, HYBRID_TREE, TreeSpec

# hybrid trees; the "1,1,1,1,1" tails are levels the lookup chain fills alone when it has a candidate
# (else the draft's best path continues there): long verbatim repeats get accepted past depth 5
# deeper beams at about the default's node count: on held-out code a depth-8 beam drafted more
# tokens a round than the default's depth 5 (docs/benchmarks.md)
CANDIDATE_TREES = ("2,2,2", "2,2,2,2,2", "3,3,3,3", "4,4,4,4,4", "4,8,8,8,8", DEFAULT_TREE,
                   "4,8,8,8,8,8,8,8", "4,4,4,4,4,1,1,1,1,1", "4,8,8,8,8,8,8,8,1,1", HYBRID_TREE)
# what ``--proposer auto`` weighs on a CPU (its controller measures them while generating; the
# cost model measures each once per device, so few: the first run's measurement stays short)
# (one: a shorter chain saves a CPU round little and misses long repeats; of 7, verifying 8 tokens:
# a CPU's matrix kernels take rows in blocks of 8, and a 9th row cost a round a fifth more,
# docs/benchmarks.md)
LOOKUP_CHAINS = (7,)
AUTO_TREES = ("2,2,2", "4,4,4,4,4,1,1,1,1,1")
# where step costs are measured (once per device, model and dtype; beyond the second, extrapolated:
# a step's cost is linear in the context); short ones, so the first measurement stays short
COST_CONTEXTS = (1024, 4096)
# on CUDA: the default hybrid tree and two narrower, shallower beams with a lookup tail (cheaper
# rounds, for where the draft's deep levels are rarely right, e.g. sampled calls: at temperature 1
# the two-level beam's round pays best; docs/benchmarks.md has the rounds' costs and tokens)
GPU_CANDIDATE_TREES = (HYBRID_TREE, "4,8,8,1,1,1,1,1,1,1", "4,4,1,1,1,1,1")
GPU_LOOKUP_CHAINS = (5,)
COST_MARGIN = 128  # positions left after a measured context (for the verified tokens; the biggest tree has 74)


def _time(fns: dict, device: torch.device, repeats: int) -> dict:
    """Median seconds of each of ``fns`` ({name: fn}): CUDA-graph replays on CUDA (as the engine
    runs steps), eager calls elsewhere, the functions taken in turn (one call of each a pass): a
    CPU whose speed drifts between seconds (a shared machine) then moves them alike, and the
    choice rests on their ratios."""
    if device.type == "cuda":
        return {name: time_graph(fn, repeats, device) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def measure_costs(target, candidates: dict, context: int, repeats: int = 3, batch: int = 1) -> dict:
    """``{"target_ms": {M: ms}, "draft_ms": {label: ms}}`` at ``context`` cached tokens in each of
    ``batch`` rows (random ids: step time does not depend on them): the target's step for M = 1
    and each candidate's node count per row, and each candidate's proposal (``candidates`` as for
    :func:`choose`). Measured
    without ``torch.compile`` (a compilation per shape would make the first run minutes long on a
    GPU); compiled steps are cheaper, the proposal most (about 2x on a GPU), so on a GPU the
    choice errs towards less speculation."""
    compiled, target.compile_steps = target.compile_steps, False
    try:
        return _measure_costs(target, candidates, context, repeats, batch)
    finally:
        target.compile_steps = compiled


def _measure_costs(target, candidates: dict, context: int, repeats: int, batch: int) -> dict:


    device, vocab = target.device, target.config.vocab_size
    # the tree each proposer begins with: the hybrid drafts a chain (its lookup alone) only as a view
    # of a beam tree's proposer (``with_tree``), as in its engine
    made = {label: make() for label, (_, make, _) in candidates.items()}
    hosts = {label: TreeSpec.parse(HYBRID_TREE) if isinstance(made[label], LongSpecProposer) and made[label].lookup
             is not None and tree.kind == "chain" else tree for label, (tree, _, _) in candidates.items()}
    biggest = max(tree.num_nodes for tree in hosts.values())
    cache = target.new_cache(batch, -(-(context + biggest) // 64) * 64)
    prompt = torch.randint(0, vocab, (batch, context), device=device)
    for store in (cache.pool.k, cache.pool.v):  # random K/V (no prefill: a step's time does not depend on them)
        store.normal_()
    cache.lengths.fill_(context)
    n_keys = cache.max_len if device.type == "cuda" else None
    steps = {}
    for m in sorted({1} | {tree.num_nodes for tree, _, _ in candidates.values()}):
        tokens = torch.randint(0, vocab, (batch, m), device=device)
        positions = cache.lengths[:, None] + torch.arange(m, device=device)
        mask = torch.ones(m, m, dtype=torch.bool, device=device).tril()[None]

        def step(tokens=tokens, positions=positions, mask=mask):
            target.verify(tokens, positions, mask, cache, n_keys=n_keys)
            cache.discard()

        steps[str(m)] = step
    root = prompt[:, -1]
    proposals = {}
    for label, (tree, _, _) in candidates.items():
        proposer = made[label]
        proposer.begin(target, cache, hosts[label], GenerationConfig(), Uniforms(None, device))
        for row in range(batch):
            proposer.add(row, prompt[row, :-1].tolist(), int(root[row]))
        drafting = proposer if hosts[label] == tree else proposer.with_tree(tree)

        def propose(drafting=drafting):
            drafting.propose(root)
            drafting._end_round()

        proposals[label] = propose
    return {"target_ms": {m: 1e3 * t for m, t in _time(steps, device, repeats).items()},
            "draft_ms": {label: 1e3 * t for label, t in _time(proposals, device, repeats).items()}}


# bumped when the steps' code changes what they cost, so measurements of older code are not reused
# (2: drafting selects among a reduced vocabulary's columns and a lookup chain's best matches;
# 3: one lookup search a round, the hybrid's lookup tail without draft forwards;
# 4: the draft's selections in Triton kernels, a step's inputs compiled; a CPU's shapes timed in turn)
COSTS_VERSION = 4
# the lookup's hit rates are predicted from the prompt's last this many tokens (their n-grams
# matched there): a plan then costs the same at 8k and at 1M tokens, which matters where the
# prefill hides it poorly (a long prompt mostly in the prefix cache)
PLAN_WINDOW = 4096


def device_key(target) -> str:
    """What step costs depend on: the device (and CPU threads), the model and its dtype, and the
    code (:data:`COSTS_VERSION`)."""
    device = target.device
    where = (_cuda_name(device.index if device.index is not None else torch.cuda.current_device())
             if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads")
    model = os.path.basename(str(target.path or "model").rstrip("/"))
    return f"{where} | {model} | {str(target.dtype).replace('torch.', '')} | {target.attention_impl} | v{COSTS_VERSION}"


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    """The name of CUDA device ``index`` (asked once: every auto call keys its costs by it)."""
    return torch.cuda.get_device_name(index)


def corrections_key(target, draft) -> str:
    """What auto's corrections of its predictions depend on: the model, the draft (its acceptance
    table) and the prediction's code (:data:`COSTS_VERSION`)."""
    model = os.path.basename(str(target.path or "model").rstrip("/"))
    table = json.dumps(draft.config.acceptance if draft is not None else None)
    return f"{model} | draft {hashlib.sha1(table.encode()).hexdigest()[:12]} | v{COSTS_VERSION}"


def choose(target, candidates: dict, prompt_len: int, costs_file: Optional[str] = None, batch: int = 1,
           allow_plain: bool = True) -> tuple:
    """``candidates``: {label: (tree, make_proposer, tokens per round)}. Returns (the label with
    the most expected tokens per second, or None when plain decoding is fastest (``allow_plain``);
    its predicted speed-up over plain decoding; the costs used). Costs are measured for ``batch``
    rows at the two contexts of :data:`COST_CONTEXTS` (capped by the model's) and interpolated
    linearly in the prompt's length (a step's cost is a constant plus its attention's, linear in
    the context), each measured once per device / model / dtype (cached in ``costs_file``,
    default ``<longspec home>/costs.json``), so every later prompt, whatever its length, is
    decided without measuring anything."""
    n = max(prompt_len, 1)
    lo, hi = _cost_contexts(target)
    weight = max((n - lo) / (hi - lo), 0.0) if hi > lo else 0.0  # (beyond hi: extrapolated)
    cached = _read_costs(costs_file)
    at = {context: _costs_at(target, candidates, context, batch, cached, costs_file) for context in {lo, hi}}
    # (beyond hi never below the costs measured there: noise must not extrapolate into cheap steps)
    costs = {kind: {key: max((1 - weight) * at[lo][kind][key] + weight * value, value if weight > 1 else 0.0)
                    for key, value in at[hi][kind].items() if key in at[lo][kind]}
             for kind in ("target_ms", "draft_ms")}
    costs["target_ms"] = monotone(costs["target_ms"])
    best, gain = fastest({label: (tree, tokens) for label, (tree, _, tokens) in candidates.items()}, costs,
                         allow_plain)
    return best, gain, costs


def _cost_contexts(target) -> tuple:
    """The contexts of :data:`COST_CONTEXTS`, below the model's last positions: the same for every
    candidate set (they are the cache's keys)."""
    cap = max(1, target.config.max_position_embeddings - COST_MARGIN)
    return tuple(min(c, cap) for c in COST_CONTEXTS)


def _cost_key(target, context: int, batch: int = 1) -> str:
    """The costs file's key of ``target``'s costs at ``context`` for ``batch`` rows."""
    return f"{device_key(target)} | {context}" + (f" | batch {batch}" if batch > 1 else "")


def costs_measured(target, draft, costs_file: Optional[str] = None) -> bool:
    """Whether ``--proposer auto``'s step costs for ``target`` (with ``draft``) on this device
    are cached already: no measurement before the first call."""
    labels = _candidates([], draft if draft is None or draft.config.acceptance else None, [],
                         target.device.type == "cuda")
    cached = _read_costs(costs_file)
    return all(set(labels) <= set(cached.get(_cost_key(target, c), {}).get("draft_ms", {}))
               for c in _cost_contexts(target))


def _costs_at(target, candidates: dict, context: int, batch: int, cached: dict, costs_file: Optional[str]) -> dict:
    """The costs of ``candidates`` at ``context`` from ``cached`` (the file's contents), measuring
    (and writing back) the ones missing."""
    key = _cost_key(target, context, batch)
    costs = cached.get(key, {"target_ms": {}, "draft_ms": {}})
    missing = {label: c for label, c in candidates.items() if label not in costs["draft_ms"]}
    if missing:
        fresh = measure_costs(target, missing, context, batch=batch)
        costs["target_ms"].update(fresh["target_ms"])
        costs["draft_ms"].update(fresh["draft_ms"])
        cached[key] = costs
        _write_costs(costs_file, cached)
    return costs


def fastest(rated: dict, costs: dict, allow_plain: bool = True) -> tuple:
    """``rated``: {label: (tree, expected tokens per round)} -> (the label with the most tokens
    per second under ``costs``, or None where plain decoding beats them all (``allow_plain``);
    its speed over plain decoding)."""
    target_ms, draft_ms = costs["target_ms"], costs["draft_ms"]
    plain = 1.0 / target_ms["1"]
    best, best_rate = None, plain if allow_plain else 0.0
    for label, (tree, tokens) in rated.items():
        rate = tokens / (draft_ms[label] + target_ms[str(tree.num_nodes)])
        if rate > best_rate:
            best, best_rate = label, rate
    return best, best_rate / plain


def monotone(target_ms: dict) -> dict:
    """Step times per token count made non-decreasing in it, as the closest such times (pooling
    adjacent counts that disagree, by their mean): verifying more tokens never costs less, but a
    measurement can say so (a busy CPU; a matrix shape a CPU library runs slowly), and the choice
    then favours verifying more for free. Pooled, not lifted to the larger: one slow count must
    not price every larger one above what it measured (on a 2-core CPU 7 tokens measured above 9,
    and the chain of 9 was then predicted not to pay where it did)."""
    blocks = []  # [sum, count, token counts] of pooled runs
    for m in sorted(target_ms, key=int):
        blocks.append([target_ms[m], 1, [m]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count, ms = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
            blocks[-1][2] += ms
    return {m: total / count for total, count, ms in blocks for m in ms}


def _costs_path(costs_file: Optional[str]) -> str:

    return costs_file or str(home_dir() / "costs.json")


def _read_costs(costs_file: Optional[str]) -> dict:
    try:
        with open(_costs_path(costs_file)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or an unreadable one: measure again


def _write_costs(costs_file: Optional[str], data: dict) -> None:
    from pathlib import Path


    path = Path(_costs_path(costs_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True)))


def _candidates(ids: Sequence[int], draft, hits: Sequence[float], on_cuda: bool = False) -> dict:
    """``--proposer auto``'s candidates for a text with lookup hit rates ``hits``: {label: (tree,
    make_proposer, expected tokens per round)}: prompt-lookup chains of ``LOOKUP_CHAINS`` tokens
    and, with a ``draft``, the hybrid with each of ``CANDIDATE_TREES``. On CUDA (``on_cuda``)
    fewer, those of :func:`candidate_trees`: each tree an engine drafts is captured once per process
    and kind of round. With a draft the lookup chains are the hybrid's (labelled "hybrid
    chain:N"): its lookup drafts them alone in the hybrid's engine
    (:meth:`LongSpecProposer.propose`), so one engine, one KV pool, serves every choice."""

    candidates = {}
    chains, trees = (LOOKUP_CHAINS, AUTO_TREES) if not on_cuda else (GPU_LOOKUP_CHAINS, GPU_CANDIDATE_TREES)
    for n in chains:
        tree = TreeSpec.chain(n)
        if draft is not None:
            candidates[f"hybrid {tree}"] = (tree, lambda: LongSpecProposer(draft, PromptLookup()),
                                            expected_tokens(tree, lookup=hits))
        else:
            candidates[f"pld {tree}"] = (tree, PromptLookup, expected_tokens(tree, lookup=hits))
    for shape in trees if draft is not None else ():
        tree = TreeSpec.parse(shape)
        candidates[f"hybrid {tree}"] = (tree, lambda: LongSpecProposer(draft, PromptLookup()),
                                        expected_tokens(tree, draft.config.acceptance, hits))
    return candidates


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
    """What ``--proposer auto`` runs for a prompt: ``name``, the proposer that runs every
    candidate ("pld" or "hybrid"), the engine's ``tree`` (the
    biggest candidate, which every other fits in), ``start`` (the cost model's pick: the first
    rounds; None: plain rounds), the ``draft`` (the hybrid's), ``note`` (why) and ``predicted``
    ({tree or None: (tokens per round, round ms)} of every candidate, the
    :class:`~longspec.decoding.controller.Controller`'s start; None: no cost model, ``start``
    runs throughout). ``hits``: the lookup's hit rates on the prompt, ``acceptance`` the
    draft's table and ``index`` the prompt's :class:`~longspec.spec.acceptance.LookupIndex`,
    for :meth:`repredict`."""

    name: str
    tree: Optional[TreeSpec]
    start: Optional[TreeSpec]
    draft: object
    note: str
    predicted: Optional[dict] = None
    hits: tuple = ()
    acceptance: tuple = ()
    index: Optional[LookupIndex] = None

    def repredict(self, ids: Sequence[int], n_prompt: int) -> dict:
        """{tree: tokens per round} predicted from the lookup's hit rates on the generated part of
        ``ids`` (each depth pulled towards the prompt's rate by a few positions): a model
        continuing code repeats the prompt far more than the prompt repeats itself
        (docs/benchmarks.md, "Generation on a CPU")."""
        start = max(0, n_prompt - PLAN_WINDOW)  # (the index holds the prompt's last PLAN_WINDOW tokens)
        hits = lookup_acceptance(ids[start:], tail=len(ids) - n_prompt, prior=self.hits, prior_weight=8.0,
                                 index=self.index)
        return {tree: expected_tokens(tree, () if tree.kind == "chain" else self.acceptance, hits)
                for tree in self.predicted or {} if tree is not None}


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


def resolve(target, ids: Sequence[int], draft, costs_file: Optional[str] = None) -> Plan:
    """``--proposer auto`` for prompt ``ids``: the candidates (:func:`_candidates`; on CUDA
    fewer) with their predicted tokens and times per round (:func:`choose`'s cost model), and
    plain rounds. A ``draft`` without an acceptance table: its default hybrid tree throughout."""
    if draft is not None and not draft.config.acceptance:
        tree = TreeSpec.parse(HYBRID_TREE)
        return Plan("hybrid", tree, tree, draft, "the draft has no acceptance table: default tree")
    recent = np.asarray(ids[-PLAN_WINDOW:], dtype=np.int64)
    index, hits = _lookup_of(recent)
    candidates = _candidates(recent, draft, hits, target.device.type == "cuda")
    label, gain, costs = choose(target, candidates, len(ids), costs_file)
    steps = costs["target_ms"]
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
                f"{why} ({predictions(candidates, costs)}); measured while generating", predicted, tuple(hits),
                tuple(map(tuple, draft.config.acceptance)) if draft is not None else (), index)
