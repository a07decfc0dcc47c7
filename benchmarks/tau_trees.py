"""Tokens per round (tau) of proposers and tree shapes on one prompt: an accuracy measurement
(tau depends on the model, the draft and the text, not on the device's speed), so it runs
anywhere. Greedy outputs are checked against plain decoding; ``--temperature 1`` samples (with
``--seed``). Prompts: ``--text code`` cuts source files of ``--prompt-dir`` (a package the
draft never saw); ``--text prose`` asks the chat model to summarise documentation
(``--prose-file``; default: the language reference in the standard library's
``pydoc_data/topics.py``, held out from all training). Prints one line per setting and one JSON
line last.

    python benchmarks/tau_trees.py --prompt-dir SITE/transformers/generation --length 4096 \\
        --settings "pld chain:5;pld chain:10;hybrid 4,16,16,16,16;hybrid 4,16,16,16,16,1,1,1,1,1"
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_generate import code_prompt
from longspec import GenerationConfig, load_draft, load_target
from longspec.convert import default_model_dir
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.training.selfdistill import TASKS, chat_ids

ASSETS = Path(__file__).resolve().parents[1] / "longspec" / "assets" / "smollm2-draft"


def prose_prompt(tokenizer, path, n_tokens: int) -> list:
    """A chat request to summarise documentation: the text of ``path`` (for ``topics.py``, its
    topics' prose) cut so that the whole chat prompt is about ``n_tokens`` long."""
    if Path(path).name == "topics.py":  # a dict of topic name -> reference text
        import runpy

        topics = runpy.run_path(str(path))["topics"]
        text = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        text = Path(path).read_text()
    overhead = len(chat_ids(tokenizer, TASKS["summarise"].format(doc="")))
    doc_ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(doc_ids) < n_tokens - overhead:
        raise ValueError(f"{path} holds only {len(doc_ids)} tokens, {n_tokens} asked")
    return chat_ids(tokenizer, TASKS["summarise"].format(doc=tokenizer.decode(doc_ids[:n_tokens - overhead])))


def default_prose_file() -> str:
    import sysconfig

    return str(Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model directory (default: the default model)")
    p.add_argument("--draft", default=str(ASSETS))
    p.add_argument("--text", choices=["code", "prose"], default="code")
    p.add_argument("--prompt-dir", help="--text code: a directory of source code the draft never saw")
    p.add_argument("--prose-file", default=None, help="--text prose: documentation to summarise")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (--temperature > 0)")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--settings", default="pld chain:5;hybrid 4,16,16,16,16",
                   help="';'-separated 'proposer tree' pairs: pld, streaming, longspec or hybrid")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target_dir = args.target or str(default_model_dir())
    target = load_target(target_dir, dtype=args.dtype, device=args.device)
    target.compile_steps = False  # an accuracy measurement: eager steps, no CUDA graphs (no compile time)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if args.text == "code":
        if not args.prompt_dir:
            raise SystemExit("--text code needs --prompt-dir")
        prompt, source = code_prompt(tokenizer, Path(args.prompt_dir), args.length), Path(args.prompt_dir).name
    else:
        prose = args.prose_file or default_prose_file()
        prompt, source = prose_prompt(tokenizer, prose, args.length), "prose:" + Path(prose).name
    draft = load_draft(args.draft, target)
    greedy = args.temperature == 0
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=args.temperature,
                              seed=None if greedy else args.seed)
    plain = Generator(target, cuda_graphs=False).generate([prompt], config).sequences[0] if greedy else None
    make = {"pld": PromptLookup, "longspec": lambda: LongSpecProposer(draft), "streaming": StreamingSelfSpec,
            "hybrid": lambda: LongSpecProposer(draft, PromptLookup())}
    rows = []
    for setting in args.settings.split(";"):
        name, tree = setting.split()
        t0 = time.perf_counter()
        out = Generator(target, make[name](), tree, cuda_graphs=False).generate([prompt], config)
        row = dict(proposer=name, tree=tree, tau=out.stats["tau"],
                   same_as_plain=out.sequences[0] == plain if greedy else None, seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"{len(prompt):>6} {source:<16} T={args.temperature:g} {name:<9} {tree:<26} tau {row['tau']:5.2f}  "
              f"same as plain {row['same_as_plain']}", flush=True)
    print(json.dumps({"prompt_dir": source, "text": args.text, "length": len(prompt), "temperature": args.temperature,
                      "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "results": rows}))


if __name__ == "__main__":
    main()
