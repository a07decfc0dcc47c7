"""Prefill latency of a prompt, eager against ``compile_prefill`` (causal chunks through one
dynamically shaped compiled layer), on a random-weight target of a known shape (a prefill's time
does not depend on the weights' values): what a server's arriving request costs every running
stream (README "Serving"). Wall time of whole prefills (host work included: it is most of a
short prompt's prefill), synchronised, median of ``--repeats`` after warm-up calls that compile.
Prints a table and one JSON line last.

    python benchmarks/bench_prefill.py --shape smollm2 --lengths 256,1700,4000 --rows 1,2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import SHAPES, random_target  # noqa: E402


def prefill_s(target, rows: int, length: int, repeats: int) -> float:
    cache = target.new_cache(rows, length + 64)
    ids = torch.randint(0, target.config.vocab_size, (rows, length), device=target.device)
    lengths = torch.full((rows,), length)
    times = []
    for i in range(repeats + 2):  # the first two: compilation (a new length may guard once more)
        cache.lengths.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.prefill(ids, lengths, cache)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--lengths", default="256,1700,4000")
    p.add_argument("--rows", default="1,2")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    target = random_target(args.shape, getattr(torch, args.dtype))
    target.compile_steps = True  # as load_target sets it on CUDA
    results = []
    print(f"{'rows':>4} {'tokens':>6} {'eager ms':>9} {'compiled ms':>12} {'eager / compiled':>17}")
    for rows in map(int, args.rows.split(",")):
        for length in map(int, args.lengths.split(",")):
            ms = {}
            for compiled in (False, True):
                target.compile_prefill = compiled
                ms[compiled] = 1e3 * prefill_s(target, rows, length, args.repeats)
            results.append(dict(rows=rows, tokens=length, eager_ms=ms[False], compiled_ms=ms[True]))
            print(f"{rows:>4} {length:>6} {ms[False]:9.2f} {ms[True]:12.2f} {ms[False] / ms[True]:17.2f}", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape, "dtype": args.dtype,
                      "results": results}))


if __name__ == "__main__":
    main()
