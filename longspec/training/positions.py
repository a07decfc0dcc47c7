"""Anchor-offset position indices and the noisy cross-attention lag (DESIGN.md 2.2).

Anchor offset: in a chunk of ``n`` tokens the first ``S = 4`` keep positions ``0..S-1``
(attention sinks); the rest get consecutive positions from a random offset
``o ~ U{S, ..., max(S, max_position - n)}``, so the chunk ends below ``max_position`` and short
training texts exercise the large position indices met at inference, with in-chunk relative
distances unchanged. The target forward that produces the draft's cross-attention KV uses the
same positions.

Noisy lag: one ``g ~ U{1..G}`` per optimizer step; draft query ``t`` cross-attends to target KV
``0..t-g`` (``LongSpecDraft.forward_train(..., lag=g)``), as a draft token at tree depth ``g - 1``
does at inference.

Both draws use explicit, seeded ``torch.Generator`` objects whose states are checkpointed.
"""
from __future__ import annotations

from typing import Optional

import torch

SINKS = 4


def offset_range(n: int, max_position: int, sinks: int = SINKS) -> tuple:
    """Inclusive range ``(lo, hi)`` of the offset of a chunk of ``n`` tokens."""
    if n > max_position:
        raise ValueError(f"a chunk of {n} tokens does not fit in max_position_embeddings={max_position}")
    return sinks, max(sinks, max_position - n)


def sample_offsets(batch: int, n: int, max_position: int, generator: Optional[torch.Generator],
                   sinks: int = SINKS) -> torch.Tensor:
    """Offsets [batch] (long) drawn uniformly from :func:`offset_range`."""
    lo, hi = offset_range(n, max_position, sinks)
    return torch.randint(lo, hi + 1, (batch,), generator=generator)


def positions_from_offsets(offsets: torch.Tensor, n: int, sinks: int = SINKS) -> torch.Tensor:
    """Positions [B, n]: ``0..S-1`` then ``o, o+1, ...`` for each row's offset ``o`` (offsets [B]).
    A chunk of at most ``S`` tokens keeps plain positions."""
    steps = torch.arange(n)
    if n <= sinks:
        return steps.expand(offsets.shape[0], n).clone()
    rest = offsets[:, None] + (steps[sinks:] - sinks)[None, :]
    return torch.cat([steps[:sinks].expand(offsets.shape[0], sinks), rest], 1)


def anchor_offset_positions(batch: int, n: int, max_position: int, generator: Optional[torch.Generator],
                            enabled: bool = True, sinks: int = SINKS) -> torch.Tensor:
    """Positions [batch, n] (long) for a batch of chunks: anchor-offset ones, or plain
    ``0..n-1`` when ``enabled`` is false (the ablation; the generator is then not used)."""
    if not enabled:
        offset_range(n, max_position, sinks)  # same size check
        return torch.arange(n).expand(batch, n).clone()
    return positions_from_offsets(sample_offsets(batch, n, max_position, generator, sinks), n, sinks)


def sample_lag(generator: Optional[torch.Generator], max_lag: int, noise: bool = True) -> int:
    """The cross-attention lag ``g`` of a step: uniform in ``1..max_lag``, or 1 without noise
    (the generator is then not used)."""
    if max_lag < 1:
        raise ValueError(f"max_lag must be >= 1, got {max_lag}")
    if not noise or max_lag == 1:
        return 1
    return int(torch.randint(1, max_lag + 1, (1,), generator=generator))
