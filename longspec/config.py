"""Dataclass configurations: the target model's architecture (parsed from a Hugging Face
``config.json``) and generation settings. Every unsupported option raises a ``ValueError`` that
names it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

# supported HF architecture names -> model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}
MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3"}  # read for their text model's config
MODEL_TYPES = set(ARCHITECTURES.values())
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; GeGLU with the tanh GELU (Gemma)
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass
class RopeConfig:
    """RoPE parameters, in the form transformers standardises them to (``rope_parameters``)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: Optional[float] = None  # yarn
    mscale: Optional[float] = None  # yarn
    mscale_all_dim: Optional[float] = None  # yarn
    truncate: bool = True  # yarn

    @classmethod
    def from_hf(cls, cfg: dict) -> "RopeConfig":
        """Reads ``rope_parameters`` (new format) or ``rope_theta`` + ``rope_scaling`` (hub format,
        with ``type`` or ``rope_type``)."""
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type RoPE parameters are not supported")
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("unsupported RoPE option partial_rotary_factor != 1")
        rope = cls(rope_type=rope_type, theta=float(theta))
        if rope_type != "default":
            factor = params.get("factor")
            if factor is None and rope_type != "yarn":
                raise ValueError(f"RoPE scaling {rope_type!r} needs a 'factor'")
            rope.factor = None if factor is None else float(factor)
        if rope_type in ("llama3", "yarn"):
            rope.original_max_position_embeddings = int(
                cfg.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or cfg["max_position_embeddings"]
            )
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                if key not in params:
                    raise ValueError(f"RoPE scaling 'llama3' needs {key!r}")
                setattr(rope, key, float(params[key]))
        if rope_type == "yarn":
            if rope.factor is None:
                rope.factor = cfg["max_position_embeddings"] / rope.original_max_position_embeddings
            rope.beta_fast = float(params.get("beta_fast") or 32)
            rope.beta_slow = float(params.get("beta_slow") or 1)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if params.get(key) is not None:
                    setattr(rope, key, float(params[key]))
            rope.truncate = bool(params.get("truncate", True))
        return rope


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder. One model class serves every family through flags."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    # sliding-window attention: query at position p sees keys at positions p - sliding_window + 1 .. p
    # in the layers whose ``layer_types`` entry is "sliding_attention" (the others see everything)
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple] = None  # per layer: "sliding_attention" / "full_attention"; None: all full
    rope_local: Optional[RopeConfig] = None  # RoPE of the sliding layers when it differs (Gemma 3: 10k base)
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight), all in float32
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP (four per block)
    embed_scale: Optional[float] = None  # Gemma: embeddings times sqrt(hidden), rounded to the model's dtype
    query_pre_attn_scalar: Optional[float] = None  # softmax scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    final_logit_softcapping: Optional[float] = None  # logits -> cap * tanh(logits / cap)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list]] = None

    @property
    def eos_token_ids(self) -> list:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` (an index; -1 the last) attends within ``sliding_window`` only."""
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    @property
    def has_sliding_layers(self) -> bool:
        return self.layer_types is not None and SLIDING in self.layer_types

    def check(self) -> None:
        """Raises ValueError naming the first field that no model can have (a size that is not
        positive, a RoPE base or norm epsilon that is not a positive finite number)."""
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
                 "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_heads,
                 "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "max_position_embeddings": self.max_position_embeddings}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value}")
        for name, value in (("rope_theta", self.rope.theta), ("rms_norm_eps", self.rms_norm_eps)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"config.json: {name} must be a positive finite number, got {value}")

    def parameter_count(self) -> int:
        """The number of weights this architecture has (embeddings, attention, MLP, norms, head)."""
        h, hd = self.hidden_size, self.head_dim
        attention = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + (2 * hd if self.qk_norm else 0)
        layer = attention + 3 * h * self.intermediate_size + (4 if self.sandwich_norms else 2) * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Builds the config from a parsed Hugging Face ``config.json``."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, not a {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") in MULTIMODAL.values() and isinstance(cfg.get("text_config"), dict):
            # a multimodal checkpoint: its text model (the weights are read under its prefix)
            text = cfg["text_config"]
            cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), **text,
                   "model_type": text.get("model_type", "gemma3_text"), "architectures": ["Gemma3ForCausalLM"]}
            archs = cfg["architectures"]
        model_type = cfg.get("model_type")
        unknown = [a for a in archs if a not in ARCHITECTURES]
        if unknown or model_type not in MODEL_TYPES:
            what = f"architecture {unknown[0]!r}" if unknown else f"model_type {model_type!r}"
            raise ValueError(
                f"unsupported {what}; longspec supports {', '.join(ARCHITECTURES)} "
                f"(model_type {', '.join(sorted(MODEL_TYPES))})"
            )
        gemma = model_type == "gemma3_text"
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r} (supported: {', '.join(ACTIVATIONS)})")
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("unsupported attn_logit_softcapping (Gemma 2 style attention soft-capping); "
                             "Gemma 3 has none")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("unsupported use_bidirectional_attention: longspec decodes causal models")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            attention_bias = bool(cfg.get("attention_bias", False))
            layers = int(cfg["num_hidden_layers"])
            sliding, layer_types = sliding_layers(cfg, model_type, layers)
            rope, rope_local = rope_configs(cfg, gemma)
            config = cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                rope_local=rope_local,
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=attention_bias and model_type != "qwen2",
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type in ("qwen3", "gemma3_text"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                sliding_window=sliding,
                layer_types=layer_types,
                hidden_act=act,
                norm_plus_one=gemma,
                sandwich_norms=gemma,
                embed_scale=hidden ** 0.5 if gemma else None,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
                final_logit_softcapping=(None if cfg.get("final_logit_softcapping") is None
                                         else float(cfg["final_logit_softcapping"])),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
            )
        except KeyError as err:
            raise ValueError(f"config.json lacks the field {err.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"config.json has a field of the wrong type: {err}") from None
        config.check()
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        return config


def sliding_layers(cfg: dict, model_type: str, layers: int) -> tuple:
    """(sliding_window or None, layer_types tuple or None) of a config.json: ``layer_types`` as
    written (transformers >= 4.5x), else Gemma 3's pattern (every ``sliding_window_pattern``-th layer
    global, default 6), Mistral's window on every layer, Qwen2's ``use_sliding_window`` from layer
    ``max_window_layers`` on."""
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window"):
        window = None
    if not window:
        return None, None
    window = int(window)
    if window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window}")
    types = cfg.get("layer_types")
    if types is None:
        if model_type == "gemma3_text":
            pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(layers)]
        elif model_type == "qwen2":
            first = int(cfg.get("max_window_layers", layers))
            types = [SLIDING if i >= first else GLOBAL for i in range(layers)]
        else:
            types = [SLIDING] * layers
    types = tuple(types)
    if len(types) != layers or not set(types) <= {SLIDING, GLOBAL}:
        raise ValueError(f"config.json: layer_types must list {layers} entries of {SLIDING!r} / {GLOBAL!r}")
    return (window, types) if SLIDING in types else (None, None)


def rope_configs(cfg: dict, gemma: bool) -> tuple:
    """(RoPE of the global layers, RoPE of the sliding layers or None when the same). Gemma 3:
    per-layer-type ``rope_parameters`` (transformers 5) or ``rope_theta`` (1M) + ``rope_scaling``
    for the global layers and ``rope_local_base_freq`` (10k) for the sliding ones (hub format)."""
    params = cfg.get("rope_parameters")
    per_type = isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())
    if not gemma:
        return RopeConfig.from_hf(cfg), None
    if per_type:
        if set(params) - {SLIDING, GLOBAL}:
            raise ValueError(f"config.json: rope_parameters per layer type must be {SLIDING!r} / {GLOBAL!r}, "
                             f"got {sorted(params)}")
        full = params.get(GLOBAL) or {}
        local = params.get(SLIDING) or {}
    else:
        full = dict(cfg.get("rope_scaling") or params or {})
        if "type" in full:
            full.setdefault("rope_type", full.pop("type"))
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    full = {"rope_type": "default", "rope_theta": 1_000_000.0, **full}
    local = {"rope_type": "default", "rope_theta": 10_000.0, **local}
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return RopeConfig.from_hf({**base, "rope_parameters": full}), RopeConfig.from_hf({**base, "rope_parameters": local})


def check_sampling_args(temperature: float, top_k: Optional[int] = 0, top_p: Optional[float] = 1.0) -> None:
    """Raise ``ValueError`` for invalid sampling settings.

    ``temperature`` must be finite and >= 0 (0 = greedy); ``top_k`` an int >= 0 or None (0/None =
    off); ``top_p`` a float in (0, 1] or None (1/None = off).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")

@dataclass
class GenerationConfig:
    """Settings of one ``Generator.generate`` call. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = None  # None: the model's own EOS ids
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling_args(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def eos_ids(self, model_config: ModelConfig) -> list:
        if self.ignore_eos:
            return []
        e = self.eos_token_id
        if e is None:
            return model_config.eos_token_ids
        return [e] if isinstance(e, int) else list(e)

