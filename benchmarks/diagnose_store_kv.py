"""The KV store's kernel alone (attention/kv_store.py) by rows a program: a step's new K/V of an
8B-shaped layer (8 KV heads of 128) into a pool layer, M = 1, 16, 69 (a tree) and 1024 (a
prefill chunk) rows, BLOCK_M = 16, 32, 64; 100 launches in a CUDA graph, the median of 10
replays, microseconds a launch.

    python benchmarks/diagnose_store_kv.py
"""
import torch
import triton

from longspec.attention.kv_store import _store_kv_kernel
from longspec.engine.runner import time_graph

HKV, D, POOL, FIRST = 8, 128, 65536, 32768  # the rows go to slots FIRST ..


def launch_us(k_layer, v_layer, m: int, block_m: int) -> float:
    """Microseconds a launch writing M rows (checked once against the rows given)."""
    k_new, v_new = (torch.randn(1, m, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    slots = (torch.arange(m, device="cuda") + FIRST)[None]
    k_rows, v_rows = k_layer[None].expand(1, -1, -1, -1), v_layer[None].expand(1, -1, -1, -1)

    def store():
        _store_kv_kernel[(HKV, triton.cdiv(m, block_m))](
            k_rows, v_rows, k_new, v_new, slots, k_rows.stride(0), k_rows.stride(1), k_rows.stride(2),
            k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
            slots.stride(0), slots.stride(1), HKV, m, POOL, BLOCK_M=block_m, HEAD_D=D)

    store()
    assert torch.equal(k_layer[:, FIRST:FIRST + m], k_new[0]) and torch.equal(v_layer[:, FIRST:FIRST + m], v_new[0])
    return time_graph(store, 10, inner=100) * 1e6


def main():
    k_layer = torch.zeros(HKV, POOL, D, device="cuda", dtype=torch.bfloat16)
    v_layer = torch.zeros_like(k_layer)
    for m in (1, 16, 69, 1024):
        print(m, " ".join(f"BLOCK_M={bm}: {launch_us(k_layer, v_layer, m, bm):.2f} us" for bm in (16, 32, 64)),
              flush=True)


if __name__ == "__main__":
    main()
