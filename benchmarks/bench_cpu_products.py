"""A CPU's linear products over few rows: ``F.linear`` against ``longspec.models.layers.linear``
(weight @ x^T, one row doubled), for the default model's weight shapes, with the weights cycled
through enough copies to stay out of the caches (as a step reads them); per shape and number of
rows the median time and the weight bytes read per second.

    python benchmarks/bench_cpu_products.py --threads 2

Prints a line per shape and row count."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from longspec.models.layers import linear

# the default model's products (SmolLM2-135M): q/k/v fused, o, gate/up fused, down, the LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def median_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--bytes", type=float, default=400e6, help="weight bytes cycled through (beyond the caches)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for n, k in SHAPES:
        copies = max(2, int(args.bytes // (4 * n * k)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        turn = [0]

        def weight():
            turn[0] = (turn[0] + 1) % copies
            return weights[turn[0]]

        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            with torch.inference_mode():
                ref = median_ms(lambda: F.linear(x, weight()), args.reps)
                ours = median_ms(lambda: linear(x, weight()), args.reps)
            gb = 4 * n * k / 1e6
            print(f"weight {n} x {k}  rows {rows}:  F.linear {ref:7.3f} ms ({gb / ref:4.1f} GB/s)  "
                  f"linear {ours:7.3f} ms ({gb / ours:4.1f} GB/s)  {ref / ours:4.2f}x", flush=True)


if __name__ == "__main__":
    main()
