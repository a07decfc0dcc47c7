"""Tokenising a chat's prompt again on every turn, without redoing the part seen before.

A chat client sends the whole conversation on every turn. With a prefix cache, the server
prefills only the new turn's tokens; tokenising the whole conversation again costs far more than
that prefill on a GPU, at long contexts (docs/benchmarks.md, "Prefix cache").

:class:`PieceCache` reuses the ids of the pieces a prompt shares with earlier ones, exactly.
A Hugging Face (fast) tokenizer first splits a text at its added tokens (``<|im_start|>``,
``<start_of_turn>``, ...), matched on the raw text, then normalises, pre-tokenises and encodes
each piece between them on its own. So a text's ids are its pieces' ids, in order, with the added
tokens' ids between them. A chat template puts such tokens around every message, so a
conversation's long messages are whole pieces, the same text on every turn: their ids are kept
(least recently used out, texts and ids together up to ``max_bytes``) and only the new pieces are
tokenised.

Not every tokenizer qualifies. A pre-tokenizer may treat the text's first piece differently: a
SentencePiece-style ``Metaspace`` that prepends "▁" to the start of the text only gives the same
piece other ids after an added token. Added tokens that strip the spaces beside them move text
between pieces. So the cache is on only for a fast tokenizer whose added tokens strip nothing, and
only once the piecewise ids equal the tokenizer's own on probe texts (a chat rendered by its
template, and added tokens followed by spaces, newlines and words); otherwise every text is
tokenised whole (:attr:`PieceCache.reason` says why)."""
from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Optional

MAX_BYTES = 64 << 20  # what the cache may hold: its pieces' texts and their ids (4 bytes each)
MIN_CHARS = 256  # shorter pieces are tokenised every time (cheap; not worth an entry)

_PROBE_TEXTS = (" leading space, then words: the quick brown fox.", "\n\nnewlines first\nthen text  ",
                "\tdef f(x):\n    return x + 1  # code\n", "é 漢字 🙂 numbers 12345 and 'quotes' it's", "plain")


class PieceCache:
    """``encode(text)``: the ids ``tokenizer(text, add_special_tokens=False)`` gives, its pieces
    between added tokens taken from a cache (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer, max_bytes: int = MAX_BYTES, min_chars: int = MIN_CHARS):
        self.tokenizer, self.max_bytes, self.min_chars = tokenizer, max_bytes, min_chars
        self.pieces: OrderedDict = OrderedDict()  # piece text -> its ids (array), least recently used first
        self.tokens = self.bytes = 0  # ids held, and bytes of texts and ids
        self.chars = self.hit_chars = 0  # characters encoded, and of those, read from the cache
        self.lock = threading.Lock()
        self.added, self.reason = self._added_tokens(tokenizer)
        self.split = None
        if self.added:
            self.split = re.compile("|".join(map(re.escape, sorted(self.added, key=len, reverse=True))))
            bad = next((t for t in self._probes() if self._piecewise(t, cache=False) != self._whole(t)), None)
            if bad is not None:
                self.split, self.reason = None, f"its ids of a piece depend on what precedes it (probe {bad[:40]!r})"

    @property
    def enabled(self) -> bool:
        return self.split is not None

    @staticmethod
    def _added_tokens(tokenizer) -> tuple:
        """({content: id} of the added tokens matched on the raw text, why not), or ({}, the reason
        the cache cannot be used)."""
        if not getattr(tokenizer, "is_fast", False):
            return {}, "not a fast tokenizer"
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        raw = {i: t for i, t in decoder.items() if not getattr(t, "normalized", True) and str(t.content)}
        if not raw:
            return {}, "no added tokens to split at"
        if any(t.lstrip or t.rstrip or t.single_word for t in raw.values()):
            return {}, "an added token strips the spaces beside it"
        return {str(t.content): i for i, t in raw.items()}, ""

    def _probes(self) -> list:
        """Texts whose piecewise ids must equal the tokenizer's: a chat its template renders (where
        it has one), and every added token (up to 16) before and after each probe text."""
        texts = []
        messages = [{"role": "user", "content": _PROBE_TEXTS[0] * 3}, {"role": "assistant", "content": _PROBE_TEXTS[1]},
                    {"role": "user", "content": _PROBE_TEXTS[2] + _PROBE_TEXTS[3]}]
        if getattr(self.tokenizer, "chat_template", None):
            try:
                texts.append(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
            except Exception:  # noqa: BLE001 - a template that wants other roles: the raw probes still run
                pass
        for token in list(self.added)[:16]:
            texts += [token + p + token + p[::-1] for p in _PROBE_TEXTS] + [p + token for p in _PROBE_TEXTS]
        return texts

    def _whole(self, text: str) -> list:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode(self, text: str) -> list:
        """The text's ids, as ``tokenizer(text, add_special_tokens=False).input_ids``."""
        if self.split is None or len(text) < self.min_chars:
            return self._whole(text)
        return self._piecewise(text, cache=True)

    def _piecewise(self, text: str, cache: bool) -> list:
        parts, pos = [], 0  # pieces (str) and added tokens' ids (int), in order
        for match in self.split.finditer(text):
            if match.start() > pos:
                parts.append(text[pos:match.start()])
            parts.append(self.added[match.group()])
            pos = match.end()
        if pos < len(text):
            parts.append(text[pos:])
        with self.lock:
            known = {p: self._lookup(p) for p in parts if cache and isinstance(p, str) and len(p) >= self.min_chars}
        missing = list(dict.fromkeys(p for p in parts if isinstance(p, str) and known.get(p) is None))
        fresh = dict(zip(missing, self.tokenizer(missing, add_special_tokens=False).input_ids)) if missing else {}
        ids = []
        for p in parts:
            if isinstance(p, int):
                ids.append(p)
            else:
                cached = known.get(p)
                ids.extend(fresh[p] if cached is None else cached)
        if cache:
            with self.lock:
                self.chars += len(text)
                self.hit_chars += sum(len(p) for p, v in known.items() if v is not None)
                for p, v in fresh.items():
                    if len(p) >= self.min_chars:
                        self._store(p, v)
        return ids

    def _lookup(self, piece: str) -> Optional[array]:
        found = self.pieces.get(piece)
        if found is not None:
            self.pieces.move_to_end(piece)
        return found

    @staticmethod
    def _size(piece: str, ids) -> int:
        return sys.getsizeof(piece) + 4 * len(ids)

    def _store(self, piece: str, ids: list) -> None:
        if self._size(piece, ids) > self.max_bytes or piece in self.pieces:
            return
        self.pieces[piece] = array("i", ids)
        self.tokens += len(ids)
        self.bytes += self._size(piece, ids)
        while self.bytes > self.max_bytes:
            old_piece, old = self.pieces.popitem(last=False)
            self.tokens -= len(old)
            self.bytes -= self._size(old_piece, old)

    def stats(self) -> dict:
        """Whether the cache is on (else why not), its pieces and ids, and the share of the
        characters encoded that came from it."""
        with self.lock:
            return {"enabled": self.enabled, **({} if self.enabled else {"reason": self.reason}),
                    "pieces": len(self.pieces), "tokens": self.tokens, "bytes": self.bytes,
                    "hit_rate": round(self.hit_chars / self.chars, 4) if self.chars else 0.0}
