"""Step benchmark: one target decode step and one verify step over trees of M tokens, and one
full LongSpec draft proposal, each captured in a CUDA graph and timed by replaying it (CUDA
events, median of many replays), at several context lengths, with the bandwidth floor
(weights + KV bytes read once / measured device-to-device copy bandwidth). Prints a table and
one JSON line last.

    python benchmarks/bench_steps.py --target DIR [--draft DIR] --contexts 2048,8192 \
        --trees 16,32,69,128 --attention triton,matmul,sdpa --dtype bfloat16
    python benchmarks/bench_steps.py --shape llama-8b --contexts 8192,32768,131072 --trees 16,69,128 \
        --attention triton,matmul --hf

``--batch B`` times every step over B rows (a serving batch bucket); ``--proposals`` names the
trees whose proposal and full round are timed (``hybrid:TREE`` adds the prompt-lookup chain) as a
greedy call runs them (``--sampled-rounds``: also as a call at T=1 does), e.g.
``--batch 16 --proposals "4,16,16,16,16;hybrid:4,16,16,16,16,1,1,1,1,1;hybrid:2,2,2"``.

``--shape llama-8b`` builds an 8B-Llama-shaped target (32 layers, hidden 4096, 32/8 heads,
intermediate 14336, vocab 128256) with random weights: a step's latency does not depend on the
weights' values. ``--hf`` also times transformers' own decode step (its Llama model with the same
weights, SDPA, a dynamic cache holding the same context) for comparison.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from longspec import load_target
from longspec.engine.engine import Engine, Sequence
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.engine.runner import graph_of, time_graph
from longspec.spec.tree import TreeSpec
from longspec.models.checkpoint import load_draft
from longspec.models.layers import hold_transposed


def kernel_profile(fn, top: int = 12, order: bool = False, graph: bool = False) -> tuple:
    """(kernels launched by one call of ``fn``, a table of the ``top`` kernels by time and a line
    of the GPU's busy time: the union of the kernels' intervals, against their sum (the part run
    beside another kernel, on another stream) and the first-to-last span (the rest: gaps); with
    ``order``, then every kernel in launch order, repeats of one name folded: ``name xN``).
    One eager call, or with ``graph`` one replay of ``fn`` captured in a CUDA graph (as the
    engine runs it)."""
    from torch.profiler import ProfilerActivity, profile

    run = graph_of(fn).replay if graph else fn
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, reach = 0, None
    for start, end in spans:  # the union of the intervals
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    total = sum(end - start for start, end in spans)
    if spans:
        table += (f"\nkernels {total:.1f} us, GPU busy {busy:.1f} us (beside another kernel {total - busy:.1f} us), "
                  f"first to last {max(e for _, e in spans) - spans[0][0]:.1f} us")
    if order:
        runs = []
        for e in sorted(kernels, key=lambda e: e.time_range.start):
            if runs and runs[-1][0] == e.name:
                runs[-1][1] += 1
            else:
                runs.append([e.name, 1])
        table += "\n" + "\n".join(f"  {name[:110]}" + (f" x{n}" if n > 1 else "") for name, n in runs)
    return len(kernels), table


SHAPES = {"smollm2": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                          intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          vocab_size=49152, max_position_embeddings=8192 + 1024, rms_norm_eps=1e-5,
                          rope_theta=100000.0, tie_word_embeddings=True),
          "llama-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                           intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072 + 1024,
                           rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
          "llama-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
                            intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072 + 1024,
                            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
          "llama-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                           intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                           rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
          # a CPU smoke-test shape (tensor parallelism over up to 4 ranks)
          "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=250,
                       max_position_embeddings=262144, rms_norm_eps=1e-5, tie_word_embeddings=False)}


def random_target(shape: str, dtype, device: str = "cuda", tensor_parallel=None, transposed: bool = True):
    """A target of a known shape with random weights (N(0, 0.02)), on ``device``; with
    ``tensor_parallel`` (a :class:`~longspec.parallel.TensorParallel`) this rank's share, on its
    device. On CUDA its weights are held transposed, as ``load_target`` holds them (``transposed``
    False: as stored)."""
    from longspec.config import ModelConfig
    from longspec.models.target import TargetModel
    from longspec.parallel import Shard

    config = ModelConfig.from_hf(SHAPES[shape])
    shard = None if tensor_parallel is None else Shard.of(config, tensor_parallel)
    device = device if tensor_parallel is None else tensor_parallel.device
    with torch.device("meta"):
        model = TargetModel(config, shard).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings and shard is None:  # (to_empty gave the tied head a tensor of its own)
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    model.build_rotary(device)
    model.fuse_projections()
    if transposed and model.device.type == "cuda":
        hold_transposed(model)
    return model.eval().requires_grad_(False)


def cuda_defaults(target):
    """``target`` (from :func:`random_target`) with what ``load_target`` sets up on CUDA
    (``use_device_kernels``: the Triton attention kernels, compiled steps, weights transposed)."""
    from longspec.models.checkpoint import use_device_kernels

    use_device_kernels(target)
    return target


def hf_decode_step(target, ids, replays: int = 10) -> float:
    """Median seconds of one decode step of transformers' Llama (SDPA) with ``ids`` in its cache."""
    import transformers

    c = target.config
    cfg = transformers.LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                   num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                   num_key_value_heads=c.num_kv_heads, vocab_size=c.vocab_size,
                                   max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                                   tie_word_embeddings=False)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(cfg)
    hf = hf.to_empty(device="cuda").to(target.dtype)
    hf.load_state_dict(target.state_dict(), strict=False, assign=True)
    hf.model.rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=cfg, device="cuda")
    hf.eval()
    cache = transformers.DynamicCache(config=cfg)
    with torch.inference_mode():
        for start in range(0, ids.shape[1], 4096):
            hf(ids[:, start:start + 4096], past_key_values=cache, use_cache=True)
        nxt = ids[:, -1:]
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            hf(nxt, past_key_values=cache, use_cache=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000)
            cache.crop(ids.shape[1])
    del hf, cache
    torch.cuda.empty_cache()
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    b.synchronize()
    return 10 * 2 * x.numel() / (a.elapsed_time(b) / 1000)


def print_table(rows: list) -> None:
    """The steps side by side: ms, the bandwidth floor, and each step over the floor and over the
    decode step of its attention and context (``x_decode``, added to each row)."""
    decode = {(r["attention"], r["context"]): r["ms"] for r in rows if r["step"] == "decode"}
    print(f"{'attention':<16} {'context':>7} {'step':<62} {'ms':>8} {'floor ms':>9} {'x floor':>8} {'x decode':>9}")
    for r in rows:
        r["x_decode"] = r["ms"] / decode.get((r["attention"], r["context"]), float("nan"))
        print(f"{r['attention']:<16} {r['context']:>7} {r['step']:<62} {r['ms']:8.3f} {r['floor_ms']:9.3f} "
              f"{r['x_floor']:8.2f} {r['x_decode']:9.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="model directory (or --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight target of this shape")
    p.add_argument("--hf", action="store_true", help="also time transformers' decode step")
    p.add_argument("--draft")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--trees", default="16,32,69,128", help="verify tree sizes (tokens incl. the root)")
    p.add_argument("--attention", default="triton,matmul,sdpa")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", default="off", help="off, on or off,on: layers and round glue via torch.compile")
    p.add_argument("--random-draft", action="store_true", help="a randomly initialised draft (8192-token draft "
                   "vocabulary) when no --draft is given: proposal cost does not depend on the weights")
    p.add_argument("--profile", action="store_true", help="print the kernels of one eager step of each kind")
    p.add_argument("--profile-order", action="store_true", help="with --profile: also every kernel of the "
                   "proposals and rounds in launch order")
    p.add_argument("--profile-graph", action="store_true", help="with --profile: profile a CUDA-graph replay of "
                   "each step instead of an eager call")
    p.add_argument("--kernel", default="", help="Triton attention options for every step, e.g. tma=0,block_q=64 "
                   "(KernelConfig's fields: a boolean one by its name or as name=0/1, an integer one as name=value)")
    p.add_argument("--no-prefill", action="store_true", help="the context's K/V left as allocated, only the "
                   "rows' lengths set (a step's time does not depend on their values; a 1M-token prefill takes "
                   "minutes); no proposals (their engines prefill)")
    p.add_argument("--row-major-weights", action="store_true", help="with --shape: the weights as stored, not "
                   "held transposed as load_target holds them on CUDA")
    p.add_argument("--batch", type=int, default=1, help="rows per step (a serving batch bucket; default 1)")
    p.add_argument("--sampled-rounds", action="store_true", help="also time each proposal's rounds as a sampled "
                   "call runs them (T=1: the target's distributions, sampled acceptance); the default rows are greedy")
    p.add_argument("--proposals", default="4,16,16,16,16",
                   help="';'-separated trees whose proposal and full round are timed with the draft; prefix "
                        "'hybrid:' for the draft + prompt-lookup chain, 'pld:' for prompt lookup alone (default: "
                        "4,16,16,16,16); with --compile on the proposals are compiled too")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.kernel:
        import dataclasses

        from longspec.attention import triton_kernels

        fields = {f.name: f.type for f in dataclasses.fields(triton_kernels.KernelConfig)}
        options = {}
        for item in filter(None, (x.strip() for x in args.kernel.split(","))):
            name, eq, value = item.partition("=")
            if fields.get(name) in (bool, "bool", "Optional[bool]") and value in ("", "0", "1"):
                options[name] = value != "0"
            elif fields.get(name) in (int, "int") and value.isdigit():
                options[name] = int(value)
            else:
                raise SystemExit(f"--kernel takes names of {', '.join(fields)} (integer ones as name=value), "
                                 f"got {item!r}")
        triton_kernels.DEFAULT_CONFIG = dataclasses.replace(triton_kernels.DEFAULT_CONFIG, **options)
        print("Triton attention:", triton_kernels.DEFAULT_CONFIG)
    if bool(args.target) == bool(args.shape):
        raise SystemExit("give --target DIR or --shape NAME")
    target = (load_target(args.target, dtype=args.dtype, device="cuda") if args.target
              else random_target(args.shape, getattr(torch, args.dtype), transposed=not args.row_major_weights))
    if args.draft:
        draft = load_draft(args.draft, target)
    elif args.random_draft:
        from longspec.models.draft import DraftConfig, init_draft
        draft = init_draft(DraftConfig.for_target(target), target)
        draft.limit_vocab(torch.randperm(target.config.vocab_size)[:8192])
        draft.fuse_projections()
        if not args.row_major_weights:
            hold_transposed(draft)  # as load_draft holds a draft on CUDA
    else:
        draft = None
    bw = copy_bandwidth()
    unique = {t.data_ptr(): t for t in target.state_dict().values()}  # tied weights once
    weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    c = target.config
    rows = []
    for impl, compiled in ((i, mode) for mode in args.compile.split(",") for i in args.attention.split(",")):
        target.attention_impl, target.compile_steps = impl, compiled == "on"
        label = impl + ("+compile" if target.compile_steps else "")
        for ctx in map(int, args.contexts.split(",")):
            max_m = max(map(int, args.trees.split(",")))
            b = args.batch
            cache = target.new_cache(b, -(-(ctx + max_m) // 64) * 64)
            ids = torch.randint(0, c.vocab_size, (b, ctx), device="cuda")
            if args.no_prefill:
                cache.lengths.fill_(ctx)
            else:
                target.prefill(ids, torch.full((b,), ctx, device="cuda"), cache)
            kv_bytes = 2 * c.num_layers * c.num_kv_heads * b * cache.max_len * c.head_dim * cache.k.element_size()
            floor = (weight_bytes + kv_bytes) / bw
            for m in [1] + list(map(int, args.trees.split(","))):
                tokens = torch.randint(0, c.vocab_size, (b, m), device="cuda")
                positions = cache.lengths[:, None] + torch.arange(m, device="cuda")
                mask = torch.ones(m, m, dtype=torch.bool, device="cuda").tril()[None]

                def step():
                    target.verify(tokens, positions, mask, cache, n_keys=cache.max_len)
                    cache.discard()

                t = time_graph(step)
                rows.append(dict(attention=label, context=ctx, step="decode" if m == 1 else f"verify M={m}",
                                 ms=t * 1e3, floor_ms=floor * 1e3, x_floor=t / floor))
                print(f"  {label} {ctx} {rows[-1]['step']}: {t * 1e3:.3f} ms", flush=True)
                if args.profile and m in (1, 69):
                    n, table = kernel_profile(step, graph=args.profile_graph)
                    print(f"== {label} ctx {ctx} M={m}: {n} kernels\n{table}")
            cache = None  # the proposals' engines hold caches of their own
            for spec in (args.proposals.split(";") if draft is not None and not args.no_prefill else []):
                hybrid, lookup = spec.startswith("hybrid:"), spec.startswith("pld:")
                tree = TreeSpec.parse(spec.removeprefix("hybrid:").removeprefix("pld:"))
                proposer = PromptLookup() if lookup else LongSpecProposer(draft, PromptLookup() if hybrid else None)
                # full rounds replayed ~45 times advance the cache by up to depth + 1 tokens each
                room = ctx + 64 * (tree.depth + 1) + 256
                engine = Engine(target, proposer, tree, max_batch=b, max_len=room, buckets=[b], cuda_graphs=False,
                                compile_proposals=True)  # as Generator's engines (with --compile on)
                engine.add([Sequence(row.tolist(), 400) for row in ids])
                rows_view = engine.view(b)

                def propose():
                    with torch.inference_mode():
                        engine._propose_phase(rows_view)
                        engine.proposer._end_round()

                def full_round():  # propose, verify, accept, commit (replays advance the cache)
                    with torch.inference_mode():
                        engine._propose_phase(rows_view)
                        engine._verify_phase(rows_view)

                what = f"{'hybrid ' if hybrid else 'pld ' if lookup else ''}{tree}"
                for temperature in [0.0] + ([1.0] if args.sampled_rounds else []):
                    # the kind of round a call at this temperature runs: greedy acceptance, or
                    # sampled (every row at T=1: the target's distributions, sampled children)
                    for i in range(b):
                        engine.config.set_row(i, temperature, 0, 1.0)
                    engine._use_round_kind(temperature == 0, False)
                    if hasattr(rows_view.proposer, "sample_children"):
                        rows_view.proposer.sample_children = temperature > 0 and tree.is_static
                    kind = "" if temperature == 0 else " sampled T=1"
                    for name, fn in ((f"propose {what} ({tree.depth} levels){kind}", propose),
                                     (f"round {what}{kind}", full_round)):
                        t = time_graph(fn, replays=40)
                        rows.append(dict(attention=label, context=ctx, step=name, ms=t * 1e3,
                                         floor_ms=float("nan"), x_floor=float("nan")))
                        print(f"  {label} {ctx} {name}: {t * 1e3:.3f} ms", flush=True)
                        if args.profile:
                            n, table = kernel_profile(fn, order=args.profile_order, graph=args.profile_graph)
                            print(f"== {label} ctx {ctx} {name}: {n} kernels\n{table}")
                engine.close()  # its caches go now, before the next proposal's engine is built
            if args.hf and label == args.attention.split(",")[0] and b == 1:
                t = hf_decode_step(target, ids)
                rows.append(dict(attention="transformers", context=ctx, step="decode", ms=t * 1e3,
                                 floor_ms=floor * 1e3, x_floor=t / floor))
            cache = engine = None  # free the memory before the next context
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, weights {weight_bytes / 2**20:.0f} MiB")
    print(f"batch {args.batch}")
    print_table(rows)
    print(json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "batch": args.batch,
                      "copy_tb_s": bw / 1e12, "weight_mib": weight_bytes / 2**20, "results": rows}))


if __name__ == "__main__":
    main()
