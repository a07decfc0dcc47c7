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
import contextlib
import json
import statistics
import sys
import time

import torch

from bench_steps import SHAPES, cuda_defaults, random_target

from longspec.engine.engine import Sequence


def admit_ms(engine, prompt: list, during=None) -> float:
    """Milliseconds of ``engine.add`` for ``prompt``, synchronised: to its first token, the row
    still running (two new tokens: a server's request lets go of its blocks after its first
    token went out), inside the context ``during`` (a profiler); the row ends and is freed after."""
    seq, sync = Sequence(prompt, 2), torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with during if during is not None else contextlib.nullcontext():
        start = time.perf_counter()
        engine.add([seq])
        sync()
        ms = 1e3 * (time.perf_counter() - start)
    while engine.has_active:
        engine.step()
    return ms


def profile(engine, prompt: list, label: str, top: int) -> None:
    """One admission (to its first token, not the rounds after) under ``torch.profiler``: the
    kernels by time, the host's operations, and on CUDA the device's idle gaps (below)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = engine.target.device.type == "cuda"
    prof = torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, with_stack=cuda)
    ms = admit_ms(engine, prompt, prof)
    events = prof.key_averages()
    cuda_us = sum(e.self_device_time_total for e in events)
    print(f"\n## {label}: {ms:.2f} ms under the profiler; CUDA kernels {cuda_us / 1e3:.2f} ms in all")
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=top,
                       max_name_column_width=60))
    if cuda:  # the host's side: what Python and the launches cost
        print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as trace:
                print_gaps(json.load(trace)["traceEvents"], top)


def print_gaps(trace: list, top: int, min_us: float = 20.0) -> None:
    """The device's idle time between its first and last kernel: the ``top`` longest gaps of at
    least ``min_us``, each with the kernels around it and the Python functions the host ran
    during it (innermost last) -- what the device waited for."""
    kernels = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    # the host's events on the thread that admitted the request (not the compile workers' threads)
    main = next((e["tid"] for e in trace if e.get("cat") == "python_function" and "admission.py" in e["name"]), None)
    host = [e for e in trace if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime") and "dur" in e
            and (main is None or e["tid"] == main)]
    gaps = [(b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(kernels, kernels[1:])]
    gaps = [g for g in gaps if g[0] >= min_us]
    idle = sum(g[0] for g in gaps)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"] if kernels else 0
    print(f"device idle in gaps >= {min_us:.0f} us: {idle / 1e3:.2f} ms of {span / 1e3:.2f} ms from the first kernel "
          f"to the last ({len(gaps)} gaps)")
    for gap, a, b in sorted(sorted(gaps, key=lambda g: -g[0])[:top], key=lambda g: g[1]["ts"]):  # in time order
        lo, hi = a["ts"] + a["dur"], b["ts"]
        # the host's innermost events during the gap (those that started in it), longest first
        during = sorted((e for e in host if lo <= e["ts"] < hi), key=lambda e: -e["dur"])
        names = "; ".join(dict.fromkeys(e["name"].split("/")[-1][:48] for e in during[:8]))
        print(f"  at {(lo - kernels[0]['ts']) / 1e3:6.2f} ms {gap:6.0f} us after {a['name'][:32]!r} before "
              f"{b['name'][:32]!r}: {names}")


def host_profile(engine, prompt: list, label: str, top: int) -> None:
    """The Python functions of one admission by their own time (a wait at a device sync shows
    in the function that syncs)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    admit_ms(engine, prompt, profiler)
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
    from longspec.serving.server import build_server

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
