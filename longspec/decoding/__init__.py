"""Speculative decoding: tree shapes, sampling and lossless verification."""
from .sampling import check_sampling_args, sample, warp_logits, warp_probs
from .tree import (
    DraftTree,
    TreeSpec,
    ancestor_mask_from_parents,
    beam_select,
    depths_from_parents,
    topk_children,
)
from .verify import VerifyResult, verify_greedy, verify_sampling, verify_tree

__all__ = [
    "DraftTree",
    "TreeSpec",
    "VerifyResult",
    "ancestor_mask_from_parents",
    "beam_select",
    "check_sampling_args",
    "depths_from_parents",
    "sample",
    "topk_children",
    "verify_tree",
    "verify_greedy",
    "verify_sampling",
    "warp_logits",
    "warp_probs",
]
