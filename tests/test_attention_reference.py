"""The pure-PyTorch attention reference (the oracle of the fast kernels) checked against an
independent textbook implementation: hybrid (prefix + tree, merged by LSE) == dense attention over
the concatenated keys with the equivalent full mask; GQA, ragged rows, empty prefixes, all-masked
parts, LSE values."""
from __future__ import annotations

import math

import pytest
import torch

from longspec.attention import reference as ref

ATOL = 1e-5


def naive_attention(q, k, v, mask):
    """Textbook attention with GQA by repeat_interleave (HF ``repeat_kv``): q [B,Hq,M,D],
    k/v [B,Hkv,S,D], mask [B,M,S] -> (o [B,Hq,M,D], lse [B,Hq,M]); rows without a visible key
    get o = 0, lse = -inf."""
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, dim=1)
    v = v.float().repeat_interleave(g, dim=1)
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return p @ v, lse


def rand_tree_mask(b, m, gen, p_extra=0.3):
    """Random ancestor-like masks: diagonal always visible, random lower-triangular extras."""
    mask = torch.rand(b, m, m, generator=gen) < p_extra
    mask = torch.tril(mask) | torch.eye(m, dtype=torch.bool)
    return mask


def random_parents_mask(b, m, gen):
    """Real tree masks (ancestor-or-self) of random trees, one per row."""
    masks = torch.zeros(b, m, m, dtype=torch.bool)
    for r in range(b):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]
        for i in range(m):
            j = i
            while j >= 0:
                masks[r, i, j] = True
                j = parents[j]
    return masks


SHAPES = [  # B, Hq, Hkv, M, S, D
    (1, 4, 4, 1, 7, 16),
    (2, 4, 2, 5, 33, 16),
    (3, 8, 2, 9, 64, 32),
    (2, 6, 1, 4, 20, 8),
    (4, 4, 4, 16, 50, 64),
]


def _inputs(shape, seed, dtype=torch.float32):
    b, hq, hkv, m, s, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, m, d, generator=gen).to(dtype)
    k_cache = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    v_cache = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    k_tree = torch.randn(b, hkv, m, d, generator=gen).to(dtype)
    v_tree = torch.randn(b, hkv, m, d, generator=gen).to(dtype)
    lengths = torch.randint(0, s + 1, (b,), generator=gen)
    lengths[0] = 0 if b > 1 else lengths[0]  # an empty prefix
    lengths[-1] = s  # a full cache
    if b > 2:
        lengths[1] = 1
    # slots beyond each row's length hold stale (large, finite) values that must be ignored
    for r in range(b):
        k_cache[r, :, lengths[r]:] = 50.0
        v_cache[r, :, lengths[r]:] = -1e4
    return q, k_cache, v_cache, lengths, k_tree, v_tree, gen


def full_mask(lengths, s, tree_mask):
    b, m, _ = tree_mask.shape
    prefix = (torch.arange(s)[None, :] < lengths[:, None])[:, None, :].expand(b, m, s)
    return torch.cat([prefix, tree_mask], dim=-1)


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("tree", ["random", "tree", "causal"])
def test_hybrid_equals_dense(shape, tree):
    q, kc, vc, lengths, kt, vt, gen = _inputs(shape, seed=10 * SHAPES.index(shape) + ["random", "tree", "causal"].index(tree))
    b, _, _, m, s, _ = shape
    if tree == "random":
        mask = rand_tree_mask(b, m, gen)
    elif tree == "tree":
        mask = random_parents_mask(b, m, gen)
    else:
        mask = torch.tril(torch.ones(m, m, dtype=torch.bool)).expand(b, m, m)
    out = ref.hybrid_attention(q, kc, vc, lengths, kt, vt, mask)
    assert out.dtype == torch.float32 and out.shape == q.shape
    k = torch.cat([kc, kt], 2)
    v = torch.cat([vc, vt], 2)
    fmask = full_mask(lengths, s, mask)
    o_dense, lse_dense = ref.dense_attention(q, k, v, fmask)
    o_naive, lse_naive = naive_attention(q, k, v, fmask)
    torch.testing.assert_close(out, o_naive, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_dense, o_naive, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse_dense, lse_naive, atol=ATOL, rtol=0)
    # the merged lse equals the dense one
    o_p, lse_p = ref.prefix_attention(q, kc, vc, lengths)
    o_t, lse_t = ref.tree_attention(q, kt, vt, mask)
    o_m, lse_m = ref.merge_attention(o_p, lse_p, o_t, lse_t)
    torch.testing.assert_close(o_m, o_naive, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse_m, lse_naive, atol=ATOL, rtol=0)


def test_hybrid_shared_2d_mask_and_half_inputs():
    shape = (2, 4, 2, 6, 24, 16)
    q, kc, vc, lengths, kt, vt, gen = _inputs(shape, seed=3, dtype=torch.float16)
    mask2d = random_parents_mask(1, 6, gen)[0]
    out = ref.hybrid_attention(q, kc, vc, lengths, kt, vt, mask2d)
    assert out.dtype == torch.float32
    expect, _ = naive_attention(q, torch.cat([kc, kt], 2), torch.cat([vc, vt], 2),
                                full_mask(lengths, 24, mask2d.expand(2, 6, 6)))
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=0)


def test_tree_part_with_pending_keys():
    """Tree queries over P earlier (pending) tree keys plus their own: rectangular [B, M, P+M] mask."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, p, m, s, d = 2, 4, 2, 3, 4, 10, 16
    parents_mask = random_parents_mask(b, p + m, gen)
    q = torch.randn(b, hq, m, d, generator=gen)
    kc, vc = torch.randn(b, hkv, s, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen)
    kt, vt = torch.randn(b, hkv, p + m, d, generator=gen), torch.randn(b, hkv, p + m, d, generator=gen)
    lengths = torch.tensor([0, 7])
    mask = parents_mask[:, p:, :]  # the last M nodes' rows
    out = ref.hybrid_attention(q, kc, vc, lengths, kt, vt, mask)
    expect, _ = naive_attention(q, torch.cat([kc, kt], 2), torch.cat([vc, vt], 2), full_mask(lengths, s, mask))
    torch.testing.assert_close(out, expect, atol=ATOL, rtol=0)


def test_lse_is_logsumexp_of_scaled_scores():
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, m, s, d = 2, 6, 3, 5, 12, 32
    q = torch.randn(b, hq, m, d, generator=gen) * 3
    k = torch.randn(b, hkv, s, d, generator=gen)
    v = torch.randn(b, hkv, s, d, generator=gen)
    lengths = torch.tensor([12, 4])
    o, lse = ref.prefix_attention(q, k, v, lengths)
    for r in range(b):
        for h in range(hq):
            kk = k[r, h // (hq // hkv), :lengths[r]]
            scores = q[r, h] @ kk.T / math.sqrt(d)
            torch.testing.assert_close(lse[r, h], torch.logsumexp(scores, -1), atol=ATOL, rtol=0)
            expect = torch.softmax(scores, -1) @ v[r, h // (hq // hkv), :lengths[r]]
            torch.testing.assert_close(o[r, h], expect, atol=ATOL, rtol=0)


def test_empty_prefix_gives_zero_output_and_neg_inf_lse():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 3, 8, generator=gen)
    k = torch.randn(2, 2, 5, 8, generator=gen)
    v = torch.randn(2, 2, 5, 8, generator=gen)
    o, lse = ref.prefix_attention(q, k, v, torch.tensor([0, 5]))
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    assert torch.isneginf(lse[0]).all()
    assert torch.isfinite(o).all() and torch.isfinite(lse[1]).all()


def test_tree_attention_fully_masked_row():
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 3, 8, generator=gen)
    k = torch.randn(1, 1, 3, 8, generator=gen)
    v = torch.randn(1, 1, 3, 8, generator=gen)
    mask = torch.tensor([[[True, False, False], [False, False, False], [True, True, True]]])
    o, lse = ref.tree_attention(q, k, v, mask)
    assert torch.equal(o[:, :, 1], torch.zeros_like(o[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all()
    expect, expect_lse = naive_attention(q, k, v, mask)
    torch.testing.assert_close(o, expect, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, expect_lse, atol=ATOL, rtol=0)


def test_merge_with_all_masked_part():
    gen = torch.Generator().manual_seed(13)
    o1 = torch.randn(2, 3, 4, 8, generator=gen)
    lse1 = torch.randn(2, 3, 4, generator=gen)
    empty_o = torch.zeros_like(o1)
    empty_lse = torch.full_like(lse1, float("-inf"))
    for args in [(o1, lse1, empty_o, empty_lse), (empty_o, empty_lse, o1, lse1)]:
        o, lse = ref.merge_attention(*args)
        torch.testing.assert_close(o, o1, atol=0, rtol=0)
        torch.testing.assert_close(lse, lse1, atol=0, rtol=0)
    # both parts empty: zero output, -inf lse, no NaN
    o, lse = ref.merge_attention(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(o, empty_o) and torch.isneginf(lse).all()


def test_merge_matches_attention_over_union_and_is_stable():
    """Merging two disjoint key sets equals attention over their union, also with huge scores
    (the max-subtraction keeps it finite)."""
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(1, 2, 4, 16, generator=gen) * 40  # scores of order 1e3: exp overflows naively
    k = torch.randn(1, 2, 10, 16, generator=gen)
    v = torch.randn(1, 2, 10, 16, generator=gen)
    mask = torch.ones(1, 4, 10, dtype=torch.bool)
    o_all, lse_all = ref.dense_attention(q, k, v, mask)
    o1, l1 = ref.dense_attention(q, k[:, :, :6], v[:, :, :6], mask[..., :6])
    o2, l2 = ref.dense_attention(q, k[:, :, 6:], v[:, :, 6:], mask[..., 6:])
    o, lse = ref.merge_attention(o1, l1, o2, l2)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o, o_all, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse, lse_all, atol=1e-3, rtol=1e-6)
