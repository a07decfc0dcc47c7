"""Attention ops: pure-PyTorch references (the oracle) and, later, fast kernels with the same
signatures."""
from .reference import dense_attention, hybrid_attention, merge_attention, prefix_attention, tree_attention

__all__ = ["dense_attention", "hybrid_attention", "merge_attention", "prefix_attention", "tree_attention"]
