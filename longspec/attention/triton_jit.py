"""The device code of the hybrid tree attention (launched by
:mod:`~longspec.attention.triton_kernels`, which says what the programs do and why): the
split-KV partial kernel (packed query rows of one KV head over one chunk of the prefix, the
last chunk's program also taking the tree part under its ancestor mask) and the merge kernel
(the chunks' partial outputs combined by their log-sum-exp), with the helpers they inline."""
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

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
    def _breaks(TBL, b, stbl_b, lo, hi):
        """How many of a row's pool blocks ``lo + 1 .. hi`` (table entries) do not follow the
        block before them: 0 where blocks ``lo .. hi`` are consecutive in the pool, one run.
        Loads the entries 128 at a time: one or two loads per program for a split's chunk."""
        breaks = tl.zeros([], tl.int32)
        for j0 in range(lo + 1, hi + 1, 128):
            j = j0 + tl.arange(0, 128)
            inside = j <= hi
            entry = tl.load(TBL + b * stbl_b + j, mask=inside, other=0)
            before = tl.load(TBL + b * stbl_b + j - 1, mask=inside, other=0)
            breaks += tl.sum((inside & (entry != before + 1)).to(tl.int32), 0)
        return breaks

    @triton.jit
    def _run_end(TBL, b, stbl_b, lo, hi):
        """The run of consecutive pool blocks that a row's block ``lo`` starts: (its first pool
        block, the first of the row's blocks ``lo + 1 .. hi`` past it, else hi + 1)."""
        base = tl.load(TBL + b * stbl_b + lo, mask=lo <= hi, other=0).to(tl.int64)
        end = hi + 1
        for j0 in range(lo + 1, hi + 1, 128):
            j = j0 + tl.arange(0, 128)
            inside = j <= hi
            entry = tl.load(TBL + b * stbl_b + j, mask=inside, other=0).to(tl.int64)
            end = tl.minimum(end, tl.min(tl.where(inside & (entry != base + (j - lo)), j, hi + 1), 0))
        return base, end

    @triton.jit
    def _full_blocks(q, KD, VD, k_base, v_base, desc0, TBL, b, stbl_b, BS, first, n_full, sk_s, sv_s, d, m_i, l_i,
                     acc, qk_scale, LOOKUP: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
        """The online softmax over ``n_full`` whole key blocks that every row sees, from slot
        ``first`` on (no masks in the hot loop): at storage slots ``first + blk * BLOCK_N``, or
        through the block table (LOOKUP)."""
        for blk in range(0, n_full):
            at = _slot(TBL, b, first + blk * BLOCK_N, stbl_b, BS, LOOKUP)
            k = _block(KD, k_base, desc0 + at.to(tl.int32), at, sk_s, d, True, TMA, BLOCK_N)
            v = _block(VD, v_base, desc0 + at.to(tl.int32), at, sv_s, d, False, TMA, BLOCK_N)
            m_i, l_i, acc = _softmax_update(tl.dot(q, k, input_precision=PRECISION), v, m_i, l_i, acc, qk_scale,
                                            False, PRECISION)
        return m_i, l_i, acc

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
                        HKV, M, G, N_TREE, CHUNK, MIN_CHUNK, N_SPLITS, TREE_FROM, CAP, BS, qk_scale,
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
        if PAGED:
            # whole blocks in runs of consecutive pool blocks (a prompt's, allocated in order; a
            # cached prefix's, then the blocks allocated after it) are read run by run at slot +
            # the run's offset, as dense rows are: no table load on the hot loop's critical path.
            # Runs shorter than 4 key blocks on average: through the table, a load a block
            stop = full + n_full * BLOCK_N
            hi = (stop - 1) // BS  # (n_full == 0: hi < the first block, nothing read)
            breaks = _breaks(TBL, b, stbl_b, full // BS, hi)
            if (breaks == 0) | ((breaks + 1) * 4 <= n_full):
                at = full
                for _ in range(0, breaks + 1):
                    base, end = _run_end(TBL, b, stbl_b, at // BS, hi)
                    n_run = (tl.minimum(end * BS, stop) - at) // BLOCK_N
                    m_i, l_i, acc = _full_blocks(q, KD, VD, k_base, v_base, desc0, TBL, b, stbl_b, BS,
                                                 at + (base - at // BS) * BS, n_run, sk_s, sv_s, d, m_i, l_i, acc,
                                                 qk_scale, False, TMA, BLOCK_N, PRECISION)
                    at += n_run * BLOCK_N
            else:
                m_i, l_i, acc = _full_blocks(q, KD, VD, k_base, v_base, desc0, TBL, b, stbl_b, BS, full, n_full,
                                             sk_s, sv_s, d, m_i, l_i, acc, qk_scale, True, TMA, BLOCK_N, PRECISION)
        else:
            m_i, l_i, acc = _full_blocks(q, KD, VD, k_base, v_base, desc0, TBL, b, stbl_b, BS, full, n_full, sk_s,
                                         sv_s, d, m_i, l_i, acc, qk_scale, False, TMA, BLOCK_N, PRECISION)
        m_i, l_i, acc = _masked_range(q, k_base, v_base, TBL, b, stbl_b, BS, sk_s, sv_s, full + n_full * BLOCK_N,
                                      any_end, row_start, row_end, d, m_i, l_i, acc, qk_scale, PAGED, BLOCK_N,
                                      PRECISION)  # the chunk's ragged end
        # the tree tokens (slots length .. length + N_TREE - 1) under the tree mask: block j in split
        # TREE_FROM + j modulo the splits from TREE_FROM on (the last split after a prefix's chunks;
        # a key block a program with no prefix)
        n_tree_blocks = tl.cdiv(N_TREE, BLOCK_N)
        tree_first = tl.where(split >= TREE_FROM, split - TREE_FROM, n_tree_blocks)
        tree_step = tl.maximum(N_SPLITS - TREE_FROM, 1)
        if tree_first < n_tree_blocks:
            for blk in range(tree_first, n_tree_blocks, tree_step):
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
