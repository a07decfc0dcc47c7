"""Prompt lookup decoding (PLD) as a proposer: candidates for the next token are what followed
earlier occurrences of the context's last n tokens, searched on the device with fixed shapes."""
from __future__ import annotations

import torch

from .draft_tree import DraftTree
from .drafting import TreeDrafter
from .tokens import token_tensor

# on a device without CUDA graphs a chain round in which no row's lookup matched at least this many
# tokens verifies its root alone, a decode step (docs/benchmarks.md, "Chains only where the lookup
# matches")
DECODE_BELOW = 2


class PromptLookup(TreeDrafter):
    """Prompt lookup decoding: the next token after a node is what followed the most recent
    earlier occurrence of the context's last n tokens (n = ``max_ngram`` down to ``min_ngram``),
    in the prompt, the generated text and the node's path. Several earlier occurrences rank several
    candidates (longest match first, then most recent), so any tree shape can be filled; with no
    match the proposal is arbitrary (and will simply be rejected).

    The history lives on the device ([B, capacity] tokens) and the search is a few tensor ops over
    it, with fixed shapes: rounds can be captured in a CUDA graph. Where rounds run eagerly (a
    CPU), a chain round whose rows all matched fewer than ``decode_below`` tokens (at most
    ``max_ngram``) drafts nothing (its tree is the root alone: a decode step); its arbitrary or
    1-token-match guesses would cost the verification of the whole chain, up to twice a decode step
    there, and rarely hold."""

    graphable = True
    follows_plain_rounds = True  # its history takes every emitted token through ``accepted``

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, candidates: int = 8, decode_below: int = DECODE_BELOW):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"PromptLookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.candidates = max_ngram, min_ngram, candidates
        self.decode_below = decode_below

    def begin(self, target, cache, tree, config, rng):
        super().begin(target, cache, tree, config, rng)
        self.vocab = target.config.vocab_size
        self.capacity = cache.max_len + tree.depth + 2  # prompt + every emitted token
        device = cache.lengths.device
        self.hist = torch.full((cache.batch_size, self.capacity + 1), -1, dtype=torch.long, device=device)  # + scratch
        self.hist_len = torch.zeros(cache.batch_size, dtype=torch.long, device=device)

    def rows(self, n, cache):
        view = super().rows(n, cache)
        view.hist, view.hist_len = self.hist[:n], self.hist_len[:n]
        return view

    def release(self):
        super().release()
        self.hist = self.hist_len = None

    @property
    def history(self) -> list:
        """Per row, the prompt and every emitted token (host lists; a device sync)."""
        return [h[:n].tolist() for h, n in zip(self.hist, self.hist_len.tolist())]

    def add(self, row, prompt, first_token, tree=None):
        kept = min(len(prompt), self.capacity - 1)  # (the prompt's last tokens, then the first token)
        self.hist[row] = -1
        self.hist[row, :kept] = token_tensor(prompt[len(prompt) - kept:], self.hist.device)
        self.hist[row, kept] = first_token  # (an int, or a 0-d tensor on the device: no wait for it)
        self.hist_len[row] = kept + 1

    def accepted(self, emitted, counts):
        cols = torch.arange(emitted.shape[1], device=emitted.device)[None, :]
        pos = self.hist_len[:, None] + cols
        pos = torch.where((cols < counts[:, None]) & (pos < self.capacity), pos, self.capacity)
        self.hist.scatter_(1, pos, emitted)
        # rows that are not decoding still take part in rounds: keep their length bounded
        self.hist_len.copy_((self.hist_len + counts).clamp(max=self.capacity))

    def state_tensors(self):
        return [self.hist, self.hist_len]

    def propose(self, root: torch.Tensor) -> DraftTree:
        """A chain is the :meth:`continuation` of the history (one search a round, whatever its
        depth), its children chosen deterministically under sampling too (verified by the
        target's probability of each, which needs no draft distribution); eagerly, the root alone
        where no row matched ``decode_below`` tokens (see the class). Other trees:
        :meth:`TreeDrafter.propose` over the ranked candidates' pseudo-logits."""
        spec = self.spec
        if spec.kind != "chain":
            return super().propose(root)
        b, n = root.shape[0], spec.num_nodes
        matched, path = self.continuation(spec.depth)
        # On a CPU (no graphs, no wait) a chain round runs only where some row found a match (rows
        # with nothing cached are free rows riding along in the bucket), and a row whose lookup
        # matched fewer than ``decode_below`` tokens (at most ``max_ngram``) proposes nothing (its
        # tokens are never tried): its sample is then the one the plain round it would run alone
        # draws, whatever its neighbours matched (a seeded request's text). On CUDA every row runs
        # chains, alone too: every node is tried (no mask to build a round)
        valid = None
        if not root.is_cuda:
            found = matched >= min(self.decode_below, self.max_ngram)
            if not bool((found & (self.cache.lengths > 0)).any()):
                n, path = 1, path[:, :0]
            valid = found[:, None] | (torch.arange(n, device=root.device) == 0)[None, :]
        tokens = torch.cat([root[:, None], path], 1)
        parents = torch.arange(-1, n - 1, device=root.device).expand(b, -1).contiguous()
        mask = torch.ones(n, n, dtype=torch.bool, device=root.device).tril().expand(b, -1, -1).contiguous()
        return DraftTree(tokens, parents, self.depths[:n].expand(b, -1), mask, level_sizes=spec.level_sizes[:n - 1],
                         valid=valid)

    def continuation(self, depth: int) -> tuple:
        """(matched [B]: how many tokens of each row's tail matched, 0 where none did; tokens [B,
        depth]): the chain prompt lookup drafts after each row's history: the tokens that
        followed the best match of its tail (the longest, then most recent, earlier occurrence;
        the top candidate of :meth:`_lookup`), copied on from there, as prompt lookup decoding
        does. One search whatever ``depth`` (a search per level launched dozens of small kernels
        each). Where the copy reaches the history's end it repeats the period it found (the chain
        continues its own text: what searching again after each drafted token would find). Where
        nothing matches the tokens are arbitrary."""
        empty = torch.zeros(self.hist.shape[0], 1, 0, dtype=torch.long, device=self.hist.device)
        ctx, score = self._scores(empty)
        # a match's score is unique to its position, so the best score names the best follower;
        # a plain max, which Inductor can split over the positions
        best = score.amax(-1)[:, 0]
        follower = best.clamp(min=0) % (ctx.shape[-1] + 1)  # [B]: where the copy starts
        period = (self.hist_len - follower).clamp(min=1)
        steps = torch.arange(depth, device=follower.device)[None, :]
        source = follower[:, None] + steps % period[:, None]
        matched = torch.where(best >= 0, best // (ctx.shape[-1] + 1), 0)
        return matched, self.hist.gather(1, source.clamp(max=self.capacity)).clamp(min=0)

    def _root_logits(self, root):
        # the root was emitted last round and is already in the history
        empty = torch.zeros(root.shape[0], 1, 0, dtype=torch.long, device=root.device)
        return self._lookup(empty)[:, 0]

    def _level_logits(self, tokens, positions, mask, tree_tokens):
        depths = self.depths[:mask.shape[-1]]
        depth = self.spec.node_depth(mask.shape[-1] - 1)  # the new nodes' depth
        path = torch.stack([((mask & (depths == k)) * tree_tokens[:, None, :]).sum(-1) for k in range(1, depth + 1)],
                           -1)  # [B, n, depth]: each node's path below the root
        return self._lookup(path)

    def _lookup(self, path: torch.Tensor) -> torch.Tensor:
        """path [B, n, d] (the tokens after the history, per node) -> pseudo-logits [B, n, V]:
        ``-rank`` for the ranked candidates, -1e4 elsewhere."""
        ctx, score = self._scores(path)
        b, n, _ = score.shape
        best = torch.full((b, n, self.vocab), -1, dtype=torch.long, device=path.device)
        best.scatter_reduce_(2, ctx.clamp(min=0), score, "amax")
        top, token = best.topk(min(self.candidates, self.vocab), dim=-1)
        rank = torch.arange(top.shape[-1], device=path.device).expand_as(top)
        logits = torch.full((b, n, self.vocab), -1e4, device=path.device)
        return logits.scatter(2, token, torch.where(top >= 0, -rank.float(), -1e4))

    def _scores(self, path: torch.Tensor) -> tuple:
        """(ctx [B, n, W]: history + path per node, -1 past its end; score [B, n, W]: for each
        position f, ``matched * (W + 1) + f`` where the ``matched`` (>= min_ngram) tokens before f
        equal the context's last ones, else -1)."""
        b, n, d = path.shape
        # on CUDA the whole history (fixed shapes, for graphs); elsewhere the part in use
        used = self.capacity if path.is_cuda else min(self.capacity, max(int(self.hist_len.max()), self.max_ngram + 1))
        width = used + d
        ctx = torch.cat([self.hist[:, None, :used].expand(b, n, -1),
                         torch.full((b, n, d), -1, dtype=torch.long, device=path.device)], -1)
        if d:
            at = self.hist_len[:, None, None] + torch.arange(d, device=path.device)
            ctx = ctx.scatter(2, at.expand(b, n, d), path)
        ctx_len = (self.hist_len + d)[:, None]  # [B, 1]
        f = torch.arange(width, device=path.device)[None, None, :]  # follower positions
        matched = torch.zeros(b, n, width, dtype=torch.long, device=path.device)
        run = f <= ctx_len[..., None] - 1  # a window needs a follower inside the context
        for k in range(1, self.max_ngram + 1):
            tail = ctx.gather(2, (ctx_len - k).clamp(min=0)[..., None].expand(b, n, 1))  # k-th last token
            shifted = torch.cat([torch.full((b, n, k), -2, dtype=torch.long, device=path.device), ctx[..., :-k]], -1)
            run = run & (shifted == tail) & (ctx_len[..., None] - k >= 0) & (ctx_len[..., None] - 1 >= k)
            matched += run.long()
        return ctx, torch.where(matched >= self.min_ngram, matched * (width + 1) + f, -1)
