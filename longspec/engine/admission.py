"""Sequences joining and leaving an :class:`~longspec.engine.engine.Engine` between rounds.

A sequence joins (:meth:`Admission.add`, where the :class:`~longspec.engine.scheduler.Scheduler`
lets it) into a free row: the row takes its blocks from the
:class:`~longspec.engine.blocks.BlockManager`, its prompt is prefilled (consecutive rows in one
batched forward, or in fixed-shape chunks) and its first token is emitted. It leaves when it is
done or cancelled: its row is masked and its blocks go back."""
from __future__ import annotations

from typing import Optional

import torch

from ..kv.cache import PoolExhausted
from ..spec.tokens import token_tensor
from .sequence import Sequence, Streamer


class Admission:
    """The part of :class:`~longspec.engine.engine.Engine` that admits sequences and lets them
    go: its rows and the prefill (and a seeded sequence's own generator). It works on the
    engine's state (``rows``, ``max_len``, ``blocks``, ``cache``, ``target``, ``proposer``,
    ``config``, ``uniforms``, ``root``, ``active``, ``chunked_prefill``) and samples first
    tokens with its ``_next_token``; the proposer takes a row in through its ``take_in``."""

    def free_rows(self) -> list:
        return [r for r, s in enumerate(self.rows) if s is None]

    @property
    def has_active(self) -> bool:
        return any(s is not None for s in self.rows)

    @torch.inference_mode()
    def add(self, seqs: list, streamer: Optional[Streamer] = None, meanwhile=None) -> None:
        """Prefills ``seqs`` into free rows (consecutive rows in one batched forward) and emits each
        one's first token. Raises ValueError if they do not fit (:class:`~longspec.kv.cache.PoolExhausted`
        where the pool is short of blocks now: :class:`~longspec.engine.scheduler.Scheduler`
        decides who joins when). ``meanwhile()``: host work done once while the device runs the
        (first) prefill, before the proposer takes the rows in (it may choose their tree:
        :meth:`use_tree`) and before the prefill is waited for."""
        free = self.free_rows()
        if len(seqs) > len(free):
            raise ValueError(f"{len(seqs)} sequences do not fit: {len(free)} of {len(self.rows)} rows are free")
        for s in seqs:
            self.check(s)
        hits = self.blocks.hits(seqs)
        if not self.blocks.can_admit(seqs, hits):
            raise PoolExhausted(f"KV pool exhausted: {len(seqs)} sequences need "
                                f"{self.blocks.blocks_needed(seqs, hits)} "
                                f"blocks of {self.pool.block_size} tokens, {self.pool.num_free} of "
                                f"{self.pool.num_blocks} are free")
        start = 0
        while start < len(seqs):  # runs of consecutive free rows
            stop = start + 1
            while stop < len(seqs) and free[stop] == free[start] + stop - start:
                stop += 1
            # (a later run matches again: the runs before it allocated, which may have evicted its blocks)
            self._prefill(seqs[start:stop], free[start], streamer, hits[start:stop] if start == 0 else None,
                          meanwhile if start == 0 else None)
            start = stop

    def check(self, s: Sequence) -> None:
        """Raises ValueError for a sequence that could never join: an empty prompt, more cache
        slots than a row has, more blocks than the whole pool, or room for plain rounds only in an
        engine that drafts trees."""
        if not s.prompt:
            raise ValueError("a sequence's prompt must hold at least one token")
        if s.plain_rounds and self.proposer is not None and any(self.tree_of(b) is not None for b in self.buckets):
            raise ValueError("a sequence with room for plain rounds only joins an engine that runs plain rounds "
                             "(use_tree(None) first)")
        need = self.blocks.need(s)
        if need > self.max_len:
            raise ValueError(f"prompt of {len(s.prompt)} tokens with max_new_tokens {s.max_new_tokens} needs "
                             f"{need} cache slots, the engine has {self.max_len}")
        if self.blocks.blocks_for(s) > self.pool.num_blocks:
            raise ValueError(f"prompt of {len(s.prompt)} tokens with max_new_tokens {s.max_new_tokens} needs "
                             f"{self.blocks.blocks_for(s)} KV blocks of {self.pool.block_size} tokens, more than "
                             f"the pool's {self.pool.num_blocks}")

    def _prefill(self, seqs: list, row0: int, streamer, hits: Optional[list] = None, meanwhile=None) -> None:
        """Prefills ``seqs`` into rows ``row0..``, then (``meanwhile()``, the proposer taking
        the rows in) queues the host's work behind the device's before it reads the first
        tokens: on a GPU that work costs no time while it is shorter than the prefill."""
        n, rows = len(seqs), range(row0, row0 + len(seqs))
        try:
            self.blocks.allocate(row0, seqs, hits)
            # (uploaded before the prefill is launched, queued ahead of it)
            texts = [token_tensor(s.text(0), self.target.device) for s in seqs] if self.proposer is not None else []
            logits = self._prefill_rows(seqs, row0)
            self.uniforms.buffer = None  # fresh draws: a captured round's static numbers are its own
            for row, s in zip(rows, seqs):
                if s.seed is not None:
                    self.uniforms.seed_row(row, s.seed)
            self.uniforms.first_row = row0  # (the first tokens' draws: index 0 is row0, not a running row)
            try:
                first = self._next_token(logits, self._all_greedy(seqs), slice(row0, row0 + n))
            finally:
                self.uniforms.first_row = 0
            if meanwhile is not None:
                meanwhile()
        except BaseException:  # (a failed or interrupted prefill leaves no row holding blocks, tokens or a generator)
            for row in rows:
                self.blocks.free(row)
                self.uniforms.drop_row(row)
            raise
        for row, s in zip(rows, seqs):  # (requests arriving now may share its prompt's blocks)
            self.blocks.index(row, s)
        self.root[row0:row0 + n] = first
        taken = 0
        try:
            for i, s in enumerate(seqs):
                s.row = row0 + i
                self.rows[s.row] = s
                if self.proposer is not None:  # (before the first tokens are read: see above)
                    self.take_in(s.row, texts[i], first[i], self.tree_of(self.bucket_for(s.row + 1)))
                taken += 1
        finally:  # the rows taken in emit their first tokens and run, even where a later one failed
            for row in rows[taken + 1:]:  # (those after a failed one: blocks back, retried alone by the caller)
                self.blocks.free(row)
                self.uniforms.drop_row(row)
            for s, t in zip(seqs[:taken], first.tolist()):
                self._emit(s, [t], streamer)
                if not s.done:
                    self.active[s.row] = 1
                else:
                    self._release(s)

    def _prefill_rows(self, seqs: list, row0: int) -> torch.Tensor:
        """Prefills ``seqs`` into rows ``row0..`` (their blocks assigned, the first
        ``cached_tokens`` of each prompt in cached blocks) -> logits [n, V] after each prompt's
        last token."""
        device, n = self.target.device, len(seqs)
        rows = self.cache.rows(row0, row0 + n)
        cached = [s.cached_tokens for s in seqs]
        rows.lengths.copy_(torch.tensor(cached))
        for i, s in enumerate(seqs):
            self.config.set_row(row0 + i, s.temperature, s.top_k, s.top_p)
        rest = [s.text(0)[c:] for s, c in zip(seqs, cached)]
        chunked = self.chunked_prefill
        if chunked is not None and chunked.takes([len(r) for r in rest], cached):
            return torch.cat([chunked(row0 + i, r, c) for i, (r, c) in enumerate(zip(rest, cached))])
        if len(set(cached)) > 1:  # rows after cached prefixes of different lengths: one at a time
            return torch.cat([self.target.prefill(token_tensor(r, device)[None], torch.tensor([len(r)]),
                                                  rows.rows(i, i + 1)) for i, r in enumerate(rest)])
        ids = torch.zeros(n, max(map(len, rest)), dtype=torch.long)  # one forward over the right-padded prompts
        for i, r in enumerate(rest):
            ids[i, :len(r)] = token_tensor(r, "cpu")
        return self.target.prefill(ids.to(device), torch.tensor(list(map(len, rest))).to(device), rows)

    def cancel(self, s: Sequence) -> None:
        """Ends a sequence now (a client went away, a stop string was met): its row is free for
        the next ``add``. Call between rounds."""
        s.done = True
        if s.row >= 0 and self.rows[s.row] is s:
            self._release(s)

    def _release(self, s: Sequence) -> None:
        """Frees a finished sequence's row: masked, its length reset so later rounds' writes stay
        inside the cache. Once only (a stop string may have ended it while its tokens went out)."""
        if self.rows[s.row] is not s:
            return
        self.rows[s.row] = None
        self.active[s.row] = 0
        self.blocks.free(s.row, s)
        self.uniforms.drop_row(s.row)

    def _emit(self, s: Sequence, tokens: list, streamer) -> None:
        kept = s.extend(tokens)
        if streamer is not None and kept:
            streamer(s.row, kept)

    def _all_greedy(self, seqs: list) -> bool:
        """Whether these sequences all decode greedily (each one's temperature 0)."""
        return all(s.temperature == 0 for s in seqs)
