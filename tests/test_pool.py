"""The KV block pool: allocation, release and exhaustion; the attention kernels reading K/V through
a block table against the dense cache; engines over a small shared pool (rows of very different
lengths in one batch) giving plain decoding's tokens for every proposer."""
from __future__ import annotations

import pytest
import torch

from longspec import GenerationConfig, load_target
from longspec.attention import reference
from longspec.attention.paged import physical_slots, rows_of
from longspec.attention.triton_kernels import available, prefix_attention, tree_attention
from longspec.kv.cache import BlockPool, PoolExhausted
from longspec.engine.engine import Engine, Sequence
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft

TRITON = [pytest.param("triton", marks=pytest.mark.skipif(not available(), reason="needs triton"))]


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("pool-llama", "llama", max_position_embeddings=512, seed=5)[1]


@pytest.fixture(scope="module")
def target(path):
    return load_target(path)


def test_pool_allocates_home_runs_then_scattered_blocks_and_refuses_past_its_size(target):
    pool = BlockPool(target.config, num_blocks=8, block_size=4)
    assert pool.allocate(3, prefer=2) == [2, 3, 4]
    assert pool.allocate(2) == [0, 1]  # the lowest run of two
    assert pool.allocate(2, prefer=4) == [5, 6]  # home taken: the lowest run
    pool.release([0, 3])  # (3 was never given out alone: blocks are returned one by one)
    assert pool.allocate(2) == [0, 3] and pool.num_free == 1  # no run of two left: scattered
    with pytest.raises(PoolExhausted, match="2 blocks of 4 tokens needed, 1 of 8 free"):
        pool.allocate(2)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release([7, 7])
    assert pool.scratch == 8 and pool.k.shape[2] == 9 * 4  # the scratch block is never handed out


def test_pool_size_defaults_to_every_row_and_on_cuda_to_half_the_free_memory(target, monkeypatch):
    """An engine's default pool holds every row's slots; on CUDA at most half the memory free now
    (the smallest budget over tensor-parallel ranks, at least one block); a given size rounds up
    to whole blocks."""
    import longspec.kv.cache as cache

    config, dtype = target.cache_config, torch.float32
    assert cache.pool_blocks(config, dtype, "cpu", 3, 64, 16) == 12
    assert cache.pool_blocks(config, dtype, "cpu", 3, 64, 16, pool_tokens=33) == 3
    monkeypatch.setattr(cache, "free_memory", lambda device: 2 * 100 * cache.token_bytes(config, dtype))
    assert cache.pool_blocks(config, dtype, "cuda", 1, 64, 16) == 4  # 100 tokens free: one row fits
    assert cache.pool_blocks(config, dtype, "cuda", 3, 64, 16) == 7  # three do not: 100 tokens

    class Ranks:
        def __init__(self, other):
            self.other = other

        def gather_objects(self, budget):
            return [budget, self.other]

    assert cache.pool_blocks(config, dtype, "cuda", 3, 64, 16, tp=Ranks(40)) == 3  # the other rank's 40
    assert cache.pool_blocks(config, dtype, "cuda", 3, 64, 16, tp=Ranks(5)) == 1  # at least one block


def test_rows_over_a_shared_pool_compute_what_dense_rows_do(target):
    """Prefill, a verified tree and its commit on rows whose blocks are scattered over a shared
    pool give the logits and K/V of a cache that owns one dense block per row."""
    torch.manual_seed(0)
    dense = target.new_cache(3, 48)
    pool = BlockPool(target.config, num_blocks=17, block_size=8)  # under 3 rows x 6 blocks: paged
    paged = target.new_cache(3, 48, pool=pool)
    pool.allocate(5)  # the rows' blocks do not start at the pool's start
    for row, n in enumerate((40, 9, 25)):
        paged.assign(row, n + 6)
    assert not paged.dense and len(set(sum(paged.blocks, []))) == sum(len(b) for b in paged.blocks)
    lens = torch.tensor([37, 3, 20])
    ids = torch.randint(0, 160, (3, 37))
    for cache in (dense, paged):
        cache.lengths.zero_()
    first = [target.prefill(ids, lens, c) for c in (dense, paged)]
    torch.testing.assert_close(first[0], first[1], atol=1e-5, rtol=1e-5)
    tokens = torch.randint(0, 160, (3, 4))
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None]
    positions = lens[:, None] + torch.tensor([0, 1, 1, 2])
    for impl in ["sdpa", "reference", "matmul"]:
        target.attention_impl = impl
        out = [target.verify(tokens, positions, mask, c, n_keys=48 if impl == "matmul" else None) for c in (dense, paged)]
        torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)
        for c in (dense, paged):
            c.discard()
    target.attention_impl = "sdpa"
    for c in (dense, paged):
        target.verify(tokens, positions, mask, c)
        c.commit(torch.tensor([[0, 1, 3, 0], [0, 2, 0, 0], [0, 0, 0, 0]]), torch.tensor([3, 2, 1]))
    assert torch.equal(dense.lengths, paged.lengths)
    for layer in range(target.config.num_layers):
        for a, b in zip(dense.layer(layer).dense(41), paged.layer(layer).dense(41)):
            for row, n in enumerate(dense.lengths.tolist()):
                torch.testing.assert_close(a[row, :, :n], b[row, :, :n], atol=1e-5, rtol=1e-5)
    for row in range(3):
        paged.unassign(row)
    assert pool.num_free == 12 and (paged.table == pool.scratch).all()


@pytest.mark.parametrize("impl", TRITON)
@pytest.mark.parametrize("lengths,m,hq,hkv,d", [([0], 1, 2, 2, 16), ([130, 3, 64], 5, 4, 1, 16),
                                                ([300, 17], 16, 8, 2, 32)])
def test_triton_kernels_read_through_the_block_table(impl, lengths, m, hq, hkv, d):
    """The split-KV tree kernel and the per-query-limit prefix kernel over a pool layer read
    through a shuffled block table == the reference over the rows gathered into a dense cache."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(sum(lengths) + m)
    b, bs = len(lengths), 64
    blocks_per_row = -(-(max(lengths) + m) // bs)
    n_blocks = b * blocks_per_row + 3
    table = torch.randperm(n_blocks, generator=gen)[:b * blocks_per_row].view(b, blocks_per_row)
    k_pool = torch.randn(hkv, (n_blocks + 1) * bs, d, generator=gen)
    v_pool = torch.randn(hkv, (n_blocks + 1) * bs, d, generator=gen)
    slots = table[:, :, None] * bs + torch.arange(bs)  # [B, blocks, bs]
    k = k_pool[:, slots.view(b, -1)].transpose(0, 1)  # [B, Hkv, cap, D] gathered
    v = v_pool[:, slots.view(b, -1)].transpose(0, 1)
    q = torch.randn(b, hq, m, d, generator=gen)
    lens = torch.tensor(lengths)
    mask = torch.rand(b, m, m, generator=gen) < 0.5
    mask |= torch.eye(m, dtype=torch.bool)
    rows = torch.arange(b)[:, None]
    tree_slots = lens[:, None] + torch.arange(m)
    k_tree, v_tree = (x.transpose(1, 2)[rows, tree_slots].transpose(1, 2) for x in (k, v))
    ref = reference.hybrid_attention(q.double(), k.double(), v.double(), lens, k_tree.double(), v_tree.double(), mask)
    to = dict(device=device)
    ours = tree_attention(q.to(**to), k_pool.to(**to), v_pool.to(**to), lens.to(**to), mask.to(**to),
                          table=table.to(**to), block_size=bs).double().cpu()
    assert (ours - ref).norm() / ref.norm() < 1e-5
    limits = torch.stack([torch.randint(0, n + 1, (m,), generator=gen) for n in lengths])
    ref, _ = reference.prefix_attention(q.double(), k.double(), v.double(), limits)
    ours = prefix_attention(q.to(**to), k_pool.to(**to), v_pool.to(**to), limits.to(**to), table=table.to(**to),
                            block_size=bs).double().cpu()
    assert (ours - ref).norm() / max(ref.norm(), 1e-9) < 1e-5
    with pytest.raises(ValueError, match="multiple of the key block"):
        tree_attention(q.to(**to), k_pool.to(**to), v_pool.to(**to), lens.to(**to), mask.to(**to),
                       table=table.to(**to), block_size=48)


def proposers(target):
    draft = init_draft(DraftConfig.for_target(target, window=16), target, seed=2)
    return {"pld": (PromptLookup(), "chain:4"), "longspec": (LongSpecProposer(draft), "3,4,4"),
            "hybrid": (LongSpecProposer(draft, PromptLookup()), "3,4,4,1,1"),
            "streaming": (StreamingSelfSpec(window=8, sinks=2), "2,2")}


SLOW_ON_CPU = pytest.mark.skipif(False, reason="") if torch.cuda.is_available() else pytest.mark.slow
ENGINE_CASES = [(name, "sdpa") for name in ("pld", "longspec", "hybrid", "streaming")] + [
    pytest.param("pld", impl.values[0], marks=impl.marks) for impl in TRITON] + [
    pytest.param(name, impl.values[0], marks=[*impl.marks, SLOW_ON_CPU])  # (the draft's kernels: minutes interpreted)
    for impl in TRITON for name in ("longspec", "hybrid", "streaming")]


@pytest.mark.parametrize("name,impl", ENGINE_CASES)
def test_an_engine_over_a_small_pool_decodes_rows_of_very_different_lengths_exactly(path, name, impl):
    """Rows of 5 and 300 prompt tokens share a pool that cannot hold two full rows; a third
    request waits for blocks (the pool refuses it) and is admitted once a row is done. Every row's
    greedy tokens equal plain decoding's, and every block goes back to the pool."""
    on_gpu = impl == "triton" and torch.cuda.is_available()  # (else the kernels run interpreted)
    target = load_target(path, dtype=torch.float32, device="cuda" if on_gpu else "cpu")
    target.compile_steps = False
    target.attention_impl = impl
    try:
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (5, 300, 120)]
        prompts[1][150:200] = prompts[1][:50]  # something for the lookups to find
        config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
        plain = [Generator(target).generate([p], config).sequences[0] for p in prompts]
        proposer, tree = proposers(target)[name]
        engine = Engine(target, proposer, TreeSpec.parse(tree), max_batch=3, max_len=512, pool_tokens=448,
                        block_size=64, cuda_graphs=False)
        assert not engine.cache.dense and engine.pool.num_blocks == 7
        seqs = [Sequence(p, 12) for p in prompts]
        engine.add(seqs[:2])
        with pytest.raises(PoolExhausted, match="KV pool exhausted"):
            engine.add(seqs[2:])
        assert not engine.blocks.can_admit(seqs[2:])
        while engine.has_active:
            engine.step()
            if engine.blocks.can_admit(seqs[2:]) and seqs[2].row < 0:
                engine.add(seqs[2:])
        assert [s.tokens for s in seqs] == plain
        assert engine.pool.num_free == engine.pool.num_blocks
    finally:
        target.attention_impl = "sdpa"


def test_a_prompt_longer_than_a_row_is_refused_before_any_block_is_taken(target):
    engine = Engine(target, None, None, max_batch=2, max_len=128, pool_tokens=192, block_size=64)
    with pytest.raises(ValueError, match="needs 203 cache slots, the engine has 128"):
        engine.add([Sequence(list(range(100)) * 2, 4)])
    assert not engine.cache.dense and engine.pool.num_free == 3 and not engine.has_active


def test_the_triton_attention_refuses_blocks_that_are_no_multiple_of_its_key_block(target):
    """Blocks of 16 tokens with the Triton kernels (which read the pool in whole 64-key blocks) are
    refused when the engine is built, not gathered row by row at every step."""
    target.attention_impl = "triton"
    try:
        with pytest.raises(ValueError, match="block_size 16 with the Triton attention: it must be a multiple of 64"):
            Engine(target, None, None, max_batch=2, max_len=128, block_size=16)
        assert Engine(target, None, None, max_batch=2, max_len=128, block_size=64).pool.block_size == 64
    finally:
        target.attention_impl = "sdpa"
    assert Engine(target, None, None, max_batch=2, max_len=128, block_size=16).pool.block_size == 16


def test_an_empty_prompt_is_refused_before_any_block_is_taken(target):
    engine = Engine(target, None, None, max_batch=2, max_len=128, pool_tokens=192, block_size=64)
    free = engine.pool.num_free
    with pytest.raises(ValueError, match="at least one token"):
        engine.add([Sequence([5, 6], 4), Sequence([], 4)])
    assert engine.pool.num_free == free and not engine.has_active


def test_prompt_lookup_over_a_history_shorter_than_its_ngrams(target):
    """On a CPU the lookup searches only the history in use: a one-token prompt (history shorter
    than its longest n-gram) still drafts, and decodes plain decoding's tokens."""
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    plain = Generator(target).generate([[5]], config).sequences
    assert Generator(target, "pld").generate([[5]], config).sequences == plain


def test_rows_are_read_a_block_at_a_time_and_a_lone_row_in_consecutive_blocks_is_a_view():
    """``rows_of`` over a paged table (whole-block copies, or a view of one row whose blocks are
    consecutive) == the slots gathered one by one."""
    store = torch.randn(2, 3, 10 * 4, 5)  # [L, Hkv, P, D]: 9 blocks of 4 and the scratch block
    for table in ([[2, 3, 4, 6, 7]], [[5, 1, 9, 0, 2]], [[2, 3, 9, 1, 1], [0, 7, 8, 4, 5]]):
        table = torch.tensor(table)
        for n in (1, 5, 12, 17):  # (17 keys: whole blocks)
            slots = physical_slots(table, 4, torch.arange(n)[None], 36)
            assert torch.equal(rows_of(store, table, 4, None, 36, n), store[..., slots, :].transpose(-4, -3))
    assert rows_of(store, torch.tensor([[2, 3, 4, 5]]), 4, None, 36, 12).data_ptr() == store[:, :, 8:].data_ptr()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("impl", TRITON)
def test_a_short_causal_chunk_after_a_paged_prefix_runs_on_the_triton_kernel(tiny_model_factory, impl, family,
                                                                             monkeypatch):
    """An eager prefill's short chunk (a cached prefix's tail) over rows in scattered pool blocks:
    with the Triton implementation it goes through the kernel, which reads the pool through the
    block table, instead of gathering the row's keys for the flash path; its logits and K/V equal
    SDPA's (Gemma 3: its sliding layers' windows too). A long chunk keeps SDPA."""
    from longspec.attention import triton_kernels

    extra = {"sliding_window": 64} if family == "gemma3" else {}
    _, path = tiny_model_factory(f"pool-short-{family}", family, max_position_embeddings=512, seed=5, **extra)
    target = load_target(path, dtype=torch.float32)
    calls = []
    kernel = triton_kernels.tree_attention
    monkeypatch.setattr(triton_kernels, "tree_attention", lambda *a, **kw: calls.append(a[0].shape[2]) or kernel(*a, **kw))
    monkeypatch.setattr("longspec.models.target.TRITON_CAUSAL_MAX_TOKENS", 16)
    gen = torch.Generator().manual_seed(3)
    prefix, chunk = (torch.randint(0, 160, (1, n), generator=gen) for n in (200, 12))
    out = {}
    for name in ("sdpa", "triton"):
        target.attention_impl = name
        pool = BlockPool(target.config, num_blocks=8, block_size=64)
        pool.allocate(3)  # the row's blocks lie elsewhere, out of order
        cache = target.new_cache(1, 256, pool=pool, paged=True)
        cache.assign(0, 256)
        cache.table[0] = cache.table[0].flip(0)
        try:
            target.prefill(prefix, torch.tensor([200]), cache)
            logits = target.prefill(chunk, torch.tensor([12]), cache, all_logits=True)
        finally:
            target.attention_impl = "sdpa"
        out[name] = (logits, cache.k[:, 0, :, :212], cache.v[:, 0, :, :212])
    assert not cache.dense and calls == [12] * len(target.model.layers)  # the chunk alone: 200 > 16
    for a, b in zip(out["sdpa"], out["triton"]):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
