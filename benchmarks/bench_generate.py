"""Speculative decoding benchmark on long real inputs: autoregressive baseline vs prompt lookup
(PLD), StreamingLLM self-speculation (MagicDec) and the LongSpec draft, in the same run.

For each context length, the prompt is real source code (files of one project concatenated,
cut to the length) and every method generates ``--max-new-tokens`` greedy tokens (ours sampled
at ``--temperature`` if given: sampled rounds' costs, transformers still greedy). Reports
acceptance length tau, decode ms/token, speed relative to transformers' compiled static-cache
``generate`` (run in the same process on the same prompt, with its dynamic-cache and prompt-lookup
modes), peak memory, first-call latency (graph capture / compilation) and whether the output
equals our autoregressive output token for token. Prints one JSON line last.

    python benchmarks/bench_generate.py --target DIR [--draft DIR] --prompt-dir SRC_DIR \
        --lengths 2048,4096,7900 --max-new-tokens 128 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec
from longspec.models.checkpoint import load_draft
from longspec.kv.prefix_cache import common_prefix


def add_target_args(p: argparse.ArgumentParser) -> None:
    """``--target`` (default: the default model), ``--device`` and ``--dtype`` (default: bfloat16
    on CUDA, float32 on a CPU): see :func:`target_from_args`."""
    p.add_argument("--target", help="model directory (default: the default model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")


def target_from_args(args) -> tuple:
    """(target directory, dtype, the loaded target) of :func:`add_target_args`' arguments."""
    from longspec.convert import default_model_dir

    target_dir = args.target or str(default_model_dir())
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    return target_dir, dtype, load_target(target_dir, dtype=dtype, device=args.device)


def code_prompt(tokenizer, directory: Path, n_tokens: int) -> list:
    """Concatenated source files of ``directory`` (sorted, with path headers), cut to n_tokens."""
    parts, total = [], 0
    for path in sorted(directory.rglob("*.py")):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(f"# ==== {path.relative_to(directory)} ====\n{text}")
        total += len(text) // 3
        if total > n_tokens * 2:
            break
    ids = tokenizer("".join(parts)).input_ids
    if len(ids) < n_tokens:
        raise ValueError(f"{directory} holds only {len(ids)} tokens, {n_tokens} asked")
    return ids[:n_tokens]


def methods(args, target, prompt):
    out = {"ar": (None, None, None),  # (proposer, tree, draft)
           "pld": (PromptLookup(), TreeSpec.parse(args.pld_tree), None),
           "streaming": (StreamingSelfSpec(window=args.window), TreeSpec.parse(args.tree), None)}
    if args.draft:
        draft = load_draft(args.draft, target)
        out["longspec"] = (LongSpecProposer(draft), TreeSpec.parse(args.tree), None)
        out["longspec-chain"] = (LongSpecProposer(draft), TreeSpec.parse(args.chain_tree), None)
        out["hybrid"] = (LongSpecProposer(draft, lookup=PromptLookup()), TreeSpec.parse(args.hybrid_tree), None)
    if "auto" in args.methods.split(","):  # what `longspec generate` runs by default
        out["auto"] = ("auto", None, args.draft)
    return {k: v for k, v in out.items() if k in args.methods.split(",") or args.methods == "all"}


def first_difference(model32, prompt: list, ours: list, ref: list) -> dict:
    """Where greedy ``ours`` first leaves ``ref`` (our autoregressive output): the token index, and
    the logits there of transformers' float32 model on the prompt + the common prefix: the gap
    between the two tokens and the size of one bfloat16 step (ulp) at the larger logit. A gap
    within a few ulps means both tokens are the target's greedy choice up to bf16 rounding; a
    large one would mean a wrong token (a bug)."""
    i = common_prefix(ours, ref)
    if i == min(len(ours), len(ref)):
        return {"index": i, "note": "one output is a prefix of the other"}
    with torch.no_grad():
        row = model32(torch.tensor([prompt + ref[:i]], device=model32.device)).logits[0, -1].float()
    top = max(row[ref[i]].item(), row[ours[i]].item())
    ulp = 2.0 ** (torch.tensor(abs(top)).log2().floor().item() - 7)  # bf16: 8 significant bits
    return {"index": i, "ar_token": ref[i], "our_token": ours[i], "gap": row[ref[i]].item() - row[ours[i]].item(),
            "bf16_ulp": ulp, "fp32_choice": int(row.argmax())}


def peak_mib(fn):
    """Runs fn; returns (its result, the peak device memory it allocated beyond what was already
    allocated, MiB): the caches and activations of one generation, not the weights."""
    if not torch.cuda.is_available():
        return fn(), float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - before) / 2**20


def run_ours(target, proposer, tree, prompt, config, repeats, draft=None):
    """``proposer``: an object, None, or a name (``draft``: the LongSpec draft "auto" and the
    named drafts use)."""
    gc.collect()  # the previous method's engine (a reference cycle) must not count here
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    make = lambda: Generator(target, proposer=proposer, tree=tree, draft=draft)  # noqa: E731
    gen = make()
    t0 = time.perf_counter()
    # the first call on a fresh generator: engine, compilation, CUDA-graph capture, caches
    first, peak = peak_mib(lambda: gen.generate([prompt], config))
    first_call_s = time.perf_counter() - t0
    times, out = [], first
    for _ in range(repeats):
        out = gen.generate([prompt], config)
        times.append(out.stats["decode_s"])
    decode_s = statistics.median(times)
    n = out.stats["new_tokens"] - 1
    state, resident = gen._engine.cache.nbytes, 0  # what the method must hold: the KV cache, the draft's state
    if getattr(proposer, "ring", None) is not None:
        state += proposer.ring.nbytes + proposer.draft.head_copy_nbytes
        resident = sum(t.numel() * t.element_size() for t in proposer.draft.parameters())  # loaded before
    gen = None
    gc.collect()
    # a fresh generator once this method's steps are compiled: caches, capture, activations only
    _, warm_peak = peak_mib(lambda: make().generate([prompt], config))
    return out.sequences[0], {"ms_per_token": 1e3 * decode_s / n, "tau": out.stats.get("tau", 1.0),
                              "draft_s": out.stats.get("draft_s", 0.0), "verify_s": out.stats.get("verify_s", 0.0),
                              "peak_mib": peak, "warm_peak_mib": warm_peak, "state_mib": state / 2**20, "draft_mib": resident / 2**20, "steps": out.stats["steps"],
                              "first_call_s": first_call_s, "capture_s": first.stats["capture_s"],
                              "cuda_graphs": out.stats["cuda_graphs"], "trees": out.stats.get("trees")}


def run_hf(model, prompt, max_new, repeats, **kwargs):
    """transformers' generate: decode ms/token = (time for max_new tokens - time for 1) / (max_new - 1)."""
    ids = torch.tensor([prompt], device=model.device)
    attn = torch.ones_like(ids)

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def gen(n):
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             **kwargs)
        sync()
        return out, time.perf_counter() - t

    t0 = time.perf_counter()
    for _ in range(2):  # warm-up (compilation for the static cache)
        gen(max_new)
        gen(1)
    first_call_s = time.perf_counter() - t0
    full, one, out, peak = [], [], None, float("nan")
    for _ in range(repeats):
        (out, t), peak = peak_mib(lambda: gen(max_new))
        full.append(t)
        one.append(gen(1)[1])
    decode = statistics.median(full) - statistics.median(one)
    return out[0, len(prompt):].tolist(), {"ms_per_token": 1e3 * decode / (max_new - 1), "tau": None,
                                           "peak_mib": peak, "warmup_s": first_call_s}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--prompt-dir", required=True, help="a directory of source code (one project)")
    p.add_argument("--lengths", default="2048,4096,7900")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="4,16,16,16,16")
    p.add_argument("--hybrid-tree", default="4,16,16,16,16,1,1,1,1,1", help="tree of the hybrid (draft + lookup)")
    p.add_argument("--chain-tree", default="chain:5")
    p.add_argument("--pld-tree", default="chain:5")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--methods", default="ar,pld,longspec,longspec-chain,hybrid",
                   help="ar, pld, streaming, longspec, longspec-chain, hybrid, auto (--proposer auto), or all")
    p.add_argument("--hf", default="dynamic,static,pld", help="transformers baselines (empty: none)")
    p.add_argument("--attention", default=None,
                   help="attention implementations of our steps, comma-separated; a +compile suffix (triton+compile) "
                        "runs the steps through torch.compile (default: triton+compile on CUDA, as load_target; "
                        "sdpa on a CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="ours sample at this temperature (seed 0; no top-k / top-p); transformers stays greedy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    args = p.parse_args(argv)
    args.attention = args.attention or ("triton+compile" if args.device.startswith("cuda") else "sdpa")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    hf = None
    if args.hf:
        hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype),
                                                  attn_implementation="sdpa").to(args.device).eval()
    hf_kwargs = {"dynamic": {}, "static": {"cache_implementation": "static"},
                 "pld": {"prompt_lookup_num_tokens": 10}}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=args.temperature,
                              seed=0 if args.temperature else None)
    rows, model32 = [], None  # model32: transformers in float32, loaded at a first difference
    for n in map(int, args.lengths.split(",")):
        prompt = code_prompt(tokenizer, Path(args.prompt_dir), n)
        results = []
        impls = args.attention.split(",")
        for impl in impls:  # ours first: a crash of ours is not blamed on transformers' compiled graphs
            target.attention_impl, _, extra = impl.partition("+")  # e.g. "triton+compile"
            target.compile_steps = extra == "compile"
            for name, (proposer, tree, draft) in methods(args, target, prompt).items():
                seq, res = run_ours(target, proposer, tree, prompt, config, args.repeats, draft)
                res["attention"] = impl
                results.append((name if impl == impls[0] else f"{name}@{impl}", tree, seq, res))
                print(f"  done {n} {name} {impl}: {res['ms_per_token']:.2f} ms/token, tau {res['tau']:.2f}, "
                      f"first call {res['first_call_s']:.1f} s, peak +{res['peak_mib']:.0f} MiB, a fresh generator's "
                      f"+{res['warm_peak_mib']:.0f} MiB (KV + draft state {res['state_mib']:.0f} MiB, draft "
                      f"{res['draft_mib']:.0f} MiB)", flush=True)  # printed now: a later crash keeps them
            proposer = tree = draft = None  # the last one would keep its engine's cache and buffers alive
        for name in filter(None, args.hf.split(",")):
            seq, res = run_hf(hf, prompt, args.max_new_tokens, args.repeats, **hf_kwargs[name])
            results.append((f"hf-{name}", None, seq, res))
        # greedy output of each method against autoregressive decoding with the same attention
        reference = {r.get("attention"): seq for name, _, seq, r in results if name.split("@")[0] == "ar"}
        # the strongest transformers baseline run: the compiled static cache, else the default cache
        base_name = next((n for n in ("hf-static", "hf-dynamic") if any(name == n for name, *_ in results)), None)
        base = next((r["ms_per_token"] for name, _, _, r in results if name == base_name), None)
        for name, tree, seq, res in results:
            # (sampled: no reference; transformers' greedy tokens are not ours)
            ref = reference.get(res.get("attention", impls[0])) if not args.temperature else None
            shown = ">".join(t or "plain" for _, t in res["trees"]) if res.get("trees") else str(tree) if tree else None
            res.update(method=name, context=n, tree=shown, matches_ar=seq == ref if ref is not None else None,
                       speedup_vs_hf=(base / res["ms_per_token"]) if base else None, hf_baseline=base_name)
            if ref is not None and seq != ref:
                if model32 is None:
                    model32 = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(args.device).eval()
                res["first_difference"] = first_difference(model32, prompt, seq, ref)
            rows.append(res)
            print(f"{n:>6} {name:<15} {res['tree'] or '-':<14} tau {res['tau'] or 1.0:5.2f} "
                  f"{res['ms_per_token']:7.2f} ms/tok  x{(res['speedup_vs_hf'] or float('nan')):5.2f} "
                  f"vs {base_name}  +{res['peak_mib']:6.0f} MiB  same-as-AR {res['matches_ar']}", flush=True)
            if "first_difference" in res:
                print(f"{'':>6} {'':<15} first difference: {res['first_difference']}", flush=True)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    # each storage once (the LM head may be the embedding: tied)
    weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in target.state_dict().values()}.values()) / 2**20
    print(f"peak = device memory a generation allocates beyond the loaded weights ({weights:.0f} MiB); "
          "memory ratio = (weights + draft + peak) / (weights + draft + KV cache + draft state)")
    for r in rows:
        if "state_mib" in r and r["peak_mib"] == r["peak_mib"]:
            held, floor = weights + r["draft_mib"], weights + r["draft_mib"] + r["state_mib"]
            r["memory_ratio"], r["warm_memory_ratio"] = (held + r["peak_mib"]) / floor, (held + r["warm_peak_mib"]) / floor
            print(f"{r['context']:>6} {r['method']:<15} memory ratio {r['memory_ratio']:.2f} (first call), "
                  f"{r['warm_memory_ratio']:.2f} (a fresh generator, steps compiled)  first call {r['first_call_s']:.1f} s")
    print(json.dumps({"device": device_name, "dtype": args.dtype, "attention": args.attention, "weights_mib": weights,
                      "max_new_tokens": args.max_new_tokens, "results": rows}))


if __name__ == "__main__":
    main()
