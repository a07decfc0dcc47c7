"""The decoder's layers, as :class:`~longspec.models.target.TargetModel` stacks them and the
draft (:mod:`longspec.models.draft`) reuses their norm, projections and MLP: RMSNorm, the gated MLP
(SwiGLU or GeGLU), the attention block over the KV pool and the pre-norm decoder layer, with
Gemma 3's variations as config flags (``1 + w`` norms in float32, sandwich norms, q/k norms, its
softmax scale). Parameter names follow Hugging Face's. Linear layers that share their input run
as one matrix product (:func:`fuse_linears`); with a tensor-parallel ``shard`` a layer holds its
rank's heads and columns. Apart from the model so that :func:`run_layer`, the function compiled
steps compile (:mod:`longspec.models.compiled`), imports no model.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..attention import AttentionMeta, attend
from ..config import ModelConfig
from ..kv.cache import store_kv
from ..parallel.sharding import RowParallelLinear, VocabParallelEmbedding
from .rope import apply_rotary


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


# on a CPU, products over at most this many rows run as weight @ x^T (see :func:`linear`)
CPU_FEW_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] -> x @ weight [N, K]^T + bias: ``F.linear``, except for inference on a CPU over
    at most :data:`CPU_FEW_ROWS` rows (a decode step, a short verify), where it runs as
    ``weight @ x^T`` (one row: two, the second a copy): MKL's product with one row (its
    matrix-vector path) and with 2-4 rows reads the weight from memory well below the rate this
    form reaches, and a decode step is mostly such products (docs/benchmarks.md, "Products over
    few rows")."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type != "cpu" or not 0 < rows <= CPU_FEW_ROWS or torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(weight, (flat if rows > 1 else torch.cat([flat, flat])).t()).t()[:rows].contiguous()
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` of a linear layer, through :func:`linear` where it is a plain ``nn.Linear``."""
    return linear(x, module.weight, module.bias) if type(module) is nn.Linear else module(x)


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


def column_major(w: torch.Tensor) -> torch.Tensor:
    """A copy of ``w`` [N, K] stored as its transpose's rows (strides (1, N)): the same values and
    shape, the form :func:`hold_transposed` gives a weight."""
    return w.t().contiguous().t()


def hold_transposed(model: nn.Module) -> None:
    """Stores every linear layer's weight [N, K] of ``model`` as its transpose's rows ([K, N]
    contiguous, strides (1, K)): the same values and shape, so ``F.linear`` hands cuBLAS a
    row-major [K, N] operand, the form it runs faster over a decode or verify step's few rows
    (docs/benchmarks.md, "The products in other forms"). A fused product's layers
    (:func:`fuse_linears`) stay views of its one weight; a weight shared with an embedding (a tied
    head) stays as it is (a row lookup would read it strided), and so does a weight with no room
    on its device for the copy each takes in turn. For inference on CUDA, after fusing; a second
    call changes nothing."""
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}

    def transposed(w: torch.Tensor) -> torch.Tensor:
        try:
            return column_major(w)
        except torch.cuda.OutOfMemoryError:
            return w

    fused_weights = set()  # (storages of fused weights: their layers' views never move alone)
    with torch.no_grad():
        for module in model.modules():
            fused = getattr(module, "_fused", None)
            if fused is not None:
                fused_weights.add(fused[0].untyped_storage().data_ptr())
            if fused is None or fused[0].stride(0) == 1:
                continue
            weight, rows = transposed(fused[0]), fused[0].stride(0)
            if weight is fused[0]:
                continue
            for m in module.children():  # the fused layers: views of fused[0], at their first row
                if isinstance(m, nn.Linear) and m.weight.untyped_storage().data_ptr() == \
                        fused[0].untyped_storage().data_ptr():
                    start = (m.weight.data_ptr() - fused[0].data_ptr()) // (m.weight.element_size() * rows)
                    m.weight.data = weight[start:start + m.weight.shape[0]]
            module._fused = (weight, fused[1])
        for module in model.modules():
            w = module.weight if isinstance(module, nn.Linear) else None
            if (w is not None and w.dim() == 2 and w.is_contiguous() and w.data_ptr() not in embeddings
                    and w.untyped_storage().data_ptr() not in fused_weights):
                w.data = transposed(w.data)


def fused_linear(x: torch.Tensor, linears: list, fused: Optional[tuple]):
    """``[m(x) for m in linears]`` in one product when ``fused`` (from :func:`fuse_linears`) still
    holds the layers' parameters and no gradient is needed: then one tensor [..., sum of outputs]
    is returned, else a list."""
    if not fusion_intact(linears, fused) or (torch.is_grad_enabled() and linears[0].weight.requires_grad):
        return [m(x) for m in linears]
    return linear(x, fused[0], fused[1])


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
        return project(self.down_proj, self.act(gate) * up)


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
        return project(self.o_proj, o.to(x.dtype).transpose(1, 2).reshape(b, t, -1))


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
    version serves every layer (:func:`~longspec.models.compiled.compiled_layer`)."""
    return layer(x, cos, sin, k_layer, v_layer, meta)


class DecoderStack(nn.Module):
    """``model.*`` of a HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, shard=None):
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if shard is None else
                             VocabParallelEmbedding(shard, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
