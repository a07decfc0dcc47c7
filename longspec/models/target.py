"""One generic Llama-family decoder (Llama 2/3/3.1, Vicuna, LongChat, Mistral, Qwen2/2.5, Qwen3,
Gemma 3 as config flags) running on the static :class:`~longspec.kv.cache.KVCache`.

Gemma 3 is the same block with flags: (1 + w) RMSNorms in float32, four norms per block (after
attention, around the MLP), GeGLU, q/k norms, embeddings times sqrt(hidden), its own softmax scale,
and interleaved sliding-window layers with a RoPE base of their own.

Parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so
checkpoints load without renaming. Three forward modes share one code path:

* ``prefill``: a whole (right-padded) prompt per row, causal, in chunks;
* ``decode``: one token per row;
* ``verify``: M tokens per row at explicit positions under an M x M tree mask; every token sees the
  whole cached prefix plus the tree tokens the mask allows. Nothing is committed: the caller
  keeps the accepted tokens with ``KVCache.commit``.

The layers are in :mod:`longspec.models.layers`; fixed-shape steps run them (and their inputs)
through ``torch.compile`` with :mod:`longspec.models.compiled`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from ..attention import AttentionMeta
from ..attention.backend import TRITON_CAUSAL_MAX_TOKENS
from ..config import ModelConfig
from ..kv.cache import KVCache
from ..parallel.sharding import VocabParallelHead
from . import progress
from .compiled import compiled_inputs, compiled_layer, step_inputs
from .layers import DecoderStack, fusion_intact, project, run_layer
from .rope import RotaryEmbedding


class TargetModel(nn.Module):
    """The target LLM. Build with :func:`longspec.load_target`; see the module docstring.

    ``shard`` (a :class:`~longspec.parallel.Shard`): this process is one rank of a tensor-parallel
    group and holds only its share of the weights and of the KV heads (:attr:`cache_config`); its
    embeddings, hidden states and logits are whole, the same on every rank."""

    def __init__(self, cfg: ModelConfig, shard=None):
        super().__init__()
        self.config, self.shard = cfg, shard
        self.model = DecoderStack(cfg, shard)
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if shard is None else
                        VocabParallelHead(shard, cfg.hidden_size, cfg.vocab_size))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.build_rotary()
        self.path: Optional[str] = None  # checkpoint directory (for the tokenizer)
        # attention of fixed-shape steps: "sdpa", "matmul", "triton" (load_target's default on CUDA) or
        # "reference" (the oracle)
        self.attention_impl = "sdpa"
        # fixed-shape steps run each layer through torch.compile (load_target's default on CUDA)
        self.compile_steps = False
        # what this process keeps for the model while it lives (its engines, their drafts and
        # proposers: longspec.decoding.shared.Engines), made on first use
        self.engines = None

    def build_rotary(self, device=None) -> None:
        """The RoPE modules: ``rotary`` (every layer, or the global ones) and ``rotary_local`` (the
        sliding-window layers, when their RoPE differs; else the same module)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings).to(device)
        self.rotary_local = self.rotary if cfg.rope_local is None else RotaryEmbedding(
            cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings).to(device)

    @property
    def last_layer_rotary(self) -> RotaryEmbedding:
        """The RoPE of the last layer (whose cached keys the draft's cross-attention reads)."""
        return self.rotary_local if self.config.is_sliding(-1) else self.rotary

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def fuse_projections(self) -> None:
        """q/k/v and gate/up of every layer in one matrix product each (parameters become views of
        the fused weights; names and checkpoints are unchanged)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def cache_config(self) -> ModelConfig:
        """The config the KV cache is sized by: this rank's KV heads under tensor parallelism."""
        if self.shard is None:
            return self.config
        return dataclasses.replace(self.config, num_kv_heads=self.shard.n_kv)

    @property
    def fused(self) -> bool:
        """Whether every layer's fused projections still hold its parameters."""
        return all(fusion_intact([a.q_proj, a.k_proj, a.v_proj], a._fused) and
                   fusion_intact([m.gate_proj, m.up_proj], m._fused)
                   for a, m in ((layer.self_attn, layer.mlp) for layer in self.model.layers))

    def new_cache(self, batch_size: int, max_len: int, pool=None, paged: bool = False, allocator=None) -> KVCache:
        """A KV cache of ``batch_size`` rows of ``max_len`` slots: its own dense pool, or rows
        over a shared :class:`~longspec.kv.cache.BlockPool` (``pool``; ``paged``: read through the
        block table even where the pool has a block for every row; ``allocator``: what hands the
        pool's blocks out, if not the pool itself)."""
        return KVCache(self.cache_config, batch_size, max_len, self.dtype, self.device, pool=pool, paged=paged,
                       allocator=allocator)

    # the small interface a draft reads the target through
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> embeddings [..., H] (Gemma: times sqrt(H) rounded to the weights'
        dtype, as transformers computes it)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is None:
            return x
        return x * float(torch.tensor(self.config.embed_scale, dtype=x.dtype, device="cpu"))  # (a host number)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (after the final norm) -> float32 logits [..., V] (soft-capped to
        ``cap * tanh(logits / cap)`` when the config says so)."""
        logits = project(self.lm_head, hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @staticmethod
    def last_layer_kv(cache: KVCache):
        """The last layer's K/V (as stored: keys already rotated), a
        :class:`~longspec.kv.cache.LayerKV` (``.dense(n)``: [B, Hkv, n, D]); under tensor
        parallelism this rank's KV heads (``shard.kv_heads``)."""
        return cache.layer(-1)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       tree_mask: torch.Tensor, rope_seq_len: Optional[torch.Tensor] = None,
                       causal: bool = False, n_keys: Optional[int] = None,
                       slot_positions: bool = True) -> torch.Tensor:
        """The shared core: input_ids, positions [B, T]; tree_mask [B or 1, T, P+T] bool over
        the P tokens already pending in the cache and these T. Writes K/V after the pending ones
        (pending, not committed) and returns the final-norm hidden states [B, T, H]. ``causal``
        says that ``tree_mask`` is the plain causal mask (lets a prefill chunk use a causal kernel).
        ``n_keys``: cache slots to attend over, fixed by the caller (no host sync, no room
        check: see :class:`~longspec.attention.AttentionMeta`); such fixed-shape steps use
        ``attention_impl``, the others (prefill chunks) PyTorch's SDPA unless it is the reference, or
        Triton for a causal chunk of at most ``TRITON_CAUSAL_MAX_TOKENS`` tokens (see there).
        ``slot_positions``: the committed tokens sit at slots equal to their positions and so do the
        new ones (False for anchor-offset positions or a StreamingLLM view: sliding-window layers then
        cut only the new tokens by position, see :meth:`AttentionMeta.windowed`)."""
        impl = self.attention_impl
        short_causal = impl == "triton" and causal and input_ids.shape[1] <= TRITON_CAUSAL_MAX_TOKENS
        if n_keys is None and impl != "reference" and not short_causal:
            impl = "sdpa"
        compiled = self.compile_steps and n_keys is not None and self.fused
        inputs = compiled_inputs() if compiled and self.shard is None else step_inputs
        x, rope, local, slots = inputs(self, input_ids, positions, cache, rope_seq_len)
        meta = AttentionMeta.build(cache, tree_mask, input_ids.shape[1], impl, causal, n_keys, slots)
        cfg = self.config
        steps = {False: (meta, *rope)}  # per layer kind (sliding or not): what its layers see
        if cfg.has_sliding_layers:
            steps[True] = (meta.windowed(positions, cfg.sliding_window, slot_positions), *local)
        run = compiled_layer() if compiled else run_layer
        for i, layer in enumerate(self.model.layers):
            step_meta, cos, sin = steps[cfg.is_sliding(i)]
            x = run(layer, x, cos, sin, cache.pool.k[i], cache.pool.v[i], step_meta)
        cache.pending += input_ids.shape[1]
        return self.final_norm(x)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, n_tokens: torch.Tensor, cache: KVCache,
                chunk_size: int = 2048, all_logits: bool = False) -> torch.Tensor:
        """Appends right-padded prompts input_ids [B, T] (row b has ``n_tokens[b] >= 1`` real
        tokens) to the cache, causally, ``chunk_size`` tokens at a time.
        Returns the logits [B, V] after each row's last token (``all_logits``: [B, T, V])."""
        b, t = input_ids.shape
        n_tokens = n_tokens.to(cache.lengths.device)
        cache.check_room(t)
        start = cache.lengths.clone()
        rope_len = start + n_tokens  # dynamic NTK: transformers' prompt-level base, per row
        last_hidden = torch.zeros(b, self.config.hidden_size, dtype=self.dtype, device=self.device)
        outputs = []
        for c0 in range(0, t, chunk_size):
            ids = input_ids[:, c0:c0 + chunk_size]
            m = ids.shape[1]
            steps = torch.arange(m, device=ids.device)
            positions = start[:, None] + c0 + steps[None, :]
            causal = steps[:, None] >= steps[None, :]
            hidden = self.forward_hidden(ids, positions, cache, causal[None], rope_len, causal=True)
            real = (n_tokens - c0).clamp(0, m)
            last = (real - 1).clamp(min=0)
            has_last = (n_tokens - 1 >= c0) & (n_tokens - 1 < c0 + m)
            picked = hidden[torch.arange(b, device=ids.device), last]
            last_hidden = torch.where(has_last[:, None], picked, last_hidden)
            if all_logits:
                outputs.append(self.logits(hidden))
            cache.advance(real)
            if t > chunk_size:
                progress.report(min(1.0, (c0 + m) / t), self.device)
        return torch.cat(outputs, 1) if all_logits else self.logits(last_hidden)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, cache: KVCache, n_keys: Optional[int] = None,
               advance: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One token per row: tokens [B] at positions ``cache.lengths``; committed (``advance``
        [B] long: 1 for rows that keep the token, 0 for rows that only compute; default all).
        Returns logits [B, V]."""
        ids = tokens.view(-1, 1)
        mask = torch.ones(1, 1, 1, dtype=torch.bool, device=ids.device)
        hidden = self.forward_hidden(ids, cache.lengths[:, None].clone(), cache, mask, n_keys=n_keys)
        cache.advance(torch.ones_like(cache.lengths) if advance is None else advance)
        return self.logits(hidden[:, 0])

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
               cache: KVCache, n_keys: Optional[int] = None) -> torch.Tensor:
        """Scores a token tree: tokens, positions [B, M]; tree_mask [B or 1, M, M] bool
        (ancestor-or-self). The tokens stay pending: follow with ``cache.commit`` (or
        ``cache.discard``). Returns logits [B, M, V]."""
        return self.logits(self.forward_hidden(tokens, positions, cache, tree_mask, n_keys=n_keys))
