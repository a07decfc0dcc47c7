"""What a server's arriving request costs: a prompt's prefill, eager (one forward) against
:class:`~longspec.engine.prefill.ChunkedPrefill` (fixed-shape chunks over the engine's
``--max-len`` slots, each row's chunk step a CUDA graph), on a random-weight target of a known
shape (a prefill's time does not depend on the weights' values). Per setting: the wall time of a
whole prefill (synchronised, host work included), the device time of one chunk step (CUDA events
around a replay) and the kernels that take it (torch profiler, one replay). Prints a table, the
kernel list of each chunk setting and one JSON line last.

    python benchmarks/bench_prefill.py --shape smollm2 --lengths 256,1700 --chunks 256,512,1024 \\
        --impls triton,triton+causal --max-len 4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench_steps import SHAPES, random_target
from longspec.engine.prefill import ChunkedPrefill


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):  # the first two: compilation and capture
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def replay_ms(runner, cache, repeats: int) -> float:
    """Median device time of one chunk step (the runner's graph replayed) into an empty row."""
    times = []
    for _ in range(repeats):
        cache.lengths.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.run_round()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def top_kernels(runner, cache, n: int = 8) -> list:
    """(kernel name, device us) of one replay into an empty row, the costliest first."""
    from torch.profiler import ProfilerActivity, profile

    cache.lengths.zero_()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run_round()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:n]


def hf_prefill_ms(shape: str, lengths: list, dtype, device: str, repeats: int) -> list:
    """(tokens, ms) of transformers' prefill of a random-weight model of ``shape`` (sdpa, logits of
    the last position only, as ``generate`` asks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = dict(SHAPES[shape])
    config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    out = []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, config.vocab_size, (1, n), device=device)
            out.append((n, wall_ms(lambda: model(ids, logits_to_keep=1), repeats)))
    del model
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--lengths", default="256,1700")
    p.add_argument("--chunks", default="256,512,1024",
                   help="chunk settings, comma separated: N (chunks of N tokens) or a ladder N/M/... (a prompt's "
                        "rest in the smaller chunks, as ChunkedPrefill's default ladder does)")
    p.add_argument("--impls", default="triton,triton+causal",
                   help="attention of the chunk steps (the server's: triton); +causal: the chunk's mask passed "
                        "as causal (ChunkedPrefill causal_kernel: the Triton kernel computes it, skips blocks); "
                        "the eager ChunkedPrefill modes by name: sdpa-chunks (TargetModel.prefill in chunks), layers "
                        "(prefill_by_layer, the chunk the pieces of its projections and MLP)")
    p.add_argument("--max-len", type=int, default=4096, help="cache slots a chunk step attends over")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cpu: wall times only (a smoke test of this script)")
    p.add_argument("--hf", action="store_true",
                   help="also time transformers' prefill (the same shape, sdpa, logits of the last position)")
    args = p.parse_args(argv)
    target = random_target(args.shape, getattr(torch, args.dtype), args.device)
    cuda = args.device == "cuda"
    target.compile_steps = True  # as load_target sets it on CUDA
    lengths = [int(n) for n in args.lengths.split(",")]
    results, kernels = [], {}
    print(f"{'setting':>20} {'tokens':>6} {'prefill ms':>11} {'chunk step ms (device)':>23}")
    cache = target.new_cache(1, args.max_len)
    for n in lengths:
        ids = torch.randint(0, target.config.vocab_size, (1, n), device=args.device)
        lens = torch.tensor([n], device=args.device)
        ms = wall_ms(lambda: (cache.lengths.zero_(), target.prefill(ids, lens, cache)), args.repeats)
        results.append(dict(setting="eager", tokens=n, prefill_ms=ms))
        print(f"{'eager':>20} {n:>6} {ms:11.2f}", flush=True)
    if args.hf:
        for n, ms in hf_prefill_ms(args.shape, lengths, getattr(torch, args.dtype), args.device, args.repeats):
            results.append(dict(setting="transformers", tokens=n, prefill_ms=ms))
            print(f"{'transformers sdpa':>20} {n:>6} {ms:11.2f}", flush=True)
    eager_modes = {"sdpa-chunks": "sdpa", "layers": "layers"}
    for choice in [c for c in args.impls.split(",") if c]:
        impl, _, flag = choice.partition("+")
        mode = eager_modes.get(choice, "captured")
        target.attention_impl = impl if mode == "captured" else "triton" if cuda else "sdpa"
        for chunk in args.chunks.split(","):
            chunked = ChunkedPrefill(target, cache, [int(s) for s in chunk.split("/")], args.max_len, cuda_graphs=cuda,
                                     causal_kernel=flag == "causal", mode=mode)
            setting = f"{choice} chunk {chunk}"
            for n in lengths:
                if not chunked.fits(n):
                    raise SystemExit(f"{n} tokens in chunks of {chunk} do not fit --max-len {args.max_len}")
                prompt = torch.randint(0, target.config.vocab_size, (n,)).tolist()
                ms = wall_ms(lambda: (cache.lengths.zero_(), chunked(0, prompt)), args.repeats)
                step = replay_ms(chunked.runner(), chunked.step_row, args.repeats) if cuda and chunked.captured else float("nan")
                results.append(dict(setting=setting, tokens=n, prefill_ms=ms, chunk_step_ms=step))
                print(f"{setting:>20} {n:>6} {ms:11.2f} {step:23.3f}", flush=True)
            if cuda and chunked.captured:
                kernels[setting] = top_kernels(chunked.runner(), chunked.step_row)
    for setting, rows in kernels.items():
        print(f"-- {setting}: one chunk step's kernels (device us)")
        for name, us in rows:
            print(f"   {us:9.1f}  {name}")
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": args.shape, "dtype": args.dtype,
                      "max_len": args.max_len, "results": results, "kernels": kernels}))


if __name__ == "__main__":
    main()
