"""The cost model's step costs (see :mod:`~longspec.decoding.auto`): the target's step time for M
tokens verified at once, ``target_ms[M]``, and each candidate's time to draft its tree,
``draft_ms[label]``, measured at two contexts (:data:`COST_CONTEXTS`) and interpolated in the
prompt's length; on CUDA CUDA-graph replays (as the engine runs them), on a CPU eager
calls taken in turn, as ratios to the one-token step's. Cached in ``<longspec home>/costs.json``
under the device, threads, model, dtype, attention and :data:`COSTS_VERSION` (a CPU's also
:data:`CPU_COSTS_VERSION`), so only the first run on a machine measures. From
them :func:`choose` / :func:`fastest` pick the candidate with the most tokens per second."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from ..config import GenerationConfig
from ..convert import home_dir
from ..engine.runner import time_graph
from ..models.checkpoint import write_atomic
from ..spec.prompt_lookup import DECODE_BELOW
from ..spec.proposers import LongSpecProposer
from ..spec.sampling import Uniforms
from ..spec.tree import HYBRID_TREE, TreeSpec

# where step costs are measured (once per device, model and dtype; beyond the second, extrapolated:
# a step's cost is linear in the context); short ones, so the first measurement stays short
COST_CONTEXTS = (1024, 4096)

COST_MARGIN = 128  # positions left after a measured context (for the verified tokens; the biggest tree has 74)

def _time(fns: dict, device: torch.device, repeats: int, reference) -> dict:
    """Median seconds of each of ``fns`` ({name: fn}): CUDA-graph replays on CUDA (as the engine
    runs steps), eager calls elsewhere, the functions taken in turn (one call of each a pass), each
    function's median ratio to the ``reference``'s call (one of ``fns``) in the same pass, times
    the reference's median. A CPU whose speed drifts between seconds (a shared machine, other
    processes) moves a pass's calls alike, and the choice rests on their ratios: a ratio within a
    pass is not moved by a slow pass, as a median of each function's own calls is when the passes
    it lands in differ between functions (a larger shape then measured below a smaller one:
    docs/benchmarks.md, "Generation on a CPU")."""
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
    ref = times[reference]
    scale = statistics.median(ref)
    return {name: scale * statistics.median(a / max(b, 1e-9) for a, b in zip(t, ref)) for name, t in times.items()}


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
    fns = {**{("target_ms", m): fn for m, fn in steps.items()}, **{("draft_ms", label): fn for label, fn in proposals.items()}}
    costs = {"target_ms": {}, "draft_ms": {}}
    for (kind, key), seconds in _time(fns, device, repeats, reference=("target_ms", "1")).items():
        costs[kind][key] = 1e3 * seconds
    return costs


# bumped when the steps' code changes what they cost, so measurements of older code are not reused
# (2: drafting selects among a reduced vocabulary's columns and a lookup chain's best matches;
# 3: one lookup search a round, the hybrid's lookup tail without draft forwards;
# 4: the draft's selections in Triton kernels, a step's inputs compiled; a CPU's shapes timed in turn)
COSTS_VERSION = 4
# bumped when only a CPU's timing changes what its steps measure (a CPU's tables are measured again, a
# GPU's kept): 2: ratios to the one-token step within a pass; 3: products over few rows as weight @ x^T
CPU_COSTS_VERSION = 3

def device_key(target) -> str:
    """What step costs depend on: the device (and CPU threads), the model and its dtype, and the
    code (:data:`COSTS_VERSION`)."""
    device = target.device
    where = (_cuda_name(device.index if device.index is not None else torch.cuda.current_device())
             if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads")
    model = os.path.basename(str(target.path or "model").rstrip("/"))
    version = f"v{COSTS_VERSION}" + ("" if device.type == "cuda" else f".{CPU_COSTS_VERSION}")
    return f"{where} | {model} | {str(target.dtype).replace('torch.', '')} | {target.attention_impl} | {version}"


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    """The name of CUDA device ``index`` (asked once: every auto call keys its costs by it)."""
    return torch.cuda.get_device_name(index)


def corrections_key(target, draft) -> str:
    """What auto's corrections of its predictions depend on: the model, the draft (its acceptance
    table), the prediction's code (:data:`COSTS_VERSION`) and, on a CPU, where its chains draft
    (:data:`~longspec.spec.prompt_lookup.DECODE_BELOW`: their predictions are of those rounds)."""
    model = os.path.basename(str(target.path or "model").rstrip("/"))
    table = json.dumps(draft.config.acceptance if draft is not None else None)
    chains = "" if target.device.type == "cuda" else f" | cpu chains from {DECODE_BELOW}-token matches"
    return f"{model} | draft {hashlib.sha1(table.encode()).hexdigest()[:12]} | v{COSTS_VERSION}{chains}"


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
    lo, hi = cost_contexts(target)
    weight = max((n - lo) / (hi - lo), 0.0) if hi > lo else 0.0  # (beyond hi: extrapolated)
    cached = read_costs(costs_file)
    at = {context: _costs_at(target, candidates, context, batch, cached, costs_file) for context in {lo, hi}}
    # (beyond hi never below the costs measured there: noise must not extrapolate into cheap steps)
    costs = {kind: {key: max((1 - weight) * at[lo][kind][key] + weight * value, value if weight > 1 else 0.0)
                    for key, value in at[hi][kind].items() if key in at[lo][kind]}
             for kind in ("target_ms", "draft_ms")}
    costs["target_ms"] = floored(costs["target_ms"])
    best, gain = fastest({label: (tree, tokens) for label, (tree, _, tokens) in candidates.items()}, costs,
                         allow_plain)
    return best, gain, costs


def cost_contexts(target) -> tuple:
    """The contexts of :data:`COST_CONTEXTS`, below the model's last positions: the same for every
    candidate set (they are the cache's keys)."""
    cap = max(1, target.config.max_position_embeddings - COST_MARGIN)
    return tuple(min(c, cap) for c in COST_CONTEXTS)


def cost_key(target, context: int, batch: int = 1) -> str:
    """The costs file's key of ``target``'s costs at ``context`` for ``batch`` rows."""
    return f"{device_key(target)} | {context}" + (f" | batch {batch}" if batch > 1 else "")


def _costs_at(target, candidates: dict, context: int, batch: int, cached: dict, costs_file: Optional[str]) -> dict:
    """The costs of ``candidates`` at ``context`` from ``cached`` (the file's contents), measuring
    (and writing back) the ones missing."""
    key = cost_key(target, context, batch)
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


def floored(target_ms: dict) -> dict:
    """Step times per token count, none below the one-token step's (a round verifies its root at
    least, and plain rounds are weighed against that step). Otherwise each count keeps its own
    time, also below a smaller count's: a CPU's matrix kernels take rows in blocks, so more tokens
    can cost less (8 tokens below 7 on one CPU, 9 below 7 on another), and a chain priced at the
    pooled time of its neighbours lost to a shorter one that made fewer tokens a round for the
    same time (docs/benchmarks.md, "Generation on a CPU"). A
    CPU's tables are timed as ratios within a pass (:func:`_time`), which a busy machine moves
    less than the shapes' own medians."""
    one = target_ms["1"]
    return {m: max(t, one) for m, t in target_ms.items()}


def _costs_path(costs_file: Optional[str]) -> str:
    return costs_file or str(home_dir() / "costs.json")


def read_costs(costs_file: Optional[str]) -> dict:
    try:
        with open(_costs_path(costs_file)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or an unreadable one: measure again


def _write_costs(costs_file: Optional[str], data: dict) -> None:
    path = Path(_costs_path(costs_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True)))
