"""The commands of the ``longspec`` command line that make or convert checkpoints instead of
generating: ``train`` (a LongSpec draft), ``self-distill`` (its training data, answered by the
target), ``draft-vocab`` (a draft that scores only the most frequent tokens) and ``convert`` (a
GGUF checkpoint into a Hugging Face-format directory). As in :mod:`~longspec.cli.commands`, each
command imports the library when it runs, so ``longspec --help`` imports no PyTorch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..status import status
from .commands import UsageError, _device_and_dtype, _set_threads


def cmd_self_distill(args) -> int:
    """``longspec self-distill``: chat requests about documents answered by the target (JSONL)."""
    from .. import load_target
    from ..convert import default_model_dir
    from ..training.selfdistill import TASKS, self_distill

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
    status(f"loading {target_dir} on {device} ({dtype})")
    target = load_target(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    status(f"answering chat requests about the documents into {args.out}")
    try:
        n = self_distill(target, tokenizer, args.docs, args.out, tasks, args.max_doc_tokens, args.max_new_tokens,
                         args.batch, args.temperature, args.top_p, args.seed, limit=args.limit, shard=shard)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(f"[longspec: {n} conversations written to {args.out}]", file=sys.stderr)
    return 0


def cmd_draft_vocab(args) -> int:
    """``longspec draft-vocab``: a copy of a draft that scores only the most frequent tokens."""
    from .. import load_draft, load_target, save_draft
    from ..training import frequent_tokens, load_tokenizer

    if args.size < 1:
        raise UsageError(f"--size must be >= 1, got {args.size}")
    from ..outdir import check_out_dir

    check_out_dir(args.out, inputs=[args.target, args.draft], force=args.force)
    status(f"loading {args.target} and the draft {args.draft}")
    target = load_target(args.target)
    draft = load_draft(args.draft, target)
    status(f"counting token frequencies in {' '.join(args.data)}")
    ids = frequent_tokens(args.data, load_tokenizer(args.target), args.size, target.config.vocab_size)
    draft.limit_vocab(ids)
    save_draft(draft, args.out)
    print(f"wrote {args.out}: the draft scores {draft.config.draft_vocab} of {target.config.vocab_size} tokens")
    return 0


def cmd_convert(args) -> int:
    from ..convert import convert_gguf
    from ..models.checkpoint import resolve_dtype

    out = convert_gguf(args.gguf, args.out, resolve_dtype(args.dtype), force=args.force, tokenizer_dir=args.tokenizer)
    print(f"wrote {out}")
    return 0


def cmd_train(args) -> int:
    """``longspec train``: trains a LongSpec draft; under ``torchrun`` every process runs this."""
    import os

    from ..training import TrainConfig, train

    config = TrainConfig(
        target=args.target, data=args.data, out=args.out, seq_len=args.seq_len, batch_size=args.batch_size,
        grad_accum=args.grad_accum, steps=args.steps, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip, window=args.window,
        max_lag=args.max_lag, tree=args.tree, anchor_offset=not args.no_anchor_offset, noise=not args.no_noise,
        distill=args.distill, distill_weight=args.distill_weight, intermediate_size=args.intermediate_size, init_from=args.init_from, text_field=args.text_field,
        eval_fraction=args.eval_fraction, eval_every=args.eval_every, eval_chunks=args.eval_chunks,
        save_every=args.save_every, log_every=args.log_every, resume=args.resume, force=args.force, seed=args.seed,
        device=args.device, dtype=args.dtype, tokenizer=args.tokenizer, data_cache=args.data_cache,
        exclude=args.exclude,
        compile={"on": True, "off": False, "auto": None}[args.compile],
        progress=not args.no_progress)
    result = train(config)
    last = result.history[-1] if result.history else {}
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"out": str(result.out), "step": result.step,
                          **{k: last[k] for k in ("loss", "eval_loss", "eval_acc") if k in last}}))
    return 0
