"""The frozen target forward that feeds the draft, and the draft's training losses.

Alignment: the draft hidden state at chunk position ``t`` predicts token ``t + 1``. With lag ``g``
query ``t`` sees target KV ``0..t-g``; the first ``g`` queries see none (their cross-attention
output is zero), a state never met at inference (there the root already sees the prompt), so
they are left out of the loss: a chunk of ``T`` tokens contributes the ``T - 1 - g`` predictions
from positions ``g..T-2``. Every chunk of a step has the same ``g`` and ``T``, so token sums
divided by one global count give the exact mean over a global batch, however it is split into
micro-batches and ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..models.compiled import compile_step


@dataclass
class TargetOutputs:
    """Last-layer K/V [B, Hkv, T, D] (rotated, as the target caches them) and, for
    distillation, the target's LM-head input [B, T, H] (its final-norm hidden states: the chunked
    loss computes the logits from them)."""

    k: torch.Tensor
    v: torch.Tensor
    hidden: Optional[torch.Tensor] = None


@torch.no_grad()
def target_forward(target, input_ids: torch.Tensor, positions: torch.Tensor, want_hidden: bool = False,
                   cache=None) -> TargetOutputs:
    """Runs the frozen target over input_ids, positions [B, T] (causal) on a fresh cache (or
    ``cache``, a KV cache of B rows and at least T slots to reuse; reset first) and returns its
    last layer's K/V. Under ``no_grad``, not ``inference_mode``: the K/V are saved for the
    draft's backward."""
    b, t = input_ids.shape
    if cache is None:
        cache = target.new_cache(b, t)
    cache.lengths.zero_()
    cache.discard()
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()[None]  # [1, T, T]
    # flash, no mask (sliding-window layers: the window cut by the anchor-offset positions)
    hidden = target.forward_hidden(input_ids, positions, cache, causal, causal=True, slot_positions=False)
    k, v = cache.k[-1][:, :, :t].clone(), cache.v[-1][:, :, :t].clone()
    cache.discard()
    return TargetOutputs(k, v, hidden if want_hidden else None)


@dataclass
class LossSums:
    """Token sums over the predictions of a micro-batch: ``objective`` (the trained quantity,
    differentiable), ``ce`` (cross-entropy), ``kl`` (KL(target || draft), 0 without
    distillation), ``correct`` (top-1 hits) and ``count`` (predictions)."""

    objective: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    correct: torch.Tensor
    count: int

    def stats(self) -> torch.Tensor:
        """float64 [4]: ce, kl, correct, count (detached; for all-reduce and logging)."""
        ce = self.ce.detach().double()
        return torch.stack([ce, self.kl.detach().double(), self.correct.double(), ce.new_full((), float(self.count))])


def loss_sums(logits: torch.Tensor, input_ids: torch.Tensor, lag: int, target_logits: Optional[torch.Tensor] = None,
              distill_weight: float = 1.0) -> LossSums:
    """The reference loss over materialised logits (training uses :func:`head_loss_sums`):
    logits [B, T, V] of the draft, input_ids [B, T]; predictions from positions ``lag..T-2``.
    With ``target_logits`` [B, T, V] the objective is ``(1 - w) * CE + w * KL`` (w =
    ``distill_weight``), else CE."""
    t = input_ids.shape[1]
    pred = logits[:, lag:t - 1].float()
    labels = input_ids[:, lag + 1:]
    log_q = F.log_softmax(pred, -1)
    ce = F.nll_loss(log_q.flatten(0, 1), labels.flatten(), reduction="sum")
    correct = (pred.detach().argmax(-1) == labels).sum()
    kl = torch.zeros((), device=logits.device)
    objective = ce
    if target_logits is not None:
        log_p = F.log_softmax(target_logits[:, lag:t - 1].float(), -1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
        objective = (1.0 - distill_weight) * ce + distill_weight * kl
    return LossSums(objective, ce, kl, correct, labels.numel())


def _chunk_terms(z: torch.Tensor, labels: torch.Tensor, z_target: Optional[torch.Tensor], w: float):
    """One chunk of :class:`_ChunkedHeadLoss`: the draft's logits z [n, V] and the target's
    z_target [n, V] (or None) in the head's dtype, labels [n]. Returns the chunk's summed CE, KL
    and top-1 hits (0-d) and the gradient of (1 - w) CE + w KL with respect to z, in z's dtype:
    softmax(z) - (1 - w) onehot - w softmax(z_target). Elementwise work over [n, V]: compiled
    (``--compile``), it becomes a few fused passes instead of about ten."""
    log_q = F.log_softmax(z.float(), -1)
    y = labels[:, None]
    ce = -log_q.gather(1, y).sum()
    correct = (z.argmax(-1) == labels).sum()
    # the one-hot term as a comparison, not a scatter: it fuses (and Inductor miscompiled a
    # scatter_add next to the KL's reduction, dropping the term)
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == y
    g = log_q.exp() - (1.0 - w) * onehot
    kl = ce.new_zeros(())
    if z_target is not None:
        log_p = F.log_softmax(z_target.float(), -1)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum()
        g = g - w * p
    return ce, kl, correct, g.to(z.dtype)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Summed (1 - w) * CE + w * KL(target || draft) of the LM head ``weight`` [V, H] applied to
    h [N, H] (and to the target's h_target [N, H] for the KL), a ``chunk`` of rows at a time: the
    [N, V] logits are never held at once. The gradient with respect to h is computed in the same
    pass (softmax(z) - (1 - w) * onehot - w * p, times the head) and kept for backward; the head
    is frozen. Returns (objective, ce, kl, correct); only the objective is differentiable."""

    @staticmethod
    def forward(ctx, h, weight, labels, h_target, distill_weight: float, chunk: int, terms=_chunk_terms):
        grad = torch.empty_like(h)
        sums = torch.zeros(3, dtype=torch.float64, device=h.device)  # ce, kl, correct
        w = distill_weight if h_target is not None else 0.0
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = F.linear(h[rows].to(weight.dtype), weight)
            z_target = None if h_target is None else F.linear(h_target[rows].to(weight.dtype), weight)
            ce, kl, correct, g = terms(z, labels[rows], z_target, w)
            sums += torch.stack([ce.double(), kl.double(), correct.double()])
            grad[rows] = (g @ weight).to(h.dtype)
        ctx.save_for_backward(grad)
        ce, kl, correct = sums[0], sums[1], sums[2]
        objective = (1.0 - w) * ce + w * kl
        return objective.float(), ce.float(), kl.float(), correct.long()

    @staticmethod
    def backward(ctx, grad_objective, *unused):
        (grad,) = ctx.saved_tensors
        return grad * grad_objective.to(grad.dtype), None, None, None, None, None, None


def head_loss_sums(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, lag: int,
                   target_hidden: Optional[torch.Tensor] = None, distill_weight: float = 1.0,
                   chunk: int = 4096, terms=_chunk_terms) -> LossSums:
    """:func:`loss_sums` of ``logits = hidden @ weight.T`` without materialising them: hidden
    [B, T, H] (the draft's head input), weight [V, H] (the frozen LM head), target_hidden [B, T, H]
    (the target's head input, for distillation). ``chunk`` rows of logits exist at a time;
    ``terms``: what computes each chunk's sums and gradient (:func:`_chunk_terms`, or it compiled)."""
    t = input_ids.shape[1]
    h = hidden[:, lag:t - 1].flatten(0, 1)
    labels = input_ids[:, lag + 1:].flatten()
    h_target = None if target_hidden is None else target_hidden[:, lag:t - 1].flatten(0, 1)
    objective, ce, kl, correct = _ChunkedHeadLoss.apply(h, weight.detach(), labels, h_target, distill_weight,
                                                        chunk, terms)
    return LossSums(objective, ce, kl, correct, labels.numel())


class DraftLoss(nn.Module):
    """The draft's training step as one module (what DDP wraps: gradient synchronisation is
    hooked on ``forward``). ``forward(input_ids, positions, target_k, target_v, lag,
    target_hidden)`` -> :class:`LossSums`. ``compile``: the draft's forward (and backward) through
    torch.compile, one graph per lag and batch shape, and the elementwise work of each chunk of
    the vocabulary loss too."""

    def __init__(self, draft, distill_weight: float = 1.0, chunk: int = 4096, compile: bool = False):
        super().__init__()
        self.draft = draft
        self.distill_weight = distill_weight
        self.chunk = chunk
        self.compiled = compile
        self._forward_train = compile_step(draft.forward_train) if compile else draft.forward_train
        self._chunk_terms = compile_step(_chunk_terms) if compile else _chunk_terms

    def forward(self, input_ids, positions, target_k, target_v, lag: int, target_hidden=None) -> LossSums:
        """``target_hidden`` [B, T, H]: the target's LM-head input (for distillation). The loss over
        the big vocabulary runs in chunks (:func:`head_loss_sums`)."""
        hidden = self._forward_train(input_ids, positions, target_k, target_v, lag=lag)
        return head_loss_sums(self.draft.head_input(hidden), self.draft.target.lm_head.weight, input_ids, lag,
                              target_hidden, self.distill_weight, self.chunk, self._chunk_terms)
