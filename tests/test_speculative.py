"""Speculative decoding end to end: greedy output equals autoregressive output token for token
(random draft, prompt lookup, StreamingLLM self-speculation; chain, static and beam trees; batch 1
and 3), sampling matches the target distribution, tau accounting, finished rows, errors."""
import itertools

import pytest
import torch
from scipy import stats

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.decoding.proposers import LongSpecProposer, PromptLookup, TreeDrafter
from longspec.decoding.streaming import StreamingSelfSpec
from longspec.decoding.sampling import warp_probs
from longspec.decoding.tree import TreeSpec


class RandomDraft(TreeDrafter):
    """A useless draft: random next-token logits (seeded)."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def begin(self, target, cache, tree, config, rng):
        super().begin(target, cache, tree, config, rng)
        self.gen = torch.Generator().manual_seed(self.seed)
        self.vocab = target.config.vocab_size

    def _root_logits(self, root):
        return torch.randn(root.shape[0], self.vocab, generator=self.gen)

    def _level_logits(self, tokens, positions, mask, tree_tokens):
        return torch.randn(*tokens.shape, self.vocab, generator=self.gen)


TREES = {
    "chain4": "chain:4",
    "paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]],
    "beam": "3,4,4",
    "chain1": "chain:1",
}
PROPOSERS = {
    "random": lambda: RandomDraft(seed=1),
    "pld": lambda: PromptLookup(max_ngram=3),
    "streaming": lambda: StreamingSelfSpec(window=8, sinks=2),
}


def spec_of(name):
    tree = TREES[name]
    return TreeSpec.from_paths(tree) if isinstance(tree, list) else TreeSpec.parse(tree)


@pytest.fixture(scope="module")
def targets(tiny_model_factory):
    out = {}
    for family in ("llama", "qwen3"):
        _, path = tiny_model_factory(f"spec-{family}", family, max_position_embeddings=512, seed=3)
        out[family] = load_target(path)
    return out


def prompts_for(batch: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch):
        n = 12 + 9 * i
        base = torch.randint(0, 160, (6,), generator=gen).tolist()
        prompts.append((base * 4)[:n // 2] + torch.randint(0, 160, (n - n // 2,), generator=gen).tolist())
    return prompts


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_speculative_equals_autoregressive(targets, family, proposer, tree, batch):
    target = targets[family]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = prompts_for(batch, seed=batch * 7 + len(tree))
    expected = Generator(target).generate(prompts, config).sequences
    out = Generator(target, proposer=PROPOSERS[proposer](), tree=spec_of(tree)).generate(prompts, config)
    assert out.sequences == expected
    assert all(len(s) == 24 for s in out.sequences)
    assert 1.0 <= out.stats["tau"] <= spec_of(tree).depth + 1
    rounds = sum(out.stats["accepted_hist"])  # one entry per (row, round)
    assert out.stats["steps"] <= rounds <= out.stats["steps"] * batch


def test_greedy_lossless_with_eos_per_row(targets):
    target = targets["llama"]
    prompts = prompts_for(3, seed=11)
    free = Generator(target).generate(prompts, GenerationConfig(max_new_tokens=20, ignore_eos=True)).sequences
    eos = free[1][6]  # row 1 stops at its 7th token (or earlier if that token came before)
    config = GenerationConfig(max_new_tokens=20, eos_token_id=eos)
    expected = Generator(target).generate(prompts, config).sequences
    assert expected[1][-1] == eos and len(expected[1]) <= 7
    for proposer, tree in itertools.product(PROPOSERS, ("chain4", "beam")):
        out = Generator(target, proposer=PROPOSERS[proposer](), tree=spec_of(tree)).generate(prompts, config)
        assert out.sequences == expected, (proposer, tree)


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_tau_is_depth_plus_one_when_draft_is_the_target(targets, depth):
    """StreamingSelfSpec whose window covers the whole context *is* the target: under greedy
    decoding every draft token is accepted, so tau = depth + 1 exactly."""
    target = targets["llama"]
    prompts = prompts_for(2, seed=5)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    out = Generator(target, proposer=StreamingSelfSpec(window=500), tree=TreeSpec.chain(depth)).generate(
        prompts, config)
    assert out.sequences == Generator(target).generate(prompts, config).sequences
    assert out.stats["tau"] == depth + 1
    hist = out.stats["accepted_hist"]
    assert hist[depth] == sum(hist)  # every round accepted all `depth` draft tokens


def test_random_draft_accepts_little(targets):
    target = targets["llama"]
    out = Generator(target, proposer=RandomDraft(), tree=TreeSpec.chain(4)).generate(
        prompts_for(1, 2), GenerationConfig(max_new_tokens=30, ignore_eos=True))
    assert out.stats["tau"] < 1.5
    assert {"draft_s", "verify_s", "other_s", "tokens_per_s", "steps"} <= set(out.stats)


@pytest.fixture(scope="module")
def small_vocab_target(tiny_model_factory):
    _, path = tiny_model_factory("spec-v8", "llama", vocab_size=8, max_position_embeddings=128, seed=9)
    return load_target(path)


def exact_two_token_distribution(target, prompt, config) -> torch.Tensor:
    """p(x1, x2 | prompt) under the warped target, by enumeration: [V, V]."""
    v = target.config.vocab_size
    cache = target.new_cache(1, len(prompt) + 2)
    first = target.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache)
    p1 = warp_probs(first, config.temperature, config.top_k, config.top_p)[0]
    joint = torch.zeros(v, v)
    for x1 in range(v):
        c = target.new_cache(1, len(prompt) + 2)
        logits = target.prefill(torch.tensor([prompt + [x1]]), torch.tensor([len(prompt) + 1]), c)
        joint[x1] = p1[x1] * warp_probs(logits, config.temperature, config.top_k, config.top_p)[0]
    return joint


def assert_two_token_distribution(target, prompt, config, sequences) -> None:
    """Chi-square of the first two tokens of ``sequences`` against the exact warped target
    distribution after ``prompt`` (and no token the warped target gives probability 0)."""
    v = target.config.vocab_size
    counts = torch.zeros(v, v)
    for seq in sequences:
        counts[seq[0], seq[1]] += 1
    expected = exact_two_token_distribution(target, prompt, config).flatten() * len(sequences)
    keep = expected > 0
    assert counts.flatten()[~keep].sum() == 0, "sampled a token the warped target gives probability 0"
    big = expected[keep] >= 5
    obs, exp = counts.flatten()[keep][big], expected[keep][big]
    p_value = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p_value > 1e-3, p_value


@pytest.mark.parametrize("proposer,tree", [
    ("streaming", "chain:3"),  # children drawn from the draft: residual rule
    ("streaming", "2,3"),  # deterministic beam children: point-mass rule
    ("random", "chain:2"),
    ("streaming", "[[0],[1],[2],[0,0],[1,0]]"),  # siblings drawn without replacement (Gumbel-top-k)
    ("random", "[[0],[1],[0,0],[0,1]]"),
])
def test_sampling_matches_target_distribution(small_vocab_target, proposer, tree):
    """20000 independent rows in one batch; chi-square of the first two tokens against the exact
    warped target distribution (temperature 0.8, top-p 0.9)."""
    target, n = small_vocab_target, 20000
    prompt = [1, 5, 2, 7, 3, 0, 6]
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    draft = StreamingSelfSpec(window=2, sinks=1) if proposer == "streaming" else RandomDraft(seed=4)
    out = Generator(target, proposer=draft, tree=TreeSpec.parse(tree)).generate([prompt] * n, config)
    assert_two_token_distribution(target, prompt, config, out.sequences)


def test_sampling_with_a_lookup_tail_matches_target_distribution(small_vocab_target):
    """The hybrid with levels of one node (filled by the lookup chain on a repetitive prompt)
    under sampling: the same chi-square test against the exact warped target."""
    from longspec.decoding.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    target, n = small_vocab_target, 20000
    prompt = [1, 5, 2, 1, 5, 2, 1, 5, 2, 1]
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9, seed=321, ignore_eos=True)
    draft = init_draft(DraftConfig.for_target(target, window=4), target, seed=5)
    out = Generator(target, LongSpecProposer(draft, PromptLookup()), "2,1,1").generate([prompt] * n, config)
    assert out.stats["tau"] > 1.0
    assert_two_token_distribution(target, prompt, config, out.sequences)


def test_bad_tree_and_room_errors(targets):
    target = targets["llama"]
    with pytest.raises(ValueError, match="width"):
        TreeSpec.parse("4,0,2")
    with pytest.raises(ValueError):
        Generator(target, proposer=PromptLookup(), tree=TreeSpec.parse("200")).generate(
            [[1, 2, 3]], GenerationConfig(max_new_tokens=4))
    gen = Generator(target, proposer=PromptLookup(), tree=TreeSpec.chain(8), max_len=40)
    with pytest.raises(ValueError, match="tree slots"):
        gen.generate([[1] * 30], GenerationConfig(max_new_tokens=5))


def test_prompt_lookup_history_holds_every_emitted_token(targets):
    target = targets["llama"]
    prompt = prompts_for(1, seed=9)[0]
    lookup = PromptLookup()
    out = Generator(target, proposer=lookup, tree=TreeSpec.chain(3)).generate(
        [prompt], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    expected = prompt + out.sequences[0]
    assert lookup.history[0][:len(expected)] == expected


def test_tokens_per_s_counts_decoded_tokens_only(targets):
    out = Generator(targets["llama"]).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=1))
    assert out.stats["new_tokens"] == 1 and out.stats["tokens_per_s"] == 0


def test_proposer_shared_by_two_generators(targets):
    """A proposer object used by two generators in turn (each keeps its engine): both stay right."""
    target = targets["llama"]
    prompts = prompts_for(2, seed=13)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    expected = Generator(target).generate(prompts, config).sequences
    shared = StreamingSelfSpec(window=8, sinks=2)
    first, second = (Generator(target, proposer=shared, tree="3,4,4") for _ in range(2))
    for gen in (first, second, first, second):
        assert gen.generate(prompts, config).sequences == expected


@pytest.mark.parametrize("proposer", ["none", "streaming", "pld", "hybrid"])
def test_sequences_join_and_leave_between_rounds(targets, proposer):
    """Engine.step with requests added while others run, in rows freed by finished ones: each
    output equals the request generated alone. Rounds run over the smallest batch bucket that
    holds the active rows (1, 2 or 3 here), and every bucket is used."""
    from longspec.decoding.engine import Engine, Sequence
    from longspec.decoding.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    target = targets["qwen3"]
    prompts = prompts_for(3, seed=21) + prompts_for(2, seed=22)
    budgets = [5, 14, 9, 12, 7]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]
    if proposer == "hybrid":
        draft = LongSpecProposer(init_draft(DraftConfig.for_target(target, window=8), target, seed=2), PromptLookup())
    else:
        draft = {"none": None, "streaming": StreamingSelfSpec(window=8, sinks=2), "pld": PromptLookup()}[proposer]
    engine = Engine(target, draft, None if draft is None else TreeSpec.parse("2,3,3"), max_batch=3, max_len=96)
    assert engine.buckets == [1, 2, 3]
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert {n for _, n in engine.runners} == {1, 2, 3}


@pytest.mark.parametrize("proposer", ["streaming", "pld", "hybrid"])
def test_buckets_with_trees_of_their_own_equal_alone(targets, proposer):
    """Buckets may draft smaller trees than the engine's (less speculation where many rows share a
    round): requests moving between buckets, and so between trees, still get exactly the tokens
    they get alone; a tree that does not fit, or a bucket that is none, is refused up front."""
    from longspec.decoding.engine import Engine, Sequence
    from longspec.decoding.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    target = targets["qwen3"]
    prompts = prompts_for(3, seed=23) + prompts_for(2, seed=24)
    budgets = [6, 13, 9, 11, 8]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]

    def make():
        if proposer == "hybrid":
            draft = init_draft(DraftConfig.for_target(target, window=8), target, seed=2)
            return LongSpecProposer(draft, PromptLookup())
        return {"streaming": StreamingSelfSpec(window=8, sinks=2), "pld": PromptLookup()}[proposer]

    smaller = {2: "2,2", 3: "2"}
    engine = Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees=smaller)
    assert [engine.view(n).tree for n in (1, 2, 3)] == [TreeSpec.parse(t) for t in ("2,3,3", "2,2", "2")]
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert {n for _, n in engine.runners} == {1, 2, 3}
    assert [engine.view(n).draft_tree.num_nodes for n in (1, 2, 3)] == [9, 5, 3]  # what each bucket drafted
    # a bucket that decodes plainly (where no tree pays): rows moving from and back into drafting
    # buckets keep the proposer's state (draft ring buffer, lookup history) up to date
    engine = Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "plain"})
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert engine.view(2).draft_tree is None and engine.view(3).draft_tree.num_nodes == 9
    # only the draft has state to bring up to date in a plain round: the others run the target alone
    assert len(engine.runners[True, 2].phases) == (2 if proposer == "hybrid" else 1)
    assert len(engine.phase_times()) == 2 and all(t >= 0 for t in engine.phase_times())

    class Unaware(PromptLookup):  # a proposer that does not say it can follow plain rounds
        follows_plain_rounds = False

    with pytest.raises(ValueError, match="cannot follow plain rounds"):
        Engine(target, Unaware(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "plain"})
    if proposer == "hybrid":  # plain rounds write the tokens they decode into the draft's window
        alone_plain = Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=1, max_len=96,
                             bucket_trees={1: "plain"})
        single = Sequence(prompts[0], 6)
        alone_plain.add([single])
        while alone_plain.has_active:
            alone_plain.step()
        proposer_, full = alone_plain.proposer, torch.tensor(prompts[0] + single.tokens)
        ring, last = proposer_.ring, len(prompts[0]) + 4  # the 5 roots fed to the plain rounds end here
        index = torch.arange(last - ring.window + 1, last + 1)
        k, _ = proposer_.draft.window_kv(full[index][None], index[None])
        slots = index % ring.size
        assert torch.equal(ring.slot_index[0, slots], index)
        torch.testing.assert_close(ring.k[0][:, slots], k[0])
    with pytest.raises(ValueError, match="does not fit"):
        Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "2,2,2,2"})
    with pytest.raises(ValueError, match="not buckets"):
        Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=4, max_len=96, bucket_trees={3: "2"})
    if proposer == "hybrid":  # (a chain is allowed: the hybrid's lookup then drafts it alone)
        with pytest.raises(ValueError, match="beam trees"):
            Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "1,2"})


def run_joining(engine, seqs: list) -> None:
    """Runs ``seqs`` on ``engine``: one alone (bucket 1), then two (bucket 2), then the others as
    rows free up."""
    engine.add(seqs[:1])
    engine.step()
    engine.add(seqs[1:2])
    engine.step()
    waiting = seqs[2:]
    while engine.has_active or waiting:
        if waiting and engine.free_rows():
            engine.add([waiting.pop(0)])
        engine.step()


def test_room_is_exactly_what_a_round_writes(tiny_model_factory):
    """A 254-token prompt with max_new_tokens=1 fits a 256-token model with or without a tree
    (no round runs); each extra token needs one slot, plus the tree's nodes for a round."""
    _, path = tiny_model_factory("room-256", "llama", max_position_embeddings=256, seed=5)
    target = load_target(path)
    prompt = torch.randint(0, 160, (254,), generator=torch.Generator().manual_seed(0)).tolist()
    one = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    expected = Generator(target).generate([prompt], one).sequences
    assert Generator(target, proposer=PromptLookup(), tree="chain:1").generate([prompt], one).sequences == expected
    three = GenerationConfig(max_new_tokens=3, ignore_eos=True)  # 254 + 3 - 2 + 1 = 256 slots
    expected = Generator(target).generate([prompt], three).sequences
    with pytest.raises(ValueError, match="257 positions"):  # 254 + 3 - 2 + 2 tree nodes
        Generator(target, proposer=PromptLookup(), tree="chain:1").generate([prompt], three)
    short = prompt[:253]
    assert (Generator(target, proposer=PromptLookup(), tree="chain:1").generate([short], three).sequences
            == Generator(target).generate([short], three).sequences)
    with pytest.raises(ValueError, match="257 positions"):
        Generator(target).generate([prompt], GenerationConfig(max_new_tokens=4, ignore_eos=True))


@pytest.mark.parametrize("tree", [[3, 4, 4], (3, 4, 4), [[0], [1], [0, 0]], TreeSpec.parse("3,4,4"), "3,4,4"])
def test_tree_given_in_any_form(targets, tree):
    gen = Generator(targets["llama"], proposer=PromptLookup(), tree=tree)
    assert gen.tree == TreeSpec.coerce(tree)
    assert len(gen.generate([[1, 2, 3, 1, 2]], GenerationConfig(max_new_tokens=6, ignore_eos=True)).sequences[0]) == 6


@pytest.mark.parametrize("tree,message", [(3.5, "got float"), ([1, [0]], "beam widths"), ([], "got list"),
                                         ({"w": 1}, "got dict")])
def test_tree_of_a_wrong_type_is_named(targets, tree, message):
    with pytest.raises(ValueError, match=message):
        Generator(targets["llama"], proposer=PromptLookup(), tree=tree)


def reference_candidates(context: list, max_ngram: int, min_ngram: int, candidates: int) -> list:
    """Prompt lookup by hand: for n = max_ngram down to min_ngram, every earlier occurrence of the
    context's last n tokens (most recent first) proposes the token that followed it."""
    found = []
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail and context[start + n] not in found:
                found.append(context[start + n])
                if len(found) >= candidates:
                    return found
    return found


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_device_prompt_lookup_matches_the_reference(targets, max_ngram, min_ngram):
    """The vectorised lookup ranks exactly the candidates the by-hand search finds, for the
    root (history only) and for tree nodes (history + the node's path)."""
    from longspec.cache import KVCache

    target = targets["llama"]
    gen = torch.Generator().manual_seed(max_ngram * 10 + min_ngram)
    tree = TreeSpec.parse("2,3")
    lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, candidates=4)
    lookup.begin(target, KVCache(target.config, 3, 64), tree, GenerationConfig(), None)
    histories = [torch.randint(0, 5, (n,), generator=gen).tolist() for n in (30, 7, 1)]
    for row, h in enumerate(histories):
        lookup.add(row, h[:-1], h[-1])
    empty = torch.zeros(3, 1, 0, dtype=torch.long)
    root = lookup._lookup(empty)
    paths = torch.randint(0, 5, (3, 4, 2), generator=gen)
    nodes = lookup._lookup(paths)
    firsts = [lookup.first_candidate(empty), lookup.first_candidate(paths)]  # the hybrid chain's shortcut
    for row, h in enumerate(histories):
        contexts = [(h, root[row, 0], (0, 0))] + [(h + paths[row, j].tolist(), nodes[row, j], (1, j))
                                                  for j in range(4)]
        for context, logits, (which, j) in contexts:
            expected = reference_candidates(context, max_ngram, min_ngram, 4)
            ranked = [int(t) for t in logits.argsort(descending=True)[:len(expected)]]
            assert ranked == expected, (context, ranked, expected)
            assert int((logits > -1e4).sum()) == len(expected)
            found, token = (t[row, j] for t in firsts[which])
            assert bool(found) == bool(expected) and (not expected or int(token) == expected[0])


@pytest.mark.parametrize("tree", ["2,3", "chain:3"])
def test_engine_with_per_row_sampling(small_vocab_target, tree):
    """One engine, rows with their own settings: greedy rows give exactly the greedy output; the
    sampled rows (T=0.8, top-p 0.9) follow the exact two-token target distribution."""
    from longspec.decoding.engine import Engine, Sequence
    from longspec.decoding.sampling import RowSampling

    target, n = small_vocab_target, 6000
    prompt = [1, 5, 2, 7, 3, 0, 6]
    greedy = Generator(target).generate([prompt], GenerationConfig(max_new_tokens=6, ignore_eos=True)).sequences[0]
    engine = Engine(target, StreamingSelfSpec(window=2, sinks=1), TreeSpec.parse(tree), max_batch=n + 2,
                    max_len=64, config=RowSampling.zeros(n + 2, "cpu"))
    engine.uniforms.generator = torch.Generator().manual_seed(7)
    seqs = [Sequence(prompt, 6)] + [Sequence(prompt, 2, temperature=0.8, top_p=0.9) for _ in range(n)]
    seqs.append(Sequence(prompt, 6))
    engine.add(seqs)
    while engine.has_active:
        engine.step()
    assert seqs[0].tokens == greedy and seqs[-1].tokens == greedy
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9)
    assert_two_token_distribution(target, prompt, config, [s.tokens for s in seqs[1:-1]])


def test_siblings_beyond_the_draft_support_are_never_tried(small_vocab_target):
    """top-p 0.5 leaves the draft one or two tokens, fewer than the three siblings the tree asks
    for: the extra draws are not real draws and must not be accepted (the residual is sampled)."""
    target, n = small_vocab_target, 20000
    prompt = [1, 5, 2, 7, 3, 0, 6]
    config = GenerationConfig(max_new_tokens=2, temperature=1.0, top_p=0.5, seed=11, ignore_eos=True)
    out = Generator(target, proposer=RandomDraft(seed=2), tree="[[0],[1],[2],[0,0],[1,0]]").generate(
        [prompt] * n, config)
    assert_two_token_distribution(target, prompt, config, out.sequences)


@pytest.mark.parametrize("proposer", ["pld", "streaming"])
def test_idle_rows_survive_many_rounds(targets, proposer):
    """A row that finished early keeps taking part in (masked) rounds while another one runs far
    longer: nothing it holds may outgrow its buffers."""
    from longspec.decoding.engine import Engine, Sequence

    target = targets["llama"]
    gen = torch.Generator().manual_seed(4)
    short, long = (torch.randint(0, 160, (n,), generator=gen).tolist() for n in (40, 10))
    draft = PromptLookup() if proposer == "pld" else StreamingSelfSpec(window=8, sinks=2)
    engine = Engine(target, draft, TreeSpec.parse("chain:5"), max_batch=2, max_len=70)
    seqs = [Sequence(short, 2), Sequence(long, 52)]
    engine.add(seqs)
    while engine.has_active:
        engine.step()
    alone = Generator(target).generate([long], GenerationConfig(max_new_tokens=52, ignore_eos=True)).sequences[0]
    assert seqs[1].tokens == alone and engine.rounds > 30


def test_warm_up_prepares_every_bucket_and_changes_nothing(targets):
    """Engine.warm_up on an empty engine creates each bucket's runner; the tokens generated
    afterwards are those of a fresh engine."""
    from longspec.decoding.engine import Engine, Sequence

    target = targets["llama"]
    prompt, config = prompts_for(1, seed=5)[0], GenerationConfig(max_new_tokens=9, ignore_eos=True)
    expected = Generator(target, PromptLookup(), "2,2").generate([prompt], config).sequences[0]
    engine = Engine(target, PromptLookup(), TreeSpec.parse("2,2"), max_batch=5, max_len=64)
    engine.warm_up(sampled=True)
    assert set(engine.runners) == {(g, n) for g in (True, False) for n in (1, 2, 4, 5)}
    seq = Sequence(prompt, 9)
    engine.add([seq])
    while engine.has_active:
        engine.step()
    assert seq.tokens == expected
    engine.add([Sequence(prompt, 20)])
    with pytest.raises(RuntimeError, match="empty engine"):
        engine.warm_up()


def test_warm_up_tells_the_proposer_each_kind_of_round(targets, monkeypatch):
    """Each runner is prepared (captured, on CUDA) with the proposer drafting for its kind of
    round: greedy rounds never draw children from the draft distribution; and a proposer that
    cannot run on part of the batch gets one bucket."""
    from longspec.decoding import runner as runner_module
    from longspec.decoding.engine import Engine
    from longspec.decoding.proposers import Proposer
    from longspec.decoding.sampling import RowSampling

    seen = {}
    monkeypatch.setattr(runner_module.PhaseRunner, "prepare",
                        lambda self: seen.setdefault(id(self), self.phases[0].args[0].proposer.sample_children))
    target = targets["llama"]
    engine = Engine(target, PromptLookup(), TreeSpec.parse("chain:3"), max_batch=2, max_len=64,
                    config=RowSampling.zeros(2, "cpu"))
    engine.warm_up(sampled=True)
    assert {key: seen[id(r)] for key, r in engine.runners.items()} == {
        (True, 1): False, (True, 2): False, (False, 1): True, (False, 2): True}

    class Whole(Proposer):  # no rows(): not narrowable
        def begin(self, target, cache, tree, config, rng):
            pass

    assert Engine(target, Whole(), TreeSpec.parse("chain:2"), max_batch=4, max_len=64).buckets == [4]


def test_one_engine_serves_every_length_and_is_freed_at_once_when_replaced(targets):
    """Calls with other prompt lengths, max_new_tokens and sampling settings reuse the generator's
    engine (its pool, proposer state and graphs); a call with more prompts than it has rows
    replaces it, and the old one is released (its caches) without waiting for a garbage
    collection: the engine holds no reference cycle once closed."""
    import gc
    import weakref

    target = targets["llama"]
    gen = Generator(target, PromptLookup(), "2,2")
    gen.generate([prompts_for(1, seed=1)[0]], GenerationConfig(max_new_tokens=5, ignore_eos=True))
    first = gen._engine
    gen.generate([prompts_for(1, seed=2)[0][:7]], GenerationConfig(max_new_tokens=9, ignore_eos=True))
    gen.generate([prompts_for(1, seed=3)[0]], GenerationConfig(max_new_tokens=4, temperature=0.7, seed=1))
    assert gen._engine is first
    assert Generator(target, gen.proposer, "2,2")._engine is None  # (built on its first call)
    old = weakref.ref(first)
    del first
    gc.disable()
    try:
        gen.generate(prompts_for(2, seed=4), GenerationConfig(max_new_tokens=9, ignore_eos=True))
        assert old() is None and len(gen._engine.rows) == 2
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["pld", "hybrid"])
def test_the_old_cache_is_freed_before_a_new_engine_allocates(targets, kind, monkeypatch):
    """A proposer kept for the target's next engine (one with more rows) no longer holds the old
    engine's KV pool (and views of it) while the new one is allocated: peak memory stays one
    pool. A later generator of the same target and proposer reuses the engine."""
    import weakref

    from longspec.models.draft import DraftConfig, init_draft

    target = targets["llama"]
    proposer = (PromptLookup() if kind == "pld" else
                LongSpecProposer(init_draft(DraftConfig.for_target(target, window=16), target, seed=0), PromptLookup()))
    gen = Generator(target, proposer, "2,2")
    gen.generate([prompts_for(1, seed=1)[0]], GenerationConfig(max_new_tokens=5, ignore_eos=True))
    old_pool = weakref.ref(gen._engine.pool.k)
    alive_at_allocation = []
    new_cache = target.new_cache

    def recording_new_cache(*args, **kwargs):
        alive_at_allocation.append(old_pool() is not None)
        return new_cache(*args, **kwargs)

    monkeypatch.setattr(target, "new_cache", recording_new_cache)
    gen.generate(prompts_for(2, seed=2), GenerationConfig(max_new_tokens=9, ignore_eos=True))
    assert alive_at_allocation == [False]
    engine = gen._engine
    del gen
    again = Generator(target, proposer, "2,2")
    again.generate([prompts_for(1, seed=3)[0]], GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert again._engine is engine and alive_at_allocation == [False]


def test_sampled_prefill_after_a_captured_round_draws_fresh_numbers(targets):
    """A request joining with sampling after rounds used a static random buffer (as captured
    CUDA-graph rounds do) draws its first token from fresh numbers, not past that buffer's end."""
    from longspec.decoding.engine import Engine, Sequence
    from longspec.decoding.sampling import RowSampling

    target = targets["llama"]
    engine = Engine(target, PromptLookup(), TreeSpec.parse("2,2"), max_batch=2, max_len=64,
                    config=RowSampling.zeros(2, "cpu"))
    engine.uniforms.make_static(3)
    engine.uniforms.used = 3  # a round consumed the whole static buffer
    seq = Sequence(prompts_for(1, seed=3)[0], 4, temperature=1.0)
    engine.add([seq])
    while engine.has_active:
        engine.step()
    assert len(seq.tokens) == 4


def test_collector_paused_collects_first_and_pauses():
    """Captures run inside ``collector_paused``: dead reference cycles are collected before the
    block (so a dead engine's CUDA graphs are never reset mid-capture) and the automatic
    collector (and Dynamo's collection after a compilation) stays off inside it, on again after
    (also after an error)."""
    import gc

    from longspec.decoding.runner import collector_paused

    collected = []

    class Cycle:
        def __del__(self):
            collected.append(1)

    def make_dead_cycle():
        c = Cycle()
        c.me = c

    assert gc.isenabled()
    make_dead_cycle()
    import torch._dynamo

    with collector_paused():
        assert collected == [1]
        assert not gc.isenabled() and not torch._dynamo.config.run_gc_after_compile
    assert gc.isenabled() and torch._dynamo.config.run_gc_after_compile
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("boom")
    assert gc.isenabled()
