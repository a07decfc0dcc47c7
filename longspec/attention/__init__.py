"""Attention ops: pure-PyTorch references (the oracle, ``reference.py``) and fast paths with the
same semantics (``fast.py``), tested against them."""
from .backend import IMPLEMENTATIONS, AttentionMeta, attend, attend_masked, attend_prefix, matmul_attention
from .fast import causal_attention, masked_attention
from .reference import dense_attention, hybrid_attention, merge_attention, prefix_attention, tree_attention

__all__ = ["IMPLEMENTATIONS", "AttentionMeta", "attend", "attend_masked", "attend_prefix", "matmul_attention", "causal_attention", "dense_attention", "hybrid_attention", "masked_attention", "merge_attention",
           "prefix_attention", "tree_attention"]
