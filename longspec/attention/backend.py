"""One attention interface for every forward over a :class:`~longspec.kv.cache.KVCache`.

The caller builds :class:`AttentionMeta` once per step (per-row lengths, where the new tokens
go, their tree mask, how many cache slots to attend over); every layer then calls
:func:`attend`. Implementations, all with the reference's semantics:

* ``reference``: the pure-PyTorch oracle (unmasked prefix + masked tree part merged by LSE);
* ``sdpa``: PyTorch's fused ``scaled_dot_product_attention`` with one key mask per step;
* ``matmul``: two batched matrix products and a float32 softmax, GQA heads packed into one
  product (no repeated K/V): few launches, good for short query blocks over a long cache;
* ``triton``: the hybrid tree-attention kernels (``triton_kernels.py``): split-KV over the
  prefix, masked tree part, LSE merge; reads only each row's own length of the cache.

``n_keys`` is a Python int: given by the caller (the cache capacity, so a step's shapes never
change and it can be captured in a CUDA graph), or measured from the lengths (one host sync)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import reference, triton_kernels
from .fast import causal_attention, masked_attention, runs_attention
from .paged import LayerKV, block_runs

IMPLEMENTATIONS = ("reference", "sdpa", "matmul", "triton")
# An eager causal step of at most this many new tokens (a short prefill chunk, e.g. a cached
# prefix's tail outside the captured chunk steps, which use the kernel already) runs on the Triton
# kernel when the target's implementation is Triton (``TargetModel.forward_hidden`` picks it): it
# packs the query heads of a KV head into one tile and reads a paged cache through its block table,
# where the flash path first gathers the row's keys into a dense copy: up to 128 new tokens it is
# the faster (docs/benchmarks.md, "The measurements behind the code's choices"). Longer eager
# chunks go to SDPA.
TRITON_CAUSAL_MAX_TOKENS = 128
# A causal step of at most this many new tokens over one paged row in runs of blocks on a CPU (a
# prefix-cache hit's tail) goes run by run with an explicit [M, S] mask instead of gathering the
# row for the unmasked causal kernel: the mask costs M floats a key, the gather ~2 * Hkv * D
# (docs/benchmarks.md has the measurement).
RUNS_CAUSAL_MAX_TOKENS = 256


@dataclass
class AttentionMeta:
    """What the M new tokens of a forward see: every committed slot of their row
    (``0..lengths[b]-1``) plus the pending and new tokens their ``tree_mask`` [B or 1, M, P+M]
    allows (P tokens already pending in the cache). ``slots`` [B, M]: where their K/V are
    written. ``key_mask`` [B, M, n_keys] spells that out over cache slots for the fused kernels.
    ``causal``: the mask is causal, nothing is pending and every row has the same number of cached
    tokens (a prefill chunk): query i sees slots ``0..n_keys - M + i``, the lower-right causal
    form, which a flash kernel computes without a mask (no [B, M, n_keys] transient).
    ``window`` (a sliding-window layer, see :meth:`windowed`): query i of row b sees no committed
    slot below ``starts[b, i]`` and its ``tree_mask`` already leaves out the new tokens outside
    the window."""

    impl: str
    lengths: torch.Tensor
    slots: torch.Tensor  # [B, M] physical pool slots of the new tokens
    tree_mask: torch.Tensor
    pending: int
    n_keys: int
    table: torch.Tensor  # [B, max_blocks]: the rows' block table (see ``KVCache``)
    block_size: int
    dense_row0: Optional[int]  # the rows are a strided view of the pool from this row (None: paged)
    scratch: int  # the pool's scratch slot
    causal: bool = False
    tree_causal: bool = False  # the tree mask is lower-right causal (the Triton kernel computes it)
    key_mask: Optional[torch.Tensor] = None
    key_bias: Optional[torch.Tensor] = None  # matmul: [B, 1, 1, M, n_keys] float32, 0 or -inf
    window: Optional[int] = None  # a sliding-window layer's window (None: every key)
    starts: Optional[torch.Tensor] = None  # [B, M] long: the first committed slot each query sees
    runs: Optional[list] = dataclasses.field(default=None, repr=False)  # see key_runs

    def key_runs(self) -> list:
        """One paged row on a CPU whose keys lie in 2 to ``MOST_RUNS`` runs of pool blocks (a
        prefix-cache hit: the cached blocks, then the request's own), in a step with a key mask
        or a causal chunk (its mask spelled out here): what
        :func:`~longspec.attention.fast.runs_attention` needs per run, prepared once per step for
        every layer; empty otherwise. Attending run by run instead of gathering the row keeps a
        cached document's decode step near a cold request's (``benchmarks/bench_cached_decode.py``)."""
        if self.runs is None:
            mask, spans = self.key_mask, None
            if mask is None and self.causal:  # a prefill chunk: query i sees slots 0 .. n_keys - M + i
                n, m = self.n_keys, self.tree_mask.shape[-2]
                mask = (torch.arange(n, device=self.table.device)[None, None, :]
                        <= torch.arange(n - m, n, device=self.table.device)[None, :, None])
            if self.dense_row0 is None and mask is not None:
                spans = block_runs(self.table, self.block_size, self.n_keys)
            self.runs = []
            for lo, hi, at in spans or ():
                seen = mask[:, None, :, lo:hi]  # [1, 1, M, n]
                bias = None if bool(seen.all()) else torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
                blind = ~seen.any(-1)
                self.runs.append((at, hi - lo, bias, blind if bool(blind.any()) else None))
        return self.runs

    def layer(self, k_layer: torch.Tensor, v_layer: torch.Tensor) -> LayerKV:
        """One layer of the pool (k_layer, v_layer [Hkv, P, D]) as these rows read it: a
        :class:`~longspec.kv.cache.LayerKV`."""
        return LayerKV(k_layer, v_layer, self.table, self.block_size, self.dense_row0, self.scratch)

    @classmethod
    def build(cls, cache, tree_mask: torch.Tensor, n_new: int, impl: str, causal: bool = False,
              n_keys: Optional[int] = None, slots: Optional[torch.Tensor] = None) -> "AttentionMeta":
        """``n_keys`` None: measured as ``lengths.max() + pending + n_new`` (one host sync; the
        room in the cache is checked). Otherwise the caller vouches that every row fits.
        ``slots``: the new tokens' physical slots when the caller has them (else from ``cache``)."""
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
        n_tree = cache.pending + n_new
        if tree_mask.shape[-1] != n_tree or tree_mask.shape[-2] != n_new:
            raise ValueError(f"tree mask must be [B or 1, {n_new}, {n_tree}] (pending {cache.pending} + new "
                             f"{n_new}), got {tuple(tree_mask.shape)}")
        tree_causal = causal
        if n_keys is None:
            fewest, used = cache.lengths.aminmax()
            fewest, used = int(fewest), int(used)
            cache.check_room(n_new, longest=used)
            n_keys = used + n_tree
            causal = causal and impl != "reference" and fewest == used and cache.pending == 0
        else:
            causal = False
        slots = cache.physical(cache.new_slots(n_new)) if slots is None else slots
        meta = cls(impl, cache.lengths, slots, tree_mask, cache.pending, n_keys,
                   cache.table, cache.block_size, cache.row0 if cache.dense else None,
                   cache.pool.scratch * cache.block_size, causal, tree_causal)
        meta._spell_out()
        return meta

    def _spell_out(self) -> None:
        """Sets ``key_mask`` (and ``key_bias``) for the fused PyTorch paths (the Triton kernel and
        the reference read the tree mask themselves; a causal step needs none)."""
        if self.impl in ("triton", "reference") or self.causal:
            return
        n_new, n_tree = self.tree_mask.shape[-2], self.tree_mask.shape[-1]
        slots = torch.arange(self.n_keys, device=self.tree_mask.device)
        rel = slots[None, :] - self.lengths[:, None]  # [B, S]: slot relative to the row's prefix end
        tree = self.tree_mask.expand(rel.shape[0], -1, -1).gather(
            2, rel.clamp(0, n_tree - 1)[:, None, :].expand(-1, n_new, -1))
        in_tree = (rel >= 0) & (rel < n_tree)
        prefix = (rel < 0)[:, None, :]
        if self.starts is not None:
            prefix = prefix & (slots[None, None, :] >= self.starts[..., None])
        self.key_mask = prefix | (tree & in_tree[:, None, :])
        if self.impl == "matmul":
            self.key_bias = mask_bias(self.key_mask)

    def windowed(self, positions: torch.Tensor, window: int, slot_positions: bool = True) -> "AttentionMeta":
        """This step as a sliding-window layer sees it: a key at position ``p_k`` is visible to a
        query at ``p_q`` only if ``p_k > p_q - window`` (transformers' sliding-window mask).
        positions [B, M]: the new tokens'. The new tokens' part of the tree mask is cut by their
        positions; pending tokens count as inside the window (their depth below a query is less
        than the window). ``slot_positions``: committed slot s holds position s and the new tokens
        sit at slots equal to their positions (the target's own cache), so the committed prefix is
        cut at slot ``p_q - window + 1`` and a causal step stays causal (a band); otherwise (a
        StreamingLLM view, anchor-offset training) the committed slots are all seen."""
        n_new, n_tree = self.tree_mask.shape[-2], self.tree_mask.shape[-1]
        near = positions[:, None, :] > positions[:, :, None] - window  # [B, M(query), M(key)]
        mask = self.tree_mask.expand(positions.shape[0], -1, -1)
        mask = torch.cat([mask[..., :n_tree - n_new], mask[..., n_tree - n_new:] & near], -1)
        meta = dataclasses.replace(self, tree_mask=mask, window=window, key_mask=None, key_bias=None, runs=None,
                                   starts=positions - (window - 1) if slot_positions else None)
        if not slot_positions:
            meta.causal = meta.tree_causal = False
        meta._spell_out()
        return meta


def attend(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """q [B, Hq, M, D]; k_layer, v_layer [Hkv, P, D]: one layer of the pool, the new tokens' K/V
    already written. Returns o [B, Hq, M, D]."""
    kv = meta.layer(k_layer, v_layer)
    if meta.impl == "triton":  # (a causal step only when short: see TRITON_CAUSAL_MAX_TOKENS)
        k, v, table, block_size = kv.for_kernel(triton_kernels.DEFAULT_CONFIG.block_n)
        return triton_kernels.tree_attention(q, k, v, meta.lengths, meta.tree_mask, causal=meta.tree_causal,
                                             table=table, block_size=block_size, starts=meta.starts,
                                             window=meta.window or 0)
    if meta.causal and meta.window is not None:
        return band_attention(q, kv, meta.n_keys, meta.window)
    paged_on_cpu = meta.dense_row0 is None and not q.is_cuda and not torch.compiler.is_compiling()
    short = not meta.causal or q.shape[2] <= RUNS_CAUSAL_MAX_TOKENS
    runs = meta.key_runs() if paged_on_cpu and meta.impl == "sdpa" and short else None
    if runs:  # one paged row on a CPU in a few runs of blocks: attended run by run
        return runs_attention(q, k_layer, v_layer, runs)
    k, v = kv.dense(meta.n_keys)  # a view for dense rows, else gathered
    if meta.causal:
        return causal_attention(q, k, v)
    if meta.impl == "sdpa":
        return masked_attention(q, k, v, meta.key_mask)
    if meta.impl == "matmul":
        return matmul_attention(q, k, v, bias=meta.key_bias)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    tree_slots = meta.lengths[:, None] + torch.arange(meta.pending + q.shape[2], device=q.device)[None, :]
    k_tree = k.transpose(1, 2)[rows, tree_slots].transpose(1, 2)
    v_tree = v.transpose(1, 2)[rows, tree_slots].transpose(1, 2)
    return reference.hybrid_attention(q, k, v, meta.lengths, k_tree, v_tree, meta.tree_mask, meta.starts)


def band_attention(q: torch.Tensor, kv: LayerKV, n_keys: int, window: int) -> torch.Tensor:
    """A causal step of a sliding-window layer (every row holds ``n_keys - M`` tokens before the
    M new ones, at slots equal to their positions): query i sees slots ``n_keys - M + i - window
    + 1 .. n_keys - M + i``. Only the ``M + window - 1`` slots some query sees are read, so the
    cost does not grow with the context. q [B, Hq, M, D] -> o [B, Hq, M, D]."""
    m = q.shape[2]
    lo = max(0, n_keys - m - window + 1)
    k, v = kv.dense(n_keys)
    k, v = k[:, :, lo:], v[:, :, lo:]
    query = torch.arange(n_keys - m, n_keys, device=q.device)[:, None]
    key = torch.arange(lo, n_keys, device=q.device)[None, :]
    band = (key <= query) & (key > query - window)
    return masked_attention(q, k, v, band[None])


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, impl: str,
                  may_be_empty: bool = False) -> torch.Tensor:
    """Plain masked attention through the same implementations (the draft's ring buffer and its
    cross-attention into the target cache): q [B, Hq, M, D], k/v [B, Hkv, S, D], mask [B, M, S].
    ``may_be_empty``: rows that see no key get a zero output. Returns o [B, Hq, M, D]."""
    if impl == "reference":
        return reference.dense_attention(q, k, v, mask)[0]
    if impl == "triton":  # rows that see nothing get zeros in the kernel
        return triton_kernels.masked_attention(q, k.to(q.dtype), v.to(q.dtype), mask)
    fused = masked_attention if impl == "sdpa" else matmul_attention
    if not may_be_empty:
        return fused(q, k, v, mask)
    empty = ~mask.any(-1)  # [B, M]: such rows attend to everything, then get zeros (no host sync)
    o = fused(q, k, v, mask | empty[..., None])
    return o.masked_fill(empty[:, None, :, None], 0.0)


def attend_prefix(q: torch.Tensor, kv: LayerKV, limits: torch.Tensor, impl: str,
                  n_keys: Optional[int] = None) -> torch.Tensor:
    """Query i of row b sees slots ``0..limits[b, i]-1`` of the cache layer ``kv`` (a
    :class:`~longspec.kv.cache.LayerKV`: the draft's
    cross-attention into the target cache, each query at its own lag); a query that sees none
    gets zeros. q [B, Hq, M, D], limits [B, M]. Triton: the split-KV kernel through the block
    table, no [B, M, S] mask; otherwise over the first ``n_keys`` slots (default: the capacity)."""
    if impl == "triton":
        k, v, table, block_size = kv.for_kernel(triton_kernels.DEFAULT_CONFIG.block_n)
        return triton_kernels.prefix_attention(q, k.to(q.dtype), v.to(q.dtype), limits, table=table,
                                               block_size=block_size)
    k, v = kv.dense(kv.capacity if n_keys is None else n_keys)
    visible = torch.arange(k.shape[2], device=q.device) < limits[..., None]
    return attend_masked(q, k, v, visible, impl, may_be_empty=True)


def mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, M, S] bool -> additive float32 bias [B, 1, 1, M, S] (0 visible, -inf hidden)."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~mask, float("-inf"))[:, None, None]


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, Hq, M, D]; k, v [B, Hkv, S, D]; mask [B, M, S] bool (true = visible) or its
    ``mask_bias``; every row must see at least one key. Products in the inputs' dtype with the
    query heads of one KV head stacked (no repeated K/V), softmax in float32. Returns
    o [B, Hq, M, D] in q's dtype."""
    b, hq, m, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    if bias is None:
        bias = mask_bias(mask)
    scores = torch.matmul(q.reshape(b, hkv, g * m, d), k.transpose(-1, -2)).view(b, hkv, g, m, s)
    weights = torch.softmax(torch.add(bias, scores, alpha=1.0 / math.sqrt(d)), dim=-1).to(v.dtype)
    return torch.matmul(weights.view(b, hkv, g * m, s), v).view(b, hq, m, d)
