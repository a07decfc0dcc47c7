"""Reading a paged KV cache: a layer of the :class:`~longspec.kv.cache.BlockPool` seen through the
rows' block table (:class:`LayerKV`), and the map from a row's logical slots to the pool's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


# a row in more runs of blocks than this is gathered (each run costs an attention call and a merge)
MOST_RUNS = 8


@dataclass
class LayerKV:
    """One layer of a :class:`KVCache` as attention reads it: the pool's ``k``, ``v`` [Hkv, P, D],
    the rows' block ``table`` [B, max_blocks] and ``block_size``; ``dense_row0``: the first row's
    index when every row owns its home blocks (row r: blocks ``r * max_blocks ..``), so the rows
    are a strided view of the pool with no copy (None: read through the table)."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    block_size: int
    dense_row0: Optional[int] = None
    scratch: int = 0  # the pool's scratch slot (where slots past a row's capacity go)

    @property
    def capacity(self) -> int:
        """Slots per row (``max_blocks * block_size``)."""
        return self.table.shape[1] * self.block_size

    def for_kernel(self, key_block: int = 64) -> tuple:
        """(k, v, table, block_size) for the Triton kernels: the pool layer read through the table
        where a block holds whole key blocks of ``key_block`` slots, else the rows [B, Hkv, S, D]
        with no table (dense rows: their strided view; rows in blocks of another size: gathered)."""
        if self.block_size % key_block == 0:
            return self.k, self.v, self.table, self.block_size
        return (*self.dense(self.capacity), None, 0)

    def dense(self, n_keys: int) -> tuple:
        """k, v [B, Hkv, n_keys, D] of the rows' slots ``0..n_keys-1``: a view of the pool when the
        rows are dense, else gathered through the table (a copy)."""
        return tuple(rows_of(x, self.table, self.block_size, self.dense_row0, self.scratch, n_keys)
                     for x in (self.k, self.v))


def block_runs(table: torch.Tensor, block_size: int, n_keys: int) -> Optional[list]:
    """Where a single row's slots ``0..n_keys-1`` lie when they fill 2 to :data:`MOST_RUNS`
    runs of consecutive pool blocks (a cached prefix's blocks, then the request's own): per run
    ``(lo, hi, at)``, its logical slots ``lo..hi-1`` at pool slots ``at..``; None otherwise
    (several rows, one run, which :func:`rows_of` views, or many). table [1, max_blocks]."""
    if table.shape[0] != 1:
        return None
    used = table[0, :-(-n_keys // block_size)].tolist()
    firsts = [0] + [j for j in range(1, len(used)) if used[j] != used[j - 1] + 1]
    if not 1 < len(firsts) <= MOST_RUNS:
        return None
    return [(a * block_size, min(b * block_size, n_keys), used[a] * block_size)
            for a, b in zip(firsts, firsts[1:] + [len(used)])]


def rows_of(store: torch.Tensor, table: torch.Tensor, block_size: int, dense_row0: Optional[int], scratch: int,
            n_keys: int) -> torch.Tensor:
    """Slots ``0..n_keys-1`` of the rows of ``table`` [B, max_blocks] in pool storage ``store``
    [..., Hkv, P, D] (a layer, or every layer) -> [..., B, Hkv, n_keys, D]: a strided view when the
    rows own their home blocks from row ``dense_row0`` on, else gathered through the table."""
    b, cap = table.shape[0], table.shape[1] * block_size
    if dense_row0 is not None:
        start = dense_row0 * cap
        return store[..., start:start + b * cap, :].unflatten(-2, (b, cap)).transpose(-4, -3)[..., :n_keys, :]
    used = table[:, :-(-n_keys // block_size)]  # [B, blocks]
    if not store.is_cuda and b == 1 and bool((used.diff(dim=1) == 1).all()):
        # one row in consecutive blocks (a request that reuses no cached block takes its home run): a
        # view (a gather of a long row is a real share of a CPU's decode step: docs/benchmarks.md).
        start = int(used[0, 0]) * block_size
        return store[..., start:start + n_keys, :].unsqueeze(-4)
    if n_keys >= 4 * block_size and store.shape[-2] % block_size == 0:
        # long rows: whole blocks at a time, one contiguous copy per block (at most a quarter of it
        # wasted): on a CPU several times faster than a slot at a time
        blocks = store.unflatten(-2, (-1, block_size)).index_select(-3, used.reshape(-1))  # [..., Hkv, B*blocks, bs, D]
        return blocks.unflatten(-3, used.shape).flatten(-3, -2)[..., :n_keys, :].transpose(-4, -3)
    # short rows: a slot at a time (whole blocks would copy mostly padding)
    slots = physical_slots(table, block_size, torch.arange(n_keys, device=table.device)[None, :], scratch)
    return store.index_select(-2, slots.reshape(-1)).unflatten(-2, slots.shape).transpose(-4, -3)


def physical_slots(table: torch.Tensor, block_size: int, slots: torch.Tensor, scratch: int = 0) -> torch.Tensor:
    """Logical ``slots`` [B or 1, M] of rows with block ``table`` [B, max_blocks] -> physical
    slots [B, M] of the pool; a slot outside the row's capacity maps to physical slot ``scratch``
    (the pool's scratch block: a stray write never lands in another row)."""
    cap = table.shape[1] * block_size
    inside = (slots >= 0) & (slots < cap)
    s = torch.where(inside, slots, 0).expand(table.shape[0], -1)
    phys = table.gather(1, s // block_size) * block_size + s % block_size
    return torch.where(inside, phys, scratch)
