"""The target engine has parity with transformers.

For every supported family (Llama MHA/GQA, tied/untied, with biases; Mistral; Qwen2 with q/k/v
bias; Qwen3 with q/k norm) and RoPE scaling (default, linear, dynamic, llama3, yarn), written in
every config.json format (``rope_parameters``; hub ``rope_theta`` + ``rope_scaling`` with ``type``
or ``rope_type``), a tiny random HF checkpoint loaded with ``load_target`` gives transformers'
float32 logits (max abs diff <= 1e-4) in every forward mode: prefill (whole / chunked / ragged
batch), decode, verify with a chain mask, verify with a branching tree mask, and commit + decode.

Models have ``max_position_embeddings = 32`` and sequences run to ~100 tokens, so every scaling
acts (``test_scaling_changes_logits`` checks that it does).

``dynamic`` NTK depends on the call in transformers (the base is chosen from the longest position
of each forward); a decoded or verified token at position ``p`` must match transformers running
one token at a time with ``past_key_values`` (the base for ``p + 1``), see
``longspec/models/rope.py``. So for ``dynamic`` the reference is an incremental HF run.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers

from longspec import load_target

from conftest import (HUB_ROPE_TYPE, HUB_TYPE, ROPE_PARAMETERS, assert_close, hf_logits,
                      hf_reference_logits, hf_reset_rope, tiny_config)

MAX_POS = 32
ATOL = 1e-4

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


def _yarn_orig_top_level(cfg):
    """Phi-3 / DeepSeek style: original_max_position_embeddings at the top level of config.json
    (transformers gives it priority over the one inside rope_scaling)."""
    cfg["original_max_position_embeddings"] = 8
    cfg["rope_scaling"]["original_max_position_embeddings"] = 16


# name -> build kwargs (family, rope, config_format, HF config overrides)
CASES = {
    "llama-mha-default": dict(family="llama", num_key_value_heads=4),
    "llama-gqa-tied-default-hub": dict(family="llama", tie_word_embeddings=True, config_format=HUB_TYPE),
    "llama-gqa-bias-theta500k": dict(family="llama", attention_bias=True, mlp_bias=True,
                                     rope={"rope_theta": 500000.0}, config_format=HUB_ROPE_TYPE),
    "llama-linear-hub_type": dict(family="llama", rope={"rope_type": "linear", "factor": 2.0},
                                  config_format=HUB_TYPE),
    "llama-dynamic-hub_rope_type": dict(family="llama", rope={"rope_type": "dynamic", "factor": 2.0},
                                        config_format=HUB_ROPE_TYPE),
    "llama-dynamic-rope_parameters-mha": dict(family="llama", num_key_value_heads=4,
                                              rope={"rope_type": "dynamic", "factor": 3.0}),
    "llama-llama3-rope_parameters": dict(family="llama", rope=LLAMA3),
    "llama-llama3-hub_rope_type-tied": dict(family="llama", rope=dict(LLAMA3, rope_theta=500000.0, factor=8.0),
                                            tie_word_embeddings=True, config_format=HUB_ROPE_TYPE),
    "llama-yarn-hub_type": dict(family="llama", rope=YARN, config_format=HUB_TYPE),
    "llama-yarn-mscale-notruncate": dict(family="llama", rope=dict(YARN, mscale=1.0, mscale_all_dim=0.5,
                                                                   beta_fast=16.0, beta_slow=2.0, truncate=False)),
    "llama-yarn-orig-top-level": dict(family="llama", rope=YARN, config_format=HUB_ROPE_TYPE,
                                      edit_config=_yarn_orig_top_level),
    "mistral-default": dict(family="mistral"),
    "mistral-linear-hub_rope_type": dict(family="mistral", rope={"rope_type": "linear", "factor": 4.0},
                                         config_format=HUB_ROPE_TYPE),
    "qwen2-bias-default-hub": dict(family="qwen2", config_format=HUB_TYPE),
    "qwen2-bias-yarn-attention_factor": dict(family="qwen2", rope=dict(YARN, attention_factor=1.3)),
    "qwen2-bias-dynamic-hub_type": dict(family="qwen2", rope={"rope_type": "dynamic", "factor": 2.0},
                                        config_format=HUB_TYPE),
    "qwen3-qknorm-default-headdim32": dict(family="qwen3", head_dim=32),
    "qwen3-qknorm-yarn-hub_rope_type-tied": dict(family="qwen3", rope=YARN, tie_word_embeddings=True,
                                                 config_format=HUB_ROPE_TYPE),
    "qwen3-qknorm-llama3-sharded": dict(family="qwen3", rope=LLAMA3, attention_bias=True,
                                        max_shard_size="40KB"),
    "qwen3-qknorm-dynamic-hub_rope_type": dict(family="qwen3", rope={"rope_type": "dynamic", "factor": 2.0},
                                               config_format=HUB_ROPE_TYPE),
    # sliding-window layers (window 8, sequences of up to ~100 tokens) among global ones
    "gemma3-sliding-globals": dict(family="gemma3"),
    "gemma3-linear-softcap-mqa-window5": dict(family="gemma3", rope={"rope_type": "linear", "factor": 2.0},
                                              final_logit_softcapping=3.0, num_key_value_heads=1,
                                              query_pre_attn_scalar=32, sliding_window=5),
    "mistral-sliding-window6": dict(family="mistral", sliding_window=6),
}
NAMES = list(CASES)


def rope_type(name: str) -> str:
    return (CASES[name].get("rope") or {}).get("rope_type", "default")


def is_dynamic(name: str) -> bool:
    return rope_type(name) == "dynamic"


@pytest.fixture(params=NAMES)
def case(request, tiny_model_factory):
    """(name, hf_model, path, target) for one architecture / RoPE / config-format combination."""
    name = request.param
    kwargs = dict(CASES[name])
    kwargs.setdefault("max_position_embeddings", MAX_POS)
    kwargs["seed"] = NAMES.index(name)
    hf, path = tiny_model_factory(name, **kwargs)
    return name, hf, path, _load(str(path))


@functools.lru_cache(maxsize=None)
def _load(path: str):
    return load_target(path)


def rand_tokens(n: int, seed: int, vocab: int = 160) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def right_pad(prompts, pad: int = 7):
    """[B, T] long (padded with a real token id, so that leaking padding would show) + lengths."""
    t = max(map(len, prompts))
    ids = torch.full((len(prompts), t), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    return ids, torch.tensor([len(p) for p in prompts])


# ------------------------------------------------------------------------------ trees

# parent of each node (-1: root); parents come before children
TREE_A = [-1, 0, 0, 1, 1, 2, 3]  # BFS order: r; a b; c d (of a), e (of b); f (of c)
TREE_B = [-1, 0, 1, 0, 3, 3, 1]  # another shape, nodes not sorted by depth


def ancestors_or_self(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_mask(parents) -> torch.Tensor:
    m = len(parents)
    mask = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        mask[i, ancestors_or_self(parents, i)] = True
    return mask


def depths(parents) -> torch.Tensor:
    return torch.tensor([len(ancestors_or_self(parents, i)) - 1 for i in range(len(parents))])


def leaves(parents):
    return [i for i in range(len(parents)) if i not in parents]


# ------------------------------------------------------------------------------ tests

def test_checkpoint_and_config_parsed(case):
    name, hf, path, target = case
    spec = CASES[name]
    cfg = json.loads((path / "config.json").read_text())
    fmt = spec.get("config_format", ROPE_PARAMETERS)
    if fmt == ROPE_PARAMETERS:
        assert "rope_parameters" in cfg and "rope_scaling" not in cfg
    else:
        assert "rope_parameters" not in cfg and "rope_theta" in cfg
        if rope_type(name) != "default":
            assert ("type" if fmt == HUB_TYPE else "rope_type") in cfg["rope_scaling"]
    gemma = spec["family"] == "gemma3"
    assert target.config.rope.rope_type == rope_type(name)
    assert target.config.rope.theta == float((spec.get("rope") or {}).get("rope_theta", 1e6 if gemma else 10000.0))
    assert target.config.model_type == {"gemma3": "gemma3_text"}.get(spec["family"], spec["family"])
    hf_rope = hf.config.rope_parameters["full_attention"] if gemma else hf.config.rope_parameters
    if gemma:
        assert target.config.rope_local.theta == 10000.0 and target.config.rope_local.rope_type == "default"
    window = getattr(hf.config, "sliding_window", None)
    assert target.config.sliding_window == window
    if window:
        assert target.config.layer_types == tuple(getattr(hf.config, "layer_types", None)
                                                  or ["sliding_attention"] * hf.config.num_hidden_layers)
    for ours_key, hf_key in [("factor", "factor"), ("low_freq_factor", "low_freq_factor"),
                             ("high_freq_factor", "high_freq_factor"), ("beta_fast", "beta_fast"),
                             ("beta_slow", "beta_slow"), ("attention_factor", "attention_factor"),
                             ("mscale", "mscale"), ("mscale_all_dim", "mscale_all_dim"), ("truncate", "truncate")]:
        if hf_rope.get(hf_key) is not None:
            assert getattr(target.config.rope, ours_key) == hf_rope[hf_key], ours_key
    if rope_type(name) in ("llama3", "yarn"):
        assert target.config.rope.original_max_position_embeddings == hf_rope["original_max_position_embeddings"]
    if name == "llama-yarn-orig-top-level":
        assert target.config.rope.original_max_position_embeddings == 8
    assert target.config.tie_word_embeddings == bool(spec.get("tie_word_embeddings", gemma))
    if spec.get("tie_word_embeddings"):
        assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    if spec.get("max_shard_size"):
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    # every parameter equals the HF one
    ours, theirs = target.state_dict(), hf.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_scaling_changes_logits(case):
    """Sanity check of the test set-up: the RoPE scaling (or non-default theta) changes the logits
    of the sequences used here far beyond the tolerance."""
    name, hf, _, _ = case
    spec = CASES[name]
    if rope_type(name) == "default" and "rope_theta" not in (spec.get("rope") or {}):
        pytest.skip("default RoPE")
    overrides = {k: v for k, v in spec.items()
                 if k not in ("family", "rope", "config_format", "edit_config", "max_shard_size")}
    plain_cfg = tiny_config(spec["family"], None, max_position_embeddings=MAX_POS, **overrides)
    plain = type(hf)(plain_cfg).eval()
    plain.load_state_dict(hf.state_dict())
    ids = rand_tokens(90, 1)
    assert (hf_logits(hf, ids) - hf_logits(plain, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("chunk_size", [2048, 7])
def test_prefill_single(case, chunk_size):
    name, hf, _, target = case
    ids = rand_tokens(90, 2)
    ref = hf_logits(hf, ids)
    cache = target.new_cache(1, 128)
    logits = target.prefill(torch.tensor([ids]), torch.tensor([90]), cache, chunk_size=chunk_size,
                            all_logits=True)
    assert cache.lengths.tolist() == [90]
    assert_close(logits[0], ref, ATOL, "prefill all_logits")
    cache = target.new_cache(1, 128)
    last = target.prefill(torch.tensor([ids]), torch.tensor([90]), cache, chunk_size=chunk_size)
    assert_close(last[0], ref[-1], ATOL, "prefill last logits")


@pytest.mark.parametrize("chunk_size", [2048, 16])
@pytest.mark.parametrize("lengths", [(90, 61, 5), (30, 23)], ids=["long", "short"])
def test_prefill_ragged_batch(case, chunk_size, lengths):
    """Right-padded prompts of different lengths; each row equals HF on that prompt alone.
    (For ``dynamic`` NTK the "long" prompts are all longer than max_position_embeddings, with
    different lengths: a row must not depend on the others' lengths.)"""
    name, hf, _, target = case
    prompts = [rand_tokens(n, 10 + i) for i, n in enumerate(lengths)]
    ids, lens = right_pad(prompts)
    cache = target.new_cache(len(prompts), 128)
    logits = target.prefill(ids, lens, cache, chunk_size=chunk_size, all_logits=True)
    last = target.prefill(ids, lens, target.new_cache(len(prompts), 128), chunk_size=chunk_size)
    assert cache.lengths.tolist() == list(lengths)
    for b, p in enumerate(prompts):
        ref = hf_logits(hf, p)
        assert_close(logits[b, :len(p)], ref, ATOL, f"row {b} (length {len(p)})")
        assert_close(last[b], ref[-1], ATOL, f"row {b} last logits")


@torch.no_grad()
def _hf_two_calls(hf, first, second):
    """transformers with a KV cache: ``first`` in one forward, then ``second`` in one forward.
    Returns the logits of ``second`` [len(second), V]."""
    hf_reset_rope(hf)
    past = transformers.DynamicCache(config=hf.config)
    hf(torch.tensor([first]), cache=past, use_cache=True)
    return hf(torch.tensor([second]), cache=past, use_cache=True).logits[0].float()


@pytest.mark.parametrize("chunk_size", [2048, 7])
@pytest.mark.parametrize("lengths", [((40,), (25,)), ((30, 23), (12, 20))], ids=["single", "ragged"])
def test_prefill_continuation(case, chunk_size, lengths):
    """A second prefill appended to a filled cache (a new turn) equals transformers running the
    second part as one forward on top of its cache of the first."""
    name, hf, _, target = case
    firsts = [rand_tokens(n, 110 + i) for i, n in enumerate(lengths[0])]
    seconds = [rand_tokens(n, 120 + i) for i, n in enumerate(lengths[1])]
    cache = target.new_cache(len(firsts), 96)
    target.prefill(*right_pad(firsts), cache)
    ids, lens = right_pad(seconds)
    logits = target.prefill(ids, lens, cache, chunk_size=chunk_size, all_logits=True)
    assert cache.lengths.tolist() == [a + b for a, b in zip(*lengths)]
    for b, (first, second) in enumerate(zip(firsts, seconds)):
        ref = _hf_two_calls(hf, first, second)
        assert_close(logits[b, :len(second)], ref, ATOL, f"row {b}")


@pytest.mark.parametrize("lengths", [(40,), (24, 17)], ids=["single", "ragged"])
def test_decode(case, lengths):
    """Prefill, then 20 tokens one at a time (crossing max_position_embeddings)."""
    name, hf, _, target = case
    n_new = 20
    prompts = [rand_tokens(n, 20 + i) for i, n in enumerate(lengths)]
    conts = [rand_tokens(n_new, 30 + i) for i in range(len(lengths))]
    ids, lens = right_pad(prompts)
    cache = target.new_cache(len(prompts), 96)
    first = target.prefill(ids, lens, cache)
    steps = [target.decode(torch.tensor([c[t] for c in conts]), cache) for t in range(n_new)]
    ours = torch.stack(steps, 1)  # [B, n_new, V]
    assert cache.lengths.tolist() == [n + n_new for n in lengths]
    for b, (p, c) in enumerate(zip(prompts, conts)):
        ref = hf_reference_logits(hf, p + c, len(p), is_dynamic(name))
        assert_close(first[b], ref[len(p) - 1], ATOL, f"row {b} prefill")
        assert_close(ours[b], ref[len(p):], ATOL, f"row {b} decode")


@pytest.mark.parametrize("lengths", [(70,), (30, 23)], ids=["single", "ragged"])
def test_verify_chain(case, lengths):
    """verify with a lower-triangular mask at positions lengths + 0..M-1 equals the logits of
    the whole sequence at those positions; nothing is committed."""
    name, hf, _, target = case
    m = 8
    prompts = [rand_tokens(n, 40 + i) for i, n in enumerate(lengths)]
    chains = [rand_tokens(m, 50 + i) for i in range(len(lengths))]
    ids, lens = right_pad(prompts)
    cache = target.new_cache(len(prompts), 96)
    target.prefill(ids, lens, cache)
    positions = cache.lengths[:, None] + torch.arange(m)[None]
    mask = torch.tril(torch.ones(m, m, dtype=torch.bool)).expand(len(prompts), m, m)
    logits = target.verify(torch.tensor(chains), positions, mask, cache)
    assert logits.shape == (len(prompts), m, 160)
    assert cache.lengths.tolist() == list(lengths), "verify must not commit"
    assert cache.pending == m
    for b, (p, c) in enumerate(zip(prompts, chains)):
        ref = hf_reference_logits(hf, p + c, len(p), is_dynamic(name))
        assert_close(logits[b], ref[len(p):], ATOL, f"row {b} chain")
    # after discard, a mask shared by the rows ([1, M, M]) gives the same, and decode goes on
    cache.discard()
    again = target.verify(torch.tensor(chains), positions, mask[:1].clone(), cache)
    assert_close(again, logits, ATOL, "verify repeated")
    cache.discard()
    nxt = target.decode(torch.tensor([c[0] for c in chains]), cache)
    assert_close(nxt, logits[:, 0], ATOL, "decode after verify")
    assert cache.lengths.tolist() == [n + 1 for n in lengths]


def _tree_batch(lengths, seed):
    prompts = [rand_tokens(n, seed + i) for i, n in enumerate(lengths)]
    trees = [TREE_A, TREE_B][:len(lengths)]
    tokens = torch.tensor([rand_tokens(len(t), seed + 100 + i) for i, t in enumerate(trees)])
    mask = torch.stack([tree_mask(t) for t in trees])
    dep = torch.stack([depths(t) for t in trees])
    return prompts, trees, tokens, mask, dep


@pytest.mark.parametrize("lengths", [(70,), (30, 23)], ids=["single", "ragged"])
def test_verify_tree(case, lengths):
    """A branching tree (nodes at cache_len + depth, ancestor-or-self mask): every node's logits
    equal HF's on prefix + the root-to-node path."""
    name, hf, _, target = case
    prompts, trees, tokens, mask, dep = _tree_batch(lengths, 60)
    ids, lens = right_pad(prompts)
    cache = target.new_cache(len(prompts), 96)
    target.prefill(ids, lens, cache)
    logits = target.verify(tokens, cache.lengths[:, None] + dep, mask, cache)
    assert cache.lengths.tolist() == list(lengths)
    for b, (p, parents) in enumerate(zip(prompts, trees)):
        checked = set()
        for leaf in leaves(parents):
            path = ancestors_or_self(parents, leaf)
            ref = hf_reference_logits(hf, p + tokens[b, path].tolist(), len(p), is_dynamic(name))
            assert_close(logits[b, path], ref[len(p):], ATOL, f"row {b} path {path}")
            checked.update(path)
        assert checked == set(range(len(parents)))


def test_commit_then_decode(case):
    """verify a tree, commit one root-to-leaf path per row (different lengths), decode on: the
    logits equal HF's on prefix + path + new tokens."""
    name, hf, _, target = case
    lengths = (30, 23)
    prompts, trees, tokens, mask, dep = _tree_batch(lengths, 70)
    ids, lens = right_pad(prompts)
    cache = target.new_cache(2, 96)
    target.prefill(ids, lens, cache)
    target.verify(tokens, cache.lengths[:, None] + dep, mask, cache)
    paths = [[0, 1, 4], [0, 3, 5]]  # TREE_A: r -> a -> d; TREE_B: r -> 3 -> 5 (cut to 2 nodes below)
    n = torch.tensor([3, 2])
    assert TREE_A[4] == 1 and TREE_A[1] == 0 and TREE_B[5] == 3 and TREE_B[3] == 0
    cache.commit(torch.tensor(paths), n)
    assert cache.lengths.tolist() == [33, 25]
    kept = [tokens[b, paths[b][:int(n[b])]].tolist() for b in range(2)]
    conts = [rand_tokens(4, 80 + b) for b in range(2)]
    steps = [target.decode(torch.tensor([c[t] for c in conts]), cache) for t in range(4)]
    ours = torch.stack(steps, 1)
    for b in range(2):
        seq = prompts[b] + kept[b] + conts[b]
        ref = hf_reference_logits(hf, seq, len(prompts[b]), is_dynamic(name))
        start = len(prompts[b]) + len(kept[b])
        assert_close(ours[b], ref[start:], ATOL, f"row {b} decode after commit")


@pytest.mark.parametrize("lengths", [(70,), (30, 23)], ids=["single", "ragged"])
def test_verify_tree_level_by_level(case, lengths):
    """The tree verified in three calls (nodes 0-2, 3-5, 6), each seeing the earlier, still
    pending levels through a [B, T, P + T] mask, gives the one-shot logits; committing a path
    afterwards works on the whole pending block."""
    name, hf, _, target = case
    prompts, _, tokens, _, _ = _tree_batch(lengths, 90)
    # TREE_A for every row: its levels are contiguous node ranges
    mask = tree_mask(TREE_A).expand(len(lengths), 7, 7)
    dep = depths(TREE_A).expand(len(lengths), 7)
    ids, lens = right_pad(prompts)
    cache = target.new_cache(len(prompts), 96)
    target.prefill(ids, lens, cache)
    positions = cache.lengths[:, None] + dep
    whole = target.verify(tokens, positions, mask, cache)
    cache.discard()
    parts = []
    for lo, hi in [(0, 3), (3, 6), (6, 7)]:
        parts.append(target.verify(tokens[:, lo:hi], positions[:, lo:hi], mask[:, lo:hi, :hi], cache))
        assert cache.pending == hi
    assert_close(torch.cat(parts, 1), whole, ATOL, "level by level vs one shot")
    for b, p in enumerate(prompts):
        path = ancestors_or_self(TREE_A, 6)
        ref = hf_reference_logits(hf, p + tokens[b, path].tolist(), len(p), is_dynamic(name))
        assert_close(whole[b, path], ref[len(p):], ATOL, f"row {b} path {path}")
    cache.commit(torch.tensor([[0, 1, 3, 6]] * len(lengths)), torch.tensor([4] * len(lengths)))
    nxt = rand_tokens(len(lengths), 95)
    out = target.decode(torch.tensor(nxt), cache)
    for b, p in enumerate(prompts):
        seq = p + tokens[b, [0, 1, 3, 6]].tolist() + [nxt[b]]
        ref = hf_reference_logits(hf, seq, len(p), is_dynamic(name))
        assert_close(out[b], ref[-1], ATOL, f"row {b} decode after commit")


def test_a_cpus_products_over_few_rows_equal_the_linear_layers():
    """On a CPU, inference over at most CPU_FEW_ROWS rows runs weight @ x^T (one row doubled):
    the same values as ``F.linear`` (float32 rounding), with and without a bias, for every shape
    of rows; more rows, and products under autograd, are ``F.linear`` itself."""
    import torch.nn.functional as F
    from longspec.models import layers

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    for shape in [(40,), (1, 40), (1, 1, 40), (2, 1, 40), (1, 3, 40), (4, 40), (1, 5, 40), (2, 4, 40)]:
        x = torch.randn(*shape, generator=g)
        for b in (None, bias):
            with torch.inference_mode():
                out = layers.linear(x, weight, b)
            ref = F.linear(x, weight, b)
            assert out.shape == ref.shape and out.is_contiguous()
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 40, generator=g, requires_grad=True)
    out = layers.linear(x, weight.requires_grad_(), bias)
    out.sum().backward()  # (autograd: F.linear's own)
    assert x.grad is not None and weight.grad is not None
    x1 = torch.randn(1, 40, generator=g)
    with torch.inference_mode():
        rows = {}
        real = torch.mm
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "mm", lambda a, c: (rows.setdefault("n", c.shape[1]), real(a, c))[1])
            layers.linear(x1, weight.detach())
        assert rows == {"n": 2}  # (one row runs as two)
