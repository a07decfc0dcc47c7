"""Speculative decoding through ``Generator``, greedy: output equals autoregressive output token for
token (random draft, prompt lookup, StreamingLLM self-speculation; chain, static and beam trees;
batch 1 and 3; rows ending at EOS), tau accounting, the room a round needs, trees given in any
form, the vectorised prompt lookup against a by-hand search, errors."""
import itertools
from typing import Optional

import numpy as np
import pytest
import torch

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.spec.proposers import PromptLookup, TreeDrafter
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec


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


def test_prompt_lookup_takes_a_prompt_and_first_token_in_any_form(targets):
    """An engine gives the prompt as a tensor on the device and the first token as a 0-d tensor
    (not read yet); a caller may give lists and ints: the same history, its last ``capacity``
    tokens where the prompt is longer."""
    from longspec.spec.sampling import Uniforms

    target = targets["llama"]
    cache = target.new_cache(2, 64)
    lookup = PromptLookup()
    lookup.begin(target, cache, TreeSpec.chain(3), GenerationConfig(), Uniforms(None, target.device))
    prompt = list(range(3, 3 + lookup.capacity + 5))
    lookup.add(0, prompt, 7)
    lookup.add(1, torch.tensor(prompt), torch.tensor(7))
    assert lookup.history[0] == lookup.history[1] == (prompt + [7])[-lookup.capacity:]
    lookup.add(1, np.asarray(prompt[:9]), torch.tensor(8))
    assert lookup.history[1] == prompt[:9] + [8]


def test_prompt_lookup_marks_a_row_that_found_nothing_as_proposing_nothing(targets):
    """A CPU chain round in which one row's lookup matched and another's did not: the other's
    (arbitrary) tokens are marked as no proposal, so verifying them samples what that row's plain
    round would (its sample does not depend on whether a neighbour matched)."""
    from longspec.spec.sampling import Uniforms

    target = targets["llama"]
    cache = target.new_cache(2, 64)
    lookup = PromptLookup()
    lookup.begin(target, cache, TreeSpec.chain(3), GenerationConfig(), Uniforms(None, target.device))
    lookup.add(0, [5, 9, 13, 5, 9, 13, 5], 9)  # its tail "5 9" occurs before: a match
    lookup.add(1, [20, 21, 22, 23, 24, 25, 26], 27)  # every token new: nothing
    cache.lengths.fill_(8)
    tree = lookup.propose(torch.tensor([9, 27]))
    assert tree.num_nodes == 4 and tree.tokens[0, 1:].tolist() == [13, 5, 9]
    assert tree.valid[0].all() and tree.valid[1].tolist() == [True, False, False, False]


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


def reference_continuation(context: list, max_ngram: int, min_ngram: int, depth: int) -> tuple:
    """Prompt lookup decoding's chain by hand: (the tokens matched, the tokens after the best
    earlier occurrence of the context's tail (longest, then most recent), copied on one at a time
    (a copy that reaches the end copies what it has just copied)); (0, None) where nothing
    matches."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == context[-n:]:
                text = list(context)
                for i in range(depth):
                    text.append(text[start + n + i])
                return n, text[len(context):]
    return 0, None


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
@pytest.mark.parametrize("depth", [1, 4, 9])
def test_a_lookup_chain_is_the_copied_continuation_of_the_best_match(targets, max_ngram, min_ngram, depth):
    """A prompt-lookup chain (alone or in the hybrid's tree) is one search: the follower of the
    best match of the history's tail and the tokens after it, wrapping past the history's end
    (a repeating motif, a match just before the end), as the by-hand copy gives, with the number
    of tokens matched (0 exactly where nothing matches). On a CPU a chain round drafts only where
    some row in use matched 2 tokens or more (``max_ngram`` at most), else its tree is the root
    alone (a decode step)."""
    from longspec.kv.cache import KVCache

    target = targets["llama"]
    gen = torch.Generator().manual_seed(depth * 100 + max_ngram * 10 + min_ngram)
    lookup, cache = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram), KVCache(target.config, 5, 64)
    lookup.begin(target, cache, TreeSpec.chain(depth), GenerationConfig(), None)
    motif = torch.randint(0, 160, (6,), generator=gen).tolist()
    histories = [motif * 4 + motif[:2], torch.randint(0, 4, (40,), generator=gen).tolist(), [7, 8, 9],
                 [5, 6, 5, 6, 5], [3, 1, 2, 3]]
    for row, h in enumerate(histories):
        lookup.add(row, h[:-1], h[-1])
    matched, tokens = lookup.continuation(depth)
    for row, h in enumerate(histories):
        n, expected = reference_continuation(h, max_ngram, min_ngram, depth)
        assert int(matched[row]) == n, (h, expected)
        if expected is not None:
            assert tokens[row].tolist() == expected, (h, tokens[row].tolist(), expected)
    root = torch.tensor([h[-1] for h in histories])
    cache.lengths.copy_(torch.tensor([len(h) - 1 for h in histories]))  # (rows in use: their text cached)
    tree = lookup.propose(root)  # (a row matches min(2, max_ngram) tokens: the motif's)
    assert tree.num_nodes == depth + 1 and tree.depth == depth
    assert torch.equal(tree.tokens[:, 1:], tokens) and tree.parents[0].tolist() == list(range(-1, depth))
    assert tree.draft_probs is None and not tree.children_sampled
    cache.lengths.zero_()  # (free rows, riding along in a bucket's rounds, draft nothing)
    alone = lookup.propose(root)
    assert alone.num_nodes == 1 and alone.depth == 0 and torch.equal(alone.tokens[:, 0], root)


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_device_prompt_lookup_matches_the_reference(targets, max_ngram, min_ngram):
    """The vectorised lookup ranks exactly the candidates the by-hand search finds, for the
    root (history only) and for tree nodes (history + the node's path)."""
    from longspec.kv.cache import KVCache

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
    for row, h in enumerate(histories):
        contexts = [(h, root[row, 0])] + [(h + paths[row, j].tolist(), nodes[row, j]) for j in range(4)]
        for context, logits in contexts:
            expected = reference_candidates(context, max_ngram, min_ngram, 4)
            ranked = [int(t) for t in logits.argsort(descending=True)[:len(expected)]]
            assert ranked == expected, (context, ranked, expected)
            assert int((logits > -1e4).sum()) == len(expected)


def test_prompt_lookups_default_chain_is_shorter_on_a_cpu(targets):
    """A CPU's step over more than 4 tokens costs about 3x a decode step (its few-row products
    stop at 4 rows), where its chain of 5 ran slower than plain decoding: a Generator (and the
    CLI) on a CPU drafts a chain of 3 by default, a GPU one of 5; a tree given is kept."""
    from longspec.spec.proposers import default_tree

    assert default_tree("pld", "cpu") == "chain:3" and default_tree("pld", "cuda") == default_tree("pld") == "chain:5"
    assert default_tree("hybrid", "cpu") == default_tree("hybrid")
    assert default_tree("pld", "cuda:1") == "chain:5"
    assert Generator(targets["llama"], "pld").tree == TreeSpec.parse("chain:3")
    assert Generator(targets["llama"], "pld", "chain:5").tree == TreeSpec.parse("chain:5")
