"""The KV store's write in Triton: a step's new keys and values into their cache slots, K and V
in one launch (two indexed copies otherwise: ``cache.store_kv``)."""
from __future__ import annotations

import torch

from .triton_kernels import _on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

BLOCK_M = 16  # rows a program

if triton is not None:

    # one variant for every prompt length: the row count and batch strides that change with it unspecialised
    @triton.jit(do_not_specialize=["M", "ss_b", "skn_b", "svn_b"])
    def _store_kv_kernel(K, V, KN, VN, SLOTS, sc_b, sc_h, sc_s, skn_b, skn_h, skn_m, svn_b, svn_h, svn_m, ss_b, ss_m,
                         HKV, M, CAP, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr):
        pid, tile = tl.program_id(0), tl.program_id(1)
        b, h = (pid // HKV).to(tl.int64), (pid % HKV).to(tl.int64)  # 64-bit offsets: past 2^31 elements
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_D)
        slot = tl.load(SLOTS + b * ss_b + i * ss_m, mask=i < M, other=-1)
        ok = ((i < M) & (slot >= 0) & (slot < CAP))[:, None]  # never writes outside the cache
        dst = b * sc_b + h * sc_h + slot[:, None] * sc_s + d[None, :]
        tl.store(K + dst, tl.load(KN + b * skn_b + h * skn_h + i[:, None] * skn_m + d[None, :], mask=ok), mask=ok)
        tl.store(V + dst, tl.load(VN + b * svn_b + h * svn_h + i[:, None] * svn_m + d[None, :], mask=ok), mask=ok)


def store_fits(k_layer: torch.Tensor, v_layer: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    """Whether :func:`store_kv` takes these tensors: one layout for both cache layers, equal
    shapes and dtypes, a power-of-two head dim contiguous everywhere."""
    d = k_new.shape[-1]
    return (triton is not None and k_layer.stride() == v_layer.stride() and k_new.shape == v_new.shape
            and k_layer.dtype == v_layer.dtype == k_new.dtype == v_new.dtype and d >= 1 and (d & (d - 1)) == 0
            and all(t.stride(3) == 1 for t in (k_layer, k_new, v_new)))


def store_kv(k_layer: torch.Tensor, v_layer: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``cache.store_kv`` in one launch instead of two indexed copies: k_new, v_new [B, Hkv, M, D]
    into k_layer, v_layer [B, Hkv, S, D] at ``slots`` [B, M]; a slot outside ``0..S-1`` is not
    written. The tensors must pass :func:`store_fits`."""
    b, hkv, m, d = k_new.shape
    with _on(k_new.device):  # rows of 16 a program (rows past M masked): a tree's rows over more programs
        _store_kv_kernel[(b * hkv, triton.cdiv(m, BLOCK_M))](
            k_layer, v_layer, k_new, v_new, slots, k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
            k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
            slots.stride(0), slots.stride(1), hkv, m, k_layer.shape[2], BLOCK_M=BLOCK_M, HEAD_D=d)
