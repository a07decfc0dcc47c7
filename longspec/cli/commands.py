"""The ``generate`` command of the ``longspec`` command line (:mod:`longspec.cli` parses the
arguments) and what the commands share: the checks of the device, dtype, threads, proposer and
prompt length, and the tokenizer (``serve`` is in :mod:`~longspec.cli.serve_command`; ``train``,
``self-distill``, ``draft-vocab`` and ``convert`` in :mod:`~longspec.cli.train_commands`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..files import read_text
from ..status import Heartbeat, status


class UsageError(ValueError):
    """A bad command line: reported with exit code 2 before anything heavy is loaded."""


def _device_and_dtype(args):
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise UsageError(f"--device {device!r} is not a device longspec runs on (use cpu, cuda or cuda:N)")
    if kind == "cuda" and (not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"device {device!r} is not available on this machine (use --device cpu)")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = args.dtype or ("bfloat16" if kind == "cuda" else "float32")
    if kind == "cuda" and index:  # the process's own GPU: launches, streams and events default to it
        torch.cuda.set_device(int(index))
    return device, dtype


DTYPES = ("float32", "float16", "bfloat16")


def _set_threads(args) -> None:
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)


PROMPT_FILE_BYTES = 64 << 20  # a prompt file read at most (1M tokens of text take ~4 MB)


def _prompt_text(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        try:  # (regular files only, read up to a cap: never a device's endless bytes or a 2 GB file whole)
            text = read_text(args.prompt_file, PROMPT_FILE_BYTES, "--prompt-file")
        except ValueError as err:
            raise UsageError(str(err)) from None
    if not text.strip():
        raise UsageError("the prompt is empty (give some text with --prompt or --prompt-file)")
    return text


class TextStreamer:
    """Prints the decoded text of one row as tokens arrive (holds back incomplete characters)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out, [], 0

    def __call__(self, row: int, tokens: list) -> None:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


class PrefillStatus:
    """A status line every ~2 s until a call's first token: what the engine prepares (capturing,
    compiling), else the prompt's prefill and the fraction of it done (the prefill reports it
    after each piece, :mod:`longspec.models.progress`; a CPU's pieces take seconds). Call it with
    the fraction; :meth:`streamer` wraps the call's streamer (its first token ends the status)."""

    def __init__(self, n_tokens: int, gen, every: float = None):
        self.n_tokens, self.gen, self.done, self.first = n_tokens, gen, 0.0, False
        self.heartbeat = Heartbeat(self.label, every, until=lambda: self.first)

    def __call__(self, done: float) -> None:
        self.done = done

    def label(self) -> str:
        engine = getattr(self.gen, "_engine", None)
        if engine is not None and engine.warming:
            return f"preparing {engine.warming}"
        return f"prefilling the prompt's {self.n_tokens} tokens" + (f": {100 * self.done:.0f}%" if self.done else "")

    def streamer(self, streamer):
        def stream(row: int, tokens: list) -> None:
            self.first = True
            streamer(row, tokens)
        return stream


def cmd_generate(args) -> int:
    from .. import GenerationConfig, Generator, load_target
    from ..config import ModelConfig
    from ..convert import DEFAULT_NAME, default_model_dir
    from ..engine.sequence import cache_need, round_slots
    from ..models.checkpoint import check_size, read_config, safetensors_files
    from ..models.progress import prefill_progress

    # everything that can be checked without the model first: the arguments, then (with the
    # model's config.json and tokenizer only, no weights) the prompt's length
    _set_threads(args)
    device, dtype = _device_and_dtype(args)
    try:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as err:
        raise UsageError(f"{err} (see --max-new-tokens, --temperature, --top-k, --top-p)") from None
    text = _prompt_text(args)
    name, tree = proposer_choice(args, device)
    chosen = name  # (what --json reports: "auto" stays "auto", whatever it runs first)
    parallel = _tensor_parallel(args, device)
    if parallel and name == "auto":  # (auto's cost model times steps per device: not across ranks)
        from ..spec.proposers import default_tree
        from ..spec.tree import TreeSpec

        name = "hybrid" if args.draft or not args.target else "pld"
        tree = TreeSpec.coerce(default_tree(name, device))

    if args.draft:
        read_config(args.draft)  # (a wrong --draft said now, not after loading the model)
    target_dir = Path(args.target) if args.target else default_model_dir(announce=True)
    model_config = ModelConfig.from_hf(read_config(target_dir))
    check_size(model_config.parameter_count(), safetensors_files(target_dir), target_dir)  # (load_target's, early)
    limit = model_config.max_position_embeddings
    ids = _tokenize(target_dir, text, args.chat)
    note = ""
    if name == "auto":
        biggest = auto_biggest_slots()
        if cache_need(len(ids), args.max_new_tokens, 1) <= limit < cache_need(len(ids), args.max_new_tokens, biggest):
            # near the model's end even the smallest tree may not fit: plain decoding, decided now
            name, note = "none", "the prompt leaves no room for a speculative tree"
    check_length(len(ids), args.max_new_tokens, None if name == "auto" else tree, limit)
    if name != "auto":
        status(f"auto: plain decoding: {note}" if note else f"proposer {name}" + (f", tree {tree}" if tree else ""))

    about = (f"{DEFAULT_NAME} (135M parameters, dequantised from a 4-bit GGUF: a small demo model, so "
             "expect rough text; on a 2-core CPU about 10-30 tokens/s)" if not args.target else str(target_dir))
    plan, line = None, None
    if parallel:
        from ..parallel import ParallelGenerator

        status(f"loading {about} on {parallel} {device} processes ({dtype}), tensor-parallel")
        gen = ParallelGenerator(target_dir, parallel, proposer=name, draft=args.draft, tree=tree, dtype=dtype,
                                device=device, window=args.window, threads=args.threads)
        target = gen.target
    else:
        status(f"loading {about} on {device} ({dtype})")
        target = load_target(target_dir, dtype=dtype, device=device)
        target.compile_steps = target.compile_steps and args.compile  # one call: CUDA graphs of eager steps
        # (the draft: --draft, else the one shipped for the default model; one request: a prefix
        # cache would have nothing to reuse, the engine keeps its dense rows)
        gen = Generator(target, proposer=name, tree=tree, draft=args.draft, window=args.window, prefix_cache=False)
    if name == "auto":
        from ..decoding.auto import costs_measured

        if costs_measured(target, gen.draft):
            plan = gen.plan([ids], config)  # what `generate` runs below: the same engine as Generator(proposer="auto")
        else:
            status("auto: measuring the step costs on this device once (a few seconds; cached for later runs)")
            with Heartbeat(lambda: "auto: measuring the step costs"):
                plan = gen.plan([ids], config)
        name, note = plan.name, plan.note
        tree, gain = gen.first_rounds(plan, config)
        line = auto_line(name, tree, gain if gain is not None else predicted_gain(note))
    biggest = plan.tree if plan is not None else tree
    if cache_need(len(ids), args.max_new_tokens, round_slots(biggest)) > limit:  # (auto checked plain decoding's need above)
        check_length(len(ids), args.max_new_tokens, biggest, limit)
    if line:
        status(line)
    if target.device.type == "cuda":
        status("compiling and capturing the steps (seconds to a minute the first time on a machine; compiled code "
               "is kept under the longspec home)" if target.compile_steps else "capturing the steps as CUDA graphs")
    streamer = TextStreamer(tokenizer_for(target_dir), sys.stderr if args.json else sys.stdout)
    try:
        prefill = PrefillStatus(len(ids), gen)
        with prefill_progress(prefill), prefill.heartbeat:
            out = gen.generate([ids], config, streamer=prefill.streamer(streamer),
                               **({} if parallel else {"plan": plan}))
    finally:
        if parallel:
            gen.close()
    streamer.out.write("\n")
    streamer.out.flush()
    tokens = out.sequences[0]
    stats = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.stats.items()}
    if args.json:
        # (for auto: the tree predicted fastest, null for plain rounds, as its status line says;
        # stats["trees"] what ran when)
        print(json.dumps({"text": streamer.tokenizer.decode(tokens, skip_special_tokens=True), "token_ids": tokens,
                          "proposer": chosen, "tree": str(tree) if tree else None, "auto": note or None,
                          "stats": stats}))
    else:
        print(summary_line(stats), file=sys.stderr)
    return 0


def summary_line(stats: dict) -> str:
    """The line after the text: tokens, the prefill's time and the decoding's rate (apart: a long
    prompt's prefill would hide the decoding's speed, or the rate alone the prefill's time), for
    auto that rate against plain decoding's (as its controller timed or predicted plain rounds),
    tau and what auto ran (its first rounds, then each switch)."""
    tau = f", tau {stats['tau']:.2f}" if "tau" in stats else ""
    faster = f" (about {stats['vs_plain']:.1f}x plain decoding's)" if "vs_plain" in stats else ""
    switches = "".join(f", {t or 'plain'}" + (f" from token {n}" if i else "")
                       for i, (n, t) in enumerate(stats.get("trees", [])))  # (what auto ran first, then its switches)
    return (f"[{stats['new_tokens']} tokens in {stats['wall_s']:.1f} s (the {stats['prompt_tokens']:,}-token prompt's "
            f"prefill: {stats['prefill_s']:.1f} s), {stats['tokens_per_s']:.1f} tokens/s after it{faster}, "
            f"{stats['steps']} steps{tau}{switches}]")


def _tensor_parallel(args, device: str) -> int:
    """--tensor-parallel's process count, checked (0: one process, no tensor parallelism)."""
    import torch

    n = getattr(args, "tensor_parallel", 1)
    if n < 1:
        raise UsageError(f"--tensor-parallel must be >= 1, got {n}")
    if n == 1:
        return 0
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--tensor-parallel uses cuda:0..{n - 1}: give --device cuda, not {device}")
    if device == "cuda" and torch.cuda.device_count() < n:
        raise UsageError(f"--tensor-parallel {n} needs {n} GPUs, {torch.cuda.device_count()} visible")
    return n


_TOKENIZERS: dict = {}


def tokenizer_for(target_dir):
    """The checkpoint's own tokenizer (loaded once per process)."""
    from transformers import AutoTokenizer

    key = str(target_dir)
    if key not in _TOKENIZERS:
        try:
            _TOKENIZERS[key] = AutoTokenizer.from_pretrained(target_dir)
        except (OSError, ValueError, TypeError) as err:  # transformers' messages run over several lines
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UsageError(f"cannot load the tokenizer in {target_dir}: {first}") from None
    return _TOKENIZERS[key]


def _tokenize(target_dir, text: str, chat: bool) -> list:
    tokenizer = tokenizer_for(target_dir)
    if not chat:
        return tokenizer(text).input_ids
    if not tokenizer.chat_template:
        raise UsageError(f"the tokenizer in {target_dir} has no chat template; drop --chat")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer(prompt, add_special_tokens=False).input_ids


def check_length(prompt_len: int, max_new_tokens: int, tree, limit: int) -> None:
    """A UsageError when the prompt, ``max_new_tokens`` and one round of ``tree`` (None: a decode
    step) need more positions than the model has (``limit``)."""
    from ..engine.sequence import cache_need, round_slots

    slots = round_slots(tree)
    need = cache_need(prompt_len, max_new_tokens, slots)
    if need > limit:
        raise UsageError(f"the prompt ({prompt_len} tokens) with --max-new-tokens {max_new_tokens}"
                         + (f" and the tree ({slots} nodes)" if tree is not None else "")
                         + f" needs {need} positions; the model has {limit}: shorten the prompt, lower "
                         "--max-new-tokens" + (" or use a smaller --tree" if tree is not None else ""))


def auto_biggest_slots() -> int:
    """The most cache slots a round of any setting ``--proposer auto`` may pick writes."""
    from ..decoding import auto
    from ..spec.tree import TreeSpec

    shapes = [f"chain:{n}" for n in getattr(auto, "LOOKUP_CHAINS", ())] + list(getattr(auto, "CANDIDATE_TREES", ()))
    return max([TreeSpec.parse(s).num_nodes for s in shapes] or [1])


def predicted_gain(note: str):
    """The predicted speed-up over plain decoding in auto's note ("... 1.62x plain ..."), or None."""
    import re

    found = re.search(r"([0-9]+(?:\.[0-9]+)?)x plain", note or "")
    return float(found.group(1)) if found else None


def auto_line(name: str, tree, gain) -> str:
    """What ``--proposer auto`` starts with and why, in one line, e.g. "auto: prompt lookup, chain
    of 5 (predicted 1.60x plain decoding); then chosen by measured speed every round"."""
    predicted = f" (predicted {gain:.2f}x plain decoding)" if gain else ""
    later = "; then chosen by measured speed after every round"
    if name == "none":
        return "auto: plain decoding: the prompt leaves no room for a speculative tree"
    if tree is None:
        return f"auto: plain decoding first: no speculative setting is predicted faster on this prompt{later}"
    if name == "pld":
        return f"auto: prompt lookup, {describe_tree(tree)}{predicted}{later}"
    if getattr(tree, "kind", None) == "chain":  # (the hybrid's engine runs its lookup's chain)
        return f"auto: prompt lookup alone in the hybrid's engine, {describe_tree(tree)}{predicted}{later}"
    return f"auto: LongSpec draft + prompt lookup (hybrid), {describe_tree(tree)}{predicted}{later}"


def describe_tree(tree) -> str:
    """"chain of 5" for a chain, else "tree 4,4,4,4,4"."""
    text = str(tree)
    if text.startswith("chain:"):
        return f"chain of {text.split(':', 1)[1]}"
    return f"tree {text}"


def proposer_choice(args, device):
    """(proposer name, TreeSpec or None) from --proposer / --tree / --draft, checked without loading
    anything; the default tree is ``device``'s ("cpu", "cuda" or "cuda:N")."""
    from ..spec.proposers import default_tree
    from ..spec.tree import TreeSpec

    name = "longspec" if args.draft and args.proposer == "none" else args.proposer
    if args.draft and name not in ("longspec", "hybrid", "auto"):
        raise UsageError(f"--draft is for --proposer longspec, hybrid or auto, not {name}")
    if name == "auto":
        if args.tree:
            raise UsageError("--tree needs a proposer (--proposer pld | streaming | longspec | hybrid): "
                             "--proposer auto chooses its tree itself")
        return name, None
    if name == "none":
        if args.tree:
            raise UsageError("--tree needs a proposer (--proposer pld | streaming | longspec)")
        return name, None
    if name in ("longspec", "hybrid") and not args.draft and args.target:
        raise UsageError(f"--proposer {name} needs --draft DIR (a LongSpec draft trained for this target; "
                         "only the default model ships one)")
    if args.window < 1:
        raise UsageError(f"--window must be >= 1, got {args.window}")
    try:
        return name, TreeSpec.parse(args.tree or default_tree(name, device))
    except ValueError as err:
        raise UsageError(str(err)) from None
