"""StreamingLLM self-speculation: the target drafts for itself from a constant-size view of its
own KV cache (MagicDec's baseline), as a :class:`~longspec.spec.drafting.TreeDrafter`."""
from __future__ import annotations

import torch

from ..kv.cache import KVCache
from .drafting import TreeDrafter


class StreamingSelfSpec(TreeDrafter):
    """The target as its own draft, attending only to a StreamingLLM view of its KV cache: the
    first ``sinks`` tokens and the last ``window`` committed tokens (MagicDec). The view is a small
    separate cache of ``sinks + window + tree`` slots, refreshed from the target cache each
    round: its size does not depend on the context."""

    def __init__(self, window: int = 512, sinks: int = 4):
        if window < 1 or sinks < 0:
            raise ValueError(f"StreamingSelfSpec needs window >= 1 and sinks >= 0, got {window}, {sinks}")
        self.window, self.sinks = window, sinks

    graphable = True
    follows_plain_rounds = True  # its view is refreshed from the target cache every round

    def begin(self, target, cache, tree, config, rng):
        super().begin(target, cache, tree, config, rng)
        self.view = KVCache(target.cache_config, cache.batch_size, self.sinks + self.window + tree.num_nodes,
                            target.dtype, target.device)

    def rows(self, n, cache):
        view = super().rows(n, cache)
        view.view = self.view.rows(0, n)
        return view

    def release(self):
        super().release()
        self.view = None

    def _refresh(self) -> None:
        """Copies sink + recent slots of every row from the target cache into the view."""
        lengths, span = self.cache.lengths, self.sinks + self.window
        j = torch.arange(span, device=lengths.device)[None, :]
        recent_start = torch.clamp(lengths - self.window, min=self.sinks)[:, None]
        src = torch.where(j < self.sinks, j, recent_start + j - self.sinks)
        n = torch.minimum(lengths, torch.full_like(lengths, span))
        src = torch.where(j < n[:, None], src, 0)
        src, dst = self.cache.physical(src), self.view.physical(j)
        for store, view in ((self.cache.pool.k, self.view.pool.k), (self.cache.pool.v, self.view.pool.v)):
            view[:, :, dst.reshape(-1)] = store[:, :, src.reshape(-1)]
        self.view.lengths.copy_(n)
        self.view.discard()

    def _root_logits(self, root):
        self._refresh()
        one = torch.ones(1, 1, 1, dtype=torch.bool, device=root.device)
        return self._forward(root[:, None], self.cache.lengths[:, None], one)[:, 0]

    def _level_logits(self, tokens, positions, mask, tree_tokens):
        return self._forward(tokens, positions, mask)

    @torch.inference_mode()
    def _forward(self, tokens, positions, mask):
        return self.target.logits(self.target.forward_hidden(tokens, positions, self.view, mask,
                                                             n_keys=self.view.max_len, slot_positions=False))

    def _end_round(self):
        self.view.discard()
