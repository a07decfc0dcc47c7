"""``auto``'s choices alone, without a model or a device: the controller
(:class:`~longspec.decoding.controller.Controller`) runs a workload of calls whose round times and
tokens per round are drawn from given numbers, and every call is given against plain decoding's
time for it. A diagnostic of the policy (what it runs on a text the draft misses, after a slow
stretch), never a measurement of speed: the numbers it starts from come from a measured run
(the defaults: the T=1 workload of the default pair on one H100, ``workload_t1_*_h100.log``).

    python benchmarks/simulate_controller.py --seeds 8 --slow "plain=1.55,chain=1.3,tree=1.5"

Per candidate: its round time (``--ms``), the cost model's (tokens, ms) (``--predicted``), its mean
tokens per round on a text it predicts (``--good``) and on one it misses (``--poor``); a call is
``--max-new-tokens`` tokens; ``--workload``: the texts of the calls in order (``g``, ``p``), the
``--slow-call``-th (from 1; 0: none) running every candidate's rounds ``--slow`` times slower
(per kind: plain, chain, tree); the first call is the warm-up. ``--switch-ms`` is added to a round after a switch and
``--begin-ms`` to each call (the host's work that plain decoding does not do). Prints each call
after the slow one, the median and worst call over seeds (and per kind of text), one JSON line last."""
from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter

from longspec.decoding.controller import Controller, label
from longspec.decoding.corrections import kind_of
from longspec.spec.tree import TreeSpec

TREES = "chain:5;4,16,16,16,16,1,1,1,1,1;4,8,8,1,1,1,1,1,1,1;4,4,1,1,1,1,1"


def per_tree(text: str) -> list:
    return [float(x) for x in text.split(",")]


def draw_tokens(rng: random.Random, mean: float, depth: int) -> int:
    """1 + the levels accepted, each with the same chance, that chance set so the mean is ``mean``."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if 1 + sum(a ** k for k in range(1, depth + 1)) < mean else (lo, a)
    tokens = 1
    while tokens <= depth and rng.random() < a:
        tokens += 1
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=TREES, help="the candidates besides plain rounds, ';'-separated")
    ap.add_argument("--ms", default="1.27,2.11,1.68,1.53", help="their round times (ms)")
    ap.add_argument("--plain-ms", type=float, default=1.16)
    ap.add_argument("--predicted", default="1.60:1.82,3.83:3.25,3.28:2.66,2.96:2.36", help="the cost model's tokens:ms")
    ap.add_argument("--plain-predicted-ms", type=float, default=1.55)
    ap.add_argument("--good", default="1.15,1.9,1.8,1.55")
    ap.add_argument("--poor", default="1.04,1.14,1.12,1.08")
    ap.add_argument("--workload", default="pgg" * 2 + "p" + "pg" * 3)
    ap.add_argument("--slow-call", type=int, default=7)
    ap.add_argument("--slow", default="plain=1.5,chain=1.5,tree=1.5")
    ap.add_argument("--switch-ms", type=float, default=0.5)
    ap.add_argument("--begin-ms", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sampling", default="t1", help="the key of what calls learn (as a kind of round)")
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    trees = [TreeSpec.parse(t) for t in args.trees.split(";")]
    ms = {**dict(zip(trees, per_tree(args.ms))), None: args.plain_ms}
    texts = {"g": dict(zip(trees, per_tree(args.good))), "p": dict(zip(trees, per_tree(args.poor)))}
    predicted = {t: tuple(map(float, p.split(":"))) for t, p in zip(trees, args.predicted.split(","))}
    predicted[None] = (1.0, args.plain_predicted_ms)
    slow = {k: float(v) for k, v in (item.split("=") for item in args.slow.split(","))}
    ratios, per_text = [], {}
    for seed in range(args.seeds):
        rng, controller = random.Random(seed), Controller()
        for i, text in enumerate(args.workload, 1):
            factor = (lambda t: slow.get(kind_of(label(t)), 1.0)) if i == args.slow_call else (lambda t: 1.0)
            tree, made, spent, ran = controller.begin(predicted, args.sampling), 0, args.begin_ms, Counter()
            while made < args.max_new_tokens:
                tokens = 1 if tree is None else draw_tokens(rng, texts[text][tree], tree.depth)
                round_ms = ms[tree] * factor(tree) * rng.uniform(0.98, 1.02)
                made, ran[label(tree)] = made + tokens, ran[label(tree)] + 1
                after = controller.observe(tokens, round_ms / 1e3, tree)
                spent += round_ms + (args.switch_ms if after != tree else 0.0)
                tree = after
            controller.end()
            plain = args.max_new_tokens * ms[None] * factor(None)
            if i > max(args.slow_call, 1):
                ratios.append(plain / spent)
                per_text.setdefault(text, []).append(plain / spent)
                print(f"seed {seed} call {i:2d} ({text}) {plain / spent:.3f}x plain  {dict(ran)}")
    summary = {text: (statistics.median(r), min(r)) for text, r in sorted(per_text.items())}
    print(f"after the slow call: median {statistics.median(ratios):.3f}x, worst {min(ratios):.3f}x plain decoding; "
          + ", ".join(f"on {'good' if t == 'g' else 'poor'} texts {m:.3f}x / {w:.3f}x" for t, (m, w) in summary.items()))
    print(json.dumps({"median": statistics.median(ratios), "worst": min(ratios), "calls": len(ratios),
                      "per_text": {t: {"median": m, "worst": w} for t, (m, w) in summary.items()}}))


if __name__ == "__main__":
    main()
