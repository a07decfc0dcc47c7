"""The draft's selections on a GPU: the top k of ``x + bias`` over groups of columns, in one
or two small Triton launches.

A beam level picks the ``width`` best (parent, token) pairs by cumulative log-probability over
P parents x C tokens; a static level the top k children of each node. ``torch.topk`` did this
in six kernels a level (a per-chunk pass, a pass over the chunks' winners and the pairs' top k,
each a radix select and a sort), a large share of a draft level (docs/benchmarks.md). Here,
pass 1 (one program per row, group and span of ``BLOCK`` columns) takes its span's top k by k
rounds of a max over the span held in registers; pass 2 (one program per row) takes the top k
of those winners. A score and its column travel as one 64-bit key (the score's bits, ordered
as the floats, over the complement of the column), so one max a round finds both and ties go
to the smaller column, as a stable sort would put them. NaN ranks above every number, as in
``torch.topk``.

:func:`top_k` runs the kernels on CUDA tensors (as one ``torch.library`` operator, so compiled
proposals keep one graph) and ``torch.topk`` elsewhere; :func:`select_top` runs the kernels
as they are (the tests run them under ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

MAX_K = 64  # larger selections go to torch.topk (k rounds a program)
MAX_CANDIDATES = 8192  # pass 2's span (programs x k of pass 1); wider selections go to torch.topk

if triton is not None:

    @triton.jit
    def _keys(x, column):
        """float32 scores and their int32 columns -> int64 keys ordered by score, then by the
        smaller column (NaN above every number)."""
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        ordered = tl.where(x != x, 0x7FFFFFFF, ordered)
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - column).to(tl.int64)

    @triton.jit
    def _select_kernel(x_ptr, bias_ptr, keys_ptr, out_keys_ptr, values_ptr, index_ptr, n, groups, parts,
                       K: tl.constexpr, BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
        """FIRST: program (row, group * parts + part) keys its span of x [R, G, n] (+ bias [R, G]);
        else program (row, 0) loads the row's n keys of pass 1. Then k rounds of a max: LAST
        writes values [R, K] and columns [R, K] (group * n + column), else the keys [R, P, K]."""
        row = tl.program_id(0)
        program = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        pad = -9223372036854775807  # below every key (the smallest is -inf's, > -2**63 + 2**55)
        if FIRST:
            group = program // parts
            column = (program % parts) * BLOCK + offs
            inside = column < n
            x = tl.load(x_ptr + (row * groups + group).to(tl.int64) * n + column, mask=inside, other=0.0)
            x = x.to(tl.float32)
            if HAS_BIAS:
                x = x + tl.load(bias_ptr + row * groups + group).to(tl.float32)
            key = tl.where(inside, _keys(x, group * n + column), pad)
        else:
            key = tl.load(keys_ptr + row.to(tl.int64) * n + offs, mask=offs < n, other=pad)
        out = (row * tl.num_programs(1) + program) * K
        for i in tl.static_range(K):
            best = tl.max(key, 0)
            if LAST:
                ordered = (best >> 32).to(tl.int32)
                bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
                tl.store(values_ptr + out + i, bits.to(tl.float32, bitcast=True))
                tl.store(index_ptr + out + i, (0x7FFFFFFF - (best & 0xFFFFFFFF)).to(tl.int64))
            else:
                tl.store(out_keys_ptr + out + i, best)
            key = tl.where(key == best, pad, key)


def fits(x: torch.Tensor, k: int) -> bool:
    """Whether :func:`select_top` takes ``x`` [R, G, N] and ``k``."""
    if triton is None or x.dim() != 3 or not 0 < k <= min(MAX_K, x.shape[1] * x.shape[2]):
        return False
    programs = x.shape[1] * triton.cdiv(x.shape[2], _block(x.shape[2]))
    return x.shape[1] * x.shape[2] < 2 ** 31 and (programs == 1 or programs * k <= MAX_CANDIDATES)


def _block(n: int) -> int:
    return min(2048, triton.next_power_of_2(n))


def select_top(x: torch.Tensor, k: int, bias: Optional[torch.Tensor] = None) -> tuple:
    """The ``k`` largest of ``x + bias`` over each row's groups and columns, in the Triton kernels.

    Args:
        x: ``[R, G, N]`` scores (float; contiguous after ``.contiguous()``).
        k: how many (``fits(x, k)``).
        bias: ``[R, G]`` added to every score of its group (a parent's cumulative
            log-probability), or None.
    Returns:
        ``values [R, k]`` float32 (``x + bias`` in float32), descending, and ``index [R, k]``
        int64: ``group * N + column``; among equal values the smaller index first.
    """
    if not fits(x, k):
        raise ValueError(f"select_top: x must be [R, G, N] with 0 < k <= {MAX_K} and at most "
                         f"{MAX_CANDIDATES} winners of pass 1, got {tuple(x.shape)} and k={k}")
    r, g, n = x.shape
    x = x.contiguous()
    has_bias, bias = bias is not None, x if bias is None else bias.contiguous()
    values = torch.empty(r, k, dtype=torch.float32, device=x.device)
    index = torch.empty(r, k, dtype=torch.long, device=x.device)
    block = _block(n)
    parts = triton.cdiv(n, block)
    if g * parts == 1:
        _select_kernel[(r, 1)](x, bias, x, x, values, index, n, g, parts, K=k, BLOCK=block, FIRST=True,
                               LAST=True, HAS_BIAS=has_bias, num_warps=4)
        return values, index
    keys = torch.empty(r, g * parts, k, dtype=torch.long, device=x.device)
    _select_kernel[(r, g * parts)](x, bias, x, keys, values, index, n, g, parts, K=k, BLOCK=block, FIRST=True,
                                   LAST=False, HAS_BIAS=has_bias, num_warps=4)
    m = g * parts * k
    _select_kernel[(r, 1)](x, bias, keys, keys, values, index, m, g, parts, K=k,
                           BLOCK=triton.next_power_of_2(m), FIRST=False, LAST=True, HAS_BIAS=False,
                           num_warps=4 if m <= 2048 else 8)
    return values, index


def _reference(x: torch.Tensor, k: int, bias: Optional[torch.Tensor]) -> tuple:
    scores = x.float() if bias is None else x.float() + bias.float()[..., None]
    return torch.topk(scores.flatten(1), k, dim=-1)


_operator = None


def _register():
    """The kernels as one custom operator (a shape-only version for tracing)."""
    global _operator

    @torch.library.custom_op("longspec::select_top", mutates_args=())
    def select_top_op(x: torch.Tensor, k: int, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return select_top(x, k, bias)

    @select_top_op.register_fake
    def _(x, k, bias):
        return x.new_empty(x.shape[0], k, dtype=torch.float32), x.new_empty(x.shape[0], k, dtype=torch.long)

    _operator = select_top_op


if triton is not None:
    _register()


def top_k(x: torch.Tensor, k: int, bias: Optional[torch.Tensor] = None) -> tuple:
    """:func:`select_top` (values, index) on a CUDA tensor it fits, ``torch.topk`` of the
    flattened ``x + bias`` otherwise (the same values; among equal ones the order may differ)."""
    if x.is_cuda and _operator is not None and fits(x, k):
        return _operator(x, k, bias)
    return _reference(x, k, bias)
