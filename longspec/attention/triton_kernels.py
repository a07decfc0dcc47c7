"""Hybrid tree attention in Triton: split-KV over the cached prefix (no mask) + the masked tree
part, merged exactly by log-sum-exp (DESIGN.md 2.4).

One program handles the packed query rows of one KV head (the ``G`` query heads that share it,
times the ``M`` queries: GQA packing; a tile of ``BLOCK_Q`` of them) over one chunk of the
prefix; the program of the last chunk also takes the tree tokens under their ancestor mask.
Per-row cache lengths (and optional per-query limits) are read on the device, so chunks past a
row's end do no work and the launch grid depends only on the cache capacity (CUDA-graph
capturable). The row tiles of one (KV head, chunk) are neighbours in the launch order, so they
read the chunk's keys from L2 once it is there, and the split plan fills whole waves of the
device's multiprocessors. A second kernel merges the chunks' partial outputs by their LSE and
writes the result in the layout the output projection reads (one chunk: written directly).

On Hopper GPUs a tree (more than 128 packed rows a KV head: compute-bound at long contexts, at
most 128 tree tokens) goes to the warp-specialized kernel of
:mod:`~longspec.attention.hopper_tree`, prefix and tree part in its split-KV programs; the
merge kernel combines their parts.

The same kernel serves decode (M = 1), the draft's cross-attention into the target cache (:func:`prefix_attention`:
per-query limits, no tree part) and its ring buffer's self-attention (:func:`masked_attention`: no prefix).

The kernels' device code is in :mod:`~longspec.attention.triton_jit`; this module plans and
launches them. The oracle is :mod:`longspec.attention.reference`; CPUs run the kernels under
``TRITON_INTERPRET=1``."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch

from ..compile_boundary import compile_boundary

try:
    import triton
except ImportError:  # pragma: no cover - triton is optional
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    _descriptors = TensorDescriptor.from_tensor
except ImportError:  # pragma: no cover - triton before 3.4
    _descriptors = None

from . import hopper_tree
from .launch_plan import (ACC_ELEMENTS_PER_THREAD, SHARED_MEMORY_BUDGET, KernelConfig, merge_plan, plan,  # noqa: F401
                          programs_per_sm, shared_memory_budget, shared_memory_bytes, tile_plan, wide_head_tiles)

LOG2E = 1.4426950408889634


def available() -> bool:
    return triton is not None


if triton is not None:  # (the device code)
    from .triton_jit import _merge_kernel, _partial_kernel

DEFAULT_CONFIG = KernelConfig()  # what calls without a config use (benchmarks may replace it)


@functools.lru_cache(maxsize=None)
def _tma_hardware(device: torch.device) -> bool:
    """Whether ``device`` has the tensor memory accelerator (compute capability 9.0 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _shared_memory_budget(device: torch.device) -> int:
    """Bytes of shared memory a launch's tiles may take on ``device`` (:func:`shared_memory_budget`
    of its opt-in limit per block)."""
    if device.type != "cuda":
        return SHARED_MEMORY_BUDGET
    props = torch.cuda.get_device_properties(device)
    return shared_memory_budget(getattr(props, "shared_memory_per_block_optin", 0))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _on(device: torch.device):
    """Makes ``device`` current while kernels launch: Triton launches on the current device's
    stream, whatever device the tensors are on (a model on cuda:1 while cuda:0 is current)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check(q, k_cache, v_cache, config, table=None, block_size: int = 0):
    """Checks the inputs (``table``: k_cache, v_cache are a pool layer [Hkv, P, D] read through
    the rows' block table [B, max_blocks] of ``block_size``-slot blocks); returns the config."""
    b, hq, m, d = q.shape
    if triton is None:
        raise RuntimeError("the Triton attention kernels need the triton package (pip install triton)")
    c = config or DEFAULT_CONFIG
    if table is not None:
        hkv = k_cache.shape[0]
        if k_cache.dim() != 3 or hq % hkv or k_cache.shape != v_cache.shape or k_cache.shape[2] != d:
            raise ValueError(f"Triton attention: q {tuple(q.shape)} does not match the pool layer {tuple(k_cache.shape)}")
        if table.dim() != 2 or table.shape[0] != b or table.dtype.is_floating_point:
            raise ValueError(f"Triton attention: the block table must be integers [{b}, blocks], got "
                             f"{tuple(table.shape)} {table.dtype}")
        if block_size < 1 or block_size % c.block_n:
            raise ValueError(f"Triton attention: block size {block_size} must be a multiple of the key block "
                             f"{c.block_n}")
    elif k_cache.dim() != 4 or q.shape[1] % k_cache.shape[1] or k_cache.shape != v_cache.shape \
            or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"Triton attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"Triton attention: head_dim {d} must be a power of two >= 16")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"Triton attention: dtypes differ (q {q.dtype}, cache {k_cache.dtype})")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("Triton attention: the head dimension must be contiguous")
    blocks = (c.block_q, c.block_n, c.merge_elements)
    if any(x & x - 1 or 0 < x < 16 for x in blocks) or 0 in blocks[1:] or min(c.programs, c.per_sm, c.min_chunk - 1) < 0:
        raise ValueError(f"Triton attention: bad kernel config {c} (block sizes: powers of two >= 16)")
    return c


def _launch(q, k_cache, v_cache, lengths, limits, mask, config, with_prefix: bool,
            table: Optional[torch.Tensor] = None, block_size: int = 0,
            starts: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """The checked inputs of the public functions below -> o [B, Hq, M, D]. ``table``: k_cache,
    v_cache are a pool layer [Hkv, P, D] read through the rows' block table. ``window`` (with
    ``starts``): no query sees more than ``window`` prefix slots from its start, so the keys of a
    tile of rows span less than ``window + M`` slots from its lowest start: the split-KV plan
    covers that span instead of the cache."""
    b, hq, m, d = q.shape
    paged = table is not None
    hkv = k_cache.shape[0 if paged else 1]
    cap = table.shape[1] * block_size if paged else k_cache.shape[2]
    c, g = config, hq // hkv
    rows = g * m
    block_q, block_n, num_warps, num_stages = tile_plan(c, rows, d, q.element_size(), _shared_memory_budget(q.device))
    tiles = triton.cdiv(rows, block_q)
    units = b * hkv * tiles
    windowed = starts is not None and window > 0
    span = min(cap, window + m + block_n) if windowed else cap  # + block_n: the span starts block-aligned
    sms = _multiprocessors(q.device)
    wide = wide_head_tiles(rows, d, block_q)  # (a tree's 64-row tiles of small heads)
    programs = c.programs or sms * (c.per_sm or programs_per_sm(span, units, block_q, sms, wide))
    n_tree = 0 if mask is None else mask.shape[2]
    if with_prefix:  # the prefix in chunks, the tree in the last one's program
        n_splits, chunk = plan(span, units, c.block_n, programs, c.min_chunk)
        tree_from = n_splits - 1
    else:  # keys only (the draft's ring buffer): a key block a program, as many as fill the GPU
        n_splits, chunk, tree_from = max(1, min(triton.cdiv(n_tree, block_n), programs // units)), cap, 0
    # a tree on Hopper: the warp-specialized kernel, its splits of each row tile as the parts to merge
    wanted = c.hopper if c.hopper is not None else cap >= hopper_tree.MIN_KEYS and hopper_tree.pays(rows, d)
    hopper = (mask is not None and with_prefix and limits is None and starts is None and wanted
              and n_tree <= hopper_tree.BLOCK_N
              and hopper_tree.applies(q, k_cache, v_cache, rows, block_size if paged else 0))
    if hopper:
        n_splits = hopper_tree.split_plan(rows, b * hkv, sms, cap, d)
    out = torch.empty(b, m, hq, d, dtype=q.dtype, device=q.device)
    direct = n_splits == 1 and not hopper
    if direct:  # no partials: the kernel writes `out`
        o_part = lse_part = out
    else:
        o_part = torch.empty(b, hkv, n_splits, rows, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b, hkv, n_splits, rows, dtype=torch.float32, device=q.device)
    if mask is None:
        mask = lengths.view(torch.int8)  # never read (int8 as a real mask: the dead tree loop compiled for an
        # int64 mask would reserve shared memory for [BLOCK_Q, BLOCK_N] int64 tiles)
        tm_strides = (0, 0)
    else:
        mask = mask.view(torch.int8) if mask.dtype == torch.bool else mask.to(torch.int8)  # bool: no copy
        if mask.stride(2) != 1:
            mask = mask.contiguous()
        tm_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1))
    lim_strides = (0, 0) if limits is None else (limits.stride(0), limits.stride(1))
    start_strides = (0, 0) if starts is None else (starts.stride(0), starts.stride(1))
    op_strides = (0,) * 4 if direct else o_part.stride()[:4]
    lp_strides = (0,) * 3 if direct else lse_part.stride()[:3]
    tma = (block_q >= 128 or wide) and _tma_hardware(q.device) if c.tma is None else c.tma
    # (the Triton kernel's descriptors: none where the Hopper kernel takes the tree, with its own)
    tma = tma and not hopper and k_cache.is_contiguous() and v_cache.is_contiguous() and _descriptors is not None
    kd, vd = ((_descriptors(t.view(-1, d), [block_n, d]) for t in (k_cache, v_cache)) if tma else (k_cache, v_cache))
    if paged:  # the pool layer as a cache of one row of P slots, shared by every row (batch stride 0)
        k_strides, v_strides = (0, *k_cache.stride()[:2]), (0, *v_cache.stride()[:2])
        tbl, tbl_stride = table, table.stride(0)
    else:
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
        tbl, tbl_stride, block_size = lengths, 0, 1  # never read
    grid = (tiles, b * hkv, n_splits)
    with _on(q.device):
        if hopper:
            try:
                hopper_tree.tree_parts(q, k_cache, v_cache, lengths, mask, o_part, lse_part, n_splits,
                                       LOG2E / math.sqrt(d), table, block_size)
            except (triton.CompilationError, TypeError, AttributeError) as err:  # (Gluon's API moved)
                hopper_tree.give_up(err)
                return _launch(q, k_cache, v_cache, lengths, limits, mask, c, with_prefix, table, block_size,
                               starts, window)
        else:
            _partial_kernel[grid](
                q, k_cache, v_cache, kd, vd, lengths, lengths if limits is None else limits,
                lengths if starts is None else starts, mask, tbl, o_part, lse_part, out, q.stride(0), q.stride(1),
                q.stride(2), *k_strides, *v_strides,
                *lim_strides, *start_strides, *tm_strides, tbl_stride,
                *op_strides, *lp_strides, out.stride(0), out.stride(1), out.stride(2),
                hkv, m, g, n_tree, chunk, min(chunk, triton.cdiv(c.min_chunk, block_n) * block_n), n_splits, tree_from,
                cap, block_size, LOG2E / math.sqrt(d),
                HAS_LIMIT=limits is not None, HAS_START=starts is not None, WINDOWED=windowed, DIRECT=direct,
                TMA=tma, PAGED=paged, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_D=d,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}))
        if not direct:
            parts, block_r = merge_plan(n_splits, rows, d, c.merge_elements, b * hkv, programs)
            _merge_kernel[(b * hkv, triton.cdiv(rows, block_r))](
                o_part, lse_part, out, *op_strides, *lp_strides, *out.stride()[:3], hkv, m, g, n_splits,
                PARTS_P2=triton.next_power_of_2(n_splits), PARTS=parts, BLOCK_R=block_r, HEAD_D=d)
    return out.transpose(1, 2)


@compile_boundary  # compiled steps call it as a custom operator (attention/ops.py), eager ones as it is
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                   tree_mask: torch.Tensor, config: Optional[KernelConfig] = None, causal: bool = False,
                   table: Optional[torch.Tensor] = None, block_size: int = 0,
                   starts: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """Every query sees the committed prefix of its row (slots ``0..lengths[b]-1``, no mask) plus
    the tree tokens at slots ``lengths[b] + j`` that ``tree_mask[b, i, j]`` allows.

    q [B, Hq, M, D]; k_cache, v_cache [B, Hkv, S, D] (the tree tokens already written); lengths [B]
    long; tree_mask [B or 1, M, N_TREE] bool or int8. ``causal``: the caller vouches that the mask
    is lower-right causal (query i sees tree tokens j <= i + N_TREE - M, a prefill chunk): the
    mask is not read; the chunk goes as more prefix, query i's ending at its own slot, through the
    unmasked block loop (TMA where it applies) instead of the tree part's masked gathers.
    ``table`` [B, max_blocks] (paged): k_cache, v_cache are a pool layer [Hkv, P, D] and row b's
    slot s is pool slot ``table[b, s // block_size] * block_size + s % block_size``.
    ``starts`` [B, M] integer (a sliding window): query i of row b sees no prefix slot below
    ``starts[b, i]``, nor (``causal``: a chunk whose slots are its positions) a tree slot; a tree's
    window is in its mask. Key blocks below a tile's lowest start are never read. ``window`` > 0
    (with ``starts``): the caller vouches that no query sees more than ``window`` prefix slots
    from its start (a sliding-window layer: starts = positions - window + 1); the launch then
    splits only one window's span of the cache, so its cost does not grow with the context.
    Returns o [B, Hq, M, D] in q's dtype, a view of a [B, M, Hq, D] tensor (so the output
    projection's reshape is free)."""
    c = _check(q, k_cache, v_cache, config, table, block_size)
    m = q.shape[2]
    if window < 0:
        raise ValueError(f"tree_attention: window must be >= 0 (0: none), got {window}")
    if starts is not None and (starts.shape != (q.shape[0], m) or starts.dtype.is_floating_point):
        raise ValueError(f"tree_attention: starts must be integers [B, M] = {(q.shape[0], m)}, "
                         f"got {tuple(starts.shape)} {starts.dtype}")
    if tree_mask.dim() != 3 or tree_mask.shape[1] != m or tree_mask.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"tree_attention: tree mask must be [B or 1, {m}, N], got {tuple(tree_mask.shape)}")
    if causal:  # the chunk's slots continue the prefix: query i sees the slots up to its own, read
        # by the prefix's unmasked block loop (a tile's ragged band masked), with no tree part
        n_tree = tree_mask.shape[2]
        if n_tree < m:
            raise ValueError(f"tree_attention: a causal tree part needs N >= M, got N {n_tree}, M {m}")
        limits = lengths[:, None] + (n_tree - m + 1) + torch.arange(m, device=q.device)[None, :]
        return _launch(q, k_cache, v_cache, lengths + n_tree, limits, None, c, with_prefix=True, table=table,
                       block_size=block_size, starts=starts, window=window)
    return _launch(q, k_cache, v_cache, lengths, None, tree_mask, c, with_prefix=True, table=table,
                   block_size=block_size, starts=starts, window=window)


@compile_boundary
def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, limits: torch.Tensor,
                     config: Optional[KernelConfig] = None, table: Optional[torch.Tensor] = None,
                     block_size: int = 0, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Query i of row b sees cache slots ``0..limits[b, i]-1`` (the draft's cross-attention into
    the target cache, each query at its own lag); a query that sees no slot gets zeros.

    q [B, Hq, M, D]; k_cache, v_cache [B, Hkv, S, D], or a pool layer read through ``table`` as in
    :func:`tree_attention`; limits [B, M] integer (clamped to [0, S]); lengths [B]:
    ``limits.amax(1)`` when the caller has it (a compiled step computes it in a kernel of its own).
    Returns o [B, Hq, M, D] as :func:`tree_attention`."""
    c = _check(q, k_cache, v_cache, config, table, block_size)
    if limits.shape != (q.shape[0], q.shape[2]) or limits.dtype.is_floating_point:
        raise ValueError(f"prefix_attention: limits must be integers [B, M] = {(q.shape[0], q.shape[2])}, "
                         f"got {tuple(limits.shape)} {limits.dtype}")
    return _launch(q, k_cache, v_cache, limits.amax(1) if lengths is None else lengths, limits, None, c,
                   with_prefix=True, table=table, block_size=block_size)


@compile_boundary
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     config: Optional[KernelConfig] = None) -> torch.Tensor:
    """Query i of row b sees key j where ``mask[b, i, j]`` (the draft's ring-buffer
    self-attention: window + tree nodes); a query that sees no key gets zeros. The key blocks go
    one a program (as many programs as fill the GPU), merged by their LSE: each program's chain
    of dependent block loads stays short, which is this attention's time at hundreds of keys.

    q [B, Hq, M, D]; k, v [B, Hkv, S, D]; mask [B or 1, M, S] bool or int8. Returns o as
    :func:`tree_attention`."""
    c = _check(q, k, v, config)
    b, m, s = q.shape[0], q.shape[2], k.shape[2]
    if mask.dim() != 3 or mask.shape[1:] != (m, s) or mask.shape[0] not in (1, b):
        raise ValueError(f"masked_attention: mask must be [B or 1, {m}, {s}], got {tuple(mask.shape)}")
    return _launch(q, k, v, _zeros(b, q.device), None, mask, c, with_prefix=False)


_ZEROS: dict = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """int32 zeros [n] (no prefix before the keys: masked attention's lengths), kept per device
    outside CUDA-graph capture (a zeroing kernel less a call; one made while capturing holds
    zeros only when the graph runs, so it is not kept)."""
    zeros = _ZEROS.get(device)
    if zeros is None or zeros.numel() < n:
        zeros = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return zeros[:n]
        _ZEROS[device] = zeros
    return zeros[:n]
