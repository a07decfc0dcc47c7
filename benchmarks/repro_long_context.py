"""Reproduces, on a random SmolLM2-shaped model (no weights needed), one greedy generation at a
given prompt length with a given attention implementation, eager or with CUDA graphs; exits
non-zero on failure. Used to localise a CUDA illegal-memory-access seen at 7.9k tokens.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/repro_long_context.py --length 7900 --attention triton --eager

Found so far (H200, benchmarks/results/repro_triton_graphs_h200.log): with ``--new 128 --calls 2
--generators 2 --attention triton --pld`` the second generator's graph replay fails (illegal
memory access); ``--eager``, ``--attention matmul``, a single generator and 2k prompts pass.
``--sync-phases`` names the failing phase; ``--eager-first 1`` tells whether it needs an earlier
capture; ``--max-len`` whether it follows the cache capacity.
"""
import argparse
from pathlib import Path

import torch

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.spec.proposers import PromptLookup


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=7900)
    p.add_argument("--attention", default="triton")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--new", type=int, default=16, help="tokens to generate")
    p.add_argument("--compile", action="store_true", help="compiled steps")
    p.add_argument("--pld", action="store_true", help="prompt-lookup speculative decoding")
    p.add_argument("--generators", type=int, default=1, help="fresh generators, one after the other")
    p.add_argument("--gc", action="store_true", help="collect garbage after each generator")
    p.add_argument("--fresh-proposer", action="store_true",
                   help="a new proposer per generator (else one shared, as bench_generate does)")
    p.add_argument("--calls", type=int, default=1, help="generate calls per generator")
    p.add_argument("--eager-first", type=int, default=0, help="the first N generators run eagerly (no graphs)")
    p.add_argument("--sync-phases", action="store_true",
                   help="synchronise after every phase of every round and name the one that fails")
    p.add_argument("--max-len", type=int, default=None, help="the generators' cache limit (default: the model's)")
    p.add_argument("--dir", default="/tmp/smol-random")
    args = p.parse_args()
    if not (Path(args.dir) / "config.json").exists():
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                       rope_theta=100000.0, tie_word_embeddings=True)
        transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(args.dir)
    target = load_target(args.dir, dtype=torch.bfloat16, device="cuda")
    target.attention_impl, target.compile_steps = args.attention, args.compile
    prompt = torch.randint(0, 49152, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    make_proposer = (lambda: PromptLookup()) if args.pld else (lambda: None)
    proposer = make_proposer()
    where = {"generator": 0, "round": 0, "phase": 0}
    if args.sync_phases:  # synchronise after every graph replay and name the one that fails
        from longspec.engine.runner import PhaseRunner

        replay, run_round = torch.cuda.CUDAGraph.replay, PhaseRunner.run_round

        def checked_replay(graph):
            replay(graph)
            try:
                torch.cuda.synchronize()
            except Exception as err:
                print(f"FAILED in phase {where['phase']} (graph) of round {where['round']} of generator "
                      f"{where['generator']}: {err}", flush=True)
                raise SystemExit(1)
            where["phase"] += 1

        def counted_round(self):
            where["phase"] = 0
            run_round(self)
            where["round"] += 1

        torch.cuda.CUDAGraph.replay, PhaseRunner.run_round = checked_replay, counted_round
    for i in range(args.generators):  # as bench_generate: calls on one generator, then a fresh one
        where.update(generator=i, round=0)
        if args.fresh_proposer:
            proposer = make_proposer()
        gen = Generator(target, proposer, tree="chain:5" if args.pld else None, max_len=args.max_len,
                        cuda_graphs=not args.eager and i >= args.eager_first)
        for _ in range(args.calls):
            out = gen.generate([prompt], GenerationConfig(max_new_tokens=args.new, ignore_eos=True))
            torch.cuda.synchronize()
        print("generator", i, "done", out.stats.get("tau"), flush=True)
        del gen
        if args.fresh_proposer:
            proposer = None
        if args.gc:
            import gc
            gc.collect()
    if args.attention == "triton":  # does the kernel take scratch memory at launch (unsafe in graphs)?
        from longspec.attention import triton_kernels as tk
        for kernel in (tk._partial_kernel, tk._merge_kernel):
            try:
                for cache in kernel.device_caches.values():
                    for compiled in cache[0].values():
                        md = compiled.metadata
                        print(kernel.fn.__name__, "global_scratch", getattr(md, "global_scratch_size", None),
                              "profile_scratch", getattr(md, "profile_scratch_size", None), "shared", md.shared)
            except Exception as err:  # internals differ between Triton versions
                print("kernel metadata unavailable:", repr(err))
    torch.cuda.synchronize()
    print("OK", args, out.sequences[0][:8])


if __name__ == "__main__":
    main()
