"""Self-distillation data: chat requests about long documents, answered by the target itself.

A draft trained only on raw text learns what text looks like, not what the target writes when a
user asks it something. This module turns documents (README / markdown / rst / text / source
files, e.g. from installed packages: never the standard library, which is held out) into chat
requests — summarise, explain, continue, answer a question about it — has the target answer them
(through any proposer: the output is the target's own) and writes JSONL records whose ``text`` is
the whole conversation. Train on them with ``--distill`` so the draft also matches the target's
distribution on every token (KL), not only its samples:

    longspec self-distill --target DIR --docs SITE/requests SITE/click --out chats.jsonl
    longspec train --target DIR --data chats.jsonl SITE/numpy ... --distill --out draft/
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional, Sequence

from ..config import GenerationConfig
from ..decoding.generator import Generator
from .data import check_not_stdlib, read_text_file, tree_files

DOC_SUFFIXES = (".md", ".rst", ".txt", ".py")
TASKS = {
    "summarise": "Summarise the following document in a few paragraphs.\n\n{doc}",
    "explain": "Explain what the following document describes or does, step by step.\n\n{doc}",
    "continue": "Here is the beginning of a document. Continue it in the same style.\n\n{doc}",
    "question": "Read the following document, then answer: what are its three most important points, "
                "and why?\n\n{doc}",
}


def find_documents(paths: Sequence, min_chars: int = 2000, max_file_bytes: int = 1 << 20) -> list:
    """(name, text) of every readable file with a ``DOC_SUFFIXES`` suffix under ``paths`` (files
    or directories: their files as a training source tree lists them) with at least ``min_chars``
    characters. Raises for missing paths and paths in the standard library."""
    docs = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"document path not found: {path}")
        check_not_stdlib(path)
        files = [f for f in tree_files(path) if f.name.lower().endswith(DOC_SUFFIXES)] if path.is_dir() else [path]
        for file in files:
            text = read_text_file(file, max_file_bytes)
            if text is not None and len(text) >= min_chars:
                docs.append((f"{path.name}/{file.relative_to(path).as_posix()}" if path.is_dir() else file.name, text))
    return docs


def chat_ids(tokenizer, request: str) -> list:
    """Token ids of ``request`` as the user's turn, ready for the assistant's answer: the
    tokenizer's chat template, or ``User: ...\\nAssistant:`` when it has none."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(f"User: {request}\nAssistant:").input_ids


def self_distill(target, tokenizer, paths: Sequence, out, tasks: Sequence[str] = tuple(TASKS),
                 max_doc_tokens: int = 3072, max_new_tokens: int = 256, batch_size: int = 8,
                 temperature: float = 0.7, top_p: float = 0.95, seed: int = 0, proposer=None, tree=None,
                 limit: Optional[int] = None, shard: tuple = (0, 1)) -> int:
    """Writes one JSONL record per (document, task) to ``out`` — ``text`` (request + answer),
    ``name``, ``task``, ``prompt_tokens``, ``answer_tokens`` — with the target's answers sampled
    at ``temperature`` / ``top_p`` (``seed``). Each document is cut to ``max_doc_tokens`` tokens;
    each document gets one task, in turn (``limit``: at most that many records, counted before
    sharding). ``shard`` (i, n): only requests i, i + n, i + 2n, ... of that list, so that n
    processes with the same ``seed`` answer disjoint parts of it. Returns the number of records."""

    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    docs = find_documents(paths)
    if not docs:
        raise ValueError(f"no document of at least 2000 characters ({', '.join(DOC_SUFFIXES)}) under {list(paths)}")
    random.Random(seed).shuffle(docs)
    docs = docs[:limit] if limit else docs
    requests = []
    for i, (name, text) in enumerate(docs):
        if i % shard[1] != shard[0]:
            continue
        task = tasks[i % len(tasks)]
        doc = tokenizer.decode(tokenizer(text).input_ids[:max_doc_tokens], skip_special_tokens=True)
        requests.append((name, task, chat_ids(tokenizer, TASKS[task].format(doc=doc))))
    if not requests:  # a shard past the end of a short list
        Path(out).write_text("")
        return 0
    longest = max(len(ids) for _, _, ids in requests)
    generator = Generator(target, proposer=proposer, tree=tree,
                          max_len=min(longest + max_new_tokens + 128, target.config.max_position_embeddings))
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    written = 0
    with open(out, "w") as f:
        for start in range(0, len(requests), batch_size):
            group = requests[start:start + batch_size]
            answers = generator.generate([ids for _, _, ids in group], config).sequences
            for (name, task, ids), answer in zip(group, answers):
                f.write(json.dumps({"text": tokenizer.decode(ids + answer), "name": name, "task": task,
                                    "prompt_tokens": len(ids), "answer_tokens": len(answer)}) + "\n")
                written += 1
            f.flush()  # whole batches on disk as they finish (a run cut short keeps them)
    return written
