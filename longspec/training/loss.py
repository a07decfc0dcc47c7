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


@dataclass
class TargetOutputs:
    """Last-layer K/V [B, Hkv, T, D] (rotated, as the target caches them) and, for
    distillation, the target's next-token logits [B, T, V] (float32)."""

    k: torch.Tensor
    v: torch.Tensor
    logits: Optional[torch.Tensor] = None


@torch.no_grad()
def target_forward(target, input_ids: torch.Tensor, positions: torch.Tensor, want_logits: bool = False,
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
    hidden = target.forward_hidden(input_ids, positions, cache, causal)
    k, v = cache.k[-1][:, :, :t].clone(), cache.v[-1][:, :, :t].clone()
    cache.discard()
    return TargetOutputs(k, v, target.logits(hidden) if want_logits else None)


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
        return torch.stack([self.ce.detach().double(), self.kl.detach().double(),
                            self.correct.double(), torch.tensor(float(self.count), dtype=torch.float64,
                                                                device=self.ce.device)])


def loss_sums(logits: torch.Tensor, input_ids: torch.Tensor, lag: int, target_logits: Optional[torch.Tensor] = None,
              distill_weight: float = 1.0) -> LossSums:
    """logits [B, T, V] of the draft, input_ids [B, T]; predictions from positions ``lag..T-2``.
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


class DraftLoss(nn.Module):
    """The draft's training step as one module (what DDP wraps: gradient synchronisation is
    hooked on ``forward``). ``forward(input_ids, positions, target_k, target_v, lag,
    target_logits)`` -> :class:`LossSums`."""

    def __init__(self, draft, distill_weight: float = 1.0):
        super().__init__()
        self.draft = draft
        self.distill_weight = distill_weight

    def forward(self, input_ids, positions, target_k, target_v, lag: int, target_logits=None) -> LossSums:
        hidden = self.draft.forward_train(input_ids, positions, target_k, target_v, lag=lag)
        return loss_sums(self.draft.logits(hidden), input_ids, lag, target_logits, self.distill_weight)
