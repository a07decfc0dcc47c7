"""Top-k / top-p warping of a round's rows on CUDA: the sorting path against the searched cut
points (``longspec.spec.truncation``), each captured in a CUDA graph and timed by replaying
it, for several row counts (a decode step's 1, a tree's nodes) and vocabularies; and whether the
two keep exactly the same tokens (logits of a few scales; tied scores under top-k). Prints a table and
one JSON line last.

    python benchmarks/bench_truncation.py --vocab 49152,262144 --rows 1,16,27,74
    python benchmarks/bench_truncation.py --sweep 512:4,512:8,1024:8,1024:16   (block:warps of the program)
"""
from __future__ import annotations

import argparse
import json

import torch

from longspec.engine.runner import time_graph
from longspec.spec import sampling, truncation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="49152,262144")
    ap.add_argument("--rows", default="1,16,27,74")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--sweep", default="", help="BLOCK:NUM_WARPS settings of the searching program to time too")
    args = ap.parse_args()
    settings = [tuple(map(int, x.split(":"))) for x in args.sweep.split(",") if x]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, mismatches = [], 0
    print(f"{'vocab':>7} {'rows':>5} {'sorting ms':>11} {'searched ms':>12} {'speedup':>8}")
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            # (scale, top-k, top-p); tied scores (rounded) with top-k only: top-p keeps ties together
            for scale, top_k, top_p in ((1.0, 0, 0.9), (4.0, 0, 0.9), (4.0, 20, 0.8), (16.0, 50, 1.0)):
                logits = torch.randn(rows, vocab, device="cuda", generator=gen) * scale
                if top_p == 1.0:
                    logits = logits.round()
                k = torch.full((rows, 1), top_k, device="cuda")
                p = torch.full((rows, 1), top_p, device="cuda")
                a, b = sampling._truncate_sorting(logits, k, p), sampling._cut_apart(logits, k, p)
                mismatches += int((a.isfinite() != b.isfinite()).any(-1).sum())
            k = torch.full((rows, 1), args.top_k, device="cuda")
            p = torch.full((rows, 1), args.top_p, device="cuda")
            out = {}
            timed = {"sorting": lambda: out.__setitem__(0, sampling._truncate_sorting(logits, k, p).softmax(-1)),
                     "searched": lambda: out.__setitem__(0, sampling._cut_apart(logits, k, p).softmax(-1))}
            ms = {name: time_graph(fn) * 1e3 for name, fn in timed.items()}
            default = truncation.BLOCK, truncation.NUM_WARPS
            for block, warps in settings:
                truncation.BLOCK, truncation.NUM_WARPS = block, warps
                ms[f"searched {block}:{warps}"] = time_graph(timed["searched"]) * 1e3
            truncation.BLOCK, truncation.NUM_WARPS = default
            results.append(dict(vocab=vocab, rows=rows, **{f"{n}_ms": round(t, 4) for n, t in ms.items()}))
            print(f"{vocab:>7} {rows:>5} {ms['sorting']:>11.3f} {ms['searched']:>12.3f} "
                  f"{ms['sorting'] / ms['searched']:>7.2f}x", *(f"{k} {v:.3f}" for k, v in ms.items() if ":" in k))
    print(f"rows whose kept tokens differ between the two paths: {mismatches}")
    print(json.dumps(dict(top_k=args.top_k, top_p=args.top_p, mismatched_rows=mismatches, results=results)))


if __name__ == "__main__":
    main()
