"""Bad input gets a clear error: missing / incomplete / corrupt / unsupported checkpoints, prompts
longer than the cache."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator

from conftest import build_tiny_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A valid tiny Llama checkpoint (single safetensors file), max_position_embeddings 64."""
    _, path = build_tiny_model(tmp_path_factory.mktemp("ckpt-base"), "llama", reload=False,
                               max_position_embeddings=64)
    return path


@pytest.fixture
def ckpt(base_dir, tmp_path):
    """A fresh, writable copy of the valid checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(base_dir, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_valid_checkpoint_loads(ckpt):
    target = load_target(ckpt)
    assert target.config.vocab_size == 160


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_target(tmp_path / "does-not-exist")


def test_file_instead_of_directory(ckpt):
    """A file is said to be a file, not "not found" (it exists)."""
    with pytest.raises(NotADirectoryError, match="config.json is a file, not a checkpoint directory"):
        load_target(ckpt / "config.json")


def test_no_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_target(ckpt)


def test_unsupported_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        load_target(ckpt)
    assert "LlamaForCausalLM" in str(err.value)  # lists what is supported


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, architectures=None, model_type="falcon")
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'"):
        load_target(ckpt)


def test_unsupported_activation(ckpt):
    edit_config(ckpt, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        load_target(ckpt)


@pytest.mark.parametrize("fmt", ["rope_parameters", "rope_scaling-type", "rope_scaling-rope_type"])
def test_unsupported_rope_type(ckpt, fmt):
    params = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}
    if fmt == "rope_parameters":
        edit_config(ckpt, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **params})
    else:
        key = fmt.split("-")[1]
        edit_config(ckpt, rope_parameters=None, rope_theta=10000.0, rope_scaling={key: "longrope", **params})
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'longrope'"):
        load_target(ckpt)


def test_rope_scaling_without_factor(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="factor"):
        load_target(ckpt)


def test_missing_field(ckpt):
    edit_config(ckpt, hidden_size=None)
    with pytest.raises(ValueError, match="hidden_size"):
        load_target(ckpt)


def test_missing_tensor(ckpt):
    file = ckpt / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_target(ckpt)


def test_unexpected_tensor(ckpt):
    file = ckpt / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        load_target(ckpt)


def test_mis_shaped_tensor(ckpt):
    edit_config(ckpt, vocab_size=170)
    pattern = r"tensor '(lm_head|model\.embed_tokens)\.weight' .*shape \(160, 64\).*expects \(170, 64\)"
    with pytest.raises(ValueError, match=pattern):
        load_target(ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.98, 10], ids=["half", "tail", "header"])
def test_corrupt_safetensors(ckpt, keep):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    n = int(len(data) * keep) if keep < 1 else keep
    file.write_bytes(data[:n])
    with pytest.raises(ValueError, match="corrupt") as err:
        load_target(ckpt)
    assert "model.safetensors" in str(err.value)


def test_garbage_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64 + b"not a safetensors file" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        load_target(ckpt)


def test_bin_only_weights(ckpt):
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors") as err:
        load_target(ckpt)
    assert ".bin" in str(err.value)


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*\\.safetensors weights"):
        load_target(ckpt)


def test_missing_shard(tmp_path):
    _, path = build_tiny_model(tmp_path / "sharded", "llama", reload=False, max_shard_size="40KB")
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"missing.*{shards[1].name}"):
        load_target(path)


def test_bad_index(tmp_path):
    _, path = build_tiny_model(tmp_path / "sharded", "llama", reload=False, max_shard_size="40KB")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        load_target(path)


def test_unknown_dtype(ckpt):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_target(ckpt, dtype="float8")


def test_mistral_sliding_window_on_every_layer(tmp_path):
    """Mistral v0.1's window slides on every layer (parity past it: ``test_target_parity.py``);
    the cache is not limited to it."""
    _, path = build_tiny_model(tmp_path / "mistral", "mistral", reload=False, sliding_window=16)
    target = load_target(path)
    assert target.config.sliding_window == 16
    assert target.config.layer_types == ("sliding_attention",) * target.config.num_layers
    assert target.new_cache(1, 100).max_len == 100


def test_sliding_window_settings_that_slide_nothing(tmp_path):
    """Mistral with ``sliding_window: null`` (v0.2+) and Qwen2 with ``use_sliding_window: false``
    (the window field is present but unused): every layer global."""
    _, path = build_tiny_model(tmp_path / "mistral", "mistral", reload=False)
    edit_config(path, sliding_window=None)
    assert load_target(path).config.layer_types is None
    _, path = build_tiny_model(tmp_path / "qwen2", "qwen2", reload=False, sliding_window=16,
                               use_sliding_window=False)
    config = load_target(path).config
    assert (config.sliding_window, config.layer_types) == (None, None)


# ------------------------------------------------------------------------------ prompt / cache

@pytest.fixture(scope="module")
def target(base_dir):
    return load_target(base_dir)


def test_prompt_longer_than_context(target):
    with pytest.raises(ValueError, match="over the maximum length 64"):
        Generator(target).generate([list(range(100)) * 3], GenerationConfig(max_new_tokens=10))


def test_prompt_plus_new_tokens_longer_than_context(target):
    gen = Generator(target)  # the last new token is emitted, never written: prompt + 9 slots
    assert len(gen.generate([list(range(55))], GenerationConfig(max_new_tokens=10)).sequences[0]) == 10
    with pytest.raises(ValueError, match="needs 65 positions, over the maximum length 64"):
        gen.generate([list(range(56))], GenerationConfig(max_new_tokens=10))
    # an explicit max_len raises the limit
    out = Generator(target, max_len=128).generate([list(range(100))], GenerationConfig(max_new_tokens=10))
    assert len(out.sequences[0]) == 10


def test_bad_prompts(target):
    gen = Generator(target)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[1, 2, 160]], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[1, -1]], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match=f"token id {2 ** 70} outside the vocabulary"):
        gen.generate([[1, 2 ** 70]], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        gen.generate([[1, 2], []], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="no prompts"):
        gen.generate([], GenerationConfig(max_new_tokens=2))


def test_bad_generation_config():
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        GenerationConfig(top_k=-1)


def test_cache_check_room(target):
    cache = target.new_cache(2, 16)
    cache.check_room(16)
    with pytest.raises(ValueError, match="KV cache full: 17 tokens needed, the cache holds 16"):
        cache.check_room(17)
    ids = torch.randint(0, 160, (2, 10))
    target.prefill(ids, torch.tensor([10, 4]), cache)
    cache.check_room(6)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.check_room(7)
    # every forward checks before writing anything
    with pytest.raises(ValueError, match="KV cache full"):
        target.prefill(ids, torch.tensor([10, 10]), cache)
    with pytest.raises(ValueError, match="KV cache full"):
        target.verify(torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long),
                      torch.ones(1, 7, 7, dtype=torch.bool), cache)
    assert cache.lengths.tolist() == [10, 4]
    for _ in range(6):
        target.decode(torch.tensor([1, 2]), cache)
    assert cache.lengths.tolist() == [16, 10]
    with pytest.raises(ValueError, match="KV cache full"):
        target.decode(torch.tensor([1, 2]), cache)


def test_cache_bad_size(target):
    with pytest.raises(ValueError, match="max_len >= 1"):
        target.new_cache(1, 0)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        target.new_cache(0, 8)


def test_saved_files_are_readable_like_ordinary_files(tmp_path):
    """Atomic writes go through temporary files; the result still gets the umask's permissions."""
    import os
    import stat

    from longspec.models.checkpoint import default_mode, write_atomic

    target = tmp_path / "f.txt"
    write_atomic(target, lambda f: open(f, "w").write("x"))
    assert stat.S_IMODE(os.stat(target).st_mode) == default_mode() and target.read_text() == "x"
