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

The same kernel serves decode (M = 1), the draft's cross-attention into the target cache (:func:`prefix_attention`:
per-query limits, no tree part) and its ring buffer's self-attention (:func:`masked_attention`: no prefix).

The oracle is :mod:`longspec.attention.reference`; CPUs run the kernels under ``TRITON_INTERPRET=1``."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch

from ..compile_boundary import compile_boundary

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    _descriptors = TensorDescriptor.from_tensor
except ImportError:  # pragma: no cover - triton before 3.4
    _descriptors = None

from .launch_plan import (ACC_ELEMENTS_PER_THREAD, SHARED_MEMORY_BUDGET, KernelConfig, merge_plan, plan,  # noqa: F401
                          shared_memory_budget, shared_memory_bytes, tile_plan)

LOG2E = 1.4426950408889634


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _softmax_update(s, v, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        """One key block of the online softmax: raw scores s = q.k [BLOCK_Q, BLOCK_N] (-inf where
        hidden, only if MASKED), values v [BLOCK_N, HEAD_D] -> the updated running max (log2
        units), sum and output, the sum and output relative to that max. Unmasked blocks skip the
        guards for rows that saw nothing yet."""
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
        if MASKED:  # a row that sees nothing yet: exponentials against 0, the max stays -inf (a
            # clamped max carried on would underflow the row's later, far-below-0 scores)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _block(DESC, base, desc_row, first, stride, d, TRANSPOSED: tl.constexpr, TMA: tl.constexpr,
               BLOCK_N: tl.constexpr):
        """The BLOCK_N keys from storage slot ``first`` on, every one inside the row's prefix:
        K as [HEAD_D, BLOCK_N] (TRANSPOSED, the q.k operand) or V as [BLOCK_N, HEAD_D]; through the
        TMA descriptor DESC (rows ``desc_row ..`` of the storage as [rows, HEAD_D]) or plain loads
        from ``base``."""
        if TMA:
            x = DESC.load([desc_row, 0])
            if TRANSPOSED:
                x = x.T
        else:
            n = first + tl.arange(0, BLOCK_N)
            if TRANSPOSED:
                x = tl.load(base + n[None, :] * stride + d[:, None])
            else:
                x = tl.load(base + n[:, None] * stride + d[None, :])
        return x

    @triton.jit
    def _slot(TBL, b, n, stbl_b, BS, PAGED: tl.constexpr):
        """Storage slot of a row's logical slot(s) ``n``: through the block table (PAGED) or ``n``."""
        if PAGED:
            return tl.load(TBL + b * stbl_b + n // BS).to(tl.int64) * BS + n % BS
        else:
            return n

    @triton.jit
    def _rows(Q, LIM, START, b, h, first, sq_b, sq_h, sq_m, slim_b, slim_m, sst_b, sst_m, M, G, length,
              HAS_LIMIT: tl.constexpr, HAS_START: tl.constexpr, ROWS: tl.constexpr, HEAD_D: tl.constexpr):
        """Packed query rows ``first .. first + ROWS - 1`` of KV head h (row = g * M + i): the rows,
        whether they exist, their queries [ROWS, HEAD_D] and tree index i, where each one's prefix
        ends (query i sees prefix slots below min(limit, length) with limits) and where its window
        starts (the first slot it sees: START[b, i] with a sliding window, else 0)."""
        rows = first + tl.arange(0, ROWS)
        ok = rows < G * M
        g, i = rows // M, rows % M
        d = tl.arange(0, HEAD_D)
        q = tl.load(Q + b * sq_b + (h * G + g)[:, None] * sq_h + i[:, None] * sq_m + d[None, :],
                    mask=ok[:, None], other=0.0)
        if HAS_LIMIT:
            end = tl.minimum(tl.maximum(tl.load(LIM + b * slim_b + i * slim_m, mask=ok, other=0).to(tl.int32), 0),
                             length)
        else:
            end = tl.zeros([ROWS], tl.int32) + length
        if HAS_START:
            start = tl.maximum(tl.load(START + b * sst_b + i * sst_m, mask=ok, other=0).to(tl.int32), 0)
        else:
            start = tl.zeros([ROWS], tl.int32)
        return rows, ok, i, q, end, start

    @triton.jit
    def _masked_range(q, k_base, v_base, TBL, b, stbl_b, BS, sk_s, sv_s, begin, end, row_start, row_end, d,
                      m_i, l_i, acc, qk_scale, PAGED: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """The key blocks from slot ``begin`` (a multiple of BLOCK_N) to ``end`` of the prefix, each
        row seeing the slots in ``row_start .. row_end - 1`` (a window's start, a ragged end)."""
        for blk in range(0, tl.cdiv(tl.maximum(end - begin, 0), BLOCK_N)):
            n = begin + blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < end
            p = _slot(TBL, b, begin + blk * BLOCK_N, stbl_b, BS, PAGED) + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + p[None, :] * sk_s + d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(v_base + p[:, None] * sv_s + d[None, :], mask=n_ok[:, None], other=0.0)
            seen = (n[None, :] < row_end[:, None]) & (n[None, :] >= row_start[:, None])
            s = tl.where(seen, tl.dot(q, k, input_precision=PRECISION), float("-inf"))
            m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, qk_scale, True, PRECISION)
        return m_i, l_i, acc

    @triton.jit
    def _finish(acc, m_i, l_i, rows, ok, b, h, split, OP, LP, OUT, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                sout_b, sout_m, sout_h, M, G, DIRECT: tl.constexpr, HEAD_D: tl.constexpr):
        """Stores the rows' output: final (DIRECT, one chunk) or this chunk's partial output and LSE."""
        g, i = rows // M, rows % M
        d = tl.arange(0, HEAD_D)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw nothing: zeros
        if DIRECT:
            tl.store(OUT + b * sout_b + i[:, None] * sout_m + (h * G + g)[:, None] * sout_h + d[None, :],
                     o.to(OUT.dtype.element_ty), mask=ok[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(OP + b * so_b + h * so_h + split * so_s + rows[:, None] * so_r + d[None, :], o, mask=ok[:, None])
            tl.store(LP + b * sl_b + h * sl_h + split * sl_s + rows, lse, mask=ok)

    @triton.jit
    def _partial_kernel(Q, K, V, KD, VD, LEN, LIM, START, TM, TBL, OP, LP, OUT,
                        sq_b, sq_h, sq_m, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, slim_b, slim_m, sst_b, sst_m,
                        stm_b, stm_m, stbl_b,
                        so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s, sout_b, sout_m, sout_h,
                        HKV, M, G, N_TREE, CHUNK, MIN_CHUNK, N_SPLITS, CAP, BS, qk_scale,
                        HAS_LIMIT: tl.constexpr, HAS_START: tl.constexpr, WINDOWED: tl.constexpr,
                        DIRECT: tl.constexpr, TMA: tl.constexpr, PAGED: tl.constexpr, BLOCK_Q: tl.constexpr,
                        BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PRECISION: tl.constexpr):
        tile, pid, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = (pid // HKV).to(tl.int64), (pid % HKV).to(tl.int64)  # 64-bit offsets: past 2^31 elements
        d = tl.arange(0, HEAD_D)
        length = tl.minimum(tl.maximum(tl.load(LEN + b).to(tl.int32), 0), CAP)  # never read outside the cache
        rows, row_ok, i, q, row_end, row_start = _rows(Q, LIM, START, b, h, tile * BLOCK_Q, sq_b, sq_h, sq_m, slim_b,
                                                       slim_m, sst_b, sst_m, M, G, length, HAS_LIMIT, HAS_START,
                                                       BLOCK_Q, HEAD_D)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_D], tl.float32)
        first_end = tl.min(tl.where(row_ok, row_end, CAP), 0)
        last_end = tl.max(tl.where(row_ok, row_end, 0), 0)
        # paged: K, V are the pool's layer [HKV, P, D] (no batch stride) and a row's slots go through
        # its block table; a key block never crosses a pool block (BS is a multiple of BLOCK_N)
        k_base, v_base = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
        # a sliding window: no row sees the key blocks below the tile's lowest start (skipped), every
        # row the ones from its highest start on
        first_start = tl.min(tl.where(row_ok, row_start, CAP), 0)
        last_start = tl.max(tl.where(row_ok, row_start, 0), 0)
        first_block = first_start // BLOCK_N * BLOCK_N
        # WINDOWED: the splits tile the span from the tile's lowest start (the plan covers one
        # window), not the whole cache: the work and the partials to merge do not grow with it.
        # Otherwise they tile the keys the tile's rows see (not the capacity the plan was made for):
        # a row shorter than the cache still spreads over every split, so its time follows its
        # length (a 64k row in a 128k cache: all the programs, not half of them)
        if WINDOWED:
            chunk = CHUNK
            lo = first_block + split * chunk
        else:
            chunk = tl.minimum(tl.maximum(tl.cdiv(tl.cdiv(last_end, N_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK), CHUNK)
            lo = split * chunk
        every_end = tl.minimum(lo + chunk, first_end)  # every row sees the keys below
        any_end = tl.minimum(lo + chunk, last_end)  # some row sees the keys below
        head = tl.maximum(lo, first_block)
        full = tl.maximum(head, tl.cdiv(last_start, BLOCK_N) * BLOCK_N)
        m_i, l_i, acc = _masked_range(q, k_base, v_base, TBL, b, stbl_b, BS, sk_s, sv_s, head, tl.minimum(full, any_end),
                                      row_start, row_end, d, m_i, l_i, acc, qk_scale, PAGED, BLOCK_N, PRECISION)
        n_full = tl.maximum(every_end - full, 0) // BLOCK_N
        # TMA: KD, VD describe the (contiguous) storage as [rows * HKV * S, HEAD_D], S slots a head
        desc0 = ((b * sk_b + h * sk_h) // HEAD_D).to(tl.int32)  # (paged: no batch stride)
        for blk in range(0, n_full):  # whole blocks every row sees: no masks in the hot loop
            first = _slot(TBL, b, full + blk * BLOCK_N, stbl_b, BS, PAGED)
            k = _block(KD, k_base, desc0 + first.to(tl.int32), first, sk_s, d, True, TMA, BLOCK_N)
            v = _block(VD, v_base, desc0 + first.to(tl.int32), first, sv_s, d, False, TMA, BLOCK_N)
            m_i, l_i, acc = _softmax_update(tl.dot(q, k, input_precision=PRECISION), v, m_i, l_i, acc, qk_scale,
                                            False, PRECISION)
        m_i, l_i, acc = _masked_range(q, k_base, v_base, TBL, b, stbl_b, BS, sk_s, sv_s, full + n_full * BLOCK_N,
                                      any_end, row_start, row_end, d, m_i, l_i, acc, qk_scale, PAGED, BLOCK_N,
                                      PRECISION)  # the chunk's ragged end
        if split == N_SPLITS - 1:  # the tree tokens (slots length .. length + N_TREE - 1) under the tree mask
            for blk in range(0, tl.cdiv(N_TREE, BLOCK_N)):
                j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
                n = length + j
                n_ok = (j < N_TREE) & (n < CAP)
                p = _slot(TBL, b, tl.where(n_ok, n, 0), stbl_b, BS, PAGED)
                k = tl.load(k_base + p[None, :] * sk_s + d[:, None], mask=n_ok[None, :], other=0.0)
                v = tl.load(v_base + p[:, None] * sv_s + d[None, :], mask=n_ok[:, None], other=0.0)
                seen = tl.load(TM + b * stm_b + i[:, None] * stm_m + j[None, :],
                               mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
                s = tl.where(seen, tl.dot(q, k, input_precision=PRECISION), float("-inf"))
                m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, qk_scale, True, PRECISION)
        _finish(acc, m_i, l_i, rows, row_ok, b, h, split, OP, LP, OUT, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                sout_b, sout_m, sout_h, M, G, DIRECT, HEAD_D)

    @triton.jit
    def _merge_kernel(OP, LP, OUT, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s, sout_b, sout_m, sout_h, HKV, M, G, N_PARTS,
                      PARTS_P2: tl.constexpr, PARTS: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_D: tl.constexpr):
        # all the LSEs at once, then the outputs PARTS parts a load (an empty part's, LSE -inf: not read)
        pid, tile = tl.program_id(0), tl.program_id(1)
        b, h = (pid // HKV).to(tl.int64), (pid % HKV).to(tl.int64)  # 64-bit offsets: past 2^31 elements
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < G * M
        lp, op, d = LP + b * sl_b + h * sl_h, OP + b * so_b + h * so_h, tl.arange(0, HEAD_D)
        all_parts = tl.arange(0, PARTS_P2)  # every part's LSE in one load: [PARTS_P2, BLOCK_R]
        every = tl.load(lp + all_parts[:, None] * sl_s + rows[None, :],
                        mask=(all_parts < N_PARTS)[:, None] & row_ok[None, :], other=float("-inf"))
        m = tl.max(every, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp2(every - m_safe[None, :]), 0)
        acc = tl.zeros([BLOCK_R, HEAD_D], tl.float32)
        for first in range(0, N_PARTS, PARTS):  # independent loads: only the sum is carried
            parts = first + tl.arange(0, PARTS)
            w = tl.exp2(tl.load(lp + parts[:, None] * sl_s + rows[None, :],
                                mask=(parts < N_PARTS)[:, None] & row_ok[None, :], other=float("-inf")) - m_safe)
            o = tl.load(op + parts[:, None, None] * so_s + rows[None, :, None] * so_r + d[None, None, :],
                        mask=(w > 0)[:, :, None], other=0.0)
            acc += tl.sum(o * w[:, :, None], 0)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        g, i = rows // M, rows % M
        tl.store(OUT + b * sout_b + i[:, None] * sout_m + (h * G + g)[:, None] * sout_h + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


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
    programs = c.programs or _multiprocessors(q.device) * (c.per_sm or 1)
    windowed = starts is not None and window > 0
    span = min(cap, window + m + block_n) if windowed else cap  # + block_n: the span starts block-aligned
    n_splits, chunk = plan(span, units, c.block_n, programs, c.min_chunk) if with_prefix else (1, cap)
    out = torch.empty(b, m, hq, d, dtype=q.dtype, device=q.device)
    direct = n_splits == 1
    if direct:  # no partials: the kernel writes `out`
        o_part = lse_part = out
    else:
        o_part = torch.empty(b, hkv, n_splits, rows, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b, hkv, n_splits, rows, dtype=torch.float32, device=q.device)
    n_tree = 0 if mask is None else mask.shape[2]
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
    tma = block_q >= 128 and _tma_hardware(q.device) if c.tma is None else c.tma
    tma = tma and k_cache.is_contiguous() and v_cache.is_contiguous() and _descriptors is not None
    kd, vd = ((_descriptors(t.view(-1, d), [block_n, d]) for t in (k_cache, v_cache)) if tma else (k_cache, v_cache))
    if paged:  # the pool layer as a cache of one row of P slots, shared by every row (batch stride 0)
        k_strides, v_strides = (0, *k_cache.stride()[:2]), (0, *v_cache.stride()[:2])
        tbl, tbl_stride = table, table.stride(0)
    else:
        k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
        tbl, tbl_stride, block_size = lengths, 0, 1  # never read
    grid = (tiles, b * hkv, n_splits)
    with _on(q.device):
        _partial_kernel[grid](
            q, k_cache, v_cache, kd, vd, lengths, lengths if limits is None else limits,
            lengths if starts is None else starts, mask, tbl, o_part, lse_part, out,
            q.stride(0), q.stride(1), q.stride(2), *k_strides, *v_strides, *lim_strides, *start_strides, *tm_strides,
            tbl_stride,
            *op_strides, *lp_strides, out.stride(0), out.stride(1), out.stride(2),
            hkv, m, g, n_tree, chunk, min(chunk, triton.cdiv(c.min_chunk, block_n) * block_n), n_splits, cap,
            block_size, LOG2E / math.sqrt(d),
            HAS_LIMIT=limits is not None, HAS_START=starts is not None, WINDOWED=windowed, DIRECT=direct, TMA=tma,
            PAGED=paged, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_D=d,
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
    self-attention: window + tree nodes); a query that sees no key gets zeros. One program per
    row tile and KV head, no split: for short key sets (hundreds).

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
