"""Whether the prefix cache slows a cold prompt (one that shares nothing cached): a server with
the cache fills its pool with idle cached blocks, and a new long document must evict them.

Three engines as ``longspec serve`` builds them (one row, captured prefill chunks, warmed up) over
one random-weight target of ``--shape``: without the prefix cache; with it and a pool of one
row (``max_len``: a new document evicts the last one's blocks); with it and a pool of two rows
(nothing evicted). In each: one ``--context``-token document (the pool's first long prompt),
then ``--repeats`` fresh documents of a new length (``--context`` + 37 + the engine's index:
each engine's first prompt of that length builds its attention plan) timed from ``Engine.add``
to the first token, synchronised; then one more under ``torch.profiler`` (the kernels and the
host's operations by time) and under ``cProfile`` (the Python functions by their own time).
Python's garbage collections of the oldest generation during each timed admission are listed
beside it (a process that compiled its steps holds hundreds of thousands of objects: one such
collection can take a large part of a second); ``--freeze`` moves everything alive after the
warm-up out of the collector's reach (``gc.freeze``), as ``longspec serve`` does.

    python benchmarks/diagnose_cold_with_cache.py --shape llama-8b --context 32768
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from bench_steps import SHAPES, cuda_defaults, random_target
from diagnose_cached_prefill import admit_ms, host_profile, profile


class OldestCollections:
    """Milliseconds of each collection of the oldest generation since the last :meth:`take`."""

    def __init__(self):
        self.pauses, self._start = [], 0.0
        gc.callbacks.append(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.pauses.append(1e3 * (time.perf_counter() - self._start))

    def take(self) -> str:
        pauses, self.pauses = self.pauses, []
        return "full GC " + ("+".join(f"{p:.0f}" for p in pauses) + " ms" if pauses else "none")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--top", type=int, default=12, help="rows listed per profile table")
    p.add_argument("--no-profile", action="store_true", help="times only")
    p.add_argument("--profile-first", action="store_true",
                   help="profile the first fresh document (a new length's one-offs) instead of one after the timed ones")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() after each engine's warm-up")
    p.add_argument("--engines", default="0,1,2",
                   help="which of the three engines to build (0: no cache, 1: a pool of one row, 2: of two rows)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from longspec.serving.server import build_server

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = cuda_defaults(random_target(args.shape, dtype, args.device))
    max_len = args.context + 1024
    vocab = target.config.vocab_size
    rng = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {args.shape} {str(dtype)[6:]} on {where}; documents of {args.context} tokens, then fresh ones of "
          f"{args.context + 37}+ tokens; max_len {max_len}")
    setups = [("no prefix cache", False, None), ("prefix cache, pool of one row", True, max_len),
              ("prefix cache, pool of two rows", True, 2 * max_len)]
    collections = OldestCollections()
    for index, (label, cache, pool) in enumerate(setups):
        if str(index) not in args.engines.split(","):
            continue
        server = build_server(target, None, "diagnose", None, None, max_batch=1, max_len=max_len,
                              prefill_chunk=args.prefill_chunk if args.device == "cuda" else None,
                              prefix_cache=cache, pool_tokens=pool)
        engine = server.engine
        warm = engine.warm_up()
        if args.freeze:
            gc.freeze()
        collections.take()
        first = admit_ms(engine, fresh(args.context))
        first_gc = collections.take()
        length = args.context + 37 + index
        if args.profile_first:
            profile(engine, fresh(length), f"{label}: the first fresh document", args.top)
        times = []
        for _ in range(args.repeats):
            times.append(f"{admit_ms(engine, fresh(length)):.1f} ({collections.take()})")
        stats = engine.prefix.stats() if engine.prefix is not None else {}
        start = time.perf_counter()
        gc.collect()
        after = 1e3 * (time.perf_counter() - start)
        print(f"\n# {label}: warm-up {warm:.1f} s, then {len(gc.get_objects())} objects tracked "
              f"({gc.get_freeze_count()} frozen); first document {first:.1f} ms ({first_gc}); "
              f"fresh documents of {length} tokens: {', '.join(times)} ms; pool blocks {engine.pool.num_blocks}, "
              f"evicted {stats.get('evicted_blocks', 0)}; a full collection after them {after:.0f} ms", flush=True)
        if not args.no_profile and not args.profile_first:
            profile(engine, fresh(length), f"{label}: a fresh document", args.top)
            host_profile(engine, fresh(length), f"{label}: a fresh document", args.top)
        engine.close()
        del server, engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
