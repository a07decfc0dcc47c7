"""Attention ops: pure-PyTorch references (the oracle, ``reference.py``) and fast paths with the
same semantics (``fast.py``), tested against them."""
from .fast import causal_attention, masked_attention
from .reference import dense_attention, hybrid_attention, merge_attention, prefix_attention, tree_attention

__all__ = ["causal_attention", "dense_attention", "hybrid_attention", "masked_attention", "merge_attention",
           "prefix_attention", "tree_attention"]
