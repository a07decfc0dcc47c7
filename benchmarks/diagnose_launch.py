"""How much of a round the device spends waiting for the host: the decode round's CUDA graph
replayed back to back (the launch hidden behind the previous replay) against one replay at a
time with a sync after each (as ``Engine.step`` runs it: its tokens go to the host every round),
and ``Engine.step`` itself; plus the host's time in the launch call alone. Random weights of ``--shape``, plain decode, batch 1, a row of
``--context`` tokens. (Each replay decodes one more token into the row.)

    python benchmarks/diagnose_launch.py --shape llama-8b --context 16384
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench_steps import SHAPES, cuda_defaults, random_target

from longspec.engine.engine import Sequence


def timings(graph, repeats: int) -> dict:
    """Milliseconds per replay of ``graph``: back to back, one at a time synced, and the host's
    time in the launch call."""
    sync = torch.cuda.synchronize
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    sync()
    chained = (time.perf_counter() - start) / repeats
    synced, launch = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        sync()
        synced.append(time.perf_counter() - t0)
        launch.append(t1 - t0)
    return {"chained": 1e3 * chained, "synced": 1e3 * statistics.median(synced),
            "launch": 1e3 * statistics.median(launch)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    from longspec.serving.server import build_server

    target = cuda_defaults(random_target(args.shape, torch.bfloat16, "cuda"))
    max_len = args.context + 4 * args.repeats + 64
    engine = build_server(target, None, "diagnose", None, None, max_batch=1, max_len=max_len, prefill_chunk=1024,
                          prefix_cache=True, pool_tokens=2 * max_len).engine
    print(f"# {args.shape} on {torch.cuda.get_device_name()}, context {args.context}; warm-up {engine.warm_up():.1f} s")
    rng = torch.Generator().manual_seed(0)
    doc = torch.randint(0, target.config.vocab_size, (args.context,), generator=rng).tolist()
    engine.add([Sequence(doc, 3 * args.repeats + 10)])
    steps = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        steps.append(1e3 * (time.perf_counter() - t0))
    print(f"Engine.step: {statistics.median(steps):.3f} ms (median of {args.repeats})")
    runner = next(r for key, r in engine.runners.items() if r.graphs)
    for i, graph in enumerate(runner.graphs):
        t = timings(graph, args.repeats)
        print(f"decode graph {i} ({len(runner.graphs)}): back to back {t['chained']:.3f} ms, synced each "
              f"{t['synced']:.3f} ms (exposed {t['synced'] - t['chained']:.3f} ms); launch call {t['launch']:.3f} ms")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
