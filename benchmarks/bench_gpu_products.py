"""A GPU's linear products over few rows (a decode step's, a tree's): the layer's weight shapes of an
8B-shaped target, each product in the forms that could serve it, with the weights cycled through
copies beyond the L2 cache (as a step reads them, a layer's after another's); per shape, row count
and form the median time (CUDA events over a CUDA graph of many products) and the weight bytes
read per second.

    python benchmarks/bench_gpu_products.py --rows 1,16,69

Forms: ``linear`` F.linear(x, W) (what the layers call); ``nn`` x @ W^T with W^T stored contiguous;
``splitK S`` the K dimension cut in S batches of a batched product, summed (more programs
for a matrix whose N alone gives too few). Prints a line per shape, row count and form."""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from longspec.engine.runner import time_graph

# an 8B-shaped layer's products (N outputs, K inputs): q/k/v fused, o, gate/up fused, down; the LM head
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}


def timed_us(fn, copies: int, reps: int) -> float:
    """Median microseconds a product over ``reps`` graph replays of ``copies`` products each
    (one on each copy of the weight)."""
    return time_graph(lambda: [fn(i) for i in range(copies)], reps) * 1e6 / copies


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,69")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--splits", default="2,4")
    p.add_argument("--bytes", type=float, default=1.2e9, help="weight bytes cycled through (beyond L2)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.version.__version__}, bf16, "
          f"BLAS {torch.backends.cuda.preferred_blas_library()}", flush=True)
    print(f"{'shape':8} {'rows':>4} {'form':10} {'us':>8} {'TB/s':>6}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, min(16, int(args.bytes // (n * k * 2))))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            forms = {"linear": lambda i: F.linear(x, ws[i]), "nn": lambda i: x @ wts[i]}
            for s in map(int, args.splits.split(",")):
                if k % s == 0:
                    forms[f"splitK {s}"] = lambda i, s=s: torch.bmm(
                        x.view(m, s, k // s).transpose(0, 1), ws[i].view(n, s, k // s).permute(1, 2, 0)).sum(0)
            reference = F.linear(x, ws[0]).float()
            for form, fn in forms.items():
                err = (fn(0).float() - reference).abs().max().item()
                us = timed_us(fn, copies, args.reps)
                print(f"{name:8} {m:4d} {form:10} {us:8.2f} {n * k * 2 / us / 1e6:6.2f}"
                      + (f"  (max diff {err:.3g})" if err > 0.05 else ""), flush=True)
        del ws, wts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
