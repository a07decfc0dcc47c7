"""Fast attention through PyTorch's fused ``scaled_dot_product_attention`` (flash / memory-
efficient kernels on GPU), with the reference's semantics (rows that see no key are handled by
``backend.attend_masked``). ``dense_attention`` in ``reference.py`` is its oracle."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's fused attention builds a new plan for every new key length (milliseconds of CPU per call
# when the cache grows by a token each step): decoding uses the others.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _backends(order: list, set_priority: bool = False):
    """``sdpa_kernel(order)`` in eager code. Under ``torch.compile`` nothing: the context's calls
    in a graph make torch.compile's on-disk AOT cache bypass that graph (it is traced again in
    every process), and PyTorch's default order (flash, memory-efficient, math, cuDNN) already
    keeps cuDNN off decoding's steps."""
    return nullcontext() if torch.compiler.is_compiling() else sdpa_kernel(order, set_priority=set_priority)


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeat: bool) -> tuple:
    """(k, v, enable_gqa) for SDPA: with ``repeat`` and fewer KV heads than query heads, K/V
    repeated per query head, for the memory-efficient kernel, which has no GQA: without them
    SDPA falls back to its math path, a [B, Hq, M, S] float32 matrix (256 GiB for 256k tokens)."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and repeat:
        g = q.shape[1] // k.shape[1]
        return k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), False
    return k, v, gqa


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, M, D]; k, v [B, Hkv, S, D] (GQA: Hq a multiple of Hkv); mask [B, M, S] bool
    (true = visible; every row must see a key: ``attend_masked`` handles rows that see none).
    Returns o [B, Hq, M, D] in q's dtype."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    # the memory-efficient kernel (flash takes no mask) has no GQA
    k, v, gqa = _grouped(q, k, v, repeat=q.is_cuda)
    with _backends(_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)


def runs_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, runs: list) -> torch.Tensor:
    """Masked attention of one row whose keys lie in runs of a paged pool layer instead of one
    tensor: each run's attention with its log-sum-exp (PyTorch's flash kernel for CPUs), merged
    exactly by the LSEs. q [1, Hq, M, D]; k_layer, v_layer [Hkv, P, D]; runs ``[(at, n, bias,
    blind)]`` (see :meth:`~longspec.attention.backend.AttentionMeta.key_runs`): the run's pool
    slots ``at..at + n - 1``, its additive mask [1, 1, M, n] (None: every query sees every key)
    and the queries that see none of it [1, 1, M] (None: none such). A query that sees no key at
    all gets zeros. Returns o [1, Hq, M, D] in q's dtype."""
    outs, lses = [], []
    for at, n, bias, blind in runs:
        k, v = (x[None, :, at:at + n].to(q.dtype) for x in (k_layer, v_layer))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=None if bias is None else bias.to(q.dtype))
        outs.append(o)
        lses.append(lse if blind is None else lse.masked_fill(blind, float("-inf")))  # (the kernel gives 0)
    weights = torch.softmax(torch.stack(lses).float(), dim=0)  # [R, 1, Hq, M]
    if any(blind is not None for *_, blind in runs):  # a query that sees nothing: all -inf, zeros
        weights = weights.nan_to_num(0.0)
    return (torch.stack(outs) * weights[..., None]).sum(0).to(q.dtype)


# backends a prompt's causal attention may use, in order of preference (``sdpa_kernel`` with
# ``set_priority``; an ineligible one, e.g. for lower-right causal, is skipped). cuDNN first: its
# causal attention runs long prompts well above PyTorch's default (flash; docs/benchmarks.md, "The
# measurements behind the code's choices"). Its first call in a process sets cuDNN up (paid at an
# engine's warm-up), its first of each kind of length (a multiple of 128 or not) builds a kernel
# (also paid there), and each new shape builds a plan: prompts by layer pay it once per prompt, not
# per layer. (Compiled chunk steps get PyTorch's default order: see :func:`_backends`.)
CAUSAL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *_BACKENDS]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last M of S tokens: q [B, Hq, M, D], k, v [B, Hkv, S, D] (S >= M);
    query i sees keys ``0..S - M + i`` (lower-right causal: a prefill chunk after S - M cached
    tokens). With M == S it is plain ``is_causal`` (every backend has it); otherwise PyTorch's
    ``causal_lower_right`` bias runs it on the flash kernel where it can. No [M, S] mask or score
    matrix is materialised. Backends: :data:`CAUSAL_BACKENDS`."""
    m, s = q.shape[2], k.shape[2]
    # float32 on CUDA: only the memory-efficient kernel takes it (not flash, not cuDNN)
    k, v, gqa = _grouped(q, k, v, repeat=q.is_cuda and q.dtype == torch.float32)
    with _backends(CAUSAL_BACKENDS, set_priority=True):
        if m == s:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if torch.compiler.is_compiling():
            return _compiled_lower_right(q, k, v, gqa)
        from torch.nn.attention.bias import causal_lower_right  # (imports TorchDynamo, seconds: only here)

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(m, s), enable_gqa=gqa)


def _compiled_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    """:func:`causal_attention`'s lower-right case under ``torch.compile``. ``causal_lower_right``
    dispatches through ``SDPAParams``, which Dynamo does not trace (a graph break, and the graph
    after it is never saved to the on-disk AOT cache); this calls what it dispatches to directly:
    the flash kernel, whose causal flag means lower right, in half precision on CUDA, else SDPA
    with an explicit [M, S] mask. q [B, Hq, M, D], k, v [B, Hkv, S, D] -> [B, Hq, M, D]."""
    m, s, d = q.shape[2], k.shape[2], q.shape[3]
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and torch.cuda.get_device_properties(q.device).major >= 8):  # (a constant to torch.compile)
        # (the flash kernel takes fewer K/V heads than query heads as they are: no copies)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    if gqa and q.is_cuda:  # the memory-efficient kernel (the mask) has no GQA: off the math path
        k, v, gqa = _grouped(q, k, v, repeat=True)
    visible = torch.arange(s - m, s, device=q.device)[:, None] >= torch.arange(s, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)
