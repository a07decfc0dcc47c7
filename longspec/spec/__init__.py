"""What a speculative round proposes and how it is verified: tree shapes, the proposers (prompt
lookup, the LongSpec draft, the hybrid of both, streaming self-speculation), sampling and its
warps, lossless verification, and the model of how many tokens a round emits. The engine
(``longspec.engine``) runs these; ``longspec.decoding`` decides which to run."""
from .drafting import beam_select, topk_children
from .sampling import check_sampling_args, sample, warp_logits, warp_probs
from .draft_tree import DraftTree
from .tree import TreeSpec, ancestor_mask_from_parents, depths_from_parents
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
