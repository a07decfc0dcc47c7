"""The warp-specialized Hopper tree attention kernel (``attention/hopper_tree.py``). Gluon kernels do
not run in Triton's interpreter, so on a CPU each form of the kernel is compiled for a Hopper
target (sm_90a, Triton's own ptxas): its layouts, barriers and partitions must type-check and
fit a Hopper block's shared memory. Its outputs are tested on a GPU
(``test_tree_attention.py::test_hopper_tree_kernel_on_gpu``)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
from longspec.attention import hopper_tree  # noqa: E402

HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on an H100 / H200


def compile_for_hopper(paged: bool, d: int, block_size: int, consumers=None, pingpong=False):
    """The kernel's launch as ``tree_parts`` makes it (a 69-node tree x 4 query heads of 8 KV
    heads; ``consumers``: forced to 2 or 3; ``pingpong``: three consumers' turns), compiled for
    sm_90a without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    hkv, g, m, s = 8, 4, 69, 4096
    q = torch.empty(1, hkv * g, m, d, dtype=torch.bfloat16)
    k = torch.empty(hkv, s, d, dtype=torch.bfloat16) if paged else torch.empty(1, hkv, s, d, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([hopper_tree.BLOCK_N, d], gl.bfloat16)
    kd = TensorDescriptor.from_tensor(k.view(-1, d), [hopper_tree._piece(block_size), d], layout)
    op, lp = torch.empty(1, hkv, 4, g * m, d), torch.empty(1, hkv, 4, g * m)
    tm = torch.zeros(1, m, m, dtype=torch.int8)
    args = dict(Q=q, KD=kd, VD=kd, LEN=torch.zeros(1, dtype=torch.int64), TBL=torch.zeros(1, 64, dtype=torch.int32),
                TM=tm, OP=op, LP=lp, sq_b=q.stride(0), sq_h=q.stride(1), sq_m=q.stride(2), stbl_b=64, stm_b=0,
                stm_m=tm.stride(1), so_b=op.stride(0), so_h=op.stride(1), so_s=op.stride(2), so_r=op.stride(3),
                sl_b=lp.stride(0), sl_h=lp.stride(1), sl_s=lp.stride(2), HKV=hkv, M=m, G=g, N_TREE=m, N_SPLITS=4,
                CAP=s, BS=block_size or 1, S_ROWS=s, qk_scale=0.1)
    hopper_tree.PINGPONG_THREE = pingpong  # (this process only: the test runs it in one of its own)
    n = hopper_tree.consumers(g * m, d) if consumers is None else consumers
    constants, launch_regs = hopper_tree.launch_constants(d, n)
    constexprs = dict(PAGED=paged, **constants)
    fn = hopper_tree._hopper_kernel
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in fn.arg_names}
    source = GluonASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=launch_regs))


def stack_bytes(cubin: bytes) -> int:
    """A thread's local memory (spilled registers) in the compiled kernel, as Triton's cuobjdump
    reports it."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@pytest.mark.parametrize("paged,d,block_size,consumers", [
    (False, 128, 0, 2), (True, 128, 64, 2), (True, 128, 256, 2), (False, 64, 0, 3), (True, 64, 64, 3),
    (False, 64, 0, 2), (False, 64, 0, -3), (True, 64, 64, -3)])
def test_the_kernel_compiles_for_hopper_within_its_shared_memory_and_registers(paged, d, block_size, consumers):
    """Compiled in a process of its own: the tests run Triton's interpreter on a CPU, under which
    Gluon functions cannot be compiled. Heads of 64 take three consumers for 276 rows (-3: with
    their turns); two is the form for trees whose rows fill no fewer tiles that way. Two consumers
    keep every value in registers (no local memory: spills would slow every key block); three, at
    160 registers a thread, spill in the masked blocks' code (docs/benchmarks.md)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, *map(str, (int(paged), d, block_size, consumers))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["wgmma"] >= 2 * abs(consumers)  # q.k and p.v in every consumer's loop
    assert report["shared"] <= HOPPER_SHARED_MEMORY and report["cubin"] > 0
    if abs(consumers) == 2:
        assert report["stack"] == 0, report


def test_where_the_kernel_applies():
    """Hopper only (never a CPU, where the Triton kernel runs in the interpreter), 16-bit heads of
    64 or 128 dimensions, more than 128 rows a KV head, pools of 64-slot multiples."""
    q = torch.empty(1, 32, 69, 128, dtype=torch.bfloat16)
    assert not hopper_tree.applies(q, q, q, 276, 0)  # a CPU tensor
    assert hopper_tree._piece(0) == hopper_tree._piece(256) == hopper_tree.BLOCK_N
    assert hopper_tree._piece(64) == 64 and hopper_tree._piece(192) == 64


def test_split_plan_gives_every_tile_of_a_head_the_same_chunks():
    """A 69-node tree x 4 heads of 8 KV heads (2 full tiles + 20 rows: 3 tiles) on 132
    multiprocessors: up to WAVES waves of programs, chunks of MIN_BLOCKS key blocks or more."""
    plan = hopper_tree.split_plan
    assert plan(276, 8, 132, 1 << 17, 128) == 132 * hopper_tree.WAVES // 24  # 16 at 3 waves
    assert plan(256, 8, 132, 1 << 17, 128) == min(1024 // hopper_tree.MIN_BLOCKS, 132 * hopper_tree.WAVES // 16)
    assert plan(276, 8, 132, 1 << 15, 128) == 256 // hopper_tree.MIN_BLOCKS  # a shorter cache: longer chunks
    assert plan(276, 8, 132, 256, 128) == 1  # at least one program a tile
    tiles = 2 if hopper_tree.THREE_CONSUMERS else 3  # heads of 64: 2 tiles of 192 rows, or 3 of 128
    assert plan(276, 8, 132, 1 << 20, 64) == 132 * hopper_tree.WAVES // (8 * tiles)


def test_the_kernel_pays_at_heads_of_128_from_three_row_tiles_of_128_on():
    assert hopper_tree.pays(276, 128) and hopper_tree.pays(384, 128)  # 69 and 96 nodes x 4 heads
    assert not hopper_tree.pays(256, 128) and not hopper_tree.pays(192, 128)  # 64 and 48 nodes
    assert hopper_tree.pays(192, 64) and hopper_tree.pays(256, 64)  # heads of 64: always


def test_three_consumers_where_they_save_a_row_tile_at_heads_of_64(monkeypatch):
    monkeypatch.setattr(hopper_tree, "THREE_CONSUMERS", True)
    assert hopper_tree.consumers(276, 64) == 3  # 2 tiles of 192 rows, not 3 of 128
    assert hopper_tree.consumers(256, 64) == 2  # 2 tiles either way
    assert hopper_tree.consumers(276, 128) == 2  # heads of 128: never
    assert hopper_tree.consumers(384, 64) == 3 and hopper_tree.consumers(128, 64) == 2


if __name__ == "__main__":  # python test_hopper_tree.py PAGED D BLOCK_SIZE CONSUMERS: compiles, reports
    paged, d, block_size, consumers = (int(x) for x in sys.argv[1:5])
    kernel = compile_for_hopper(bool(paged), d, block_size, abs(consumers), consumers < 0)
    print(json.dumps(dict(wgmma=len(re.findall(r"wgmma\.mma_async", kernel.asm["ptx"])), shared=kernel.metadata.shared,
                          cubin=len(kernel.asm["cubin"]), stack=stack_bytes(kernel.asm["cubin"]))))
