"""Issue 10's ablations, summarised: drafts trained with and without anchor-offset positions,
noisy lags and distillation, and with other widths (by ``benchmarks/ablations.sh``), plus
the reduced draft vocabulary, compared on held-out
text by their acceptance (teacher-forced top-k hit rates per tree depth,
``longspec.spec.acceptance.measure_acceptance``), the tokens per round those predict for the
default beam tree and a chain, and the T=1 overlap ``sum min(p, q)`` with the target at depths 1
and 5 (``draft_overlap.py``); held-out loss curves plotted (PNG). Prints a table and one JSON
line last.

    python benchmarks/ablations.py --target DIR --runs base=DIR no-anchor=DIR no-noise=DIR distill=DIR \
        --heldout SITE/requests SITE/click --vocab-data SITE/numpy SITE/networkx --out results/

Held-out loss is comparable between runs of the same lag setting only (without noise the
evaluation uses lag 1); the acceptance table is comparable across all of them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draft_acceptance import source_tokens
from draft_overlap import overlaps
from longspec import load_target
from longspec.spec.acceptance import expected_tokens, measure_acceptance
from longspec.spec.tree import TreeSpec
from longspec.models.checkpoint import load_draft
from longspec.training.data import frequent_tokens


def eval_curve(run: Path) -> list:
    """(step, eval_loss) rows of a run's metrics.jsonl (``run``: its directory or the file)."""
    path = run if run.suffix == ".jsonl" else run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def steps_to(curve: list, loss: float):
    """First step whose held-out loss is at most ``loss`` (None if never)."""
    return next((step for step, value in curve if value <= loss), None)


def plot(curves: dict, out: str) -> None:
    """Held-out loss against step, one line per run, to OUT/ablations.png (from the first
    evaluation after step 0: an untrained draft's loss would flatten the rest)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    for name, curve in curves.items():
        curve = [(step, loss) for step, loss in curve if step > 0]
        if curve:
            plt.plot(*zip(*curve), marker="o", label=name)
    plt.xlabel("step")
    plt.ylabel("held-out loss")
    plt.yscale("log")
    plt.legend()
    plt.savefig(Path(out) / "ablations.png", dpi=120)
    print("plot:", Path(out) / "ablations.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--runs", nargs="+", required=True, help="name=DRAFT_DIR (the first is the baseline)")
    p.add_argument("--heldout", nargs="+", default=[], help="held-out source directories")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="tokens per teacher-forced chunk (positions 0..chunk-1)")
    p.add_argument("--vocab", type=int, default=8192, help="also the baseline with this reduced draft vocabulary "
                   "(0: not), taken from --vocab-data")
    p.add_argument("--vocab-data", nargs="*", default=[], help="the training data (for the reduced vocabulary)")
    p.add_argument("--out", default=".")
    p.add_argument("--plot-only", action="store_true", help="only the held-out loss plot; --runs may name "
                   "metrics.jsonl files (e.g. runs of several calls)")
    args = p.parse_args(argv)
    if args.plot_only:
        plot({name: eval_curve(Path(path)) for name, path in (item.split("=", 1) for item in args.runs)}, args.out)
        return
    if not args.target or not args.heldout:
        p.error("--target and --heldout are needed (except with --plot-only)")
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(args.target, device=device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = source_tokens(tokenizer, args.heldout, args.tokens)
    runs = dict(item.split("=", 1) for item in args.runs)
    beam, chain = TreeSpec.parse("4,16,16,16,16"), TreeSpec.chain(5)
    rows, curves = [], {}
    for name, run_dir in runs.items():
        curves[name] = eval_curve(Path(run_dir))
        first = name == next(iter(runs))
        variants = [(name, None)] + ([(f"{name}, vocab {args.vocab}", args.vocab)] if first and args.vocab and
                                     args.vocab_data else [])
        for label, vocab in variants:
            draft = load_draft(run_dir, target).float()
            if vocab:  # the most frequent tokens of the training data, as `longspec draft-vocab` picks them
                draft.limit_vocab(frequent_tokens(args.vocab_data, tokenizer, vocab, target.config.vocab_size))
            table = measure_acceptance(draft, target, ids, depths=5, chunk=args.chunk)
            ov = overlaps(draft, target, torch.tensor([ids[:args.chunk + 1]], device=target.device), 5)
            rows.append(dict(run=label, step=curves[name][-1][0] if curves[name] else None,
                             final_eval_loss=curves[name][-1][1] if curves[name] else None,
                             top1_depth1=table[0][0], top1_depth5=table[4][0], top4_depth1=table[0][3],
                             tokens_beam=expected_tokens(beam, table), tokens_chain5=expected_tokens(chain, table),
                             overlap_depth1=ov[0]["overlap"], overlap_depth5=ov[-1]["overlap"], acceptance=table))
    base_name, base_curve = next(iter(curves.items()))
    if "no-anchor" in curves and base_curve:  # the paper: 3.93x fewer steps with anchor offsets
        target_loss = curves["no-anchor"][-1][1]
        fast, slow = steps_to(base_curve, target_loss), curves["no-anchor"][-1][0]
        print(f"steps to the no-anchor run's final held-out loss {target_loss:.3f}: baseline {fast}, "
              f"no-anchor {slow}" + (f" ({slow / fast:.2f}x fewer with anchor offsets)" if fast else ""))
    print(f"{'run':<22} {'step':>5} {'eval loss':>9} {'top1@1':>7} {'top1@5':>7} {'top4@1':>7} {'beam tok':>8} {'chain tok':>9} "
          f"{'T=1 ov@1':>8} {'ov@5':>6}")
    for r in rows:
        loss = f"{r['final_eval_loss']:9.3f}" if r["final_eval_loss"] is not None else f"{'-':>9}"
        print(f"{r['run']:<22} {r['step'] or '-':>5} {loss} {r['top1_depth1']:7.3f} {r['top1_depth5']:7.3f} {r['top4_depth1']:7.3f} "
              f"{r['tokens_beam']:8.2f} {r['tokens_chain5']:9.2f} {r['overlap_depth1']:8.3f} {r['overlap_depth5']:6.3f}")
    plot(curves, args.out)
    print(json.dumps({"heldout": args.heldout, "tokens": len(ids), "results": rows}))


if __name__ == "__main__":
    main()
