"""Prompt lookup's chain rounds replayed on plain decoding's own text: per prompt, the rounds a
chain of ``--depth`` tokens runs when every round drafts, and when a round drafts only where the
lookup matched at least g tokens of the text's tail (elsewhere a decode step), each round priced
at ``ratio`` decode steps (a CPU's verification of depth + 1 tokens against one). Prints tokens
per decode step's time against plain decoding's, per gate and ratio, and the tokens a drafting
round accepted by the length of its match. The greedy text is the model's (the tokens every
method emits); each round's chain is ``PromptLookup.continuation`` on the text so far.

    python benchmarks/sim_lookup_gate.py --prompt-file A.py --prompt "def fibonacci(n):" \\
        --chat-prompt "What is speculative decoding?" --max-new-tokens 128 --threads 2
"""
from __future__ import annotations

import argparse

import torch

from types import SimpleNamespace

from longspec import GenerationConfig, PromptLookup, load_target
from longspec.cli.commands import _tokenize
from longspec.convert import default_model_dir
from longspec.decoding.generator import Generator
from longspec.spec.tree import TreeSpec


def replay(prompt: list, new: list, depth: int, gate: int) -> tuple:
    """(drafting rounds, decode steps, {match length: tokens each drafting round accepted}) of
    ``PromptLookup``'s chain of ``depth`` on the text ``prompt`` + ``new``, a round drafting only
    where the lookup matched ``gate`` tokens or more (0: every round)."""
    lookup = PromptLookup()
    cache = SimpleNamespace(lengths=torch.zeros(1, dtype=torch.long), batch_size=1, max_len=len(prompt) + len(new))
    lookup.begin(SimpleNamespace(config=SimpleNamespace(vocab_size=1)), cache, TreeSpec.chain(depth),
                 GenerationConfig(), None)
    history, i, drafting, decoded, accepted = list(prompt), 0, 0, 0, {}
    while i < len(new):
        lookup.add(0, history[:-1], history[-1])
        matched, chain = (int(a[0]) if a.dim() == 1 else a[0].tolist() for a in lookup.continuation(depth))
        if matched < gate:
            history.append(new[i])
            i, decoded = i + 1, decoded + 1
            continue
        a = 0
        while a < depth and i + a < len(new) and chain[a] == new[i + a]:
            a += 1
        emitted = min(a + 1, len(new) - i)
        accepted.setdefault(matched, []).append(a)
        history += new[i:i + emitted]
        i, drafting = i + emitted, drafting + 1
    return drafting, decoded, accepted


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model folder (default: the default model)")
    p.add_argument("--prompt-file", action="append", default=[])
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--chat-prompt", action="append", default=[], help="a prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--gates", default="0,1,2,3", help="match lengths a drafting round needs (0: every round)")
    p.add_argument("--ratios", default="1.4,1.7,2.0", help="a chain round's cost in decode steps")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = args.target or default_model_dir()
    target = load_target(target_dir)
    prompts = ([(f, open(f).read(), False) for f in args.prompt_file] + [(t, t, False) for t in args.prompt]
               + [(t, t, True) for t in args.chat_prompt])
    gates, ratios = [int(g) for g in args.gates.split(",")], [float(r) for r in args.ratios.split(",")]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for name, text, chat in prompts:
        ids = _tokenize(target_dir, text, chat)
        new = Generator(target).generate([ids], config).sequences[0]
        rounds = {g: replay(ids, new, args.depth, g) for g in gates}
        accepted = replay(ids, new, args.depth, 1)[2]
        by_match = "  ".join(f"{m}: {len(a)} rounds, {sum(a) / len(a):.2f} accepted" for m, a in sorted(accepted.items()))
        print(f"{name[:40]:<40}  {len(ids)} prompt tokens, {len(new)} new; drafting rounds by match length: {by_match}")
        for ratio in ratios:
            speeds = "  ".join(f"gate {g}: {len(new) / (decoded + ratio * drafting):.2f}x"
                               for g, (drafting, decoded, _) in rounds.items())
            print(f"    chain:{args.depth} round = {ratio} decode steps: tokens per step's time against plain  {speeds}")


if __name__ == "__main__":
    main()
