"""The warp-specialized Hopper tree attention kernel (``attention/hopper_tree.py``) against the Triton kernel
alone, on a tree's attention (M queries over S cached keys + the M tree keys, bf16, one sequence),
and each form of it: ping-pong of the two consumers on or off, the next block's softmax under this
block's p.v on or off, neither of the two, heads of 64 with two consumers instead of three
(``THREE_CONSUMERS``) or with three not taking turns (``PINGPONG_THREE``), the waves of programs
(``WAVES``), the key blocks a program streams at least (``MIN_BLOCKS``), K/V stages (``--forms``,
comma-separated). Every form is checked against the Triton kernel's output (relative error) and
timed as the engine runs it (CUDA-graph replays, median). Prints one line per form, and one JSON
line last.

    python benchmarks/bench_hopper_tree.py --shapes 32x8x128@131072,32x8x64@1048576 --trees 69

A form that deadlocks hangs the process: run it under ``timeout``."""
from __future__ import annotations

import argparse
import json

import torch

from bench_attention import timed
from bench_steps import kernel_profile
from longspec.attention import hopper_tree
from longspec.attention.triton_kernels import KernelConfig, tree_attention

FORMS = {  # name: module constants of hopper_tree
    "default": {},
    "no ping-pong": {"PINGPONG": False},
    "no overlap": {"OVERLAP": False},
    "neither": {"PINGPONG": False, "OVERLAP": False},
    "two consumers": {"THREE_CONSUMERS": False},
    "three free": {"PINGPONG_THREE": False},
    "one wave": {"WAVES": 1},
    "two waves": {"WAVES": 2},
    "2 stages": {"stages": lambda d, n: 2},
    **{f"min blocks {n}": {"MIN_BLOCKS": n} for n in (8, 16, 24, 32)},
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x8x128@32768,32x8x128@131072,32x8x64@1048576",
                   help="query heads x KV heads x head dim @ cached keys, comma-separated")
    p.add_argument("--trees", default="69", help="tree sizes M, comma-separated")
    p.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(FORMS)}")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernels", action="store_true", help="also the kernels of a call by time (torch profiler)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    defaults = {name: getattr(hopper_tree, name) for form in FORMS.values() for name in form}
    rows = []
    for shape in args.shapes.split(","):
        heads, s = shape.split("@")
        h, hkv, d = map(int, heads.split("x"))
        s = int(s)
        for m in map(int, args.trees.split(",")):
            q = torch.randn(1, h, m, d, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(1, hkv, s + m, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            lengths = torch.tensor([s], device="cuda")
            tree = torch.tril(torch.ones(m, m, dtype=torch.bool, device="cuda"))[None]
            off = KernelConfig(hopper=False)
            ref = tree_attention(q, k, v, lengths, tree, off).float()
            base = timed(lambda: tree_attention(q, k, v, lengths, tree, off), args.repeats)
            print(f"{shape} M={m:>3} Triton kernel alone {base * 1e6:9.1f} us", flush=True)
            rows.append(dict(shape=shape, m=m, form="triton", us=base * 1e6))
            on = KernelConfig(hopper=True)
            for form in args.forms.split(","):
                for name, value in {**defaults, **FORMS[form]}.items():
                    setattr(hopper_tree, name, value)
                hopper_tree._failed.clear()  # (a form that failed to build must not turn off the next)
                try:
                    out = tree_attention(q, k, v, lengths, tree, on).float()
                    err = float((out - ref).norm() / ref.norm())
                    t = timed(lambda: tree_attention(q, k, v, lengths, tree, on), args.repeats)
                except Exception as e:  # noqa: BLE001 - a form the device cannot run (shared memory): reported
                    print(f"{shape} M={m:>3} {form:<14} {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if hopper_tree._failed:
                    print(f"{shape} M={m:>3} {form:<14} did not build: {hopper_tree._failed[0]!r:.300}", flush=True)
                    continue
                print(f"{shape} M={m:>3} {form:<14} {t * 1e6:9.1f} us  x{t / base:.3f} the Triton kernel  "
                      f"rel err {err:.1e}", flush=True)
                rows.append(dict(shape=shape, m=m, form=form, us=t * 1e6, rel_err=err))
                if args.kernels:
                    print(kernel_profile(lambda: tree_attention(q, k, v, lengths, tree, on), top=6)[1], flush=True)
            for name, value in defaults.items():
                setattr(hopper_tree, name, value)
    print(json.dumps({"device": torch.cuda.get_device_name(), "results": rows}))


if __name__ == "__main__":
    main()
