"""Long contexts end to end on one GPU: per context, the prompt's prefill (each ``--prefill``
mode, through the engine as a request sees it, against transformers' sdpa prefill of the same
weights in the same process where it fits, and against the FLOPs floor), then one target decode
step (captured, the autoregressive cost per token) and ``--new-tokens`` of speculative generation
with a random LongSpec draft (its rounds' times), the target's KV bytes, the draft's state bytes
(constant: the same at every context) and the peak memory. Targets have random weights, built in
their dtype on the device (a step's time does not depend on the values). Prints a table and one
JSON line last; ``--out`` copies everything printed to a file.

    python benchmarks/bench_long.py --shape llama-8b --contexts 32768,131072 --hf-max 131072 \\
        --prefill captured:2048,sdpa:8192,layers:16384 --out benchmarks/results/long_8b_h200.log
    python benchmarks/bench_long.py --shape llama-1b --contexts 8192,262144,1048576 --hf-max 0
    python benchmarks/bench_long.py --shape tiny --device cpu --contexts 256,700 --new-tokens 8 \\
        --prefill captured:64,sdpa:128,layers:128          # a CPU smoke test of this script

The prefill modes (:class:`~longspec.engine.prefill.ChunkedPrefill`): ``captured:N``
(captured N-token chunk steps, Triton causal split-KV attention; a prompt of
``ChunkedPrefill.by_layer_from`` tokens or more layer by layer, as ``layers``; the default), ``chunks:N``
(captured chunk steps only, whatever the length), ``sdpa:N`` (eager
N-token chunks, PyTorch's fused attention, lower-right causal), ``layers:N`` (layer by layer, one
causal attention call per layer over the whole prompt, projections and MLP N tokens at a time).
The floor is ``(matmul FLOPs + causal attention FLOPs) / --peak-tflops``, both parts printed.
``--hf-decode``: transformers' ``generate`` with its static cache (compiled, as ``generate``
compiles a static cache), ms per generated token, beside our decode step, where its prefill is
timed.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from bench_steps import SHAPES, cuda_defaults, random_target
from longspec.attention import fast
from longspec.engine.engine import Engine, Sequence
from longspec.engine.prefill import MODES, ChunkedPrefill
from longspec.spec.proposers import LongSpecProposer
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft

BENCH_MODES = MODES + ("chunks",)  # chunks: captured chunk steps whatever the length
DEFAULT_CONTEXTS = {"llama-8b": "32768,131072,524288", "llama-1b": "8192,262144,1048576", "tiny": "256,700"}
LOG: list = []


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class Heartbeat:
    """Prints a line every ``every`` seconds while a long call runs (elapsed time, memory)."""

    def __init__(self, label: str, cuda: bool, every: float = 5.0):
        self.label, self.cuda, self.every = label, cuda, every
        self.stop = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()

        def beat():
            while not self.stop.wait(self.every):
                mem = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated" if self.cuda else ""
                print(f"   ... {self.label}: {time.perf_counter() - self.t0:.0f} s{mem}", flush=True)

        self.thread = threading.Thread(target=beat, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def flops(config, n: int) -> tuple:
    """(matmul FLOPs, causal attention FLOPs) of a prefill of ``n`` tokens (logits of the last
    one only): projections and MLP 2 FLOPs per weight per token; attention 4 * head_dim FLOPs per
    (query head, causal query-key pair) per layer (QK^T and PV)."""
    c = config
    h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    per_token = 2 * c.num_layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * c.intermediate_size)
    matmul = n * per_token + 2 * h * c.vocab_size
    attention = 4 * c.num_layers * hq * d * n * (n + 1) // 2
    return matmul, attention


def hf_model(target, shape: str):
    """transformers' model of ``shape`` (sdpa) holding the target's own weights (shared, not copied)."""
    import transformers

    hf_config = dict(SHAPES[shape])
    cfg = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=target.dtype, attn_implementation="sdpa")
    hf.load_state_dict(target.state_dict(), strict=False, assign=True)
    if target.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    with torch.device(target.device):  # (its inverse frequencies, left on the meta device)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    return hf.eval()


def hf_prefill_s(hf, ids: torch.Tensor, cuda: bool) -> tuple:
    """(seconds, greedy next token) of transformers' prefill (its cache filled, logits of the last
    position) of ``ids`` [1, T]; one warm-up call on a short prompt first."""
    with torch.inference_mode():
        hf(ids[:, :min(2048, ids.shape[1])], logits_to_keep=1)
        sync(cuda)
        with Heartbeat(f"transformers prefill {ids.shape[1]}", cuda):
            t0 = time.perf_counter()
            logits = hf(ids, logits_to_keep=1).logits
            sync(cuda)
            seconds = time.perf_counter() - t0
    return seconds, int(logits[0, -1].argmax())


def hf_decode_ms(hf, ids: torch.Tensor, cuda: bool, short: int = 8, long: int = 40) -> float:
    """Wall ms per token of transformers' greedy ``generate`` with a static cache (which it
    compiles, CUDA graphs included, as it does for ``cache_implementation="static"``) after the
    prompt ``ids`` [1, T]: ``(t(long) - t(short)) / (long - short)`` over two calls sharing one
    cache of fixed size (no recompilation between them; each call's prefill cancels out); a first
    call compiles, off the clock."""
    import transformers

    n = ids.shape[1]
    cache = transformers.StaticCache(config=hf.config, max_cache_len=n + long + 8)
    mask = torch.ones_like(ids)

    def run(tokens: int) -> float:
        cache.reset()
        sync(cuda)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)
        sync(cuda)
        assert out.shape[1] == n + tokens
        return time.perf_counter() - t0

    with Heartbeat(f"transformers static-cache generate at {n} (compiling)", cuda):
        run(short)
    seconds = {k: run(k) for k in (short, long)}
    return 1e3 * (seconds[long] - seconds[short]) / (long - short)


def decode_step_ms(target, engine, cuda: bool) -> float:
    """One target decode step over row 0 of the engine's cache (its context in place), captured
    and replayed on CUDA: the autoregressive cost of a token. Nothing is committed."""
    from longspec.engine.runner import time_graph

    cache = engine.cache.rows(0, 1)
    token = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    mask = torch.ones(1, 1, 1, dtype=torch.bool, device=target.device)

    def step():
        target.verify(token, cache.lengths[:, None].clone(), mask, cache, n_keys=engine.step_keys)
        cache.discard()

    if cuda:
        return 1e3 * time_graph(step, replays=20)
    t0 = time.perf_counter()
    step()
    return 1e3 * (time.perf_counter() - t0)


def say_profile(profiler, what: str, cuda: bool, rows: int = 12) -> None:
    """The host operations of a profiled call by their own time, then its device kernels."""
    averages = profiler.key_averages()
    say(f"{what}: host operations by their own time")
    say(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    if cuda:
        say(f"{what}: device kernels")
        say(averages.table(sort_by="self_device_time_total", row_limit=rows))


def run_context(target, draft, args, n: int, cuda: bool) -> dict:
    c = target.config
    tree = TreeSpec.parse(args.tree)
    modes = [(m.partition(":")[0], int(m.partition(":")[2] or 2048)) for m in args.prefill.split(",")]
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    max_len = n + args.new_tokens + tree.num_nodes + 1 + max(chunk for _, chunk in modes)  # (a last chunk's padding)
    engine = Engine(target, LongSpecProposer(draft), tree, max_batch=1, max_len=max_len, pool_tokens=max_len,
                    cuda_graphs=cuda)
    t0 = time.perf_counter()
    engine.warm_up()
    say(f"[{n}] engine: {engine.pool.nbytes / 2**30:.2f} GiB KV pool, rounds prepared in {time.perf_counter() - t0:.1f} s")
    prompt = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    out = dict(context=n, prefill={}, first_tokens={})
    seq = None
    for i, (mode, chunk) in enumerate(modes):
        chunked = ChunkedPrefill(target, engine.cache, [min(chunk, engine.max_len)], engine.step_keys, engine.cuda_graphs,
                                 mode="captured" if mode == "chunks" else mode)
        chunked.max_chunks = 1 << 30  # every prompt through this mode, however long
        if mode == "chunks":  # captured chunk steps only, whatever the prompt's length
            chunked.by_layer_from = 1 << 62
        chunked.prepare_by_layer()  # (as the engine's warm-up does)
        assert chunked.takes([n], [0]), f"{mode}:{chunk} does not take {n} tokens into {engine.max_len} slots"
        engine.chunked_prefill = chunked
        # capture / first-call costs off the clock, on a prompt of another length: a request's
        # new length pays what it pays in use (e.g. cuDNN's plan for a new shape)
        warm = Sequence(prompt[:max(1, min(n - 1, 2 * chunk))], 1)
        engine.add([warm])
        engine.cancel(warm) if not warm.done else None
        seq = Sequence(list(prompt), args.new_tokens)
        sync(cuda)
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else [])) if args.profile else contextlib.nullcontext()
        with Heartbeat(f"prefill {n} {mode}:{chunk}", cuda), profiler:
            t0 = time.perf_counter()
            engine.add([seq])
            sync(cuda)
            seconds = time.perf_counter() - t0
        if args.profile:
            say_profile(profiler, f"[{n}] prefill {mode}:{chunk} (under the profiler)", cuda)
        out["prefill"][f"{mode}:{chunk}"] = seconds
        out["first_tokens"][f"{mode}:{chunk}"] = seq.tokens[0]
        say(f"[{n}] prefill {mode}:{chunk}: {seconds:.3f} s (first token {seq.tokens[0]})")
        if i < len(modes) - 1:
            engine.cancel(seq)
    out["decode_ms"] = decode_step_ms(target, engine, cuda)
    say(f"[{n}] target decode step: {out['decode_ms']:.2f} ms")
    rounds = []
    with Heartbeat(f"speculative generation at {n}", cuda, every=10.0):
        while not seq.done:
            t0 = time.perf_counter()
            engine.step()  # (one host read per round: the time is the round's)
            rounds.append(time.perf_counter() - t0)
    out["rounds"] = len(rounds)
    out["tokens"] = len(seq.tokens)
    out["round_ms"] = 1e3 * statistics.median(rounds)
    out["spec_ms_per_token"] = 1e3 * sum(rounds) / max(1, len(seq.tokens) - 1)
    out["target_kv_bytes"] = 2 * c.num_layers * c.num_kv_heads * c.head_dim * n * target.dtype.itemsize
    out["pool_bytes"] = engine.pool.nbytes
    out["draft_state_bytes"] = sum(t.nbytes for t in engine.proposer.state_tensors())
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    say(f"[{n}] speculative: {len(seq.tokens)} tokens in {len(rounds)} rounds, round {out['round_ms']:.2f} ms "
        f"(median), {out['spec_ms_per_token']:.2f} ms/token; target KV {out['target_kv_bytes'] / 2**30:.2f} GiB, "
        f"draft state {out['draft_state_bytes']} bytes, peak {out['peak_gib']:.1f} GiB")
    engine.close()
    del engine, seq, chunked  # (the prefill holds the cache too)
    if 0 < n <= args.hf_max:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        ids = torch.tensor([prompt], device=target.device)
        hf = hf_model(target, args.shape)
        out["hf_prefill"], out["first_tokens"]["transformers"] = hf_prefill_s(hf, ids, cuda)
        say(f"[{n}] transformers sdpa prefill: {out['hf_prefill']:.3f} s (first token "
            f"{out['first_tokens']['transformers']})")
        if args.hf_decode:
            gc.collect()
            out["hf_decode_ms"] = hf_decode_ms(hf, ids, cuda)
            say(f"[{n}] transformers generate, static cache{', compiled' if cuda else ''}: {out['hf_decode_ms']:.2f} ms/token "
                f"(our decode step {out['decode_ms']:.2f} ms: {out['hf_decode_ms'] / out['decode_ms']:.2f}x)")
        del hf
    matmul, attention = flops(c, n)
    out.update(matmul_flops=matmul, attention_flops=attention,
               floor_s=(matmul + attention) / (args.peak_tflops * 1e12))
    say(f"[{n}] floor at {args.peak_tflops:.0f} TFLOP/s: matmuls {matmul / 1e15:.3f} PFLOP "
        f"({matmul / args.peak_tflops / 1e12:.3f} s) + causal attention {attention / 1e15:.3f} PFLOP "
        f"({attention / args.peak_tflops / 1e12:.3f} s) = {out['floor_s']:.3f} s")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--contexts", help="prompt lengths (default per shape: " +
                   "; ".join(f"{k} {v}" for k, v in DEFAULT_CONTEXTS.items()) + ")")
    p.add_argument("--prefill", default="captured:2048",
                   help=f"prefill modes to time, MODE:CHUNK comma-separated (modes {', '.join(BENCH_MODES)}); the last "
                        "one's request is decoded")
    p.add_argument("--hf-max", type=int, default=131072,
                   help="time transformers' prefill at contexts up to this many tokens (0: never)")
    p.add_argument("--hf-decode", action="store_true",
                   help="also time transformers' generate with its compiled static cache (ms/token) where its prefill is timed")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens of speculative generation per context")
    p.add_argument("--tree", default="4,16,16,16,16", help="the draft's beam tree")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="the dense bf16 matmul rate of the floor")
    p.add_argument("--sdpa-backends", default="",
                   help="SDPA backends of the prompt's causal attention, in order of preference, e.g. "
                        "cudnn,flash,efficient,math (default: flash, efficient, math)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (use --shape tiny)")
    p.add_argument("--profile", action="store_true",
                   help="each timed prefill under the torch profiler (its time then includes the profiler's): its "
                        "costliest host operations and device kernels")
    p.add_argument("--out", help="also write everything printed to this file")
    args = p.parse_args(argv)
    for mode in args.prefill.split(","):
        if mode.partition(":")[0] not in BENCH_MODES:
            raise SystemExit(f"--prefill takes MODE:CHUNK with MODE one of {BENCH_MODES}, got {mode!r}")
    if args.sdpa_backends:
        from torch.nn.attention import SDPBackend

        names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
        fast.CAUSAL_BACKENDS = [getattr(SDPBackend, names[b.strip()]) for b in args.sdpa_backends.split(",")]
    cuda = args.device == "cuda"
    contexts = [int(x) for x in (args.contexts or DEFAULT_CONTEXTS.get(args.shape, "2048")).split(",")]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    target = cuda_defaults(random_target(args.shape, getattr(torch, args.dtype), args.device))  # as load_target
    draft = init_draft(DraftConfig.for_target(target), target)
    draft.fuse_projections()
    say(f"{args.shape} ({args.dtype}, {torch.cuda.get_device_name() if cuda else 'cpu'}): target and random draft "
        f"built in {time.perf_counter() - t0:.1f} s; prefill modes {args.prefill}; SDPA backends "
        f"{[b.name for b in fast.CAUSAL_BACKENDS]}")
    results = []
    for n in contexts:
        results.append(run_context(target, draft, args, n, cuda))
    say(f"\n{'context':>8} {'prefill':<16} {'s':>8} {'x hf':>6} {'x floor':>7} {'decode ms':>9} {'hf dec ms':>9} {'round ms':>8} "
        f"{'spec ms/tok':>11} {'KV GiB':>7} {'draft B':>9} {'peak GiB':>8}")
    for r in results:
        for setting, s in list(r["prefill"].items()) + ([("transformers", r["hf_prefill"])] if "hf_prefill" in r else []):
            vs_hf = r["hf_prefill"] / s if "hf_prefill" in r else float("nan")
            say(f"{r['context']:>8} {setting:<16} {s:8.3f} {vs_hf:6.2f} {r['floor_s'] / s:7.2f} {r['decode_ms']:9.2f} "
                f"{r.get('hf_decode_ms', float('nan')):9.2f} "
                f"{r['round_ms']:8.2f} {r['spec_ms_per_token']:11.2f} {r['target_kv_bytes'] / 2**30:7.2f} "
                f"{r['draft_state_bytes']:>9} {r['peak_gib']:8.1f}")
    sizes = {r["draft_state_bytes"] for r in results}
    say(f"draft state bytes the same at every context ({', '.join(str(r['context']) for r in results)}): "
        f"{'yes' if len(sizes) == 1 else 'NO'} ({sorted(sizes)})")
    say("(x hf: transformers' prefill time / this one; x floor: floor / this one = share of the peak; hf dec ms: "
        "transformers' generate, static cache, compiled, ms per token)")
    say(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": args.shape,
                    "dtype": args.dtype, "peak_tflops": args.peak_tflops, "prefill_modes": args.prefill,
                    "tree": args.tree, "results": results}))
    if args.out:
        Path(args.out).write_text("# python benchmarks/bench_long.py " + " ".join(sys.argv[1:] if argv is None else argv)
                                  + "\n" + "\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
