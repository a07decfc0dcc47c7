"""What a prompt's prefill by layer pays the first time its length is seen in a process: for
each length of ``--lengths`` in order (repeat one to see it warm), one admission through the
engine with the prompt by layer, its wall time split into the causal attention calls, the K/V
stores and the rest (each timed with a device sync around it). Then the causal attention alone at
``--attention-lengths``, first and second call: cuDNN first (as ``fast.causal_attention``) with the
layouts the prefill passes (queries a transposed view, K/V views of the pool) and with contiguous
copies (a new shape's plan cost), and flash alone.

    python benchmarks/diagnose_first_prefill.py --shape llama-8b --lengths 32768,32768,40000,40000,36000
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_steps import random_target
from longspec.attention import fast
from longspec.engine.engine import Engine, Sequence
from longspec.spec.proposers import LongSpecProposer
from longspec.spec.tree import TreeSpec
from longspec.models import layer_prefill
from longspec.models.draft import DraftConfig, init_draft

SPENT: dict = defaultdict(float)


def timed(name: str, fn):
    """``fn`` with its device time (sync before and after) added to ``SPENT[name]``."""
    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        SPENT[name] += time.perf_counter() - t0
        return out
    return wrapper


def attention_alone(target, lengths: list) -> None:
    c = target.config
    pool = torch.randn(c.num_kv_heads, max(lengths) + 4096, c.head_dim, device="cuda", dtype=target.dtype)
    for n in dict.fromkeys(lengths):
        queries = torch.randn(1, n, c.num_heads, c.head_dim, device="cuda", dtype=target.dtype)
        k = pool[None, :, :n]  # [1, Hkv, n, D], head stride of the pool
        for layout, args in (("views", (queries.transpose(1, 2), k, k)),
                             ("contiguous", (queries.transpose(1, 2).contiguous(), k.contiguous(), k.contiguous())),
                             ("flash", (queries.transpose(1, 2), k, k))):
            backends = [SDPBackend.FLASH_ATTENTION] if layout == "flash" else fast.CAUSAL_BACKENDS
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel(backends, set_priority=True):
                    F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            print(f"attention alone {n:>7} {layout:<10}: first {times[0]:8.1f} ms, again {times[1]:8.1f} ms", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--lengths", default="32768,32768,40000,40000,36000")
    p.add_argument("--attention-lengths", default="2048,7600,8192,16384,32768,40000,131072",
                   help="lengths of the attention-alone part")
    p.add_argument("--warm-up", type=int, default=2048, help="a prompt by layer of this length first (0: none)")
    p.add_argument("--contiguous", action="store_true", help="contiguous copies into the causal attention")
    p.add_argument("--no-attention-warm-up", action="store_true",
                   help="leave cuDNN's set-up to the first prompt by layer (the engine's warm-up pays it by default)")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    t0 = time.perf_counter()
    target = random_target(args.shape, torch.bfloat16, "cuda")
    target.attention_impl, target.compile_steps = "triton", False  # (only the prefill by layer is timed)
    draft = init_draft(DraftConfig.for_target(target), target)
    draft.fuse_projections()
    engine = Engine(target, LongSpecProposer(draft), TreeSpec.parse("4,16,16,16,16"), max_batch=1,
                    max_len=max(lengths) + 2048 + 200, prefill_chunk=2048)
    engine.warm_up(prefill_by_layer=not args.no_attention_warm_up)
    engine.chunked_prefill.by_layer_from = 1
    print(f"target and engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    attend = layer_prefill.causal_attention
    if args.contiguous:
        def attend(q, k, v, inner=attend):
            return inner(q.contiguous(), k.contiguous(), v.contiguous())
    layer_prefill.causal_attention = timed("attention", attend)
    layer_prefill.store_kv = timed("store K/V", layer_prefill.store_kv)
    for n in ([args.warm_up] if args.warm_up else []) + lengths:
        prompt = torch.randint(0, target.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        SPENT.clear()
        seq = Sequence(prompt, 4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add([seq])
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0)
        engine.cancel(seq) if not seq.done else None
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in SPENT.items())
        print(f"admission {n:>7}: {wall:8.1f} ms ({parts}, rest {wall - 1e3 * sum(SPENT.values()):.1f})", flush=True)
    attention_alone(target, [int(n) for n in args.attention_lengths.split(",")])


if __name__ == "__main__":
    main()
