"""Localises two CUDA-graph faults seen on the H200 (no model download: random SmolLM2-shaped
weights). Prints a traceback for a failed capture and says whether a Triton kernel was compiled
while a stream was capturing (a new specialisation there cannot be captured).

    python benchmarks/diagnose_graphs.py --part costs   # generations at --long, then auto's cost
                                                        # measurement at --short (the bench order)
    python benchmarks/diagnose_graphs.py --part hybrid-test   # tests/test_gpu.py bucket test, hybrid

Found so far: bench_generate with triton+compile crashed (illegal memory access) in auto's cost
measurement at 2k after the 7.9k methods; tests/test_gpu.py::test_batch_buckets_with_graphs_equal_alone
[hybrid] failed its capture (fp32 tiny model) and left the CUDA generator in capture mode."""
import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def watch_triton_and_captures():
    """Reports Triton compilations during a capture, and the traceback of a failed capture."""
    import longspec.decoding.runner as runner
    from longspec.attention import triton_kernels as tk

    class LoudWarnings:
        @staticmethod
        def warn(msg, *a, **k):
            print("CAPTURE FAILED:", msg, flush=True)
            traceback.print_exc()

    runner.warnings = LoudWarnings
    for kernel in (tk._partial_kernel, tk._merge_kernel):
        original = kernel.run

        def run(*args, _kernel=kernel, _original=original, **kwargs):
            before = sum(len(c[0]) for c in _kernel.device_caches.values())
            out = _original(*args, **kwargs)
            after = sum(len(c[0]) for c in _kernel.device_caches.values())
            if after != before:
                capturing = torch.cuda.is_current_stream_capturing()
                print(f"triton compiled {_kernel.fn.__name__} (variants {before} -> {after}), "
                      f"capturing={capturing}", flush=True)
                if capturing:
                    traceback.print_stack(limit=12)
            return out

        kernel.run = run


def part_costs(args):
    from bench_steps import random_target
    from longspec import GenerationConfig
    from longspec.decoding.auto import CANDIDATE_TREES, LOOKUP_CHAINS, measure_costs
    from longspec.decoding.generator import Generator
    from longspec.decoding.proposers import LongSpecProposer, PromptLookup
    from longspec.decoding.tree import TreeSpec
    from longspec.models.draft import DraftConfig, init_draft

    target = random_target("smollm2", torch.bfloat16)
    target.attention_impl = args.attention
    draft = init_draft(DraftConfig.for_target(target, window=512), target, seed=1).to(torch.bfloat16)
    vocab = target.config.vocab_size
    for n, proposer in (("ar", None), ("pld", PromptLookup())):
        if args.long:
            prompt = torch.randint(0, vocab, (args.long,)).tolist()
            gen = Generator(target, proposer, TreeSpec.parse("chain:5") if proposer else None)
            for _ in range(2):
                gen.generate([prompt], GenerationConfig(max_new_tokens=args.new, ignore_eos=True))
            torch.cuda.synchronize()
            print(f"generated at {args.long} with {n}: ok", flush=True)
    candidates = {f"pld {n}": (TreeSpec.chain(n), PromptLookup, 2.0) for n in LOOKUP_CHAINS}
    candidates.update({f"hybrid {s}": (TreeSpec.parse(s), lambda: LongSpecProposer(draft, PromptLookup()), 2.0)
                       for s in CANDIDATE_TREES})
    for context in args.contexts:
        costs = measure_costs(target, candidates, context)
        torch.cuda.synchronize()
        print(f"costs at {context}: ok", {k: round(v, 3) for k, v in costs["target_ms"].items()}, flush=True)
    print("OK")


def part_hybrid_test(args):
    import pytest
    sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-x", "-s",
                          "tests/test_gpu.py::test_batch_buckets_with_graphs_equal_alone"]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["costs", "hybrid-test"], required=True)
    p.add_argument("--attention", default="triton")
    p.add_argument("--long", type=int, default=7900, help="prompt length of the first generations (0: none)")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[2048])
    args = p.parse_args()
    watch_triton_and_captures()
    {"costs": part_costs, "hybrid-test": part_hybrid_test}[args.part](args)


if __name__ == "__main__":
    main()
