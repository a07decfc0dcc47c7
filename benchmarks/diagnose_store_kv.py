"""The KV store's kernel alone (attention/kv_store.py) by rows a program: a step's new K/V of an
8B-shaped layer (8 KV heads of 128) into a pool layer, M = 1, 16, 69 (a tree) and 1024 (a
prefill chunk) rows, BLOCK_M = 16, 32, 64; 100 launches in a CUDA graph, the median of 10
replays, microseconds a launch.

    python benchmarks/diagnose_store_kv.py
"""
import torch
import triton

from longspec.attention.kv_store import _store_kv_kernel

hkv, d, pool = 8, 128, 65536
k_layer = torch.zeros(hkv, pool, d, device="cuda", dtype=torch.bfloat16)
v_layer = torch.zeros_like(k_layer)


def run(m, block_m):
    k_new = torch.randn(1, m, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v_new = torch.randn(1, m, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    slots = (torch.arange(m, device="cuda") + 32768)[None]
    k_rows, v_rows = k_layer[None].expand(1, -1, -1, -1), v_layer[None].expand(1, -1, -1, -1)
    def f():
        _store_kv_kernel[(hkv, triton.cdiv(m, block_m))](
            k_rows, v_rows, k_new, v_new, slots, k_rows.stride(0), k_rows.stride(1), k_rows.stride(2),
            k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
            slots.stride(0), slots.stride(1), hkv, m, pool, BLOCK_M=block_m, HEAD_D=d)
    f(); torch.cuda.synchronize()
    assert torch.equal(k_layer[:, 32768:32768 + m], k_new[0])
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(100):
            f()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 10)
    return sorted(ts)[5]


for m in (1, 16, 69, 1024):
    print(m, " ".join(f"BLOCK_M={bm}: {run(m, bm):.2f} us" for bm in (16, 32, 64)), flush=True)
