"""Preparing an :class:`~longspec.engine.engine.Engine`'s rounds before requests need them:
compilation and CUDA-graph capture of every bucket's rounds of each kind (greedy, sampled,
sampled with top-k / top-p) and tree, and of the prefill's chunk steps, with the time each part
took; and the seconds its rounds spent, per phase."""
from __future__ import annotations

import gc
import time
from typing import Optional

import torch

from ..models.compiled import compile_counts

_OWN_TREES = object()  # warm_up: each bucket's own tree


class WarmUp:
    """The part of :class:`~longspec.engine.engine.Engine` that prepares its rounds and counts
    their time. It works on the engine's state (``runners``, ``parked``, ``buckets``,
    ``chunked_prefill``, ``config``, ``rows``, ``proposer``; it sets ``warming``,
    ``greedy_round``, ``warm_up_seconds``, ``warm_up_graphs``) through its ``has_active``,
    ``use_tree``, ``tree_of``, ``round_kind`` and ``_round``."""

    @property
    def all_runners(self) -> list:
        return [*self.runners.values(), *(r for _, parked in self.parked.values() for r in parked.values())]

    def phase_times(self) -> list:
        """Seconds spent in each phase (with a proposer: drafting, then the target's), over every
        kind of round; a plain bucket's round counts its target step as the target's phase."""
        out = [0.0] * (1 if self.proposer is None else 2)
        for r in self.all_runners:
            for i, t in enumerate(reversed(r.times)):
                out[-1 - i] += t
        return out

    @torch.inference_mode()
    def warm_up(self, sampled: bool = False, trees: Optional[list] = None, prefill_by_layer: bool = True,
                kinds: Optional[list] = None) -> float:
        """Prepares every bucket's greedy rounds (and, with ``sampled``, its sampling rounds) now:
        compilation and CUDA-graph capture, which otherwise happen on a bucket's first round;
        ``trees``: the rounds of each of these trees (None: plain rounds; see :meth:`use_tree`),
        default the buckets' own; ``prefill_by_layer``: the long prompts' attention too (see
        :meth:`prepare_prefill`); and the proposer's take-in of a row (:meth:`prepare_take_in`).
        Call with no sequences in the engine. Returns the seconds it
        took; :attr:`warm_up_seconds` has them per part ({what: seconds}), :attr:`warm_up_graphs` the
        graphs compiled ({what: :func:`compile_counts`' counts}). Ends with a full garbage
        collection: compiling leaves hundreds of thousands of new Python objects, whose first full
        collection (a noticeable pause at the 8B shape) would otherwise fall in a request soon after.
        ``kinds``: the kinds of round to prepare instead, as (greedy, truncating) pairs (see
        :attr:`round_kind`)."""
        if self.has_active:
            raise RuntimeError("warm_up needs an empty engine")
        t0, kind = time.perf_counter(), self.round_kind
        if kinds is None:
            kinds = [(True, False)]  # (greedy, truncating); sampled: with per-row settings, with top-k / top-p too
            if sampled:
                kinds += [(False, False), (False, True)]
        own = {b: self.tree_of(b) for b in self.buckets}
        self.warm_up_seconds, self.warm_up_graphs = {}, {}

        def part(what: str, prepare) -> None:
            self.warming, start, before = what, time.perf_counter(), compile_counts()
            prepare()
            self.warm_up_seconds[what] = time.perf_counter() - start
            self.warm_up_graphs[what] = {k: n - before[k] for k, n in compile_counts().items()}

        try:
            part("the prefill", lambda: self.prepare_prefill(by_layer=prefill_by_layer))
            for tree in trees if trees is not None else [_OWN_TREES]:
                if tree is not _OWN_TREES:
                    self.use_tree(tree)
                for greedy, truncating in kinds:
                    self._use_round_kind(greedy, truncating)
                    for n in self.buckets:
                        which = "" if tree is _OWN_TREES else f" (tree {tree or 'none'})"
                        what = "greedy" if greedy else "sampled (top-k / top-p)" if truncating else "sampled"
                        part(f"bucket {n}'s {what} rounds{which}", self._round(n)[1].prepare)
            if self.proposer is not None:
                part("the proposer's take-in", self.prepare_take_in)
            part("garbage collection", gc.collect)
        finally:
            self.warming = None
        if trees is not None and len(set(map(str, own.values()))) == 1:
            self.use_tree(own[self.buckets[0]])
        self._use_round_kind(*kind)
        return time.perf_counter() - t0

    def _use_round_kind(self, greedy: bool, truncating: bool) -> None:
        """Rounds from now on are greedy or sampled, with top-k / top-p (``truncating``) or
        without."""
        self.greedy_round = greedy
        self.config.truncating = truncating

    def prepare_prefill(self, by_layer: bool = False) -> None:
        """Prepares (on CUDA captures) the chunked prefill's chunk step of every size (one each,
        serving every row), if it has chunk steps; ``by_layer``: sets up the attention of prompts
        long enough to go layer by layer too (once a process: cuDNN's set-up). Call with no
        sequences in the engine."""
        chunked = self.chunked_prefill
        if chunked is not None and chunked.captured:
            chunked.prepare(row=0)
            if by_layer:
                if self.rows[0] is not None:
                    raise RuntimeError("preparing the prefill by layer needs row 0 free (an empty engine)")
                chunked.prepare_by_layer(row=0)

    def prepare_take_in(self) -> None:
        """Takes row 0 in once (a text of zeros as long as the row can hold): the first take-in
        of a process loads its kernels, which would otherwise stall the first switch of ``auto``
        to a tree that takes the rows in, mid-request. The row is taken in again before a round
        drafts from it: at admission, or at that switch where plain rounds left the proposer
        behind (an idle row's state is never read into a sequence's). Call with no sequences in
        the engine."""
        if self.rows[0] is not None:
            raise RuntimeError("preparing the take-in needs row 0 free (an empty engine)")
        if self.max_len < 2:
            return
        text = torch.zeros(self.max_len - 1, dtype=torch.long, device=self.target.device)
        self.proposer.add(0, text, 0)

    def capture_seconds(self) -> float:
        """Seconds spent so far preparing rounds and prefill chunks: compilation (on their eager
        first runs) and CUDA-graph capture."""
        chunks = self.chunked_prefill.runners.values() if self.chunked_prefill is not None else ()
        return sum(r.capture_s for r in [*self.all_runners, *chunks])
