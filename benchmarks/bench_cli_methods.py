"""``longspec generate`` as a user runs it, one fresh process a call, methods interleaved: for each
round, each prompt once with each ``--proposer``; per call the decoding speed (tokens/s, the
prefill left out), tau, the rounds and the trees auto ran. A machine whose speed drifts (a shared
CPU) moves calls next to each other alike, so the headline is paired: each call of ``auto``
against the faster of the other methods' calls on the same prompt in the same round, the median
and the worst over the rounds.

    python benchmarks/bench_cli_methods.py --prompt-file A.py --prompt-file B.py \\
        --prompt "def fibonacci(n):" --methods auto,none,pld --rounds 5 --max-new-tokens 128 \\
        --extra "--threads 2"

Prints a line per call, the paired summary, and one JSON line last."""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys


def run_call(prompt: tuple, method: str, args) -> dict:
    kind, text = prompt
    cmd = [sys.executable, "-m", "longspec.cli", "generate", "--prompt-file" if kind == "file" else "--prompt",
           text, "--max-new-tokens", str(args.max_new_tokens), "--proposer", *shlex.split(method), "--json",
           *shlex.split(args.extra)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    stats = json.loads(out.stdout.strip().splitlines()[-1]).get("stats", {})
    return dict(tokens_per_s=stats["tokens_per_s"], tau=stats.get("tau") or 1.0, steps=stats.get("steps"),
                trees=stats.get("trees"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-file", action="append", default=[], help="a prompt file (repeatable)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt text (repeatable)")
    p.add_argument("--methods", default="auto,none,pld", help="--proposer values (each may carry more "
                   "arguments: \"pld --tree chain:8\"); the first is paired against the faster of the others")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--extra", default="", help="more `longspec generate` arguments, e.g. \"--threads 2 --chat\"")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    prompts = [("file", f) for f in args.prompt_file] + [("text", t) for t in args.prompt]
    if not prompts:
        raise SystemExit("give --prompt-file or --prompt")
    methods = args.methods.split(",")
    calls = []
    for r in range(args.rounds):
        for prompt in prompts:
            for method in (methods if r % 2 == 0 else methods[::-1]):  # (alternating order)
                res = dict(round=r, prompt=prompt[1], method=method, **run_call(prompt, method, args))
                calls.append(res)
                print(f"round {r}  {prompt[1][:40]:<40}  {method:<8}  tokens/s {res['tokens_per_s']:6.1f}  "
                      f"tau {res['tau']:5.2f}  rounds {res['steps']}  trees {res['trees']}", flush=True)
    summary = {}
    first, others = methods[0], methods[1:]
    for _, text in prompts:
        speeds = {m: [c["tokens_per_s"] for c in calls if c["prompt"] == text and c["method"] == m] for m in methods}
        ratios = [speeds[first][r] / max(speeds[m][r] for m in others) for r in range(args.rounds)] if others else []
        summary[text] = dict(median_tokens_per_s={m: statistics.median(v) for m, v in speeds.items()},
                             paired_median=statistics.median(ratios) if ratios else None,
                             paired_worst=min(ratios) if ratios else None)
        med = "  ".join(f"{m} {statistics.median(v):.1f}" for m, v in speeds.items())
        pair = (f"  {first} / faster of {','.join(others)}: median {summary[text]['paired_median']:.2f}x, "
                f"worst {summary[text]['paired_worst']:.2f}x" if ratios else "")
        print(f"{text[:40]:<40}  median tokens/s: {med}{pair}")
    print(json.dumps({"calls": calls, "summary": summary}))


if __name__ == "__main__":
    main()
