"""Whether this Triton's Gluon can multicast a TMA load to the CTAs of a cluster (what a tree's row
tiles would need to read each K/V block from L2 once, docs/benchmarks.md): compiles, for sm_90a
and without a GPU, a kernel of two CTAs a cluster whose K/V tile has the same CTA layout in both,
and prints the PTX's bulk tensor loads, and whether ``tma.async_load`` takes ``multicast``.

    python benchmarks/tma_multicast_check.py"""
from __future__ import annotations

import inspect

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _copy(KD, OUT, LAYOUT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.bfloat16, [128, 128], LAYOUT)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, KD.block_type.nbytes)
    _load(KD, [0, 0], bar, buf)
    mbarrier.wait(bar, 0)
    _store(OUT, [0, 0], buf)
    tma.store_wait(0)


def main():
    layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16, cga_layout=((0, 0), ))
    desc = TensorDescriptor.from_tensor(torch.empty(1024, 128, dtype=torch.bfloat16), [128, 128], layout)
    args = dict(KD=desc, OUT=desc)
    signature = {n: "constexpr" if n == "LAYOUT" else mangle_type(args[n]) for n in _copy.arg_names}
    source = GluonASTSource(_copy, signature, {(_copy.arg_names.index("LAYOUT"), ): layout})
    explicit = "multicast" in inspect.signature(inspect.unwrap(_load)).parameters
    print(f"Triton {triton.__version__}: the TMA load takes multicast=: {explicit}")
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_ctas=2)).asm["ptx"]
    except Exception as err:  # noqa: BLE001 - the cluster form's layouts differ between releases: reported
        print(f"a tile shared by 2 CTAs did not compile: {str(err).splitlines()[0][:200]}")
        return
    loads = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line and ".global.mbarrier" in line]
    print("bulk tensor loads of a tile shared by 2 CTAs:\n" + "\n".join(f"  {line}" for line in loads))
    print(f"multicast in the PTX: {any('multicast' in line for line in loads)}")


if __name__ == "__main__":
    main()
