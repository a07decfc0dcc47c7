"""Draft strategies behind one interface.

The :class:`~longspec.decoding.generator.Generator` calls, per generation: ``begin`` after the
prefill; per round: ``propose(root)`` -> :class:`DraftTree`, then ``accepted(tokens)`` with each
row's newly emitted tokens; and ``select_rows`` when finished rows leave the batch.

:class:`TreeDrafter` grows any tree shape (chain, static paths, beam widths) from a next-token
distribution; the concrete proposers only say how to get that distribution for a level of tree
nodes:

* :class:`PromptLookup` — n-gram match in the prompt + generated text (prompt lookup decoding);
* :class:`~longspec.decoding.streaming.StreamingSelfSpec` — the target itself over a
  StreamingLLM view of its own KV cache (4 sink tokens + the last ``window`` tokens), the MagicDec
  baseline;
* the LongSpec draft (``LongSpecProposer``) plugs in the same way.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from ..cache import DraftCache, KVCache
from ..config import GenerationConfig
from .sampling import config_rows, uniform, warp_probs
from .tree import DraftTree, TreeSpec


def beam_select(parent_logprobs: torch.Tensor, child_logprobs: torch.Tensor, width: int):
    """Pick the ``width`` best (parent, token) pairs by cumulative log-probability.

    Args:
        parent_logprobs: ``[B, P]`` cumulative draft log-probability of each current-level node.
        child_logprobs: ``[B, P, V]`` draft log-probabilities of each node's children.
        width: number of pairs to keep (``<= P * V``).
    Returns:
        ``parent_idx [B, width]`` (index into the P parents), ``token [B, width]``,
        ``cum_logprob [B, width]`` — sorted by descending ``cum_logprob``, so siblings appear in
        descending draft probability as the verifier expects.
    """
    B, P, V = child_logprobs.shape
    if tuple(parent_logprobs.shape) != (B, P):
        raise ValueError(f"parent_logprobs must be {(B, P)}, got {tuple(parent_logprobs.shape)}")
    if not 0 < width <= P * V:
        raise ValueError(f"beam width must be in [1, {P * V}] ({P} parents x {V} tokens), got {width}")
    # each winning pair is among its parent's ``width`` best children: select per parent first
    # (one small top-k per row), then among the P * k survivors (far cheaper than over P * V)
    k = min(width, V)
    child_top, child_token = torch.topk(child_logprobs, k, dim=-1)  # [B, P, k]
    scores = (parent_logprobs.unsqueeze(-1) + child_top).reshape(B, P * k)
    cum, flat = torch.topk(scores, width, dim=-1, sorted=True)
    return flat // k, child_token.reshape(B, P * k).gather(1, flat), cum


def topk_children(logits: torch.Tensor, k: int):
    """Top-``k`` children of each node from draft ``logits [B, M, V]``.

    Returns ``tokens [B, M, k]`` and their ``logprobs [B, M, k]``, in descending probability.
    """
    logprobs, tokens = torch.topk(logits.float().log_softmax(-1), k, dim=-1)
    return tokens, logprobs


class Proposer:
    """Interface of a draft strategy (see the module docstring). ``graphable``: ``propose`` and
    ``accepted`` use fixed shapes and never synchronise with the host, so an engine may capture
    them in a CUDA graph; ``state_tensors`` then lists what a warm-up run must not change."""

    graphable = False
    narrowable = False  # implements rows(): an engine may run it on part of its batch
    # an engine may decode some rounds plainly: the proposer keeps up through ``accepted`` alone, or
    # implements ``decoded`` (state built from each round's root)
    follows_plain_rounds = False

    def begin(self, target, cache: KVCache, tree: TreeSpec, config: GenerationConfig, rng) -> None:
        """Once per engine: ``cache`` is the target's (all batch rows), ``rng`` a
        :class:`~longspec.decoding.sampling.Uniforms`."""
        raise NotImplementedError

    def add(self, row: int, prompt: list, first_token: int) -> None:
        """A sequence with ``prompt`` (prefilled) and its first generated token takes batch row ``row``."""

    def propose(self, root: torch.Tensor) -> DraftTree:
        """root [B]: the last emitted token of each row (its target KV is not cached yet)."""
        raise NotImplementedError

    def accepted(self, emitted: torch.Tensor, counts: torch.Tensor) -> None:
        """emitted [B, D+1]: per row, the tokens the last round emitted (accepted drafts + bonus),
        the first ``counts[b]`` valid."""

    def decoded(self, root: torch.Tensor) -> None:
        """A round decodes ``root`` [B] plainly, drafting nothing (a batch bucket where speculation
        does not pay): take it in as a round would have. ``accepted`` then gets its one token.
        Proposers whose state follows from ``accepted`` alone leave this undefined (no work)."""
        raise NotImplementedError

    def state_tensors(self) -> list:
        return []

    def release(self) -> None:
        """Forgets the engine it was begun for (``Engine.close`` calls it): a proposer kept for a
        next engine would otherwise hold the old KV cache, and buffers sized for it, while the new
        one is allocated. ``begin`` binds the next engine's."""
        self.cache = None
        self.engine = None

    def rows(self, n: int, cache: KVCache) -> "Proposer":
        """This proposer over batch rows ``0..n-1`` only (``cache``: the target cache's view over
        them), sharing its state: what an engine runs for a smaller batch bucket."""
        raise NotImplementedError(f"{type(self).__name__} cannot run on a part of its batch")

    def with_tree(self, tree: TreeSpec) -> "Proposer":
        """This proposer drafting ``tree`` instead of the tree it was begun with (no deeper and
        with no more nodes: its state is sized for that one), sharing its state: what an engine
        runs for a batch bucket with a tree of its own."""
        raise NotImplementedError(f"{type(self).__name__} drafts only the tree it was begun with")


def takes_lookup(tree: TreeSpec) -> bool:
    """Whether a prompt-lookup chain can merge into ``tree`` (see :class:`TreeDrafter`): a beam
    tree whose first level has at least 2 nodes."""
    return tree.kind == "beam" and tree.widths[0] >= 2


class TreeDrafter(Proposer):
    """Grows a draft tree level by level from a next-token distribution.

    Subclasses implement ``_root_logits(root) -> [B, V]`` (start a round) and
    ``_level_logits(tokens [B, n], positions [B, n], mask [B, n, P+n], tree_tokens [B, P+n])
    -> [B, n, V]`` (the distribution after each new node; ``mask`` is ancestor-or-self over the
    ``tree_tokens`` so far), and may override ``_end_round``. Children are the top-k (static
    trees), the best cumulative log-probability pairs (beam trees), or, for a chain under
    sampling, drawn from the draft's own warped distribution (the residual verification rule then
    applies). Shapes are fixed by the tree spec: no host synchronisation.

    ``lookup`` (a :class:`PromptLookup`, beam trees only): the last node of every level is the
    lookup's candidate after the previous level's lookup node (the prompt-lookup chain, merged into
    the draft's tree: the HOWL idea inside one verification), when it has one."""

    lookup: Optional["PromptLookup"] = None
    narrowable = True

    def begin(self, target, cache, tree, config, rng):
        self.target, self.cache, self.config, self.rng = target, cache, config, rng
        self.max_tree = tree
        if self.lookup is not None:
            self._check_lookup_tree(tree)
            self.lookup.begin(target, cache, tree, config, rng)
        self._set_tree(tree)

    def _check_lookup_tree(self, tree: TreeSpec) -> None:
        if not takes_lookup(tree):
            raise ValueError(f"prompt lookup merges into beam trees whose first level has >= 2 nodes, not {tree}")

    def _set_tree(self, tree: TreeSpec) -> None:
        """What drafting ``tree`` needs: its node depths, levels and identity mask on the device."""
        self.spec = tree
        # under sampling, the children of chain and static trees are drawn from the draft's warped
        # distribution without replacement (Gumbel-top-k) and verified by the residual rule
        self.sample_children = not self.config.greedy and tree.is_static
        device = self.cache.lengths.device
        self.depths = tree.depths.to(device)
        self.eye = torch.eye(tree.num_nodes, dtype=torch.bool, device=device)
        self.static_levels = {}
        if tree.is_static:
            for d in range(1, tree.depth + 1):
                self.static_levels[d] = tuple(t.to(device) for t in tree.level_index(d))

    def with_tree(self, tree):
        big = self.max_tree
        if not tree.fits_in(big):
            raise ValueError(f"tree {tree} does not fit the tree {big} the proposer was begun with "
                             f"(depth {tree.depth} > {big.depth} or {tree.num_nodes} > {big.num_nodes} nodes)")
        view = copy.copy(self)
        if self.lookup is not None:
            if tree.kind != "chain":  # a chain: the lookup drafts alone (see LongSpecProposer.propose)
                self._check_lookup_tree(tree)
            view.lookup = self.lookup.with_tree(tree)
        view._set_tree(tree)
        return view

    def release(self):
        super().release()
        self.rng = None
        if self.lookup is not None:
            self.lookup.release()

    def rows(self, n, cache):
        view = copy.copy(self)
        view.cache = cache
        view.config = config_rows(self.config, n)
        if self.lookup is not None:
            view.lookup = self.lookup.rows(n, cache)
        return view

    def _root_logits(self, root: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _level_logits(self, tokens, positions, mask, tree_tokens) -> torch.Tensor:
        raise NotImplementedError

    def _end_round(self) -> None:
        pass

    def propose(self, root: torch.Tensor) -> DraftTree:
        spec, b, n = self.spec, root.shape[0], self.spec.num_nodes
        device = root.device
        tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        parents = torch.full((b, n), -1, dtype=torch.long, device=device)
        mask = torch.zeros(b, n, n, dtype=torch.bool, device=device)
        tokens[:, 0], mask[:, 0, 0] = root, True
        draft_probs, valid = None, None
        level_logits = self._root_logits(root)[:, None]  # [B, 1, V]
        cum = torch.zeros(b, 1, device=device)
        chain = _LookupChain(self.lookup, b, device) if self.lookup is not None else None
        for depth in range(1, spec.depth + 1):
            prev, cur = spec.level_slice(depth - 1), spec.level_slice(depth)
            if self.sample_children:
                c = self.config
                q = warp_probs(level_logits, c.temperature, c.top_k, c.top_p)  # [B, n_prev, V]
                if draft_probs is None:
                    draft_probs = torch.zeros(b, n, q.shape[-1], device=device)
                    valid = torch.ones(b, n, dtype=torch.bool, device=device)
                draft_probs[:, prev] = q
                gumbel = -torch.log(-torch.log(uniform(q.shape, self.rng, device).clamp(min=1e-20)))
                keys, top = (q.log() + gumbel).topk(spec.max_children, dim=-1)  # draws without replacement
                local_parent, rank = self.static_levels[depth]
                new_tokens = top[:, local_parent, rank]
                valid[:, cur] = keys[:, local_parent, rank] > float("-inf")
                local_parent = local_parent.expand(b, -1)
            elif spec.is_static:
                top, _ = topk_children(level_logits, spec.max_children)
                local_parent, rank = self.static_levels[depth]
                new_tokens = top[:, local_parent, rank]
                local_parent = local_parent.expand(b, -1)
            else:
                logprobs = level_logits.float().log_softmax(-1)
                local_parent, new_tokens, cum = beam_select(cum, logprobs, spec.widths[depth - 1])
                if chain is not None:
                    chain.extend(local_parent, new_tokens, cum, logprobs)
            parent = local_parent + prev.start
            tokens[:, cur], parents[:, cur] = new_tokens, parent
            mask[:, cur] = mask.gather(1, parent[:, :, None].expand(-1, -1, n)) | self.eye[cur]
            if depth < spec.depth:
                positions = self.cache.lengths[:, None] + depth
                level_logits = self._level_logits(new_tokens, positions.expand(-1, new_tokens.shape[1]),
                                                  mask[:, cur, :cur.stop], tokens[:, :cur.stop])
        self._end_round()
        return DraftTree(tokens, parents, self.depths.expand(b, -1), mask, draft_probs=draft_probs,
                         children_sampled=self.sample_children, without_replacement=self.sample_children,
                         level_sizes=spec.level_sizes, valid=valid)


class _LookupChain:
    """The prompt-lookup chain of one round, grown inside a beam tree (see ``TreeDrafter.lookup``):
    at each level its candidate takes the level's last slot (the beam's weakest pair)."""

    def __init__(self, lookup, b: int, device):
        self.lookup, self.path = lookup, torch.zeros(b, 1, 0, dtype=torch.long, device=device)
        self.node = torch.zeros(b, dtype=torch.long, device=device)  # its node's index within the level
        self.alive = torch.ones(b, dtype=torch.bool, device=device)

    def extend(self, local_parent, new_tokens, cum, logprobs) -> None:
        """Overwrites the last pair of the level (in place) where the chain has a candidate."""
        found, token = self.lookup.first_candidate(self.path)
        found, token = found[:, 0], token[:, 0]
        self.alive = self.alive & found
        rows = torch.arange(token.shape[0], device=token.device)
        parent_cum = cum.new_zeros(token.shape) if self.path.shape[-1] == 0 else self.cum
        chain_cum = parent_cum + logprobs[rows, self.node, token]
        last = new_tokens.shape[1] - 1
        new_tokens[:, last] = torch.where(self.alive, token, new_tokens[:, last])
        local_parent[:, last] = torch.where(self.alive, self.node, local_parent[:, last])
        cum[:, last] = torch.where(self.alive, chain_cum, cum[:, last])
        self.cum, self.node = chain_cum, torch.full_like(self.node, last)
        self.path = torch.cat([self.path, token[:, None, None]], -1)


class PromptLookup(TreeDrafter):
    """Prompt lookup decoding: the next token after a node is what followed the most recent
    earlier occurrence of the context's last n tokens (n = ``max_ngram`` down to ``min_ngram``),
    in the prompt, the generated text and the node's path. Several earlier occurrences rank several
    candidates (longest match first, then most recent), so any tree shape can be filled; with no
    match the proposal is arbitrary (and will simply be rejected).

    The history lives on the device ([B, capacity] tokens) and the search is a few tensor ops over
    it, with fixed shapes: rounds can be captured in a CUDA graph."""

    graphable = True
    follows_plain_rounds = True  # its history takes every emitted token through ``accepted``

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, candidates: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"PromptLookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.candidates = max_ngram, min_ngram, candidates

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

    def add(self, row, prompt, first_token):
        tokens = (list(prompt) + [first_token])[-self.capacity:]
        self.hist[row] = -1
        self.hist[row, :len(tokens)] = torch.tensor(tokens, device=self.hist.device)
        self.hist_len[row] = len(tokens)

    def accepted(self, emitted, counts):
        cols = torch.arange(emitted.shape[1], device=emitted.device)[None, :]
        pos = self.hist_len[:, None] + cols
        pos = torch.where((cols < counts[:, None]) & (pos < self.capacity), pos, self.capacity)
        self.hist.scatter_(1, pos, emitted)
        # rows that are not decoding still take part in rounds: keep their length bounded
        self.hist_len.copy_((self.hist_len + counts).clamp(max=self.capacity))

    def state_tensors(self):
        return [self.hist, self.hist_len]

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

    def first_candidate(self, path: torch.Tensor) -> tuple:
        """path [B, n, d] -> (found [B, n] bool, token [B, n]): the best-ranked candidate of
        :meth:`_lookup` (the follower of the longest, then most recent, match), without its
        [B, n, V] scores: a match's score is unique to its position, so the best position's
        token is the best token."""
        ctx, score = self._scores(path)
        # a plain max, which Inductor can split over the positions (max-with-index took 150 us at
        # 16 rows on the H200, steps_batch16_h200.log; not measured since)
        best = score.amax(-1)
        where = best.clamp(min=0) % (ctx.shape[-1] + 1)  # the position is part of the score
        return best >= 0, ctx.gather(2, where[..., None])[..., 0].clamp(min=0)

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


class LongSpecProposer(TreeDrafter):
    """The LongSpec draft (:class:`~longspec.models.draft.LongSpecDraft`) as proposer.

    Each round re-reads, in one draft forward, the tokens accepted in the last round plus the new
    root (their target KV now exists: each sees target slots before its own index, lag 1), then
    grows the tree with tree-masked self-attention over the ring buffer and unmasked
    cross-attention over the target's last-layer cache. Its memory is the ring buffer: constant.
    The re-read block always has ``D + 1`` columns (padding masked), so rounds have fixed shapes."""

    graphable = True
    follows_plain_rounds = True  # ``decoded`` writes the window K/V a round's first forward would

    def __init__(self, draft, lookup: Optional["PromptLookup"] = None):
        """``lookup``: merge a prompt-lookup chain into the draft's beam tree (the hybrid
        proposer; see :class:`TreeDrafter`)."""
        self.draft, self.lookup = draft, lookup

    def begin(self, target, cache, tree, config, rng):
        if target is not self.draft.target:
            self.draft.config.check_target(target)
        super().begin(target, cache, tree, config, rng)
        b, device = cache.batch_size, target.device
        self.ring = DraftCache(self.draft.config, b, tree.num_nodes, target.dtype, device)
        self.reread = torch.zeros(b, tree.depth + 1, dtype=torch.long, device=device)
        self.reread_count = torch.zeros(b, dtype=torch.long, device=device)  # accepted drafts, root excluded

    def rows(self, n, cache):
        view = super().rows(n, cache)
        view.ring, view.reread, view.reread_count = self.ring.rows(0, n), self.reread[:n], self.reread_count[:n]
        return view

    def release(self):
        super().release()
        self.ring = self.reread = self.reread_count = self.target_kv = self.root_index = self.cross_keys = None

    def add(self, row, prompt, first_token):
        """Fills row ``row`` of the window with the prompt's last W tokens (K/V only: exact for a
        one-block draft)."""
        w, device = self.draft.config.window, self.reread.device
        tail = prompt[-w:]
        ids = torch.tensor([tail], device=device)
        index = torch.arange(len(prompt) - len(tail), len(prompt), device=device)[None]
        self.ring.clear_row(row)
        with torch.inference_mode():
            k, v = self.draft.window_kv(ids, index)
            self.ring.rows(row, row + 1).write(k, v, index, torch.full_like(index, -1), torch.ones_like(index, dtype=torch.bool))
        self.reread_count[row] = 0
        if self.lookup is not None:
            self.lookup.add(row, prompt, first_token)

    def accepted(self, emitted, counts):
        # accepted drafts, then the bonus (the next root); a bucket's smaller tree emits fewer columns
        self.reread[:, :emitted.shape[1]].copy_(emitted)
        self.reread_count.copy_(counts - 1)
        if self.lookup is not None:
            self.lookup.accepted(emitted, counts)

    def state_tensors(self):
        lookup = self.lookup.state_tensors() if self.lookup is not None else []
        return [self.reread, self.reread_count, self.ring.k, self.ring.v, self.ring.slot_index, self.ring.slot_node,
                *lookup]

    def _reread_block(self, root):
        """The tokens this round re-reads, [B, D+1] each: ids (last round's accepted drafts, then
        ``root``), their sequence indices (the root's is the cache length) and which are real."""
        count = self.reread_count
        cols = torch.arange(self.reread.shape[1], device=root.device)[None, :]
        ids = torch.where(cols < count[:, None], self.reread, 0).scatter(1, count[:, None], root[:, None])
        index = self.cache.lengths[:, None] - count[:, None] + cols
        return ids, index, cols <= count[:, None]

    def decoded(self, root):
        """Writes the re-read block's window K/V into the ring, as a round's first draft forward
        would (exact without running the block: see ``LongSpecDraft.window_kv``)."""
        ids, index, valid = self._reread_block(root)
        k, v = self.draft.window_kv(ids, index)
        self.ring.write(k, v, index, torch.full_like(index, -1), valid)

    def _root_logits(self, root):
        b, device = root.shape[0], root.device
        ids, index, valid = self._reread_block(root)
        self.target_kv = self.target.last_layer_kv(self.cache)  # committed slots: fixed during the round
        # cross-attention keys: the capacity on CUDA (fixed shapes), the slots in use elsewhere
        self.cross_keys = None if root.is_cuda else max(1, int(self.cache.lengths.max()))
        hidden = self.draft.forward_step(ids, index, index, torch.full_like(index, -1), valid, self.ring,
                                         self.target_kv, cross_limit=index, cross_keys=self.cross_keys)
        self.root_index = self.cache.lengths.clone()
        return self.draft.logits(hidden[torch.arange(b, device=device), self.reread_count], reduced=True)

    def _level_logits(self, tokens, positions, mask, tree_tokens):
        n_prev = mask.shape[-1] - tokens.shape[1]
        node = torch.arange(n_prev, mask.shape[-1], device=tokens.device)[None, :].expand_as(tokens)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        cross_limit = self.cache.lengths[:, None].expand_as(tokens)
        hidden = self.draft.forward_step(tokens, positions, positions, node, valid, self.ring, self.target_kv,
                                         cross_limit, tree_mask=mask, slot=self.root_index[:, None] + node,
                                         cross_keys=self.cross_keys)
        return self.draft.logits(hidden, reduced=True)

    def propose(self, root):
        """A round's tree; with a lookup and a chain tree (``with_tree``; ``--proposer auto``
        switches to one where the lookup alone is predicted faster) the lookup drafts the chain
        alone and the draft only takes in the re-read block's window K/V, as in a plain round, so
        beam trees can return later."""
        if self.lookup is not None and self.spec.kind == "chain":
            self.decoded(root)
            return self.lookup.propose(root)
        return super().propose(root)

    def _end_round(self):
        self.ring.drop_pending()

