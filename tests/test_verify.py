"""Verification: greedy (exact) and lossless sampling (statistical tests against enumeration).

The toy "model" is a trigram table over a small vocabulary: the next-token distribution depends
on the last two tokens. The draft is a different trigram table. The speculative process is
simulated over a large batch at once and the empirical distribution of the first emitted tokens
is compared with the exact target distribution computed by enumeration.
"""
import pytest
import torch
from scipy.stats import chi2

import longspec.spec.verify as verify_mod
from longspec.spec.sampling import warp_probs
from longspec.spec.proposers import beam_select
from longspec.spec.draft_tree import DraftTree
from longspec.spec.tree import TreeSpec
from longspec.spec.verify import verify_greedy, verify_sampling, verify_tree

V = 8
PROMPT = (1, 2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are small ([B, 8]): intra-op threading only adds overhead."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_tables(seed=0, vocab=V):
    """Target and draft trigram logits ``[V, V, V]`` indexed by (token t-2, token t-1)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab, vocab, vocab, generator=g)
    draft = target + torch.randn(vocab, vocab, vocab, generator=g)
    return target, draft


def random_parents(B, widths, gen):
    """[B, N] random parents of a depth-grouped tree with the given level sizes."""
    cols, start = [torch.full((B,), -1)], 0
    for d, w in enumerate(widths):
        prev_w = 1 if d == 0 else widths[d - 1]
        cols += [start + torch.randint(prev_w, (B,), generator=gen) for _ in range(w)]
        start += prev_w
    return torch.stack(cols, 1)


def node_context(tokens, parents, ctx2):
    """Token before each node (parent's token; the prompt's second-to-last for the root)."""
    prev = tokens.gather(1, parents.clamp(min=0))
    return torch.where(parents >= 0, prev, ctx2[:, :1])


# ============================================================================================
# Greedy
# ============================================================================================


def naive_greedy(tokens, parents, logits):
    """Per-row Python walk: deepest node whose whole path is correct (lowest index on ties)."""
    B, N = tokens.shape
    paths, bonus = [], []
    for b in range(B):
        amax = logits[b].argmax(-1).tolist()
        par, tok = parents[b].tolist(), tokens[b].tolist()
        best, best_path = 0, [0]
        for i in range(1, N):
            path, j, ok = [], i, True
            while j > 0:
                ok &= tok[j] == amax[par[j]]
                path.append(j)
                j = par[j]
            if ok and len(path) + 1 > len(best_path):
                best, best_path = i, [0] + path[::-1]
        paths.append(best_path)
        bonus.append(amax[best])
    return paths, bonus


def test_greedy_hand_built():
    spec = TreeSpec.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [1, 0, 0]])
    N = spec.num_nodes  # nodes: 1=[0] 2=[1] 3=[0,0] 4=[0,1] 5=[1,0] 6=[1,1] 7=[1,0,0]
    argmax = torch.tensor(
        [
            [4, 9, 2, 9, 9, 6, 9, 3],  # row 0: path 0 -> 2 -> 5 -> 7 correct, bonus 3
            [4, 9, 9, 9, 9, 9, 9, 9],  # row 1: nothing correct, bonus 4
            [4, 1, 7, 9, 9, 6, 9, 3],  # row 2: node 1 correct (depth 1) but node 2's subtree deeper
            [4, 7, 9, 9, 9, 9, 9, 9],  # row 3: duplicate siblings 1, 2 both correct: lowest index
        ]
    )
    tokens = torch.tensor(
        [
            [0, 1, 4, 5, 5, 2, 6, 6],
            [0, 1, 2, 3, 4, 5, 6, 7],
            [0, 4, 4, 1, 1, 7, 0, 6],
            [0, 4, 4, 7, 0, 0, 0, 0],
        ]
    )
    logits = torch.nn.functional.one_hot(argmax, 10).float()
    res = verify_greedy(DraftTree.from_spec(spec, tokens), logits)
    assert res.accepted_nodes.tolist() == [[0, 2, 5, 7], [0, -1, -1, -1], [0, 2, 5, 7], [0, 1, 3, -1]]
    assert res.num_accepted.tolist() == [3, 0, 3, 2]
    assert res.accepted_tokens.tolist() == [[4, 2, 6], [-1, -1, -1], [4, 7, 6], [4, 7, -1]]
    assert res.bonus_token.tolist() == [3, 4, 3, 9]
    em, n = res.emitted()
    assert em.tolist() == [[4, 2, 6, 3], [4, -1, -1, -1], [4, 7, 6, 3], [4, 7, 9, -1]]
    assert n.tolist() == [4, 1, 4, 3]
    assert N == 8


@pytest.mark.parametrize("widths", [[1], [1, 1, 1], [3, 2, 4], [4, 8, 8, 8], [2, 2, 2, 2, 2]])
def test_greedy_random_against_naive(widths):
    gen = torch.Generator().manual_seed(len(widths) * 10 + widths[0])
    B, vocab = 64, 3  # tiny vocabulary: many correct nodes and duplicate siblings
    parents = random_parents(B, widths, gen)
    N = parents.shape[1]
    tokens = torch.randint(vocab, (B, N), generator=gen)
    logits = torch.randn(B, N, vocab, generator=gen)
    res = verify_greedy(DraftTree.from_parents(tokens, parents), logits)
    paths, bonus = naive_greedy(tokens, parents, logits)
    D = len(widths)
    assert res.accepted_nodes.tolist() == [p + [-1] * (D + 1 - len(p)) for p in paths]
    assert res.num_accepted.tolist() == [len(p) - 1 for p in paths]
    assert res.bonus_token.tolist() == bonus


def greedy_rollout(table, prompt, steps):
    ctx = list(prompt)
    for _ in range(steps):
        ctx.append(int(table[ctx[-2], ctx[-1]].argmax()))
    return ctx[len(prompt):]


def draw(probs, gen):
    """One token per row of ``probs [B, V]`` by inverse CDF (much faster than multinomial here)."""
    u = torch.rand(probs.shape[0], 1, generator=gen) * probs.sum(-1, keepdim=True)
    idx = (probs.cumsum(-1) <= u).sum(-1)
    return torch.minimum(idx, (probs > 0).long().cumsum(-1).argmax(-1))  # guard rounding at the top


def build_tree(kind, spec, ctx2, qtab, gen, without_replacement=False):
    """Draft a tree for each row from the toy draft distribution ``qtab [V, V, V]`` (probabilities).

    kind: "sampled" (children drawn from q, i.i.d. or without replacement), "topk" (static tree,
    child of rank r = the draft's r-th most likely token) or "beam" (``spec`` is a beam TreeSpec).
    """
    B = ctx2.shape[0]
    if kind == "beam":
        tokens, parents = [ctx2[:, 1]], [torch.full((B,), -1)]
        prev_nodes = torch.zeros(B, 1, dtype=torch.long)
        cum = torch.zeros(B, 1)
        for d in range(1, spec.depth + 1):
            tok = torch.stack(tokens, 1)
            par = torch.stack(parents, 1)
            prev_ctx = node_context(tok, par, ctx2)
            pn = prev_nodes
            child_lp = qtab[prev_ctx.gather(1, pn), tok.gather(1, pn)].log()
            pidx, new_tok, cum = beam_select(cum, child_lp, spec.level_sizes[d - 1])
            parents += list(pn.gather(1, pidx).unbind(1))
            tokens += list(new_tok.unbind(1))
            start = spec.level_slice(d).start
            prev_nodes = torch.arange(start, start + spec.level_sizes[d - 1]).expand(B, -1)
        return DraftTree.from_parents(torch.stack(tokens, 1), torch.stack(parents, 1))

    N = spec.num_nodes
    par = spec.parents.expand(B, N)
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = ctx2[:, 1]
    for i in range(1, N):
        j = int(spec.parents[i])
        q = qtab[node_context(tokens, par, ctx2)[:, j], tokens[:, j]]
        if kind == "topk":
            tokens[:, i] = q.argsort(-1, descending=True)[:, int(spec.child_rank[i])]
            continue
        if without_replacement:  # sequential draws: drop the earlier siblings' tokens
            for s in range(1, i):
                if int(spec.parents[s]) == j:
                    q = q.scatter(1, tokens[:, s : s + 1], 0.0)
            q = q / q.sum(-1, keepdim=True)
        tokens[:, i] = draw(q, gen)
    if kind == "topk":
        return DraftTree.from_spec(spec, tokens)
    draft_probs = qtab[node_context(tokens, par, ctx2), tokens]  # [B, N, V]
    return DraftTree.from_spec(
        spec, tokens, draft_probs=draft_probs, children_sampled=True, without_replacement=without_replacement
    )


def simulate(make_tree, ptab, B, L, gen, greedy=False):
    """Run speculative rounds from PROMPT until every row has emitted >= L tokens.

    ``make_tree(ctx2 [B, 2], gen) -> DraftTree``; ``ptab [V, V, V]`` target probabilities (or
    logits when ``greedy``). Returns ``[B, L]`` first emitted tokens.
    """
    ctx2 = torch.tensor(PROMPT).expand(B, 2)
    out = torch.full((B, 4 * L + 16), -1, dtype=torch.long)
    length = torch.zeros(B, dtype=torch.long)
    while int(length.min()) < L:
        tree = make_tree(ctx2, gen)
        rows = ptab[node_context(tree.tokens, tree.parents, ctx2), tree.tokens]  # [B, N, V]
        res = verify_greedy(tree, rows) if greedy else verify_sampling(tree, rows, gen)
        em, n = res.emitted()
        n = torch.where(length < L, n, 0)
        cols = torch.arange(em.shape[1])
        pos = torch.where(cols < n[:, None], length[:, None] + cols, out.shape[1] - 1)
        out.scatter_(1, pos, em)
        length += n
        last = out.gather(1, (length - 1)[:, None]).squeeze(1)
        before = out.gather(1, (length - 2).clamp(min=0)[:, None]).squeeze(1)
        ctx2 = torch.stack([torch.where(length >= 2, before, PROMPT[1]), last], 1)
    return out[:, :L]


TREES = {
    "chain": TreeSpec.chain(4),
    "paths": TreeSpec.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]),
    "beam": TreeSpec.beam([3, 4, 4]),
}


@pytest.mark.parametrize("shape,kind", [("chain", "topk"), ("paths", "topk"), ("beam", "beam"), ("paths", "sampled")])
def test_greedy_equals_autoregressive(shape, kind):
    """Greedy speculative output == greedy decoding of the target, also with a useless draft,
    and verify_sampling at temperature 0 emits the same tokens."""
    target, draft = make_tables(1)
    gen = torch.Generator().manual_seed(0)
    expected = greedy_rollout(target, PROMPT, 12)
    for qlogits in (draft, torch.randn(V, V, V, generator=gen)):
        qtab = qlogits.softmax(-1)
        make = lambda c, g: build_tree(kind, TREES[shape], c, qtab, g)  # noqa: E731
        out = simulate(make, target, 8, 12, gen, greedy=True)
        assert (out == torch.tensor(expected)).all()
        onehot = warp_probs(target, 0.0)
        out = simulate(make, onehot, 8, 12, gen)
        assert (out == torch.tensor(expected)).all()


# ============================================================================================
# Lossless sampling: frequency tests
# ============================================================================================

B_STAT = 40000


def exact_joint(ptab, L):
    """Exact distribution ``[V] * L`` of the first L tokens sampled from ``ptab`` after PROMPT."""
    a, b = PROMPT
    joint = ptab[a, b]  # [V]
    if L >= 2:
        joint = joint[:, None] * ptab[b]  # [V, V]
    if L >= 3:
        joint = joint[:, :, None] * ptab  # [V, V, V]
    return joint.double()


def frequency_test(samples, probs):
    """Chi-square goodness of fit of ``samples [B, L]`` against ``probs [V]*L``.

    Cells with expected count < 5 are pooled. Returns ``(p_value, tv_distance)``; a sample in a
    cell of exact probability 0 gives p-value 0.
    """
    n = samples.shape[0]
    flat = torch.zeros(samples.shape[0], dtype=torch.long)
    for j in range(samples.shape[1]):
        flat = flat * V + samples[:, j]
    counts = torch.bincount(flat, minlength=probs.numel()).double()
    p = probs.flatten()
    tv = 0.5 * (counts / n - p).abs().sum().item()
    if counts[p == 0].sum() > 0:
        return 0.0, tv
    expected = n * p
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (p > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (p > 0)].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return float(chi2.sf(stat, int(keep.sum()) - 1)), tv


WARPS = {"T0.7-p0.9": dict(temperature=0.7, top_p=0.9), "T1.3-k5-p0.95": dict(temperature=1.3, top_k=5, top_p=0.95)}
CASES = {  # name: (tree, how children are chosen, without_replacement, draft warping)
    "chain-sampled": ("chain", "sampled", False, dict(temperature=1.0, top_p=0.8)),
    "tree-iid": ("paths", "sampled", False, dict(temperature=1.0, top_p=0.8)),
    "tree-noreplace": ("paths", "sampled", True, dict(temperature=1.0)),
    "chain-greedy-draft": ("chain", "topk", False, dict(temperature=1.0)),
    "tree-topk": ("paths", "topk", False, dict(temperature=1.0)),
    "beam": ("beam", "beam", False, dict(temperature=1.0)),
}


def run_case(case, warp, seed=0, B=B_STAT, L=3):
    shape, kind, norep, draft_warp = CASES[case]
    target, draft = make_tables(seed)
    ptab = warp_probs(target, **WARPS[warp])
    qtab = warp_probs(draft, **draft_warp)
    gen = torch.Generator().manual_seed(seed + 1)
    make = lambda c, g: build_tree(kind, TREES[shape], c, qtab, g, without_replacement=norep)  # noqa: E731
    return simulate(make, ptab, B, L, gen), ptab


@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_is_lossless(case, warp):
    samples, ptab = run_case(case, warp)
    for L in (2, 3):
        pval, tv = frequency_test(samples[:, :L], exact_joint(ptab, L))
        assert pval > 1e-3, f"{case}/{warp}: first {L} tokens deviate from the target (p={pval:.2e}, TV={tv:.4f})"
        assert tv < 0.04


def test_frequency_test_detects_2_percent_tv():
    """Power of the harness: a diffuse 2%-TV perturbation of the exact 2-token joint is rejected."""
    target, _ = make_tables(0)
    exact = exact_joint(warp_probs(target, **WARPS["T0.7-p0.9"]), 2)
    g = torch.Generator().manual_seed(7)
    sign = torch.randint(0, 2, exact.shape, generator=g).double() * 2 - 1
    for delta in torch.linspace(0.01, 0.2, 400):
        bad = exact * (1 + delta * sign)
        bad = bad / bad.sum()
        if 0.5 * (bad - exact).abs().sum() >= 0.02:
            break
    samples = torch.multinomial(bad.flatten().float(), B_STAT, replacement=True, generator=g)
    pval, _ = frequency_test(torch.stack([samples // V, samples % V], 1), exact)
    assert pval < 1e-3


def _wrong_sampled_residual(p, q):
    """Deliberately wrong: after a rejection resample from p instead of norm(max(0, p - q))."""
    return p


def _wrong_bonus_resampled(p, children, generator):
    """Deliberately wrong: when every top-k child is rejected, resample the bonus from p, so a
    rejected child can come back (the rule needs p with the children removed)."""
    from longspec.spec.sampling import sample

    return sample(p, generator)


_right_child_choices = verify_mod._child_choices


def _wrong_child_choices(tree, target_probs, generator):
    """Deliberately wrong: children taken with probabilities sharper than p's (p squared)."""
    sharp = target_probs ** 2
    return _right_child_choices(tree, sharp / sharp.sum(-1, keepdim=True), generator)


def _wrong_keep_q(q, token):
    """Deliberately wrong: siblings drawn without replacement, but q is not renormalised without x."""
    return q


@pytest.mark.parametrize(
    "case,attr,wrong",
    [
        ("chain-sampled", "_sampled_residual", _wrong_sampled_residual),
        ("tree-iid", "_sampled_residual", _wrong_sampled_residual),
        ("tree-noreplace", "_sampled_residual", _wrong_sampled_residual),
        ("tree-noreplace", "_drop_token", _wrong_keep_q),
        ("tree-topk", "_bonus_after_rejection", _wrong_bonus_resampled),
        ("beam", "_bonus_after_rejection", _wrong_bonus_resampled),
        ("tree-topk", "_child_choices", _wrong_child_choices),
        ("beam", "_child_choices", _wrong_child_choices),
    ],
)
def test_frequency_test_detects_wrong_rule(monkeypatch, case, attr, wrong):
    monkeypatch.setattr(verify_mod, attr, wrong)
    samples, ptab = run_case(case, "T0.7-p0.9")
    pval, tv = frequency_test(samples[:, :2], exact_joint(ptab, 2))
    assert pval < 1e-6, f"wrong rule not detected (p={pval:.2e}, TV={tv:.4f})"


# ============================================================================================
# Structure / API
# ============================================================================================


def test_sampling_result_structure_and_determinism():
    target, draft = make_tables(3)
    ptab, qtab = warp_probs(target, 0.8, 0, 0.9), draft.softmax(-1)
    ctx2 = torch.tensor(PROMPT).expand(256, 2)
    tree = build_tree("sampled", TREES["paths"], ctx2, qtab, torch.Generator().manual_seed(0))
    rows = ptab[node_context(tree.tokens, tree.parents, ctx2), tree.tokens]
    r1 = verify_sampling(tree, rows, torch.Generator().manual_seed(1))
    r2 = verify_sampling(tree, rows, torch.Generator().manual_seed(1))
    assert torch.equal(r1.accepted_nodes, r2.accepted_nodes) and torch.equal(r1.bonus_token, r2.bonus_token)
    D = TREES["paths"].depth
    assert r1.accepted_nodes.shape == (256, D + 1) and r1.accepted_tokens.shape == (256, D)
    for b in range(256):
        nodes = [x for x in r1.accepted_nodes[b].tolist() if x >= 0]
        assert nodes[0] == 0 and len(nodes) == int(r1.num_accepted[b]) + 1
        for a, c in zip(nodes, nodes[1:]):
            assert int(tree.parents[b, c]) == a
        assert r1.accepted_tokens[b, : len(nodes) - 1].tolist() == tree.tokens[b, nodes[1:]].tolist()
        last = nodes[-1]
        assert float(rows[b, last, r1.bonus_token[b]]) > 0  # bonus comes from p (or its residual)
    assert 0 < r1.num_accepted.float().mean() < D


def test_root_only_tree():
    tree = DraftTree.from_parents(torch.tensor([[3], [4]]), torch.tensor([[-1], [-1]]))
    logits = torch.tensor([[[0.0, 1.0, 0.0]], [[2.0, 1.0, 0.0]]])
    res = verify_greedy(tree, logits)
    assert res.accepted_nodes.tolist() == [[0], [0]] and res.accepted_tokens.shape == (2, 0)
    assert res.emitted()[0].tolist() == [[1], [0]]
    res = verify_sampling(tree, warp_probs(logits, 0.0))
    assert res.bonus_token.tolist() == [1, 0] and res.num_accepted.tolist() == [0, 0]


def test_verify_dispatch_and_errors():
    spec = TreeSpec.chain(2)
    tokens = torch.tensor([[0, 1, 2]])
    tree = DraftTree.from_spec(spec, tokens)
    logits = torch.full((1, 3, 4), -5.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 5.0
    res = verify_tree(tree, logits)  # temperature 0 -> greedy
    assert res.accepted_nodes.tolist() == [[0, 1, 2]] and res.bonus_token.tolist() == [3]
    res = verify_tree(tree, logits, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert res.accepted_nodes.tolist() == [[0, 1, 2]] and res.bonus_token.tolist() == [3]
    with pytest.raises(ValueError, match="temperature"):
        verify_tree(tree, logits, temperature=-1.0)
    with pytest.raises(ValueError, match="target_logits must be"):
        verify_greedy(tree, logits[:, :2])
    with pytest.raises(ValueError, match="target_probs must be"):
        verify_sampling(tree, logits[0])
    sampled = DraftTree.from_spec(spec, tokens, draft_probs=torch.rand(1, 3, 5), children_sampled=True)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_sampling(sampled, logits.softmax(-1))


def test_duplicate_siblings_stay_lossless():
    """Two children with the same token (a merged tree may hold them) whose own children differ:
    following whichever duplicate leads deeper would bias the emitted tokens; the first one is
    used, and the two-token joint matches the target."""
    target, draft = make_tables(5)
    ptab = warp_probs(target, 0.9)
    qtab = draft.softmax(-1)
    spec = TreeSpec.from_paths([[0], [1], [0, 0], [1, 0]])

    def make(ctx2, gen):
        q = qtab[ctx2[:, 0], ctx2[:, 1]]
        top = q.topk(3, -1).indices
        tokens = torch.stack([ctx2[:, 1], top[:, 0], top[:, 0], top[:, 1], top[:, 2]], 1)
        return DraftTree.from_spec(spec, tokens)

    samples = simulate(make, ptab, B_STAT, 2, torch.Generator().manual_seed(3))
    pval, tv = frequency_test(samples, exact_joint(ptab, 2))
    assert pval > 1e-3 and tv < 0.04, (pval, tv)
