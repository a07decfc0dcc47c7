"""What an audit broke outside the server: ``--out`` folders that held a user's files, malformed
checkpoints and GGUF files that ended in tracebacks, training that crashed on an empty held-out
split, a damaged metrics log and the files a kill leaves behind. Each case gets exit code 2 (or a
ValueError) with one line naming the file or option, and leaves the user's files alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from longspec import load_target
from longspec.cli import main
from longspec.models.checkpoint import load_draft, save_draft
from longspec.training import TrainConfig, train
from longspec.training.data import tokenize_documents, Document

from conftest import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    _, path = build_tiny_model(tmp_path_factory.mktemp("hard") / "model", "llama", reload=False,
                               max_position_embeddings=256)
    return path


@pytest.fixture
def ckpt(model_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(model_dir, dst)
    return dst


def user_folder(tmp_path):
    """A folder of a user's files."""
    folder = tmp_path / "v"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("x")
    return folder


def cli_error(capsys, *args) -> str:
    """Runs the CLI, expects exit code 2 and returns its one-line error."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and "\n" not in err, err
    return err


# ------------------------------------------------------------------------------------ --out

def test_convert_refuses_a_folder_of_user_files_and_an_existing_file(capsys, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    folder = user_folder(tmp_path)
    err = cli_error(capsys, "convert", "--gguf", str(gguf), "--out", str(folder))
    assert str(folder) in err and "--force" in err
    assert (folder / "notes.txt").read_text() == "x" and (folder / "sub").is_dir()
    afile = tmp_path / "out.txt"
    afile.write_text("keep")
    assert "is an existing file" in cli_error(capsys, "convert", "--gguf", str(gguf), "--out", str(afile))
    assert afile.read_text() == "keep"
    assert "would overwrite the input" in cli_error(capsys, "convert", "--gguf", str(gguf), "--out", str(tmp_path),
                                                    "--force")
    assert gguf.is_file()


@pytest.mark.parametrize("cut", [1024, 0.5])
def test_a_truncated_gguf_says_so(capsys, tmp_path, cut):
    from longspec.convert import default_gguf

    try:
        source = default_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    size = source.stat().st_size
    gguf = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        gguf.write_bytes(f.read(cut if cut > 1 else int(size * cut)))
    err = cli_error(capsys, "convert", "--gguf", str(gguf), "--out", str(tmp_path / "out"))
    assert "truncated" in err and str(gguf) in err
    assert not (tmp_path / "out").exists()


def test_train_and_draft_vocab_never_write_into_the_targets_folder(capsys, ckpt, tmp_path):
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    data = tmp_path / "d.txt"
    data.write_text("hello world " * 50)
    err = cli_error(capsys, "train", "--target", str(ckpt), "--data", str(data), "--out", str(ckpt), "--force",
                    "--device", "cpu", "--seq-len", "16", "--steps", "1")
    assert "would overwrite the input" in err
    err = cli_error(capsys, "draft-vocab", "--target", str(ckpt), "--draft", str(tmp_path), "--data", str(data),
                    "--out", str(ckpt))
    assert "would overwrite the input" in err
    folder = user_folder(tmp_path)
    err = cli_error(capsys, "train", "--target", str(ckpt), "--data", str(data), "--out", str(folder),
                    "--device", "cpu", "--seq-len", "16", "--steps", "1")
    assert "holds other files" in err and (folder / "notes.txt").read_text() == "x"
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_an_output_longspec_wrote_may_be_replaced(tmp_path, model_dir):
    from longspec.models.draft import DraftConfig, LongSpecDraft
    from longspec.outdir import check_out_dir, mark

    target = load_target(model_dir)
    out = tmp_path / "draft"
    save_draft(LongSpecDraft(DraftConfig.for_target(target, window=8), target), out)
    assert check_out_dir(out) == out  # a longspec draft
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="holds other files"):
        check_out_dir(converted)
    mark(converted, "convert")
    assert check_out_dir(converted) == converted
    # a link to an earlier output: refused up front (it was written, then the swap failed on the
    # link: exit 2, the link replaced by a folder, a stray temporary link left)
    link = tmp_path / "latest"
    link.symlink_to(converted)
    with pytest.raises(ValueError, match="is a symbolic link: give the folder it points to"):
        check_out_dir(link)
    assert link.is_symlink() and check_out_dir(link.resolve()) == converted


@pytest.mark.slow
def test_convert_replaces_its_own_output_and_with_force_keeps_a_users_other_files(capsys, tmp_path):
    from longspec.convert import default_gguf

    try:
        gguf = str(default_gguf())
    except FileNotFoundError as err:
        pytest.skip(str(err))
    out = tmp_path / "new"
    for _ in range(2):  # the second run replaces the first conversion
        assert main(["convert", "--gguf", gguf, "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]  # no temporary folder left
    folder = user_folder(tmp_path)
    assert main(["convert", "--gguf", gguf, "--out", str(folder), "--force"]) == 0
    assert (folder / "notes.txt").read_text() == "x" and (folder / "sub").is_dir()
    for path in (out, folder):
        load_target(path)


# ------------------------------------------------------------------------ malformed checkpoints

def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": 10 ** 9}, "describes"),
    ({"hidden_size": None}, "wrong type"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"rope_theta": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta must be a positive"),
])
def test_impossible_config_values_are_named(capsys, ckpt, changes, message):
    edit_config(ckpt, **changes)
    err = cli_error(capsys, "generate", "--target", str(ckpt), "--prompt", "hi", "--device", "cpu")
    assert message in err


def test_config_that_is_a_list_and_index_that_is_not_a_map(capsys, ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in cli_error(capsys, "generate", "--target", str(ckpt), "--prompt", "hi",
                                                  "--device", "cpu")


@pytest.mark.parametrize("weight_map,message", [
    (["model.safetensors"], "must map tensor names"),
    ({"model.norm.weight": "/etc/passwd"}, "not a file inside"),
    ({"model.norm.weight": "../ckpt-other/model.safetensors"}, "not a file inside"),
])
def test_an_index_names_only_files_inside_the_checkpoint(ckpt, weight_map, message):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=message):
        load_target(ckpt)


def test_non_finite_weights_are_refused(ckpt):
    file = ckpt / "model.safetensors"
    state = load_file(str(file))
    state["model.norm.weight"][3] = float("nan")
    save_file(state, str(file))
    with pytest.raises(ValueError, match="'model.norm.weight' in .* NaN"):
        load_target(ckpt)


def test_random_bytes_in_tensor_data_are_refused(ckpt):
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = torch.randint(0, 256, (len(data) - start,), generator=torch.Generator().manual_seed(0),
                                 dtype=torch.uint8).numpy().tobytes()
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="NaN or infinite"):
        load_target(ckpt)


def test_a_draft_with_window_0_is_refused(model_dir, tmp_path):
    from longspec.models.draft import DraftConfig, LongSpecDraft

    target = load_target(model_dir)
    out = save_draft(LongSpecDraft(DraftConfig.for_target(target, window=8), target), tmp_path / "draft")
    edit_config(out, window=0)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        load_draft(out, target)


# ------------------------------------------------------------------------------------- training

def word_tokenizer():
    """A fast (Rust) word-level tokenizer, the kind whose batch call failed on no documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "the", "cat", "sees", "dog", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<unk>")


def small_run(out, data, **kw):
    base = dict(data=[str(data)], out=str(out), seq_len=16, batch_size=2, steps=4, lr=1e-3, warmup=1, window=8,
                max_lag=2, eval_every=0, save_every=2, log_every=1, progress=False, device="cpu")
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "one.txt"
    data.write_text("the cat sees the dog . " * 200)
    return data


def test_an_empty_held_out_split_trains_without_evaluation(model_dir, one_file, tmp_path):
    assert tokenize_documents([], word_tokenizer()).numel() == 0
    assert tokenize_documents([Document("a", "the cat")], word_tokenizer()).tolist() == [1, 2, 0]
    result = train(small_run(tmp_path / "run", one_file), tokenizer=word_tokenizer(), target=load_target(model_dir))
    assert result.step == 4 and not any("eval_loss" in r for r in result.history)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_resume_survives_a_damaged_last_metrics_line_and_cleans_what_a_kill_left(model_dir, one_file, tmp_path):
    target, out = load_target(model_dir), tmp_path / "run"
    train(small_run(out, one_file, steps=2), tokenizer=word_tokenizer(), target=target)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a kill while the row was written
    pid = dead_pid()
    left = [out / "checkpoints" / f".step-00000004.tmp-{pid}-ab12", out / f".model.safetensors.tmp-{pid}-cd34",
            out / "checkpoints" / f".latest.tmp-{pid}-ef56"]
    left[0].mkdir()
    (left[0] / "model.safetensors").write_bytes(b"\0" * 1000)
    for path in left[1:]:
        path.write_bytes(b"\0")
    live = out / f".config.json.tmp-{os.getpid()}-gh78"  # a live process's: kept
    live.write_text("{}")
    result = train(small_run(out, one_file, steps=4, resume=True), tokenizer=word_tokenizer(), target=target)
    assert result.step == 4
    assert not any(p.exists() for p in left) and live.exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_a_damaged_metrics_line_before_the_last_names_the_file(capsys, model_dir, one_file, tmp_path):
    out = tmp_path / "run"
    train(small_run(out, one_file, steps=2), tokenizer=word_tokenizer(), target=load_target(model_dir))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(["{oops"] + lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl line 1 is damaged"):
        train(small_run(out, one_file, steps=4, resume=True), tokenizer=word_tokenizer(),
              target=load_target(model_dir))


# ------------------------------------------------------------------------------ seeds per row

def test_captured_draws_change_nothing_compiled_code_is_guarded_on():
    """A capture runs a round eagerly (sizing), then on a static buffer twice (warm-up, capture):
    compiled code that draws from the buffer must not be recompiled by the capture run (a
    recompilation inside a CUDA-graph capture makes the capture fail). Regression: the static
    draws recorded their layout in a dict that the compiled code was guarded on."""
    from torch._dynamo.utils import counters

    from longspec.spec.sampling import Uniforms, uniform

    u = Uniforms(torch.Generator().manual_seed(0), "cpu")
    u.seed_row(1, 7)  # a seeded row: its numbers go into the buffer's layout
    torch._dynamo.reset()
    draw = torch.compile(lambda x: x + uniform((2, 3), u) + uniform((2,), u)[:, None], backend="eager")
    x = torch.zeros(2, 3)
    rows, u.row_generators = u.row_generators, {}  # (a capture swaps the rows' generators out)
    u.eager()
    draw(x)  # sizing run
    u.make_static(u.used)
    u.refill()
    draw(x)  # warm-up
    before = dict(counters["stats"])
    u.refill()
    captured = draw(x)  # the capture's run
    assert dict(counters["stats"]) == before
    u.row_generators = rows
    u.refill()  # a replay: the seeded row's numbers come from its own stream (its first round)
    from longspec.spec.sampling import RowStream

    assert torch.equal(u.buffer[3:6], RowStream(7).draw((3,), 0, "cpu"))
    assert not torch.equal(draw(x), captured)


@pytest.mark.parametrize("static", [False, True])
def test_a_rows_own_generator_gives_it_the_same_numbers_in_any_batch(static):
    """A row with its own generator (a seeded server request) draws the same numbers whatever
    the batch size, the row it sits in and the shared generator's state, eagerly or from a
    captured round's buffer (refilled before each round)."""
    from longspec.spec.sampling import Uniforms

    def rounds(batch: int, row: int, first_row: int = 0) -> list:
        u = Uniforms(torch.Generator().manual_seed(batch * 31 + row), "cpu")
        u.first_row = first_row
        if static:  # as a capture: a sizing run (without the rows' generators), then the static
            u.eager()  # buffer its graphs read
            u((batch, 3))
            u.make_static(batch * 3)
            view = u((batch, 3))
        u.seed_row(row, 7)
        out = []
        for _ in range(3):
            u.refill()
            numbers = view if static else u((batch, 3))
            out.append(numbers[row - first_row].clone())
        u.drop_row(row)
        u.refill()
        assert not torch.equal((view if static else u((batch, 3)))[row - first_row], out[0])
        return out

    from longspec.spec.sampling import RowStream

    own = RowStream(7)
    expected = [own.draw((3,), i, "cpu") for i in range(3)]  # its first draw of three rounds
    assert not torch.equal(expected[0], expected[1])
    for batch, row, first_row in [(1, 0, 0), (4, 2, 0), (8, 7, 0), (2, 5, 4)]:
        assert all(torch.equal(a, b) for a, b in zip(rounds(batch, row, first_row), expected))


def test_a_seeded_rows_numbers_do_not_depend_on_the_batchs_tree_or_idle_rounds():
    """A seeded row's numbers at a tree node are the same whether the batch's round has one node
    or four (another row's proposals), and rounds in which the row draws nothing (it waits) do
    not move its stream: a seeded server request samples what it would alone (regression: the
    row's generator drew as many numbers as the batch's tree had nodes, so its later samples
    changed with its neighbours)."""
    from longspec.spec.sampling import Uniforms

    def numbers(nodes: list, idle: int) -> list:
        u = Uniforms(torch.Generator().manual_seed(0), "cpu")
        u.seed_row(1, 7)
        out = [u((2,))[1].clone()]  # the prefill's sample
        for _ in range(idle):
            u.refill()  # rounds of other rows while this one waits (it draws nothing)
        for n in nodes:
            u.refill()
            out.append(u((2, n))[1, 0].clone())  # the root's number (the walk's first)
            out.append(u((2,))[1].clone())  # the bonus token's
        return out

    alone = numbers([1, 4, 1], idle=0)
    assert all(torch.equal(a, b) for a, b in zip(alone, numbers([4, 4, 4], idle=2)))
    assert len({float(x) for x in alone}) == len(alone)  # (fresh numbers every draw)


def test_a_row_without_a_lookup_match_samples_as_its_plain_round_would():
    """In a batch's chain round, a seeded row whose prompt lookup found nothing (its chain's
    tokens arbitrary) draws the token its plain round would, alone on a CPU (the root alone):
    its nodes are no proposal, never tried (before: an arbitrary token was tried, and on
    rejection the sample came from the target's distribution without it)."""
    from longspec.spec.draft_tree import DraftTree
    from longspec.spec.sampling import Uniforms
    from longspec.spec.verify import verify_sampling

    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(1, 4, 12, generator=gen), -1)
    chain = torch.arange(-1, 3)[None]
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None]
    for seed in range(20):
        tokens = probs[0, 0].argsort(descending=True)[:4][None]  # likely tokens: often taken if tried
        valid = torch.tensor([[True, False, False, False]])
        alone, batch = Uniforms(None, "cpu"), Uniforms(None, "cpu")
        for u in (alone, batch):
            u.seed_row(0, seed)
            u.refill()
        plain = verify_sampling(DraftTree(tokens[:, :1], chain[:, :1], torch.zeros(1, 1, dtype=torch.long),
                                          mask[:, :1, :1], level_sizes=()), probs[:, :1], alone)
        nothing = verify_sampling(DraftTree(tokens, chain, torch.arange(4)[None], mask, level_sizes=(1, 1, 1),
                                            valid=valid), probs, batch)
        assert int(nothing.num_accepted) == 0 and torch.equal(nothing.bonus_token, plain.bonus_token), seed
