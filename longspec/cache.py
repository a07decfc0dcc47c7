"""Static KV cache: allocated once per generation, never reallocated while decoding."""
from __future__ import annotations

from typing import Optional

import torch

from .config import ModelConfig


class KVCache:
    """Keys and values of every target layer for a batch of sequences.

    ``k``, ``v``: [L, B, Hkv, S, D] (S = ``max_len`` slots); ``lengths`` [B] long: row b holds
    committed tokens in slots ``0..lengths[b]-1``. New tokens (a prefill chunk, a decode token or
    a verification tree) are written after them and stay *pending* (``pending`` tokens per row,
    at slots ``lengths[b] + 0..pending-1``) until ``advance`` commits a prefix of them, ``commit``
    moves chosen ones to consecutive slots after the prefix, or ``discard`` drops them. A tree
    can be grown level by level: each forward sees the pending tokens through its tree mask."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"KV cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        if config.sliding_window is not None and max_len > config.sliding_window:
            raise ValueError(
                f"this model uses sliding-window attention (window {config.sliding_window}), which longspec "
                f"does not implement: contexts up to {config.sliding_window} tokens only (asked for {max_len})")
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.pending = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, n_new: int, longest: Optional[int] = None) -> None:
        """Raises a clear error if ``n_new`` more tokens do not fit in every row (``longest``:
        ``lengths.max()`` when the caller has it already, saving a device sync)."""
        need = (int(self.lengths.max()) if longest is None else longest) + self.pending + n_new
        if need > self.max_len:
            raise ValueError(f"KV cache full: {need} tokens needed, the cache holds {self.max_len}")

    def _slots(self, start: int, count: int) -> tuple:
        rows = torch.arange(self.batch_size, device=self.lengths.device)[:, None]
        offsets = torch.arange(start, start + count, device=self.lengths.device)[None, :]
        return rows, self.lengths[:, None] + offsets

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Stores k_new, v_new [B, Hkv, M, D] after the pending tokens of ``layer`` (the caller
        adds M to ``pending`` once every layer has written)."""
        rows, slots = self._slots(self.pending, k_new.shape[2])
        self.k[layer].transpose(1, 2)[rows, slots] = k_new.transpose(1, 2)
        self.v[layer].transpose(1, 2)[rows, slots] = v_new.transpose(1, 2)

    def pending_kv(self, layer: int, count: int) -> tuple:
        """K, V [B, Hkv, count, D] of the first ``count`` uncommitted slots of ``layer``."""
        rows, slots = self._slots(0, count)
        k = self.k[layer].transpose(1, 2)[rows, slots].transpose(1, 2)
        v = self.v[layer].transpose(1, 2)[rows, slots].transpose(1, 2)
        return k, v

    def advance(self, n: torch.Tensor) -> None:
        """Commits the first ``n[b]`` pending tokens of each row (n [B] long)."""
        self.lengths += n
        self.pending = 0

    def discard(self) -> None:
        """Drops the pending tokens."""
        self.pending = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keeps only batch rows ``rows`` (e.g. the unfinished sequences), in that order."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.lengths = self.lengths[rows]

    def commit(self, nodes: torch.Tensor, n: torch.Tensor) -> None:
        """Keeps pending tokens ``nodes[b, :n[b]]`` (indices into the pending block, increasing;
        [B, K] long, padding ignored) of every layer: moves them to slots
        ``lengths[b] + 0..n[b]-1``, advances the lengths by ``n`` and drops the rest."""
        k = nodes.shape[1]
        cols = torch.arange(k, device=nodes.device)[None, :]
        keep = cols < n[:, None]
        src = self.lengths[:, None] + torch.where(keep, nodes, cols)
        dst = self.lengths[:, None] + cols
        rows = torch.arange(nodes.shape[0], device=nodes.device)[:, None]
        for store in (self.k, self.v):
            view = store.permute(1, 3, 0, 2, 4)  # [B, S, L, Hkv, D]
            view[rows, dst] = view[rows, src]
        self.advance(n)
