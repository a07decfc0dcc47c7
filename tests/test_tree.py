"""TreeSpec parsing/validation/buffers, DraftTree, parent-array utilities, beam_select."""
import itertools

import pytest
import torch

from longspec.spec.proposers import beam_select, topk_children
from longspec.spec.draft_tree import DraftTree
from longspec.spec.tree import TreeSpec, ancestor_mask_from_parents, depths_from_parents


def random_parents(B, widths, gen):
    """[B, N] random parents of a depth-grouped tree with the given level sizes."""
    cols, starts = [torch.full((B,), -1)], [0]
    for d, w in enumerate(widths):
        prev = starts[-1]
        prev_w = 1 if d == 0 else widths[d - 1]
        starts.append(1 + sum(widths[:d]))
        for _ in range(w):
            cols.append(prev + torch.randint(prev_w, (B,), generator=gen))
    return torch.stack(cols, 1)


def naive_mask(parents):
    B, N = parents.shape
    m = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            j = i
            while j >= 0:
                m[b, i, j] = True
                j = int(parents[b, j])
    return m


# ---- parsing ---------------------------------------------------------------------------------


def test_parse_shapes():
    c = TreeSpec.parse("chain:5")
    assert (c.kind, c.depth, c.num_nodes, c.max_width, c.max_children) == ("chain", 5, 6, 1, 1)
    b = TreeSpec.parse("4,16,16,16,16")
    assert (b.kind, b.depth, b.num_nodes, b.max_width) == ("beam", 5, 69, 16)
    assert TreeSpec.parse(" beam: 4, 16 ") == TreeSpec.beam([4, 16])
    p = TreeSpec.parse("[[0],[1],[0,0],[0,1],[0,0,0]]")
    assert p == TreeSpec.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    assert TreeSpec.parse("paths:[[0],[1]]").num_nodes == 3
    for spec in (c, b, p):  # str round trip
        assert TreeSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text,msg",
    [
        ("", "empty tree spec"),
        ("   ", "empty tree spec"),
        ("chain:0", "positive integer"),
        ("chain:-2", "positive integer"),
        ("chain:x", "not an integer"),
        ("4,0,16", "positive integers"),
        ("4,-1", "positive integers"),
        ("4,,16", "not an integer"),
        ("banana", "not an integer"),
        ("[[0],[0,0", "JSON"),
        ("[]", "at least one path"),
        ("[[]]", "empty path"),
        ("[[0],[0]]", "duplicate path"),
        ("[[0],[1,0]]", "lacks its prefix \\[1\\]"),
        ("[[0],[-1]]", "invalid rank"),
        ("[[0],[0.5]]", "invalid rank"),
        ("[[0], 3]", "list of child ranks"),
    ],
)
def test_parse_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        TreeSpec.parse(text)


def test_constructor_errors():
    with pytest.raises(ValueError, match="unknown tree kind"):
        TreeSpec("star")
    with pytest.raises(ValueError, match="at least one width"):
        TreeSpec.beam([])
    with pytest.raises(ValueError, match="positive integer"):
        TreeSpec.chain(0)
    with pytest.raises(ValueError, match="only rank-0"):
        TreeSpec("chain", paths=[[0], [1]])


def test_validate_vocab_and_room():
    TreeSpec.parse("4,16,16").validate(vocab_size=4, max_cache_room=37)
    with pytest.raises(ValueError, match="depth 1 exceeds the vocabulary size 3"):
        TreeSpec.parse("4,16").validate(3)
    with pytest.raises(ValueError, match="width 17 at depth 2 exceeds"):
        TreeSpec.parse("4,17").validate(4)
    with pytest.raises(ValueError, match="top-3 children but the vocabulary has 2"):
        TreeSpec.parse("[[0],[2]]").validate(2)
    with pytest.raises(ValueError, match="needs 6 cache slots .* only 5 are left"):
        TreeSpec.parse("chain:5").validate(100, max_cache_room=5)
    TreeSpec.parse("chain:5").validate(100, max_cache_room=6)
    with pytest.raises(ValueError, match="vocab_size"):
        TreeSpec.parse("chain:1").validate(0)


# ---- static buffers ----------------------------------------------------------------------------


def test_paths_buffers():
    # given in shuffled order: canonical order is by depth, then by ranks
    s = TreeSpec.from_paths([[0, 0, 0], [0, 1], [1], [0, 0], [0]])
    assert s.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert s.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert s.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert s.child_rank.tolist() == [-1, 0, 1, 0, 1, 0]
    assert (s.depth, s.num_nodes, s.max_width, s.max_children) == (3, 6, 2, 2)
    assert s.level_sizes == (2, 2, 1)
    assert [s.level_slice(d) for d in range(4)] == [slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 6)]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(s.ancestor_mask, expected)
    assert s.leaf_paths.tolist() == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]


def test_chain_buffers():
    c = TreeSpec.chain(4)
    assert c.parents.tolist() == [-1, 0, 1, 2, 3]
    assert c.depths.tolist() == [0, 1, 2, 3, 4]
    assert c.child_rank.tolist() == [-1, 0, 0, 0, 0]
    assert torch.equal(c.ancestor_mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert c.leaf_paths.tolist() == [[0, 1, 2, 3, 4]]
    # a chain is a paths tree with ranks all 0
    p = TreeSpec.from_paths([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    for name in ("parents", "depths", "child_rank", "ancestor_mask", "leaf_paths"):
        assert torch.equal(getattr(c, name), getattr(p, name))


def test_beam_buffers():
    b = TreeSpec.beam([2, 3, 3])
    assert b.depths.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert b.level_slice(2) == slice(3, 6)
    for name in ("parents", "child_rank", "ancestor_mask", "leaf_paths"):
        with pytest.raises(ValueError, match="decided at draft time"):
            getattr(b, name)


# ---- parent utilities ----------------------------------------------------------------------------


def test_ancestor_mask_and_depths_from_parents_match_naive():
    gen = torch.Generator().manual_seed(0)
    for widths in ([1], [3, 1, 4], [4, 8, 8, 8], [2, 2, 2, 2, 2, 2]):
        parents = random_parents(5, widths, gen)
        mask = ancestor_mask_from_parents(parents)
        assert torch.equal(mask, naive_mask(parents))
        assert torch.equal(depths_from_parents(parents), mask.sum(-1) - 1)
        assert torch.equal(depths_from_parents(parents)[0], TreeSpec.beam(widths).depths)
        # unbatched
        assert torch.equal(ancestor_mask_from_parents(parents[0]), mask[0])
        assert torch.equal(depths_from_parents(parents[0]), mask[0].sum(-1) - 1)
    assert ancestor_mask_from_parents(torch.tensor([[-1]])).tolist() == [[[True]]]


def test_parents_cycle_detected():
    with pytest.raises(ValueError, match="cycle"):
        ancestor_mask_from_parents(torch.tensor([[-1, 2, 1]]))


# ---- DraftTree -----------------------------------------------------------------------------------


def test_draft_tree_constructors():
    spec = TreeSpec.from_paths([[0], [1], [0, 0]])
    tokens = torch.tensor([[5, 1, 2, 3], [6, 4, 4, 0]])
    t = DraftTree.from_spec(spec, tokens)
    t.check()
    assert t.parents.shape == (2, 4) and t.mask.shape == (2, 4, 4) and t.depth == 2
    t2 = DraftTree.from_parents(tokens, spec.parents.expand(2, 4))
    assert torch.equal(t2.mask, t.mask) and torch.equal(t2.depths, t.depths)
    with pytest.raises(ValueError, match="3 nodes but tree"):
        DraftTree.from_spec(spec, tokens[:, :3])
    with pytest.raises(ValueError, match="decided at draft time"):
        DraftTree.from_spec(TreeSpec.beam([3]), tokens)
    with pytest.raises(ValueError, match="needs draft_probs"):
        DraftTree.from_spec(spec, tokens, children_sampled=True)
    with pytest.raises(ValueError, match="only applies"):
        DraftTree.from_spec(spec, tokens, draft_probs=torch.rand(2, 4, 7), without_replacement=True)
    with pytest.raises(ValueError, match="root"):
        DraftTree.from_parents(tokens, torch.tensor([[0, 0, 0, 1]] * 2))
    with pytest.raises(ValueError, match="topological"):
        DraftTree.from_parents(tokens, torch.tensor([[-1, 0, 3, 1]] * 2))
    with pytest.raises(ValueError, match="mask must have shape"):
        DraftTree(tokens, t.parents, t.depths, t.mask[:, :3])


# ---- drafting helpers ------------------------------------------------------------------------------


def test_beam_select_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    B, P, V, W = 3, 4, 7, 9
    parent_lp = torch.randn(B, P, generator=gen)
    child_lp = torch.randn(B, P, V, generator=gen).log_softmax(-1)
    pidx, tok, cum = beam_select(parent_lp, child_lp, W)
    assert pidx.shape == tok.shape == cum.shape == (B, W)
    for b in range(B):
        pairs = sorted(
            ((float(parent_lp[b, i] + child_lp[b, i, v]), i, v) for i, v in itertools.product(range(P), range(V))),
            reverse=True,
        )[:W]
        assert [(i, v) for _, i, v in pairs] == list(zip(pidx[b].tolist(), tok[b].tolist()))
        torch.testing.assert_close(cum[b], torch.tensor([s for s, _, _ in pairs]))
    with pytest.raises(ValueError, match="beam width"):
        beam_select(parent_lp, child_lp, P * V + 1)


def test_topk_children_and_static_level_index():
    spec = TreeSpec.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    gen = torch.Generator().manual_seed(3)
    B, V = 2, 10
    logits = torch.randn(B, spec.num_nodes, V, generator=gen)
    tokens = torch.zeros(B, spec.num_nodes, dtype=torch.long)
    for d in range(1, spec.depth + 1):
        prev = spec.level_slice(d - 1)
        top, lp = topk_children(logits[:, prev], spec.max_children)
        assert torch.all(lp[..., :-1] >= lp[..., 1:])
        parent, rank = spec.level_index(d)
        tokens[:, spec.level_slice(d)] = top[:, parent, rank]
    order = logits.argsort(-1, descending=True)
    for i in range(1, spec.num_nodes):  # node i = rank child_rank[i] of its parent's draft
        par, rank = int(spec.parents[i]), int(spec.child_rank[i])
        assert torch.equal(tokens[:, i], order[:, par, rank])


@pytest.mark.parametrize("shape,k,biased", [((2, 3, 8192), 16, True), ((1, 16, 1024), 4, True),
                                            ((4, 1, 640), 8, False), ((2, 1, 300), 5, False), ((1, 1, 4), 4, False)])
def test_select_top_kernel_is_topk(shape, k, biased):
    """The draft's top-k kernels (under the Triton interpreter on a CPU) give torch.topk's values
    of the flattened x + bias, in order, with distinct indices that hold them; among ties the
    smaller index first; NaN above everything, -inf kept."""
    topk = pytest.importorskip("longspec.spec.topk")
    if topk.triton is None:
        pytest.skip("no Triton")
    gen = torch.Generator().manual_seed(sum(shape) + k)
    bias = torch.randn(shape[:2], generator=gen) if biased else None
    tied = torch.randint(0, 5, shape, generator=gen).float()
    special = torch.randn(shape, generator=gen)
    special[..., :2] = float("-inf")
    special[0, 0, -1] = float("nan")
    for x in (torch.randn(shape, generator=gen), tied, special):
        values, index = topk.select_top(x, k, bias)
        scores = (x if bias is None else x + bias[..., None]).flatten(1)
        ref, _ = torch.topk(scores, k, dim=-1)
        assert torch.equal(values.nan_to_num(), ref.nan_to_num())
        assert torch.equal(scores.gather(-1, index).nan_to_num(), values.nan_to_num())
        for row, ids in zip(values, index):  # ties: ascending indices
            for a in range(k - 1):
                assert ids[a] != ids[a + 1] and (row[a] != row[a + 1] or ids[a] < ids[a + 1])
    assert topk.fits(x, k) and not topk.fits(x[0], k) and not topk.fits(x, topk.MAX_K + 1)
    with pytest.raises(ValueError, match="select_top"):
        topk.select_top(x, topk.MAX_K + 1)
