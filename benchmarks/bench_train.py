"""Training throughput of the draft trainer: tokens/s of ``Trainer.train_step`` on a random-weight
target of a known shape (step time does not depend on the weights' values) with random token
chunks, for several micro-batch sizes and loss chunk sizes, with the peak memory. Steps are timed
as the trainer runs them: ``--steps`` back to back without host synchronisation (after a warm-up
that compiles every lag), the mean step time. Prints a table and one JSON line last.

    python benchmarks/bench_train.py --shape smollm2 --seq-len 2048 --batch 8,16,32 --chunk 4096,0

``--chunk 0`` computes the LM-head loss of a whole micro-batch at once (the [tokens, vocab]
logits materialised, as before the chunked loss); other values bound the rows of logits alive
at a time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time

import torch

from bench_steps import SHAPES, random_target
from longspec.training.data import PackedData
from longspec.training import distributed
from longspec.training.trainer import TrainConfig, Trainer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", default="8,16,32", help="micro-batch sizes")
    p.add_argument("--chunk", default="4096,0", help="loss chunk rows (0: whole micro-batch)")
    p.add_argument("--steps", type=int, default=12, help="timed steps after 3 warm-up steps")
    p.add_argument("--distill", action="store_true")
    p.add_argument("--compile", default="off", help="off, on or off,on: the draft's forward through torch.compile")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="after timing, the kernels and host ops of 3 steps")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    env = distributed.setup(args.device)  # under torchrun: one rank per GPU, the draft in DDP
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    target = random_target(args.shape, torch.bfloat16 if cuda else torch.float32, env.device)
    vocab = target.config.vocab_size
    rows = []
    for batch, chunk, compiled in itertools.product(map(int, args.batch.split(",")), map(int, args.chunk.split(",")),
                                                    [c == "on" for c in args.compile.split(",")]):
        data = PackedData(torch.randint(0, vocab, (max(64, 4 * batch), args.seq_len)),
                          torch.randint(0, vocab, (4, args.seq_len)), 1, 1)
        with tempfile.TemporaryDirectory() as out:
            config = TrainConfig(target="random", data=[], out=out, seq_len=args.seq_len, batch_size=batch,
                                 steps=args.steps + 40, distill=args.distill, progress=False, compile=compiled)
            config.validate()
            trainer = Trainer(config, env, target, data)
            trainer.loss.chunk = chunk or batch * args.seq_len
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                lags, warm = set(), 0  # warm-up: every lag's shapes compiled once (or 40 steps)
                while warm < 3 or (len(lags) < (config.max_lag if config.noise else 1) and warm < 40):
                    lags.add(trainer.train_step()["lag"])
                    warm += 1
                # timed as training runs: steps back to back, no host synchronisation between them
                sync()
                t = time.perf_counter()
                pending = [trainer.train_step() for _ in range(args.steps)]
                sync()
                sec = (time.perf_counter() - t) / args.steps
                trainer.step_metrics(pending)  # checks the losses are finite
                if args.profile:
                    profile_steps(trainer, env, cuda)
                row = dict(batch=batch, chunk=chunk, compile=compiled, seq_len=args.seq_len, step_s=sec,
                           ranks=env.world, tokens_per_s=batch * env.world * args.seq_len / sec,
                           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"))
            except torch.OutOfMemoryError:
                row = dict(batch=batch, chunk=chunk, compile=compiled, seq_len=args.seq_len, step_s=float("nan"),
                           ranks=env.world, tokens_per_s=float("nan"), peak_gib=float("nan"), error="out of memory")
            rows.append(row)
            if env.is_main:
                print(f"ranks {env.world} batch {batch:3} chunk {chunk:6} compile {'on ' if compiled else 'off'}: "
                      f"{row['tokens_per_s'] / 1e3:8.1f} k tokens/s, step {row['step_s'] * 1e3:7.1f} ms, "
                      f"peak {row['peak_gib']:.1f} GiB", flush=True)
            del trainer
            if cuda:
                torch.cuda.empty_cache()
    if env.is_main:
        print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": args.shape,
                          "distill": args.distill, "results": rows}))
    env.close()


def profile_steps(trainer, env, cuda: bool, steps: int = 3) -> None:
    """Prints (rank 0) the device kernels and the host ops of ``steps`` training steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        pending = [trainer.train_step() for _ in range(steps)]
        trainer.step_metrics(pending)
        if cuda:
            torch.cuda.synchronize()
    if env.is_main:
        averages = prof.key_averages()
        if cuda:
            print(averages.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
