"""Draft training on a tiny target: the target forward the trainer reads, held-out loss falls,
distillation, bit-exact resume after an interruption, metrics windows and a non-finite loss,
checkpoints that load with ``load_draft``, the CLI's errors, a trained draft lossless and accepted
more than an untrained one, warm starts, ``--compile``, and self-distillation data."""
import json
import random
from pathlib import Path

import pytest
import torch

from longspec import load_target
from longspec.cli import main
from longspec.models.checkpoint import load_draft
from longspec.training import TrainConfig, iter_documents, target_forward, train
from longspec.training.checkpoints import latest_checkpoint


ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n#=_/()0123456789:"


class CharTokenizer:
    """A trivial character-level tokenizer: id 0 = eos, 1 = bos, then one id per character."""

    bos_token_id, eos_token_id = 1, 0

    def encode(self, text, add_special_tokens=False):
        return [2 + ALPHABET.index(ch) for ch in text if ch in ALPHABET]


def grammar_text(rng: random.Random, sentences: int) -> str:
    """Synthetic but learnable text: sentences of a tiny grammar."""
    nouns = ["cat", "dog", "bird", "fish", "horse"]
    verbs = ["sees", "likes", "chases", "finds"]
    adjs = ["big", "small", "red", "quick"]
    out = []
    for _ in range(sentences):
        out.append(f"the {rng.choice(adjs)} {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}.")
    return " ".join(out) + "\n"


def write_corpus(path, docs: int = 40, sentences: int = 12, seed: int = 0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": grammar_text(rng, sentences), "meta": 1}) + "\n")
    return path


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    _, path = tiny_model_factory("train-llama", "llama", max_position_embeddings=256, seed=5)
    return load_target(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "grammar.jsonl")


def small_config(out, corpus, **kw):
    base = dict(data=[str(corpus)], out=str(out), seq_len=32, batch_size=4, steps=40, lr=3e-3, warmup=4,
                window=16, max_lag=3, eval_fraction=0.2, eval_every=0, eval_chunks=16, save_every=0, log_every=1,
                progress=False, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------------------ target forward

def test_target_forward_matches_prefill_cache(target):
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    out = target_forward(target, ids, torch.arange(12).expand(2, 12), want_hidden=True)
    cache = target.new_cache(2, 12)
    logits = target.prefill(ids, torch.full((2,), 12), cache, all_logits=True)
    torch.testing.assert_close(out.k, cache.k[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.v, cache.v[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.logits(out.hidden), logits, rtol=1e-4, atol=1e-4)
    assert not out.k.requires_grad and not out.k.is_inference()  # usable in the draft's backward


# ------------------------------------------------------------------------------------- trainer

def test_training_reduces_held_out_loss_and_checkpoints_load(target, corpus, tmp_path):
    out = tmp_path / "run"
    result = train(small_config(out, corpus, steps=60, eval_every=30), tokenizer=CharTokenizer(), target=target)
    evals = [r for r in result.history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    assert evals[-1]["eval_loss"] < 0.6 * evals[0]["eval_loss"], evals
    assert evals[-1]["eval_acc"] > evals[0]["eval_acc"] + 0.2, evals
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == json.loads(json.dumps(result.history))
    assert {"step", "loss", "lr", "tokens_per_s", "acc"} <= set(rows[1])
    # the output directory and the checkpoint are loadable drafts
    for path in (out, latest_checkpoint(out)):
        draft = load_draft(path, target)
        for name, p in draft.state_dict().items():
            assert torch.equal(p, result.draft.state_dict()[name]), name
    assert latest_checkpoint(out).name == "step-00000060"
    with pytest.raises(ValueError, match="already holds a training run"):
        train(small_config(out, corpus), tokenizer=CharTokenizer(), target=target)


def test_resume_is_bit_exact(target, corpus, tmp_path):
    kw = dict(steps=10, save_every=4, grad_accum=2, batch_size=2, eval_every=5, keep_checkpoints=1)
    full = train(small_config(tmp_path / "full", corpus, **kw), tokenizer=CharTokenizer(), target=target)

    class Killed(Exception):
        pass

    def kill_after_6(step, metrics):
        if step == 6:
            raise Killed

    out = tmp_path / "interrupted"
    with pytest.raises(Killed):
        train(small_config(out, corpus, **kw), tokenizer=CharTokenizer(), target=target, callback=kill_after_6)
    assert latest_checkpoint(out).name == "step-00000004"  # steps 5-6 are lost, as after a kill
    resumed = train(small_config(out, corpus, resume=True, **kw), tokenizer=CharTokenizer(), target=target)
    assert resumed.step == 10
    for name, p in full.draft.state_dict().items():
        assert torch.equal(p, resumed.draft.state_dict()[name]), name
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(11))  # rows of the lost steps were replaced
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s",)} for r in rows]  # noqa: E731
    assert strip(logged) == strip(json.loads(json.dumps(full.history)))
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000010"]


def test_metrics_are_read_in_windows_and_a_non_finite_loss_stops_before_the_next_checkpoint(
        target, corpus, tmp_path, monkeypatch, capsys):
    from longspec.training.trainer import Trainer

    # logging every 5 steps gives the same rows as averaging the per-step rows of log_every=1
    every = train(small_config(tmp_path / "every", corpus, steps=10), tokenizer=CharTokenizer(), target=target)
    capsys.readouterr()
    fives = train(small_config(tmp_path / "fives", corpus, steps=10, log_every=5, eval_every=10),
                  tokenizer=CharTokenizer(), target=target)
    lines = [line for line in capsys.readouterr().err.splitlines() if " step " in line]  # no bar: a line per row
    assert [line.split(":")[0] for line in lines] == [f"[longspec train] step {n}" for n in (0, 5, 10)]
    assert "held-out loss" in lines[0] and "tokens/s" in lines[1] and "held-out loss" not in lines[1]
    assert "tokens/s" in lines[2] and "held-out loss" in lines[2]
    for row in (r for r in fives.history if "loss" in r):
        steps = [r for r in every.history if row["step"] - 5 < r["step"] <= row["step"]]
        for key in ("loss", "acc", "grad_norm"):
            assert row[key] == pytest.approx(sum(r[key] for r in steps) / 5, rel=1e-9), key
    step = Trainer.train_step

    def poisoned(self):  # the draft's weights turn NaN before step 3
        if self.step == 2:
            with torch.no_grad():
                next(self.draft.parameters()).fill_(float("nan"))
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(FloatingPointError, match="at step 3"):
        train(small_config(out, corpus, steps=10, log_every=5, save_every=4), tokenizer=CharTokenizer(),
              target=target)
    assert latest_checkpoint(out) is None  # read at step 4, before its checkpoint


def test_distillation_loss_decreases(target, corpus, tmp_path):
    result = train(small_config(tmp_path / "kd", corpus, steps=30, eval_every=30, distill=True),
                   tokenizer=CharTokenizer(), target=target)
    evals = [r for r in result.history if "eval_kl" in r]
    assert evals[-1]["eval_kl"] < 0.8 * evals[0]["eval_kl"], evals
    train_rows = [r for r in result.history if "kl" in r]
    first, last = train_rows[:3], train_rows[-3:]
    assert sum(r["loss"] for r in last) < 0.8 * sum(r["loss"] for r in first)
    # mixed with CE: the objective (1 - w) CE + w KL falls too
    mixed = train(small_config(tmp_path / "mixed", corpus, steps=20, distill=True, distill_weight=0.5),
                  tokenizer=CharTokenizer(), target=target).history
    assert all(r["loss"] == pytest.approx(0.5 * r["ce"] + 0.5 * r["kl"]) for r in mixed if "loss" in r)
    assert sum(r["loss"] for r in mixed[-3:]) < 0.8 * sum(r["loss"] for r in mixed[:3])


def test_ablation_flags_and_config_errors(target, corpus, tmp_path):
    result = train(small_config(tmp_path / "plain", corpus, steps=3, anchor_offset=False, noise=False),
                   tokenizer=CharTokenizer(), target=target)
    assert result.step == 3
    fresh = train(small_config(tmp_path / "fresh", corpus, steps=2, resume=True), tokenizer=CharTokenizer(),
                  target=target)  # --resume without a checkpoint starts from scratch
    assert fresh.step == 2
    with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings"):
        train(small_config(tmp_path / "long", corpus, seq_len=512), tokenizer=CharTokenizer(), target=target)
    with pytest.raises(ValueError, match="max_lag \\+ 2"):
        train(small_config(tmp_path / "lag", corpus, seq_len=4, max_lag=4), tokenizer=CharTokenizer(), target=target)


def test_cli_errors(tiny_model_factory, corpus, tmp_path, capsys):
    _, path = tiny_model_factory("train-llama", "llama", max_position_embeddings=256, seed=5)
    base = ["train", "--target", str(path), "--data", str(corpus), "--out", str(tmp_path / "o"), "--device", "cpu"]
    assert main(base + ["--seq-len", "999"]) == 2
    assert "error: --seq-len 999 exceeds the target's max_position_embeddings (256)" in capsys.readouterr().err
    assert main(base + ["--seq-len", "32"]) == 2  # the tiny model directory has no tokenizer
    assert "no tokenizer files" in capsys.readouterr().err


def test_trained_draft_is_lossless_and_beats_untrained(target, corpus, tmp_path):
    """A draft distilled from the tiny target keeps greedy output identical (chain, static and
    beam trees; batch 1 and 3) and is accepted more often than the untrained one."""
    from longspec import GenerationConfig, Generator, LongSpecProposer, TreeSpec
    from longspec.models.draft import DraftConfig, init_draft

    result = train(small_config(tmp_path / "run", corpus, steps=60, distill=True), tokenizer=CharTokenizer(),
                   target=target)
    trained = load_draft(tmp_path / "run", target)
    untrained = init_draft(DraftConfig.for_target(target, window=16), target)
    rng = random.Random(3)
    tok = CharTokenizer()
    prompts = [[tok.bos_token_id] + tok.encode(grammar_text(rng, 2 + i)) for i in range(3)]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    expected = Generator(target).generate(prompts, config).sequences
    taus = {}
    for tree in ("chain:4", "[[0],[1],[0,0],[1,0],[0,0,0]]", "3,4,4"):
        for batch in (prompts[:1], prompts):
            for name, draft in (("trained", trained), ("untrained", untrained)):
                out = Generator(target, proposer=LongSpecProposer(draft), tree=TreeSpec.parse(tree)).generate(
                    batch, config)
                assert out.sequences == expected[:len(batch)], (tree, name, len(batch))
                taus.setdefault(name, []).append(out.stats["tau"])
    assert sum(taus["trained"]) > sum(taus["untrained"]) + 0.5, (taus, result.history[-1])


def test_warm_start_continues_a_trained_draft_and_a_wider_draft_trains(target, corpus, tmp_path):
    """``--init-from`` a trained draft: the run starts at that draft's held-out loss and improves
    on it. A draft of another window or MLP width is refused; ``--intermediate-size`` trains and
    saves a draft of that width."""
    plain = train(small_config(tmp_path / "plain", corpus, steps=30), tokenizer=CharTokenizer(), target=target)
    warm = train(small_config(tmp_path / "warm", corpus, steps=30, eval_every=30, lr=1e-3,
                              init_from=str(tmp_path / "plain")), tokenizer=CharTokenizer(), target=target)
    evals = [r["eval_loss"] for r in warm.history if "eval_loss" in r]
    assert evals[0] == pytest.approx(plain.history[-1]["eval_loss"], rel=1e-5)
    assert evals[-1] < evals[0]
    with pytest.raises(ValueError, match="window"):
        train(small_config(tmp_path / "other", corpus, window=8, init_from=str(tmp_path / "plain")),
              tokenizer=CharTokenizer(), target=target)
    with pytest.raises(ValueError, match="intermediate_size"):
        train(small_config(tmp_path / "wide", corpus, intermediate_size=96, init_from=str(tmp_path / "plain")),
              tokenizer=CharTokenizer(), target=target)
    with pytest.raises(ValueError, match="intermediate_size must be >= 1"):
        train(small_config(tmp_path / "zero", corpus, intermediate_size=0), tokenizer=CharTokenizer(), target=target)
    train(small_config(tmp_path / "wide2", corpus, steps=2, intermediate_size=96), tokenizer=CharTokenizer(),
          target=target)
    wide = load_draft(tmp_path / "wide2", target)
    assert wide.config.intermediate_size == 96 and wide.mlp.down_proj.weight.shape[1] == 96


def test_warm_start_keeps_the_source_drafts_architecture_and_float32_weights(tiny_model_factory, target, corpus,
                                                                             tmp_path):
    """The draft a warm start (or a resume) begins with has its source's head setting, reduced
    vocabulary and MLP width, no stale acceptance table, and its float32 weights exactly, also
    under a bfloat16 target; a resumed warm-started run no longer needs the source."""
    from longspec.models.checkpoint import save_draft
    from longspec.training.trainer import initial_draft

    train(small_config(tmp_path / "plain", corpus, steps=5, intermediate_size=40), tokenizer=CharTokenizer(),
          target=target)
    source = load_draft(tmp_path / "plain", target, dtype=torch.float32)
    source.config.head_norm, source.config.acceptance = False, [[0.5] * 6]
    source.limit_vocab([3, 5, 7, 11])
    save_draft(source, tmp_path / "source")
    _, path = tiny_model_factory("train-llama", "llama", max_position_embeddings=256, seed=5)
    bf16_target = load_target(path, dtype=torch.bfloat16)
    config = small_config(tmp_path / "run", corpus, init_from=str(tmp_path / "source"))
    draft = initial_draft(config, bf16_target, tmp_path / "source")
    c = draft.config
    assert (c.head_norm, c.draft_vocab, c.intermediate_size, c.acceptance) == (False, 4, 40, [])
    assert draft.vocab_subset.tolist() == [3, 5, 7, 11]
    want = load_draft(tmp_path / "source", target, dtype=torch.float32).state_dict()
    for name, value in draft.state_dict().items():
        assert value.dtype == want[name].dtype and torch.equal(value, want[name]), name
    run = small_config(tmp_path / "run", corpus, steps=4, save_every=2, init_from=str(tmp_path / "source"))
    train(run, tokenizer=CharTokenizer(), target=target)
    import shutil
    shutil.rmtree(tmp_path / "source")
    resumed = train(small_config(tmp_path / "run", corpus, steps=6, save_every=2, resume=True),
                    tokenizer=CharTokenizer(), target=target)
    assert resumed.step == 6 and not resumed.draft.config.head_norm and resumed.draft.config.draft_vocab == 4
    assert resumed.draft.vocab_subset.tolist() == [3, 5, 7, 11]


def test_compiled_draft_forward_trains_the_same(target, corpus, tmp_path, monkeypatch):
    """``--compile`` puts the draft's forward (and backward) through torch.compile (here the
    aot_eager backend, as on a CPU without a compiler): the losses are those of eager training."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("LONGSPEC_COMPILE_BACKEND", "aot_eager")
    kw = dict(steps=4, eval_every=4)
    eager = train(small_config(tmp_path / "eager", corpus, **kw), tokenizer=CharTokenizer(), target=target)
    graphs = counters["stats"]["unique_graphs"]
    compiled = train(small_config(tmp_path / "compiled", corpus, compile=True, **kw), tokenizer=CharTokenizer(),
                     target=target)
    assert counters["stats"]["unique_graphs"] > graphs
    losses = lambda result: [row["loss"] for row in result.history if "loss" in row]  # noqa: E731
    assert len(losses(eager)) == 4 and losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    assert compiled.history[-1]["eval_loss"] == pytest.approx(eager.history[-1]["eval_loss"], rel=1e-4)


# --------------------------------------------------------------------------- self-distillation

class ChatStubTokenizer:
    """Characters of ALPHABET as ids 2.. (no chat template: the plain User/Assistant format)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[2 + ALPHABET.index(ch) for ch in text.lower() if ch in ALPHABET])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(ALPHABET[i - 2] for i in ids if 2 <= i < 2 + len(ALPHABET))


def test_self_distill_writes_the_targets_answers(target, tmp_path):
    import sysconfig

    from longspec.training.selfdistill import self_distill

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    rng = random.Random(0)
    for name in ("a.md", "sub/b.rst", "c.py"):
        (docs / name).write_text(grammar_text(rng, 80))  # > 2000 characters
    (docs / "short.md").write_text("too short")
    (docs / "data.bin").write_bytes(b"\0" * 3000)
    args = dict(tasks=["summarise", "explain"], max_doc_tokens=30, max_new_tokens=5, batch_size=2, seed=3)
    out = tmp_path / "chats.jsonl"
    assert self_distill(target, ChatStubTokenizer(), [docs], out, **args) == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["name"] for r in records) == ["docs/a.md", "docs/c.py", "docs/sub/b.rst"]
    assert [r["task"] for r in records] == ["summarise", "explain", "summarise"]
    for r in records:
        assert r["text"].startswith("user: " + r["task"]) and "\nassistant:" in r["text"]
        assert r["answer_tokens"] == 5 and 30 < r["prompt_tokens"] < 200
    again = tmp_path / "again.jsonl"
    self_distill(target, ChatStubTokenizer(), [docs], again, **args)
    assert again.read_text() == out.read_text()  # seeded: the same answers
    # two shards (one process per GPU, same seed) answer disjoint halves of the same requests
    halves = []
    for i in range(2):
        part = tmp_path / f"shard{i}.jsonl"
        self_distill(target, ChatStubTokenizer(), [docs], part, shard=(i, 2), **args)
        halves.append([(r["name"], r["task"]) for r in map(json.loads, part.read_text().splitlines())])
    assert len(halves[0]) == 2 and len(halves[1]) == 1
    assert self_distill(target, ChatStubTokenizer(), [docs], tmp_path / "none.jsonl", shard=(3, 4), **args) == 0
    assert sorted(halves[0] + halves[1]) == sorted((r["name"], r["task"]) for r in records)
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "json"
    with pytest.raises(ValueError, match="standard library"):
        self_distill(target, ChatStubTokenizer(), [stdlib], out, **args)
    with pytest.raises(ValueError, match="standard library"):
        list(iter_documents(stdlib))


def test_evaluation_samples_the_whole_held_out_set():
    """The held-out chunks come file after file: an evaluation of k chunks takes them from the
    first to the last, evenly, not the first file's k."""
    from longspec.training.trainer import held_out_sample

    picked = held_out_sample(1000, 64).tolist()
    assert len(set(picked)) == 64 and picked == sorted(picked) and picked[0] == 0 and picked[-1] == 999
    assert max(b - a for a, b in zip(picked, picked[1:])) <= 17
    assert held_out_sample(10, 0).tolist() == list(range(10)) == held_out_sample(10, 64).tolist()
