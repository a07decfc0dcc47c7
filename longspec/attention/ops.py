"""The Triton attention kernels as PyTorch custom operators, for compiled steps.

A compiled step that calls a Triton launch directly breaks its graph there (the kernels are
:func:`~longspec.compile_boundary.compile_boundary` functions): a hybrid draft's proposal became
dozens of graphs, each traced and compiled apart. As ``torch.library`` custom operators with a
shape-only (fake) implementation, the read-only attention kernels are one node each of the
caller's graph. The KV store stays a graph break: as an operator mutating the cache,
functionalization would copy the cache. :func:`register` (once, when compilation is set up)
makes the kernels' public functions call the operators; calls with a ``config`` of their own
(benchmarks) run the kernels directly."""
from __future__ import annotations

from typing import Optional

import torch

from . import triton_kernels

_registered = False


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """An output as the kernels return it: [B, Hq, M, D], a view of a [B, M, Hq, D] tensor."""
    b, hq, m, d = q.shape
    return q.new_empty(b, m, hq, d).transpose(1, 2)


def register() -> None:
    """Defines the operators (once; nothing without Triton) and routes the kernels' public
    functions through them."""
    global _registered
    if _registered or not triton_kernels.available():
        return
    _registered = True
    tree_kernel = triton_kernels.tree_attention.__wrapped__
    prefix_kernel = triton_kernels.prefix_attention.__wrapped__
    masked_kernel = triton_kernels.masked_attention.__wrapped__

    @torch.library.custom_op("longspec::tree_attention", mutates_args=())
    def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                       tree_mask: torch.Tensor, causal: bool, table: Optional[torch.Tensor], block_size: int,
                       starts: Optional[torch.Tensor], window: int) -> torch.Tensor:
        return tree_kernel(q, k, v, lengths, tree_mask, causal=causal, table=table, block_size=block_size,
                           starts=starts, window=window)

    @torch.library.custom_op("longspec::prefix_attention", mutates_args=())
    def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor,
                         table: Optional[torch.Tensor], block_size: int, lengths: torch.Tensor) -> torch.Tensor:
        return prefix_kernel(q, k, v, limits, table=table, block_size=block_size, lengths=lengths)

    @torch.library.custom_op("longspec::masked_attention", mutates_args=())
    def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_kernel(q, k, v, mask)

    for op in (tree_attention, prefix_attention, masked_attention):
        op.register_fake(lambda q, *args: _output_like(q))

    def tree_call(q, k, v, lengths, tree_mask, config=None, causal=False, table=None, block_size=0, starts=None,
                  window=0):
        if config is not None:
            return tree_kernel(q, k, v, lengths, tree_mask, config, causal, table, block_size, starts, window)
        return tree_attention(q, k, v, lengths, tree_mask, causal, table, block_size, starts, window)

    def prefix_call(q, k, v, limits, config=None, table=None, block_size=0):
        if config is not None:
            return prefix_kernel(q, k, v, limits, config, table, block_size)
        return prefix_attention(q, k, v, limits, table, block_size, limits.amax(1))  # (in the caller's graph)

    def masked_call(q, k, v, mask, config=None):
        return masked_kernel(q, k, v, mask, config) if config is not None else masked_attention(q, k, v, mask)

    triton_kernels.tree_attention.run = tree_call
    triton_kernels.prefix_attention.run = prefix_call
    triton_kernels.masked_attention.run = masked_call
