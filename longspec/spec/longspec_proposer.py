"""The LongSpec draft as a proposer, alone or with a prompt-lookup chain merged into its beam
tree (the hybrid proposer)."""
from __future__ import annotations

from typing import Optional

import torch

from ..kv.cache import DraftCache
from .drafting import TreeDrafter
from .prompt_lookup import PromptLookup
from .tokens import token_tensor


class LongSpecProposer(TreeDrafter):
    """The LongSpec draft (:class:`~longspec.models.draft.LongSpecDraft`) as proposer.

    Each round re-reads, in one draft forward, the tokens accepted in the last round plus the new
    root (their target KV now exists: each sees target slots before its own index, lag 1), then
    grows the tree with tree-masked self-attention over the ring buffer and unmasked
    cross-attention over the target's last-layer cache. Its memory is the ring buffer: constant.
    The re-read block always has ``D + 1`` columns (padding masked), so rounds have fixed shapes."""

    graphable = True
    follows_plain_rounds = True  # ``decoded`` writes the window K/V a round's first forward would

    def __init__(self, draft, lookup: Optional[PromptLookup] = None):
        """``lookup``: merge a prompt-lookup chain into the draft's beam tree (the hybrid
        proposer; see :class:`TreeDrafter`)."""
        self.draft, self.lookup = draft, lookup

    def begin(self, target, cache, tree, config, rng):
        if target is not self.draft.target:
            self.draft.config.check_target(target)
        super().begin(target, cache, tree, config, rng)
        if self.draft.config.draft_vocab and self.draft.target.shard is None:
            self.draft.reduced_head(check=True)
        self._take_columns()
        b, device = cache.batch_size, target.device
        self.ring = DraftCache(self.draft.config, b, tree.num_nodes, target.dtype, device)
        self.reread = torch.zeros(b, tree.depth + 1, dtype=torch.long, device=device)
        self.reread_count = torch.zeros(b, dtype=torch.long, device=device)  # accepted drafts, root excluded

    def _take_columns(self) -> None:
        """Rounds select among the reduced vocabulary's columns (see TreeDrafter.candidate_ids):
        its tokens and the column of each token id."""
        if self.draft.config.draft_vocab and self.draft.target.shard is None:
            subset = self.draft.vocab_subset
            columns = torch.arange(subset.numel(), device=subset.device)
            self.candidate_ids = subset
            self.candidate_index = torch.full((self.draft.config.vocab_size,), -1, dtype=torch.long,
                                              device=subset.device).scatter(0, subset, columns)
        else:
            self.candidate_ids = self.candidate_index = None

    def _columns(self):
        if self.candidate_ids is not None and self.candidate_ids is not self.draft.vocab_subset:
            self._take_columns()  # the draft's vocabulary changed (limit_vocab) since ``begin``
        return super()._columns()

    def rows(self, n, cache):
        view = super().rows(n, cache)
        view.ring, view.reread, view.reread_count = self.ring.rows(0, n), self.reread[:n], self.reread_count[:n]
        return view

    def release(self):
        super().release()
        self.ring = self.reread = self.reread_count = self.target_kv = self.root_index = self.cross_keys = None
        self.candidate_ids = self.candidate_index = None

    def add(self, row, prompt, first_token, tree=None):
        """Fills row ``row`` of the window with the prompt's last W tokens (K/V only: exact for a
        one-block draft), and the lookup's history; for a ``tree`` the lookup drafts alone, the
        history only."""
        if tree is not None and not self.keeps_up(tree):
            self.lookup.add(row, prompt, first_token)
            return
        w, device = self.draft.config.window, self.reread.device
        tail = prompt[-w:]
        ids = token_tensor(tail, device)[None]
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
        return self.draft.logits(hidden[torch.arange(b, device=device), self.reread_count], reduced=True,
                                 compact=self._columns() is not None)

    def _level_logits(self, tokens, positions, mask, tree_tokens):
        n_prev = mask.shape[-1] - tokens.shape[1]
        node = torch.arange(n_prev, mask.shape[-1], device=tokens.device)[None, :].expand_as(tokens)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        cross_limit = self.cache.lengths[:, None].expand_as(tokens)
        hidden = self.draft.forward_step(tokens, positions, positions, node, valid, self.ring, self.target_kv,
                                         cross_limit, tree_mask=mask, slot=self.root_index[:, None] + node,
                                         cross_keys=self.cross_keys)
        return self.draft.logits(hidden, reduced=True, compact=self._columns() is not None)

    def keeps_up(self, tree):
        """A chain drafted by the lookup alone leaves the draft's window behind (its rounds cost
        what prompt lookup's own do, without the draft's K/V of the re-read block)."""
        return not (self.lookup is not None and tree.kind == "chain")

    def propose(self, root):
        """A round's tree; with a lookup and a chain tree (``with_tree``; ``--proposer auto``
        switches to one where the lookup alone is predicted faster) the lookup drafts the chain
        alone, and the draft does not follow (:meth:`keeps_up`: the engine takes the rows in
        again before a beam tree returns)."""
        if self.lookup is not None and self.spec.kind == "chain":
            return self.lookup.propose(root)
        return super().propose(root)

    def _end_round(self):
        self.ring.drop_pending()
