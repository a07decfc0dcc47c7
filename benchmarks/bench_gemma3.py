"""Gemma 3 (270M: 32k context, 15 of 18 layers with a 512-token sliding window) on the GPU:

1. parity of our logits with transformers' in bfloat16 on an 8k prompt (the last 256 positions:
   max abs diff and argmax agreement; float32 in the CPU smoke run);
2. tau and decode ms/token at each length of ``--lengths`` for plain decoding, prompt lookup,
   LongSpec (beam tree), the hybrid (draft + lookup), ``auto`` (what ``longspec generate`` runs by
   default: the proposer and tree its cost model picks), greedy and T=1 (``--temperatures``), and
   transformers' compiled static-cache ``generate`` (greedy, after all of ours), prompts cut from
   held-out text (``--prompt-dirs``: folders of Python files, e.g. code and the documentation text
   of ``pydoc_data``; it is a base model, so completion prompts). ``--ends`` prompts per kind,
   ``--end-shift`` tokens apart; each length's prompt is the last n tokens before the same end
   point, so the lengths continue the same text and differ only in how much context they see.
   The longest length leaves room for the new tokens in the model's 32,768 positions;
3. the draft's memory (its ring buffer and reduced head) after a prompt of the shortest and of the
   longest length: it must not grow with the context.

``--methods`` picks among them (e.g. ``hf-static`` alone in a process of its own). Prints a line
per result, a summary (mean tau and ms/token over the end points, the speed-up per token over
transformers) and one JSON line last; ``--out`` is rewritten after every result.

    python benchmarks/bench_gemma3.py --target DIR --draft DIR --prompt-dirs SRC_DIR PROSE_DIR \
        --lengths 2048,8192,16384,32512 --out gemma3.json
    python benchmarks/bench_gemma3.py --random-tiny --out smoke.json   # CPU smoke run

``--random-tiny`` builds a tiny random Gemma 3 folder (byte-level tokenizer), a random draft and
uses this repository's sources and docs as prompts: every step runs, the numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_generate import code_prompt, peak_mib, run_hf, run_ours
from longspec import GenerationConfig, load_target
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.tree import TreeSpec
from longspec.models.checkpoint import load_draft, save_draft
from longspec.models.draft import DraftConfig, init_draft

REPO = Path(__file__).resolve().parents[1]


def build_random_tiny(folder: Path) -> tuple:
    """A tiny random Gemma 3 folder (6 layers, window 64, globals at 2 and 5, head_dim 64,
    byte-level BPE tokenizer of 300 tokens) and a random draft for it: (target dir, draft dir)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    target_dir, draft_dir = folder / "gemma3-tiny", folder / "gemma3-tiny-draft"
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{ch: 3 + i for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>")
    config = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=64, max_position_embeddings=4096,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, bos_token_id=2, eos_token_id=1,
        pad_token_id=0)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(target_dir)
    fast.save_pretrained(target_dir)
    target = load_target(target_dir)
    save_draft(init_draft(DraftConfig.for_target(target, window=64), target), draft_dir)
    return target_dir, draft_dir


@torch.no_grad()
def parity(target, hf, prompt: list, tail: int = 256) -> dict:
    """Our logits against transformers' over the last ``tail`` positions of ``prompt`` (our prefill
    of the rest, then the tail as a continuation; transformers in one forward)."""
    n = len(prompt)
    ids = torch.tensor([prompt], device=target.device)
    cache = target.new_cache(1, n)
    target.prefill(ids[:, :n - tail], torch.tensor([n - tail]), cache)
    ours = target.prefill(ids[:, n - tail:], torch.tensor([tail]), cache, all_logits=True)[0]
    theirs = hf(ids, logits_to_keep=tail).logits[0].float()
    return {"positions": tail, "context": n, "max_abs_diff": float((ours - theirs).abs().max()),
            "logit_scale": float(theirs.abs().max()),
            "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}


def ended_prompts(tokenizer, directory: Path, longest: int, ends: int, shift: int) -> list:
    """``ends`` token lists of ``longest`` tokens of ``directory``'s text, the k-th ending
    ``k * shift`` tokens after the first: each length's prompt is the last n tokens of one of
    them, so every length continues the same text and tau differs only by the context."""
    tokens = code_prompt(tokenizer, directory, longest + (ends - 1) * shift)
    return [tokens[k * shift:k * shift + longest] for k in range(ends)]


def summary(results: list) -> list:
    """Per length, kind and temperature: each method's mean tau and ms/token over the end points,
    and its speed-up per token over transformers' compiled static cache (at the same length; of the
    same kind of text where it ran on it)."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r["context"], r["prompts"], r["temperature"], r["method"]), []).append(r)
    rows = []
    for (n, kind, temperature, method), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        # transformers' time per token depends on the length, not the text: any kind's at this length
        hf = groups.get((n, kind, 0.0, "hf-static")) or next(
            (rs for key, rs in groups.items() if key[0] == n and key[3] == "hf-static"), None)
        ms = statistics.mean(r["ms_per_token"] for r in rs)
        row = {"context": n, "prompts": kind, "temperature": temperature, "method": method, "prompts_n": len(rs),
               "ms_per_token": ms}
        if rs[0]["tau"] is not None:
            row["tau"] = statistics.mean(r["tau"] for r in rs)
        if hf and method != "hf-static":
            row["x_hf_static"] = hf[0]["ms_per_token"] / ms
        rows.append(row)
    return rows


@torch.inference_mode()  # (as the engine drafts: the head rows it copied are inference tensors)
def draft_memory(target, draft, prompt: list, tree: TreeSpec) -> dict:
    """Bytes the draft holds (ring buffer, reduced head rows) and the peak device memory of one
    drafting round after ``prompt`` is in the target's cache."""
    cache = target.new_cache(1, len(prompt) + tree.num_nodes + 1)
    target.prefill(torch.tensor([prompt], device=target.device), torch.tensor([len(prompt)]), cache)
    proposer = LongSpecProposer(draft)
    proposer.begin(target, cache, tree, GenerationConfig(), None)
    proposer.add(0, prompt, prompt[-1])
    root = torch.tensor([prompt[-1]], device=target.device)
    _, peak = peak_mib(lambda: proposer.propose(root))
    return {"context": len(prompt), "ring_bytes": proposer.ring.nbytes, "head_copy_bytes": draft.head_copy_nbytes,
            "round_peak_mib": peak}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF folder of Gemma 3 (Gemma3ForCausalLM)")
    p.add_argument("--draft", help="its LongSpec draft")
    p.add_argument("--prompt-dirs", nargs="+", help="held-out text: code and prose folders (never trained on)")
    p.add_argument("--lengths", default="2048,8192,16384,32512")
    p.add_argument("--parity-length", type=int, default=8192)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="4,16,16,16,16")
    p.add_argument("--hybrid-tree", default="4,16,16,16,16,1,1,1,1,1")
    p.add_argument("--pld-tree", default="chain:5")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="plain,pld,longspec,hybrid,auto,hf-static",
                   help="which to run (hf-static: transformers' compiled static cache, after all of ours)")
    p.add_argument("--ends", type=int, default=3, help="prompts per kind of text: end points --end-shift apart")
    p.add_argument("--end-shift", type=int, default=1024, help="tokens between two prompts' end points")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--random-tiny", action="store_true", help="CPU smoke run on a tiny random Gemma 3")
    p.add_argument("--merge", help="the --out JSON of an earlier run whose results join this one's summary (e.g. "
                   "ours, when transformers' --methods hf-static runs in a process of its own)")
    p.add_argument("--out", required=True, help="JSON file of the results")
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    scratch = None
    if args.random_tiny:
        scratch = tempfile.TemporaryDirectory()
        args.target, args.draft = map(str, build_random_tiny(Path(scratch.name)))
        args.prompt_dirs = args.prompt_dirs or [str(REPO / "longspec"), str(REPO / "benchmarks")]
        if args.lengths == p.get_default("lengths"):
            args.lengths, args.parity_length, args.max_new_tokens, args.repeats = "256,1024", 512, 12, 1
    if not (args.target and args.draft and args.prompt_dirs):
        p.error("--target, --draft and --prompt-dirs are needed (or --random-tiny)")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = load_target(args.target, dtype=dtype, device=args.device)
    draft = load_draft(args.draft, target)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, dtype),
                                              attn_implementation="sdpa").to(args.device).eval()
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "dtype": dtype,
              "target": args.target, "draft": args.draft, "results": []}
    report["parity"] = parity(target, hf, code_prompt(tokenizer, Path(args.prompt_dirs[0]), args.parity_length))
    print(f"parity at {args.parity_length}: {report['parity']}", flush=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    # the draft's memory first: cheap, and a goal of its own
    report["draft_memory"] = [draft_memory(target, draft, code_prompt(tokenizer, Path(args.prompt_dirs[0]), n),
                                           TreeSpec.parse(args.tree)) for n in (lengths[0], lengths[-1])]
    print(f"draft memory: {report['draft_memory']}", flush=True)

    def record(res: dict) -> None:  # the JSON holds every result so far (a run cut short keeps them)
        report["results"].append(res)
        Path(args.out).write_text(json.dumps(report) + "\n")

    methods = {"plain": (None, None), "pld": (PromptLookup(), args.pld_tree),
               "longspec": (LongSpecProposer(draft), args.tree),
               "hybrid": (LongSpecProposer(draft, lookup=PromptLookup()), args.hybrid_tree),
               "auto": ("auto", None)}  # what `longspec generate` runs by default
    chosen = [m for m in args.methods.split(",") if m]
    unknown = set(chosen) - set(methods) - {"hf-static"}
    if unknown:
        p.error(f"unknown --methods {sorted(unknown)}; expected some of {', '.join([*methods, 'hf-static'])}")
    methods = {name: methods[name] for name in chosen if name in methods}
    by_kind = {Path(d).name: ended_prompts(tokenizer, Path(d), lengths[-1], args.ends, args.end_shift)
               for d in args.prompt_dirs}
    # end points outermost: a run cut short still has every kind and length for its first end points
    prompts = {(n, kind, end): by_kind[kind][end][-n:] for end in range(args.ends) for kind in by_kind for n in lengths}
    for (n, kind, end), prompt in prompts.items():
        for temperature in map(float, args.temperatures.split(",")):
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                      temperature=temperature, seed=0 if temperature else None)
            for name, (proposer, tree) in methods.items():
                _, res = run_ours(target, proposer, tree and TreeSpec.parse(tree), prompt, config, args.repeats,
                                  draft=draft)
                res.update(method=name, context=n, prompts=kind, end=end, temperature=temperature)
                record(res)
                print(f"{n:>6} {kind:<12} end {end} T={temperature:g} {name:<9} tau {res['tau']:5.2f} "
                      f"{res['ms_per_token']:7.2f} ms/token  (first call {res['first_call_s']:.2f} s)", flush=True)
    # transformers last: in one process, our next generate after its compiled static-cache generate
    # once died on the H200 ("unspecified launch failure"; gemma3_table_h200.log)
    for (n, kind, end), prompt in prompts.items():
        if end or "hf-static" not in chosen:
            continue  # its speed per token: one prompt per length and kind
        start = time.perf_counter()  # on CUDA, transformers compiles static-cache decoding itself
        _, res = run_hf(hf, prompt, args.max_new_tokens, args.repeats, cache_implementation="static")
        res.update(method="hf-static", context=n, prompts=kind, end=end, temperature=0.0,
                   wall_s=time.perf_counter() - start)
        record(res)
        print(f"{n:>6} {kind:<12} T=0 hf-static {res['ms_per_token']:7.2f} ms/token", flush=True)
    if args.merge:
        report["results"] += json.loads(Path(args.merge).read_text())["results"]
    report["summary"] = summary(report["results"])
    print("summary (means over the end points; x: transformers' ms/token over this one's)")
    for r in report["summary"]:
        print(f"{r['context']:>6} {r['prompts']:<12} T={r['temperature']:g} {r['method']:<9} "
              f"tau {r.get('tau', float('nan')):5.2f} {r['ms_per_token']:7.2f} ms/token  x{r.get('x_hf_static', float('nan')):5.2f}")
    print(json.dumps(report))
    Path(args.out).write_text(json.dumps(report) + "\n")  # (with the merged results and the summary)
    if scratch is not None:
        scratch.cleanup()


if __name__ == "__main__":
    main()
