"""Where the time of the Triton kernel's small part beside the Hopper prefix kernel goes (the keys
after the prefix's whole 128-key blocks, and the tree under its mask): a few keys for each of a
69-node tree's 276 packed rows a KV head at the 8B shape, yet a verify step's profile shows it at
about 20 us a layer. Times that part alone (the Hopper kernel's call replaced by nothing: its
parts left as allocated, so the merge may skip or read them), then with one thing changed at a
time, and small Triton launches for scale (CUDA-graph replays, median; bf16).

    python benchmarks/diagnose_tail.py --context 32768"""
from __future__ import annotations

import argparse

import torch

from bench_attention import timed
from longspec.attention import hopper_prefix, triton_kernels
from longspec.attention.triton_kernels import KernelConfig, masked_attention, tree_attention


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--nodes", type=int, default=69)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    h, hkv, d, m, s = 32, 8, args.head_dim, args.nodes, args.context
    cap = s + 128 + m
    q = torch.randn(1, h, m, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(1, hkv, cap, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    tree = torch.rand(1, m, m, device="cuda") < 0.3
    ragged, aligned = (torch.tensor([n], device="cuda") for n in (s + 100, s))
    hop = KernelConfig(hopper=True)
    real = hopper_prefix.prefix_parts

    def time(name, fn):
        print(f"{name:<58} {timed(fn, args.repeats) * 1e6:8.1f} us", flush=True)

    time("whole op (Hopper kernel + the part + merge)", lambda: tree_attention(q, k, v, ragged, tree, hop))
    hopper_prefix.prefix_parts = lambda *a, **kw: None  # the part and the merge alone
    try:
        time("the part + merge, 100 keys after the blocks", lambda: tree_attention(q, k, v, ragged, tree, hop))
        time("the part + merge, no keys after the blocks", lambda: tree_attention(q, k, v, aligned, tree, hop))
        time("the part + merge, a tree of 1 key", lambda: tree_attention(q, k, v, ragged, tree[:, :, :1], hop))
        time("the part + merge, TMA off", lambda: tree_attention(q, k, v, ragged, tree, KernelConfig(hopper=True,
                                                                                                   tma=False)))
    finally:
        hopper_prefix.prefix_parts = real
    small = KernelConfig(hopper=False)
    k_short, v_short = (x[:, :, :256].contiguous() for x in (k, v))
    short = torch.tensor([100], device="cuda")
    time("Triton kernel alone over 100 keys + the tree",
         lambda: tree_attention(q, k_short, v_short, short, tree, small))
    time("masked attention, the tree's keys only", lambda: masked_attention(
        q, k_short[:, :, :m].contiguous(), v_short[:, :, :m].contiguous(), tree))
    time("decode, one query over 100 keys", lambda: tree_attention(
        q[:, :, :1].contiguous(), k_short, v_short, short, tree[:, :1, :1], small))
    ring = torch.rand(1, 16, 582, device="cuda") < 0.9  # a draft level's 16 nodes over its ring buffer
    k_ring, v_ring = (torch.randn(1, hkv, 582, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    time("draft self-attention: 16 queries over 582 slots", lambda: masked_attention(
        q[:, :, :16].contiguous(), k_ring, v_ring, ring))
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    for n in (1, 4, 8, 16):
        x = torch.randn(n, 4096, dtype=torch.bfloat16, device="cuda")
        time(f"a 4096 x 4096 projection of {n} rows (floor 11 us)", lambda: torch.nn.functional.linear(x, weight))
    time("merge-sized launch: torch.add of 2 x 276 x 128 x 8", lambda: torch.add(
        *(torch.empty(8, 2, 276, d, device="cuda") for _ in range(2))))
    print("triton_kernels.DEFAULT_CONFIG:", triton_kernels.DEFAULT_CONFIG)


if __name__ == "__main__":
    main()
