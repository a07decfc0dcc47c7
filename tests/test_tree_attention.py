"""The Triton hybrid tree-attention kernel (split-KV prefix + masked tree part + LSE merge)
against the pure-PyTorch reference: ragged lengths (0, 1, 17, long), tree sizes, GQA ratios,
head dims, broadcast and per-row masks, every output element written, no NaN. On a CPU the
kernels run in Triton's interpreter (float16 / float32); ``-m gpu`` repeats them in bfloat16."""
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")
from longspec.attention import reference  # noqa: E402
from longspec.attention.launch_plan import LONG_CHUNK, programs_per_sm, wide_head_tiles  # noqa: E402
from test_attention_reference import random_parents_mask  # noqa: E402
from longspec.attention.triton_kernels import (KernelConfig, masked_attention, merge_plan, plan,  # noqa: E402
                                               prefix_attention, tree_attention)

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)


def check(lengths, m, hq, hkv, d, dtype, device, capacity=None, broadcast=False, seed=0, pending=0, config=None,
          causal=False, window=None, table=None, plan_window=True, block=64):
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    n_tree = pending + m
    cap = capacity or max(lengths) + n_tree
    q = torch.randn(b, hq, m, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, cap, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, cap, d, generator=gen).to(dtype)
    lens = torch.tensor(lengths)
    masks = random_parents_mask(b, n_tree, gen)[:, pending:]  # the last M rows over P + M tree tokens
    if causal:  # a prefill chunk: query i sees tree tokens j <= i + P (the kernel is told, reads no mask)
        masks = (torch.arange(n_tree)[None, :] <= torch.arange(m)[:, None] + pending).expand(b, m, n_tree)
    starts = None
    if window is not None:  # a sliding window: queries at consecutive positions after the pending tokens
        # (causal), or tree queries at positions length + a random depth < 4 (their mask cut by the caller)
        depth = torch.arange(m) + pending if causal else torch.randint(0, 4, (m,), generator=gen)
        starts = lens[:, None] + depth[None, :] - window + 1  # [B, M]
        tree_slots = lens[:, None, None] + torch.arange(n_tree)[None, None, :]
        masks = masks & (tree_slots >= starts[..., None]) if causal else masks
    if broadcast:
        masks = masks[:1]
    rows = torch.arange(b)[:, None]
    slots = lens[:, None] + torch.arange(n_tree)[None, :]
    k_tree = k.transpose(1, 2)[rows, slots].transpose(1, 2)
    v_tree = v.transpose(1, 2)[rows, slots].transpose(1, 2)
    ref = reference.hybrid_attention(q.double(), k.double(), v.double(), lens, k_tree.double(), v_tree.double(),
                                     masks, starts)
    if table is not None:  # the rows' slots through a block table of `block`-slot blocks (shuffled) of one pool
        k, v = (paged_pool(x, table, block) for x in (k, v))
        table = table.to(device)
    ours = tree_attention(q.to(device), k.to(device), v.to(device), lens.to(device), masks.to(device), config,
                          causal=causal, table=table, block_size=block if table is not None else 0,
                          starts=None if starts is None else starts.to(device),
                          window=window if window is not None and plan_window else 0)
    assert ours.shape == (b, hq, m, d) and ours.dtype == dtype
    ours = ours.double().cpu()
    assert torch.isfinite(ours).all()
    err = (ours - ref).norm() / ref.norm()
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert err < tol, f"relative error {err:.2e}"


def paged_pool(x: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """Rows x [B, Hkv, S, D] written into a pool layer [Hkv, P, D] through ``table`` [B, S / block]."""
    b, hkv, s, d = x.shape
    pool = torch.full((hkv, (int(table.max()) + 1) * block, d), float("nan"), dtype=x.dtype)
    for row in range(b):
        for j, blk in enumerate(table[row].tolist()):
            pool[:, blk * block:(blk + 1) * block] = x[row, :, j * block:(j + 1) * block]
    return pool


CASES = [  # lengths, M, Hq, Hkv, D
    ([0], 1, 2, 2, 16),
    ([1], 1, 4, 1, 16),
    ([17], 5, 4, 1, 32),
    ([17, 0, 40], 3, 8, 2, 16),
    ([130, 3], 16, 4, 4, 16),
    ([300], 69, 2, 1, 16),
    ([4096], 16, 8, 1, 64),  # a long prefix over many splits, GQA 8
    ([5, 1, 0], 128, 4, 4, 128),  # a big tree, head_dim 128
]


@pytest.mark.parametrize("lengths,m,hq,hkv,d", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(lengths, m, hq, hkv, d, dtype):
    check(lengths, m, hq, hkv, d, dtype, "cuda" if ON_GPU else "cpu")


@pytest.mark.parametrize("lengths,m,hq,hkv,d,pending", [([0], 16, 2, 2, 16, 0), ([17, 0, 40], 33, 8, 2, 16, 0),
                                                        ([5, 1], 128, 3, 1, 16, 0), ([9], 20, 4, 4, 32, 7)])
@pytest.mark.parametrize("config", [None, KernelConfig(block_q=16, block_n=16)])
def test_causal_tree_part_equals_the_causal_mask(lengths, m, hq, hkv, d, pending, config):
    """A prefill chunk's tree part computed as lower-right causal (block skipping included: GQA
    tiles that span two query groups, small blocks, pending tokens before the chunk)."""
    check(lengths, m, hq, hkv, d, torch.float32, "cuda" if ON_GPU else "cpu", pending=pending, config=config,
          causal=True)


def test_broadcast_mask_pending_tokens_and_spare_capacity():
    """A [1, M, P+M] mask over P pending tree tokens, a cache larger than the rows need."""
    check([20, 45], 4, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", capacity=200, broadcast=True,
          pending=3)


def test_rows_that_see_nothing_get_zeros():
    """A tree row that sees no key at all (empty mask, empty prefix): zero output, no NaN."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 3, 16, generator=gen), torch.randn(2, 2, 8, 16, generator=gen)
    mask = torch.ones(2, 3, 3, dtype=torch.bool).tril()
    mask[1, 2] = False
    device = "cuda" if ON_GPU else "cpu"
    out = tree_attention(q.to(device), k.to(device), k.to(device), torch.tensor([4, 0], device=device),
                         mask.to(device)).cpu()
    assert torch.isfinite(out).all() and out[1, :, 2].abs().max() == 0 and out[0].abs().max() > 0


def test_lengths_outside_the_cache_never_read_outside_it():
    """A row length below 0 or past the capacity (a caller's bug) is clamped on the device: the
    kernel reads only cache slots, as if the length were 0 or the capacity."""
    gen = torch.Generator().manual_seed(2)
    device = "cuda" if ON_GPU else "cpu"
    q, k, v = (torch.randn(2, 4, 3, 16, generator=gen).to(device),
               torch.randn(2, 2, 8, 16, generator=gen).to(device), torch.randn(2, 2, 8, 16, generator=gen).to(device))
    mask = torch.ones(1, 3, 3, dtype=torch.bool, device=device).tril()
    bad = tree_attention(q, k, v, torch.tensor([-3, 1000], device=device), mask)
    clamped = tree_attention(q, k, v, torch.tensor([0, 8], device=device), mask)
    assert torch.isfinite(bad).all() and torch.equal(bad, clamped)


@pytest.mark.parametrize("config", [KernelConfig(block_q=16, block_n=32, programs=7),
                                    # (the tests above and below run this one too)
                                    pytest.param(KernelConfig(block_n=16, programs=64, min_chunk=16),
                                                 marks=pytest.mark.slow),
                                    KernelConfig(block_q=64, block_n=16, num_warps=2, programs=1),
                                    KernelConfig(block_n=16, programs=64, min_chunk=16, merge_elements=32),
                                    KernelConfig(block_n=16, programs=64, min_chunk=16, tma=True),
                                    KernelConfig(block_q=32, block_n=16, programs=1, tma=True),
                                    KernelConfig(block_q=32, block_n=16, programs=7, min_chunk=16, tma=True)])
def test_other_launch_configs_compute_the_same(config):
    """Launch parameters (as a tuning sweep tries them) change the tiling, never the result."""
    check([300, 17], 69, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", config=config)


def test_merge_plan_loads_every_part_within_the_budget():
    """The merge takes all the parts in one load where they fit the budget (many small programs),
    else the most that fit, looped; one part at a time in 16-row programs where those alone fill
    the device; a power of two of rows, at least one."""
    assert merge_plan(22, 174, 64, 4096, units=3) == (32, 2)
    assert merge_plan(16, 64, 128, 4096, units=8) == (16, 2)
    assert merge_plan(132, 4, 128, 4096) == (32, 1)  # looped: 5 passes of 32 parts
    assert merge_plan(3, 1, 256, 4096) == (4, 1)
    assert merge_plan(8, 256, 128, 4096, units=8, programs=132) == (1, 16)  # 128 programs of 16 rows
    assert merge_plan(8, 256, 128, 4096, units=8, programs=512) == (8, 4)
    for n_parts, rows, d in ((1, 1, 16), (7, 300, 32), (200, 16, 256)):
        parts, block_r = merge_plan(n_parts, rows, d, 4096)
        assert parts * block_r * d <= 4096 and block_r >= 1 and not parts & (parts - 1) and not block_r & (block_r - 1)


def test_programs_per_sm():
    """One program per multiprocessor, except small tiles over a cache so long that each would
    stream more than LONG_CHUNK keys: up to four, each a shorter chunk."""
    assert programs_per_sm(1 << 20, 8, 16) == 4 and programs_per_sm(1 << 19, 8, 16) == 2
    assert programs_per_sm(131072, 8, 16) == programs_per_sm(32768, 8, 32) == 1
    assert programs_per_sm(1 << 20, 16, 128) == 1 and programs_per_sm(1 << 24, 8, 16) == 4  # (trees; at most 4)
    for cap in (4096, 1 << 18, 1 << 20, 1 << 22):
        n = programs_per_sm(cap, 8, 16)
        assert cap / (n * 132 // 8) <= LONG_CHUNK or n == 4
    # a tree's 64-row tiles of heads of 64 dimensions: two programs where each of one would stream
    # WIDE_CHUNK keys or more (12 units: 11 programs per unit, 2048 keys -> 186 each: one)
    assert programs_per_sm(8192, 12, 64, 132, wide=True) == 2 and programs_per_sm(2048, 12, 64, 132, wide=True) == 1
    assert programs_per_sm(1 << 20, 40, 64, 132, wide=True) == 2 and programs_per_sm(1 << 20, 40, 64, 132) == 1
    # (wide: more than 64 packed rows of heads of at most 64 dimensions in 64-row tiles; 64 rows are not)
    assert wide_head_tiles(276, 64, 64) and not wide_head_tiles(64, 64, 64) and not wide_head_tiles(276, 128, 64)


def test_wide_trees_of_small_heads_take_64_row_tiles():
    """A tree's many rows (more than 64 packed rows) take 64-row tiles of 4 warps where heads have
    at most 64 dimensions, 128-row tiles of 8 warps at 128; decode's few rows as before."""
    from longspec.attention.launch_plan import tile_plan

    c = KernelConfig()
    assert tile_plan(c, 276, 64, 2)[0::2] == (64, 4) and tile_plan(c, 222, 32, 2)[0::2] == (64, 4)
    assert tile_plan(c, 276, 128, 2)[0::2] == (128, 8) and tile_plan(c, 4, 64, 2)[0] == 16
    assert tile_plan(KernelConfig(block_q=128), 276, 64, 2)[0] == 128  # (a config's own choice stands)


def test_plan_covers_the_capacity():
    for cap in (64, 1000, 8192, 131072):
        for units in (1, 16, 207):
            for min_chunk in (1, 128, 512):
                splits, chunk = plan(cap, units, 64, 132, min_chunk=min_chunk)
                assert splits * chunk >= cap and chunk % 64 == 0 and splits >= 1 and chunk >= min_chunk
                assert (splits - 1) * chunk < cap  # no split starts past the capacity
                assert splits * units <= max(132, units)  # one wave at most


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_rows_far_shorter_than_the_cache(causal, paged):
    """The split-KV chunks follow the keys a tile's rows see, not the capacity the launch was
    planned for: rows of 700, 65 and 0 keys in a cache of 2048 slots beside a full row, each
    spread over the splits (chunks of at least ``min_chunk``), tree or causal, contiguous or
    through a shuffled block table."""
    table = torch.randperm(4 * 32, generator=torch.Generator().manual_seed(3)).view(4, 32) if paged else None
    check([2030, 700, 65, 0], 9, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", capacity=2048,
          causal=causal, pending=2, table=table, config=KernelConfig(block_n=16, programs=64, min_chunk=32))


# (a causal chunk through a block table: test_causal_chunk_through_a_block_table)
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_paged_rows_in_runs_of_consecutive_blocks(causal):
    """Paged rows whose key blocks lie in runs of consecutive pool blocks (a split's chunk read
    run by run at an offset, no table load per key block) and partly not (through the table),
    chunk by chunk: a row in order, one in order but for two blocks swapped, one in reverse, one
    in two runs (a cached prefix, then blocks allocated elsewhere), one in four; small chunks
    (their few blocks with a break go through the table) and the default plan's; with TMA where
    the device has it."""
    runs = torch.arange(5 * 32).view(5, 32)
    runs[1, [10, 11]] = runs[1, [11, 10]]
    runs[2] = runs[2].flip(0)
    runs[3] = torch.cat([torch.arange(96, 112), torch.arange(170, 186)])
    runs[4] = torch.cat([torch.arange(112, 120), torch.arange(186, 196), torch.arange(120, 128), torch.arange(160, 166)])
    for config in (KernelConfig(block_n=16, programs=64, min_chunk=32), None):
        check([2030, 1500, 900, 2020, 1990], 9, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", capacity=2048,
              causal=causal, pending=2, table=runs, config=config)


def test_tree_masks_of_any_layout_and_dtype_give_the_same_output():
    """A bool mask is read in place (no copy per layer); a strided or int8 one is made contiguous."""
    gen = torch.Generator().manual_seed(4)
    device = "cuda" if ON_GPU else "cpu"
    q, k, v = (torch.randn(1, 4, 5, 16, generator=gen).to(device),
               torch.randn(1, 2, 40, 16, generator=gen).to(device), torch.randn(1, 2, 40, 16, generator=gen).to(device))
    mask = random_parents_mask(1, 5, gen).to(device)
    wide = torch.zeros(1, 5, 10, dtype=torch.bool, device=device)
    wide[..., ::2] = mask
    lengths = torch.tensor([30], device=device)
    want = tree_attention(q, k, v, lengths, mask)
    for other in (wide[..., ::2], mask.to(torch.int8)):
        assert torch.equal(tree_attention(q, k, v, lengths, other), want)


def test_bad_inputs_are_clear_errors():
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="tree mask"):
        tree_attention(q, k, k, torch.tensor([2]), torch.ones(1, 3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="dtypes"):
        tree_attention(q.half(), k, k, torch.tensor([2]), torch.ones(1, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="kernel config"):
        tree_attention(q, k, k, torch.tensor([2]), torch.ones(1, 2, 2, dtype=torch.bool), KernelConfig(block_n=48))
    with pytest.raises(ValueError, match="head_dim"):
        tree_attention(q[..., :12], k[..., :12], k[..., :12], torch.tensor([2]), torch.ones(1, 2, 2, dtype=torch.bool))


def dense_check(ours, q, k, v, mask, dtype):
    """ours against the float64 dense oracle; rows that see no key must be exact zeros."""
    ref = reference.dense_attention(q.double(), k.double(), v.double(), mask.expand(q.shape[0], -1, -1))[0]
    ref = ref.masked_fill(~mask.expand(q.shape[0], -1, -1).any(-1)[:, None, :, None], 0.0)
    ours = ours.double().cpu()
    assert ours.shape == q.shape and torch.isfinite(ours).all()
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert (ours - ref).norm() / ref.norm() < tol
    empty = ~mask.expand(q.shape[0], -1, -1).any(-1)
    assert ours.transpose(1, 2)[empty].abs().max() == 0 if empty.any() else True


# float16 with the default launch in the default run, with the others in the slow one
@pytest.mark.parametrize("dtype,config", [
    *((torch.float32, c) for c in (None, KernelConfig(block_n=16, programs=64, min_chunk=16),
                                   KernelConfig(block_q=16, block_n=16, programs=1))),
    (torch.float16, None),
    *(pytest.param(torch.float16, c, marks=pytest.mark.slow) for c in (
        KernelConfig(block_n=16, programs=64, min_chunk=16), KernelConfig(block_q=16, block_n=16, programs=1)))])
def test_prefix_attention_with_per_query_limits(dtype, config):
    """The draft's cross-attention: query i of row b sees slots below limits[b, i] (lags differ
    within a tile, so chunks end in masked blocks); limit 0 -> zeros; limits past the cache are
    clamped to it."""
    gen = torch.Generator().manual_seed(5)
    device = "cuda" if ON_GPU else "cpu"
    b, hq, hkv, m, s, d = 3, 8, 2, 6, 700, 32
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((b, hq, m, d), (b, hkv, s, d), (b, hkv, s, d)))
    limits = torch.tensor([[699, 698, 650, 640, 3, 1], [0, 0, 17, 129, 130, 64], [900, 700, 0, 513, 511, 512]])
    mask = torch.arange(s)[None, None, :] < limits.clamp(max=s)[..., None]
    ours = prefix_attention(q.to(device), k.to(device), v.to(device), limits.to(device), config)
    dense_check(ours, q, k, v, mask, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("broadcast", [False, True])
def test_masked_attention_over_a_ring_buffer(dtype, broadcast):
    """The draft's ring-buffer self-attention: any [B or 1, M, S] mask, rows that see nothing
    get zeros, GQA 4, every output written."""
    gen = torch.Generator().manual_seed(6)
    device = "cuda" if ON_GPU else "cpu"
    b, hq, hkv, m, s, d = 2, 8, 2, 9, 150, 16
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((b, hq, m, d), (b, hkv, s, d), (b, hkv, s, d)))
    mask = torch.rand(1 if broadcast else b, m, s, generator=gen) < 0.3
    mask[0, 4] = False
    ours = masked_attention(q.to(device), k.to(device), v.to(device), mask.to(device))
    dense_check(ours, q, k, v, mask, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("config", [KernelConfig(tma=True), KernelConfig(tma=False),
                                    KernelConfig(tma=True, block_n=128, num_stages=2)])
def test_kernel_options_bfloat16_on_gpu(config):
    """TMA loads on and off on the GPU (a 69-token tree x 4 heads: 2 full 128-row tiles + 20
    rows)."""
    check([4096, 17, 1], 69, 32, 8, 128, torch.bfloat16, "cuda", config=config)
    check([5000], 16, 32, 8, 128, torch.bfloat16, "cuda", config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("d,dtype,three,turns", [
    (128, torch.bfloat16, True, True), (64, torch.bfloat16, True, True), (64, torch.bfloat16, True, False),
    (64, torch.bfloat16, False, True), (128, torch.float16, True, True)])
@pytest.mark.parametrize("block", [0, 64, 256])
def test_hopper_tree_kernel_on_gpu(monkeypatch, d, dtype, three, turns, block):
    """A tree of 69 nodes x 4 query heads a KV head (276 rows: the warp-specialized Hopper kernel
    takes the prefix's whole 128-key blocks and, masked, the keys after them and the tree's)
    against the reference: rows with a ragged end, one shorter than a key block, an empty one, one
    of whole blocks, dense or through a shuffled table of 64- or 256-slot blocks (TMA pieces of 64
    or 128 rows); a tree ending at the cache's last slot (its masked block past the row's table or
    the cache's end), of more tokens than queries, its mask shared by the rows. Heads
    of 128: two consumers, the last tile's 20 rows in one, the other keeping the turns; of 64:
    three consumers (the second tile's 84 rows: one full, one of 20, one spare) taking turns at
    the tensor cores (the default) or running free (``turns`` off), or two (``three`` off)."""
    from longspec.attention import hopper_tree

    monkeypatch.setattr(hopper_tree, "THREE_CONSUMERS", three)
    monkeypatch.setattr(hopper_tree, "PINGPONG_THREE", turns)

    q = torch.empty(1, 32, 69, d, dtype=dtype, device="cuda")
    if not hopper_tree.applies(q, q, q, 4 * 69, block):
        pytest.skip("the warp-specialized kernel runs on Hopper GPUs only")
    calls, real = [], hopper_tree.tree_parts
    monkeypatch.setattr(hopper_tree, "tree_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    lengths, cap = [5000, 127, 0, 1280], 5120 + 256
    table = None
    if block:
        table = torch.randperm(4 * cap // block, generator=torch.Generator().manual_seed(1)).view(4, cap // block)
    check(lengths, 69, 32, 8, d, dtype, "cuda", capacity=cap, table=table, block=block or 64,
          config=KernelConfig(hopper=True))
    assert calls, "the Hopper kernel was not used"
    check([3000], 69, 32, 8, d, dtype, "cuda", config=KernelConfig(hopper=True))
    block = block or 64
    cap = 5056 // block * block
    table = torch.randperm(2 * cap // block, generator=torch.Generator().manual_seed(2)).view(2, cap // block)
    check([3000, cap - 79], 69, 32, 8, d, dtype, "cuda", capacity=cap, table=table, block=block, pending=10,
          broadcast=True, config=KernelConfig(hopper=True))
    assert len(calls) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_the_hopper_path_replays_in_a_cuda_graph():
    """The Hopper kernel, the Triton kernel's part after its whole blocks and the merge, captured
    in a CUDA graph and replayed over new inputs copied into the captured ones (a shorter row: a
    new split of its whole blocks and a new tail), give the eager call's output for those."""
    from longspec.attention import hopper_tree

    gen = torch.Generator(device="cuda").manual_seed(3)

    def inputs():
        q = torch.randn(1, 32, 69, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
        k, v = (torch.randn(1, 8, 4200 + 69, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
                for _ in range(2))
        tree = torch.rand(1, 69, 69, device="cuda", generator=gen).lt(0.5).tril()
        return q, k, v, tree | torch.eye(69, dtype=torch.bool, device="cuda")

    q, k, v, tree = inputs()
    if not hopper_tree.applies(q, q, q, 4 * 69, 0):
        pytest.skip("the warp-specialized kernel runs on Hopper GPUs only")
    lengths = torch.tensor([4200], device="cuda")
    config = KernelConfig(hopper=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as a capture wants
        tree_attention(q, k, v, lengths, tree, config)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tree_attention(q, k, v, lengths, tree, config)
    for x, new in zip((q, k, v, tree), inputs()):
        x.copy_(new)
    lengths.fill_(3100)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, tree_attention(q, k, v, lengths, tree, config))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_prefix_and_masked_kernels_bfloat16_on_gpu():
    test_prefix_attention_with_per_query_limits(torch.bfloat16, None)
    test_masked_attention_over_a_ring_buffer(torch.bfloat16, False)


@pytest.mark.parametrize("dtype,logit", [(torch.float16, -20.0), (torch.float32, -120.0)])
def test_a_row_that_sees_nothing_in_its_first_block_keeps_its_later_keys(dtype, logit):
    """A query whose visible keys all lie past the first key block, with scores far below 0
    (a ring-buffer row after wrap-around): the running max of the empty block must not be carried
    on as 0, or the later scores underflow and the row comes out as zeros."""
    gen = torch.Generator().manual_seed(8)
    device = "cuda" if ON_GPU else "cpu"
    b, hq, hkv, m, s, d = 1, 2, 1, 3, 150, 16
    q = torch.zeros(b, hq, m, d)
    q[..., 0] = d ** 0.5  # q . k / sqrt(d) = k[..., 0]
    k = torch.randn(b, hkv, s, d, generator=gen)
    k[..., 0] = logit + 0.5 * torch.randn(b, hkv, s, generator=gen)
    v = torch.randn(b, hkv, s, d, generator=gen)
    mask = torch.zeros(1, m, s, dtype=torch.bool)
    mask[:, :, 100:110] = True
    mask[0, 1, 5] = True  # one row also sees a key of the first block
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    ours = masked_attention(q.to(device), k.to(device), v.to(device), mask.to(device))
    dense_check(ours, q, k, v, mask, dtype)


@pytest.mark.parametrize("programs", [64, 1])
def test_ragged_tiles_through_every_path(programs):
    """36 packed rows in 32-row tiles (a full tile and one of 4 rows) through the tree,
    per-query-limit and masked paths: ragged limits, pending tree tokens, a row that sees nothing."""
    config = KernelConfig(block_q=32, block_n=16, programs=programs, min_chunk=16)
    device = "cuda" if ON_GPU else "cpu"
    check([90, 33], 9, 8, 2, 16, torch.float32, device, pending=2, config=config)
    gen = torch.Generator().manual_seed(9)
    b, hq, hkv, m, s, d = 2, 8, 2, 9, 200, 16
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, hq, m, d), (b, hkv, s, d), (b, hkv, s, d)))
    limits = torch.tensor([[199, 3, 0, 150, 151, 17, 64, 65, 200], [1, 2, 3, 4, 5, 6, 7, 8, 0]])
    ours = prefix_attention(q.to(device), k.to(device), v.to(device), limits.to(device), config)
    dense_check(ours, q, k, v, torch.arange(s)[None, None, :] < limits[..., None], torch.float32)
    mask = torch.rand(b, m, s, generator=gen) < 0.2
    mask[1, 8] = False
    ours = masked_attention(q.to(device), k.to(device), v.to(device), mask.to(device), config)
    dense_check(ours, q, k, v, mask, torch.float32)


@pytest.mark.parametrize("config", [KernelConfig(block_n=16, programs=8, min_chunk=16),
                                    KernelConfig(block_q=32, block_n=16, programs=8, min_chunk=16, tma=True)])
def test_unmasked_loops_of_many_blocks_per_split(config):
    """Unmasked loops of many blocks in each of several splits (their partials merged), ragged
    rows, scores climbing along the prefix, and per-query limits long enough to reach the
    unmasked loop."""
    device = "cuda" if ON_GPU else "cpu"
    check([2048, 1000, 0], 9, 8, 2, 16, torch.float32, device, pending=1, config=config)
    _growing_max(config)
    gen = torch.Generator().manual_seed(11)
    b, hq, hkv, m, s, d = 2, 8, 2, 9, 900, 16
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, hq, m, d), (b, hkv, s, d), (b, hkv, s, d)))
    limits = torch.randint(150, 900, (b, m), generator=gen)
    ours = prefix_attention(q.to(device), k.to(device), v.to(device), limits.to(device), config)
    dense_check(ours, q, k, v, torch.arange(s)[None, None, :] < limits[..., None], torch.float32)


def _growing_max(config):
    """Scores that climb along the prefix (by ~230 in log2 units over 300 keys): the running max
    must move with them (and the output be rescaled), or exp2 overflows."""
    gen = torch.Generator().manual_seed(10)
    device = "cuda" if ON_GPU else "cpu"
    b, hq, hkv, m, cap, d = 1, 4, 2, 5, 320, 16
    q = torch.zeros(b, hq, m, d)
    q[..., 0] = d ** 0.5
    k = torch.randn(b, hkv, cap, d, generator=gen)
    k[..., 0] = torch.linspace(-10.0, 150.0, cap) + torch.randn(cap, generator=gen)  # q.k / sqrt(d) = k[..., 0]
    v = torch.randn(b, hkv, cap, d, generator=gen)
    lengths = torch.tensor([300])
    mask = torch.ones(1, m, m, dtype=torch.bool).tril()
    ours = tree_attention(q.to(device), k.to(device), v.to(device), lengths.to(device), mask.to(device), config)
    visible = torch.cat([torch.ones(1, m, 300, dtype=torch.bool), mask, torch.zeros(1, m, cap - 300 - m, dtype=torch.bool)], -1)
    dense_check(ours, q, k, v, visible, torch.float32)


def test_prefix_and_masked_attention_reject_bad_shapes():
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="limits"):
        prefix_attention(q, k, k, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="limits"):
        prefix_attention(q, k, k, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="mask"):
        masked_attention(q, k, k, torch.ones(1, 2, 7, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("lengths,m,hq,hkv,d", CASES + [([4096, 17, 1], 128, 32, 8, 128), ([32768], 64, 32, 8, 128)])
def test_kernel_bfloat16_on_gpu(lengths, m, hq, hkv, d):
    check(lengths, m, hq, hkv, d, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("m,hq,hkv", [(256, 9, 3), (1024, 9, 3), (128, 32, 8)])
def test_causal_tree_part_bfloat16_on_gpu(m, hq, hkv):
    check([0, 300], m, hq, hkv, 64, torch.bfloat16, "cuda", causal=True)



@pytest.mark.parametrize("m", [1, 5, 69])
@pytest.mark.parametrize("outside", [False, True])
def test_store_kernel_writes_what_indexing_writes(m, outside):
    """One launch writes K and V at per-row slots as ``cache.store_kv``'s indexed copies do
    (V in another layout: a transposed view, as a qkv split gives); a slot outside the cache
    (-1, or the capacity) is skipped, nothing else written."""
    from longspec.attention.kv_store import store_fits, store_kv

    gen = torch.Generator().manual_seed(m)
    device = "cuda" if ON_GPU else "cpu"
    b, hkv, s, d = 3, 2, 100, 16
    k_cache, v_cache = (torch.randn(b, hkv, s, d, generator=gen).to(device) for _ in range(2))
    k_new = torch.randn(b, hkv, m, d, generator=gen).to(device)
    v_new = torch.randn(b, m, hkv, d, generator=gen).to(device).transpose(1, 2)
    slots = torch.tensor([0, 7, s - m], device=device)[:, None] + torch.arange(m, device=device)[None, :]
    if outside:
        slots[0, 0], slots[2, -1] = -1, s
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for r in range(b):
        for j in range(m):
            if 0 <= slots[r, j] < s:
                want_k[r, :, slots[r, j]], want_v[r, :, slots[r, j]] = k_new[r, :, j], v_new[r, :, j]
    assert store_fits(k_cache, v_cache, k_new, v_new)
    store_kv(k_cache, v_cache, k_new, v_new, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_the_store_kernel_is_compiled_once_whatever_the_prompt_length():
    """The store kernel does not specialise on what changes with a prompt's length (its row
    count, the batch strides of its pieces and their slots): a first long prompt of a new length
    compiles nothing. Checked on the compiled kernel (outside the interpreter the tests run in)."""
    import subprocess
    import sys

    code = ("from longspec.attention.kv_store import _store_kv_kernel as k; "
            "print(sorted(p.name for p in k.params if p.do_not_specialize))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split("\n")[-2] == str(sorted(["M", "ss_b", "skn_b", "svn_b"]))


def test_tma_loads_by_default_for_full_tiles_on_hopper(monkeypatch):
    """The default config loads K/V through TMA descriptors for a tree's full tiles on Hopper or
    newer (faster there), not for smaller tiles (decode); the result is the same either way."""
    from longspec.attention import triton_kernels

    monkeypatch.setattr(triton_kernels, "_tma_hardware", lambda device: True)  # as on an H100 / H200
    described = []
    make = triton_kernels._descriptors
    monkeypatch.setattr(triton_kernels, "_descriptors", lambda *a: described.append(a) or make(*a))
    device = "cuda" if ON_GPU else "cpu"
    check([300, 17], 32, 8, 2, 16, torch.float32, device)  # 4 heads x 32 queries: two 64-row tiles (16 dims)
    assert len(described) == 2  # K and V
    check([300, 17], 4, 8, 2, 16, torch.float32, device)  # 16 rows
    check([300, 17], 32, 8, 2, 16, torch.float32, device, config=KernelConfig(tma=False))
    assert len(described) == 2


WINDOW_CASES = [  # lengths, M, Hq, Hkv, D, window
    ([40, 0, 7], 3, 4, 2, 16, 8),  # the window inside one key block, a row shorter than it, an empty row
    ([300, 129], 5, 8, 2, 32, 64),  # windows across key blocks and splits (ragged starts in a tile)
    ([1000], 16, 4, 1, 16, 100),  # most key blocks below the window (skipped)
    ([700, 64], 2, 4, 1, 256, 130),  # head_dim 256 (Gemma 3)
]


@pytest.mark.parametrize("lengths,m,hq,hkv,d,window", WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_tree_matches_reference(lengths, m, hq, hkv, d, window, dtype):
    """Per-query window starts over the prefix (tree queries at different depths), every split and
    block layout, several launch configs."""
    device = "cuda" if ON_GPU else "cpu"
    for config in (None, KernelConfig(block_q=16, block_n=16, programs=8, min_chunk=16)):
        for plan_window in (False, True):  # splits over the whole cache, or over one window's span
            check(lengths, m, hq, hkv, d, dtype, device, window=window, config=config, seed=len(lengths),
                  plan_window=plan_window)


@pytest.mark.parametrize("lengths,m,pending,window", [([0], 40, 0, 8), ([37, 100], 33, 0, 16), ([9], 70, 5, 7),
                                                      ([300], 64, 0, 200)])
@pytest.mark.parametrize("config", [None, KernelConfig(block_q=16, block_n=16)])
def test_sliding_window_causal_chunk(lengths, m, pending, window, config):
    """A prefill chunk of a sliding-window layer: the window cuts the prefix and the chunk itself
    (chunks longer than the window; tree blocks wholly below a tile's window are skipped)."""
    for plan_window in (False, True):
        check(lengths, m, 4, 2, 32, torch.float32, "cuda" if ON_GPU else "cpu", pending=pending, config=config,
              causal=True, window=window, plan_window=plan_window)


@pytest.mark.parametrize("causal,m", [(False, 5), (True, 24)])
def test_a_window_splits_only_its_span_of_a_long_cache(monkeypatch, causal, m):
    """With ``window`` the split-KV plan covers one window's span from each tile's lowest start,
    not the cache (the cost of a sliding layer stays flat in context): the output is the
    reference's over a long cache split into many parts, and the plan was given the span."""
    from longspec.attention import triton_kernels

    spans = []
    real_plan = triton_kernels.plan
    monkeypatch.setattr(triton_kernels, "plan", lambda span, *a: spans.append(span) or real_plan(span, *a))
    config = KernelConfig(block_q=16, block_n=16, programs=64, min_chunk=16)
    check([3000, 1234], m, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", window=40, config=config,
          causal=causal, seed=5)
    assert spans == [40 + m + 16]


def test_sliding_window_through_a_block_table():
    """Paged rows (shuffled 64-slot blocks) with a window: the skipped and partly seen blocks are
    found through the table."""
    table = torch.tensor([[5, 0, 3, 7, 1], [2, 6, 4, 8, 9]])
    check([250, 90], 4, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", capacity=320, window=70,
          table=table, config=KernelConfig(programs=4))


@pytest.mark.parametrize("window", [None, 50])
def test_causal_chunk_through_a_block_table(window):
    """A prefill chunk after cached tokens (a prefix-cache hit) in paged rows: the chunk's own
    slots, which it reads as prefix, are found through the table too."""
    table = torch.tensor([[5, 0, 3, 7, 1], [2, 6, 4, 8, 9]])
    check([130, 0], 100, 4, 2, 16, torch.float32, "cuda" if ON_GPU else "cpu", capacity=320, causal=True,
          pending=3, window=window, table=table, config=KernelConfig(programs=4, block_q=16, block_n=16))


def test_a_window_that_does_not_cut_changes_nothing():
    """Starts at or below 0 (a window longer than the context) give the plain kernel's output."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 3, 16, generator=gen), torch.randn(2, 2, 50, 16, generator=gen), \
        torch.randn(2, 2, 50, 16, generator=gen)
    lens, mask = torch.tensor([40, 12]), torch.ones(1, 3, 3, dtype=torch.bool).tril()
    plain = tree_attention(q, k, v, lens, mask)
    cut = tree_attention(q, k, v, lens, mask, starts=torch.tensor([[0, -5, 0], [-100, 0, 0]]))
    assert torch.equal(plain, cut)
    with pytest.raises(ValueError, match="starts"):
        tree_attention(q, k, v, lens, mask, starts=torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("elem", [2, 4])
def test_tiles_fit_the_shared_memory_of_a_hopper_block(d, elem):
    """Every launch's tiles, for any number of rows and the default and benchmarked configs, fit
    the 227 KB of shared memory a block has on the H200 (estimate of the tiles plus Triton's
    pipeline buffers) and keep the float32 accumulator within 64 registers per thread."""
    from longspec.attention.triton_kernels import (ACC_ELEMENTS_PER_THREAD, DEFAULT_CONFIG, SHARED_MEMORY_BUDGET,
                                                   shared_memory_bytes, tile_plan)

    assert SHARED_MEMORY_BUDGET <= 227 * 1024
    for config in (DEFAULT_CONFIG, KernelConfig(block_q=128), KernelConfig(block_n=128, num_stages=4)):
        for rows in (1, 4, 16, 64, 100, 256, 1024):
            block_q, block_n, warps, stages = tile_plan(config, rows, d, elem)
            assert shared_memory_bytes(block_q, block_n, d, elem, stages or 3) <= SHARED_MEMORY_BUDGET
            assert block_q * d <= warps * 32 * ACC_ELEMENTS_PER_THREAD
            assert block_q >= 16 and block_n >= 16 and not block_n & (block_n - 1)
            if d <= 128 and elem == 2 and config is DEFAULT_CONFIG:  # unchanged where it always fitted
                assert (block_n, stages) == (64, 0)


def test_a_hopper_kernel_that_fails_to_build_leaves_the_triton_kernel(monkeypatch):
    """Gluon's API moves between Triton releases: where the Hopper kernel fails to build, one
    warning says so and the Triton kernel alone computes the launch, and every later one."""
    from longspec.attention import hopper_tree

    monkeypatch.setattr(hopper_tree, "_failed", [])
    monkeypatch.setattr(hopper_tree, "applies", lambda *args: not hopper_tree._failed)
    tries = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise triton.CompilationError("kernel.py", None, "no such builtin")

    monkeypatch.setattr(hopper_tree, "tree_parts", broken)
    device = "cuda" if ON_GPU else "cpu"
    with pytest.warns(UserWarning, match="Hopper attention kernel failed"):
        check([300, 40], 9, 4, 2, 16, torch.float32, device, config=KernelConfig(hopper=True))
    check([300, 40], 9, 4, 2, 16, torch.float32, device, config=KernelConfig(hopper=True))
    assert len(tries) == 1


def hopper_parts_by_the_reference(q, k_cache, v_cache, lengths, tree_mask, o_part, lse_part, n_splits, qk_scale,
                                  table=None, block_size=0):
    """``hopper_tree.tree_parts`` by the reference attention, part by part: part s the rows'
    attention over key blocks ``s * per ..`` of ``per = cdiv(cdiv(length + N, BLOCK_N), n_splits)``
    (the prefix's keys below the length seen by every query, the tree's N tokens after it by the
    mask; the kernel's split of a row's blocks); dense caches [B, Hkv, S, D] or a pool layer
    [Hkv, P, D] read through ``table`` [B, blocks]."""
    from longspec.attention import hopper_tree
    from longspec.attention.paged import rows_of

    b, hq, m, d = q.shape
    if table is not None:
        k_cache, v_cache = (rows_of(x, table, block_size, None, 0, table.shape[1] * block_size)
                            for x in (k_cache, v_cache))
    hkv, cap, n_tree = k_cache.shape[1], k_cache.shape[2], tree_mask.shape[2]
    blk = hopper_tree.BLOCK_N
    slots = torch.arange(cap, device=q.device)
    for row in range(b):
        length = min(max(int(lengths[row]), 0), cap)
        per = math.ceil(math.ceil((length + n_tree) / blk) / n_splits)  # blocks a split
        tree = tree_mask[min(row, tree_mask.shape[0] - 1)].bool()  # [M, N]
        j = (slots - length).clamp(0, n_tree - 1)
        seen = (slots < length)[None, :] | ((slots >= length) & (slots < length + n_tree))[None, :] & tree[:, j]
        for s in range(n_splits):
            part = seen & (slots >= s * per * blk)[None, :] & (slots < (s + 1) * per * blk)[None, :]
            o, lse = reference.dense_attention(q[row:row + 1].double(), k_cache[row:row + 1].double(),
                                               v_cache[row:row + 1].double(), part[None])
            lse = lse.reshape(1, hkv, hq // hkv * m)
            o_part[row, :, s] = torch.nan_to_num(o.reshape(1, hkv, hq // hkv * m, d))[0].to(o_part.dtype)
            lse_part[row, :, s] = (lse * math.log2(math.e))[0].to(lse_part.dtype)  # the kernels' LSE: base 2


@pytest.mark.parametrize("nodes,pending,paged", [(21, 0, False), (69, 0, True), (40, 30, False), (128, 0, False)])
def test_the_hopper_path_merges_its_parts(monkeypatch, nodes, pending, paged):
    """The Hopper path of the launch (the kernel by the reference here: it runs on Hopper GPUs
    only): the tree mask handed over, its parts (splits of each row's key blocks, empty ones
    among them) merged into the reference's output: rows with a ragged end, shorter than a
    block, empty, of whole blocks; trees of one block of up to 128 tokens, of more tokens than
    queries; dense rows or through a shuffled table."""
    from longspec.attention import hopper_tree

    monkeypatch.setattr(hopper_tree, "applies", lambda *args: True)
    monkeypatch.setattr(hopper_tree, "tree_parts", hopper_parts_by_the_reference)
    monkeypatch.setattr(hopper_tree, "split_plan", lambda *args: 3)
    device = "cuda" if ON_GPU else "cpu"
    lengths, cap, table = [300, 127, 0, 256], 512, None
    if paged:
        table = torch.randperm(4 * cap // 64, generator=torch.Generator().manual_seed(2)).view(4, cap // 64)
    check(lengths, nodes, 4, 2, 16, torch.float32, device, capacity=cap, table=table, pending=pending,
          config=KernelConfig(hopper=True))


def test_the_hopper_kernel_serves_a_tree_by_default_over_long_caches(monkeypatch):
    """KernelConfig's default (hopper=None): the Hopper kernel takes a tree over a cache
    of hopper_tree.MIN_KEYS keys or more (where it was measured faster), for one row or a batch,
    at heads of 128 for more than two 128-row tiles, the Triton kernel alone the rest (shorter
    caches, fewer rows at heads of 128, trees of more than 128 tokens); hopper=False never runs it."""
    from longspec.attention import hopper_tree

    monkeypatch.setattr(hopper_tree, "applies", lambda *args: True)

    def ran(*args, **kwargs):
        raise LookupError("the Hopper kernel ran")

    monkeypatch.setattr(hopper_tree, "tree_parts", ran)
    device = "cuda" if ON_GPU else "cpu"
    long, short = hopper_tree.MIN_KEYS, hopper_tree.MIN_KEYS // 8
    check([300], 9, 4, 2, 16, torch.float32, device, capacity=short, config=KernelConfig())
    check([300], 9, 4, 2, 16, torch.float32, device, capacity=long, config=KernelConfig(hopper=False))
    for lengths in ([300], [300, 40]):
        with pytest.raises(LookupError):
            check(lengths, 9, 4, 2, 16, torch.float32, device, capacity=long, config=KernelConfig())
    # heads of 128 (hopper_tree.pays): two of the Triton kernel's 128-row tiles (64 nodes x 4 heads)
    # stay with it, three (69 nodes) go to the Hopper kernel
    monkeypatch.setattr(hopper_tree, "MIN_KEYS", 512)
    check([300], 64, 8, 2, 128, torch.float32, device, capacity=512, config=KernelConfig())
    with pytest.raises(LookupError):
        check([300], 69, 8, 2, 128, torch.float32, device, capacity=512, config=KernelConfig())
    # a tree of more than BLOCK_N tokens (the kernel's tree mask: four 32-bit words a row): the Triton kernel
    check([300], 69, 8, 2, 128, torch.float32, device, capacity=512, pending=60, config=KernelConfig(hopper=True))


def test_the_hopper_kernel_never_takes_rows_with_window_starts(monkeypatch):
    """The Hopper kernel reads every whole block from slot 0: rows whose queries start later (a
    sliding window's starts, with or without a planned window) stay with the Triton kernel."""
    from longspec.attention import hopper_tree

    monkeypatch.setattr(hopper_tree, "applies", lambda *args: True)
    monkeypatch.setattr(hopper_tree, "tree_parts", lambda *args, **kwargs: pytest.fail("the Hopper kernel ran"))
    device = "cuda" if ON_GPU else "cpu"
    for plan_window in (True, False):
        check([300, 40], 5, 4, 2, 16, torch.float32, device, window=64, plan_window=plan_window,
              config=KernelConfig(hopper=True))
