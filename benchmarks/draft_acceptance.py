"""Measures a draft's acceptance table for ``--proposer auto`` (top-k hit rates per tree depth,
teacher-forced at each depth's lag; see ``longspec/decoding/auto.py``) on held-out source code and
optionally stores it in the draft's config.json.

    python benchmarks/draft_acceptance.py --draft longspec/assets/smollm2-draft \
        --data SITE/httpx SITE/starlette --tokens 8192 --write

The shipped draft's table comes from httpx + starlette: neither its training data (numpy, scipy,
networkx, torch) nor the benchmarks' prompts (transformers/generation) nor the standard library.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longspec import load_target
from longspec.convert import default_model_dir
from longspec.spec.acceptance import ACCEPTANCE_WIDTHS, measure_acceptance
from longspec.models.checkpoint import load_draft


def source_tokens(tokenizer, dirs, n_tokens: int) -> list:
    """Python files of ``dirs`` (sorted), concatenated with path headers, cut to ``n_tokens``."""
    ids = []
    for directory in map(Path, dirs):
        for path in sorted(directory.rglob("*.py")):
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            ids += tokenizer(f"# ==== {path.name} ====\n{text}").input_ids
            if len(ids) >= n_tokens:
                return ids[:n_tokens]
    raise SystemExit(f"only {len(ids)} tokens in {dirs}, {n_tokens} asked")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="model directory (default: the default model)")
    p.add_argument("--draft", required=True)
    p.add_argument("--data", nargs="+", required=True, help="directories of held-out source code")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--depths", type=int, default=6)
    p.add_argument("--write", action="store_true", help="store the table in the draft's config.json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    target_dir = args.target or default_model_dir()
    target = load_target(target_dir)
    draft = load_draft(args.draft, target).float()
    ids = source_tokens(AutoTokenizer.from_pretrained(target_dir), args.data, args.tokens)
    table = measure_acceptance(draft, target, ids, depths=args.depths)
    print("depth  " + "  ".join(f"top{w:<3}" for w in ACCEPTANCE_WIDTHS))
    for d, row in enumerate(table, 1):
        print(f"{d:5}  " + "  ".join(f"{x:6.3f}" for x in row))
    if args.write:
        config_file = Path(args.draft) / "config.json"
        config = json.loads(config_file.read_text())
        config["acceptance"] = table
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        print("written to", config_file)
    print(json.dumps({"draft": args.draft, "data": args.data, "tokens": len(ids), "acceptance": table}))


if __name__ == "__main__":
    main()
