"""Top-k and top-p cut points without sorting the vocabulary: one Triton program per row.

A sampled round with top-k or top-p warps every node's distribution (the target's, for the
acceptance, and the draft's levels). Sorting a whole vocabulary per node costs more than the
rest of the acceptance; the cut is only one number per row, found here by a search over the
scores' values instead:

- top-k keeps the scores ``>= v_k``, the k-th largest value (ties kept, as transformers'
  ``TopKLogitsWarper``): the largest ``t`` with ``count(score >= t) >= k``;
- top-p (after top-k) keeps the scores ``>= v_p``: the largest ``t`` with
  ``mass(score >= t) >= p``, mass being the softmax over what top-k kept. A token is then kept
  iff the mass strictly above it is below ``p``, which is transformers' ``TopPLogitsWarper``
  (drop the ascending-sorted tail whose cumulative mass ``<= 1 - p``), except that tokens of
  exactly equal score are kept or dropped together instead of by their order in a sort.

Both predicates fall as ``t`` grows, so the largest ``t`` is found digit by digit over the
scores' float32 bit patterns, as integers in the order of the floats (-0.0 just below +0.0;
:func:`_value` maps one back): eight passes over the row for eight 4-bit digits, each pass
evaluating the predicate at the 16 values of the next digit. The result is exactly a score of
the row (the predicates change only at the row's values), so ``scores < cut`` is the same
comparison the sorting path makes.

The sorting path in :mod:`longspec.spec.sampling` is the reference (and what CPUs run)."""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

BLOCK = 512  # scores a program reads at a time
NUM_WARPS = 8  # (one program a row: a decode step has one row, so each program should use its SM well)

if triton is not None:
    # a float's key: 2^31 + its bits if it is >= +0.0, else 2^31 - 1 - its magnitude's bits
    NEG_INF_KEY = tl.constexpr(0x7FFFFF)  # the key of -inf ...
    POS_INF_KEY = tl.constexpr(0x80000000 + 0x7F800000)  # ... and of +inf

    @triton.jit
    def _value(key):
        """The float of ``key``, clamped to [-inf, +inf] (keys past them are no float)."""
        key = tl.minimum(tl.maximum(key, NEG_INF_KEY), POS_INF_KEY)
        bits = tl.where(key >= 2147483648, key - 2147483648, -1 - key).to(tl.int32)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _search(row, V, below, m, target, COUNT: tl.constexpr, BLOCK: tl.constexpr):
        """The largest value ``t`` of the row's scores ``s`` with ``count(s >= t) >= target``
        (COUNT) or with ``sum(exp(s - m))`` over ``s >= t`` (and ``s >= below``) ``>= target``.
        Masses in float64 (a float32 sum over a whole vocabulary is a few of its last bits off,
        enough to move a cut near p = 0.999 by a token or more: the sorting path sums the small
        tail first). No NaN is compared: what the compiler may assume of NaNs does not matter."""
        digits = tl.arange(0, 16).to(tl.int64)
        prefix = tl.zeros((), dtype=tl.int64)
        for i in tl.static_range(8):
            keys = prefix + (digits << (28 - 4 * i))  # [16]: the values of the next digit
            cand, live = _value(keys), keys <= POS_INF_KEY  # (above +inf: no score reaches it)
            acc = tl.zeros((16,), dtype=tl.float64)
            for start in range(0, V, BLOCK):
                j = start + tl.arange(0, BLOCK)
                s = tl.load(row + j, mask=j < V, other=float("-inf"))
                if COUNT:
                    w = tl.where(j < V, 1.0, 0.0).to(tl.float64)
                else:
                    w = tl.where((j < V) & (s >= below), tl.exp(s.to(tl.float64) - m.to(tl.float64)), 0.0)
                acc += tl.sum(tl.where((s[:, None] >= cand[None, :]) & live[None, :], w[:, None], 0.0), 0)
            # digit 0 always holds (the prefix does); the largest digit that still holds
            best = tl.max(tl.where((acc >= target) | (digits == 0), digits, 0), 0)
            prefix = prefix + (best << (28 - 4 * i))
        return _value(prefix)

    @triton.jit(do_not_specialize=["V"])
    def _cut_kernel(S, K, P, CUT, V, stride, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        row = S + r * stride
        k = tl.load(K + r)
        p = tl.load(P + r)
        cut = tl.full((), float("-inf"), tl.float32)
        if (k > 0) & (k < V):
            cut = _search(row, V, cut, 0.0, k.to(tl.float64), True, BLOCK)
        if p < 1.0:
            m = tl.full((), float("-inf"), tl.float32)
            for start in range(0, V, BLOCK):
                j = start + tl.arange(0, BLOCK)
                m = tl.maximum(m, tl.max(tl.load(row + j, mask=j < V, other=float("-inf")), 0))
            z = tl.zeros((), dtype=tl.float64)
            for start in range(0, V, BLOCK):
                j = start + tl.arange(0, BLOCK)
                s = tl.load(row + j, mask=j < V, other=float("-inf"))
                z += tl.sum(tl.where((j < V) & (s >= cut), tl.exp(s.to(tl.float64) - m.to(tl.float64)), 0.0), 0)
            # (the top score alone has mass 1: a positive target never cuts it, however small p)
            cut = _search(row, V, cut, m, tl.maximum(p.to(tl.float64) * z, 1e-30), False, BLOCK)
        tl.store(CUT + r, cut)


def available() -> bool:
    return triton is not None


def cut_points(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scores [R, V] float32 (temperature applied), top_k [R] (0: off), top_p [R] (1: off) ->
    [R] float32: the smallest score each row keeps (``-inf``: all of them); a row's warped
    scores are ``scores.masked_fill(scores < cut[:, None], -inf)``."""
    scores = scores.float().contiguous()
    r, v = scores.shape
    cut = torch.empty(r, dtype=torch.float32, device=scores.device)
    if r == 0:
        return cut
    with (torch.cuda.device(scores.device) if scores.is_cuda else contextlib.nullcontext()):
        _cut_kernel[(r,)](scores, top_k.long().contiguous(), top_p.float().contiguous(), cut, v, scores.stride(0),
                          BLOCK=BLOCK, num_warps=NUM_WARPS)
    return cut
