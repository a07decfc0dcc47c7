"""The LongSpec draft: one decoder block on top of the target's token embedding, sharing the
target's embedding, final norm and LM head (frozen, never copied). In order, each with a
pre-RMSNorm and a residual:

* sliding-window self-attention (window ``W``) over the draft's own tokens, RoPE at their true
  positions; at inference its K/V live in a ring buffer of ``W + tree_size`` slots
  (:class:`DraftCache`), whose size never depends on the context;
* cross-attention into the target's last-layer KV cache exactly as the target stored it (already
  rotated): only ``q_proj`` (+ RoPE at the query's position) and ``o_proj``;
* a SwiGLU MLP.

Two forward paths share the weights: ``forward_train`` (teacher-forced chunk, noisy lag ``g``:
query ``t`` sees target KV ``0..t-g``; the first ``g`` queries get a zero cross-attention output)
and ``forward_step`` (incremental, over a :class:`DraftCache`). A test pins that they agree.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..attention import attend_masked, attend_prefix
from ..attention.fast import masked_attention
from ..kv.cache import DraftCache  # noqa: F401  (re-exported: the draft's ring buffer)
from ..config import ModelConfig
from .rope import apply_rotary
from .layers import MLP, Projections, RMSNorm, column_major
from .target import TargetModel


@dataclass
class DraftConfig:
    """Architecture of a draft; head counts, head_dim and hidden size follow the target."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    window: int = 512
    qkv_bias: bool = True  # as in the published LongSpec checkpoints
    cross_q_bias: bool = False
    target_architecture: str = ""
    target_model_type: str = ""
    target_embedding_sample: list = field(default_factory=list)  # fingerprint, see embedding_sample
    rope: Optional[dict] = None  # informational: the target's RoPE (the draft always uses the target's)
    # the target's final RMSNorm before the shared LM head: ours are trained with it; the published
    # LongSpec drafts apply the LM head to the block's output directly (their code does)
    head_norm: bool = True
    # > 0: the draft scores only this many tokens (the most frequent of its training data, kept in
    # the ``vocab_subset`` buffer; FR-Spec style); verification still covers the full vocabulary
    draft_vocab: int = 0
    # measured top-k hit rates per tree depth (rows) and width (``spec.acceptance.ACCEPTANCE_WIDTHS``)
    # on held-out text: what ``--proposer auto`` predicts acceptance from
    acceptance: list = field(default_factory=list)

    @classmethod
    def for_target(cls, target: TargetModel, window: int = 512, **overrides) -> "DraftConfig":
        c: ModelConfig = target.config
        config = cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                     rms_norm_eps=c.rms_norm_eps, window=window,
                     target_architecture=ARCH_NAMES.get(c.model_type, c.model_type),
                     target_model_type=c.model_type, target_embedding_sample=embedding_sample(target),
                     rope=asdict(c.rope))
        for key, value in overrides.items():
            setattr(config, key, value)
        return config

    def check_target(self, target: TargetModel) -> None:
        """Raises ValueError when ``target`` is not the model this draft was built for."""
        c = target.config
        for name, mine, theirs in (("hidden_size", self.hidden_size, c.hidden_size),
                                   ("vocab_size", self.vocab_size, c.vocab_size),
                                   ("num_heads", self.num_heads, c.num_heads),
                                   ("num_kv_heads", self.num_kv_heads, c.num_kv_heads),
                                   ("head_dim", self.head_dim, c.head_dim)):
            if mine != theirs:
                raise ValueError(f"draft/target mismatch: the draft was built for {name}={mine}, "
                                 f"the target has {theirs}")
        if self.target_model_type and self.target_model_type != c.model_type:
            raise ValueError(f"draft/target mismatch: the draft was built for a {self.target_model_type} "
                             f"target, this one is {c.model_type}")
        if self.target_embedding_sample:
            ours = torch.tensor(self.target_embedding_sample, device="cpu")
            theirs = torch.tensor(embedding_sample(target), device="cpu")
            if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=2e-2, atol=2e-2 * ours.abs().max()):
                raise ValueError("draft/target mismatch: the target's token embedding differs from the one the "
                                 "draft was trained with (different checkpoint?)")


ARCH_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def embedding_sample(target: TargetModel, rows: int = 8, cols: int = 8) -> list:
    """A dtype-robust fingerprint of the target's embedding: ``rows`` evenly spaced rows, first
    ``cols`` values each (float, 5 significant digits)."""
    vocab = target.config.vocab_size
    idx = torch.linspace(0, vocab - 1, rows, device=target.device).round().long()
    with torch.no_grad():  # through the lookup: whole rows under tensor parallelism too
        sample = target.embed(idx)[:, :cols]
    return [float(f"{x:.5g}") for x in sample.float().flatten().tolist()]


class CrossAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.cross_q_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, n, d).transpose(1, 2)


def _merge_heads(o: torch.Tensor, dtype) -> torch.Tensor:
    b, h, t, d = o.shape
    return o.to(dtype).transpose(1, 2).reshape(b, t, h * d)


class LongSpecDraft(nn.Module):
    """The draft block. ``target`` is referenced, not registered: its weights are shared and
    never saved with the draft."""

    def __init__(self, config: DraftConfig, target: TargetModel):
        super().__init__()
        config.check_target(target)
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Projections(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                     qkv_bias=config.qkv_bias, o_bias=False)
        self.post_self_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn = CrossAttention(config)
        self.post_cross_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=False)
        object.__setattr__(self, "target", target)  # shared, not a submodule
        if config.draft_vocab:
            self.register_buffer("vocab_subset", torch.zeros(config.draft_vocab, dtype=torch.long))
        self._head_rows = None  # (subset, weight rows) cache

    def limit_vocab(self, token_ids) -> None:
        """Scores only ``token_ids`` when drafting (e.g. :func:`frequent_tokens` of the training
        data). The output stays exact: the target verifies over its whole vocabulary."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"a draft vocabulary needs token ids in [0, {self.config.vocab_size})")
        device = self.target.lm_head.weight.device
        if "vocab_subset" in self._buffers:
            del self._buffers["vocab_subset"]
        self.register_buffer("vocab_subset", ids.to(device))
        self.config.draft_vocab, self._head_rows = ids.numel(), None

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the shared LM head is applied to: the target's final norm of ``hidden`` when
        ``config.head_norm``, else ``hidden`` itself."""
        return self.target.final_norm(hidden) if self.config.head_norm else hidden

    @property
    def head_copy_nbytes(self) -> int:
        """Bytes of the reduced vocabulary's head rows, copied on first use (0 before / without)."""
        return 0 if self._head_rows is None else self._head_rows[1].nbytes

    def logits(self, hidden: torch.Tensor, reduced: bool = False, compact: bool = False) -> torch.Tensor:
        """Draft hidden [..., H] -> float32 logits [..., V] through the target's LM head (after its
        final norm when ``config.head_norm``, as our drafts are trained; published drafts have
        none). ``reduced`` (drafting) with a reduced vocabulary: only those rows of the head are
        computed, the other tokens get -inf; with ``compact`` too, only their scores
        [..., V_draft] (the tokens of ``vocab_subset``) are returned. Training always scores the
        whole vocabulary."""
        h = self.head_input(hidden)
        if reduced and self.config.draft_vocab and self.target.shard is not None:
            # the head's rows are spread over the ranks: every score, the others masked
            keep = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=h.device)
            return self.target.logits(h).masked_fill(~keep.index_fill(0, self.vocab_subset, True), float("-inf"))
        if not (reduced and self.config.draft_vocab):
            return self.target.logits(h)
        scores = F.linear(h, self.reduced_head()).float()
        if compact:
            return scores
        full = torch.full((*h.shape[:-1], self.config.vocab_size), float("-inf"), device=h.device)
        return full.scatter(-1, self.vocab_subset.expand(*h.shape[:-1], -1), scores)

    def reduced_head(self, check: bool = False) -> torch.Tensor:
        """The LM head's rows of the reduced vocabulary [V_draft, H], copied on first use. A
        proposer takes them (``check``: copied again if the target's head has moved or changed
        dtype since) before its rounds are compiled: a compiled round that copied them would be
        a graph no later round matches (compiled again in every process)."""
        subset, weight = self.vocab_subset, self.target.lm_head.weight
        rows = self._head_rows
        source = (weight.data_ptr(), weight.dtype, weight.device)  # where the rows were copied from
        if rows is None or rows[0] is not subset or (check and rows[2] != source):
            copy = weight.detach()[subset]  # (row-major; a head held transposed: its rows so too)
            self._head_rows = (subset, column_major(copy) if weight.stride(0) == 1 else copy, source)
        return self._head_rows[1]

    def _qkv(self, x, positions):
        cos, sin = (c.to(x.dtype) for c in self.target.last_layer_rotary(positions))
        q, k, v = self.self_attn.rotated_qkv(self.input_layernorm(x), cos, sin)
        return q, k, v, cos, sin

    def _cross_query(self, x, cos, sin):
        c = self.config
        return apply_rotary(_heads(self.cross_attn.q_proj(self.post_self_attention_layernorm(x)),
                                   c.num_heads, c.head_dim), cos[:, None], sin[:, None])

    def fuse_projections(self) -> None:
        """One product for q/k/v and one for gate/up at inference (training keeps them apart)."""
        self.self_attn.fuse()
        self.mlp.fuse()

    def _finish(self, x, cross_o):
        shard = self.target.shard
        if shard is not None and cross_o.shape[1] == shard.n_q < self.config.num_heads:
            x = x + shard.tp.all_reduce(F.linear(_merge_heads(cross_o, x.dtype), self._cross_o_share(shard)))
        else:
            x = x + self.cross_attn.o_proj(_merge_heads(cross_o, x.dtype))
        return x + self.mlp(self.post_cross_attention_layernorm(x))

    def _cross_o_share(self, shard) -> torch.Tensor:
        """The columns of the cross-attention's ``o_proj`` for this rank's query heads
        [H, n_q * D] (copied once per weight)."""
        w = self.cross_attn.o_proj.weight
        if getattr(self, "_o_share", (None,))[0] is not w:
            d = self.config.head_dim
            self._o_share = (w, w.detach()[:, shard.q_heads[0] * d:shard.q_heads[1] * d].contiguous())
        return self._o_share[1]

    def forward_train(self, input_ids, positions, target_k, target_v, lag: int = 1) -> torch.Tensor:
        """Teacher-forced chunk. input_ids, positions [B, T]; target_k, target_v [B, Hkv, T, D]: the
        target's last-layer K/V for the same tokens and positions; ``lag`` g >= 1: query t sees
        target KV 0..t-g (a shifted causal attention, no dense mask). Self-attention is causal
        within a window of W tokens. Returns the draft hidden states [B, T, H]."""
        b, t = input_ids.shape
        x = self.target.embed(input_ids)
        q, k, v, cos, sin = self._qkv(x, positions)
        idx = torch.arange(t, device=x.device)
        window = (idx[:, None] >= idx[None, :]) & (idx[:, None] - idx[None, :] < self.config.window)
        o = masked_attention(q, k, v, window[None])  # on CUDA off SDPA's math path (masked + GQA)
        x = x + self.self_attn.o_proj(_merge_heads(o, x.dtype))
        cq = self._cross_query(x, cos, sin)
        cross = torch.zeros_like(cq)
        if lag < t:
            cross[:, :, lag:] = F.scaled_dot_product_attention(
                cq[:, :, lag:], target_k[:, :, :t - lag].to(cq.dtype), target_v[:, :, :t - lag].to(cq.dtype),
                is_causal=True, enable_gqa=True)
        return self._finish(x, cross)

    def forward_step(self, input_ids, positions, index, node, valid, cache: DraftCache, target_kv,
                     cross_limit, tree_mask=None, slot=None, cross_keys=None) -> torch.Tensor:
        """Incremental forward. input_ids, positions, index (sequence index: the token's slot in
        the target cache, for a tree node root index + depth), node (-1 for committed tokens, else
        tree node number) and valid: [B, T]; target_kv: the target cache's last layer (a
        :class:`~longspec.kv.cache.LayerKV`); cross_limit [B, T]: target slots ``0..limit-1`` visible to each query; tree_mask
        [B, T, N] for pending nodes; slot: see ``DraftCache.write``; cross_keys: target slots the
        cross-attention reads at most (default: the cache's capacity; ``cross_limit`` must not pass it). Writes this step's K/V into
        ``cache`` first. Returns hidden [B, T, H]."""
        x = self.target.embed(input_ids)
        q, k, v, cos, sin = self._qkv(x, positions)
        cache.write(k, v, index, node, valid, slot)
        impl = self.target.attention_impl
        o = attend_masked(q, cache.k, cache.v, cache.visibility(index, node, tree_mask), impl, may_be_empty=True)
        x = x + self.self_attn.o_proj(_merge_heads(o, x.dtype))
        cq = self._cross_query(x, cos, sin)
        shard = self.target.shard
        if shard is not None:  # the target's KV heads are spread over the ranks: this rank's query
            # heads over its KV heads; _finish sums the ranks' shares of o_proj (as the target's layers do)
            cq = cq[:, shard.q_heads[0]:shard.q_heads[1]]
        cross = attend_prefix(cq, target_kv, cross_limit, impl, cross_keys)
        return self._finish(x, cross)

    def window_kv(self, input_ids, positions):
        """Self-attention K/V [B, Hkv, T, D] of committed tokens. Exact without running the block:
        in a one-block draft they depend on the token and its position only."""
        x = self.target.embed(input_ids)
        return self._qkv(x, positions)[1:3]


def init_draft(config: DraftConfig, target: TargetModel, seed: int = 0) -> LongSpecDraft:
    """A freshly initialised draft (std 0.02 linear weights, zero biases, unit norms), on the
    target's device and dtype."""
    torch.manual_seed(seed)
    draft = LongSpecDraft(config, target)
    for name, p in draft.named_parameters():
        with torch.no_grad():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return draft.to(device=target.device, dtype=target.dtype)
