"""A batched draft tree (``DraftTree``): what a proposer hands to the verifier, the tokens, parents,
depths and ancestor mask of every row's nodes. The conventions (node 0 the root, topological
order, siblings by draft probability) and the tree shapes (``TreeSpec``) are in
:mod:`longspec.spec.tree`; this module holds the per-round tensors built from them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .tree import TreeSpec, ancestor_mask_from_parents

__all__ = ["DraftTree"]


def _check_parents(parents: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``parents [B, N]`` is a rooted tree in topological order."""
    N = parents.shape[-1]
    if N < 1:
        raise ValueError("a tree needs at least the root node")
    if bool((parents[..., 0] != -1).any()):
        raise ValueError("node 0 must be the root (parent -1)")
    if N > 1:
        rest = parents[..., 1:]
        idx = torch.arange(1, N, device=parents.device)
        if bool(((rest < 0) | (rest >= idx)).any()):
            raise ValueError("every node i > 0 needs a parent in [0, i) (topological order)")


@dataclass
class DraftTree:
    """What a proposer hands to the verifier (batched).

    Attributes:
        tokens: ``[B, N]`` long; ``tokens[:, 0]`` is the root token (last accepted token).
        parents: ``[B, N]`` long, ``-1`` at the root.
        depths: ``[B, N]`` long (root 0); the target position of node i is ``cache_len + depth``.
        mask: ``[B, N, N]`` bool ancestor-or-self mask.
        draft_probs: optional ``[B, N, V]`` float: ``draft_probs[:, i]`` is the draft
            distribution ``q`` from which node ``i``'s children were chosen. Required when
            ``children_sampled``.
        children_sampled: True if children were drawn from ``q`` (i.i.d. with replacement, or
            without replacement when ``without_replacement``); False if chosen deterministically
            (top-k / beam), in which case siblings must be stored in descending draft probability.
        without_replacement: siblings were drawn from ``q`` without replacement.
        level_sizes: number of nodes at depth ``1..D`` when known on the host (from the
            ``TreeSpec``); then ``depth`` and ``level_width`` need no device sync.
        valid: optional ``[B, N]`` bool: children that are real proposals (siblings drawn
            without replacement beyond the support of ``q`` are not, nor a row's arbitrary
            tokens where prompt lookup found nothing; sampled verification never tries them).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    draft_probs: Optional[torch.Tensor] = None
    children_sampled: bool = False
    without_replacement: bool = False
    level_sizes: Optional[tuple] = None
    valid: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, N], got shape {tuple(self.tokens.shape)}")
        B, N = self.tokens.shape
        for name in ("parents", "depths"):
            t = getattr(self, name)
            if tuple(t.shape) != (B, N):
                raise ValueError(f"{name} must have shape {(B, N)}, got {tuple(t.shape)}")
        if tuple(self.mask.shape) != (B, N, N):
            raise ValueError(f"mask must have shape {(B, N, N)}, got {tuple(self.mask.shape)}")
        if self.draft_probs is not None and tuple(self.draft_probs.shape[:2]) != (B, N):
            raise ValueError(f"draft_probs must be [B, N, V] with B, N = {B}, {N}, got {tuple(self.draft_probs.shape)}")
        if self.children_sampled and self.draft_probs is None:
            raise ValueError("children_sampled=True needs draft_probs (the distribution q the children came from)")
        if self.without_replacement and not self.children_sampled:
            raise ValueError("without_replacement only applies when children_sampled=True")

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, **kwargs) -> "DraftTree":
        """Build from ``tokens [B, N]`` and ``parents [B, N]``; depths and mask are derived."""
        _check_parents(parents)
        mask = ancestor_mask_from_parents(parents)
        return cls(tokens, parents, mask.sum(-1) - 1, mask, **kwargs)

    @classmethod
    def from_spec(cls, spec: TreeSpec, tokens: torch.Tensor, **kwargs) -> "DraftTree":
        """Build from a static ``spec`` and ``tokens [B, N]`` (buffers broadcast over the batch)."""
        spec._require_static("DraftTree.from_spec")
        B, N = tokens.shape
        if N != spec.num_nodes:
            raise ValueError(f"tokens have {N} nodes but tree {spec} has {spec.num_nodes}")
        dev = tokens.device
        return cls(
            tokens,
            spec.parents.to(dev).expand(B, N),
            spec.depths.to(dev).expand(B, N),
            spec.ancestor_mask.to(dev).expand(B, N, N),
            level_sizes=spec.level_sizes,
            **kwargs,
        )

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def depth(self) -> int:
        """Maximum node depth ``D`` over the batch (a host sync unless ``level_sizes`` is known)."""
        if self.level_sizes is not None:
            return len(self.level_sizes)
        return int(self.depths.max()) if self.depths.numel() else 0

    def level_width(self, depth: int) -> int:
        """Most nodes at ``depth`` in any row (a host sync unless ``level_sizes`` is known)."""
        if self.level_sizes is not None:
            return self.level_sizes[depth - 1] if 1 <= depth <= len(self.level_sizes) else 0
        return int((self.depths == depth).sum(-1).max()) if self.depths.numel() else 0

    def check(self) -> None:
        """Full consistency check (host syncs; for tests and debugging)."""
        _check_parents(self.parents)
        if not torch.equal(self.mask, ancestor_mask_from_parents(self.parents)):
            raise ValueError("mask is not the ancestor-or-self mask of parents")
        if not torch.equal(self.depths, self.mask.sum(-1) - 1):
            raise ValueError("depths do not match parents")
