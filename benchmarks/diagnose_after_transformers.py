"""Does our next ``generate`` survive transformers' compiled static-cache ``generate`` in the same
process? On the H200 with Gemma 3 270M, the first ``generate`` of a new ``Generator`` after it
died twice with CUDA "unspecified launch failure" in our prefill (``results/gemma3_table_h200.log``),
at 2k and at 32k tokens; without transformers in between every call completed.

Steps, each printed as it ends: ours on prompt A (a new Generator), transformers' compiled
static-cache generate on prompt A, ours on prompt B (a new Generator: it reuses the engine of the
first, kept on the target), ours on prompt B again (the same Generator). Run it with
``CUDA_LAUNCH_BLOCKING=1`` to see which kernel fails.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/diagnose_after_transformers.py --target DIR --data SRC_DIR \
        --length 2048
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_generate import add_target_args, code_prompt, run_hf, target_from_args
from longspec import GenerationConfig
from longspec.decoding.generator import Generator


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--data", required=True, help="a folder of Python files to cut the prompts from")
    p.add_argument("--length", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, dtype, target = target_from_args(args)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    text = code_prompt(AutoTokenizer.from_pretrained(target_dir), Path(args.data), 2 * args.length)
    prompt_a, prompt_b = text[:args.length], text[args.length:]
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)

    def step(name, fn):
        start = time.perf_counter()
        out = fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"{name}: done in {time.perf_counter() - start:.1f} s", flush=True)
        return out

    first = step("ours, prompt A", lambda: Generator(target).generate([prompt_a], config)).sequences[0]
    theirs, _ = step("transformers' compiled static cache, prompt A",
                     lambda: run_hf(hf, prompt_a, args.new_tokens, 1, cache_implementation="static"))
    print(f"  same tokens as ours: {first == theirs[:len(first)]}", flush=True)
    gen = Generator(target)
    step("ours, prompt B (a new Generator)", lambda: gen.generate([prompt_b], config))
    step("ours, prompt B again", lambda: gen.generate([prompt_b], config))
    print("all steps completed")


if __name__ == "__main__":
    main()
