"""The LongSpec draft: constant memory, losslessness as a proposer, training/inference
equivalence, checkpoints (ours and the published layout) and mismatch errors."""
import json

import pytest
import torch
from safetensors.torch import save_file

from longspec import GenerationConfig, load_target
from longspec.attention import triton_kernels
from longspec.engine.engine import Engine
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer
from longspec.spec.tree import TreeSpec
from longspec.models.checkpoint import load_draft, save_draft
from longspec.models.draft import DraftCache, DraftConfig, init_draft


def noisy_draft(target, window=8, seed=0, std=0.2):
    """A random draft with weights large enough to make confident (mostly wrong) proposals."""
    draft = init_draft(DraftConfig.for_target(target, window=window), target, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return draft


@pytest.fixture(scope="module")
def targets(tiny_model_factory):
    out = {}
    for seed, (name, family, kwargs) in enumerate((
        ("llama", "llama", {}),
        ("qwen2-mha", "qwen2", {"num_key_value_heads": 4}),
        ("llama-yarn", "llama", {"rope": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama-dynamic", "llama", {"rope": {"rope_type": "dynamic", "factor": 2.0}}),
    )):
        kwargs = dict(kwargs)
        rope = kwargs.pop("rope", None)
        _, path = tiny_model_factory(f"draft-{name}", family, rope, max_position_embeddings=256, seed=5 + seed,
                                     **kwargs)
        out[name] = load_target(path)
    return out


def prompts_for(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (10 + 7 * i,), generator=gen).tolist() for i in range(batch)]


def assert_greedy_lossless(target, draft, trees, seed: int) -> None:
    """Greedy speculative output with ``draft`` equals plain decoding's on two prompts, each tree."""
    prompts = prompts_for(2, seed=seed)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    expected = Generator(target).generate(prompts, config).sequences
    for tree in trees:
        assert Generator(target, proposer=LongSpecProposer(draft), tree=tree).generate(prompts, config).sequences \
            == expected


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree", ["chain:4", "[[0],[1],[0,0],[0,1],[0,0,0]]", "3,4,4"])
@pytest.mark.parametrize("name", ["llama", "qwen2-mha", "llama-yarn", "llama-dynamic"])
def test_longspec_proposer_is_lossless(targets, name, tree, batch):
    target = targets[name]
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    prompts = prompts_for(batch, seed=batch + len(tree))
    expected = Generator(target).generate(prompts, config).sequences
    proposer = LongSpecProposer(noisy_draft(target, window=6))
    out = Generator(target, proposer=proposer, tree=TreeSpec.parse(tree)).generate(prompts, config)
    assert out.sequences == expected


TRITON = ["triton"] if triton_kernels.available() else []


@pytest.mark.parametrize("lag", [1, 2, 4])
@pytest.mark.parametrize("name,impl", [("llama", "sdpa"), ("qwen2-mha", "sdpa"), ("llama-yarn", "sdpa")]
                         + [("llama", impl) for impl in ["matmul", "reference"] + TRITON])
def test_training_forward_equals_incremental_inference(targets, name, lag, impl):
    """forward_train (teacher-forced, anchor-offset positions, lag g) == forward_step token by
    token over the ring buffer when each query sees target slots 0..t-g, with each attention
    implementation of the incremental steps (Triton: the ring-buffer and per-query-limit kernels)."""
    target = load_target(targets[name].path) if impl != "sdpa" else targets[name]
    target.attention_impl = impl
    draft = noisy_draft(target, window=5, seed=1)
    t = 24
    gen = torch.Generator().manual_seed(lag)
    ids = torch.randint(0, 160, (2, t), generator=gen)
    positions = torch.cat([torch.arange(4), torch.arange(150, 150 + t - 4)])[None].expand(2, -1)
    cache = target.new_cache(2, t)
    with torch.no_grad():
        target.forward_hidden(ids, positions, cache, torch.ones(t, t, dtype=torch.bool).tril()[None])
        k, v = cache.k[-1], cache.v[-1]
        target_kv = target.last_layer_kv(cache)
        train = draft.forward_train(ids, positions, k, v, lag=lag)
        ring = DraftCache(draft.config, 2, tree_size=3, dtype=torch.float32, device="cpu")
        steps = []
        for i in range(t):
            index = torch.full((2, 1), i)
            steps.append(draft.forward_step(ids[:, i:i + 1], positions[:, i:i + 1], index, torch.full((2, 1), -1),
                                            torch.ones(2, 1, dtype=torch.bool), ring, target_kv,
                                                cross_limit=index - lag + 1))
    assert torch.allclose(train, torch.cat(steps, 1), atol=1e-4)


# (a chain is a tree of one branch: the slow run adds it, ~40 s in the Triton interpreter)
@pytest.mark.parametrize("tree", ["3,4,4", pytest.param("chain:4", marks=pytest.mark.slow)])
@pytest.mark.parametrize("impl", TRITON)
def test_longspec_proposer_with_triton_attention(targets, tree, impl):
    """Target and draft attention through the Triton kernels (tree, ring buffer, cross-attention
    with per-query lags): the same tokens as autoregressive decoding, ragged batch."""
    target = load_target(targets["qwen2-mha"].path)
    target.attention_impl = impl
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompts = prompts_for(2, seed=7)
    expected = Generator(targets["qwen2-mha"]).generate(prompts, config).sequences
    out = Generator(target, proposer=LongSpecProposer(noisy_draft(target, window=6)),
                    tree=TreeSpec.parse(tree)).generate(prompts, config)
    assert out.sequences == expected


def test_draft_memory_is_constant(tiny_model_factory):
    """Bytes held by the draft's caches after prefill of 1k and 8k tokens are identical; only
    the target's cache grows. (The 64k case is the slow test below.)"""
    _, path = tiny_model_factory("draft-long", "llama", max_position_embeddings=70000, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, hidden_size=32, head_dim=16, seed=2)
    target = load_target(path)
    assert draft_bytes_after_prefill(target, [1024, 8192]) is not None


def draft_bytes_after_prefill(target, lengths):
    draft = noisy_draft(target, window=64)
    tree = TreeSpec.parse("4,16,16,16,16")
    drafts, targets_ = [], []
    for n in lengths:
        prompt = torch.randint(0, 160, (n,)).tolist()
        cache = target.new_cache(1, n + tree.num_nodes + 1)
        target.prefill(torch.tensor([prompt]), torch.tensor([n]), cache, chunk_size=1024)
        proposer = LongSpecProposer(draft)
        proposer.begin(target, cache, tree, GenerationConfig(), None)
        proposer.add(0, prompt, 5)
        proposer.propose(torch.tensor([5]))  # one drafting round
        drafts.append(proposer.ring.nbytes)
        targets_.append(cache.nbytes)
    assert len(set(drafts)) == 1, drafts
    assert targets_ == sorted(targets_) and targets_[0] < targets_[-1]
    return drafts[0]


@pytest.mark.slow
def test_draft_memory_is_constant_at_64k(tiny_model_factory):
    _, path = tiny_model_factory("draft-long", "llama", max_position_embeddings=70000, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, hidden_size=32, head_dim=16, seed=2)
    draft_bytes_after_prefill(load_target(path), [1024, 8192, 65536])


def test_save_load_roundtrip_and_mismatch(targets, tmp_path):
    target = targets["llama"]
    draft = noisy_draft(target, window=7, seed=3)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", target)
    assert loaded.config.window == 7
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert not any("embed" in k or "lm_head" in k for k in loaded.state_dict())  # shared, not copied
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["target_architecture"] == "LlamaForCausalLM" and config["target_embedding_sample"]
    with pytest.raises(ValueError, match="draft/target mismatch: .*embedding"):
        load_draft(tmp_path / "d", targets["llama-yarn"])  # same shapes, other weights
    with pytest.raises(ValueError, match="draft/target mismatch: .*num_kv_heads"):
        load_draft(tmp_path / "d", targets["qwen2-mha"])
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_draft(tmp_path / "nope", target)


def test_loads_published_longspec_layout(targets, tmp_path):
    """A synthetic checkpoint in the layout the LongSpec paper published: one decoder layer under
    a prefix, q/k/v biases, unused cross-attention k/v weights, shared tensors present."""
    target = targets["llama"]
    ours = noisy_draft(target, window=512, seed=4)
    state = {f"model.layers.0.{k}": v for k, v in ours.state_dict().items()}
    kv = target.config.num_kv_heads * target.config.head_dim
    state["model.layers.0.cross_attn.k_proj.weight"] = torch.randn(kv, target.config.hidden_size)
    state["model.layers.0.cross_attn.v_proj.weight"] = torch.randn(kv, target.config.hidden_size)
    state["model.embed_tokens.weight"] = target.model.embed_tokens.weight.clone()
    (tmp_path / "pub").mkdir()
    save_file(state, str(tmp_path / "pub" / "model.safetensors"))
    (tmp_path / "pub" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    loaded = load_draft(tmp_path / "pub", target)
    assert loaded.config.qkv_bias and loaded.config.window == 512
    for (name, a), (_, b) in zip(ours.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    # the published code applies the LM head to the block's output, without the final norm
    hidden = torch.randn(2, 3, target.config.hidden_size)
    assert not loaded.config.head_norm and ours.config.head_norm
    assert torch.equal(loaded.logits(hidden), target.logits(hidden))
    assert torch.equal(ours.logits(hidden), target.logits(target.final_norm(hidden)))
    save_draft(loaded, tmp_path / "ours")  # our format keeps the choice
    assert not load_draft(tmp_path / "ours", target).config.head_norm
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "pub" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor.*mlp.up_proj.weight"):
        load_draft(tmp_path / "pub", target)


def test_corrupt_published_draft_is_a_clear_error(targets, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt safetensors file"):
        load_draft(tmp_path / "bad", targets["llama"])


def repetitive_prompts(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        motif = torch.randint(0, 160, (5 + i,), generator=gen).tolist()
        out.append(torch.randint(0, 160, (4,), generator=gen).tolist() + motif * 6)
    return out


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree", ["3,4,4", "4,16,16,16,16", "3,4,1,1,1,1"])
@pytest.mark.parametrize("name", ["llama", "qwen2-mha"])
def test_hybrid_lookup_and_draft_is_lossless_and_accepts_more(targets, name, tree, batch):
    """The prompt-lookup chain merged into the draft's beam tree: greedy output equals plain
    decoding, and on repetitive text it accepts more than the (random) draft alone (levels of
    one node, "1,1,1,1", are the lookup chain's alone when it has a candidate)."""
    from longspec import PromptLookup

    target = targets[name]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts(batch, seed=batch + len(tree))
    expected = Generator(target).generate(prompts, config).sequences
    draft = noisy_draft(target, window=6)
    alone = Generator(target, proposer=LongSpecProposer(draft), tree=tree).generate(prompts, config)
    hybrid = Generator(target, proposer=LongSpecProposer(draft, lookup=PromptLookup()), tree=tree).generate(
        prompts, config)
    assert alone.sequences == expected and hybrid.sequences == expected
    assert hybrid.stats["tau"] >= alone.stats["tau"]


def test_hybrid_needs_a_beam_tree(targets):
    from longspec import PromptLookup

    target = targets["llama"]
    for tree in ("chain:3", "1,4,4"):
        with pytest.raises(ValueError, match="beam trees"):
            Generator(target, proposer=LongSpecProposer(noisy_draft(target), lookup=PromptLookup()),
                      tree=tree).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=4))


def test_reduced_draft_vocabulary(targets, tmp_path):
    """A draft that scores only some tokens: its logits are -inf elsewhere (only those head rows
    are computed), greedy output is unchanged, training still scores everything, and the choice
    survives save/load."""
    target = targets["llama"]
    draft = noisy_draft(target, window=6)
    hidden = torch.randn(2, 3, target.config.hidden_size)
    full = draft.logits(hidden, reduced=True)
    keep = torch.tensor([3, 7, 11, 50, 100, 159])
    draft.limit_vocab(keep)
    reduced = draft.logits(hidden, reduced=True)
    assert torch.allclose(reduced[..., keep], full[..., keep], atol=1e-5)
    others = torch.ones(target.config.vocab_size, dtype=torch.bool)
    others[keep] = False
    assert torch.isinf(reduced[..., others]).all() and torch.equal(draft.logits(hidden), full)
    assert_greedy_lossless(target, draft, ("4,16,16,16,16", "chain:3"), seed=3)
    save_draft(draft, tmp_path / "small")
    loaded = load_draft(tmp_path / "small", target)
    assert loaded.config.draft_vocab == 6 and torch.equal(loaded.vocab_subset, keep)
    # an engine's proposer copies the head rows before any (compiled) round runs
    assert loaded.head_copy_nbytes == 0
    Engine(target, LongSpecProposer(loaded), TreeSpec.parse("2,2"), max_batch=1, max_len=64)
    assert loaded.head_copy_nbytes == 6 * target.config.hidden_size * loaded.reduced_head().element_size()
    rows = loaded.reduced_head()
    assert loaded.reduced_head(check=True) is rows  # the same head: the same copy
    head = target.lm_head.weight
    head.data = head.data.clone()  # the head moved (as after a .to()): copied again when a proposer begins
    again = loaded.reduced_head(check=True)
    assert again is not rows and torch.equal(again, rows)
    with pytest.raises(ValueError, match="token ids in"):
        draft.limit_vocab([1, 1000])


class FullVocabularyProposer(LongSpecProposer):
    """The reference: a reduced draft's rounds selecting over the whole vocabulary (its logits -inf
    outside the reduced one), as before rounds selected among the reduced columns."""

    def begin(self, *args):
        super().begin(*args)
        self.candidate_ids = self.candidate_index = None


@pytest.mark.parametrize("tree,temperature", [("4,16,16,16,16", 0.0), ("3,4,4", 0.0), ("chain:3", 0.0),
                                              ("[[0],[1],[0,0],[1,0]]", 0.0), ("chain:3", 1.0), ("3,4,4", 1.0)])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("narrow", [False, True])
def test_a_reduced_vocabulary_draft_selects_among_its_columns_as_over_the_whole_vocabulary(
        targets, monkeypatch, tree, temperature, hybrid, narrow):
    """A reduced draft's rounds pick children among its C scored tokens ([.., C] logits, no
    [.., V] tensor): every round's tree (tokens, parents) equals the one picked over the whole
    vocabulary with -inf elsewhere (float32 logits: no ties), greedy (static, beam and hybrid
    trees) and sampled (its children drawn from the whole vocabulary's distribution, the same
    draws). A vocabulary narrower than a level (``narrow``: 3 tokens) goes whole, as before."""
    from longspec import PromptLookup
    from longspec.spec.drafting import TreeDrafter

    if hybrid and not tree[0].isdigit():
        pytest.skip("the lookup chain merges into beam trees")
    target = targets["llama"]
    draft = noisy_draft(target, window=6)
    seen = sorted({t for p in repetitive_prompts(2, seed=9) for t in p})
    # some lookup candidates are not scored
    draft.limit_vocab([3, 7, 11] if narrow else sorted(set(seen[::2]) | set(range(0, 160, 3))))
    trees = []
    propose = TreeDrafter.propose

    def recorded(self, root):
        out = propose(self, root)
        trees.append((out.tokens.clone(), out.parents.clone()))
        return out

    monkeypatch.setattr(TreeDrafter, "propose", recorded)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True, temperature=temperature,
                              seed=3 if temperature else None)
    prompts = repetitive_prompts(2, seed=9)
    runs = {}
    for cls in (LongSpecProposer, FullVocabularyProposer):
        trees.clear()
        proposer = cls(draft, lookup=PromptLookup() if hybrid else None)
        out = Generator(target, proposer=proposer, tree=tree).generate(prompts, config)
        runs[cls] = (out.sequences, list(trees))
        if cls is LongSpecProposer:
            assert proposer.candidate_ids is not None and proposer.candidate_ids.numel() < target.config.vocab_size
            assert (proposer._columns() is None) == (narrow and TreeSpec.parse(tree).max_children > 3)
        if cls is LongSpecProposer and not narrow:  # the vocabulary changed after begin: the new one's columns
            draft.limit_vocab(range(0, 160, 2))
            assert torch.equal(proposer._columns(), torch.arange(0, 160, 2))
            draft.limit_vocab(sorted(set(seen[::2]) | set(range(0, 160, 3))))
    (compact, compact_trees), (full, full_trees) = runs.values()
    assert compact == full and len(compact_trees) == len(full_trees) > 0
    for (tokens, parents), (ref_tokens, ref_parents) in zip(compact_trees, full_trees):
        assert torch.equal(tokens, ref_tokens) and torch.equal(parents, ref_parents)


def test_the_hybrids_chain_rounds_draft_as_the_engine_says(targets, monkeypatch):
    """A hybrid bucket switched to a chain (``with_tree``, as ``--proposer auto`` does) lets the
    lookup draft alone: its copied continuation, one search, no whole-vocabulary pseudo-logits, in
    greedy and sampled rounds alike (the children are chosen deterministically, and verified by
    the target's probability of each: lossless without a draft distribution)."""
    from longspec import PromptLookup
    from longspec.kv.cache import KVCache
    from longspec.spec.drafting import TreeDrafter
    from longspec.spec.sampling import RowSampling, Uniforms

    target = targets["llama"]
    proposer = LongSpecProposer(noisy_draft(target, window=6), lookup=PromptLookup())
    cache = KVCache(target.config, 1, 96)
    proposer.begin(target, cache, TreeSpec.parse("2,2,2"), RowSampling.zeros(1, "cpu"), Uniforms(None, "cpu"))
    prompt = repetitive_prompts(1, seed=4)[0]
    proposer.add(0, prompt[:-1], prompt[-1])
    cache.lengths[0] = len(prompt) - 1  # (the row in use, its prompt cached: its chain drafts where it matches)
    generic = []
    grow = TreeDrafter.propose
    monkeypatch.setattr(TreeDrafter, "propose", lambda self, root: generic.append(type(self).__name__)
                        or grow(self, root))
    chain = proposer.with_tree(TreeSpec.chain(3))
    root = torch.tensor([prompt[-1]])
    for sampled in (False, True):
        chain.sample_children = sampled  # what Engine._round sets on the bucket's view
        tree = chain.propose(root)
        assert generic == [] and tree.tokens.shape == (1, 4) and not tree.children_sampled
    assert chain.propose(root).tokens[0, 1:].tolist() == (prompt[prompt.index(prompt[-1]) + 1:] * 2)[:3]


def test_frequent_tokens_of_data(tmp_path):
    from longspec.training import frequent_tokens

    class Chars:
        bos_token_id = eos_token_id = None

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 50 for c in text]

    (tmp_path / "a.txt").write_text("bbbbb aaaa c")
    top = frequent_tokens([tmp_path / "a.txt"], Chars(), 3, vocab_size=50).tolist()
    assert top == [ord("b") % 50, ord("a") % 50, ord(" ") % 50]


def test_the_merged_lookup_chain_follows_the_beams_own_pick_of_its_token():
    """Where the draft's beam picks the lookup chain's next token under the chain's node, the
    chain goes on from that node rather than taking the level's last slot for a second node with
    the same token and parent (sampled verification never reaches such a duplicate, nor its
    subtree: at T=1 the hybrid trees accepted 0.85-1.6 tokens a round where the chain alone
    accepted 3.2). The tree then holds the chain as one path, and a sampled round accepts as much
    as the chain alone does."""
    from types import SimpleNamespace

    from longspec import PromptLookup
    from longspec.spec.drafting import TreeDrafter
    from longspec.spec.verify import verify_sampling

    vocab, rows, text = 16, 2000, [3, 4, 5, 6, 7, 8]  # the text after token 2, which the draft predicts too
    history = [9, 2] + text + [10, 11, 2]  # (the lookup: 3 4 5 6 7 after the last 2)

    class Agrees(TreeDrafter):
        def _root_logits(self, root):
            logits = torch.zeros(root.shape[0], vocab)
            logits[:, text[0]], logits[:, 13] = 5.0, 4.0
            return logits

        def _level_logits(self, tokens, positions, mask, tree_tokens):
            logits = torch.zeros(*tokens.shape, vocab)
            logits[..., text[self.spec.node_depth(mask.shape[-1] - 1)]], logits[..., 14] = 5.0, 4.0
            return logits

    def accepted(proposer, tree):
        cache = SimpleNamespace(lengths=torch.full((rows,), len(history)), batch_size=rows, max_len=64)
        proposer.begin(SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)), cache, tree,
                       GenerationConfig(temperature=1.0), torch.Generator().manual_seed(0))
        for r in range(rows):
            (proposer.lookup or proposer).add(r, history[:-1], history[-1])
        drafted = proposer.propose(torch.full((rows,), history[-1]))
        paths = {}
        for i in range(drafted.tokens.shape[1]):  # (each node's path from the root)
            paths[i] = (paths[int(drafted.parents[0, i])] if i else ()) + (int(drafted.tokens[0, i]),)
        probs = torch.full((rows, len(paths), vocab), 1.0 / vocab)  # the target: 0.85 on the text's next token
        for i, path in paths.items():
            if list(path[1:]) == text[:len(path) - 1] and len(path) <= len(text):
                probs[:, i] = 0.15 / (vocab - 1)
                probs[:, i, text[len(path) - 1]] = 0.85
        assert len(set(paths.values())) == len(paths)  # (no two nodes with the same path)
        assert tuple([2] + text[:tree.depth]) in paths.values()  # (the chain, one path)
        return verify_sampling(drafted, probs, torch.Generator().manual_seed(1)).num_accepted.float().mean().item()

    chain = accepted(PromptLookup(decode_below=1), TreeSpec.chain(5))  # (a 1-token match: drafted on a CPU too)
    for tree in ("2,2,1,1,1", "4,4,1,1,1"):
        hybrid = Agrees()
        hybrid.lookup = PromptLookup()
        assert accepted(hybrid, TreeSpec.parse(tree)) == pytest.approx(chain, abs=0.15)


@pytest.mark.parametrize("tied", [True, False])
def test_weights_held_transposed_compute_the_same(tiny_model_factory, tied):
    """As ``load_target`` and ``load_draft`` hold them on CUDA (here on a CPU): every product's
    weight [N, K] with strides (1, K), the fused layers still views of their one weight (the
    target still ``fused``), a head tied to the embedding left as stored; a second call changes
    nothing; the same logits as the weights as stored, and greedy speculative output (the draft's
    reduced head too) equal to plain decoding's."""
    from longspec.models.layers import hold_transposed

    _, path = tiny_model_factory(f"transposed-{tied}", "llama", None, max_position_embeddings=256, seed=11,
                                 tie_word_embeddings=tied)
    stored, target = load_target(path), load_target(path)
    draft = noisy_draft(target, window=6)
    draft.fuse_projections()
    draft.limit_vocab(torch.arange(0, 160, 3))
    hold_transposed(target)
    hold_transposed(draft)
    head = target.lm_head.weight
    assert (head is target.model.embed_tokens.weight and head.is_contiguous()) if tied else head.stride(0) == 1
    linears = [m for model in (target, draft) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not target.lm_head]
    assert len(linears) > 10 and all(m.weight.stride(0) == 1 for m in linears)
    assert target.fused and draft.reduced_head().stride(0) == (1 if not tied else draft.reduced_head().shape[1])
    attn = target.model.layers[0].self_attn
    rows_bytes = attn.q_proj.weight.shape[0] * attn._fused[0].element_size()  # k's rows after q's: a column's
    assert attn.k_proj.weight.data_ptr() == attn._fused[0].data_ptr() + rows_bytes
    pointers = [p.data_ptr() for p in target.parameters()]
    hold_transposed(target)
    assert [p.data_ptr() for p in target.parameters()] == pointers
    ids = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = [m.prefill(ids, torch.tensor([9, 6]), m.new_cache(2, 16)) for m in (target, stored)]
    assert torch.allclose(*logits, atol=1e-5)
    assert_greedy_lossless(target, draft, ("4,16,16", "chain:3"), seed=4)


def test_a_weight_with_no_room_for_its_copy_stays_as_stored(tiny_model_factory, monkeypatch):
    """``hold_transposed`` copies a weight at a time; where a copy finds no memory (here: the
    untied head's and the layers' fused q/k/v) that weight stays as stored, the fused layers still
    views of it, and the model computes as before."""
    from longspec.models.layers import hold_transposed

    _, path = tiny_model_factory("transposed-False", "llama", None, max_position_embeddings=256, seed=11,
                                 tie_word_embeddings=False)
    stored, target = load_target(path), load_target(path)
    attn = target.model.layers[0].self_attn
    full = {target.lm_head.weight.shape, attn._fused[0].shape}
    real = torch.Tensor.contiguous

    def contiguous(t, *args, **kwargs):
        if tuple(t.t().shape) in full:  # (the transpose of a weight of those shapes)
            raise torch.cuda.OutOfMemoryError("no room")
        return real(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    hold_transposed(target)
    monkeypatch.undo()
    assert target.lm_head.weight.is_contiguous() and attn._fused[0].is_contiguous() and target.fused
    assert attn.o_proj.weight.stride(0) == 1 and target.model.layers[1].mlp.gate_proj.weight.stride(0) == 1
    ids = torch.randint(0, 160, (1, 7), generator=torch.Generator().manual_seed(1))
    logits = [m.prefill(ids, torch.tensor([7]), m.new_cache(1, 16)) for m in (target, stored)]
    assert torch.allclose(*logits, atol=1e-5)
