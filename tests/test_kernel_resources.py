"""The attention kernels' shared memory on a Hopper GPU (the H100 / H200: 227 KB a block) and on
a consumer GPU (99 KB), read from Triton's own compilation for that target, which runs on any
machine (Triton carries ptxas).
A launch that asks for more fails on the GPU with OutOfResources: an 8B-shaped target's causal
prefill chunks once asked for 256 KB, because the kernel's unused tree-mask argument was an
int64 tensor and its (dead) tree loop reserved pipelined [BLOCK_Q, BLOCK_N] int64 tiles."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longspec.attention import triton_kernels

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not triton_kernels.available(), reason="needs triton")

# (compute capability, bytes of shared memory one block may use: what OutOfResources names as the limit)
GPUS = {"h200": (90, 232448), "rtx4090": (89, 101376)}


class _Recorder:
    """Stands in for a kernel: records the first launch's arguments instead of running it."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _signature(kernel, args: tuple, kwargs: dict) -> tuple:
    """Triton's signature, constants and attributes for these launch arguments, specialised as a
    GPU launch would: ints equal to 1 become constants, multiples of 16 and tensors (16-byte
    aligned on a GPU) are marked divisible by 16."""
    types = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
             torch.int32: "*i32", torch.int8: "*i8"}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name], constants[(i,)] = "constexpr", kwargs[name]
            continue
        a = args[i]
        if isinstance(a, torch.Tensor):
            signature[name], attrs[(i,)] = types[a.dtype], [["tt.divisibility", 16]]
        elif isinstance(a, float):
            signature[name] = "fp32"
        elif a == 1:
            signature[name], constants[(i,)] = "constexpr", 1
        else:
            signature[name] = "i32" if abs(a) < 2**31 else "i64"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def shared_memory_on(gpu: str, launch) -> int:
    """Shared memory (bytes) of the partial kernel as ``launch()`` would launch it on ``gpu`` (its
    tiles planned for that GPU's limit). Needs Triton's compiler, not its interpreter (run in a
    process without TRITON_INTERPRET)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arch, limit = GPUS[gpu]
    saved = {name: getattr(triton_kernels, name) for name in ("_partial_kernel", "_merge_kernel", "_tma_hardware",
                                                               "_shared_memory_budget")}
    calls = []
    triton_kernels._partial_kernel, triton_kernels._merge_kernel = _Recorder(calls), _Recorder([])
    triton_kernels._tma_hardware = lambda device: False
    triton_kernels._shared_memory_budget = lambda device: triton_kernels.shared_memory_budget(limit)
    try:
        launch()
    finally:
        for name, value in saved.items():
            setattr(triton_kernels, name, value)
    kernel = saved["_partial_kernel"]
    args, kwargs = calls[0]
    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps"), "num_stages": kwargs.pop("num_stages", 3)}
    signature, constants, attrs = _signature(kernel, args, kwargs)
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).metadata.shared


def _launch(hq, hkv, m, d, kind):
    """A launch of ``kind`` (a causal chunk, a tree, the draft's per-query limits, a sliding
    window's tree) for M = ``m`` queries over 4096 cached tokens."""
    q = torch.zeros(1, hq, m, d, dtype=torch.bfloat16)
    k = torch.zeros(1, hkv, 4096 + m, d, dtype=torch.bfloat16)
    v, lengths = torch.zeros_like(k), torch.tensor([4096])
    causal = torch.ones(1, m, m, dtype=torch.bool).tril()
    return {
        "causal": lambda: triton_kernels.tree_attention(q, k, v, lengths, causal, causal=True),
        "tree": lambda: triton_kernels.tree_attention(q, k, v, lengths, causal),
        "prefix": lambda: triton_kernels.prefix_attention(q, k, v, lengths[:, None] - torch.arange(m)[None, :]),
        "window": lambda: triton_kernels.tree_attention(q, k, v, lengths, causal, starts=lengths[:, None] - 511
                                                        + torch.arange(m)[None, :], window=512),
    }[kind]


CASES = [
    (32, 8, 2048, 128, "causal"),  # an 8B shape's captured prefill chunk
    (32, 8, 32, 128, "causal"),  # a short chunk after a cached prefix
    (32, 8, 69, 128, "tree"),  # verification of the default beam tree
    (32, 8, 69, 128, "prefix"),  # the draft's cross-attention, a limit per query
    (4, 1, 69, 256, "window"),  # Gemma 3's sliding layers (head_dim 256)
    (9, 3, 2048, 64, "causal"),  # the default model's prefill chunk
]


@pytest.fixture(scope="module")
def shared_memory() -> dict:
    """{case: bytes}, compiled in a process of its own (this one runs Triton interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    return {(gpu, *case): shared for gpu, case, shared in json.loads(run.stdout.splitlines()[-1])}


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_fits_the_shared_memory_of_a_block(shared_memory, gpu, case):
    """On the H200 and on a consumer GPU (99 KB a block), whose launches get smaller tiles."""
    need, limit = shared_memory[(gpu, *case)], GPUS[gpu][1]
    assert need <= limit, f"{case[-1]} launch {case} needs {need} bytes of shared memory on the {gpu} ({limit})"


if __name__ == "__main__":
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        print(f"this Triton cannot compile for a target by hand: {e}")
        sys.exit(3)
    print(json.dumps([[gpu, case, shared_memory_on(gpu, _launch(*case))] for gpu in GPUS for case in CASES]))
