"""The caches of a generation, allocated once and never reallocated while decoding: the target's
KV cache (:class:`KVCache`) and the draft's constant-size ring buffer (:class:`DraftCache`).

Every write goes to slots computed on the device from per-row lengths, with shapes that do not
change from step to step, so a step can be captured in a CUDA graph. Finished rows are not
removed: the engine stops advancing them."""
from __future__ import annotations

from typing import Optional

import torch

from .attention import triton_kernels
from .config import ModelConfig


@torch.compiler.disable  # compiled layers call it as it is: in-place, no copy of the layer's cache
def store_kv(k_layer: torch.Tensor, v_layer: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
          slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes k_new, v_new [B, Hkv, M, D] into one layer of a :class:`KVCache` (k_layer, v_layer
    [B, Hkv, S, D]) at ``slots`` [B, M] (from ``KVCache.new_slots``); rows = ``arange(B)[:, None]``.
    On CUDA with Triton, one kernel writes both (two indexed copies otherwise)."""
    if k_layer.is_cuda and triton_kernels.store_fits(k_layer, v_layer, k_new, v_new):
        triton_kernels.store_kv(k_layer, v_layer, k_new, v_new, slots)
        return
    k_layer.transpose(1, 2)[rows, slots] = k_new.transpose(1, 2)
    v_layer.transpose(1, 2)[rows, slots] = v_new.transpose(1, 2)


@torch.compiler.disable  # as it is in compiled rounds: Inductor turned this indexed write into a
# view of the cache into two copies of the whole cache (0.9 ms of a 3 ms round at batch 16 on the
# H200, ``benchmarks/results/steps_batch16_h200.log``)
def move_tokens(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies the K/V of slots ``src`` [B, K] to slots ``dst`` [B, K] of every layer of a
    :class:`KVCache`'s ``k``, ``v`` [L, B, Hkv, S, D] (rows = ``arange(B)[:, None]``): one gather
    of the kept tokens, then one scatter, so overlapping slots are read before any is written."""
    for store in (k, v):
        view = store.permute(1, 3, 0, 2, 4)  # [B, S, L, Hkv, D]
        view[rows, dst] = view[rows, src]


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

    def rows(self, start: int, stop: int) -> "KVCache":
        """A cache over batch rows ``start..stop-1`` sharing this one's storage (and lengths)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.lengths = self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop]
        view.max_len, view.pending = self.max_len, 0
        return view

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

    def new_slots(self, count: int) -> torch.Tensor:
        """[B, count] slots of ``count`` new tokens written after the pending ones."""
        offsets = torch.arange(self.pending, self.pending + count, device=self.lengths.device)
        return self.lengths[:, None] + offsets[None, :]

    def advance(self, n: torch.Tensor) -> None:
        """Commits the first ``n[b]`` pending tokens of each row (n [B] long)."""
        self.lengths += n
        self.pending = 0

    def discard(self) -> None:
        """Drops the pending tokens."""
        self.pending = 0

    def commit(self, nodes: torch.Tensor, n: torch.Tensor) -> None:
        """Keeps pending tokens ``nodes[b, :n[b]]`` (indices into the pending block, increasing;
        [B, K] long, padding ignored) of every layer: moves them to slots
        ``lengths[b] + 0..n[b]-1`` (one gather and one scatter over all layers), advances the
        lengths by ``n`` and drops the rest. ``n[b] = 0`` leaves row b as it is."""
        k = nodes.shape[1]
        cols = torch.arange(k, device=nodes.device)[None, :]
        keep = cols < n[:, None]
        src = self.lengths[:, None] + torch.where(keep, nodes, cols)
        dst = self.lengths[:, None] + cols
        rows = torch.arange(nodes.shape[0], device=nodes.device)[:, None]
        move_tokens(self.k, self.v, rows, src, dst)
        self.advance(n)


class DraftCache:
    """Ring buffer of the draft's self-attention K/V for a batch: ``R = window + tree_size``
    slots, independent of the context length (plus one scratch slot that absorbs the writes of
    padding tokens, so every write has a fixed shape).

    Token with sequence index ``i`` (its slot in the target cache) is stored in slot ``i % R``.
    ``slot_index`` [B, R+1] records which index a slot holds (-1: empty), ``slot_node`` [B, R+1]
    marks pending tree nodes (their node number; -1 for committed tokens). A committed query at
    index ``i`` sees committed keys ``i-W+1..i``; a pending tree node sees those below its index plus
    the pending nodes its tree mask allows."""

    def __init__(self, config, batch_size: int, tree_size: int, dtype, device):
        """``config``: the draft's (``window``, ``num_kv_heads``, ``head_dim``)."""
        self.window, self.size = config.window, config.window + tree_size
        shape = (batch_size, config.num_kv_heads, self.size + 1, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_index = torch.full((batch_size, self.size + 1), -1, dtype=torch.long, device=device)
        self.slot_node = torch.full((batch_size, self.size + 1), -1, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.slot_index, self.slot_node))

    def rows(self, start: int, stop: int) -> "DraftCache":
        """A ring over batch rows ``start..stop-1`` sharing this one's storage."""
        view = DraftCache.__new__(DraftCache)
        view.window, view.size = self.window, self.size
        view.k, view.v = self.k[start:stop], self.v[start:stop]
        view.slot_index, view.slot_node = self.slot_index[start:stop], self.slot_node[start:stop]
        return view

    def write(self, k, v, index, node, valid, slot=None):
        """k, v [B, Hkv, T, D]; index, node [B, T] (node -1: committed); valid [B, T] bool;
        ``slot`` [B, T] (default ``index``) picks ring slot ``slot % R``: a pending node n of a tree
        whose root has index r uses ``r + n``, so the nodes of one tree never collide. Invalid
        tokens go to the scratch slot, which is never visible."""
        slot = torch.where(valid, (index if slot is None else slot) % self.size, self.size)
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(slot)
        self.k.transpose(1, 2)[rows, slot] = k.transpose(1, 2)
        self.v.transpose(1, 2)[rows, slot] = v.transpose(1, 2)
        self.slot_index[rows, slot] = torch.where(valid, index, -1)
        self.slot_node[rows, slot] = torch.where(valid, node, -1)

    def visibility(self, index, node, tree_mask):
        """Mask [B, T, R+1] for queries at ``index`` [B, T] (node [B, T], -1 for committed ones);
        tree_mask [B, T, N] over tree nodes (rows of committed queries are ignored)."""
        si, sn = self.slot_index[:, None, :], self.slot_node[:, None, :]
        q = index[..., None]
        committed = (sn < 0) & (si >= 0) & (si <= q) & (si > q - self.window)
        if tree_mask is None:
            return committed
        seen = tree_mask.gather(2, sn.clamp(min=0).expand(-1, q.shape[1], -1))
        return committed | ((sn >= 0) & (node[..., None] >= 0) & seen)

    def drop_pending(self):
        pending = self.slot_node >= 0
        self.slot_index.masked_fill_(pending, -1)
        self.slot_node.masked_fill_(pending, -1)

    def clear_row(self, row: int) -> None:
        """Empties row ``row`` (a new sequence takes it)."""
        self.slot_index[row] = -1
        self.slot_node[row] = -1
