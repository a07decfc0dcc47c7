"""Training data: documents from text files, JSONL files and source trees, tokenised with the
target's tokenizer and packed into fixed-length chunks, split into train / held-out BY DOCUMENT.

Sources (any mix, each a path):

* a ``.jsonl`` / ``.ndjson`` file: one document per line, its text in ``text_field``;
* any other file: one document (its whole text, UTF-8);
* a directory: a source tree. Each top-level subdirectory is one *project*; the files directly
  in the directory form one more project. A project's files (sorted by path; hidden entries and
  ``__pycache__`` / ``node_modules`` skipped, binary / undecodable files and files above
  ``max_file_bytes`` skipped) are concatenated into ONE long document, each preceded by a header
  ``# ==== path/to/file.py ====``: real long-context data.

Document names do not depend on where the data lives (a file's base name, ``name:line`` for a
JSONL line, ``dir/project`` for a project), so the held-out split (``sha256(name)`` below
``eval_fraction``) is the same on every machine and never splits a document between sides.
"""
from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from ..files import read_text
from ..models.checkpoint import write_atomic
from ..outdir import remove_stale

JSONL_SUFFIXES = (".jsonl", ".ndjson")
FILE_MARKER = "# ==== "  # starts each file's header line in a project document
SKIP_DIRS = {"__pycache__", "node_modules", ".git", ".hg", ".svn", ".venv", "venv", ".tox", ".mypy_cache"}
BINARY_SNIFF = 8192


@dataclass
class Document:
    """One training document: a stable ``name`` (drives the held-out split) and its ``text``."""

    name: str
    text: str


@dataclass
class DataConfig:
    """Where the data is and how to cut it."""

    paths: Sequence[str]
    seq_len: int = 2048
    text_field: str = "text"
    eval_fraction: float = 0.05
    max_file_bytes: int = 1 << 20  # files of a source tree above this size are skipped
    exclude: Sequence[str] = ()  # glob patterns of top-level entries of source trees to leave out


@dataclass
class PackedData:
    """``train`` [N, seq_len] and ``eval`` [M, seq_len] token chunks (long), plus counts."""

    train: torch.Tensor
    eval: torch.Tensor
    train_documents: int
    eval_documents: int

    def summary(self) -> str:
        t = self.train.shape[1]
        return (f"{self.train_documents} train documents -> {self.train.shape[0]} chunks of {t} tokens; "
                f"{self.eval_documents} held-out documents -> {self.eval.shape[0]} chunks")


MAX_FILE_BYTES = 1 << 30  # a single text file read whole at most (a larger corpus: JSONL or a folder)


def read_text_file(path: Path, max_bytes: Optional[int] = None) -> Optional[str]:
    """The UTF-8 text of ``path``, or None when it is not a regular file (a FIFO, a link to a
    device), binary (a NUL byte early on), not UTF-8, empty / whitespace only, or larger than
    ``max_bytes`` (default :data:`MAX_FILE_BYTES`; never more is read)."""
    try:
        text = read_text(path, MAX_FILE_BYTES if max_bytes is None else max_bytes)
    except ValueError:
        return None
    if "\x00" in text[:BINARY_SNIFF]:
        return None
    return text if text.strip() else None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Document]:
    with path.open("r", encoding="utf-8", errors="strict") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON: {err}") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if isinstance(text, str) and text.strip():
                yield Document(f"{path.name}:{line_no}", text)


def tree_files(root: Path) -> list:
    """Files under ``root`` (sorted relative paths), skipping hidden entries and junk dirs."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for name in filenames:
            if not name.startswith("."):
                files.append(Path(dirpath, name))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def project_document(name: str, root: Path, files: Sequence[Path], max_file_bytes: int) -> Optional[Document]:
    """One project as one document: each readable file preceded by ``# ==== rel/path ====``
    (paths relative to ``root``). None when no file is usable."""
    parts = []
    for file in files:
        text = read_text_file(file, max_file_bytes)
        if text is None:
            continue
        if not text.endswith("\n"):
            text += "\n"
        parts.append(f"{FILE_MARKER}{file.relative_to(root).as_posix()} ====\n{text}")
    return Document(name, "".join(parts)) if parts else None


def _tree_documents(root: Path, max_file_bytes: int, exclude: Sequence[str] = ()) -> Iterator[Document]:
    def kept(p: Path) -> bool:
        return not p.name.startswith(".") and not any(fnmatch.fnmatch(p.name, pattern) for pattern in exclude)

    loose = sorted(p for p in root.iterdir() if p.is_file() and kept(p))
    doc = project_document(root.name, root, loose, max_file_bytes)
    if doc is not None:
        yield doc
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and kept(p) and p.name not in SKIP_DIRS):
        doc = project_document(f"{root.name}/{sub.name}", sub, tree_files(sub), max_file_bytes)
        if doc is not None:
            yield doc


def check_not_stdlib(path) -> None:
    """Raises ValueError for a path inside the Python standard library (installed packages under
    site-packages are fine): it is kept out of training to evaluate drafts on text they never saw."""
    import sysconfig

    resolved = Path(path).resolve()
    paths = sysconfig.get_paths()
    packages = [Path(paths[k]).resolve() for k in ("purelib", "platlib")]
    if resolved.is_relative_to(Path(paths["stdlib"]).resolve()) and not any(
            resolved.is_relative_to(p) for p in packages):
        raise ValueError(f"{path} is in the Python standard library, which is kept out of training "
                         "(drafts are evaluated on it); use installed packages (site-packages) or your own text")


def iter_documents(path, text_field: str = "text", max_file_bytes: int = 1 << 20,
                   exclude: Sequence[str] = ()) -> Iterator[Document]:
    """The documents of one data path (see the module docstring). ``exclude``: glob patterns of
    entries of a source tree's top level to leave out (e.g. the packages kept for evaluation).
    Raises FileNotFoundError for a missing path and ValueError when it holds no usable text or
    lies in the standard library."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data path not found: {path}")
    if not (path.is_dir() or path.is_file()):  # (a FIFO would block, a device never end)
        raise ValueError(f"data path {path} is neither a folder nor a regular file")
    check_not_stdlib(path)
    if path.is_dir():
        docs = _tree_documents(path, max_file_bytes, exclude)
        why = "no readable text files (binary, undecodable, empty or larger than max_file_bytes are skipped)"
    elif path.name.lower().endswith(JSONL_SUFFIXES):
        docs = _jsonl_documents(path, text_field)
        why = f"no line has a non-empty string field {text_field!r}"
    else:
        text = read_text_file(path)
        docs = iter([Document(path.name, text)] if text is not None else [])
        why = "the file is empty, binary or not UTF-8"
    found = False
    try:
        for doc in docs:
            found = True
            yield doc
    except UnicodeDecodeError:
        raise ValueError(f"no usable text in {path}: not UTF-8") from None
    if not found:
        raise ValueError(f"no usable text in {path}: {why}")


def is_held_out(name: str, eval_fraction: float) -> bool:
    """Deterministic by-document split: sha256 of the name as a number in [0, 1)."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64
    return h < eval_fraction


def split_documents(docs: Sequence[Document], eval_fraction: float) -> tuple:
    """(train, held_out) lists of documents. With ``eval_fraction > 0`` and at least two
    documents the held-out side is never empty (the document of smallest hash goes there)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    held = [is_held_out(d.name, eval_fraction) for d in docs]
    if eval_fraction > 0 and len(docs) >= 2 and not any(held):
        key = [hashlib.sha256(d.name.encode("utf-8")).digest() for d in docs]
        held[min(range(len(docs)), key=key.__getitem__)] = True
    if docs and all(held):  # never leave nothing to train on
        held[0] = False
    train = [d for d, h in zip(docs, held) if not h]
    return train, [d for d, h in zip(docs, held) if h]


def _file_pieces(text: str, size: int = 1 << 18) -> list:
    """A project document cut before its ``# ==== path ====`` file markers into pieces of about
    ``size`` characters or more, so one big document tokenises on every core. Each cut falls
    just before the newline that ends the line above a marker: byte-level BPE pre-tokenisers
    split there anyway, so the pieces' tokens are the whole text's (tested)."""
    if len(text) <= size:
        return [text]
    pieces, start = [], 0
    while True:
        cut = text.find(f"\n{FILE_MARKER}", start + size)
        if cut < 0:
            pieces.append(text[start:])
            return pieces
        pieces.append(text[start:cut])  # the newline goes with the marker: "\n\n#" stays "\n", "\n", "#"
        start = cut


class Progress:
    """How far tokenising has come, in characters: a tqdm bar (``bar``), or else a line on stderr
    at most every ``every`` seconds (a log file sees progress, not a bar)."""

    def __init__(self, total: int, desc: str, bar: bool = True, every: float = 10.0):
        from tqdm.auto import tqdm

        self.total, self.desc, self.every, self.done = total, desc, every, 0
        self.bar = tqdm(total=total, desc=desc, unit="char", unit_scale=True) if bar else None
        self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.last >= self.every or self.done >= self.total:
            self.last = time.monotonic()
            print(f"[longspec] {self.desc}: {self.done / 1e6:.1f} of {self.total / 1e6:.1f} M characters",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


BATCH_CHARACTERS = 1 << 23  # text per batch call of a fast tokenizer: all cores busy, progress seen often


def tokenize_documents(docs: Sequence[Document], tokenizer, vocab_size: Optional[int] = None,
                       progress: Optional[Progress] = None) -> torch.Tensor:
    """One token stream (long [N]): every document as ``[bos] + encode(text) + [eos]`` (bos / eos
    where the tokenizer has them). ``tokenizer`` needs ``encode(text, add_special_tokens=False)``
    (any Hugging Face tokenizer, or a small object in tests). ``progress`` is told the characters
    done after every batch (fast tokenizers: ``BATCH_CHARACTERS`` a call) or document."""
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    texts = [doc.text for doc in docs]
    tell = progress.update if progress is not None else (lambda n: None)
    if texts and getattr(tokenizer, "is_fast", False):  # Rust tokenizer: a batch call runs on all cores
        pieces_of = [_file_pieces(text) for text in texts]  # a whole package is one document: by files
        flat, batch, size = [], [], 0
        for piece in itertools.chain.from_iterable(pieces_of):
            batch.append(piece)
            size += len(piece)
            if size >= BATCH_CHARACTERS:
                flat += tokenizer(batch, add_special_tokens=False)["input_ids"]
                tell(size)
                batch, size = [], 0
        if batch:
            flat += tokenizer(batch, add_special_tokens=False)["input_ids"]
            tell(size)
        ends = list(itertools.accumulate(len(pieces) for pieces in pieces_of))
        encoded = [flat[end - len(pieces):end] for pieces, end in zip(pieces_of, ends)]
    else:
        encoded = []
        for text in texts:
            encoded.append([tokenizer.encode(text, add_special_tokens=False)])
            tell(len(text))
    head, tail = [bos] if bos is not None else [], [eos] if eos is not None else []
    pieces = [torch.tensor(ids, dtype=torch.long) for doc in encoded for ids in (head, *doc, tail)]
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    check_token_ids(stream, vocab_size, "the tokenizer produced")
    return stream


def check_token_ids(ids: torch.Tensor, vocab_size: Optional[int], source: str) -> None:
    """Raises ValueError when ``ids`` hold a token id outside a vocabulary of ``vocab_size``
    (``source`` says where they came from)."""
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"{source} token id {int(ids.max())}, but the target's vocabulary has {vocab_size} entries: "
                         "wrong tokenizer for this target?")


def frequent_tokens(paths, tokenizer, k: int, vocab_size: int, max_file_bytes: int = 1 << 20) -> torch.Tensor:
    """The ``k`` most frequent token ids (long [k], most frequent first) of the documents under
    ``paths`` (text, JSONL or source trees, as for training): a draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in paths:
        docs = list(iter_documents(path, max_file_bytes=max_file_bytes))
        if docs:
            counts += torch.bincount(tokenize_documents(docs, tokenizer, vocab_size), minlength=vocab_size)
    if int(counts.sum()) == 0:
        raise ValueError(f"no text found under {list(map(str, paths))}")
    return counts.argsort(descending=True)[:k]


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cuts a token stream [N] into [N // seq_len, seq_len] chunks (the remainder is dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path):
    """The Hugging Face tokenizer stored in a model directory (local files only)."""
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {path}: pass --tokenizer DIR")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load a tokenizer from {path}: {err}") from None


def check_seq_len(seq_len: int, max_position_embeddings: int) -> None:
    """Raises ValueError when chunks of ``seq_len`` tokens cannot be trained on the target."""
    if seq_len > max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} exceeds the target's max_position_embeddings "
                         f"({max_position_embeddings})")
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {seq_len}")


def tokenizer_fingerprint(tokenizer) -> str:
    """What identifies a tokenizer's output: its class, special ids and (Hugging Face fast
    tokenizers) its whole serialised definition."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):  # slow tokenizers: their vocabulary
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    else:
        definition = type(tokenizer).__qualname__
    return json.dumps([type(tokenizer).__name__, getattr(tokenizer, "bos_token_id", None),
                       getattr(tokenizer, "eos_token_id", None), hashlib.sha256(definition.encode()).hexdigest()])


def data_key(docs: Sequence[Document], config: DataConfig, tokenizer) -> str:
    """sha256 over the documents (names and texts), the cutting settings and the tokenizer."""
    h = hashlib.sha256(json.dumps([config.seq_len, config.eval_fraction, tokenizer_fingerprint(tokenizer)]).encode())
    for doc in docs:
        h.update(doc.name.encode("utf-8", "surrogatepass") + b"\0" + doc.text.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def build_data(config: DataConfig, tokenizer, max_position_embeddings: int,
               vocab_size: Optional[int] = None, cache_dir: Optional[str] = None,
               write_cache: bool = True, progress: Optional[bool] = None) -> PackedData:
    """Reads every path, splits by document, tokenises and packs both sides. Raises ValueError
    for a path without usable text, ``seq_len`` above ``max_position_embeddings``, or a training
    side shorter than one chunk. ``cache_dir``: the packed tokens are kept there (int32), keyed by
    :func:`data_key`, and read back instead of tokenising again (``write_cache``: this process
    writes a missing entry; under DDP only rank 0 does). ``progress``: tokenising shows a bar
    (True), lines on stderr (False) or nothing (None)."""
    check_seq_len(config.seq_len, max_position_embeddings)
    if not config.paths:
        raise ValueError("no data paths given")
    docs = [d for p in config.paths for d in iter_documents(p, config.text_field, config.max_file_bytes, config.exclude)]
    train_docs, eval_docs = split_documents(docs, config.eval_fraction)
    cached = None if cache_dir is None else Path(cache_dir) / f"tokens-{data_key(docs, config, tokenizer)}.pt"
    if cached is not None and cached.is_file():
        saved = torch.load(cached, map_location="cpu", weights_only=True)
        train, held = saved["train"].long(), saved["eval"].long()
        for ids in (train, held):
            check_token_ids(ids, vocab_size, f"the cached data in {cached} holds")
    else:
        total = sum(len(d.text) for d in docs)
        shown = None if progress is None else Progress(total, "tokenizing", bar=progress)
        try:
            train = pack(tokenize_documents(train_docs, tokenizer, vocab_size, shown), config.seq_len)
            held = pack(tokenize_documents(eval_docs, tokenizer, vocab_size, shown), config.seq_len)
        finally:
            if shown is not None:
                shown.close()
        if cached is not None and write_cache:
            cached.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(cached.parent)  # entries a killed run left half-written
            write_atomic(cached, lambda f: torch.save({"train": train.int(), "eval": held.int()}, f))
    if train.shape[0] == 0:
        raise ValueError(f"the training documents of {', '.join(map(str, config.paths))} hold fewer than "
                         f"--seq-len {config.seq_len} tokens")
    return PackedData(train, held, len(train_docs), len(eval_docs))
