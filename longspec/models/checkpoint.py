"""Loading Hugging Face-format checkpoints: ``config.json`` + ``*.safetensors`` (one file or
shards listed in ``model.safetensors.index.json``). Only safetensors are read (no pickle)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

from ..attention import triton_kernels
from ..config import MULTIMODAL, ModelConfig
from ..outdir import temp_prefix
from ..parallel.sharding import Shard, shard_slice
from .draft import DraftConfig, LongSpecDraft
from .layers import hold_transposed
from .target import TargetModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_config(path: Union[str, Path]) -> dict:
    """Parsed ``config.json`` of a checkpoint directory, with clear errors."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a checkpoint directory (a folder with config.json and "
                                 "*.safetensors)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object, not a {type(config).__name__}")
    return config


def safetensors_files(path: Path) -> list:
    """The weight files of a checkpoint directory, sharded or not."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a valid safetensors index: {err}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        inside = path.resolve()
        for name in names:
            if inside not in (path / name).resolve().parents:
                raise ValueError(f"{index} names the shard {name!r}, which is not a file inside {path}")
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (found PyTorch .bin weights: longspec only loads safetensors; re-save them with " \
               "save_pretrained(safe_serialization=True))" if list(path.glob("*.bin")) else ""
        raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shard(s) listed in the index are missing: {', '.join(missing)}")
    return files


def load_state(module: torch.nn.Module, files: list, prefix: str = "", ignore=IGNORED_SUFFIXES,
               rename=None, shard=None) -> None:
    """Copies tensors from safetensors ``files`` into ``module``'s parameters and buffers (any
    device/dtype), checking that every parameter is present once with the right shape. Keys are
    stripped of ``prefix`` and mapped through ``rename`` (a dict or callable returning None to
    skip a key). Unexpected keys raise. ``shard`` (a :class:`~longspec.parallel.Shard`): only this
    rank's slice of each split tensor is read."""
    from safetensors import SafetensorError, safe_open

    params = dict(module.state_dict(keep_vars=True))
    seen, unexpected = set(), []
    with torch.no_grad():
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        name = key[len(prefix):] if prefix and key.startswith(prefix) else key
                        if rename is not None:
                            name = rename(name) if callable(rename) else rename.get(name, name)
                        if name is None or name.endswith(ignore):
                            continue  # a tensor this model does not use (by design)
                        if name not in params:
                            unexpected.append(key)
                            continue
                        tensor = f.get_tensor(key) if shard is None else shard_slice(shard, name, f.get_slice(key))
                        check_finite(key, tensor, file)
                        target = params[name]
                        if tuple(tensor.shape) != tuple(target.shape):
                            raise ValueError(f"tensor {key!r} in {file.name} has shape {tuple(tensor.shape)}, "
                                             f"the model expects {tuple(target.shape)}")
                        target.data.copy_(tensor)
                        seen.add(name)
            except SafetensorError as err:
                raise ValueError(f"corrupt safetensors file {file}: {err}") from None
    # tied parameters appear under two names; one of them present is enough
    by_tensor = {}
    for name, p in params.items():
        by_tensor.setdefault(id(p), []).append(name)
    missing = [names[0] for names in by_tensor.values() if not any(n in seen for n in names)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensor(s): {shown}")
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise ValueError(f"checkpoint has tensor(s) this model does not use: {shown}")


def load_target(path: Union[str, Path], dtype: Union[str, torch.dtype] = torch.float32,
                device: Union[str, torch.device] = "cpu", tensor_parallel=None) -> TargetModel:
    """Loads a Llama-family causal LM from a local HF-format directory.

    ``tensor_parallel`` (a :class:`~longspec.parallel.TensorParallel`, this process's rank of a
    group): loads only this rank's share of the weights onto the rank's device (``device`` is
    ignored); every rank of the group must call it (see :class:`~longspec.parallel.ParallelGenerator`).

    Raises FileNotFoundError for a missing directory/config/weights and ValueError for an
    unsupported architecture or RoPE scaling, a corrupt file, or missing/extra/mis-shaped tensors."""
    path = Path(path)
    raw = read_config(path)
    config = ModelConfig.from_hf(raw)
    dtype = resolve_dtype(dtype)
    files = safetensors_files(path)
    check_size(config.parameter_count(), files, path)
    shard = None if tensor_parallel is None else Shard.of(config, tensor_parallel)
    device = device if tensor_parallel is None else tensor_parallel.device
    with torch.device("meta"):  # (in the target dtype before allocating: a float32 copy may not fit)
        model = TargetModel(config, shard).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.build_rotary(device)
    load_state(model, files, shard=shard, rename=multimodal_text_name if is_multimodal(raw) else None)
    model.path = str(path)
    model.fuse_projections()
    use_device_kernels(model)
    return model.eval().requires_grad_(False)


def use_device_kernels(model: TargetModel) -> None:
    """On CUDA: the Triton tree-attention kernels (matmul, GQA-stacked products, where Triton or
    the head size does not suit them), compiled steps and the weights held transposed
    (:func:`~longspec.models.layers.hold_transposed`); elsewhere the defaults."""
    if model.device.type != "cuda":
        return
    hold_transposed(model)
    d = model.config.head_dim
    fits = triton_kernels.available() and d >= 16 and not d & (d - 1)  # the kernels' head dims
    model.attention_impl = "triton" if fits else "matmul"
    model.compile_steps = True  # fused kernels for decode/verify/propose (compiled once per shape)


def is_multimodal(raw: dict) -> bool:
    """Whether a config.json describes a multimodal checkpoint whose text model is loaded."""
    return raw.get("model_type") in MULTIMODAL.values() and isinstance(raw.get("text_config"), dict)


def multimodal_text_name(key: str) -> Optional[str]:
    """A multimodal checkpoint's tensor name -> the text model's (None: the vision tower and
    projector, not loaded). transformers 5 writes ``model.language_model.*``, older versions
    ``language_model.model.*`` and ``language_model.lm_head.*``."""
    for prefix, ours in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if key.startswith(prefix):
            return ours + key[len(prefix):]
    return None


def check_size(parameters: int, files: list, path: Path) -> None:
    """Raises ValueError, before anything is allocated, when the weight files are too small to
    hold ``parameters`` weights (at least one byte each): a config.json whose sizes do not
    describe these weights (e.g. a hidden_size of 1e9)."""
    held = sum(f.stat().st_size for f in files)
    if parameters > held:
        names = ", ".join(f.name for f in files[:3]) + (" ..." if len(files) > 3 else "")
        raise ValueError(f"{path / 'config.json'} describes {parameters:,} weights (about "
                         f"{4 * parameters / 2**30:,.1f} GiB in float32), but its weight files ({names}) hold only {held:,} bytes: a wrong size "
                         f"in config.json, or corrupt (truncated) weight files")


def check_finite(name: str, tensor: torch.Tensor, file: Path) -> None:
    """Raises ValueError naming the tensor and file when a floating-point tensor holds NaN or
    infinity: every value of a norm weight, a strided sample of the others (random bytes in a
    tensor give non-finite values throughout, so a sample finds them)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    if "norm" not in name:
        flat = flat[::max(1, flat.numel() // 65536)]
    if not bool(torch.isfinite(flat).all()):
        raise ValueError(f"tensor {name!r} in {file} holds NaN or infinite values: a damaged checkpoint")


DRAFT_FORMAT = "longspec-draft"
DRAFT_MODULES = ("self_attn.", "cross_attn.", "mlp.", "input_layernorm.", "post_self_attention_layernorm.",
                 "post_cross_attention_layernorm.")


def save_draft(draft, path: Union[str, Path]) -> Path:
    """Writes ``config.json`` + ``model.safetensors`` (draft weights only; the target's shared
    embedding / norm / LM head are not copied) into ``path``, atomically."""
    import dataclasses

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"format": DRAFT_FORMAT, **dataclasses.asdict(draft.config)}
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    write_atomic(path / "model.safetensors", lambda f: save_file(state, f, metadata={"format": "pt"}))
    write_atomic(path / "config.json", lambda f: Path(f).write_text(json.dumps(config, indent=2)))
    return path


def default_mode(directory: bool = False) -> int:
    """The permissions a new file (or directory) gets under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def write_atomic(path: Path, write) -> None:
    """Calls ``write(tmp_path)`` on a temporary file next to ``path``, then renames it over ``path``
    (with the permissions an ordinary new file would have)."""
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _published_name(key: str):
    """Maps a published LongSpec draft key (any prefix, e.g. ``model.layers.0.``) to ours;
    None for tensors we do not use (cross-attention k/v, shared embedding / norm / head)."""
    for module in DRAFT_MODULES:
        at = key.find(module)
        if at >= 0 and (at == 0 or key[at - 1] == "."):
            name = key[at:]
            if name.startswith(("cross_attn.k_proj", "cross_attn.v_proj")):
                return None
            return name
    return None


def load_draft(path: Union[str, Path], target, dtype: Optional[torch.dtype] = None, fuse: bool = True):
    """Loads a draft for ``target`` from a directory written by :func:`save_draft`, or a
    published LongSpec draft checkpoint (one decoder layer with ``self_attn``, ``cross_attn``,
    ``mlp`` and three norms; cross-attention k/v weights are ignored). Raises ValueError when the
    draft does not fit the target. ``dtype``: of the draft's weights (default: the target's);
    ``fuse``: q/k/v and gate/up in one product each, for inference (training keeps them apart)."""
    config, files, rename = read_draft_config(path, target)
    with torch.device("meta"):
        draft = LongSpecDraft(config, target)
    draft = draft.to_empty(device=target.device).to(dtype or target.dtype)
    load_state(draft, files, rename=rename)
    if fuse:
        draft.fuse_projections()
        if draft.target.device.type == "cuda":
            hold_transposed(draft)
    return draft.eval()


def read_draft_config(path: Union[str, Path], target) -> tuple:
    """(DraftConfig, safetensors files, key rename or None) of the draft at ``path`` (see
    :func:`load_draft`), without loading its weights."""
    path = Path(path)
    raw = read_config(path)
    files = safetensors_files(path)
    if raw.get("format") == DRAFT_FORMAT:
        fields = {f for f in DraftConfig.__dataclass_fields__}
        try:
            config = DraftConfig(**{k: v for k, v in raw.items() if k in fields})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path / 'config.json'} is not a valid draft config: {err}") from None
        rename = None
    else:  # published checkpoint: architecture from the target, biases from the file
        from safetensors import safe_open

        from safetensors import SafetensorError

        keys = set()
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    keys.update(filter(None, map(_published_name, f.keys())))
            except SafetensorError as err:
                raise ValueError(f"corrupt safetensors file {file}: {err}") from None
        if not any(k.startswith("cross_attn.q_proj") for k in keys):
            raise ValueError(f"{path} holds no LongSpec draft weights (no cross_attn.q_proj)")
        window = raw.get("sliding_window") or raw.get("window") or 512
        config = DraftConfig.for_target(target, window=window if isinstance(window, int) else -1,
                                        qkv_bias="self_attn.q_proj.bias" in keys,
                                        cross_q_bias="cross_attn.q_proj.bias" in keys)
        config.target_embedding_sample = []  # published files carry no fingerprint
        config.head_norm = False  # the published code applies the LM head to the block's output
        hidden = raw.get("hidden_size", config.hidden_size)
        if hidden != target.config.hidden_size:
            raise ValueError(f"draft/target mismatch: the draft has hidden_size={hidden}, "
                             f"the target {target.config.hidden_size}")
        rename = _published_name
    check_draft_config(config, path)
    return config, files, rename


def check_draft_config(config, path: Path) -> None:
    """Raises ValueError naming the first field of a draft's config.json that no draft can have
    (a size or window that is not a positive integer)."""
    for name in ("window", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        value = getattr(config, name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path / 'config.json'}: {name} must be a positive integer, got {value!r}")
