"""The fused-kernel path (SDPA with one key mask per forward) against the pure-PyTorch reference
(prefix + tree merged by LSE): attention op level and whole-model level."""
import pytest
import torch

from longspec import load_target
from longspec.attention import attend_masked, causal_attention, triton_kernels, dense_attention, matmul_attention
from longspec.attention.fast import runs_attention


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_matmul_attention_matches_dense_reference(hq, hkv):
    gen = torch.Generator().manual_seed(hq + 1)
    b, m, s, d = 2, 7, 40, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for h, n in ((hq, m), (hkv, s), (hkv, s)))
    mask = torch.rand(b, m, s, generator=gen) < 0.3
    mask[:, :, 0] = True
    ref, _ = dense_attention(q, k, v, mask)
    assert torch.allclose(matmul_attention(q, k, v, mask), ref, atol=1e-5)
    empty = mask.clone()
    empty[0, 3] = False
    ours = attend_masked(q, k, v, empty, "matmul", may_be_empty=True)
    assert torch.isfinite(ours).all() and ours[0, :, 3].abs().max() == 0
    assert torch.allclose(ours, dense_attention(q, k, v, empty)[0], atol=1e-5)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_masked_attention_matches_dense_reference(hq, hkv):
    gen = torch.Generator().manual_seed(hq)
    b, m, s, d = 3, 5, 17, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for h, n in ((hq, m), (hkv, s), (hkv, s)))
    mask = torch.rand(b, m, s, generator=gen) < 0.4
    mask[1, 2] = False  # a row that sees nothing: zero output, no NaN
    ours = attend_masked(q, k, v, mask, "sdpa", may_be_empty=True)
    ref, _ = dense_attention(q, k, v, mask)
    assert torch.isfinite(ours).all()
    assert torch.allclose(ours, ref, atol=1e-5)
    assert ours[1, :, 2].abs().max() == 0


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_attention_over_runs_of_blocks_matches_the_gathered_row(hq, hkv):
    """One paged row whose slots lie in three runs of pool blocks, attended run by run and merged
    by log-sum-exp, against masked attention over the row gathered: a query that sees nothing in
    one run, one that sees nothing at all (zeros), a run every query sees whole."""
    from longspec.attention.backend import AttentionMeta
    from longspec.attention.paged import LayerKV, block_runs

    gen = torch.Generator().manual_seed(hq)
    m, d, block = 5, 16, 4
    table = torch.tensor([[6, 7, 8, 2, 3, 0, 10]])  # runs: slots 0-11, 12-19, 20-23 (+ an unused block)
    k, v = (torch.randn(hkv, 11 * block, d, generator=gen) for _ in range(2))
    n_keys = 22
    assert block_runs(table, block, n_keys) == [(0, 12, 24), (12, 20, 8), (20, 22, 0)]
    assert block_runs(table[:, 3:], block, 8) is None  # one run: viewed, not split
    assert block_runs(table.expand(2, -1), block, 8) is None  # two rows: gathered
    q = torch.randn(1, hq, m, d, generator=gen)
    mask = torch.rand(1, m, n_keys, generator=gen) < 0.5
    mask[0, 1, :12] = False  # sees nothing in the first run
    mask[0, 1, 13] = True
    mask[0, 3] = False  # sees nothing at all
    mask[0, :, 20:] = True  # the last run: seen whole ...
    mask[0, 3, 20:] = False  # ... but for the blind query
    meta = AttentionMeta("sdpa", torch.tensor([n_keys - m]), torch.zeros(1, m, dtype=torch.long),
                         torch.ones(1, m, m, dtype=torch.bool), 0, n_keys, table, block, None, 0, key_mask=mask)
    runs = meta.key_runs()
    assert [(at, n) for at, n, _, _ in runs] == [(24, 12), (8, 8), (0, 2)] and meta.key_runs() is runs
    ours = runs_attention(q, k, v, runs)
    k_row, v_row = LayerKV(k, v, table, block).dense(n_keys)
    ref = attend_masked(q, k_row, v_row, mask, "sdpa", may_be_empty=True)
    assert torch.allclose(ours, ref, atol=1e-5) and ours[0, :, 3].abs().max() == 0
    mask[:] = True  # every query sees the whole row: no masks, no blind queries
    meta.runs = None
    assert all(bias is None and blind is None for _, _, bias, blind in meta.key_runs())
    assert torch.allclose(runs_attention(q, k, v, meta.runs), attend_masked(q, k_row, v_row, mask, "sdpa"), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_fast_path_equals_reference_path(tiny_model_factory, family):
    """prefill in chunks (ragged batch), then a tree verify and a tree grown level by level
    (pending tokens), with both attention implementations."""
    _, path = tiny_model_factory(f"fast-{family}", family, max_position_embeddings=256, seed=4)
    outputs = {}
    impls = ("sdpa", "matmul", "triton", "reference") if triton_kernels.available() else ("sdpa", "matmul", "reference")
    for impl in impls:
        target = load_target(path)
        target.attention_impl = impl
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 160, (2, 40), generator=gen)
        cache = target.new_cache(2, 64)
        pre = target.prefill(ids, torch.tensor([40, 23]), cache, chunk_size=16, all_logits=True)
        parents = [-1, 0, 0, 1, 1, 2]
        mask = torch.eye(6, dtype=torch.bool)
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] |= mask[p]
        depth = mask.sum(-1) - 1
        tokens = torch.randint(0, 160, (2, 6), generator=gen)
        positions = cache.lengths[:, None] + depth
        tree = target.verify(tokens, positions, mask[None], cache)
        cache.discard()
        fixed = target.verify(tokens, positions, mask[None], cache, n_keys=64)  # a step over the whole capacity
        assert torch.allclose(fixed, tree, atol=1e-5)
        cache.discard()
        level1 = target.verify(tokens[:, :3], positions[:, :3], mask[None, :3, :3], cache)
        level2 = target.verify(tokens[:, 3:], positions[:, 3:], mask[None, 3:, :6], cache)
        outputs[impl] = (pre, tree, torch.cat([level1, level2], 1))
    for impl in impls[:-1]:
        for ours, ref in zip(outputs[impl], outputs["reference"]):
            assert torch.allclose(ours, ref, atol=1e-4)
    assert torch.allclose(outputs["sdpa"][1], outputs["sdpa"][2], atol=1e-4)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_causal_attention_after_a_cached_prefix(hq, hkv):
    """A prefill chunk of M queries after S - M cached tokens: query i sees keys 0..S-M+i."""
    gen = torch.Generator().manual_seed(hq)
    b, m, s, d = 2, 5, 13, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for h, n in ((hq, m), (hkv, s), (hkv, s)))
    mask = (torch.arange(s)[None, :] <= s - m + torch.arange(m)[:, None]).expand(b, -1, -1)
    assert torch.allclose(causal_attention(q, k, v), dense_attention(q, k, v, mask)[0], atol=1e-5)
    assert torch.allclose(causal_attention(q, k[:, :, :m], v[:, :, :m]),
                          dense_attention(q, k[:, :, :m], v[:, :, :m], mask[:, :, -m:])[0], atol=1e-5)


def test_prefill_chunks_take_the_unmasked_causal_path_when_rows_are_even(tiny_model_factory):
    """Chunks after the first use lower-right causal attention (no [B, M, S] mask) when every row
    has the same cached length; ragged rows fall back to the key mask."""
    from longspec.attention import AttentionMeta
    _, path = tiny_model_factory("fast-causal", "llama", max_position_embeddings=64, seed=2)
    cache = load_target(path).new_cache(2, 64)
    causal = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    cache.lengths[:] = 9
    even = AttentionMeta.build(cache, causal, 4, "sdpa", causal=True)
    assert even.causal and even.key_mask is None and even.n_keys == 13
    cache.lengths[1] = 5
    ragged = AttentionMeta.build(cache, causal, 4, "sdpa", causal=True)
    assert not ragged.causal and ragged.key_mask is not None


def test_compiled_sdpa_paths_are_kept_by_the_on_disk_compile_cache(tmp_path, monkeypatch):
    """A graph holding ``sdpa_kernel``'s calls is never saved to torch.compile's AOT cache (it
    is traced again in every process): the fused paths must not put them in compiled code."""
    from torch._dynamo.utils import counters
    from longspec.attention import masked_attention

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=gen) for h, n in ((4, 3), (2, 6), (2, 6)))
    mask = torch.rand(1, 3, 6, generator=gen) < 0.5
    mask[..., 0] = True

    def step(q, k, v, mask):
        return masked_attention(q, k, v, mask) + causal_attention(q, k, v)

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(step)(q, k, v, mask)
    torch._dynamo.reset()
    assert torch.allclose(out, step(q, k, v, mask), atol=1e-5)
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_bypass"] == 0 and aot["autograd_cache_saved"] + aot["autograd_cache_hit"] >= 1, dict(aot)
