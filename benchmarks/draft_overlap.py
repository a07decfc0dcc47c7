"""How well a draft's distribution matches its target's at temperature 1, on held-out text:
per tree depth d (the draft queries the target's cache at lag d), the mean overlap
``sum_x min(p(x), q(x))`` of the target's next-token distribution p and the draft's q (the
probability that one drafted token survives rejection sampling), the top-1 agreement, and the
tau a chain of ``--depths`` tokens would get at T=1 if depths were independent
(``1 + a1 + a1 a2 + ...``). Teacher-forced over one chunk; float32; CPU or GPU.

    python benchmarks/draft_overlap.py --prompt-dir SITE/transformers/generation [--draft DIR] [--tokens 2048]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longspec import default_draft_path, default_model_path, load_draft, load_target
from longspec.training.loss import target_forward


@torch.no_grad()
def overlaps(draft, target, ids: torch.Tensor, depths: int) -> list:
    """Per depth d = 1..``depths`` (lag d): the mean overlap ``sum min(p, q)`` and the top-1
    agreement of the draft's next-token distribution q with the target's p, teacher-forced over
    ids [1, T+1] (T inputs; depth d is averaged over its T - d predictions that see target KV)."""
    inputs, positions = ids[:, :-1], torch.arange(ids.shape[1] - 1, device=ids.device)[None]
    out = target_forward(target, inputs, positions, want_hidden=True)
    p_target = torch.softmax(target.logits(out.hidden)[0].float(), -1)
    rows = []
    for d in range(1, depths + 1):
        hidden = draft.forward_train(inputs, positions, out.k, out.v, lag=d)
        q = torch.softmax(draft.logits(hidden, reduced=True)[0].float(), -1)
        overlap = float(torch.minimum(p_target, q).sum(-1)[d:].mean())  # the first d see no target KV
        agree = float((q.argmax(-1) == p_target.argmax(-1))[d:].float().mean())
        rows.append(dict(depth=d, overlap=overlap, top1_agreement=agree))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model directory (default: the default model)")
    p.add_argument("--draft", default=None, help="draft directory (default: the shipped draft)")
    p.add_argument("--prompt-dir", required=True, help="held-out source code (its .py files, sorted)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--depths", type=int, default=5)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_dir = args.target or default_model_path()
    target = load_target(target_dir, dtype=torch.float32, device=device)
    draft = load_draft(args.draft or default_draft_path(), target).float()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text, files = "", sorted(Path(args.prompt_dir).rglob("*.py"))
    while files and len(text) < 6 * args.tokens:
        text += files.pop(0).read_text(errors="replace")
    ids = torch.tensor(tokenizer(text)["input_ids"][:args.tokens + 1], device=device)[None]
    if ids.shape[1] < args.depths + 2:
        raise SystemExit(f"too little text under {args.prompt_dir}")
    rows = overlaps(draft, target, ids, args.depths)
    tau, survive = 1.0, 1.0
    for row in rows:
        survive *= row["overlap"]
        tau += survive
        print(f"depth {row['depth']}: overlap {row['overlap']:.3f}, top-1 agreement {row['top1_agreement']:.3f}")
    print(f"chain:{args.depths} at T=1, predicted tau (independent depths): {tau:.2f}")
    print(json.dumps({"tokens": int(ids.shape[1] - 1), "depths": rows, "chain_tau_t1": tau}))


if __name__ == "__main__":
    main()
