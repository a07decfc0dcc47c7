"""Speculative decoding under sampling: the first two tokens follow the exact warped target
distribution (chi-square against enumeration) for sampled and deterministic tree children,
siblings drawn without replacement, a prompt-lookup tail, rows with their own settings in one
engine, and tree siblings beyond the draft's support."""
import pytest
import torch
from scipy import stats

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.spec.proposers import PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.sampling import warp_probs
from longspec.spec.tree import TreeSpec
from test_speculative import RandomDraft


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


@pytest.mark.parametrize("prompt", [[1, 5, 2, 7, 3, 0, 6], [1, 5, 2, 1, 5, 2, 1, 5]])
def test_sampling_with_lookup_chains_matches_target_distribution(small_vocab_target, prompt):
    """Prompt lookup's chains, sampled on a CPU: after a prompt of distinct tokens no row matches
    2 tokens, so the rounds draft nothing (decode steps); after a repeating one they draft the
    chain. Either way the first two tokens follow the exact warped target distribution."""
    target, n = small_vocab_target, 20000
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9, seed=321, ignore_eos=True)
    out = Generator(target, proposer=PromptLookup(), tree="chain:3").generate([prompt] * n, config)
    assert_two_token_distribution(target, prompt, config, out.sequences)


def test_sampling_with_a_lookup_tail_matches_target_distribution(small_vocab_target):
    """The hybrid with levels of one node (filled by the lookup chain on a repetitive prompt)
    under sampling: the same chi-square test against the exact warped target."""
    from longspec.spec.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    target, n = small_vocab_target, 20000
    prompt = [1, 5, 2, 1, 5, 2, 1, 5, 2, 1]
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9, seed=321, ignore_eos=True)
    draft = init_draft(DraftConfig.for_target(target, window=4), target, seed=5)
    out = Generator(target, LongSpecProposer(draft, PromptLookup()), "2,1,1").generate([prompt] * n, config)
    assert out.stats["tau"] > 1.0
    assert_two_token_distribution(target, prompt, config, out.sequences)


@pytest.mark.parametrize("tree", ["2,3", "chain:3"])
def test_engine_with_per_row_sampling(small_vocab_target, tree):
    """One engine, rows with their own settings: greedy rows give exactly the greedy output; the
    sampled rows (T=0.8, top-p 0.9) follow the exact two-token target distribution."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.sampling import RowSampling

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
