"""Tensor-parallel runs for the tests: every rank (a spawned CPU process, gloo) loads its share of
tiny targets and runs the same Generator calls as the single-process run in the test."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from longspec import GenerationConfig, Generator, load_target
from longspec.models.checkpoint import load_draft

GREEDY = dict(max_new_tokens=10)
SAMPLED = dict(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.95, seed=11)
# name -> (proposer, tree, generation settings)
CASES = {
    "none": ("none", None, GREEDY),
    "pld": ("pld", "chain:3", GREEDY),
    "streaming": ("streaming", "2,2,2", GREEDY),
    "longspec": ("longspec", "2,2,2", GREEDY),
    "hybrid": ("hybrid", "2,2,1,1", GREEDY),
    "none-sampled": ("none", None, SAMPLED),
    "longspec-sampled": ("longspec", "2,2,2", SAMPLED),
}
# prompts with repeats (prompt lookup finds matches) and of different lengths (a batch of two)
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 7, 21, 5, 9, 13], [3, 4, 5, 6, 3, 4, 5]]


def run_cases(target, draft_dir, cases) -> dict:
    """{case: generated tokens of PROMPTS} for each case name on ``target`` (whole or a shard);
    case "logits": the prefill's logits of the first prompt (every position)."""
    draft = load_draft(draft_dir, target) if draft_dir else None
    out = {}
    for name in cases:
        if name == "logits":
            ids = torch.tensor([PROMPTS[0]])
            cache = target.new_cache(1, 64)
            out[name] = target.prefill(ids, torch.tensor([ids.shape[1]]), cache, chunk_size=8, all_logits=True).tolist()
            if draft is not None:  # the draft over the target's KV heads, token by token
                out["draft"] = draft_states(target, draft, cache, ids).tolist()
            continue
        proposer, tree, settings = CASES[name]
        uses_draft = proposer in ("longspec", "hybrid")
        gen = Generator(target, proposer, tree, max_len=64, window=8, draft=draft if uses_draft else None)
        result = gen.generate(PROMPTS, GenerationConfig(**settings))
        out[name] = [result.sequences, result.stats.get("accepted_hist")]
    return out


@torch.inference_mode()
def draft_states(target, draft, cache, ids) -> torch.Tensor:
    """The draft's hidden states [1, T, H] over ``ids`` (whose target KV is in ``cache``), one token
    at a time, each query seeing the target's KV up to itself."""
    from longspec.kv.cache import DraftCache

    ring = DraftCache(draft.config, 1, tree_size=1, dtype=target.dtype, device=target.device)
    target_kv = target.last_layer_kv(cache)
    steps = []
    for i in range(ids.shape[1]):
        index = torch.full((1, 1), i)
        steps.append(draft.forward_step(ids[:, i:i + 1], index, index, torch.full((1, 1), -1),
                                        torch.ones(1, 1, dtype=torch.bool), ring, target_kv, cross_limit=index + 1))
    return torch.cat(steps, 1)


def rank_main(rank: int, world: int, init: str, jobs: list, out_dir: str) -> None:
    """One rank: every job (model folder, draft folder, case names) through :func:`run_cases`."""
    from longspec.parallel.group import join

    torch.set_num_threads(1)
    tp = join(rank, world, init, "cpu")
    try:
        results = {}
        for path, draft_dir, cases in jobs:
            target = load_target(path, tensor_parallel=tp)
            results[path] = run_cases(target, draft_dir, cases)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        tp.close()


def run_ranks(jobs: list, world: int = 2) -> list:
    """Runs :func:`rank_main` in ``world`` spawned processes; returns each rank's results."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        torch.multiprocessing.start_processes(rank_main, args=(world, init, jobs, tmp), nprocs=world,
                                              start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
