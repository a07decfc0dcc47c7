"""Tree attention on Hopper GPUs, warp-specialized (Gluon): each split-KV program takes its share
of a row's key blocks for every packed query row of a KV head, as partial outputs and LSEs that
the Triton merge kernel combines (:mod:`~longspec.attention.triton_kernels`). The prefix's whole
key blocks come first; the one or two after them (the prefix's last keys, then the tree's
tokens at slots ``length ..``) are masked: every row sees the prefix, a tree token where the tree
mask allows, which the consumers hold as four 32-bit words a row (trees of at most 128 tokens).

Why a second kernel: a tree's many rows (69 queries x 4 query heads a KV head: 276) make the
prefix part compute-bound at long contexts, and the Triton kernel runs each key block's two
products and its softmax one after another in all its warps (about half the tensor cores' rate).
Here one program holds 128 rows in two consumer warpgroups of 64 and one producer warp: the
producer streams K/V blocks through a ring of shared-memory stages by TMA (through the block
table where the rows are paged), each consumer runs q.k, the online softmax and p.v on its 64
rows, and the two consumers' softmax and products overlap on the multiprocessor (one's softmax
while the other's products run), as FlashAttention-3 does. At heads of 64 dimensions a program
can take three consumers (192 rows) where that saves a row tile (:func:`consumers`,
``THREE_CONSUMERS``): every tile streams the whole K/V through the L2 cache, and that traffic,
not the arithmetic, sets a tile's pace.

Device code in Gluon (``triton.experimental.gluon``, Triton 3.4+): it runs on CUDA devices of
compute capability 9.x only, never under the interpreter; :func:`applies` says where."""
from __future__ import annotations

import functools
import warnings

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the TMA load's name: async_load from Triton 3.7 on, async_copy_global_to_shared before
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - triton without gluon
    gluon = None

ROWS = 64  # query rows of one consumer warpgroup (a wgmma tile's M)
CONSUMERS = 2  # consumer warpgroups of a program: ROWS * CONSUMERS rows share each K/V block
THREE_CONSUMERS = True  # three at heads of 64 where they save a row tile (no overlap: registers)
PINGPONG_THREE = True  # three consumers' products take turns too
REGISTERS = {2: (240, 168), 3: (160, 128)}  # consumers: (a consumer thread's registers, the launch's)
MAX_STAGES = 4  # K/V blocks in flight in shared memory, at most
SHARED_MEMORY = 224 * 1024  # bytes of a program's tiles: a Hopper block's 227 KB, less barriers and Triton's scratch
BLOCK_N = 128  # keys of a block (the TMA loads and the products' N / K)
PINGPONG = True  # the consumers' products alternate
OVERLAP = True  # a block's softmax runs while the previous block's p.v does
WAVES = 3  # programs of a launch, at most, in multiprocessors (the tiles' splits finish unevenly)
MIN_BLOCKS = 48  # key blocks a program streams, at least (fewer: the merge of more parts costs more)
MIN_KEYS = 32768  # a cache's capacity from which the kernel serves a tree by default (as measured)

if gluon is not None:

    @gluon.jit
    def _produce(KD, VD, k_bufs, v_bufs, ready, empty, TBL, b, stbl_b, BS, CAP, desc0, first, n_blocks,
                 PAGED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: K and V of key blocks ``first .. first + n_blocks - 1`` into the ring,
        in pieces of the descriptors' rows (a pool block's or a whole key block's), each piece's
        pool slot through the block table where PAGED (a piece never crosses a pool block; the
        last block's pieces past the row's table read its last pool block: masked, never seen)."""
        PIECE: gl.constexpr = KD.block_type.shape[0]
        for j in range(n_blocks):
            s = j % STAGES
            mbarrier.wait(empty.index(s), (j // STAGES & 1) ^ 1)  # the consumers freed the stage
            mbarrier.expect(ready.index(s), (KD.block_type.nbytes + VD.block_type.nbytes) * (BLOCK_N // PIECE))
            for piece in gl.static_range(BLOCK_N // PIECE):
                n = (first + j) * BLOCK_N + piece * PIECE
                if PAGED:
                    slot = gl.load(TBL + b * stbl_b + gl.minimum(n // BS, CAP // BS - 1)).to(gl.int32) * BS + n % BS
                else:
                    slot = n
                _tma_load(KD, [desc0 + slot, 0], ready.index(s), k_bufs.index(s).slice(piece * PIECE, PIECE))
                _tma_load(VD, [desc0 + slot, 0], ready.index(s), v_bufs.index(s).slice(piece * PIECE, PIECE))

    @gluon.jit
    def _probs(sc, m_i, l_i, qk_scale, dtype: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """One key block of the online softmax (log2 units): raw scores sc [ROWS, BLOCK_N] -> the
        probabilities in ``dtype`` as the p.v product's register operand, the new running max
        and sum, and the factor alpha [ROWS] that rescales the output to the new max (a row that
        has seen no key yet, in masked blocks, keeps a max of ``-inf`` and probabilities of 0)."""
        m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
        m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
        p = gl.exp2(sc * qk_scale - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        return (gl.convert_layout(p.to(dtype), p_layout), m_new, l_i * alpha + gl.sum(p, 1),
                gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)))

    @gluon.jit
    def _tree_bits(TM, b, stm_b, stm_m, rows, M, N_TREE, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """The tree mask TM [B or 1, M, N_TREE] int8 of packed rows [ROWS] (query ``row % M``) as
        four int32 words a row (tree tokens 32 w + 0 .. 31 in word w: ``N_TREE <= BLOCK_N = 128``),
        read before the key blocks: a [ROWS, BLOCK_N] gather in the block loop would take 64 more
        registers a thread than the consumers have."""
        # loaded 16 bytes a thread (few addresses), the words moved to the scores' rows once
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_N // 16), BLOCK_N // 16], [4, 1], [1, 0])
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, ld))
        i = gl.convert_layout(rows, gl.SliceLayout(1, ld)) % M
        seen = gl.load(TM + b * stm_b + i[:, None] * stm_m + cols[None, :], mask=(cols < N_TREE)[None, :], other=0)
        bits = gl.where(seen != 0, (1 << (cols % 32))[None, :], 0)
        word = (cols // 32)[None, :]
        row: gl.constexpr = gl.SliceLayout(1, s_layout)
        return (gl.convert_layout(gl.sum(gl.where(word == 0, bits, 0), 1), row),
                gl.convert_layout(gl.sum(gl.where(word == 1, bits, 0), 1), row),
                gl.convert_layout(gl.sum(gl.where(word == 2, bits, 0), 1), row),
                gl.convert_layout(gl.sum(gl.where(word == 3, bits, 0), 1), row))

    @gluon.jit
    def _hide(sc, key0, length, CAP, N_TREE, w0, w1, w2, w3, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Scores sc [ROWS, BLOCK_N] of the key block at slot ``key0`` past the whole blocks, with
        ``-inf`` where the row does not see the key: a prefix key below ``length`` is seen by
        every row, a tree token (slot ``length + j``, below the cache's capacity) where its bit j
        of the row's words w0 .. w3 [ROWS] (:func:`_tree_bits`) is set, nothing after."""
        keys = key0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        j = keys - length
        in_tree = (j >= 0) & (j < N_TREE) & (keys < CAP)
        j = gl.where(in_tree, j, 0)
        word = (j // 32)[None, :]
        w = gl.where(word == 0, w0[:, None], gl.where(word == 1, w1[:, None], gl.where(word == 2, w2[:, None],
                                                                                     w3[:, None])))
        seen = (keys < length)[None, :] | (in_tree[None, :] & ((w >> (j % 32)[None, :]) & 1 != 0))
        return gl.where(seen, sc, float("-inf"))

    @gluon.jit
    def _turn(turns, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Waits for this warpgroup's turn ``t`` to issue its products (PINGPONG: the consumers'
        products take turns, 0, 1 (, 2), 0, .., so one's softmax runs under the others' products):
        the previous consumer's turn ``t`` (the first's: the last one's turn ``t - 1``)."""
        FIRST: gl.constexpr = 1 if WG == 0 else 0
        if PINGPONG:
            mbarrier.wait(turns.index(WG), (t & 1) ^ FIRST)

    @gluon.jit
    def _pass(turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
        NEXT: gl.constexpr = (WG + 1) % turns.shape[0]
        if PINGPONG:
            mbarrier.arrive(turns.index(NEXT), count=1)

    @gluon.jit
    def _consume(q_bufs, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, row0, blk0, n_blocks, n_all,
                 length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s, stm_b, stm_m, M, G, N_TREE,
                 qk_scale, WG: gl.constexpr,
                 ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                 PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
        """A consumer warpgroup: packed rows ``row0 + WG * ROWS ..`` (row = g * M + i) over the
        ring's key blocks ``blk0 ..`` (from ``n_all`` on, masked: :func:`_hide`), then its partial
        output and LSE; one without rows (a tree's last tile) only keeps the turns and frees the
        stages."""
        first = row0 + WG * ROWS
        if first < G * M:
            _attend(q_bufs.index(WG), k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, first, blk0,
                    n_blocks, n_all, length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s, stm_b,
                    stm_m, M, G, N_TREE, qk_scale, WG, ROWS, BLOCK_N, HEAD_D, STAGES, PINGPONG, OVERLAP)
        else:  # the waits and arrivals of _attend, in its order
            if n_blocks > 0:
                mbarrier.wait(ready.index(0), 0)
                _turn(turns, 0, WG, PINGPONG)
                _pass(turns, WG, PINGPONG)
            for j in range(n_blocks - 1):
                mbarrier.wait(ready.index((j + 1) % STAGES), (j + 1) // STAGES & 1)
                _turn(turns, j + 1, WG, PINGPONG)
                _pass(turns, WG, PINGPONG)
                mbarrier.arrive(empty.index(j % STAGES), count=1)
            if n_blocks > 0:
                _turn(turns, n_blocks, WG, PINGPONG)
                _pass(turns, WG, PINGPONG)
                mbarrier.arrive(empty.index((n_blocks - 1) % STAGES), count=1)

    @gluon.jit
    def _attend(q_smem, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, first, blk0, n_blocks, n_all,
                length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s, stm_b, stm_m, M, G, N_TREE,
                qk_scale, WG: gl.constexpr,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
        """Rows ``first .. first + ROWS - 1``. Block j's softmax gives p and the factor alpha;
        then, at this consumer's turn, the output is rescaled by alpha and q.k of block j + 1 is
        issued with p.v of block j, and block j + 1's softmax runs while that p.v does (OVERLAP);
        with PINGPONG the other consumer's products run during this one's softmax. Blocks from
        ``n_all`` on (the keys after the whole blocks and the tree's) have their scores masked
        before their softmax."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_D, HEAD_D // 8], [4, 1], [1, 0])
        dtype: gl.constexpr = Q.dtype.element_ty
        rows = first + gl.arange(0, ROWS, gl.SliceLayout(1, ld_layout))
        d = gl.arange(0, HEAD_D, gl.SliceLayout(0, ld_layout))
        g, i = rows // M, rows % M
        q = gl.load(Q + b * sq_b + (h * G + g)[:, None] * sq_h + i[:, None] * sq_m + d[None, :],
                    mask=(rows < G * M)[:, None], other=0.0)
        q_smem.store(q)
        fence_async_shared()
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
        sc = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        p = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
        alpha = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, o_layout))
        w0 = gl.zeros([ROWS], gl.int32, gl.SliceLayout(1, s_layout))
        w1, w2, w3 = w0, w0, w0
        if blk0 + n_blocks > n_all:  # (only the programs with masked blocks read the tree mask)
            w0, w1, w2, w3 = _tree_bits(TM, b, stm_b, stm_m, first + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout)),
                                        M, N_TREE, BLOCK_N, s_layout)
        if n_blocks > 0:  # q.k of the first block
            mbarrier.wait(ready.index(0), 0)
            _turn(turns, 0, WG, PINGPONG)
            sc = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), sc, use_acc=False, is_async=True)
            _pass(turns, WG, PINGPONG)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
            if blk0 >= n_all:
                sc = _hide(sc, blk0 * BLOCK_N, length, CAP, N_TREE, w0, w1, w2, w3, BLOCK_N, s_layout)
            p, m_i, l_i, alpha = _probs(sc, m_i, l_i, qk_scale, dtype, o_layout, p_layout)
        for j in range(n_blocks - 1):
            s, s1 = j % STAGES, (j + 1) % STAGES
            acc = acc * alpha[:, None]
            mbarrier.wait(ready.index(s1), (j + 1) // STAGES & 1)
            _turn(turns, j + 1, WG, PINGPONG)
            sc = warpgroup_mma(q_smem, k_bufs.index(s1).permute((1, 0)), sc, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)
            _pass(turns, WG, PINGPONG)
            if OVERLAP:  # block j + 1's softmax while p.v of block j runs
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc, ))
            else:  # both products done: the stage is free before the softmax
                sc, acc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, acc))
                mbarrier.arrive(empty.index(s), count=1)
            p_in_flight = p
            if blk0 + j + 1 >= n_all:
                sc = _hide(sc, (blk0 + j + 1) * BLOCK_N, length, CAP, N_TREE, w0, w1, w2, w3, BLOCK_N, s_layout)
            p, m_i, l_i, alpha = _probs(sc, m_i, l_i, qk_scale, dtype, o_layout, p_layout)
            if OVERLAP:
                acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_in_flight))
                mbarrier.arrive(empty.index(s), count=1)
        if n_blocks > 0:  # the last block's p.v
            s = (n_blocks - 1) % STAGES
            acc = acc * alpha[:, None]
            _turn(turns, n_blocks, WG, PINGPONG)
            acc = warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)
            _pass(turns, WG, PINGPONG)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(s), count=1)
        rows = first + gl.arange(0, ROWS, gl.SliceLayout(1, o_layout))
        d = gl.arange(0, HEAD_D, gl.SliceLayout(0, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
        ok = rows < G * M
        gl.store(OP + b * so_b + h * so_h + split * so_s + rows[:, None] * so_r + d[None, :], o, mask=ok[:, None])
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        lse = gl.where(l_o > 0, m_o + gl.log2(gl.where(l_o > 0, l_o, 1.0)), float("-inf"))
        gl.store(LP + b * sl_b + h * sl_h + split * sl_s + rows, lse, mask=ok)

    @gluon.jit
    def _hopper_kernel(Q, KD, VD, LEN, TBL, TM, OP, LP, sq_b, sq_h, sq_m, stbl_b, stm_b, stm_m, so_b, so_h, so_s, so_r,
                       sl_b, sl_h, sl_s, HKV, M, G, N_TREE, N_SPLITS, CAP, BS, S_ROWS, qk_scale, PAGED: gl.constexpr,
                       CONSUMERS: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
                       OVERLAP: gl.constexpr):
        tile, pid, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        b, h = pid // HKV, pid % HKV
        length = gl.minimum(gl.maximum(gl.load(LEN + b).to(gl.int32), 0), CAP)
        # the row's key blocks, split evenly among the N_SPLITS programs of its tile: a (KV head,
        # split)'s tiles stream the same blocks, launched together, so the memory reads K/V once and
        # the L2 cache serves the other tiles. Its whole blocks, then one or two masked ones (the
        # keys after them and the tree's N_TREE tokens at slots length ..): in the last splits,
        # which take fewer whole blocks where they do not divide evenly
        n_all = length // BLOCK_N
        n_to_end = gl.cdiv(length + N_TREE, BLOCK_N)  # blocks up to the tree's last token
        per = gl.cdiv(n_to_end, N_SPLITS)
        first = split * per
        n_blocks = gl.maximum(gl.minimum(per, n_to_end - first), 0)
        # the storage as [rows * HKV * S_ROWS, HEAD_D] (paged: the pool's layer, S_ROWS slots a head)
        desc0 = ((b * HKV + h) * S_ROWS).to(gl.int32) if not PAGED else (h * S_ROWS).to(gl.int32)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], Q.dtype.element_ty)
        q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [CONSUMERS, ROWS, HEAD_D], q_layout)
        k_bufs = gl.allocate_shared_memory(KD.dtype, [STAGES, BLOCK_N, HEAD_D], KD.layout)
        v_bufs = gl.allocate_shared_memory(VD.dtype, [STAGES, BLOCK_N, HEAD_D], VD.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(turns.index(w), count=1)
        fence_async_shared()  # the barriers initialised before TMA or another partition uses them
        row0 = tile * CONSUMERS * ROWS
        # (the partitions written out: Gluon keeps a constexpr argument only in a literal tuple)
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_consume, (q_bufs, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, row0, first,
                            n_blocks, n_all, length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                            stm_b, stm_m, M, G, N_TREE, qk_scale, 0, ROWS, BLOCK_N, HEAD_D, STAGES, PINGPONG, OVERLAP)),
                (_consume, (q_bufs, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, row0, first,
                            n_blocks, n_all, length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                            stm_b, stm_m, M, G, N_TREE, qk_scale, 1, ROWS, BLOCK_N, HEAD_D, STAGES, PINGPONG, OVERLAP)),
                (_consume, (q_bufs, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, row0, first,
                            n_blocks, n_all, length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                            stm_b, stm_m, M, G, N_TREE, qk_scale, 2, ROWS, BLOCK_N, HEAD_D, STAGES, PINGPONG, OVERLAP)),
                (_produce, (KD, VD, k_bufs, v_bufs, ready, empty, TBL, b, stbl_b, BS, CAP, desc0, first, n_blocks,
                            PAGED, BLOCK_N, STAGES)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consume, (q_bufs, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, row0, first,
                            n_blocks, n_all, length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                            stm_b, stm_m, M, G, N_TREE, qk_scale, 0, ROWS, BLOCK_N, HEAD_D, STAGES, PINGPONG, OVERLAP)),
                (_consume, (q_bufs, k_bufs, v_bufs, ready, empty, turns, Q, OP, LP, TM, b, h, split, row0, first,
                            n_blocks, n_all, length, CAP, sq_b, sq_h, sq_m, so_b, so_h, so_s, so_r, sl_b, sl_h, sl_s,
                            stm_b, stm_m, M, G, N_TREE, qk_scale, 1, ROWS, BLOCK_N, HEAD_D, STAGES, PINGPONG, OVERLAP)),
                (_produce, (KD, VD, k_bufs, v_bufs, ready, empty, TBL, b, stbl_b, BS, CAP, desc0, first, n_blocks,
                            PAGED, BLOCK_N, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])


def consumers(rows: int, head_dim: int) -> int:
    """Consumer warpgroups a program for ``rows`` packed rows a KV head: with THREE_CONSUMERS,
    three (192 rows a tile) at heads of 64 dimensions where that takes fewer row tiles than two
    (a 69-node tree x 4 heads: 276 rows in 2 tiles, not 3), else two. At heads of 128 three
    consumers' scores, probabilities and outputs fit their 160 registers only with blocks of 64
    keys, which cost more than the tile they save (as measured)."""
    fewer = -(-rows // (ROWS * 3)) < -(-rows // (ROWS * 2))
    return 3 if THREE_CONSUMERS and head_dim == 64 and fewer else CONSUMERS


def pays(rows: int, head_dim: int) -> bool:
    """Whether the kernel beats the Triton kernel alone for ``rows`` packed rows a KV head, as
    measured (docs/benchmarks.md, "By tree size"): at heads of 64 always; at heads of 128 from
    three row tiles of 128 on (its own and the Triton kernel's: more than 256 rows), not at two,
    where the Triton kernel alone is faster."""
    return head_dim != 128 or row_tiles(rows, head_dim) > 2


def row_tiles(rows: int, head_dim: int) -> int:
    """Programs of a (row, KV head, split): its ``rows`` packed rows, a tile of consumers' rows each."""
    return -(-rows // (ROWS * consumers(rows, head_dim)))


def stages(head_dim: int, n_consumers: int) -> int:
    """K/V blocks in flight: as many as fit beside the consumers' query tiles (heads of 128
    dimensions: 3, of 64: 4)."""
    tiles = n_consumers * ROWS * head_dim * 2
    return max(2, min(MAX_STAGES, (SHARED_MEMORY - tiles) // (2 * BLOCK_N * head_dim * 2)))


def launch_constants(head_dim: int, n_consumers: int) -> tuple:
    """The kernel's compile-time arguments for ``n_consumers`` at heads of ``head_dim`` (ping-pong
    for two, for three with PINGPONG_THREE; the overlap for two only: three consumers' registers
    do not hold it), and the launch's registers a thread."""
    regs, launch_regs = REGISTERS[n_consumers]
    return dict(CONSUMERS=n_consumers, ROWS=ROWS, BLOCK_N=BLOCK_N, HEAD_D=head_dim,
                STAGES=stages(head_dim, n_consumers), CONSUMER_REGS=regs,
                PINGPONG=PINGPONG and (n_consumers == 2 or PINGPONG_THREE),
                OVERLAP=OVERLAP and n_consumers == 2), launch_regs


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


_failed: list = []  # why the kernel could not be built on this Triton (then never tried again)


def give_up(err: Exception) -> None:
    """The kernel failed to build (Gluon's API moves between Triton releases): warns once; the
    Triton kernel serves every launch from now on."""
    if not _failed:
        import triton

        warnings.warn(f"the warp-specialized Hopper attention kernel failed on Triton {triton.__version__}, "
                      f"using the Triton kernel alone: {type(err).__name__}: {str(err)[:300]}")
    _failed.append(err)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int, block_size: int) -> bool:
    """Whether :func:`tree_parts` serves a launch: a Hopper GPU, 16-bit K and V stored contiguously,
    heads of 64 or 128 dimensions, more than 128 packed rows a KV head (a tree: fewer rows are
    memory-bound, where the Triton kernel is at its floor) and pool blocks of a multiple of 64 slots."""
    return (gluon is not None and not _failed and _hopper(q.device) and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in (64, 128) and rows > ROWS * CONSUMERS and k_cache.is_contiguous()
            and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and block_size % 64 == 0)


def _piece(block_size: int) -> int:
    """Rows of one TMA load: a whole key block, or a pool block where those are smaller."""
    return BLOCK_N if block_size == 0 or block_size % BLOCK_N == 0 else 64


def split_plan(rows: int, heads: int, programs: int, capacity: int, head_dim: int) -> int:
    """Programs per row tile (splits of the key blocks) for ``rows`` packed rows of ``heads`` (row,
    KV head) pairs over a cache of ``capacity`` keys: every tile of a pair takes the same splits
    (they share each block through the L2 cache), up to WAVES x ``programs`` in all (a tree's last
    tile of a few rows, one live consumer, ends early: later waves fill its multiprocessors), and
    chunks of at least MIN_BLOCKS key blocks."""
    tiles = row_tiles(rows, head_dim)
    return max(1, min(capacity // (BLOCK_N * MIN_BLOCKS), programs * WAVES // (heads * tiles)))


def tree_parts(q, k_cache, v_cache, lengths, tree_mask, o_part, lse_part, n_splits: int, qk_scale: float,
               table=None, block_size: int = 0) -> None:
    """Writes parts ``0 .. n_splits - 1`` of o_part [B, Hkv, parts, rows, D] / lse_part [B, Hkv,
    parts, rows]: the rows' tree attention, its key blocks split evenly among ``n_splits``
    programs per row tile (:func:`split_plan`): the prefix (keys below ``lengths[b]``) and the
    tree tokens at slots ``lengths[b] + j`` that tree_mask [B or 1, M, N] int8 (last dimension
    contiguous) allows, the blocks past the prefix's whole ones masked. q [B, Hq, M, D]; k_cache,
    v_cache [B, Hkv, S, D] or a pool layer [Hkv, P, D] read through ``table`` [B, blocks] of
    ``block_size``-slot blocks. The masked blocks' slots after the tree are read (and never seen):
    they must hold finite values, as caches that start zeroed do."""
    b, hq, m, d = q.shape
    paged = table is not None
    hkv = k_cache.shape[0 if paged else 1]
    s_rows = k_cache.shape[1 if paged else 2]
    cap = table.shape[1] * block_size if paged else s_rows
    g = hq // hkv
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    piece = _piece(block_size if paged else 0)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], element)
    kd, vd = (TensorDescriptor.from_tensor(t.view(-1, d), [piece, d], layout) for t in (k_cache, v_cache))
    constants, launch_regs = launch_constants(d, consumers(g * m, d))
    tbl = table if paged else lengths
    tm_b = tree_mask.stride(0) if tree_mask.shape[0] > 1 else 0
    _hopper_kernel[(row_tiles(g * m, d), b * hkv, n_splits)](
        q, kd, vd, lengths, tbl, tree_mask, o_part, lse_part, q.stride(0), q.stride(1), q.stride(2),
        table.stride(0) if paged else 0, tm_b, tree_mask.stride(1), *o_part.stride()[:4], *lse_part.stride()[:3],
        hkv, m, g, tree_mask.shape[2], n_splits, cap, block_size or 1, s_rows, qk_scale, PAGED=paged, **constants,
        num_warps=4, maxnreg=launch_regs)
