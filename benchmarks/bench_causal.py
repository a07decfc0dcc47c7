"""A prompt's causal self-attention (``is_causal``, queries and keys the same T tokens, one layer)
through each of PyTorch's fused SDPA backends, alone: which one a long prefill should use. GQA is
tried two ways, with ``enable_gqa`` (K/V heads shared) and with K/V repeated to the query heads
(some backends take no GQA); a backend that cannot run a case says why. Rates count 4 * D FLOPs per
(query head, causal query-key pair). ``--queries N`` times instead N queries over each length's
keys without a mask (a prompt's chunk over a long prefix: how a backend's rate follows the keys).

    python benchmarks/bench_causal.py --lengths 8192,32768,131072 --heads 32 --kv-heads 8 --head-dim 128
    python benchmarks/bench_causal.py --lengths 524288,1048576 --queries 16384 --head-dim 64 --backends cudnn

Prints a table and one JSON line last."""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events; one untimed call first)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--queries", type=int, default=0, help="this many queries over all keys, no mask (0: causal)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"of {', '.join(BACKENDS)}")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{h} query heads, {hkv} KV heads, head_dim {d}, {args.dtype}", flush=True)
    for t in (int(x) for x in args.lengths.split(",")):
        n = args.queries or t
        q = torch.randn(1, h, n, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, hkv, t, d, device="cuda", dtype=dtype) for _ in range(2))
        reference = None
        for name in args.backends.split(","):
            backend = BACKENDS[name]
            for gqa in ("enable_gqa", "repeated"):
                kk, vv = (k, v) if gqa == "enable_gqa" else (k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))

                def call():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=not args.queries,
                                                              enable_gqa=gqa == "enable_gqa")

                try:
                    out = call()
                    if reference is None:
                        reference = out
                    err = (out.float() - reference.float()).abs().max().item()
                    ms = time_ms(call, args.repeats)
                    tflops = 4 * d * h * (n * t if args.queries else t * (t + 1) / 2) / ms / 1e9
                    row = dict(length=t, queries=n, backend=name, gqa=gqa, ms=ms, tflops=tflops, max_diff=err)
                    print(f"{n:>8} x {t:>8} {name:<10} {gqa:<11} {ms:10.2f} ms {tflops:7.1f} TFLOP/s "
                          f"(max diff {err:.3g})", flush=True)
                except RuntimeError as e:
                    row = dict(length=t, queries=n, backend=name, gqa=gqa, error=str(e).splitlines()[0][:120])
                    print(f"{n:>8} x {t:>8} {name:<10} {gqa:<11} cannot run: {row['error']}", flush=True)
                rows.append(row)
                del kk, vv
        del q, k, v, reference
        torch.cuda.empty_cache()
    print(json.dumps({"heads": h, "kv_heads": hkv, "head_dim": d, "dtype": args.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
