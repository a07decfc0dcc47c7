"""Does the draft lose accuracy as the context grows? The same ``--tail`` tokens of held-out text,
each read after ``n`` tokens of context for every ``n`` of ``--contexts``; for each n, teacher-forced:
the target's top-1 accuracy on the text, and the draft's top-1 agreement with the target and with
the text at each cross-attention lag (lag g: the draft sees the target's KV up to g tokens back,
as a tree node at depth g - 1 does). Only the amount of context changes between the rows, so a
falling agreement is the draft's own long-context loss (what tau at 32k against 2k measures with
generation noise on top).

    python benchmarks/draft_context.py --draft longspec/assets/smollm2-draft \
        --data STDLIB/asyncio --contexts 256,1024,4096,7680
    python benchmarks/draft_context.py --target GEMMA --draft gemma3-draft --data STDLIB/asyncio \
        --contexts 2048,8192,32512 --device cuda --dtype bfloat16

Prints a line per context and one JSON line last.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_generate import add_target_args, code_prompt, target_from_args
from longspec.models.checkpoint import load_draft


@torch.no_grad()
def context_row(target, draft, ids: torch.Tensor, tail: int, lags: list) -> dict:
    """ids [n + tail] (long): the agreements over its last ``tail`` positions."""
    inputs, labels = ids[None, :-1], ids[1:]
    n = inputs.shape[1]
    cache = target.new_cache(1, n)
    logits = target.prefill(inputs, torch.tensor([n]), cache, all_logits=True)[0]
    dtype = next(draft.parameters()).dtype
    k, v = (x.to(dtype) for x in target.last_layer_kv(cache).dense(n))  # once for every lag
    positions = torch.arange(n, device=ids.device)[None]
    target_top = logits.argmax(-1)
    last = slice(n - tail, n)
    row = {"context": n + 1 - tail, "target_acc": float((target_top[last] == labels[last]).float().mean())}
    for lag in lags:
        hidden = draft.forward_train(inputs, positions, k, v, lag=lag)
        picked = draft.logits(hidden, reduced=False)[0].argmax(-1)
        row[f"lag{lag}_vs_target"] = float((picked[last] == target_top[last]).float().mean())
        row[f"lag{lag}_vs_text"] = float((picked[last] == labels[last]).float().mean())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True, help="a folder of held-out Python files (never trained on)")
    p.add_argument("--contexts", default="256,1024,4096,7680")
    p.add_argument("--tail", type=int, default=256, help="tokens scored after each context")
    p.add_argument("--lags", default="1,2,3")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    target_dir, dtype, target = target_from_args(args)
    draft = load_draft(args.draft, target)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    lags = [int(g) for g in args.lags.split(",")]
    text = code_prompt(AutoTokenizer.from_pretrained(target_dir), Path(args.data), contexts[-1] + args.tail)
    ids = torch.tensor(text, device=args.device)
    rows = []
    for n in contexts:
        start = time.perf_counter()
        row = context_row(target, draft, ids[len(ids) - args.tail - n:], args.tail, lags)
        rows.append(row)
        lag_text = "  ".join(f"lag {g}: {row[f'lag{g}_vs_target']:.3f} / {row[f'lag{g}_vs_text']:.3f}" for g in lags)
        print(f"context {n:>6}: target {row['target_acc']:.3f}; draft vs target / vs text  {lag_text}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    print(json.dumps({"target": target_dir, "draft": args.draft, "data": args.data, "tail": args.tail,
                      "dtype": str(dtype), "rows": rows}))


if __name__ == "__main__":
    main()
