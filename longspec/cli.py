"""Command line: ``longspec generate | convert``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _device_and_dtype(args):
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return device, dtype


def _prompt_text(args) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise SystemExit(f"error: prompt file not found: {path}")
    return path.read_text()


class TextStreamer:
    """Prints the decoded text of one row as tokens arrive (holds back incomplete characters)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out, [], 0

    def __call__(self, row: int, tokens: list) -> None:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def cmd_generate(args) -> int:
    from transformers import AutoTokenizer

    from . import GenerationConfig, Generator, load_target
    from .convert import default_model_dir

    target_dir = Path(args.target) if args.target else default_model_dir()
    device, dtype = _device_and_dtype(args)
    target = load_target(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text = _prompt_text(args)
    if args.chat:
        if not tokenizer.chat_template:
            raise SystemExit(f"error: the tokenizer in {target_dir} has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text).input_ids
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    streamer = TextStreamer(tokenizer, sys.stderr if args.json else sys.stdout)
    proposer, tree = make_proposer(args, target)
    out = Generator(target, proposer=proposer, tree=tree).generate([ids], config, streamer=streamer)
    streamer.out.write("\n")
    tokens = out.sequences[0]
    stats = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.stats.items()}
    if args.json:
        print(json.dumps({"text": tokenizer.decode(tokens, skip_special_tokens=True), "token_ids": tokens,
                          "stats": stats}))
    else:
        tau = f", tau {stats['tau']:.2f}" if "tau" in stats else ""
        print(f"[{stats['new_tokens']} tokens in {stats['steps']} steps, {stats['tokens_per_s']:.1f} tokens/s{tau}]",
              file=sys.stderr)
    return 0


def make_proposer(args, target):
    """(proposer, TreeSpec) from --proposer / --tree / --window, or (None, None)."""
    from .decoding.proposers import PromptLookup, StreamingSelfSpec
    from .decoding.tree import TreeSpec

    name = "longspec" if args.draft and args.proposer == "none" else args.proposer
    if name == "none":
        return None, None
    tree = TreeSpec.parse(args.tree or ("chain:5" if name == "pld" else "4,16,16,16,16"))
    if name == "pld":
        return PromptLookup(), tree
    if name == "streaming":
        return StreamingSelfSpec(window=args.window), tree
    if not args.draft:
        raise ValueError("--proposer longspec needs --draft DIR (a trained LongSpec draft for this target)")
    from .decoding.proposers import LongSpecProposer
    from .models.checkpoint import load_draft

    return LongSpecProposer(load_draft(args.draft, target)), tree


def cmd_convert(args) -> int:
    from .convert import convert_gguf
    from .models.checkpoint import resolve_dtype

    out = convert_gguf(args.gguf, args.out, resolve_dtype(args.dtype))
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a target model")
    gen.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct, converted once)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object last (text, token_ids, stats)")
    gen.add_argument("--proposer", choices=["none", "pld", "streaming", "longspec"], default="none",
                     help="draft strategy: none (autoregressive), pld (prompt lookup), streaming "
                          "(target with a StreamingLLM cache, MagicDec), longspec (needs --draft)")
    gen.add_argument("--tree", default=None,
                     help="tree shape: 'chain:5', per-depth beam widths '4,16,16,16,16' (default) or "
                          "static paths '[[0],[1],[0,0]]'")
    gen.add_argument("--draft", default=None, help="LongSpec draft directory (implies --proposer longspec)")
    gen.add_argument("--window", type=int, default=512, help="recent window of --proposer streaming")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    gen.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="convert a GGUF checkpoint to an HF-format directory")
    conv.add_argument("--gguf", required=True, help="input .gguf file")
    conv.add_argument("--out", required=True, help="output directory")
    conv.add_argument("--dtype", default="float32")
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
