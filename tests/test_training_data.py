"""Draft training data: anchor-offset positions, noisy lags and the lag range a tree needs, the
learning-rate schedule and chunk sampling, and the data pipeline (text / JSONL / source trees,
split by document, the token cache, errors, big projects tokenised by file)."""
import json
import random
from pathlib import Path

import pytest
import torch

from longspec.training import (DataConfig, Document, TrainConfig, anchor_offset_positions, build_data,
                               iter_documents, lr_at, offset_range, sample_chunks, sample_lag, split_documents)
from test_training import CharTokenizer, grammar_text


# ----------------------------------------------------------------------------------- positions

def test_anchor_offset_positions():
    gen = torch.Generator().manual_seed(0)
    n, max_pos = 20, 100
    pos = anchor_offset_positions(500, n, max_pos, gen)
    assert pos.shape == (500, n) and pos.dtype == torch.long
    assert (pos[:, :4] == torch.arange(4)).all()  # attention sinks
    assert (pos[:, 5:] - pos[:, 4:-1] == 1).all()  # consecutive after the sinks
    offsets = pos[:, 4]
    assert offset_range(n, max_pos) == (4, 80)
    assert int(offsets.min()) >= 4 and int(offsets.max()) <= 80
    assert int(offsets.min()) <= 10 and int(offsets.max()) >= 74  # spread over the range
    assert int(pos.max()) < max_pos
    again = anchor_offset_positions(500, n, max_pos, torch.Generator().manual_seed(0))
    assert torch.equal(pos, again)  # seeded
    assert torch.equal(anchor_offset_positions(3, n, max_pos, None, enabled=False), torch.arange(n).expand(3, n))
    full = anchor_offset_positions(8, max_pos, max_pos, gen)  # a chunk as long as the context: plain
    assert torch.equal(full, torch.arange(max_pos).expand(8, max_pos))
    assert torch.equal(anchor_offset_positions(2, 3, max_pos, gen), torch.arange(3).expand(2, 3))
    with pytest.raises(ValueError, match="does not fit"):
        anchor_offset_positions(1, max_pos + 1, max_pos, gen)


def test_noisy_lag_range():
    gen = torch.Generator().manual_seed(0)
    lags = [sample_lag(gen, 4) for _ in range(400)]
    assert set(lags) == {1, 2, 3, 4}
    assert all(sample_lag(gen, 4, noise=False) == 1 for _ in range(10))
    assert sample_lag(gen, 1) == 1
    with pytest.raises(ValueError):
        sample_lag(gen, 0)


def test_lag_range_follows_the_tree_depth(tmp_path):
    """A node at depth d of a depth-D tree reads the target cache d+1 positions behind it; the
    deepest drafting level is D-1, so lags 1..D are trained unless --max-lag says otherwise."""
    from longspec.training import TrainConfig

    for tree, lag in (("4,16,16,16,16", 5), ("chain:3", 3), ("[[0],[1],[0,0]]", 2)):
        config = TrainConfig(out=str(tmp_path), tree=tree)
        config.validate()
        assert config.max_lag == lag
    config = TrainConfig(out=str(tmp_path), tree="chain:3", max_lag=7)
    config.validate()
    assert config.max_lag == 7


def test_lr_schedule_and_sampling():
    c = TrainConfig(out="x", lr=1.0, warmup=4, steps=20, min_lr_ratio=0.1)
    lrs = [lr_at(s, c) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] == pytest.approx(0.1)
    idx = sample_chunks(0, 30, 10, seed=3)  # three epochs, each a permutation
    for e in range(3):
        assert sorted(idx[e * 10:(e + 1) * 10].tolist()) == list(range(10))
    assert torch.equal(sample_chunks(7, 9, 10, 3), idx[7:16])  # a pure function of the sample ids


# ---------------------------------------------------------------------------------------- data

def test_text_jsonl_and_source_tree_documents(tmp_path):
    text = tmp_path / "book.md"
    text.write_text("# title\nsome text\n")
    assert list(iter_documents(text)) == [Document("book.md", "# title\nsome text\n")]

    jl = tmp_path / "c.jsonl"
    jl.write_text('{"body": "first"}\n\n{"other": 1}\n{"body": "third"}\n')
    docs = list(iter_documents(jl, text_field="body"))
    assert [(d.name, d.text) for d in docs] == [("c.jsonl:1", "first"), ("c.jsonl:4", "third")]

    root = tmp_path / "repos"
    (root / "alpha" / "pkg").mkdir(parents=True)
    (root / "alpha" / "pkg" / "b.py").write_text("B = 2\n")
    (root / "alpha" / "a.py").write_text("A = 1")
    (root / "alpha" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "alpha" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "alpha" / "huge.txt").write_text("x" * 5000)
    (root / "alpha" / "__pycache__").mkdir()
    (root / "alpha" / "__pycache__" / "a.pyc.txt").write_text("skip me")
    (root / "alpha" / ".git").mkdir()
    (root / "alpha" / ".git" / "HEAD").write_text("skip me")
    (root / "beta").mkdir()
    (root / "beta" / "main.c").write_text("int main() {}\n")
    (root / "empty").mkdir()
    (root / "README.txt").write_text("top level\n")
    docs = list(iter_documents(root, max_file_bytes=1000))
    assert [d.name for d in docs] == ["repos", "repos/alpha", "repos/beta"]
    assert docs[0].text == "# ==== README.txt ====\ntop level\n"
    assert docs[1].text == "# ==== a.py ====\nA = 1\n# ==== pkg/b.py ====\nB = 2\n"  # one long document
    assert docs[2].text == "# ==== main.c ====\nint main() {}\n"
    # --exclude: top-level entries matching a pattern are left out (packages kept for evaluation)
    assert [d.name for d in iter_documents(root, max_file_bytes=1000, exclude=("al*", "README.txt"))] == [
        "repos/beta"]


def test_split_is_by_document_and_stable(tmp_path):
    names = [f"doc{i}" for i in range(2000)]
    train, held = split_documents([Document(n, "x") for n in names], 0.1)
    assert 140 < len(held) < 260 and len(train) + len(held) == 2000
    assert {d.name for d in train}.isdisjoint({d.name for d in held})
    train2, held2 = split_documents([Document(n, "y") for n in reversed(names)], 0.1)
    assert {d.name for d in held2} == {d.name for d in held}  # by name only, order-independent
    _, few = split_documents([Document("a", "x"), Document("b", "x")], 0.01)
    assert len(few) == 1  # a held-out side exists whenever there are two documents
    assert split_documents([Document("a", "x")], 0.5)[0]  # never everything held out

    # packing: each document is one repeated letter, so a chunk shows which documents it came from
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = [json.dumps({"text": ch * (40 + 7 * i)}) for i, ch in enumerate(letters)]
    (tmp_path / "letters.jsonl").write_text("\n".join(lines) + "\n")
    tok = CharTokenizer()
    data = build_data(DataConfig([str(tmp_path / "letters.jsonl")], seq_len=16, eval_fraction=0.3), tok, 64, 160)
    docs = list(iter_documents(tmp_path / "letters.jsonl"))
    _, held_docs = split_documents(docs, 0.3)
    held_ids = {tok.encode(d.text[0])[0] for d in held_docs} | {0, 1}
    assert data.eval.shape[0] > 0 and data.train.shape[1] == 16
    assert set(data.eval.unique().tolist()) <= held_ids
    assert set(data.train.unique().tolist()).isdisjoint(held_ids - {0, 1})


def test_data_cache_skips_tokenising_and_follows_the_text(tmp_path):
    """A second build on the same documents reads the cache (the tokenizer is not called) and gets
    the same chunks; a changed document, seq_len or tokenizer misses it."""
    class Counting(CharTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=False):
            Counting.calls += 1
            return super().encode(text)

    rng = random.Random(0)
    for i in range(4):
        (tmp_path / "src" / f"m{i}.py").parent.mkdir(exist_ok=True)
        (tmp_path / "src" / f"m{i}.py").write_text(grammar_text(rng, 30))
    config, cache = DataConfig([str(tmp_path / "src")], seq_len=16, eval_fraction=0.3), str(tmp_path / "cache")
    first = build_data(config, Counting(), 64, 160, cache_dir=cache)
    calls = Counting.calls
    again = build_data(config, Counting(), 64, 160, cache_dir=cache)
    assert Counting.calls == calls and torch.equal(again.train, first.train) and torch.equal(again.eval, first.eval)
    assert again.train.dtype == torch.long and again.train_documents == first.train_documents
    (tmp_path / "src" / "m0.py").write_text(grammar_text(rng, 31))
    build_data(config, Counting(), 64, 160, cache_dir=cache)
    assert Counting.calls > calls
    calls = Counting.calls
    build_data(DataConfig([str(tmp_path / "src")], seq_len=8, eval_fraction=0.3), Counting(), 64, 160, cache_dir=cache)
    assert Counting.calls > calls
    assert len(list(Path(cache).glob("tokens-*.pt"))) == 3
    with pytest.raises(ValueError, match="cached data .* holds token id"):  # a cache hit is checked too
        build_data(config, Counting(), 64, 10, cache_dir=cache)


def test_data_errors(tmp_path):
    tok = CharTokenizer()
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match=r"no usable text in .*empty\.txt: the file is empty"):
        build_data(DataConfig([str(empty)], seq_len=8), tok, 64)
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\xff" * 50)
    with pytest.raises(ValueError, match=r"no usable text in .*blob\.txt"):
        build_data(DataConfig([str(binary)], seq_len=8), tok, 64)
    bindir = tmp_path / "bindir"
    bindir.mkdir()
    (bindir / "x.so").write_bytes(b"\x7fELF\x00\x00")
    with pytest.raises(ValueError, match=r"no usable text in .*bindir: no readable text files"):
        build_data(DataConfig([str(bindir)], seq_len=8), tok, 64)
    jl = tmp_path / "nofield.jsonl"
    jl.write_text('{"content": "abc"}\n')
    with pytest.raises(ValueError, match=r"no usable text in .*nofield\.jsonl: no line has .*'text'"):
        build_data(DataConfig([str(jl)], seq_len=8), tok, 64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "abc"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
        build_data(DataConfig([str(bad)], seq_len=8), tok, 64)
    with pytest.raises(FileNotFoundError, match="data path not found"):
        build_data(DataConfig([str(tmp_path / "missing")], seq_len=8), tok, 64)
    good = tmp_path / "good.txt"
    good.write_text("abc " * 100)
    with pytest.raises(ValueError, match="--seq-len 128 exceeds the target's max_position_embeddings \\(64\\)"):
        build_data(DataConfig([str(good)], seq_len=128), tok, 64)
    with pytest.raises(ValueError, match="fewer than --seq-len 60"):
        short = tmp_path / "short.txt"
        short.write_text("abc")
        build_data(DataConfig([str(short)], seq_len=60), tok, 64)
    with pytest.raises(ValueError, match="vocabulary has 10 entries"):
        build_data(DataConfig([str(good)], seq_len=8), tok, 64, vocab_size=10)


def test_big_project_documents_tokenise_by_file_with_the_same_tokens():
    """A package is one document; it is tokenised in pieces cut at its file markers (so a big
    one runs on every core) with exactly the tokens of the whole text, under a byte-level BPE
    whose merges join newlines (blank lines, trailing spaces and indentation before markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from longspec.training.data import FILE_MARKER, _file_pieces, tokenize_documents

    rng = random.Random(3)
    bodies = ["def f(x):\n    return x  \n\n\n", "class A:\n    pass\n", "x = 1\n\n", "    y = 2\n  \n",
              "# comment\n\n\n\n", "import os\n"]
    text = "".join(f"{FILE_MARKER}pkg/m{i}.py ====\n{rng.choice(bodies) * rng.randint(1, 40)}" for i in range(2500))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text[:50000]], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    whole = fast(text, add_special_tokens=False)["input_ids"]
    assert any(len(fast.decode([t])) > 1 and fast.decode([t]).strip() == "" for t in set(whole))  # merged blanks
    pieces = _file_pieces(text, size=2000)
    assert len(text) > 1 << 18 and len(pieces) > 100 and "".join(pieces) == text
    assert [t for p in pieces for t in fast(p, add_special_tokens=False)["input_ids"]] == whole
    assert tokenize_documents([Document("pkg", text)], fast).tolist() == whole


def test_tokenizing_reports_its_progress_in_batches_with_the_same_tokens(monkeypatch, capsys):
    """A fast tokenizer goes in batch calls of about ``BATCH_CHARACTERS`` (each on every core), and
    the progress it reports adds up to the text; the tokens are those of one call. Without a bar
    (``--no-progress``) the progress goes to stderr as lines, at most one per ``every`` seconds and
    at the end."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from longspec.training import data

    tok = Tokenizer(models.WordLevel({chr(97 + i): i for i in range(26)} | {"[UNK]": 26}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    rng = random.Random(0)
    docs = [Document(f"d{i}", "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(50, 3000))))
            for i in range(40)]
    whole = data.tokenize_documents(docs, fast).tolist()
    calls = []
    encode = PreTrainedTokenizerFast.__call__
    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", lambda self, texts, **kw: calls.append(len(texts))
                        or encode(self, texts, **kw))
    monkeypatch.setattr(data, "BATCH_CHARACTERS", 5000)
    shown = data.Progress(sum(len(d.text) for d in docs), "tokenizing", bar=False, every=3600)
    assert data.tokenize_documents(docs, fast, progress=shown).tolist() == whole
    assert len(calls) > 5 and sum(calls) == len(docs) and shown.done == shown.total
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "tokenizing" in lines[0] and "of" in lines[0]  # only the last one (every 3600 s)


def test_only_regular_files_are_read_and_never_past_their_cap(tmp_path):
    """A data folder holding a FIFO (a read would block) and a link to ``/dev/zero`` (a read would
    fill memory) gives the documents of its regular files only, at once; a FIFO as the data path
    is refused; a file over the cap is skipped without being read."""
    import os
    import time

    from longspec.training.data import iter_documents, read_text_file

    (tmp_path / "good.py").write_text("def f():\n    return 1\n")
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "zero.py").symlink_to("/dev/zero")
    start = time.perf_counter()
    docs = list(iter_documents(tmp_path))
    assert len(docs) == 1 and "return 1" in docs[0].text and "pipe.py" not in docs[0].text
    assert time.perf_counter() - start < 2
    with pytest.raises(ValueError, match="neither a folder nor a regular file"):
        list(iter_documents(tmp_path / "pipe.py"))
    big = tmp_path / "big.txt"
    big.write_text("x" * 1000)
    assert read_text_file(big, max_bytes=999) is None and read_text_file(big, max_bytes=1000) == "x" * 1000
