"""Tokens per round (tau) of proposers and tree shapes on one prompt, greedy: an accuracy
measurement (tau depends on the model, the draft and the text, not on the device's speed), so
it runs anywhere; every output is checked against plain decoding. Prints one line per setting
and one JSON line last.

    python benchmarks/tau_trees.py --prompt-dir SITE/transformers/generation --length 4096 \\
        --settings "pld chain:5;pld chain:10;hybrid 4,16,16,16,16;hybrid 4,16,16,16,16,1,1,1,1,1"
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import code_prompt  # noqa: E402
from longspec import GenerationConfig, load_draft, load_target  # noqa: E402
from longspec.convert import default_model_dir  # noqa: E402
from longspec.decoding.engine import Generator  # noqa: E402
from longspec.decoding.proposers import LongSpecProposer, PromptLookup  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "longspec" / "assets" / "smollm2-draft"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model directory (default: the default model)")
    p.add_argument("--draft", default=str(ASSETS))
    p.add_argument("--prompt-dir", required=True, help="a directory of source code the draft never saw")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--settings", default="pld chain:5;hybrid 4,16,16,16,16",
                   help="';'-separated 'proposer tree' pairs: pld, longspec or hybrid")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target_dir = args.target or str(default_model_dir())
    target = load_target(target_dir, dtype=args.dtype, device=args.device)
    prompt = code_prompt(AutoTokenizer.from_pretrained(target_dir), Path(args.prompt_dir), args.length)
    draft = load_draft(args.draft, target)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    plain = Generator(target).generate([prompt], config).sequences[0]
    make = {"pld": PromptLookup, "longspec": lambda: LongSpecProposer(draft),
            "hybrid": lambda: LongSpecProposer(draft, PromptLookup())}
    rows = []
    for setting in args.settings.split(";"):
        name, tree = setting.split()
        t0 = time.perf_counter()
        out = Generator(target, make[name](), tree).generate([prompt], config)
        row = dict(proposer=name, tree=tree, tau=out.stats["tau"], same_as_plain=out.sequences[0] == plain,
                   seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"{args.length:>6} {Path(args.prompt_dir).name:<12} {name:<9} {tree:<26} tau {row['tau']:5.2f}  "
              f"same as plain {row['same_as_plain']}", flush=True)
    print(json.dumps({"prompt_dir": Path(args.prompt_dir).name, "length": args.length, "dtype": args.dtype,
                      "max_new_tokens": args.max_new_tokens, "results": rows}))


if __name__ == "__main__":
    main()
