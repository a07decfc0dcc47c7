"""Where ``longspec serve``'s start-up goes: runs the command's start-up exactly as a user starts
it (model load, the buckets' trees, the warm-up) but serves nothing, then prints the start-up's
wall time, torch.compile's time per phase (Dynamo's tracing, AOTAutograd, Inductor's code
generation or its cache's loading, Triton's compilation and autotuning: ``compile_times``) and
its counters (cache hits and misses, graphs). The server's own status line already gives each
warm-up part's seconds and graphs. Run it twice, in two processes, to compare cold and warm
compile caches::

    python benchmarks/diagnose_serve_start.py -- --target MODEL_DIR --buckets 1,4,16
    TORCH_LOGS=recompiles python benchmarks/diagnose_serve_start.py -- --target MODEL_DIR --buckets 1,4,16

Everything after ``--`` goes to ``longspec serve`` (``--warm-up on`` is added). ``--cache-log
FILE`` writes the compile caches' messages there (each graph's hit, miss or bypass and, at a miss,
the details its key was hashed from: two runs' details of a key that misses every time show what
changes) and prints the misses and bypasses."""
from __future__ import annotations

import argparse
import sys
import time



def log_cache_messages(path: str) -> None:
    """Every message of Inductor's FX graph cache and of AOTAutograd's cache (hits, misses,
    bypasses, the hashed details of each key) goes to ``path``; misses, bypasses and failures to
    save are printed too."""
    import logging

    out = open(path, "w")

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            out.write(message + "\n=====\n")
            out.flush()
            first = message.splitlines()[0] if message else ""
            if any(w in first.lower() for w in ("miss", "bypass", "unable", "fail")):
                print(f"[cache] {first[:300]}", flush=True)

    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(Handler(logging.DEBUG))
        logger.propagate = False  # (the hashed details are long: the file has them, the console not)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-log", default=None, help="write the compile caches' messages to this file")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments of longspec serve (after --)")
    args = p.parse_args(argv)
    serve_args = [a for a in args.serve_args if a != "--"]
    if args.cache_log:
        log_cache_messages(args.cache_log)
    import uvicorn

    from longspec.cli import main as cli

    uvicorn.Server.run = lambda self: None  # everything up to serving, then return
    start = time.perf_counter()
    rc = cli(["serve", *serve_args, "--warm-up", "on"])
    seconds = time.perf_counter() - start
    print(f"\nlongspec serve {' '.join(serve_args)}: start-up {seconds:.1f} s (exit code {rc}), imports excluded")
    if "torch._dynamo.utils" not in sys.modules:
        print("nothing was compiled")
        return rc
    from torch._dynamo.utils import compile_times, counters

    print(compile_times(repr="str", aggregate=True))
    for group in ("stats", "frames", "aot_autograd", "inductor"):
        print(f"{group}: {dict(sorted(counters[group].items()))}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
