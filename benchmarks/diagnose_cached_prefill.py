"""Where a cached request's time to first token goes, against a cold request of only its tail
(issue: a prefix-cache hit should cost little more than prefilling the tokens after the prefix).

On the engine ``longspec serve`` builds (prefix cache on, captured prefill chunks, warmed up), a
random-weight target of ``--shape``: one ``--context``-token document is prefilled, then for each
tail length of ``--tails`` the document + a fresh tail (a hit of the whole document) and the tail
alone (cold) are admitted ``--repeats`` times each; per tail the median milliseconds of
``Engine.add`` (to the first token, synchronised) of both and their ratio. Then one cached and one
cold admission of the first tail under ``torch.profiler``: the CUDA kernels by total time, and
the host's operations; then under ``cProfile``: the Python functions by their own time. No HTTP:
what the server's ``timings_ms["prefill"]`` measures.

    python benchmarks/diagnose_cached_prefill.py --shape llama-8b --context 32768 --tails 31,35,64,200
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import SHAPES, cuda_defaults, random_target  # noqa: E402

from longspec.decoding.engine import Sequence  # noqa: E402


def admit_ms(engine, prompt: list) -> float:
    """Milliseconds of ``engine.add`` for ``prompt``, synchronised: to its first token, the row
    still running (two new tokens: a server's request lets go of its blocks after its first
    token went out); the row ends and is freed after."""
    seq, sync = Sequence(prompt, 2), torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    engine.add([seq])
    sync()
    ms = 1e3 * (time.perf_counter() - start)
    while engine.has_active:
        engine.step()
    return ms


def profile(engine, prompt: list, label: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = engine.target.device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        ms = admit_ms(engine, prompt)
    events = prof.key_averages()
    cuda_us = sum(e.self_device_time_total for e in events)
    print(f"\n## {label}: {ms:.2f} ms under the profiler; CUDA kernels {cuda_us / 1e3:.2f} ms in all")
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=top,
                       max_name_column_width=60))
    if cuda:  # the host's side: what Python and the launches cost
        print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def host_profile(engine, prompt: list, label: str, top: int) -> None:
    """The Python functions of one admission by their own time (a wait at a device sync shows
    in the function that syncs)."""
    import cProfile
    import io
    import pstats

    seq, profiler = Sequence(prompt, 2), cProfile.Profile()
    profiler.enable()
    engine.add([seq])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    while engine.has_active:
        engine.step()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print(f"\n## {label}: Python functions by own time\n" + out.getvalue().split("\n", 4)[-1].strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--tails", default="31,35,64,200")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--top", type=int, default=15, help="kernels listed per profile")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from longspec.serve import build_server

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = cuda_defaults(random_target(args.shape, dtype, args.device))  # as load_target sets it up
    tails = [int(t) for t in args.tails.split(",")]
    max_len = args.context + max(tails) + 64
    # a pool with room for the document and a cold tail beside it: no admission evicts the document
    server = build_server(target, None, "diagnose", None, None, max_batch=1, max_len=max_len,
                          prefill_chunk=args.prefill_chunk if args.device == "cuda" else None, prefix_cache=True,
                          pool_tokens=2 * max_len)
    engine = server.engine
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {args.shape} {str(dtype)[6:]} on {where}, document {args.context} tokens, "
          f"prefill {engine.chunked_prefill.sizes[::-1] if engine.chunked_prefill else 'eager'}; warm-up {engine.warm_up():.1f} s")
    vocab = target.config.vocab_size
    rng = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    document = fresh(args.context)
    print(f"document (cold): {admit_ms(engine, document + fresh(1)):.1f} ms")
    print(f"{'tail':>5} {'cached ms':>10} {'cold tail ms':>13} {'ratio':>6}")
    for tail in tails:
        admit_ms(engine, document + fresh(tail)), admit_ms(engine, fresh(tail))  # each path once first
        cached = statistics.median(admit_ms(engine, document + fresh(tail)) for _ in range(args.repeats))
        cold = statistics.median(admit_ms(engine, fresh(tail)) for _ in range(args.repeats))
        print(f"{tail:>5} {cached:>10.2f} {cold:>13.2f} {cached / cold:>6.2f}   "
              f"(pool: {engine.prefix.stats()['evicted_blocks']} blocks evicted so far)")
    profile(engine, document + fresh(tails[0]), f"cached, tail {tails[0]}", args.top)
    profile(engine, fresh(tails[0]), f"cold, tail {tails[0]}", args.top)
    host_profile(engine, document + fresh(tails[0]), f"cached, tail {tails[0]}", args.top)
    host_profile(engine, fresh(tails[0]), f"cold, tail {tails[0]}", args.top)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
