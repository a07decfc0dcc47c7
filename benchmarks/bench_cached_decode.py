"""Decode steps of a prefix-cache hit against a cold request, on the engine (no server): a
document of ``--context`` tokens and questions after it, one request at a time, plain decoding.
A cached request's row is the document's cached blocks followed by its own blocks elsewhere in
the pool; on a CPU it is attended run by run (``AttentionMeta.key_runs``), or, with ``gathered``, gathered
through the block table every step as before. Prints milliseconds per decode step per request
(the first request of each engine is cold) and the median of the later ones.

    python benchmarks/bench_cached_decode.py --context 3000 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from longspec import load_target
from longspec.attention.backend import AttentionMeta
from longspec.convert import default_model_dir
from longspec.engine.engine import Engine, Sequence


def decode_ms(engine: Engine, prompt: list, steps: int) -> tuple:
    """(milliseconds per decode step after the first, tokens read from the cache) of one request."""
    seq = Sequence(prompt, steps + 1)
    engine.add([seq])
    engine.step()
    start, n = time.perf_counter(), 0
    while engine.has_active:
        engine.step()
        n += 1
    return 1e3 * (time.perf_counter() - start) / n, seq.cached_tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF-format model directory (default: the default model)")
    p.add_argument("--context", type=int, default=3000, help="document tokens")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per request")
    p.add_argument("--modes", default="cold,runs,gathered")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = Path(args.target) if args.target else default_model_dir()
    target = load_target(path, dtype=torch.float32, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join(f.read_text() for f in sorted((root / "docs").glob("*.md")))
    doc = tokenizer(text, add_special_tokens=False).input_ids[:args.context]
    questions = [tokenizer(f"\n\nQuestion {k}: what does section {k} say?\nAnswer:", add_special_tokens=False).input_ids
                 for k in range(args.questions)]
    key_runs = AttentionMeta.key_runs
    for mode in args.modes.split(","):
        AttentionMeta.key_runs = (lambda self: []) if mode == "gathered" else key_runs
        engine = Engine(target, None, None, max_batch=1, max_len=args.context + 512, prefix_cache=mode != "cold",
                        cuda_graphs=False)
        times = []
        for k, q in enumerate(questions):
            ms, cached = decode_ms(engine, doc + q, args.steps)
            times.append(ms)
            print(f"{mode:<9} request {k}: {ms:6.1f} ms a step ({cached} tokens from the cache)", flush=True)
        print(f"{mode:<9} median of requests 1-{len(questions) - 1}: {statistics.median(times[1:]):.1f} ms a step",
              flush=True)
    AttentionMeta.key_runs = key_runs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
