"""What a new user meets at the command line: --version, every command in the top-level help,
Ctrl-C, file errors that name the file, a prompt too long for the model refused before anything
slow (whatever the proposer), status lines before slow steps, and auto's one readable line."""
import time

import pytest

import longspec
from longspec.cli import commands, main
from longspec.spec.tree import TreeSpec

from test_cli import needs_default_model


class Loaded(Exception):
    """Raised by a stand-in for load_target: the command got as far as loading the model."""


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"longspec {longspec.__version__}"


def test_top_level_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for command in ("generate", "serve", "train", "self-distill", "draft-vocab", "convert"):
        assert top.count(f"\n  {command} ") == 1, (command, top)  # (once: one list of the commands)


def test_a_mistyped_option_shows_its_commands_usage(capsys):
    """An option the command does not have is named with the command's usage, not the top
    level's (which says nothing about the command's options)."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--max-new-tokes", "5"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: longspec generate" in err and "--max-new-tokes" in err, err


def test_generate_help_documents_json_streams(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "one JSON object on stdout" in text and "goes to stderr" in text


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("longspec.cli.cmd_generate", interrupted)
    assert main(["generate", "--prompt", "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "[longspec: interrupted]" and "Traceback" not in err


def test_file_errors_name_the_file(capsys, tmp_path):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(bytes(range(256)))
    assert main(["generate", "--target", "/nonexistent", "--prompt-file", str(binary)]) == 2
    err = capsys.readouterr().err
    assert f"--prompt-file {binary} is not UTF-8 text" in err and "codec" not in err, err
    assert main(["generate", "--target", str(tmp_path / "no-model"), "--prompt", "x"]) == 2
    assert "no-model" in capsys.readouterr().err


def test_a_prompt_file_is_a_regular_file_read_up_to_a_cap(capsys, tmp_path):
    """A FIFO (which would block), a link to ``/dev/zero`` (which never ends) and a file over the
    cap (a sparse one here: nothing is read) are refused at once, each named, before any model
    is looked at."""
    import os

    fifo, zero, huge = tmp_path / "fifo", tmp_path / "zero", tmp_path / "huge.txt"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    with open(huge, "wb") as f:
        f.truncate(commands.PROMPT_FILE_BYTES + 1)
    for path, why in ((fifo, "is not a regular file"), (zero, "is not a regular file"), (huge, "has 67108865 bytes")):
        start = time.perf_counter()
        assert main(["generate", "--target", "/nonexistent", "--prompt-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--prompt-file {path} {why}" in err, err
        assert time.perf_counter() - start < 2


@pytest.mark.parametrize("key", ["sekret ", " sekret", "  sekret  "])
def test_an_api_key_with_whitespace_around_it_is_refused_at_start(capsys, monkeypatch, key):
    """HTTP strips a header's surrounding whitespace: a server started with such a key answered
    401 to every request; it is refused before anything loads."""
    monkeypatch.delenv("LONGSPEC_API_KEY", raising=False)
    assert main(["serve", "--target", "/nonexistent", "--api-key", key]) == 2
    assert "whitespace around it" in capsys.readouterr().err


def test_auto_line_says_what_runs_and_why():
    chain, later = TreeSpec.chain(5), "; then chosen by measured speed after every round"
    assert commands.auto_line("pld", chain, 1.6) == \
        "auto: prompt lookup, chain of 5 (predicted 1.60x plain decoding)" + later
    assert commands.auto_line("hybrid", chain, 1.6) == \
        "auto: prompt lookup alone in the hybrid's engine, chain of 5 (predicted 1.60x plain decoding)" + later
    assert commands.auto_line("hybrid", None, None) == \
        "auto: plain decoding first: no speculative setting is predicted faster on this prompt" + later
    assert commands.auto_line("none", None, None) == \
        "auto: plain decoding: the prompt leaves no room for a speculative tree"
    hybrid = commands.auto_line("hybrid", TreeSpec.parse("4,4,4,4,4"), 1.41)
    assert hybrid == "auto: LongSpec draft + prompt lookup (hybrid), tree 4,4,4,4,4 (predicted 1.41x plain decoding)" \
        + later
    assert commands.predicted_gain("cost model: 1.62x plain decoding predicted") == 1.62
    assert commands.predicted_gain("the draft has no acceptance table: default tree") is None


def _no_load(*args, **kwargs):
    raise Loaded


@pytest.mark.parametrize("proposer", ["auto", "none", "pld", "hybrid"])
def test_a_prompt_too_long_fails_before_the_model_loads(capsys, monkeypatch, proposer):
    """9,000+ tokens for a model of 8,192 positions: refused from config.json and the tokenizer
    alone, in well under 2 s, with what to change."""
    needs_default_model()
    commands.tokenizer_for(longspec.default_model_path())  # (the tokenizer's first load is not what is timed)
    monkeypatch.setattr(longspec, "load_target", _no_load)
    prompt = "def add(a, b):\n    return a + b\n\n" * 700
    start = time.perf_counter()
    assert main(["generate", "--prompt", prompt, "--proposer", proposer, "--device", "cpu"]) == 2
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert "needs" in err and "the model has 8192: shorten the prompt, lower --max-new-tokens" in err, err
    assert seconds < 2.0, seconds


def test_auto_near_the_models_end_decodes_plainly_and_says_so(capsys, monkeypatch):
    """Where plain decoding fits but no speculative tree does, auto decides so before loading
    anything (instead of measuring costs and failing after)."""
    needs_default_model()
    ids = commands._tokenize(longspec.default_model_path(), "hello world", chat=False)
    monkeypatch.setattr(longspec, "load_target", _no_load)
    with pytest.raises(Loaded):  # it got as far as loading the model: the length passed
        main(["generate", "--prompt", "hello world", "--max-new-tokens", str(8193 - len(ids)), "--device", "cpu"])
    lines = capsys.readouterr().err.splitlines()
    assert "[longspec: auto: plain decoding: the prompt leaves no room for a speculative tree]" in lines, lines
    assert lines[-1].startswith("[longspec: loading SmolLM2-135M-Instruct")  # said before the slow step


def test_ctrl_c_while_generating_exits_130_without_a_traceback():
    """A real SIGINT in the middle of a generation (the default model, plain decoding)."""
    import os
    import signal
    import subprocess
    import sys

    needs_default_model()
    # SIGINT's default action in the child even where the tests run as a background job of a
    # non-interactive shell (which starts them with SIGINT ignored: Python then installs no handler)
    proc = subprocess.Popen([sys.executable, "-m", "longspec.cli", "generate", "--prompt", "def fibonacci(n):",
                             "--max-new-tokens", "2000", "--proposer", "none", "--threads", "1", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdout.read(1)  # text is streaming: the generation runs
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("[longspec: interrupted]") and "Traceback" not in err, err


def test_the_cli_starts_without_torchdynamo():
    """Importing the command line leaves TorchDynamo unloaded (1-4 s of a process's start): it is
    imported when a step is first compiled, which ``longspec generate`` never does by default."""
    import subprocess
    import sys

    code = "import sys, longspec.cli; print('torch._dynamo' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_version_and_help_answer_without_importing_torch():
    """``--version`` and ``--help`` import nothing heavy (they took ~4 s, Dynamo included)."""
    import subprocess
    import sys

    code = ("import sys\nfrom longspec.cli import main\nfor argv in (['--version'], ['--help'], ['serve', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_ctrl_c_while_the_libraries_load_exits_130_with_one_line(capsys, monkeypatch):
    """The heavy imports happen inside the command (where Ctrl-C is one line and status 130),
    not before it."""
    import longspec.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "use_compile_caches", interrupted)
    assert main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err.strip() == "[longspec: interrupted]"


def test_a_file_given_as_the_draft_is_said_before_anything_loads(tmp_path, capsys):
    """``--draft`` naming a file (or nothing) is refused before the model loads, saying which."""
    text = tmp_path / "notes.md"
    text.write_text("not a draft")
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert main([*command, "--draft", str(text), "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert f"{text} is a file, not a checkpoint directory" in err and "loading" not in err, err
        assert main([*command, "--draft", str(tmp_path / "missing"), "--device", "cpu"]) == 2
        assert "checkpoint directory not found" in capsys.readouterr().err


def test_the_summary_line_gives_the_prefill_and_the_decoding_apart():
    """An 8,151-token prompt once showed "8.5 tokens/s" for a 44-second command: the rate leaves
    the prefill out, so the line says both."""
    stats = dict(new_tokens=64, wall_s=44.2, prompt_tokens=8151, prefill_s=36.9, tokens_per_s=8.5, steps=20, tau=3.2,
                 trees=[(0, "chain:8"), (12, None)])
    assert commands.summary_line(stats) == ("[64 tokens in 44.2 s (the 8,151-token prompt's prefill: 36.9 s), 8.5 "
                                            "tokens/s after it, 20 steps, tau 3.20, chain:8, plain from token 12]")
    assert "tokens/s after it (about 2.4x plain decoding's), 20 steps" in commands.summary_line({**stats, "vs_plain": 2.43})


def test_json_says_what_the_user_chose_and_what_ran_first(capsys):
    """``--json`` with the default auto: "proposer" is "auto" (what was chosen), "tree" the one
    predicted fastest (null: plain rounds), as the status line says; what ran when in
    stats["trees"]; every value a JSON type (no "None" strings)."""
    import json

    needs_default_model()
    assert main(["generate", "--prompt", "def f(x):\n    return x\n" * 6, "--max-new-tokens", "6", "--json",
                 "--threads", "1", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.splitlines()[-1])
    assert out["proposer"] == "auto" and out["auto"].startswith("cost model")
    assert out["stats"]["trees"][0][0] == 0
    assert all(isinstance(at, int) and (tree is None or isinstance(tree, str)) for at, tree in out["stats"]["trees"])
    said = [line for line in captured.err.splitlines()  # (the choice; not the costs' first measurement)
            if line.startswith("[longspec: auto: ") and "measuring the step costs" not in line]
    assert said and ("plain decoding first" in said[0]) == (out["tree"] is None)
    assert out["tree"] is None or commands.describe_tree(out["tree"]) in said[0]
