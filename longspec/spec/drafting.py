"""Drafting a tree: the :class:`Proposer` interface every draft strategy implements, and
:class:`TreeDrafter`, which grows any tree shape (chain, static paths, beam widths) from a
next-token distribution, with the selection helpers it uses (:func:`beam_select`,
:func:`topk_children`) and the prompt-lookup chain it can merge into a beam tree. The concrete
proposers (:mod:`~longspec.spec.prompt_lookup`, :mod:`~longspec.spec.longspec_proposer`,
:mod:`~longspec.spec.streaming`) build on it; :mod:`~longspec.spec.proposers` gathers them."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Optional

import torch

from ..config import GenerationConfig
from ..kv.cache import KVCache
from .draft_tree import DraftTree
from .sampling import config_rows, uniform, warp_with
from .topk import top_k
from .tree import TreeSpec

if TYPE_CHECKING:
    from .prompt_lookup import PromptLookup


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
    cum, flat = top_k(child_logprobs, width, bias=parent_logprobs)  # over the P * V pairs
    return flat // V, flat % V, cum


def topk_children(logits: torch.Tensor, k: int):
    """Top-``k`` children of each node from draft ``logits [B, M, V]``.

    Returns ``tokens [B, M, k]`` and their ``logprobs [B, M, k]``, in descending probability.
    """
    b, m, v = logits.shape
    logprobs, tokens = top_k(logits.float().log_softmax(-1).reshape(b * m, 1, v), k)
    return tokens.view(b, m, k), logprobs.view(b, m, k)


class Proposer:
    """Interface of a draft strategy. An engine calls ``begin`` once; ``add`` when a sequence
    joins (after its prefill); per round ``propose(root)`` -> :class:`DraftTree`, then
    ``accepted(emitted, counts)`` with each row's newly emitted tokens. ``graphable``:
    ``propose`` and ``accepted`` use fixed shapes and never synchronise with the host, so an
    engine may capture them in a CUDA graph; ``state_tensors`` then lists what a warm-up run must
    not change."""

    graphable = False
    narrowable = False  # implements rows(): an engine may run it on part of its batch
    # an engine may decode some rounds plainly: the proposer keeps up through ``accepted`` alone, or
    # implements ``decoded`` (state built from each round's root)
    follows_plain_rounds = False

    def begin(self, target, cache: KVCache, tree: TreeSpec, config: GenerationConfig, rng) -> None:
        """Once per engine: ``cache`` is the target's (all batch rows), ``rng`` a
        :class:`~longspec.spec.sampling.Uniforms`."""
        raise NotImplementedError

    def add(self, row: int, prompt, first_token, tree: Optional[TreeSpec] = None) -> None:
        """A sequence with ``prompt`` (its token ids, prefilled: an int64 tensor on the device or
        a numpy array from an engine; any sequence of ints will do) and its first generated token
        (an int, or a 0-d tensor on the device: an engine takes a row in before it reads the
        token, so that on a GPU this work queues behind the prefill) takes batch row ``row``.
        ``tree``: given (by an engine) only for a tree whose rounds do not keep all the state up
        (:meth:`keeps_up`): only the state its rounds use need be taken in."""

    def propose(self, root: torch.Tensor) -> DraftTree:
        """root [B]: the last emitted token of each row (its target KV is not cached yet)."""
        raise NotImplementedError

    def accepted(self, emitted: torch.Tensor, counts: torch.Tensor) -> None:
        """emitted [B, D+1]: per row, the tokens the last round emitted (accepted drafts + bonus),
        the first ``counts[b]`` valid (fewer columns after a round that drafted less: a bucket's
        smaller tree, a CPU's lookup chain that drafted nothing)."""

    def decoded(self, root: torch.Tensor) -> None:
        """A round decodes ``root`` [B] plainly, drafting nothing (a batch bucket where speculation
        does not pay): take it in as a round would have. ``accepted`` then gets its one token.
        Proposers whose state follows from ``accepted`` alone leave this undefined (no work)."""
        raise NotImplementedError

    def keeps_up(self, tree: TreeSpec) -> bool:
        """Whether rounds of ``tree`` keep all of this proposer's state up with the text (else
        the engine takes its rows in again, :meth:`add`, before rounds that need it)."""
        return True

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
    ``tree_tokens`` so far), or [.., C] over the tokens :meth:`_columns` names, and may override
    ``_end_round``. Children are the top-k (static
    trees), the best cumulative log-probability pairs (beam trees), or, for a chain under
    sampling, drawn from the draft's own warped distribution (the residual verification rule then
    applies). Shapes are fixed by the tree spec: no host synchronisation.

    ``lookup`` (a :class:`PromptLookup`, beam trees only): the last node of every level is the
    lookup's candidate after the previous level's lookup node (the prompt-lookup chain, merged into
    the draft's tree: the HOWL idea inside one verification), when it has one; the tree's trailing
    one-node levels (:attr:`TreeSpec.lookup_tail`) hold the chain alone, and the draft does not
    run for them (past the beam its best path is rarely right: the shipped draft's top-1 rate is
    ~0.45 a level)."""

    lookup: Optional["PromptLookup"] = None
    narrowable = True
    # a proposer that scores part of the vocabulary (a draft's reduced head): the level logits are
    # [.., C] over the token ids ``candidate_ids`` [C], and ``candidate_index`` [V] maps a token id
    # to its column (-1: not scored). Greedy selection then runs over C columns, not the whole
    # vocabulary (Gemma 3: 8,192 against 262,144); None: the logits cover the whole vocabulary
    candidate_ids: Optional[torch.Tensor] = None
    candidate_index: Optional[torch.Tensor] = None

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

    def _columns(self) -> Optional[torch.Tensor]:
        """The token ids [C] the level logits score this round, or None (the whole vocabulary):
        ``candidate_ids`` when no level of the tree picks more than C tokens a node (a narrower
        vocabulary goes whole, its other tokens -inf, so such a tree still fills)."""
        ids = self.candidate_ids
        return ids if ids is not None and ids.numel() >= self.spec.max_children else None

    def _whole_vocabulary(self, logits: torch.Tensor, ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Level logits [.., C] over ``ids`` -> [.., V] (-inf for the tokens not scored)."""
        if ids is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.candidate_index.shape[0]), float("-inf"), device=logits.device)
        return full.scatter(-1, ids.expand(*logits.shape[:-1], -1), logits.float())

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
        ids = self._columns()  # the level logits' columns' tokens (None: every token)
        level_logits = self._root_logits(root)[:, None]  # [B, 1, V or C]
        cum = torch.zeros(b, 1, device=device)
        chain = _LookupChain(self.lookup, spec.depth) if self.lookup is not None else None
        drafted = spec.depth - (spec.lookup_tail if chain is not None else 0)  # levels the draft picks
        for depth in range(1, spec.depth + 1):
            prev, cur = spec.level_slice(depth - 1), spec.level_slice(depth)
            if depth > drafted:
                local_parent, new_tokens = chain.tail(depth)
            elif self.sample_children:
                q = warp_with(self.config, self._whole_vocabulary(level_logits, ids))  # [B, n_prev, V]
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
                new_tokens = new_tokens if ids is None else ids[new_tokens]
                local_parent = local_parent.expand(b, -1)
            else:
                logprobs = level_logits.float().log_softmax(-1)  # (over C columns: the others' exp is 0)
                local_parent, new_tokens, cum = beam_select(cum, logprobs, spec.widths[depth - 1])
                new_tokens = new_tokens if ids is None else ids[new_tokens]
                if chain is not None:
                    chain.extend(depth, local_parent, new_tokens, cum, logprobs,
                                 None if ids is None else self.candidate_index)
            parent = local_parent + prev.start
            tokens[:, cur], parents[:, cur] = new_tokens, parent
            mask[:, cur] = mask.gather(1, parent[:, :, None].expand(-1, -1, n)) | self.eye[cur]
            if depth < drafted:
                positions = self.cache.lengths[:, None] + depth
                level_logits = self._level_logits(new_tokens, positions.expand(-1, new_tokens.shape[1]),
                                                  mask[:, cur, :cur.stop], tokens[:, :cur.stop])
        self._end_round()
        return DraftTree(tokens, parents, self.depths.expand(b, -1), mask, draft_probs=draft_probs,
                         children_sampled=self.sample_children, without_replacement=self.sample_children,
                         level_sizes=spec.level_sizes, valid=valid)


class _LookupChain:
    """The prompt-lookup chain of one round inside a beam tree (see ``TreeDrafter.lookup``): its
    tokens are the lookup's :meth:`~longspec.spec.prompt_lookup.PromptLookup.continuation`
    (one search a round); at each drafted level its token takes the level's last slot (the beam's
    weakest pair) under the chain's last node, unless the beam picked it there already (the chain
    then goes on from that node: a second node with the same token under the same parent would be
    a duplicate, which sampled verification never reaches, nor its subtree), and the tree's lookup
    tail (``TreeSpec.lookup_tail``) holds the chain alone."""

    def __init__(self, lookup, depth: int):
        matched, self.tokens = lookup.continuation(depth)  # [B], [B, D]
        self.found = matched > 0
        self.node = torch.zeros_like(self.found, dtype=torch.long)  # its node's index within the last level
        self.cum = torch.zeros(self.found.shape, device=self.found.device)  # its cumulative draft log-probability

    def extend(self, depth: int, local_parent, new_tokens, cum, logprobs, columns=None) -> None:
        """Overwrites the last pair of level ``depth`` (in place) where the chain has a candidate
        the beam did not pick under the chain's node. ``columns`` [V]: the column of each token id
        in ``logprobs`` (-1: not scored), when ``logprobs`` covers only part of the vocabulary."""
        token = self.tokens[:, depth - 1]
        rows = torch.arange(token.shape[0], device=token.device)
        if columns is None:
            token_logprob = logprobs[rows, self.node, token]
        else:
            column = columns[token]
            token_logprob = torch.where(column >= 0, logprobs[rows, self.node, column.clamp(min=0)], float("-inf"))
        chain_cum = self.cum + token_logprob
        last = new_tokens.shape[1] - 1
        picked = (new_tokens == token[:, None]) & (local_parent == self.node[:, None])  # [B, n]
        write = self.found & ~picked.any(1)
        new_tokens[:, last] = torch.where(write, token, new_tokens[:, last])
        local_parent[:, last] = torch.where(write, self.node, local_parent[:, last])
        cum[:, last] = torch.where(write, chain_cum, cum[:, last])
        at = torch.where(write | ~self.found, last, picked.int().argmax(1))  # (the first such pick)
        self.cum, self.node = chain_cum, at

    def tail(self, depth: int) -> tuple:
        """(local parent [B, 1], token [B, 1]) of the one node of tail level ``depth``: the
        chain's next token under its last node (arbitrary where the lookup found nothing)."""
        parent = self.node[:, None]
        self.node = torch.zeros_like(self.node)
        return parent, self.tokens[:, depth - 1:depth]
