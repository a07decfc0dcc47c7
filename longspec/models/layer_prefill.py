"""A prompt's prefill layer by layer: each decoder layer runs over the whole prompt before the
next one starts, so its attention is one causal call over the prompt (``is_causal``: queries
and keys are the same tokens, which every fused SDPA backend has, cuDNN's included) instead of
one lower-right causal call per chunk. The projections and the MLP still go ``piece`` tokens at
a time, so the activation memory stays bounded: the hidden states, the queries and the attention
output of the whole prompt ([T, H] each, e.g. 4 GiB each for 1M tokens of a 2048-wide model),
plus one piece's MLP. Launches per layer: a few per piece, negligible for pieces of thousands of
tokens, so nothing is captured. The same K/V and logits as :meth:`TargetModel.prefill` (up to
kernel rounding)."""
from __future__ import annotations

import torch

from ..attention import causal_attention
from ..kv.cache import KVCache, store_kv
from . import progress


MAX_CALL_ELEMENTS = 1 << 30  # queries per attention call: fused kernels may index with 32-bit integers


def grouped_causal_attention(queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries [1, T, Hq, D] over k, v [1, Hkv, S, D] -> [1, T, Hq, D]; in
    calls over groups of KV heads (and their query heads) where the queries of one call would
    pass :data:`MAX_CALL_ELEMENTS` (e.g. 1M tokens of 32 heads of 64 dims: 2^31 elements)."""
    hq, hkv = queries.shape[2], k.shape[1]
    groups = 1
    while queries.numel() // groups > MAX_CALL_ELEMENTS and groups < hkv and hkv % (2 * groups) == 0:
        groups *= 2
    if groups == 1:
        return causal_attention(queries.transpose(1, 2), k, v).transpose(1, 2)
    out = torch.empty_like(queries)
    qs, ks = hq // groups, hkv // groups
    for g in range(groups):
        out[:, :, g * qs:(g + 1) * qs] = causal_attention(queries[:, :, g * qs:(g + 1) * qs].transpose(1, 2),
                                                          k[:, g * ks:(g + 1) * ks], v[:, g * ks:(g + 1) * ks]
                                                          ).transpose(1, 2)
    return out


def supports(config) -> bool:
    """Whether :func:`prefill_by_layer` runs a target of ``config``: pre-norm blocks whose every
    layer attends to every earlier token (no sliding-window layers, no Gemma-style sandwich norms
    or query scale; those targets prefill in chunks)."""
    return (not config.has_sliding_layers and not config.sandwich_norms
            and config.query_pre_attn_scalar in (None, config.head_dim))


def check_supported(config) -> None:
    """Raises ValueError, saying what to do instead, for a target :func:`prefill_by_layer` cannot run."""
    if not supports(config):
        raise ValueError("a prefill layer by layer runs targets whose layers all see every earlier token, with "
                         "plain pre-norm blocks; this one has sliding-window layers or Gemma-style norms: prefill "
                         "it in chunks")


@torch.inference_mode()
def warm_up(target, cache: KVCache, tokens: int) -> None:
    """One prefill by layer of ``tokens`` tokens into the idle one-row ``cache`` (its blocks
    assigned), whose K/V are then dropped (its length set back to 0): what the first prompt by
    layer would otherwise pay once, on the same path with the same layouts (the kernels specialise
    on the length: ``ChunkedPrefill.warm_tokens`` holds one of each kind). A process's first
    causal attention sets cuDNN up, its first of a length that is a multiple of 128, and of one
    that is not, builds a kernel (``ChunkedPrefill.prepare_by_layer`` warms both); each new prompt
    length still builds a cuDNN plan (docs/benchmarks.md has the times)."""
    ids = torch.zeros(1, tokens, dtype=torch.long, device=target.device)
    try:
        prefill_by_layer(target, ids, cache)
    finally:
        cache.lengths.zero_()


@torch.inference_mode()
def prefill_by_layer(target, input_ids: torch.Tensor, cache: KVCache, piece: int = 8192) -> torch.Tensor:
    """Appends the prompt input_ids [1, T] (every token real) to the one-row ``cache`` after the
    tokens it holds, layer by layer, projections and MLP ``piece`` tokens at a time. Returns the
    logits [1, V] after its last token. (Batches of prompts: one call per row.)"""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or cache.batch_size != 1:
        raise ValueError(f"prefill_by_layer takes one row: input_ids [1, T] and a one-row cache, got "
                         f"{tuple(input_ids.shape)} and {cache.batch_size} rows")
    check_supported(target.config)
    if piece < 1:
        raise ValueError(f"piece must be >= 1 tokens, got {piece}")
    t = input_ids.shape[1]
    cache.check_room(t)
    start = int(cache.lengths[0])  # one host sync per prompt
    device = input_ids.device
    positions = torch.arange(start, start + t, device=device)[None]
    rope_len = torch.tensor([start + t], device=device)  # dynamic NTK: the prompt-level base
    x = target.embed(input_ids)  # [1, T, H], updated in place piece by piece
    cos, sin = (c.to(x.dtype) for c in target.rotary(positions, rope_len))
    slots = cache.physical(cache.new_slots(t))  # [1, T] pool slots of the prompt's K/V
    pieces = [slice(a, min(a + piece, t)) for a in range(0, t, piece)]
    queries = None  # [1, T, Hq, D]: the layer's queries of the whole prompt (one buffer for every layer)
    for i, layer in enumerate(target.model.layers):
        attn = layer.self_attn
        k_layer, v_layer = cache.pool.k[i], cache.pool.v[i]
        for p in pieces:
            q, k, v = attn.rotated_qkv(layer.input_layernorm(x[:, p]), cos[:, p], sin[:, p],
                                       getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
            store_kv(k_layer, v_layer, k, v, slots[:, p])
            if queries is None:
                queries = q.new_empty(1, t, q.shape[1], q.shape[3])
            queries[:, p] = q.transpose(1, 2)
        k_all, v_all = cache.layer(i).dense(start + t)  # a strided view of the pool for dense rows
        o = grouped_causal_attention(queries, k_all, v_all)  # [1, T, Hq, D]
        for p in pieces:
            h = x[:, p] + attn.o_proj(o[:, p].to(x.dtype).reshape(1, p.stop - p.start, -1))
            x[:, p] = h + layer.mlp(layer.post_attention_layernorm(h))
        del o
        progress.report((i + 1) / len(target.model.layers), device)
    cache.advance(torch.full((1,), t, dtype=torch.long, device=device))
    return target.logits(target.final_norm(x[:, -1]))
