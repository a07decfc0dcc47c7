"""Autoregressive generation (``Generator`` without a proposer) against transformers' ``generate``:
greedy token for token (batches of ragged prompts, several families and RoPE scalings), EOS
stopping per row, sampling determinism, statistics, streaming."""
from __future__ import annotations

import pytest
import torch

from longspec import GenerationConfig, load_target

try:
    from longspec import Generator
except ImportError:  # pragma: no cover - the lazy import of longspec/__init__.py
    from longspec.decoding.generator import Generator

from conftest import hf_reset_rope

VOCAB = 160

MODELS = {
    # name -> (family, rope, HF overrides)
    "llama-gqa": ("llama", None, dict(max_position_embeddings=128)),
    "qwen3": ("qwen3", None, dict(max_position_embeddings=128)),
    # prompts shorter than max_position_embeddings, generation runs past it
    "llama-dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}, dict(max_position_embeddings=32)),
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
                   dict(max_position_embeddings=32)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def models(request, tiny_model_factory):
    family, rope, overrides = MODELS[request.param]
    hf, path = tiny_model_factory(f"gen-{request.param}", family, rope, seed=21, **overrides)
    return request.param, hf, load_target(path), path


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, prompt, n_new, eos=None):
    hf_reset_rope(hf)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_generate(models):
    name, hf, target, _ = models
    n_new = 24
    prompts = prompts_of((5, 17, 11), seed=1)
    out = Generator(target, max_len=64).generate(prompts, GenerationConfig(max_new_tokens=n_new))
    assert len(out.sequences) == 3
    for prompt, seq in zip(prompts, out.sequences):
        assert seq == hf_greedy(hf, prompt, n_new)


def test_greedy_single_prompt_and_one_token(models):
    name, hf, target, _ = models
    prompt = prompts_of((9,), seed=2)[0]
    gen = Generator(target, max_len=64)
    out = gen.generate(prompt, GenerationConfig(max_new_tokens=1))  # a flat list = one prompt
    assert out.sequences == [hf_greedy(hf, prompt, 1)]
    out = gen.generate(torch.tensor(prompt), GenerationConfig(max_new_tokens=6))
    assert out.sequences == [hf_greedy(hf, prompt, 6)]


def test_greedy_ignores_batch_companions(models):
    """A row's output does not depend on the other rows of the batch."""
    name, hf, target, _ = models
    prompts = prompts_of((12, 3, 20, 7), seed=3)
    gen = Generator(target, max_len=64)
    config = GenerationConfig(max_new_tokens=10)
    batch = gen.generate(prompts, config).sequences
    for prompt, seq in zip(prompts, batch):
        assert gen.generate([prompt], config).sequences[0] == seq


def test_eos_stops_each_row(models):
    name, hf, target, _ = models
    n_new, k = 16, 5
    prompts = prompts_of((6, 14, 9), seed=4)
    gen = Generator(target, max_len=64)
    free = gen.generate(prompts, GenerationConfig(max_new_tokens=n_new, ignore_eos=True)).sequences
    # an EOS token that row 1 produces first at step k (and, if possible, no other row produces)
    candidates = [s for s in range(k, n_new - 1) if free[1][s] not in free[1][:s]]
    assert candidates, "degenerate test model"
    step = next((s for s in candidates if all(free[1][s] not in free[r] for r in (0, 2))), candidates[0])
    eos = free[1][step]

    def expected(seq):
        return seq[:seq.index(eos) + 1] if eos in seq else seq

    out = gen.generate(prompts, GenerationConfig(max_new_tokens=n_new, eos_token_id=eos))
    assert out.sequences[1] == free[1][:step + 1]  # stops at the EOS, which is included
    assert out.sequences == [expected(s) for s in free]
    assert any(len(s) == n_new for s in out.sequences), "another row should keep going"
    assert out.stats["new_tokens"] == sum(map(len, out.sequences))
    # transformers stops at the same place for each prompt alone
    for prompt, seq in zip(prompts, out.sequences):
        assert hf_greedy(hf, prompt, n_new, eos=eos) == seq
    # several EOS ids (one never produced); the model's own EOS id (config.json) is the default;
    # ignore_eos overrides both
    unused = next(t for t in range(VOCAB) if t not in sum(free, []))
    out2 = gen.generate(prompts, GenerationConfig(max_new_tokens=n_new, eos_token_id=[unused, eos]))
    assert out2.sequences == out.sequences
    own = load_target(models[3])
    own.config.eos_token_id = eos
    gen_own = Generator(own, max_len=64)
    assert gen_own.generate(prompts, GenerationConfig(max_new_tokens=n_new)).sequences == out.sequences
    assert gen_own.generate(prompts, GenerationConfig(max_new_tokens=n_new, ignore_eos=True)).sequences == free


def test_eos_as_first_token(models):
    """A row whose very first token (from the prefill logits) is EOS outputs just [EOS]."""
    name, hf, target, _ = models
    prompts = prompts_of((8, 5), seed=9)
    gen = Generator(target, max_len=64)
    free = gen.generate(prompts, GenerationConfig(max_new_tokens=6)).sequences
    eos = free[0][0]
    out = gen.generate(prompts, GenerationConfig(max_new_tokens=6, eos_token_id=eos)).sequences
    assert out[0] == [eos]
    assert out[1] == (free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1])


def test_stats_and_streamer(models):
    name, hf, target, _ = models
    prompts = prompts_of((4, 10), seed=5)
    seen = {0: [], 1: []}
    out = Generator(target, max_len=64).generate(
        prompts, GenerationConfig(max_new_tokens=7), streamer=lambda row, toks: seen[row].extend(toks))
    assert [seen[0], seen[1]] == out.sequences
    stats = out.stats
    assert stats["new_tokens"] == 14
    assert stats["prompt_tokens"] == 14
    assert stats["steps"] >= 6  # one decode per token after the first (from the prefill)
    assert stats["tokens_per_s"] > 0
    for key in ("prefill_s", "decode_s", "wall_s"):
        assert stats[key] >= 0


def test_sampling_same_seed_same_output(models):
    name, hf, target, _ = models
    prompts = prompts_of((5, 13, 8), seed=6)
    gen = Generator(target, max_len=64)
    config = GenerationConfig(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.95, seed=123)
    a = gen.generate(prompts, config).sequences
    b = gen.generate(prompts, config).sequences
    assert a == b
    for seq in a:
        assert len(seq) == 20 and all(0 <= t < VOCAB for t in seq)
    c = gen.generate(prompts, GenerationConfig(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.95,
                                               seed=124)).sequences
    assert c != a  # 3 x 20 tokens from ~50 candidates: equal with negligible probability
    greedy = gen.generate(prompts, GenerationConfig(max_new_tokens=20)).sequences
    assert a != greedy


def test_sampling_unseeded_and_top_k_1_is_greedy(models):
    name, hf, target, _ = models
    prompts = prompts_of((7, 3), seed=7)
    gen = Generator(target, max_len=64)
    greedy = gen.generate(prompts, GenerationConfig(max_new_tokens=12)).sequences
    top1 = gen.generate(prompts, GenerationConfig(max_new_tokens=12, temperature=0.7, top_k=1, seed=0))
    assert top1.sequences == greedy
    free = gen.generate(prompts, GenerationConfig(max_new_tokens=12, temperature=1.5))  # no seed
    assert all(len(s) == 12 and all(0 <= t < VOCAB for t in s) for s in free.sequences)


def test_greedy_batch_invariant_long_prompts_dynamic(tiny_model_factory):
    """Dynamic NTK with prompts longer than max_position_embeddings: a row's greedy output must
    equal transformers' on that prompt alone, whatever the other rows' lengths."""
    hf, path = tiny_model_factory("gen-dynamic-long", "llama", {"rope_type": "dynamic", "factor": 2.0},
                                  seed=22, max_position_embeddings=32)
    target = load_target(path)
    prompts = prompts_of((60, 40), seed=8)
    out = Generator(target, max_len=80).generate(prompts, GenerationConfig(max_new_tokens=8))
    assert out.sequences[0] == hf_greedy(hf, prompts[0], 8)
    assert out.sequences[1] == hf_greedy(hf, prompts[1], 8)
