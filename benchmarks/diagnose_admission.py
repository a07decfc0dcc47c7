"""Where a request's admission (``Engine.add``: prefill, the draft's window, the first token)
spends its time, per prefill path, on a random-weight target of a known shape: the wall time,
then under the torch profiler the costliest device kernels and host operations of one admission.

    python benchmarks/diagnose_admission.py --shape smollm2 --length 7600 --paths chunks,layers

``chunks``: captured 2,048-token chunk steps; ``layers``: the prompt by layer (cuDNN first)."""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_steps import random_target
from longspec.engine.engine import Engine, Sequence
from longspec.spec.proposers import LongSpecProposer
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--length", type=int, default=7600)
    p.add_argument("--paths", default="chunks,layers")
    p.add_argument("--rows", type=int, default=12, help="lines of each profile table")
    p.add_argument("--no-compile", action="store_true", help="captured steps without torch.compile (a shorter warm-up)")
    args = p.parse_args(argv)
    target = random_target(args.shape, torch.bfloat16, "cuda")
    target.attention_impl, target.compile_steps = "triton", not args.no_compile
    draft = init_draft(DraftConfig.for_target(target), target)
    draft.fuse_projections()
    engine = Engine(target, LongSpecProposer(draft), TreeSpec.parse("4,16,16,16,16"), max_batch=1,
                    max_len=args.length + 2048 + 200, prefill_chunk=2048)
    engine.warm_up()
    prompt = torch.randint(0, target.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(1)).tolist()
    for path in args.paths.split(","):
        engine.chunked_prefill.by_layer_from = 1 if path == "layers" else 1 << 40

        def admit():
            seq = Sequence(list(prompt), 4)
            engine.add([seq])
            engine.cancel(seq)

        admit()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            admit()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"== {path}: admission of {args.length} tokens: {1e3 * sorted(times)[2]:.1f} ms (median of 5)", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            admit()
            torch.cuda.synchronize()
        events = prof.key_averages()
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
