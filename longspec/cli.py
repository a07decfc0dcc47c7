"""longspec: lossless speculative decoding for long contexts.

Commands: generate (text from a prompt), serve (an OpenAI-compatible server), train (a LongSpec
draft for a target), convert (a GGUF checkpoint into a Hugging Face-format directory)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def _prompt_text(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        path = Path(args.prompt_file)
        if path.is_dir():
            raise UsageError(f"--prompt-file {path} is a directory, not a file")
        if not path.is_file():
            raise UsageError(f"--prompt-file {path} not found")
        text = path.read_text()
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


def cmd_generate(args) -> int:
    from . import GenerationConfig, Generator, load_target
    from .convert import DEFAULT_NAME, default_model_dir
    from .decoding.sequence import cache_need, round_slots

    # everything that can be checked without the model first
    _set_threads(args)
    device, dtype = _device_and_dtype(args)
    try:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as err:
        raise UsageError(f"{err} (see --max-new-tokens, --temperature, --top-k, --top-p)") from None
    text = _prompt_text(args)
    name, tree = proposer_choice(args)
    draft = None

    from transformers import AutoTokenizer

    target_dir = Path(args.target) if args.target else default_model_dir(announce=True)
    target = load_target(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if args.chat:
        if not tokenizer.chat_template:
            raise UsageError(f"the tokenizer in {target_dir} has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text).input_ids
    note, retune = "", None
    if name == "auto":
        name, tree, draft, note, retune = resolve_auto(args, target, ids)
    slots = round_slots(retune.biggest if retune else tree)
    need, limit = cache_need(len(ids), args.max_new_tokens, slots), target.config.max_position_embeddings
    if need > limit:
        raise UsageError(f"the prompt ({len(ids)} tokens) with --max-new-tokens {args.max_new_tokens}"
                         + (f" and the tree ({slots} nodes)" if tree is not None else "")
                         + f" needs {need} positions; the model has {limit}: shorten the prompt, lower "
                         "--max-new-tokens" + (" or use a smaller --tree" if tree is not None else ""))
    proposer = make_proposer(args, name, target, draft)
    if not args.json:
        about = (f"{DEFAULT_NAME} (135M parameters, dequantised from a 4-bit GGUF: a small demo model, so "
                 "expect rough text; on a 2-core CPU about 10-30 tokens/s)" if not args.target else str(target_dir))
        shown = f" tree {tree}" if tree else " (plain rounds first)" if retune else ""
        print(f"[longspec: {about} on {device} ({dtype}), proposer {name}{shown}"
              f"{f' (auto: {note})' if note else ''}]", file=sys.stderr)
    streamer = TextStreamer(tokenizer, sys.stderr if args.json else sys.stdout)
    out = Generator(target, proposer=proposer, tree=retune.biggest if retune else tree,
                    retune=retune).generate([ids], config, streamer=streamer)
    streamer.out.write("\n")
    tokens = out.sequences[0]
    stats = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.stats.items()}
    if args.json:
        print(json.dumps({"text": tokenizer.decode(tokens, skip_special_tokens=True), "token_ids": tokens,
                          "proposer": name, "tree": str(tree) if tree else None, "auto": note or None,
                          "stats": stats}))
    else:
        tau = f", tau {stats['tau']:.2f}" if "tau" in stats else ""
        switches = "".join(f", {'plain' if t == 'None' else t} from token {n}" for n, t in stats.get("trees", [])[1:])
        print(f"[{stats['new_tokens']} tokens in {stats['steps']} steps, {stats['tokens_per_s']:.1f} tokens/s{tau}"
              f"{switches}]", file=sys.stderr)
    return 0


def proposer_choice(args):
    """(proposer name, TreeSpec or None) from --proposer / --tree / --draft, checked without loading
    anything."""
    from .decoding.tree import TreeSpec

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
        return name, TreeSpec.parse(args.tree or default_tree(name))
    except ValueError as err:
        raise UsageError(str(err)) from None


def default_tree(proposer: str) -> str:
    """pld: a 5-token chain; longspec: the paper's beam tree; hybrid: that tree plus five levels
    of one node, which the lookup chain fills when the text repeats (README: choosing the proposer)."""
    from .decoding.sequence import DEFAULT_TREE, HYBRID_TREE

    return {"pld": "chain:5", "hybrid": HYBRID_TREE}.get(proposer, DEFAULT_TREE)


def resolve_auto(args, target, ids: list) -> tuple:
    """``--proposer auto``: (proposer name, tree, loaded draft or None, why, the retuner or None),
    see :func:`longspec.decoding.auto.pick` and :func:`~longspec.decoding.auto.retuner`; the
    draft is --draft, or the one shipped for the default model."""
    from .convert import DEFAULT_DRAFT
    from .decoding.auto import pick, retuner
    from .decoding.sequence import cache_need, round_slots
    from .models.checkpoint import load_draft

    draft_dir = args.draft or (DEFAULT_DRAFT if not args.target else None)
    loaded = load_draft(draft_dir, target) if draft_dir else None
    name, tree, draft, note = pick(target, ids, loaded)
    retune = retuner(target, ids, name, tree, loaded)
    limit = target.config.max_position_embeddings
    if retune is not None and cache_need(len(ids), args.max_new_tokens, round_slots(retune.biggest)) <= limit:
        name, note = retune.proposer, note + "; retuned while generating"
    else:  # (near the context's end the biggest candidate tree may not fit: no retuning)
        retune = None
    return name, tree, draft, note, retune


def make_proposer(args, name, target, draft=None):
    """The proposer object for ``name`` (loads the draft for longspec / hybrid unless given), or None."""
    from .decoding.proposers import LongSpecProposer, PromptLookup
    from .decoding.streaming import StreamingSelfSpec

    if name == "none":
        return None
    if name == "pld":
        return PromptLookup()
    if name == "streaming":
        return StreamingSelfSpec(window=args.window)
    from .convert import DEFAULT_DRAFT
    from .models.checkpoint import load_draft

    if draft is None:
        draft = load_draft(args.draft or DEFAULT_DRAFT, target)
    return LongSpecProposer(draft, lookup=PromptLookup() if name == "hybrid" else None)


def cmd_self_distill(args) -> int:
    """``longspec self-distill``: chat requests about documents answered by the target (JSONL)."""
    from . import load_target
    from .convert import default_model_dir
    from .training.selfdistill import TASKS, self_distill

    _set_threads(args)
    device, dtype = _device_and_dtype(args)
    tasks = args.tasks.split(",")
    if any(t not in TASKS for t in tasks) or args.max_doc_tokens < 1 or args.max_new_tokens < 1 or args.batch < 1:
        raise UsageError(f"--tasks must name some of {','.join(TASKS)}; --max-doc-tokens, --max-new-tokens and "
                         "--batch must be >= 1")
    index, _, count = args.shard.partition("/")
    try:
        shard = (int(index), int(count))
    except ValueError:
        shard = (-1, 0)
    if not 0 <= shard[0] < shard[1]:
        raise UsageError(f"--shard takes I/N with 0 <= I < N (e.g. 0/2), got {args.shard!r}")
    from transformers import AutoTokenizer

    target_dir = Path(args.target) if args.target else default_model_dir(announce=True)
    target = load_target(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    try:
        n = self_distill(target, tokenizer, args.docs, args.out, tasks, args.max_doc_tokens, args.max_new_tokens,
                         args.batch, args.temperature, args.top_p, args.seed, limit=args.limit, shard=shard)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(f"[longspec: {n} conversations written to {args.out}]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    """``longspec serve``: the OpenAI-compatible server (see ``longspec/serve.py``)."""
    _set_threads(args)
    device, dtype = _device_and_dtype(args)
    name, tree = proposer_choice(args)
    if args.max_batch < 1 or args.max_len < 2 or args.max_queue < 0 or (args.prefill_chunk or 0) < 0:
        raise UsageError("--max-batch must be >= 1, --max-len >= 2, --max-queue >= 0 and --prefill-chunk >= 0")
    buckets = None
    if args.buckets:
        try:
            buckets = sorted({int(b) for b in args.buckets.split(",")})
        except ValueError:
            raise UsageError(f"--buckets takes comma-separated batch sizes, got {args.buckets!r}") from None
        if buckets[0] < 1 or buckets[-1] > args.max_batch:
            raise UsageError(f"--buckets must lie in 1..--max-batch ({args.max_batch}), got {args.buckets}")
    from .decoding.auto import bucket_trees_option, choose_bucket_trees
    from .serve import build_server, create_app

    bucket_trees = bucket_trees_option(args.bucket_trees, name, tree, buckets, args.max_batch)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as err:
        raise UsageError(f"longspec serve needs FastAPI and uvicorn: pip install 'longspec[serve]' "
                         f"(importing them failed: {err})") from None
    from transformers import AutoTokenizer

    from . import load_target
    from .convert import DEFAULT_NAME, default_model_dir

    target_dir = Path(args.target) if args.target else default_model_dir(announce=True)
    target = load_target(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model_name = args.model_name or (DEFAULT_NAME if not args.target else target_dir.name)
    proposer = make_proposer(args, name, target)
    if bucket_trees == "auto":
        bucket_trees, notes = choose_bucket_trees(target, proposer, tree, buckets, args.max_batch, args.max_len)
        if notes:
            print(f"[longspec: trees of the batch buckets, cost model: {notes}]", file=sys.stderr, flush=True)
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (1024 if target.device.type == "cuda" else 0)
    server = build_server(target, tokenizer, model_name, proposer, tree, max_batch=args.max_batch,
                          max_len=args.max_len, max_queue=args.max_queue, buckets=buckets, bucket_trees=bucket_trees,
                          prefill_chunk=chunk or None)
    if args.warm_up == "on" or (args.warm_up == "auto" and target.device.type == "cuda"):
        seconds = server.engine.warm_up()
        done = "compiled and captured" if server.engine.cuda_graphs and target.device.type == "cuda" else "prepared"
        print(f"[longspec: batch buckets {server.engine.buckets} {done} in {seconds:.1f} s]",
              file=sys.stderr, flush=True)
    plain = "plain decoding"
    print(f"[longspec: serving {model_name} on http://{args.host}:{args.port}/v1 ({device}, {dtype}, proposer "
          f"{name}{f' tree {tree}' if tree else ''}"
          f"{''.join(f', bucket {b}: {t or plain}' for b, t in sorted(bucket_trees.items()))}, "
          f"{args.max_batch} rows of {args.max_len} tokens)]",
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_draft_vocab(args) -> int:
    """``longspec draft-vocab``: a copy of a draft that scores only the most frequent tokens."""
    from . import load_draft, load_target, save_draft
    from .training import frequent_tokens, load_tokenizer

    if args.size < 1:
        raise UsageError(f"--size must be >= 1, got {args.size}")
    target = load_target(args.target)
    draft = load_draft(args.draft, target)
    ids = frequent_tokens(args.data, load_tokenizer(args.target), args.size, target.config.vocab_size)
    draft.limit_vocab(ids)
    save_draft(draft, args.out)
    print(f"wrote {args.out}: the draft scores {draft.config.draft_vocab} of {target.config.vocab_size} tokens")
    return 0


def cmd_convert(args) -> int:
    from .convert import convert_gguf
    from .models.checkpoint import resolve_dtype

    out = convert_gguf(args.gguf, args.out, resolve_dtype(args.dtype))
    print(f"wrote {out}")
    return 0


def cmd_train(args) -> int:
    """``longspec train``: trains a LongSpec draft; under ``torchrun`` every process runs this."""
    import os

    import torch

    from .training import TrainConfig, train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = TrainConfig(
        target=args.target, data=args.data, out=args.out, seq_len=args.seq_len, batch_size=args.batch_size,
        grad_accum=args.grad_accum, steps=args.steps, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip, window=args.window,
        max_lag=args.max_lag, tree=args.tree, anchor_offset=not args.no_anchor_offset, noise=not args.no_noise,
        distill=args.distill, distill_weight=args.distill_weight, text_field=args.text_field,
        eval_fraction=args.eval_fraction, eval_every=args.eval_every, eval_chunks=args.eval_chunks,
        save_every=args.save_every, log_every=args.log_every, resume=args.resume, seed=args.seed,
        device=args.device, dtype=args.dtype, tokenizer=args.tokenizer, data_cache=args.data_cache,
        exclude=args.exclude,
        compile=args.compile == "on" or (args.compile == "auto" and device.startswith("cuda")),
        progress=not args.no_progress)
    result = train(config)
    last = result.history[-1] if result.history else {}
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"out": str(result.out), "step": result.step,
                          **{k: last[k] for k in ("loss", "eval_loss", "eval_acc") if k in last}}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longspec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a target model")
    gen.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct, converted once)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1, off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: none)")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object last (text, token_ids, stats)")
    gen.add_argument("--proposer", choices=["auto", "none", "pld", "streaming", "longspec", "hybrid"],
                     default="auto",
                     help="draft strategy: auto (the default: the hybrid with the tree a measured cost model "
                          "picks for this device where a draft exists, else pld), none (plain decoding), "
                          "pld (prompt lookup), streaming "
                          "(the target over a StreamingLLM cache, MagicDec), longspec (the LongSpec draft: "
                          "shipped for the default model, --draft DIR for other targets), hybrid (the LongSpec "
                          "draft's beam tree with a prompt-lookup chain merged in)")
    gen.add_argument("--tree", default=None,
                     help="tree shape: 'chain:5', per-depth beam widths '4,16,16,16,16' or static paths "
                          "'[[0],[1],[0,0]]' (default: chain:5 for pld, 4,16,16,16,16,1,1,1,1,1 for hybrid, "
                          "4,16,16,16,16 otherwise)")
    gen.add_argument("--draft", default=None, help="LongSpec draft directory (implies --proposer longspec; "
                                                   "the default model has a shipped draft)")
    gen.add_argument("--window", type=int, default=512, help="recent window of --proposer streaming (default: 512)")
    gen.add_argument("--threads", type=int, default=None,
                     help="CPU threads for PyTorch (default: PyTorch's choice; 1-2 is often fastest on a busy "
                          "small machine)")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    gen.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    gen.set_defaults(func=cmd_generate)

    sd = sub.add_parser("self-distill", help="chat requests about documents answered by the target (JSONL "
                                             "training data for --distill)")
    sd.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    sd.add_argument("--docs", nargs="+", required=True, help="files / directories of .md .rst .txt .py documents "
                                                             "(not the Python standard library)")
    sd.add_argument("--out", required=True, help="the JSONL file to write")
    sd.add_argument("--tasks", default="summarise,explain,continue,question", help="requests, one per document "
                                                                                   "in turn (default: all four)")
    sd.add_argument("--max-doc-tokens", type=int, default=3072, help="document tokens per request (default: 3072)")
    sd.add_argument("--max-new-tokens", type=int, default=256, help="answer tokens at most (default: 256)")
    sd.add_argument("--batch", type=int, default=8, help="requests answered together (default: 8)")
    sd.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    sd.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default: 0.95)")
    sd.add_argument("--seed", type=int, default=0, help="sampling and document-order seed (default: 0)")
    sd.add_argument("--limit", type=int, default=None, help="at most this many conversations (default: all)")
    sd.add_argument("--shard", default="0/1", help="I/N: answer only every N-th request from the I-th (one process "
                                                   "per GPU, same --seed; default: 0/1, all)")
    sd.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    sd.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    sd.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    sd.set_defaults(func=cmd_self_distill)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching")
    srv.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct, converted once)")
    srv.add_argument("--model-name", default=None, help="the model id clients use (default: the directory name)")
    srv.add_argument("--proposer", choices=["none", "pld", "streaming", "longspec", "hybrid"], default="none",
                     help="draft strategy, as for generate (default: none)")
    srv.add_argument("--tree", default=None, help="tree shape, as for generate")
    srv.add_argument("--draft", default=None, help="LongSpec draft directory (implies --proposer longspec)")
    srv.add_argument("--window", type=int, default=512, help="recent window of --proposer streaming (default: 512)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default: 8)")
    srv.add_argument("--max-len", type=int, default=4096, help="prompt + new tokens per request (default: 4096)")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; then 429 (default: 64)")
    srv.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    srv.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    srv.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    srv.add_argument("--buckets", default=None,
                     help="batch sizes a round runs at, comma-separated (default: powers of two up to --max-batch; "
                          "--max-batch is always one); fewer buckets, shorter warm-up, more idle rows computed")
    srv.add_argument("--bucket-trees", default="auto",
                     help="the tree each batch bucket drafts: auto (on CUDA, a cost model measured at start-up picks "
                          "for each bucket of 2 or more rows among trees that fit --tree; needs a draft with an "
                          "acceptance table; a bucket where no tree is predicted faster decodes plainly), off (--tree "
                          "everywhere) or 'B=TREE;B=TREE', e.g. '16=2,2,2' or '16=plain' (default: auto)")
    srv.add_argument("--prefill-chunk", type=int, default=None,
                     help="prefill arriving prompts in fixed-shape chunks of N tokens, each row's captured as a CUDA "
                          "graph at warm-up (less host work per arriving request; a large admission still goes as "
                          "one batched forward); 0 = always one eager prefill (default: 1024 on CUDA, 0 on a CPU)")
    srv.add_argument("--warm-up", choices=["auto", "on", "off"], default="auto",
                     help="compile and capture every batch bucket's greedy rounds before serving, so no request "
                          "waits for it (default: auto = on CUDA)")
    srv.add_argument("--log-level", default="warning", help="uvicorn's log level (default: warning)")
    srv.set_defaults(func=cmd_serve)

    dv = sub.add_parser("draft-vocab", help="reduce a draft's vocabulary to the most frequent tokens of some data",
                        description="Writes a copy of a LongSpec draft that scores only the --size most frequent "
                                    "tokens of --data (its training data) when drafting; verification still "
                                    "covers the whole vocabulary, so the output does not change.")
    dv.add_argument("--target", required=True, help="HF-format target model directory")
    dv.add_argument("--draft", required=True, help="draft directory")
    dv.add_argument("--data", required=True, nargs="+", help="text / JSONL files or source trees (the training data)")
    dv.add_argument("--size", type=int, default=8192, help="tokens kept (default: 8192)")
    dv.add_argument("--out", required=True, help="output draft directory")
    dv.set_defaults(func=cmd_draft_vocab)

    conv = sub.add_parser("convert", help="convert a GGUF checkpoint to an HF-format directory")
    conv.add_argument("--gguf", required=True, help="input .gguf file")
    conv.add_argument("--out", required=True, help="output directory")
    conv.add_argument("--dtype", default="float32")
    conv.set_defaults(func=cmd_convert)

    tr = sub.add_parser("train", help="train a LongSpec draft for a target (torchrun for several GPUs)",
                        description="Trains a LongSpec draft. Data parallel: torchrun --nproc_per_node N "
                                    "-m longspec.cli train ...")
    tr.add_argument("--target", required=True, help="HF-format target model directory (frozen)")
    tr.add_argument("--data", required=True, nargs="+",
                    help="text files, JSONL files (--text-field) and/or source-tree directories")
    tr.add_argument("--out", required=True, help="output directory: a draft loadable with load_draft")
    tr.add_argument("--seq-len", type=int, default=2048, help="tokens per training chunk")
    tr.add_argument("--batch-size", type=int, default=1, help="chunks per micro-batch per process")
    tr.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    tr.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, relative to --lr")
    tr.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    tr.add_argument("--window", type=int, default=512, help="draft self-attention window")
    tr.add_argument("--max-lag", type=int, default=None,
                    help="noisy cross-attention lags 1..G (default: the depth of --tree, 5 for the default beam tree)")
    tr.add_argument("--tree", default="4,16,16,16,16", help="the tree shape the draft will draft (default: 4,16,16,16,16)")
    tr.add_argument("--no-anchor-offset", action="store_true", help="plain positions 0..n-1 (ablation)")
    tr.add_argument("--no-noise", action="store_true", help="lag 1 always (ablation)")
    tr.add_argument("--distill", action="store_true", help="add KL(target || draft) to the loss")
    tr.add_argument("--distill-weight", type=float, default=1.0,
                    help="with --distill: loss = (1-w) CE + w KL (default 1: pure distillation)")
    tr.add_argument("--text-field", default="text", help="text field of JSONL records")
    tr.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    tr.add_argument("--eval-fraction", type=float, default=0.05, help="share of documents held out")
    tr.add_argument("--exclude", nargs="+", default=[], metavar="PATTERN",
                    help="glob patterns of top-level entries of source-tree --data to leave out (e.g. the packages "
                         "you evaluate on: --data SITE --exclude transformers 'rich*')")
    tr.add_argument("--data-cache", default=None,
                    help="directory keeping the tokenised data, keyed by the documents, settings and tokenizer: "
                         "later runs on the same data skip tokenising")
    tr.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations")
    tr.add_argument("--eval-chunks", type=int, default=64, help="held-out chunks per evaluation (0: all)")
    tr.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    tr.add_argument("--log-every", type=int, default=10, help="steps per metrics.jsonl row")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default=None, help="cpu, cuda ... (default: cuda if available)")
    tr.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                    help="the draft's forward and backward and the loss chunks through torch.compile (Inductor): "
                         "1.8x the tokens/s on the H200 with --distill (default: auto = on CUDA)")
    tr.set_defaults(func=cmd_train)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as err:  # UsageError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
