"""The command line as a new user meets it: argument errors exit 2 with a message of ours (no
traceback) before any model is loaded, the one-time conversion of the default model announces
itself (the README's examples run in test_docs.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

from longspec.cli import main
from longspec.spec.tree import TreeSpec
from conftest import needs_default_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent/target"  # never loaded: every error below must come first


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be finite and >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an int >= 0"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--device", "tpu"], "--device 'tpu' is not a device longspec runs on"),
    (["--device", "cuda:x"], "--device 'cuda:x' is not a device longspec runs on"),
    (["--device", "cpu", "--dtype", "float8"], "--dtype 'float8' is not one of"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--proposer", "pld", "--tree", "4,x"], "invalid tree spec"),
    (["--tree", "chain:3"], "--tree needs a proposer"),
    (["--proposer", "longspec"], "needs --draft DIR"),
])
def test_argument_errors_come_before_loading(capsys, args, message):
    assert main(["generate", "--target", MISSING, "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "checkpoint directory not found" not in err, err


def test_self_distill_argument_errors_come_before_loading(capsys):
    base = ["self-distill", "--target", MISSING, "--docs", "d", "--out", "o.jsonl"]
    assert main([*base, "--tasks", "summarise,poetry"]) == 2
    assert "--tasks must name some of summarise,explain,continue,question" in capsys.readouterr().err
    assert main([*base, "--batch", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    for bad in ("2/2", "one/2", "3"):
        assert main([*base, "--shard", bad]) == 2
        assert "--shard takes I/N with 0 <= I < N" in capsys.readouterr().err


def test_serve_bucket_errors_come_before_loading(capsys):
    base = ["serve", "--target", MISSING, "--max-batch", "4"]
    assert main([*base, "--buckets", "2,9"]) == 2
    assert "--buckets must lie in 1..--max-batch (4)" in capsys.readouterr().err
    assert main([*base, "--buckets", "two"]) == 2
    assert "comma-separated batch sizes" in capsys.readouterr().err
    assert main([*base, "--proposer", "pld", "--bucket-trees", "4=2,x"]) == 2
    assert "--bucket-trees takes auto, off or 'B=TREE;B=TREE'" in capsys.readouterr().err
    assert main([*base, "--proposer", "pld", "--bucket-trees", "2,2,2"]) == 2
    assert "(expected BUCKET=TREE)" in capsys.readouterr().err
    assert main([*base, "--bucket-trees", "4=2,2"]) == 2
    assert "--bucket-trees needs a proposer" in capsys.readouterr().err
    assert main([*base, "--proposer", "pld", "--bucket-trees", "3=2,2"]) == 2
    assert "batch size 3, which is not a bucket ([1, 2, 4])" in capsys.readouterr().err
    assert main([*base, "--proposer", "pld", "--tree", "2,2", "--bucket-trees", "4=2,2,2"]) == 2
    assert "does not fit --tree 2,2" in capsys.readouterr().err
    assert main([*base, "--max-len", "512", "--prefill-chunk", "1024"]) == 2
    assert "--prefill-chunk (1024) must not exceed --max-len (512)" in capsys.readouterr().err
    from longspec.decoding.bucket_choice import bucket_trees_option  # what passes: a tree that fits, or plain rounds
    assert bucket_trees_option("2=2,2;4=plain", "pld", TreeSpec.parse("2,2,2"), None, 4) == \
        {2: TreeSpec.parse("2,2"), 4: None}


def test_prompt_errors(capsys, tmp_path):
    assert main(["generate", "--target", MISSING, "--prompt", ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--target", MISSING, "--prompt-file", str(tmp_path / "none.txt")]) == 2
    assert "none.txt not found" in capsys.readouterr().err
    assert main(["generate", "--target", MISSING, "--prompt-file", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def run_cli(*args, env=None, timeout=600):
    import os

    return subprocess.run([sys.executable, "-m", "longspec.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow  # ~190 s on a 2-core CPU: 18% of the default run
def test_first_run_converts_then_auto_measures_once_and_matches_plain_decoding(tmp_path):
    """A first run in a fresh home announces the default model's conversion and the model; the
    default `generate` (--proposer auto) measures its step costs once per device (cached under
    LONGSPEC_HOME), picks a setting by the cost model and says which; a second run reads the
    cache; greedy output is the same as plain decoding. (One test: each fresh home converts the
    model and measures the costs again, about a minute each on a CPU.)"""
    import json

    needs_default_model()
    prompt = "def add(a, b):\n    return a + b\n\n" * 12 + "def add(a, b):\n"
    home = {"LONGSPEC_HOME": str(tmp_path)}
    runs = [run_cli("generate", "--prompt", prompt, "--max-new-tokens", "16", "--threads", "1", "--json",
                    *extra, env=home) for extra in ([], [], ["--proposer", "none"])]
    for run in runs:
        assert run.returncode == 0, run.stderr
    lines = runs[0].stderr.splitlines()
    assert lines[0].startswith("[longspec: converting the default model (SmolLM2-135M-Instruct) once into")
    assert any("converted in" in line for line in lines)
    assert any("a small demo model" in line for line in lines)
    assert any(line.startswith("[longspec: auto: ") for line in lines)  # --proposer auto says what runs and why
    assert "Loading weights" not in runs[0].stderr and "Traceback" not in runs[0].stderr
    assert not any("converting" in line for line in runs[1].stderr.splitlines())  # converted once
    auto, again, plain = (json.loads(run.stdout.splitlines()[-1]) for run in runs)
    assert auto["proposer"] == "auto" and auto["auto"].startswith("cost model")  # (what the user chose)
    from longspec.decoding import auto as cost_model, step_costs
    from longspec.spec.tree import TreeSpec

    costs = json.loads((tmp_path / "costs.json").read_text())
    assert len(costs) == len(step_costs.COST_CONTEXTS)  # one device and model, at each context measured
    shapes = [f"chain:{n}" for n in cost_model.LOOKUP_CHAINS] + list(cost_model.AUTO_TREES)
    for entry in costs.values():
        assert {"1"} | {str(TreeSpec.parse(s).num_nodes) for s in shapes} <= set(entry["target_ms"])
        assert {f"hybrid {TreeSpec.parse(s)}" for s in shapes} <= set(entry["draft_ms"])
    # the second run reads the costs (no measuring) and starts from what the first one learned
    assert not any("measuring" in line for line in runs[1].stderr.splitlines())
    assert again["proposer"] == auto["proposer"] and again["auto"].startswith("cost model")
    assert json.loads((tmp_path / "corrections.json").read_text())
    assert auto["token_ids"] == plain["token_ids"] == again["token_ids"]


def test_context_error_names_the_options():
    needs_default_model()
    run = run_cli("generate", "--prompt", "x", "--max-new-tokens", "9000", "--proposer", "pld")
    assert run.returncode == 2
    assert "shorten the prompt, lower --max-new-tokens or use a smaller --tree" in run.stderr, run.stderr
    assert "Generator(" not in run.stderr and "Traceback" not in run.stderr


def test_help_is_plain_and_names_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "serve         an OpenAI-compatible server" in top
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("(default: 128)", "(default: 1, off)", "(default: 0, off)", "(default: none)",
                     "default: chain:5 for pld, chain:3 on a CPU; 4,16,16,16,16,1,1,1,1,1 for hybrid; 4,16,16,16,16 otherwise", "shipped for the default model"):
        assert fragment in text, fragment


def test_the_default_models_conversion_is_never_silent(tmp_path, monkeypatch, capsys):
    """Converting the default model says each stage, and while a stage runs (transformers' own
    say nothing for seconds) a line every BEAT_S seconds with the stage and the time so far."""
    import time

    from longspec import convert, status

    monkeypatch.setenv("LONGSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(status, "BEAT_S", 0.05)
    monkeypatch.setattr(convert, "default_gguf", lambda: tmp_path / "model.gguf")

    def slow(gguf, out, progress):
        time.sleep(0.2)
        progress("dequantising the weights")
        time.sleep(0.3)
        (out / "config.json").parent.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(convert, "convert_gguf", slow)
    assert convert.default_model_dir(announce=True) == tmp_path / "models" / convert.DEFAULT_NAME
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[longspec: converting the default model") and lines[-1].startswith("[longspec: converted in")
    stage = lines.index("[longspec:   dequantising the weights ...]")
    assert any(line.startswith("[longspec:   loading the converter: ") and line.endswith(" s so far]") for line in lines[:stage])
    assert sum(line.startswith("[longspec:   dequantising the weights: ") for line in lines[stage:]) >= 3
