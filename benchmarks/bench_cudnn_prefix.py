"""A tree's prefix part through cuDNN's attention, against our kernels: the G x M packed query
rows of each KV head as that head's queries (so a 69-node tree of 4 query heads a KV head is
276 rows, as our kernels pack them), the cached keys cut into ``n`` chunks laid out as a batch
(cuDNN's attention has no split-KV of its own), one output and LSE per chunk (what the merge of
the parts needs). Timed as bench_attention.py times (CUDA-graph replays, median), beside our
``tree_attention`` (the default kernel config: the Hopper kernel where it applies) on the same
shapes in the same process.

    python benchmarks/bench_cudnn_prefix.py --shapes 32x8x128@131072,32x8x64@1048576 --trees 69 --splits 1,8,16,32
"""
from __future__ import annotations

import argparse

import torch

from bench_attention import timed
from longspec.attention.triton_kernels import KernelConfig, tree_attention


CHECKED_KEYS = 131072  # the merged chunks are checked up to this many keys (the float32 scores' memory)


def merged_error(out, lse, rows, k, v, d):
    """Max abs error of the chunks' outputs merged by their LSE (natural log, as cuDNN returns it)
    against float32 attention of the packed rows ``[Hkv, R, D]`` over all keys ``[Hkv, S, D]``."""
    lse = lse.float().squeeze(-1)  # [n, Hkv, R]
    w = torch.softmax(lse, dim=0)[..., None]
    merged = (w * out.float()).sum(0)
    ref = torch.softmax(rows.float() @ k.float().transpose(-1, -2) * d ** -0.5, -1) @ v.float()
    return (merged - ref).abs().max().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x8x128@131072,32x8x64@1048576")
    p.add_argument("--trees", default="69")
    p.add_argument("--splits", default="1,8,16,32", help="key chunks (a batch for cuDNN)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        heads, s = shape.split("@")
        h, hkv, d = map(int, heads.split("x"))
        s, g = int(s), h // hkv
        for m in map(int, args.trees.split(",")):
            q = torch.randn(1, h, m, d, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(1, hkv, s + m, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            lengths = torch.tensor([s], device="cuda")
            tree = torch.tril(torch.ones(m, m, dtype=torch.bool, device="cuda"))[None]
            ours = timed(lambda: tree_attention(q, k, v, lengths, tree, KernelConfig()), 20)
            flops = 4 * h * m * s * d
            print(f"{shape} M={m:>3} ours (whole tree attention)      {ours * 1e6:9.1f} us "
                  f"{flops / ours / 1e12:6.1f} TFLOP/s", flush=True)
            rows = q.view(hkv, g * m, d)  # packed rows of each KV head (g-major, as our kernels)
            for n in map(int, args.splits.split(",")):
                if s % n:
                    continue
                qs = rows[None].expand(n, hkv, g * m, d).contiguous()
                for layout in ("strided", "contiguous"):
                    ks, vs = (t[0, :, :s].view(hkv, n, s // n, d).transpose(0, 1) for t in (k, v))
                    if layout == "contiguous":
                        ks, vs = ks.contiguous(), vs.contiguous()
                    try:
                        def run():
                            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                                qs, ks, vs, None, True, 0.0, False, False, scale=d ** -0.5)[:2]
                        out, lse = run()
                        err = (merged_error(out, lse, rows, k[0, :, :s], v[0, :, :s], d) if s <= CHECKED_KEYS
                               else float("nan"))
                        took = timed(run, 20)
                    except Exception as e:  # noqa: BLE001 - reported
                        print(f"{shape} M={m:>3} cudnn n={n:>3} {layout:<10} {type(e).__name__}: {str(e)[:200]}",
                              flush=True)
                        continue
                    print(f"{shape} M={m:>3} cudnn n={n:>3} {layout:<10} {took * 1e6:9.1f} us "
                          f"{flops / took / 1e12:6.1f} TFLOP/s  x{took / ours:.3f} ours  lse {tuple(lse.shape)} "
                          f"merged err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
