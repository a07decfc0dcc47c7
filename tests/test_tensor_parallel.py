"""Tensor parallelism on the CPU: two gloo processes, each holding half of a tiny target's heads,
MLP columns and vocabulary (an odd vocabulary: uneven shares; one KV head: replicated on both
ranks), must give the single-process logits and exactly its tokens, with every proposer, greedy
and sampled with a seed."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from longspec import GenerationConfig, Generator, load_target
from longspec.config import ModelConfig
from longspec.models.checkpoint import save_draft
from longspec.parallel import ParallelGenerator, Shard, TensorParallel
from test_draft import noisy_draft
from tp_ranks import CASES, run_cases, run_ranks

# llama: GQA 4/2, biases on every projection (the row-parallel ones are added once), odd vocabulary;
# qwen2: one KV head (both ranks hold it), tied embeddings; qwen3: q/k norms
MODELS = {
    "llama": dict(vocab_size=161, attention_bias=True, mlp_bias=True, max_position_embeddings=128),
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=128),
    "qwen3": dict(max_position_embeddings=128),
}


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    """{family: (target folder, random draft folder)}."""
    out = {}
    for family, overrides in MODELS.items():
        _, path = tiny_model_factory(f"tp-{family}", family, seed=3, **overrides)
        target = load_target(path)
        draft_dir = tmp_path_factory.mktemp(f"tp-draft-{family}")
        save_draft(noisy_draft(target, window=16, seed=4), draft_dir)
        out[family] = (str(path), str(draft_dir))
    return out


def single_process(models, family, cases) -> dict:
    path, draft_dir = models[family]
    return run_cases(load_target(path), draft_dir, cases)


def check_ranks(models, jobs):
    """Runs ``jobs`` ({family: case names}) on two ranks and on one process; the same tokens and
    acceptance counts (so the same drafts) on both ranks as in one process, and the same logits
    and draft states to float32 rounding."""
    ranks = run_ranks([(*models[f], cases) for f, cases in jobs.items()])
    for family, cases in jobs.items():
        path = models[family][0]
        assert ranks[0][path] == ranks[1][path], f"{family}: the ranks disagree"
        want = single_process(models, family, cases)
        for case in cases:
            got = ranks[0][path][case]
            if case == "logits":
                for what in ("logits", "draft"):
                    diff = (torch.tensor(ranks[0][path][what]) - torch.tensor(want[what])).abs().max()
                    assert diff < 1e-4, f"{family}: {what} differ by {diff}"
            else:
                assert got == want[case], f"{family} {case}: {got} != {want[case]}"


def test_logits_and_tokens_match_one_process(models):
    check_ranks(models, {"llama": ["logits", "none", "longspec", "longspec-sampled"],
                         "qwen2": ["logits", "longspec"], "qwen3": ["logits"]})


@pytest.mark.slow
def test_every_proposer_matches_one_process(models):
    check_ranks(models, {"llama": list(CASES), "qwen2": list(CASES)})


def test_sampled_run_is_not_greedy(models):
    """The sampled cases sample (so their match above is a real check of the seeded draws)."""
    got = single_process(models, "llama", ["none", "none-sampled"])
    assert got["none"][0] != got["none-sampled"][0]


def test_shares():
    cfg = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=10,
                                   hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64))
    shares = [Shard.of(cfg, TensorParallel(r, 4)) for r in range(4)]
    assert [s.q_heads for s in shares] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.kv_heads for s in shares] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # 2 KV heads, 4 ranks: each twice
    assert [s.ffn for s in shares] == [(0, 24), (24, 48), (48, 72), (72, 96)]
    assert [s.vocab for s in shares] == [(0, 3), (3, 6), (6, 9), (9, 10)] and shares[0].vocab_chunk == 3
    assert shares[1].rows_of("model.layers.0.self_attn.o_proj.weight") == (1, 16, 32)
    assert shares[1].rows_of("model.layers.0.mlp.down_proj.bias") is None
    with pytest.raises(ValueError, match="attention heads"):
        Shard.of(cfg, TensorParallel(0, 3))
    with pytest.raises(ValueError, match="intermediate_size"):
        Shard.of(dataclasses.replace(cfg, intermediate_size=90), TensorParallel(0, 4))
    with pytest.raises(ValueError, match="KV heads"):
        Shard.of(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), TensorParallel(0, 4))


def test_parallel_generator_drives_its_own_workers(models):
    """The Python API: this process is rank 0, one follower process; greedy and an unseeded
    sampled call (the driver's seed reaches every rank: they agree, or the call raises)."""
    path, draft_dir = models["llama"]
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 7]
    want = Generator(load_target(path), "longspec", "2,2", draft=draft_dir).generate(
        prompt, GenerationConfig(max_new_tokens=8)).sequences
    with ParallelGenerator(path, 2, proposer="longspec", draft=draft_dir, tree="2,2", threads=1) as gen:
        assert gen.target.shard.tp.world == 2 and gen.target.model.embed_tokens.num_embeddings == 81
        assert gen.generate(prompt, GenerationConfig(max_new_tokens=8)).sequences == want
        sampled = gen.generate(prompt, GenerationConfig(max_new_tokens=8, temperature=1.0))
        assert len(sampled.sequences[0]) == 8
        with pytest.raises(ValueError, match="outside the vocabulary"):  # raised on every rank, the group lives on
            gen.generate([1000], GenerationConfig(max_new_tokens=2))
        assert gen.generate(prompt, GenerationConfig(max_new_tokens=8)).sequences == want
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate(prompt)


@pytest.mark.slow
def test_cli_generate_tensor_parallel(models, tmp_path):
    from test_training_ddp import save_char_tokenizer

    path = models["llama"][0]
    save_char_tokenizer(path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    base = [sys.executable, "-m", "longspec.cli", "generate", "--target", path, "--prompt", "abcabcab",
            "--max-new-tokens", "6", "--proposer", "pld", "--json", "--threads", "1", "--device", "cpu"]
    outs = [json.loads(subprocess.run(base + extra, capture_output=True, text=True, env=env, check=True,
                                      timeout=300).stdout.strip().splitlines()[-1])
            for extra in ([], ["--tensor-parallel", "2"])]
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and len(outs[0]["token_ids"]) == 6
