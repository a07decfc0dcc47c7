"""A training run (:func:`train`, what ``longspec train`` calls on every process): the output
directory checked, the target and the tokenised data loaded, the :class:`~longspec.training.trainer.Trainer`
built or resumed from the latest checkpoint, then its steps, with metrics rows averaged over each
logging window (``metrics.jsonl``, a progress bar or one line per row), held-out evaluations and
checkpoints at their cadence. Apart from the trainer, which holds what one step needs.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..models.checkpoint import load_target, resolve_dtype
from ..outdir import check_out_dir
from . import distributed
from .checkpoints import MetricsLog, latest_checkpoint, load_checkpoint, remove_leftovers, write_atomic
from .data import DataConfig, build_data, check_seq_len, load_tokenizer
from .trainer import TrainConfig, Trainer, config_json


@dataclass
class TrainResult:
    """What :func:`train` returns: the trained draft (unwrapped, float32), the step reached,
    the metrics rows of this run and the output directory."""

    draft: torch.nn.Module
    step: int
    history: list
    out: Path


def _progress(config: TrainConfig, env, start: int):
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=start, disable=not (config.progress and env.is_main),
                unit="step", dynamic_ncols=True, file=sys.stderr)


def _row_line(row: dict) -> str:
    """A metrics row as one short line: step, loss, accuracy, tokens/s and the held-out metrics."""
    names = {"loss": "loss {:.4f}", "acc": "acc {:.3f}", "tokens_per_s": "{:.0f} tokens/s",
             "eval_loss": "held-out loss {:.4f}", "eval_acc": "held-out acc {:.3f}"}
    return f"step {row['step']}: " + ", ".join(f.format(row[k]) for k, f in names.items() if k in row)


def _mean_rows(rows: list, seconds: float) -> dict:
    """Averages the per-step metrics of a logging window; throughput over its wall time."""
    keys = [k for k in rows[0] if k not in ("tokens", "lr", "lag")]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    out["lr"] = rows[-1]["lr"]
    out["tokens_per_s"] = sum(r["tokens"] for r in rows) / max(seconds, 1e-9)
    return out


def train(config: TrainConfig, tokenizer=None, target=None,
          callback: Optional[Callable[[int, dict], None]] = None) -> TrainResult:
    """Trains a LongSpec draft for ``config.target`` on ``config.data`` (see the module and
    :class:`TrainConfig` docs). ``tokenizer`` (anything with ``encode``) and ``target`` (a loaded
    :class:`~longspec.models.target.TargetModel`) override loading them from ``config.target``.
    ``callback(step, metrics)`` runs on every rank after each step (an exception it raises stops
    training like a kill would: nothing is saved beyond the last checkpoint). Under torchrun give
    it on every rank or on none: it makes every step read its metrics, an all-reduce.

    Raises ValueError for bad settings or data, and when ``out`` already holds a run and
    ``resume`` is not set."""
    config.validate()
    env = distributed.setup(config.device)
    try:
        result = _run(config, env, tokenizer, target, callback)
        env.barrier()  # every rank done with the group before one tears it down (see DistEnv.close)
        return result
    finally:
        env.close()


def _run(config, env, tokenizer, target, callback) -> TrainResult:
    inputs = [config.target, config.tokenizer, config.init_from, getattr(target, "path", None)]
    out = check_out_dir(config.out, inputs=inputs, force=config.force)
    if env.is_main:
        remove_leftovers(out)
    if target is None:
        if not config.target:
            raise ValueError("no target model (--target)")
        dtype = resolve_dtype(config.dtype or ("bfloat16" if env.device.type == "cuda" else "float32"))
        if dtype == torch.float16:
            raise ValueError("float16 training is not supported (no loss scaling): use bfloat16 or float32")
        target = load_target(config.target, dtype=dtype, device=env.device)
    elif target.device != env.device:
        target = target.to(env.device)
    check_seq_len(config.seq_len, target.config.max_position_embeddings)  # before tokenising anything
    if tokenizer is None:
        tokenizer = load_tokenizer(config.tokenizer or config.target)
    if env.is_main:
        print(f"[longspec train] reading and tokenizing {', '.join(map(str, config.data))}", file=sys.stderr,
              flush=True)
    data = build_data(DataConfig(config.data, config.seq_len, config.text_field, config.eval_fraction,
                                 config.max_file_bytes, tuple(config.exclude)), tokenizer, target.config.max_position_embeddings,
                      target.config.vocab_size, cache_dir=config.data_cache, write_cache=env.is_main,
                      progress=config.progress if env.is_main else None)
    checkpoint = latest_checkpoint(out)
    if checkpoint is not None and not config.resume:
        raise ValueError(f"{out} already holds a training run (checkpoint {checkpoint.name}): pass --resume to "
                         f"continue it, or choose another --out")
    env.barrier()
    trainer = Trainer(config, env, target, data, checkpoint)
    log = MetricsLog(out, enabled=env.is_main)
    if checkpoint is not None:
        trainer.load_state(load_checkpoint(checkpoint, trainer.draft))
    log.truncate_after(trainer.step if checkpoint is not None else -1)  # rows of lost / abandoned steps
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "train_config.json", lambda f: Path(f).write_text(config_json(config)))
        note = f"resuming at step {trainer.step}" if checkpoint is not None else "starting"
        print(f"[longspec train] {data.summary()}; {env.world} process(es), global batch {trainer.global_batch} "
              f"x {config.seq_len} tokens; {note}", file=sys.stderr)
        if data.eval.shape[0] == 0:
            print("[longspec train] warning: no held-out chunk (too few held-out documents / tokens): "
                  "no evaluation", file=sys.stderr)
        if trainer.loss.compiled:
            print("[longspec train] compiling the draft's step (its first evaluation and steps take a minute or "
                  "two)", file=sys.stderr, flush=True)
    history, window, pending = [], [], []

    def record(row: dict) -> None:
        log.write(row)
        history.append(row)
        if env.is_main and not config.progress:  # no bar: one line per logged row (e.g. in a log file)
            print(f"[longspec train] {_row_line(row)}", file=sys.stderr, flush=True)

    if config.eval_every and trainer.step == 0 and data.eval.shape[0]:
        record({"step": 0, **trainer.evaluate()})  # the untrained draft: a baseline
    bar = _progress(config, env, trainer.step)
    # Steps run without host synchronisation; their metrics are read (one sync, one all-reduce)
    # where they are needed: logging, evaluation, checkpoints, the last step, and after every
    # step when a callback wants them. ``elapsed``: training wall time of the logging window.
    elapsed, clock = 0.0, time.perf_counter()
    try:
        while trainer.step < config.steps:
            pending.append(trainer.train_step())
            step = trainer.step
            bar.update(1)
            log_now = step % config.log_every == 0 or step == config.steps
            eval_now = (config.eval_every and step % config.eval_every == 0) or step == config.steps
            save_now = (config.save_every and step % config.save_every == 0) or step == config.steps
            if not (log_now or eval_now or save_now or callback is not None):
                continue
            done, pending = trainer.step_metrics(pending), []
            elapsed += time.perf_counter() - clock
            window += done
            row = None
            if log_now:
                row = {"step": step, **_mean_rows(window, elapsed)}
                window, elapsed = [], 0.0
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.2f}",
                                tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            if eval_now:
                row = {"step": step, **(row or {}), **trainer.evaluate()}
            if row is not None:
                record(row)
            if env.is_main and save_now:
                trainer.save()
            if callback is not None:
                callback(step, done[-1])
            clock = time.perf_counter()
    finally:
        bar.close()
    env.barrier()
    return TrainResult(trainer.draft, trainer.step, history, out)
