"""Checks ``longspec.spec.acceptance.HIT_CORRELATION`` on held-out text: generates greedily with the
hybrid proposer (draft beam + lookup chain) and, for each tree, compares the measured tokens per
round with what ``expected_tokens`` predicts from the draft's acceptance table and the lookup's
true hit rates on the generated text, at several correlations (0: draft and lookup hits
independent, 1: a level holds the better of the two alone). Prints one line per (prompt, tree)
and the mean absolute error per correlation; one JSON line last. CPU or GPU, float32.

    python benchmarks/hit_correlation.py --prompt-dir SITE/rich --prompt-dir SITE/httpx --lengths 2048,4096
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_generate import code_prompt
from longspec import GenerationConfig, default_draft_path, default_model_path, load_draft, load_target
from longspec.spec import acceptance
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.tree import TreeSpec

CORRELATIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model directory (default: the default model)")
    p.add_argument("--draft", default=None, help="draft directory (default: the shipped draft)")
    p.add_argument("--prompt-dir", action="append", required=True, help="held-out source code (repeatable)")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--trees", default="4,4,4,4,4,1,1,1,1,1;4,16,16,16,16,1,1,1,1,1;2,2,2,2,2")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_dir = args.target or str(default_model_path())
    target = load_target(target_dir, dtype=torch.float32, device=device)
    target.compile_steps = False
    draft = load_draft(args.draft or default_draft_path(), target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    for directory in args.prompt_dir:
        for length in (int(x) for x in args.lengths.split(",")):
            prompt = code_prompt(tokenizer, Path(directory), length)
            for tree in args.trees.split(";"):
                out = Generator(target, LongSpecProposer(draft, PromptLookup()), tree, cuda_graphs=False).generate(
                    [prompt], config)
                tokens = prompt + out.sequences[0]
                hits = acceptance.lookup_acceptance(tokens, tail=len(out.sequences[0]))
                predicted = {}
                for c in CORRELATIONS:
                    acceptance.HIT_CORRELATION = c
                    predicted[c] = acceptance.expected_tokens(TreeSpec.parse(tree), draft.config.acceptance, hits)
                row = dict(prompt=Path(directory).name, length=length, tree=tree, tau=out.stats["tau"],
                           predicted={str(c): round(v, 3) for c, v in predicted.items()})
                rows.append(row)
                print(f"{row['prompt']:<10} {length:>5} {tree:<24} tau {row['tau']:5.2f}  predicted "
                      + " ".join(f"{c:g}:{v:.2f}" for c, v in predicted.items()), flush=True)
    errors = {str(c): round(sum(abs(r["predicted"][str(c)] - r["tau"]) for r in rows) / len(rows), 3)
              for c in CORRELATIONS}
    print("mean |predicted - measured| by correlation:", errors)
    print(json.dumps({"rows": rows, "mean_abs_error": errors}))


if __name__ == "__main__":
    main()
