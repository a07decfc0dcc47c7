"""Speed on a user's workload: different requests one after another in one process, and
``longspec generate`` in a fresh process.

Protocol, the same for every method, in one process: one warm-up call on an unrelated prompt of
``--warmup-length`` tokens, then pass 1 (``--lengths``: prompts of different lengths, each from
another project under ``--prompt-dirs``, each length new to the process), then pass 2 (the same
prompts again; sampled settings with ``--seeds N``: each prompt once per seed). Every call is
timed on the wall clock from the call to its last token, prefill included, and reports what it
spent compiling and capturing. Methods: ours (plain decoding, the
LongSpec draft, the hybrid, ``auto``: what ``longspec generate`` runs by default) and
transformers' ``generate`` with its compiled static cache and its dynamic cache on the same
model. Greedy outputs are compared with our plain decoding. ``--sampling`` runs the workload once
per setting: ``greedy`` on the source code, sampled settings (``t1``: temperature 1; ``t0.7p0.9``:
temperature 0.7, top-p 0.9) on the same code as a chat request ("Explain this code"). Every call
of ours is also given as a ratio to our plain decoding's call on the same prompt, stage and
setting: the headline is what speculation buys (median and worst call); ``--interleave`` runs each
prompt's calls of every method side by side (after the warm-ups), so that a stretch of a slower
device falls on both calls a ratio compares. Then, with ``--fresh-process``, the
wall time of ``longspec generate`` on the longest prompt in a new process, with cold on-disk
compile caches (a new folder) and with warm ones (the same folder again).

    python benchmarks/bench_workload.py --target DIR --draft DIR --prompt-dirs A,B,C,D \
        --lengths 2000,5000,7600 --warmup-length 1000 --max-new-tokens 128 --fresh-process \
        --sampling greedy,t1,t0.7p0.9

Prints a table per pass and one JSON line last; ``--profile-host`` also profiles our methods'
pass-2 calls on the host outside their rounds (where auto's own work goes)."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.models.checkpoint import load_draft
from bench_generate import code_prompt  # (this script's folder is on the path)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostProfile:
    """cProfile of a call's work on the host outside its rounds (``Engine.launch`` and ``finish`` are left out):
    planning, setup, the prefill's launches, the controller, switches, re-predictions."""

    def __init__(self):
        import cProfile

        self.profile = cProfile.Profile()

    def run(self, gen, prompt, config):
        from longspec.engine.engine import Engine

        profile, methods = self.profile, {name: getattr(Engine, name) for name in ("launch", "finish")}

        def unprofiled(method):
            def run(engine, *args, **kwargs):
                profile.disable()
                try:
                    return method(engine, *args, **kwargs)
                finally:
                    profile.enable()
            return run

        for name, method in methods.items():
            setattr(Engine, name, unprofiled(method))
        profile.enable()
        try:
            return gen.generate([prompt], config)
        finally:
            profile.disable()
            for name, method in methods.items():
                setattr(Engine, name, method)

    def report(self, title: str, rows: int = 30) -> None:
        import io
        import pstats

        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(self.profile, stream=text).sort_stats(order).print_stats(rows)
            print(f"--- host work outside the rounds, {title} (pass 2, cProfile, by {order})")
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:8000], flush=True)


class Collections:
    """Python's garbage collections while a call runs (``gc.callbacks``): their seconds and the
    longest one (a full collection of a process that compiled its steps scans every object
    alive; in the middle of a call it stalls the rounds)."""

    def __init__(self):
        self.seconds, self.longest, self._start = 0.0, 0.0, None
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            took = time.perf_counter() - self._start
            self.seconds, self.longest, self._start = self.seconds + took, max(self.longest, took), None

    def mark(self) -> float:
        """A call starts: its longest collection so far none."""
        self.longest = 0.0
        return self.seconds

    def since(self, mark: float) -> dict:
        """{gc_s, gc_longest_s} since :meth:`mark` returned ``mark``."""
        return {"gc_s": self.seconds - mark, "gc_longest_s": self.longest}


COLLECTIONS = Collections()


def ours(target, proposer, draft, config, profile=None):
    """A call of ours: (tokens, stats) with the wall time of the whole call; ``profile``: a
    :class:`HostProfile` that profiles the calls of pass 2 (``call(prompt, profiled=True)``).
    ``proposer`` "NAME:TREE" runs that tree throughout, its levels joined by "-" (``hybrid:4-4``)."""
    name, _, tree = (proposer or "").partition(":")
    gen = Generator(target, proposer=name or None, draft=draft, tree=tree.replace("-", ",") or None)

    def call(prompt, profiled=False, seed=None):
        cfg = config if seed is None else dataclasses.replace(config, seed=seed)
        sync()
        mark = COLLECTIONS.mark()
        t = time.perf_counter()
        out = profile.run(gen, prompt, cfg) if profiled and profile is not None else gen.generate([prompt], cfg)
        sync()
        wall, stats = time.perf_counter() - t, out.stats
        # (per round: draft_s / steps and verify_s / steps, device time: what auto's note predicted)
        return out.sequences[0], {"wall_s": wall, **COLLECTIONS.since(mark), "prefill_s": stats["prefill_s"],
                                  "capture_s": stats["capture_s"], "plan_s": stats.get("plan_s", 0.0),
                                  "setup_s": stats["setup_s"], "host_s": stats["host_s"], "rounds_s": stats["rounds_s"],
                                  "cached_tokens": stats["cached_tokens"],
                                  "tau": stats.get("tau", 1.0), "accepted_hist": stats.get("accepted_hist"),
                                  "trees": stats.get("trees"), "auto": stats.get("auto"), "steps": stats["steps"],
                                  "draft_s": stats.get("draft_s"), "verify_s": stats.get("verify_s")}
    return call


def parts(res: dict) -> str:
    """Where a call of ours spent its time: auto's plan, the setup before the prefill, the
    prefill, the rounds (their number; the rest of the wall time over them: the time a round
    takes, the host's reading of it included), the loop's work between rounds (auto's controller,
    switches, re-predictions), auto's switches and Python's garbage collections during the call
    (their milliseconds, the longest one's)."""
    if "prefill_s" not in res:
        return ""
    switches = f" switches {len(res['trees']) - 1}" if res.get("trees") else ""
    return (f"  plan {1e3 * res['plan_s']:5.1f} ms  setup {1e3 * res['setup_s']:5.1f} ms  prefill {1e3 * res['prefill_s']:6.1f}"
            f" ms ({res['cached_tokens']} tokens cached)  rounds {res['steps']:3d} ({1e3 * res['rounds_s'] / max(res['steps'], 1):.2f}"
            f" ms each)  between rounds {1e3 * res['host_s']:5.1f} ms{switches}  gc {1e3 * res['gc_s']:.1f} ms"
            f" (longest {1e3 * res['gc_longest_s']:.1f})")


def sampling_config(name: str, max_new_tokens: int) -> GenerationConfig:
    """``greedy``, ``tT`` (temperature T) or ``tTpP`` (temperature T, top-p P)."""
    if name == "greedy":
        return GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    temperature, _, top_p = name[1:].partition("p")
    return GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=float(temperature),
                            top_p=float(top_p) if top_p else None, seed=0)


def chat_prompt(tokenizer, ids: list) -> list:
    """The code ``ids`` as a chat request asking to explain it (cut to about the same length)."""
    code = tokenizer.decode(ids)
    messages = [{"role": "user", "content": f"Explain what this code does, part by part:\n\n{code}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def transformers_call(model, config, **kwargs):
    """A call of transformers' generate (exactly max_new_tokens; sampled with the config's settings)."""
    sampled = config.temperature > 0
    if sampled:
        kwargs.update(do_sample=True, temperature=config.temperature, top_p=config.top_p or 1.0, top_k=0)

    def call(prompt, seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        ids = torch.tensor([prompt], device=model.device)
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=config.max_new_tokens,
                             min_new_tokens=config.max_new_tokens, **({} if sampled else {"do_sample": False}), **kwargs)
        sync()
        return out[0, len(prompt):].tolist(), {"wall_s": time.perf_counter() - t}
    return call


def fresh_process(args, prompt_text: str, cache_dir: str) -> dict:
    """``longspec generate`` (the default proposer, auto) in a new process: its wall time, model
    load included, with the compile caches under ``cache_dir``."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt_text)
    env = dict(os.environ, LONGSPEC_HOME=cache_dir, TORCHINDUCTOR_CACHE_DIR=str(Path(cache_dir) / "inductor"),
               TRITON_CACHE_DIR=str(Path(cache_dir) / "triton"))
    cmd = [sys.executable, "-m", "longspec.cli", "generate", "--target", args.target, "--prompt-file", f.name,
           "--max-new-tokens", str(args.max_new_tokens), "--json"]
    if args.draft:
        cmd += ["--draft", args.draft]
    t = time.perf_counter()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    os.unlink(f.name)
    if run.returncode != 0:
        return {"wall_s": wall, "error": run.stderr[-2000:]}
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "proposer": out.get("proposer"), "tree": out.get("tree"),
            "tokens_per_s": out["stats"].get("tokens_per_s"), "capture_s": out["stats"].get("capture_s")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", help="the LongSpec draft (longspec, hybrid and auto)")
    p.add_argument("--prompt-dirs", required=True,
                   help="comma-separated source trees: the warm-up prompt from the first, one prompt per length "
                        "from each of the others (text the draft never saw)")
    p.add_argument("--lengths", default="2000,5000,7600")
    p.add_argument("--warmup-length", type=int, default=1000)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="plain,longspec,hybrid,auto,hf-static,hf-dynamic",
                   help="comma-separated; NAME:TREE runs one tree throughout, its levels joined by '-' (hybrid:4-4)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fresh-process", action="store_true", help="also time `longspec generate` in new processes")
    p.add_argument("--sampling", default="greedy", help="comma-separated settings: greedy, tT, tTpP (see above)")
    p.add_argument("--seeds", type=int, default=1,
                   help="sampled settings: every call of a pass with seeds 0..N-1 (each method samples its own text, "
                        "and whether it repeats its prompt decides what a lookup makes of it: one seed is a lottery)")
    p.add_argument("--out", help="also write the JSON results to this file")
    p.add_argument("--interleave", action="store_true",
                   help="after every method's warm-up, run each prompt's calls side by side (plain decoding's, then "
                        "the others'), not each method's calls in a block: a stretch of a slower device or host then "
                        "falls on the calls a ratio compares, not on one method's")
    p.add_argument("--profile-host", action="store_true",
                   help="profile our methods' pass-2 calls on the host outside their rounds (their times then include "
                        "the profiler's overhead)")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    target = load_target(args.target, dtype=args.dtype, device=device)
    draft = load_draft(args.draft, target) if args.draft else None
    load_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    dirs = [Path(d) for d in args.prompt_dirs.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    if len(dirs) < len(lengths) + 1:
        raise SystemExit(f"--prompt-dirs needs {len(lengths) + 1} folders (warm-up + one per length)")
    warmup = code_prompt(tokenizer, dirs[0], args.warmup_length)
    prompts = [code_prompt(tokenizer, d, n) for d, n in zip(dirs[1:], lengths)]
    methods = [m for m in args.methods.split(",") if m]
    hf = None
    rows, summary = [], []
    for setting in args.sampling.split(","):
        config = sampling_config(setting, args.max_new_tokens)
        greedy = config.temperature == 0
        first, tests = (warmup, prompts) if greedy else (chat_prompt(tokenizer, warmup),
                                                          [chat_prompt(tokenizer, x) for x in prompts])
        calls, profiles = {}, {}
        for name in methods:
            if name.startswith("hf-"):
                if hf is None:
                    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype),
                                                              attn_implementation="sdpa").to(device).eval()
                kwargs = {"cache_implementation": "static"} if name == "hf-static" else {}
                calls[name] = transformers_call(hf, config, **kwargs)
            else:
                profiles[name] = HostProfile() if args.profile_host else None
                calls[name] = ours(target, None if name == "plain" else name, draft, config, profiles[name])
        reference, plain_wall, mine = {}, {}, []
        seeds = [None] if greedy or args.seeds <= 1 else list(range(args.seeds))
        runs = [("warm-up", first, None)] + [(stage, x, seed) for stage in ("pass 1", "pass 2") for x in tests
                                             for seed in seeds]
        # ours first (transformers' compiled graphs come after); --interleave: every method's
        # warm-up, then each prompt's calls side by side, one method after another
        order = ([(name, run) for name in methods for run in runs] if not args.interleave else
                 [(name, runs[0]) for name in methods] + [(name, run) for run in runs[1:] for name in methods])
        for name, (stage, prompt, seed) in order:
            if stage == "warm-up":
                gc.collect()
            kwargs = {} if seed is None else {"seed": seed}
            profiled = stage == "pass 2" and profiles.get(name)
            tokens, res = calls[name](prompt, profiled=True, **kwargs) if profiled else calls[name](prompt, **kwargs)
            key = len(prompt), seed
            if name == "plain":
                reference.setdefault(key, tokens)
                plain_wall[stage, key] = res["wall_s"]
            res.update(method=name, setting=setting, stage=stage, prompt_tokens=len(prompt), seed=seed,
                       ms_per_token=1e3 * res["wall_s"] / args.max_new_tokens,
                       same_as_plain=tokens == reference.get(key) if greedy and key in reference else None,
                       vs_plain=plain_wall[stage, key] / res["wall_s"] if (stage, key) in plain_wall else None)
            mine.append(res)
            vs = f"{res['vs_plain']:5.2f}x plain" if res["vs_plain"] else ""
            stage = stage if seed is None else f"{stage} s{seed}"
            print(f"{setting:<9} {name:<10} {stage:<8} {len(prompt):>6} tokens  {res['wall_s']:8.3f} s  {vs}"
                  f"  capture+compile {res.get('capture_s', float('nan')):7.3f} s  tau {res.get('tau') or 1:5.2f}"
                  f"  same-as-plain {res['same_as_plain']}{parts(res)}  {(res.get('auto') or '')[-300:]}", flush=True)
        for name in methods:
            if profiles.get(name):
                profiles[name].report(f"{setting} {name}")
        rows += mine
        base = {stage: statistics.median(r["wall_s"] for r in mine if r["method"] == "hf-static" and r["stage"] == stage)
                for stage in ("pass 1", "pass 2")} if "hf-static" in methods else {}
        for name in methods:
            line = {"method": name, "setting": setting}
            for stage in ("warm-up", "pass 1", "pass 2"):
                these = [r for r in mine if r["method"] == name and r["stage"] == stage]
                line[stage] = statistics.median(r["wall_s"] for r in these)
                if stage in base:
                    line[f"{stage} vs hf-static"] = base[stage] / line[stage]
                if stage != "warm-up" and "capture_s" in these[0]:
                    line[f"{stage} max capture share"] = max(r["capture_s"] / r["wall_s"] for r in these)
            tested = [r["vs_plain"] for r in mine if r["method"] == name and r["stage"] != "warm-up" and r["vs_plain"]]
            if tested:
                line.update(vs_plain_median=statistics.median(tested), vs_plain_worst=min(tested))
            summary.append(line)
    print(f"\nmedian wall seconds per call ({args.max_new_tokens} new tokens, prefill included); ours against our plain "
          "decoding (median, worst call, passes 1 and 2); transformers' compiled static cache / this method")
    for line in summary:
        ratio = "".join(f"  x{line[f'{s} vs hf-static']:5.2f}" if f"{s} vs hf-static" in line else "" for s in
                        ("pass 1", "pass 2"))
        plain = (f"  vs plain {line['vs_plain_median']:5.2f}x (worst {line['vs_plain_worst']:5.2f}x)"
                 if "vs_plain_median" in line else "")
        print(f"{line['setting']:<9} {line['method']:<10} first call {line['warm-up']:7.2f}  pass 1 {line['pass 1']:7.3f}  "
              f"pass 2 {line['pass 2']:7.3f}{plain}{ratio}")
    fresh = {}
    if args.fresh_process:
        text = tokenizer.decode(prompts[-1])
        with tempfile.TemporaryDirectory() as cache_dir:
            fresh["cold"] = fresh_process(args, text, cache_dir)
            fresh["warm"] = fresh_process(args, text, cache_dir)
        print(f"longspec generate, fresh process, {lengths[-1]}-token prompt: cold caches "
              f"{fresh['cold']['wall_s']:.1f} s, warm {fresh['warm']['wall_s']:.1f} s ({fresh['warm']})")
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    result = {"device": device_name, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "load_s": load_s, "summary": summary, "fresh_process": fresh, "calls": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
