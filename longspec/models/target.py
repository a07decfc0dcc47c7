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
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..attention import AttentionMeta, attend, ops
from ..attention.backend import TRITON_CAUSAL_MAX_TOKENS
from ..compile_boundary import mark_compile_boundaries, shorten_compile_failures
from ..config import ModelConfig
from ..kv.cache import KVCache, store_kv
from ..parallel.sharding import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from . import progress
from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in float32 (one fused kernel where PyTorch has one), scaled by the weight
        (in x's dtype: a float32 trained weight on bf16 activations would miss the fused kernel).
        ``plus_one`` (Gemma): scaled by ``1 + weight`` in float32, then cast to x's dtype."""
        if self.plus_one:
            return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def fuse_linears(linears: list) -> tuple:
    """Concatenates the weights (and biases) of linear layers that share their input into one
    tensor and makes each layer's parameters views of it, so one matrix product serves all of them
    and no memory is duplicated. Returns ``(weight, bias or None)``. Call outside inference mode."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = weight[start:start + n]
            if bias is not None:
                m.bias.data = bias[start:start + n]
            start += n
    return weight, bias


def fused_linear(x: torch.Tensor, linears: list, fused: Optional[tuple]):
    """``[m(x) for m in linears]`` in one product when ``fused`` (from :func:`fuse_linears`) still
    holds the layers' parameters and no gradient is needed: then one tensor [..., sum of outputs]
    is returned, else a list."""
    if not fusion_intact(linears, fused) or (torch.is_grad_enabled() and linears[0].weight.requires_grad):
        return [m(x) for m in linears]
    return F.linear(x, fused[0], fused[1])


def fusion_intact(linears: list, fused: Optional[tuple]) -> bool:
    """Whether ``fused`` still holds the layers' parameters (not after ``model.to(...)`` or a
    load that replaced them). Not checked inside ``torch.compile`` (where reading a data pointer
    breaks the graph): the compiled path checks the whole model first (``TargetModel.fused``)."""
    if fused is None:
        return False
    return torch.compiler.is_compiling() or fused[0].data_ptr() == linears[0].weight.data_ptr()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (``gelu_pytorch_tanh``). With
    a tensor-parallel ``shard``: this rank's columns of gate and up, its rows of down, summed over
    the ranks."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu", shard=None):
        super().__init__()
        self.act = ACTIVATION_FUNCTIONS[act]
        local = intermediate if shard is None else shard.n_ffn
        self.gate_proj = nn.Linear(hidden, local, bias=bias)
        self.up_proj = nn.Linear(hidden, local, bias=bias)
        self.down_proj = (nn.Linear(local, hidden, bias=bias) if shard is None else
                          RowParallelLinear(local, hidden, bias, shard.tp))
        self._fused = None

    def fuse(self) -> None:
        self._fused = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x):
        gate_up = fused_linear(x, [self.gate_proj, self.up_proj], self._fused)
        gate, up = gate_up.chunk(2, dim=-1) if torch.is_tensor(gate_up) else gate_up
        return self.down_proj(self.act(gate) * up)


class Projections(nn.Module):
    """q/k/v/o projections of a (GQA) attention block, named as in HF checkpoints."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self._fused = None

    def fuse(self) -> None:
        self._fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def rotated_qkv(self, x, cos, sin, q_norm=None, k_norm=None):
        """x [B, T, H]; cos/sin [B, T, D] -> q [B, Hq, T, D], k, v [B, Hkv, T, D], q and k rotated
        (after the per-head norms, if given). With fused projections q and k are rotated in one go."""
        b, t, _ = x.shape
        hq, hkv, d = self.n_heads, self.n_kv, self.head_dim
        cos, sin = cos[:, :, None], sin[:, :, None]
        qkv = fused_linear(x, [self.q_proj, self.k_proj, self.v_proj], self._fused)
        if torch.is_tensor(qkv) and q_norm is None:
            heads = qkv.view(b, t, hq + 2 * hkv, d)
            qk = apply_rotary(heads[:, :, :hq + hkv], cos, sin)
            q, k, v = qk[:, :, :hq], qk[:, :, hq:], heads[:, :, hq + hkv:]
        else:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1) if torch.is_tensor(qkv) else qkv
            q, k, v = q.view(b, t, hq, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class Attention(Projections):
    """With a tensor-parallel ``shard``: this rank's query heads and the KV heads they read;
    ``o_proj`` sums the ranks' shares."""

    def __init__(self, cfg: ModelConfig, shard=None):
        heads, kv_heads = (cfg.num_heads, cfg.num_kv_heads) if shard is None else (shard.n_q, shard.n_kv)
        super().__init__(cfg.hidden_size, heads, kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.o_bias)
        if shard is not None:
            self.o_proj = RowParallelLinear(heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, shard.tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_plus_one)
        # every attention path scales by 1/sqrt(head_dim): a softmax scale of 1/sqrt(s) instead is
        # a factor on the queries (Gemma's query_pre_attn_scalar s; 1 when s == head_dim)
        s = cfg.query_pre_attn_scalar
        self.q_factor = 1.0 if s is None else (cfg.head_dim / s) ** 0.5

    def forward(self, x, cos, sin, k_layer, v_layer, meta: AttentionMeta):
        """x [B, T, H]; cos/sin [B, T, D]; k_layer, v_layer [Hkv, P, D]: this layer of the KV
        pool; ``meta``: where the new tokens go and what they see -> [B, T, H]."""
        q, k, v = self.rotated_qkv(x, cos, sin, getattr(self, "q_norm", None), getattr(self, "k_norm", None))
        if self.q_factor != 1.0:
            q = q * self.q_factor
        store_kv(k_layer, v_layer, k, v, meta.slots)
        o = attend(q, k_layer, v_layer, meta)
        b, _, t, _ = o.shape
        return self.o_proj(o.to(x.dtype).transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block. ``sandwich_norms`` (Gemma): ``post_attention_layernorm`` normalises the
    attention's output (not the MLP's input, as in Llama), ``pre_feedforward_layernorm`` the MLP's
    input and ``post_feedforward_layernorm`` its output."""

    def __init__(self, cfg: ModelConfig, shard=None):
        super().__init__()
        h, eps, plus_one = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one
        self.input_layernorm = RMSNorm(h, eps, plus_one)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(h, eps, plus_one)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, plus_one)
            self.post_feedforward_layernorm = RMSNorm(h, eps, plus_one)
        self.sandwich = cfg.sandwich_norms
        self.mlp = MLP(h, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, shard)

    def forward(self, x, cos, sin, k_layer, v_layer, meta):
        o = self.self_attn(self.input_layernorm(x), cos, sin, k_layer, v_layer, meta)
        if not self.sandwich:
            x = x + o
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(o)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def run_layer(layer: DecoderLayer, x, cos, sin, k_layer, v_layer, meta):
    """One decoder layer (see :meth:`DecoderLayer.forward`); a plain function so that one compiled
    version serves every layer (:func:`compiled_layer`)."""
    return layer(x, cos, sin, k_layer, v_layer, meta)


_COMPILED: dict = {}


def compile_step(fn):
    """``torch.compile`` as fixed-shape steps use it: static shapes, Inductor (the environment
    variable ``LONGSPEC_COMPILE_BACKEND`` picks another backend, e.g. ``aot_eager`` in CPU tests).
    Each new shape compiles once (seconds); the recompilation limit is raised for the few shapes
    an engine uses (decode, verify, each draft level, each batch size). Where compilation is not
    possible (no Triton for Inductor, an unsupported Python, a compiler error) the step runs
    uncompiled, with a warning: the same results, slower."""
    import torch._dynamo


    mark_compile_boundaries()
    shorten_compile_failures()

    ops.register()  # (after the boundaries: the attention kernels become operators, not graph breaks)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    try:
        compiled = torch.compile(fn, dynamic=False, backend=os.environ.get("LONGSPEC_COMPILE_BACKEND", "inductor"),
                                 mode=os.environ.get("LONGSPEC_COMPILE_MODE"))
    except RuntimeError as err:  # e.g. Dynamo does not support this Python version
        _compile_failed(err)
        return fn

    def step(*args, **kwargs):
        # a frame that fails to compile runs eagerly (Dynamo's own fallback: nothing runs twice)
        with torch._dynamo.config.patch(suppress_errors=True):
            return compiled(*args, **kwargs)

    return step


def compile_counts() -> dict:
    """What ``torch.compile`` has made in this process so far: ``graphs`` (Dynamo's), ``loaded``
    (taken whole from the on-disk cache: AOTAutograd cache hits), ``traced`` (traced again by
    AOTAutograd: its cache missed, or cannot hold the graph) and ``compiled`` (code Inductor
    generated: missed by its FX graph cache, or not cacheable). All 0 before anything is compiled;
    ``loaded`` and ``traced`` stay 0 for backends other than Inductor."""
    utils = sys.modules.get("torch._dynamo.utils")  # (not imported: nothing compiled; importing costs seconds)
    if utils is None:
        return dict.fromkeys(("graphs", "loaded", "traced", "compiled"), 0)
    aot, counters = utils.counters["aot_autograd"], utils.counters
    return {"graphs": counters["stats"]["unique_graphs"], "loaded": aot["autograd_cache_hit"],
            "traced": aot["autograd_cache_miss"] + aot["autograd_cache_bypass"],
            "compiled": counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]}


def _compile_failed(err: Exception) -> None:
    import warnings

    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    warnings.warn(f"torch.compile is not available here, steps run uncompiled ({first_line})", stacklevel=3)


def step_inputs(model: "TargetModel", input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rope_seq_len: Optional[torch.Tensor]) -> tuple:
    """What a step's layers take besides the cache: the embeddings [B, T, H], the rotary tables
    (cos, sin) [B, T, D] of the full-attention layers and of the sliding ones (the same pair where
    they share one), in the model's dtype, and the new tokens' physical slots [B, T]."""
    x = model.embed(input_ids)
    rope = tuple(c.to(x.dtype) for c in model.rotary(positions, rope_seq_len))
    local = rope
    if model.config.has_sliding_layers and model.rotary_local is not model.rotary:
        local = tuple(c.to(x.dtype) for c in model.rotary_local(positions, rope_seq_len))
    return x, rope, local, cache.physical(cache.new_slots(input_ids.shape[1]))


def compiled_inputs():
    """:func:`step_inputs` through :func:`compile_step`: a few kernels a step instead of a small
    one for each operation (the slots' arithmetic, the table lookup, the rotary tables'
    trigonometry and casts), which a captured step replays one after another."""
    if "inputs" not in _COMPILED:
        _COMPILED["inputs"] = compile_step(step_inputs)
    return _COMPILED["inputs"]


def compiled_layer():
    """``run_layer`` through :func:`compile_step`: Inductor fuses the norms, RoPE, the cache write,
    the attention's softmax and SwiGLU into a few kernels (matrix products stay cuBLAS); one
    compiled version per step shape serves every layer of every model."""
    if "layer" not in _COMPILED:
        _COMPILED["layer"] = compile_step(run_layer)
    return _COMPILED["layer"]


class DecoderStack(nn.Module):
    """``model.*`` of a HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, shard=None):
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if shard is None else
                             VocabParallelEmbedding(shard, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)


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
        logits = self.lm_head(hidden).float()
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
