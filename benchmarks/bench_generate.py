"""Speculative decoding benchmark on long real inputs: autoregressive baseline vs prompt lookup
(PLD), StreamingLLM self-speculation (MagicDec) and the LongSpec draft, in the same run.

For each context length, the prompt is real source code (files of one project concatenated,
cut to the length) and every method generates ``--max-new-tokens`` greedy tokens. Reports
acceptance length tau, tokens/s (decode), speedup over autoregressive, peak memory, and whether
the output equals the autoregressive output token for token. Prints one JSON line last.

    python benchmarks/bench_generate.py --target DIR [--draft DIR] --prompt-dir SRC_DIR \
        --lengths 2048,4096,7900 --max-new-tokens 128 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from longspec import GenerationConfig, load_target  # noqa: E402
from longspec.decoding.engine import Generator  # noqa: E402
from longspec.decoding.proposers import LongSpecProposer, PromptLookup, StreamingSelfSpec  # noqa: E402
from longspec.decoding.tree import TreeSpec  # noqa: E402
from longspec.models.checkpoint import load_draft  # noqa: E402


def code_prompt(tokenizer, directory: Path, n_tokens: int) -> list:
    """Concatenated source files of ``directory`` (sorted, with path headers), cut to n_tokens."""
    parts, total = [], 0
    for path in sorted(directory.rglob("*.py")):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(f"# ==== {path.relative_to(directory)} ====\n{text}")
        total += len(text) // 3
        if total > n_tokens * 2:
            break
    ids = tokenizer("".join(parts)).input_ids
    if len(ids) < n_tokens:
        raise ValueError(f"{directory} holds only {len(ids)} tokens, {n_tokens} asked")
    return ids[:n_tokens]


def methods(args, target):
    out = {"ar": (None, None),
           "pld": (PromptLookup(), TreeSpec.parse(args.pld_tree)),
           "streaming": (StreamingSelfSpec(window=args.window), TreeSpec.parse(args.tree))}
    if args.draft:
        draft = load_draft(args.draft, target)
        out["longspec"] = (LongSpecProposer(draft), TreeSpec.parse(args.tree))
        out["longspec-chain"] = (LongSpecProposer(draft), TreeSpec.parse(args.chain_tree))
    return {k: v for k, v in out.items() if k in args.methods.split(",") or args.methods == "all"}


def run_one(target, proposer, tree, prompt, config, repeats):
    gen = Generator(target, proposer=proposer, tree=tree)
    gen.generate([prompt[:256]], GenerationConfig(max_new_tokens=8, ignore_eos=True))  # warm-up
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        out = gen.generate([prompt], config)
        times.append(out.stats["decode_s"])
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
    decode_s = statistics.median(times)
    return out, {"tokens_per_s": (out.stats["new_tokens"] - 1) / decode_s, "decode_s": decode_s,
                 "prefill_s": out.stats["prefill_s"], "tau": out.stats.get("tau", 1.0),
                 "draft_s": out.stats.get("draft_s", 0.0), "verify_s": out.stats.get("verify_s", 0.0),
                 "peak_mib": peak, "steps": out.stats["steps"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--prompt-dir", required=True, help="a directory of source code (one project)")
    p.add_argument("--lengths", default="2048,4096,7900")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="4,16,16,16,16")
    p.add_argument("--chain-tree", default="chain:5")
    p.add_argument("--pld-tree", default="chain:5")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--methods", default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    for n in map(int, args.lengths.split(",")):
        prompt = code_prompt(tokenizer, Path(args.prompt_dir), n)
        reference, baseline = None, None
        for name, (proposer, tree) in methods(args, target).items():
            out, res = run_one(target, proposer, tree, prompt, config, args.repeats)
            if name == "ar":
                reference, baseline = out.sequences[0], res["tokens_per_s"]
            res.update(method=name, context=n, tree=str(tree) if tree else None,
                       matches_ar=(out.sequences[0] == reference) if reference is not None else None,
                       speedup=res["tokens_per_s"] / baseline if baseline else None)
            rows.append(res)
            print(f"{n:>6} {name:<15} tau {res['tau']:5.2f}  {res['tokens_per_s']:8.1f} tok/s  "
                  f"x{(res['speedup'] or float('nan')):5.2f}  peak {res['peak_mib']:8.0f} MiB  "
                  f"draft {res['draft_s']:.2f}s verify {res['verify_s']:.2f}s  same-as-AR {res['matches_ar']}",
                  flush=True)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": device_name, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                      "results": rows}))


if __name__ == "__main__":
    main()
