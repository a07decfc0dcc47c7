"""Pure-PyTorch reference attention: the oracle every fast kernel is tested against.

Shapes: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``Hq % Hkv == 0``, GQA),
``M`` new (tree) tokens, ``S`` cache slots, ``D`` head dim. All ops compute in float32 and return
the output with the per-row log-sum-exp of the scaled scores (natural log), so partial results
over disjoint key sets can be merged exactly. A row with no visible key gets ``o = 0`` and
``lse = -inf``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, Hq, M, D] -> [B, Hkv, G, M, D] (query heads sharing a KV head side by side)."""
    b, hq, m, d = q.shape
    return q.reshape(b, n_kv, hq // n_kv, m, d)


def _masked_softmax_attention(q, k, v, visible):
    """q [B,Hkv,G,M,D], k/v [B,Hkv,S,D], visible broadcastable to [B,1,1,M,S] -> (o, lse)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bhgmd,bhsd->bhgms", q.float(), k.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B,Hkv,G,M]
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    weights = weights.masked_fill(~visible, 0.0)
    o = torch.einsum("bhgms,bhsd->bhgmd", weights, v.float())
    b, h, g, m, d = o.shape
    return o.reshape(b, h * g, m, d), lse.reshape(b, h * g, m)


def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, starts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every query to the cached prefix.

    q [B, Hq, M, D]; k_cache, v_cache [B, Hkv, S, D]; lengths [B] (keys ``0..lengths[b]-1`` of row
    b are visible, the rest of the S slots are ignored) or [B, M] (a limit per query); ``starts``
    [B, M] (a sliding window): query i of row b sees no key below slot ``starts[b, i]``.
    Returns o [B, Hq, M, D] float32, lse [B, Hq, M] float32."""
    slots = torch.arange(k_cache.shape[2], device=q.device)
    limits = lengths[:, None] if lengths.dim() == 1 else lengths  # [B, 1 or M]
    visible = slots[None, None, :] < limits[..., None]  # [B, 1 or M, S]
    if starts is not None:
        visible = visible & (slots[None, None, :] >= starts[..., None])
    visible = visible[:, None, None]  # [B,1,1,1 or M,S]
    return _masked_softmax_attention(_grouped(q, k_cache.shape[1]), k_cache, v_cache, visible)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention among the M new tokens under a boolean mask.

    q [B, Hq, M, D]; k, v [B, Hkv, M, D]; tree_mask [B, M, M] or [M, M] (``[i, j]`` true when
    token i may see token j). Returns o [B, Hq, M, D], lse [B, Hq, M] (float32)."""
    mask = tree_mask if tree_mask.dim() == 3 else tree_mask[None]
    return _masked_softmax_attention(_grouped(q, k.shape[1]), k, v, mask[:, None, None])


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines two partial attentions over disjoint key sets by their log-sum-exps (float32).

    o [..., D], lse [...] -> (o [..., D], lse [...]); parts with ``lse = -inf`` get weight 0."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.nan_to_num(neginf=0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(0.0)
    w2 = torch.exp(lse2 - safe).nan_to_num(0.0)
    return o1 * w1[..., None] + o2 * w2[..., None], lse


def hybrid_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, starts=None):
    """Every query sees the whole cached prefix (no mask; from slot ``starts[b, i]`` on with a
    sliding window) plus the tree tokens its mask allows: ``prefix_attention`` and
    ``tree_attention`` merged by LSE. Returns o [B, Hq, M, D] float32."""
    o_prefix, lse_prefix = prefix_attention(q, k_cache, v_cache, lengths, starts)
    o_tree, lse_tree = tree_attention(q, k_tree, v_tree, tree_mask)
    return merge_attention(o_prefix, lse_prefix, o_tree, lse_tree)[0]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain masked attention, the simplest oracle: q [B, Hq, M, D], k/v [B, Hkv, S, D],
    mask [B, M, S] bool. Returns (o, lse) in float32."""
    return _masked_softmax_attention(_grouped(q, k.shape[1]), k, v, mask[:, None, None])
