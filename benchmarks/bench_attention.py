"""Tree attention alone (DESIGN.md 2.4): M tree queries over a cached prefix of S keys plus the M
tree keys, at an 8B-Llama shape (H=32, Hkv=8, D=128, bf16). Implementations: ours (the Triton
split-KV + masked-tree kernel, as the engine runs it: TMA loads for 128-row tiles on Hopper; with
and without TMA everywhere), PyTorch's flash SDPA
(``_scaled_dot_product_flash_attention``, which cannot apply the tree mask: a speed reference only), SDPA with a dense mask, and the
matmul path (two batched products + float32 softmax). Each is checked against the float64
reference (except flash, which computes another function) and timed as the engine runs it: CUDA
graph replays of 10 calls, CUDA events, median of ``--repeats``; with its ratio to the floor
max(bytes / copy bandwidth, FLOPs / matmul rate), both measured here.
Prints a table and one JSON line last.

    python benchmarks/bench_attention.py --contexts 8192,32768,131072 --trees 16,64,69,128

``--causal``: prefill chunks of M tokens after S cached ones instead of trees (as the captured
prefill's chunk steps run them), e.g. ``--contexts 0,2048,6144 --trees 2048 --heads 9 --kv-heads 3
--head-dim 64 --causal`` for the default model's chunks.

``--window W``: a sliding-window layer's attention (each query sees no key more than W - 1
positions before it; the launch splits only one window's span of the cache and skips the key
blocks below a tile's window; the floor counts the window's keys), e.g. Gemma 3
270M's local layers: ``--heads 4 --kv-heads 1 --head-dim 256 --window 512 --contexts
1024,8192,32768``; its time should not grow with the context. Checked against the float64
reference with the window in a dense mask.

"triton (paged)", "triton (two runs)" and "triton (shuffled)" read the rows as the engine does,
from a pool through a block table of 64-slot blocks (a ``Generator``'s, with its prefix cache):
consecutive ones (a prompt's blocks, allocated in order), two runs of them (a cached prefix's
blocks, then ones allocated elsewhere: one split's chunk holds the break) and shuffled ones.

``--capacity N``: the cache holds N slots and the row only its S cached keys + M (a long-lived
engine's cache, sized for its longest request, serving a shorter one); the Triton rows only, the
floor counting the row's keys, e.g. ``--contexts 8192,32768,65536 --trees 1,32,64 --capacity
131136`` (the split-KV plan is made for the capacity; the kernel spreads a row over the splits by
its own length).

``--merge 8,16,22`` times the merge of that many split-KV parts alone, in each of its forms
(``merge_plan``), e.g. ``--trees 1,16,32,64 --merge 8,16`` at the 8B shape.

``--sweep`` times our kernel over a grid of launch parameters (:class:`KernelConfig`: key
block, warps, pipeline stages, split-KV programs per multiprocessor, TMA loads, 64-row tiles)
per shape instead, and prints the fastest few and the default's rank (each checked against the
reference).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics

import torch
import torch.nn.functional as F

from longspec.attention import matmul_attention, reference
from longspec.attention import triton_kernels
from longspec.attention.fast import causal_attention
from longspec.attention.launch_plan import next_power_of_2
from longspec.attention.paged import rows_of
from longspec.attention.triton_kernels import KernelConfig, tree_attention
from longspec.kv.prefix_cache import PREFIX_BLOCK_SIZE

PAGE_BLOCK = 256  # the server's KV block size (tokens)


def timed(fn, repeats: int, inner: int = 10) -> float:
    """Median seconds of one call of ``fn`` on the device, as the engine runs it: ``inner`` calls
    captured in one CUDA graph (``runner.time_graph``). Timing eager calls would measure the
    host: our wrapper's checks and two Triton launches take longer on the CPU than a
    decode-sized kernel on the GPU (the first sweep, timed eagerly, saw a constant ~80-120 us on
    every shape). Falls back to eager calls where a capture fails."""
    from longspec.engine.runner import time_graph

    for _ in range(3):
        fn()
    try:
        return time_graph(fn, repeats, torch.device("cuda"), inner=inner)
    except RuntimeError as err:
        print(f"  (not capturable, timed eagerly: {str(err).splitlines()[0]})", flush=True)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def paged_store(x: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [1, Hkv, S, D] laid out as a pool [Hkv, P, D] whose block ``table[0, j]`` holds the row's
    ``j``-th block (S padded to whole blocks)."""
    blocks = -(-x.shape[2] // block_size)
    rows = F.pad(x[0], (0, 0, 0, blocks * block_size - x.shape[2])).unflatten(1, (blocks, block_size))
    store = torch.empty_like(rows)
    store[:, table[0]] = rows
    return store.flatten(1, 2)


def machine_rates() -> tuple:
    """(copy bandwidth, bytes/s, as bench_steps measures it: eager copies, which run as a kernel;
    captured in a graph a copy becomes a copy-engine memcpy node, 2.77 TB/s on the H200 against
    4.23 eagerly), bf16 FLOP/s of an 8192^3 product."""
    from bench_steps import copy_bandwidth

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return copy_bandwidth(), 2 * 8192**3 / timed(lambda: a @ a, 10, inner=1)


def floor_s(h: int, hkv: int, m: int, cap: int, d: int, bandwidth: float, rate: float, causal: bool = False) -> float:
    """max(bytes / bandwidth, FLOPs / matmul rate) of tree attention: K/V read once, QK and PV
    (``causal``: query i of the M sees the cap - M cached keys and i + 1 of its own)."""
    pairs = m * (cap - m) + m * (m + 1) // 2 if causal else m * cap
    return max((2 * hkv * cap * d * 2 + 2 * h * m * d * 2) / bandwidth, 4 * h * pairs * d / rate)


def sweep(q, k, v, lengths, tree, ref, s, m, repeats, bandwidth, rate, causal: bool = False,
          wide: bool = False) -> list:
    """Times every launch configuration of the grid on one shape; prints the fastest five. ``wide``:
    also smaller key blocks with deeper pipelines, two programs per multiprocessor for full tiles,
    and for a few rows (decode) five pipeline stages, key blocks of 256 and four programs per
    multiprocessor."""
    import itertools

    h, hkv, cap, d = q.shape[1], k.shape[1], k.shape[2], q.shape[3]
    floor = floor_s(h, hkv, m, cap, d, bandwidth, rate, causal)
    results = []
    rows = h // hkv * m
    big = rows >= 128  # full 128-row tiles: 8 warps, one program per SM (the first sweep's best there);
    blocks = ((32, 4), (64, 2), (64, 3), (128, 2), (128, 3)) if wide else ((64, 3), (128, 2))
    if wide and not big:  # a few rows over a long cache (decode): longer key blocks, more programs in flight
        blocks += ((64, 5), (256, 2))
    programs_per_sm = (1, 2, 4) if wide and not big else (1, 2) if wide or not big else (1,)
    grid = itertools.product(blocks, (8,) if big else (4, 8), programs_per_sm, (False, True),
                             (0, 64) if rows > 64 else (0,))
    for config in [KernelConfig()] + [KernelConfig(block_n=bn, num_warps=warps if not bq or bq > 64 else 4,
                                                   num_stages=stages, per_sm=per_sm, tma=tma, block_q=bq)
                                      for (bn, stages), warps, per_sm, tma, bq in grid]:
        try:
            out = tree_attention(q, k, v, lengths, tree, config, causal=causal)
            err = float((out.double() - ref).norm() / ref.norm())
            t = timed(lambda: tree_attention(q, k, v, lengths, tree, config, causal=causal), repeats)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects (shared memory, registers)
            print(f"S={s} M={m} {config}: {type(e).__name__}", flush=True)
            continue
        results.append(dict(context=s, m=m, impl="triton-sweep", config=dataclasses.asdict(config), us=t * 1e6, floor_us=floor * 1e6, x_floor=t / floor, rel_err=err))
    default = KernelConfig()
    results.sort(key=lambda r: r["us"])
    rank = [i for i, r in enumerate(results) if r["config"] == dataclasses.asdict(default)]
    if rank:
        r = results[rank[0]]
        print(f"S={s:>6} M={m:>3} default {r['us']:9.1f} us  x{r['x_floor']:5.2f} floor  (rank {rank[0] + 1} of "
              f"{len(results)}; the best {results[0]['us']:.1f} us)", flush=True)
    for r in results[:5]:
        print(f"S={s:>6} M={m:>3} {r['us']:9.1f} us  x{r['x_floor']:5.2f} floor  err {r['rel_err']:.1e}  {r['config']}",
              flush=True)
    return results[:5]


def merge_forms(hkv: int, g: int, m: int, d: int, n_parts: int, repeats: int) -> dict:
    """The merge kernel alone over ``n_parts`` random partial outputs of one row's M queries (G
    query heads a KV head): microseconds a call of each form (``merge_plan``): ``looped`` one part
    at a time in 16-row programs, ``P x 16 rows`` P parts a load in 16-row programs, ``at once``
    every part in one load, ``plan`` the one launches use; the outputs of all forms equal."""
    rows = g * m
    op = torch.randn(1, hkv, n_parts, rows, d, device="cuda")
    lp = torch.randn(1, hkv, n_parts, rows, device="cuda") * 3
    out = torch.empty(1, m, hkv * g, d, dtype=torch.bfloat16, device="cuda")
    args = (op, lp, out, *op.stride()[:4], *lp.stride()[:3], *out.stride()[:3], hkv, m, g, n_parts)
    forms = {"looped": (1, 16), **{f"{p} x 16 rows": (p, 16) for p in (2, 4, 8) if p < n_parts},
             "at once": triton_kernels.merge_plan(n_parts, rows, d, KernelConfig().merge_elements),
             "plan": triton_kernels.merge_plan(n_parts, rows, d, KernelConfig().merge_elements, hkv,
                                               triton_kernels._multiprocessors(out.device))}
    times, first = {}, None
    for name, (parts, block_r) in forms.items():
        def call():
            triton_kernels._merge_kernel[(hkv, -(-rows // block_r))](*args, PARTS_P2=next_power_of_2(n_parts),
                                                                     PARTS=parts, BLOCK_R=block_r, HEAD_D=d)
        call()
        first = out.clone() if first is None else first
        assert torch.allclose(out.float(), first.float(), atol=2e-2), f"the {name} merge differs"
        times[name] = timed(call, repeats) * 1e6
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="8192,32768,131072")
    p.add_argument("--trees", default="1,16,64,69,128")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="tune our kernel's launch parameters per shape")
    p.add_argument("--wide", action="store_true", help="--sweep over a wider grid (more key block sizes and "
                   "programs per multiprocessor)")
    p.add_argument("--window", type=int, default=None, help="a sliding-window layer's window (default: none)")
    p.add_argument("--causal", action="store_true",
                   help="prefill chunks instead of trees: the M new tokens causal (the kernel told so)")
    p.add_argument("--capacity", type=int, default=0,
                   help="cache slots (default: S + M, the row fills the cache); the Triton rows only")
    p.add_argument("--methods", default=None,
                   help="comma-separated names of the rows to time, e.g. 'triton' or 'triton,flash (causal)' "
                        "(default: all)")
    p.add_argument("--merge", default=None, help="comma-separated part counts: time the merge kernel alone "
                   "(its forms) over that many split-KV parts of each --trees M, instead of attention")
    args = p.parse_args(argv)
    if args.merge:
        for n_parts in map(int, args.merge.split(",")):
            for m in map(int, args.trees.split(",")):
                t = merge_forms(args.kv_heads, args.heads // args.kv_heads, m, args.head_dim, n_parts, args.repeats)
                print(f"parts {n_parts:>3} M={m:>3} " + "  ".join(f"{k} {v:6.2f} us" for k, v in t.items()),
                      flush=True)
        return
    if args.capacity and (args.sweep or args.window):
        p.error("--capacity times the default launch without a window: run it without --sweep and --window")
    if args.sweep and args.window:
        p.error("--sweep times the kernel without a window: run it without --window")
    torch.manual_seed(0)
    bandwidth, rate = machine_rates()
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    rows = []
    for s in map(int, args.contexts.split(",")):
        for m in map(int, args.trees.split(",")):
            cap = max(s + m, args.capacity)
            q = torch.randn(1, h, m, d, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(1, hkv, cap, d, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(1, hkv, cap, d, dtype=torch.bfloat16, device="cuda")
            lengths = torch.tensor([s], device="cuda")
            parents = torch.randint(0, 1, (m,))
            parents[1:] = torch.tensor([torch.randint(0, i, (1,)).item() for i in range(1, m)])
            tree = torch.eye(m, dtype=torch.bool)
            for i in range(1, m):
                tree[i] |= tree[parents[i]]
            if args.causal:  # a prefill chunk of M tokens after S cached ones
                tree = torch.ones(m, m, dtype=torch.bool).tril()
            tree = tree.cuda()[None]
            dense = torch.cat([torch.ones(1, m, s, dtype=torch.bool, device="cuda"), tree], -1)
            starts = None
            if args.window:  # each query at position s + its depth (a chunk's: s + i) sees the last W positions
                depth = tree.sum(-1) - 1  # [1, M]: ancestors in the mask, itself included
                starts = (s + depth - args.window + 1).clamp(min=0)
                # a tree's own keys lie inside the window (depth < W); a chunk's are cut by it too
                cut = cap if args.causal else s
                dense[:, :, :cut] &= torch.arange(cut, device="cuda")[None, None, :] >= starts[..., None]
            if args.window:
                ref = reference.dense_attention(q.double(), k.double(), v.double(), dense)[0]
            else:
                ref = reference.hybrid_attention(q.double(), k[:, :, :s].double(), v[:, :, :s].double(), lengths,
                                                 k[:, :, s:s + m].double(), v[:, :, s:s + m].double(), tree)
            g = h // hkv
            k_rep, v_rep = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # outside the timing
            if args.sweep:
                rows.extend(sweep(q, k, v, lengths, tree, ref, s, m, args.repeats, bandwidth, rate, args.causal,
                                  args.wide))
                continue
            window = args.window or 0  # the launch splits only one window's span of the cache
            impls = {
                # TMA loads for 128-row tiles (Hopper)
                "triton": lambda: tree_attention(q, k, v, lengths, tree, causal=args.causal, starts=starts,
                                                 window=window),
                "triton (no tma)": lambda: tree_attention(q, k, v, lengths, tree, KernelConfig(tma=False),
                                                          causal=args.causal, starts=starts, window=window),
                "triton (tma)": lambda: tree_attention(q, k, v, lengths, tree, KernelConfig(tma=True),
                                                       causal=args.causal, starts=starts, window=window),
                # a tree's whole attention in the warp-specialized Hopper kernel (hopper_tree.py)
                "triton (hopper)": lambda: tree_attention(q, k, v, lengths, tree, KernelConfig(hopper=True),
                                                          causal=args.causal, starts=starts, window=window),
                "sdpa-mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None],
                                                                    enable_gqa=True),
                "matmul": lambda: matmul_attention(q, k, v, dense),
                "flash (no mask)": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k_rep, v_rep)[0],
            }
            if not args.window and (args.methods is None or "triton (" in args.methods):
                # the engine's rows are paged: through a table of consecutive blocks (a prompt's, in
                # order: each split's chunk is read at an offset), of two runs (a cached prefix, then
                # the pool's first blocks: read run by run) and of shuffled ones (a lookup a block)
                n_blocks = -(-cap // PREFIX_BLOCK_SIZE)
                in_order = torch.arange(n_blocks, device="cuda")
                for name, blocks in (("triton (paged)", in_order),
                                     ("triton (two runs)", in_order.roll(-(n_blocks * 3 // 7))),
                                     ("triton (shuffled)", torch.randperm(n_blocks, device="cuda"))):
                    pool_k, pool_v = (paged_store(x, blocks[None], PREFIX_BLOCK_SIZE) for x in (k, v))
                    impls[name] = functools.partial(tree_attention, q, pool_k, pool_v, lengths, tree,
                                                    causal=args.causal, table=blocks[None],
                                                    block_size=PREFIX_BLOCK_SIZE)
            if triton_kernels._descriptors is None:  # Triton < 3.4: the TMA rows would time the plain loads
                impls.pop("triton (tma)")
            if args.window:  # flash cannot slide a window over a tree
                impls.pop("flash (no mask)")
            if args.causal and not args.window:  # the engine's own causal step: lower-right flash over
                # dense rows (K/V as they are), and over paged rows gathered through a shuffled table first
                table = torch.randperm(-(-cap // PAGE_BLOCK), device="cuda")[None]
                store_k, store_v = (paged_store(x, table, PAGE_BLOCK) for x in (k, v))
                impls["flash (causal)"] = lambda: causal_attention(q, k, v)
                impls["gather+flash"] = lambda: causal_attention(
                    q, rows_of(store_k, table, PAGE_BLOCK, None, 0, cap), rows_of(store_v, table, PAGE_BLOCK, None, 0, cap))
            if cap > s + m:  # the other rows would attend over the whole cache
                impls = {name: fn for name, fn in impls.items() if name.startswith("triton")}
            if args.methods:  # only these (the references above cost most of a run's time)
                impls = {name: fn for name, fn in impls.items() if name in args.methods.split(",")}
            # a sliding layer needs only the keys of its window (and the tree's or chunk's own)
            floor = floor_s(h, hkv, m, min(s + m, args.window + m) if args.window else s + m, d, bandwidth, rate,
                            args.causal)
            for name, fn in impls.items():
                try:
                    out = fn()
                    err = float((out.double() - ref).norm() / ref.norm()) if name != "flash (no mask)" else float("nan")
                    t = timed(fn, args.repeats)
                except torch.OutOfMemoryError:
                    err, t = float("nan"), float("nan")
                    torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001 - an option this Triton cannot compile: reported, not fatal
                    print(f"S={s:>6} M={m:>3} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(context=s, m=m, impl=name, us=t * 1e6, floor_us=floor * 1e6, x_floor=t / floor,
                                 rel_err=err))
                print(f"S={s:>6} M={m:>3} {name:<16} {t * 1e6:9.1f} us  floor {floor * 1e6:7.1f} us  "
                      f"x{t / floor:6.2f}  rel err {err:.1e}", flush=True)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s "
          "(flash SDPA repeats K/V per query head and ignores the tree mask: a speed reference only)")
    print(json.dumps({"device": torch.cuda.get_device_name(), "bandwidth_tb_s": bandwidth / 1e12,
                      "matmul_tflops": rate / 1e12, "results": rows}))


if __name__ == "__main__":
    main()
