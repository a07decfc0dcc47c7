"""Tensor-parallel step times: a target of a known shape with random weights built in memory (no
download), split over 1, 2, 4 ... ranks (one GPU each, NCCL; on the CPU gloo processes), its
decode step and verify step at a context, each against the per-GPU bandwidth floor (the bytes of
this rank's weights and KV cache read once per step / the HBM bandwidth, 4.8 TB/s on an H200),
and speculative decoding with a random LongSpec draft (every rank runs the draft over its share of
the last layer's KV heads). Prints a line per setting and one JSON line last; ``--out`` writes
the JSON too.

    python benchmarks/bench_tensor_parallel.py --tp 1,2 --shape llama-8b --context 32768 --out tp_8b.json
    python benchmarks/bench_tensor_parallel.py --tp 2,4 --shape llama-70b --context 32768 --spec --out tp_70b.json
    python benchmarks/bench_tensor_parallel.py --tp 1,2 --shape tiny --context 256 --device cpu   # smoke test

On CUDA each rank captures its steps in CUDA graphs with the NCCL collectives inside (``--eager``:
no graphs, no compilation). Goal: at 32k the 8B shape's decode step at TP 2 within 0.6x of TP 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import SHAPES, random_target  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200


def step_bytes(target, context: int) -> int:
    """Bytes one decode step reads on this rank: its weights (the embedding only a row) and its
    KV heads of ``context`` tokens in every layer."""
    weights = sum(p.nbytes for n, p in target.named_parameters() if "embed_tokens" not in n)
    kv = target.cache_config
    return weights + 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * context * target.dtype.itemsize


def timed(fn, device: torch.device, eager: bool, replays: int) -> float:
    """Median seconds of ``fn``: replays of its CUDA graph (captured with the collectives inside),
    or eager calls (CPU, ``--eager``)."""
    if device.type == "cuda" and not eager:
        from longspec.decoding.runner import time_graph

        return time_graph(fn, replays=replays, device=device)
    fn()
    times = []
    for _ in range(replays):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def steps(target, args) -> dict:
    """Decode and verify step times at ``args.context`` (the cache's lengths set there: a step's
    time does not depend on the cached values)."""
    device, m = target.device, args.tree_tokens
    cache = target.new_cache(1, args.context + m)
    cache.lengths.fill_(args.context)
    n_keys = cache.max_len
    token = torch.zeros(1, dtype=torch.long, device=device)
    keep = torch.zeros(1, dtype=torch.long, device=device)
    tokens = torch.zeros(1, m, dtype=torch.long, device=device)
    positions = args.context + torch.arange(m, device=device)[None]
    mask = torch.ones(m, m, dtype=torch.bool, device=device).tril()[None]

    def verify():
        target.verify(tokens, positions, mask, cache, n_keys=n_keys)
        cache.discard()

    decode_s = timed(lambda: target.decode(token, cache, n_keys=n_keys, advance=keep), device, args.eager, args.replays)
    verify_s = timed(verify, device, args.eager, args.replays)
    floor = step_bytes(target, args.context) / HBM_BYTES_PER_S
    return dict(decode_ms=decode_s * 1e3, verify_ms=verify_s * 1e3, floor_ms=floor * 1e3,
                decode_over_floor=decode_s / floor, verify_tokens=m)


@torch.inference_mode()
def speculative(target, args) -> dict:
    """Generation with a random LongSpec draft (replicated on every rank) over a random prompt
    of ``args.context`` tokens: round times and tokens/s."""
    from longspec import GenerationConfig, Generator
    from longspec.decoding.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    draft = init_draft(DraftConfig.for_target(target, window=512), target, seed=0)
    draft.fuse_projections()
    gen = Generator(target, LongSpecProposer(draft), args.tree, max_len=args.context + args.new_tokens + 256,
                    cuda_graphs=not args.eager)
    prompt = torch.randint(0, target.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    gen.generate(prompt.tolist()[-1024:], GenerationConfig(max_new_tokens=8))  # capture and compile
    stats = gen.generate(prompt.tolist(), config).stats
    rounds = max(stats["steps"], 1)
    return dict(spec_tokens_per_s=stats["tokens_per_s"], spec_tau=stats["tau"], spec_prefill_s=stats["prefill_s"],
                spec_round_ms=stats["decode_s"] / rounds * 1e3, spec_draft_ms=stats["draft_s"] / rounds * 1e3,
                spec_verify_ms=stats["verify_s"] / rounds * 1e3, spec_tree=str(args.tree))


def rank_main(rank: int, world: int, init: str, args, out_dir: str) -> None:
    from longspec.models.checkpoint import use_device_kernels
    from longspec.parallel.group import join

    tp = join(rank, world, init, args.device)
    try:
        dtype = getattr(torch, args.dtype)
        target = random_target(args.shape, dtype, tensor_parallel=tp)
        use_device_kernels(target)
        if args.eager:
            target.compile_steps = False
        result = dict(tp=world, shape=args.shape, context=args.context, dtype=args.dtype, eager=args.eager,
                      weights_gib_per_rank=sum(p.nbytes for p in target.parameters()) / 2 ** 30)
        result.update(steps(target, args))
        if args.spec:
            result.update(speculative(target, args))
        times = tp.gather_objects(result["decode_ms"])
        result["decode_ms_ranks"] = times
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
    finally:
        tp.close()


def run(world: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        torch.multiprocessing.start_processes(rank_main, args=(world, init, args, tmp), nprocs=world,
                                              start_method="spawn")
        return json.loads(Path(tmp, "result.json").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (default: 1,2)")
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES), help="target shape (random weights)")
    p.add_argument("--context", type=int, default=32768, help="cached tokens (default: 32768)")
    p.add_argument("--tree-tokens", type=int, default=64, help="tokens of a verify step (default: 64)")
    p.add_argument("--spec", action="store_true", help="also speculative decoding with a random LongSpec draft")
    p.add_argument("--tree", default="4,16,16,16,16", help="the draft's tree (default: 4,16,16,16,16)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated by --spec (default: 64)")
    p.add_argument("--replays", type=int, default=20, help="timed calls per step (default: 20)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU by default")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs, no compilation (the fallback)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default: 1)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.tp.split(",")]
    if args.device == "cuda" and max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tp {max(sizes)} needs {max(sizes)} GPUs, {torch.cuda.device_count()} visible")
    results = []
    for world in sizes:
        r = run(world, args)
        results.append(r)
        spec = (f", speculative {r['spec_tokens_per_s']:.1f} tok/s (tau {r['spec_tau']:.2f}, round "
                f"{r['spec_round_ms']:.2f} ms: draft {r['spec_draft_ms']:.2f}, verify {r['spec_verify_ms']:.2f})"
                if args.spec else "")
        print(f"TP {world}: decode {r['decode_ms']:.3f} ms (floor {r['floor_ms']:.3f} ms, "
              f"{r['decode_over_floor']:.2f}x), verify {r['verify_tokens']} tokens {r['verify_ms']:.3f} ms{spec}",
              flush=True)
    summary = dict(shape=args.shape, context=args.context, results=results)
    if 1 in sizes and 2 in sizes:
        one, two = (next(r for r in results if r["tp"] == n) for n in (1, 2))
        summary["decode_tp2_over_tp1"] = two["decode_ms"] / one["decode_ms"]
        summary["goal_tp2_within_0.6x"] = summary["decode_tp2_over_tp1"] <= 0.6
    line = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
