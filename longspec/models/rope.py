"""Rotary position embeddings, computed exactly as transformers does for each ``rope_type``
(default, linear, dynamic NTK, llama3, yarn)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                    seq_len: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, float]:
    """Returns ``(inv_freq [head_dim/2] float32, attention_scaling)``.

    For ``dynamic`` NTK, ``seq_len`` (a tensor of any shape) selects the base; the result then has
    shape ``seq_len.shape + [head_dim/2]``."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = rope.theta
    kind = rope.rope_type
    if kind == "dynamic" and seq_len is not None:
        seq = seq_len.float().clamp(min=max_position_embeddings)[..., None]
        f = rope.factor
        base = base * ((f * seq / max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents.to(seq.device)), 1.0
    inv_freq = 1.0 / (base ** exponents)
    if kind == "linear":
        return inv_freq / rope.factor, 1.0
    if kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, base)
    return inv_freq, 1.0


def _yarn(rope: RopeConfig, dim: int, base: float) -> tuple[torch.Tensor, float]:
    factor = rope.factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Produces ``cos, sin`` of shape ``[B, T, head_dim]`` for integer positions ``[B, T]``.

    ``dynamic`` NTK follows transformers' incremental semantics: a forward over a whole prompt uses
    the base for ``seq_len`` = the row's prompt length (pass ``seq_len``); a token produced later, at
    position ``p``, uses the base for ``p + 1`` (the default when ``seq_len`` is None), so a
    verified tree token gets exactly the rotation autoregressive decoding would give it."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int):
        super().__init__()
        self.rope, self.head_dim, self.max_pos = rope, head_dim, max_position_embeddings
        inv_freq, self.attention_scaling = inv_frequencies(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, seq_len: Optional[torch.Tensor] = None):
        """positions [B, T]; seq_len: None or [B] (dynamic NTK only: each row's prompt length)."""
        pos = positions.float()
        if self.rope.rope_type == "dynamic":
            lens = positions + 1 if seq_len is None else seq_len[:, None].expand_as(positions)
            inv_freq, _ = inv_frequencies(self.rope, self.head_dim, self.max_pos, lens)
            freqs = pos[..., None] * inv_freq.to(pos.device)
        else:
            freqs = pos[..., None] * self.inv_freq.to(pos.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., D]``, ``cos/sin`` broadcastable to it -> rotated ``x`` (in x's dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos.to(x.dtype), rotated, sin.to(x.dtype))
