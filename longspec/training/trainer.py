"""The draft trainer: single process, or data parallel under ``torchrun`` (DDP over the draft;
the frozen target is a plain module on every rank).

One optimizer step consumes a *global batch* of ``batch_size x world x grad_accum`` chunks: the
global sample ids ``samples_seen .. samples_seen + G - 1`` map to chunks through a seeded
permutation per epoch; the step's lag and every sample's anchor offset are drawn from seeded
generators that every rank advances identically; rank ``r`` runs micro-batch ``a`` on the
samples ``(a * world + r) * batch_size + 0..batch_size-1``. Losses are token sums divided by the
global prediction count, so a run gives the same result (up to float summation order) for any
split of the same global batch into ranks and accumulation steps.

A run around the trainer (loading the target and the data, logging, evaluation and checkpoint
cadence) is :func:`longspec.training.run.train`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..models.checkpoint import load_draft, read_draft_config
from ..models.draft import DraftConfig, init_draft
from ..spec.tree import TreeSpec
from . import distributed
from .checkpoints import save_checkpoint
from .data import PackedData
from .loss import DraftLoss, target_forward
from .positions import anchor_offset_positions, sample_lag

STATE_VERSION = 1


@dataclass
class TrainConfig:
    """Settings of a training run (the ``longspec train`` options)."""

    target: str = ""  # HF-format target directory
    data: list = field(default_factory=list)  # text / JSONL files, source-tree directories
    out: str = ""  # output directory: a loadable draft + checkpoints + metrics.jsonl
    seq_len: int = 2048
    batch_size: int = 1  # chunks per micro-batch on each rank
    grad_accum: int = 1  # micro-batches per optimizer step
    steps: int = 1000  # optimizer steps in total
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup: int = 100  # linear warm-up steps
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm (0: off)
    window: int = 512  # draft self-attention window
    # G: lags 1..G for noisy cross-attention. A tree of depth D queries the target cache at lags
    # 1 (re-read tokens, root) to D (its deepest drafting level), so G defaults to the tree's depth.
    max_lag: Optional[int] = None
    tree: str = "4,16,16,16,16"  # the tree the draft will be used with (sets the default max_lag)
    anchor_offset: bool = True
    noise: bool = True
    distill: bool = False  # objective (1 - w) CE + w KL(target || draft)
    distill_weight: float = 1.0  # w
    intermediate_size: Optional[int] = None  # the draft's MLP width (default: the target's)
    init_from: Optional[str] = None  # a draft directory whose weights start the run (warm start)
    text_field: str = "text"
    eval_fraction: float = 0.05  # share of documents held out (by sha256 of the name)
    eval_every: int = 200  # steps (0: only at the end)
    eval_chunks: int = 64  # held-out chunks per evaluation, spread over the held-out set (0: all)
    save_every: int = 500  # steps (0: only at the end)
    keep_checkpoints: int = 2
    log_every: int = 10  # steps averaged into one metrics row
    resume: bool = False  # continue from OUT's latest checkpoint (start fresh when there is none)
    force: bool = False  # write into an OUT that holds other files (never a target's or source's folder)
    seed: int = 0
    device: Optional[str] = None  # default: cuda (cuda:LOCAL_RANK under torchrun) if available
    dtype: Optional[str] = None  # target dtype and autocast dtype; default bf16 on CUDA, fp32 on CPU
    tokenizer: Optional[str] = None  # default: the target directory
    max_file_bytes: int = 1 << 20  # files of a source tree above this are skipped
    data_cache: Optional[str] = None  # directory keeping tokenised data for later runs
    exclude: list = field(default_factory=list)  # glob patterns of source-tree entries left out
    progress: bool = True  # tqdm bar on rank 0
    compile: Optional[bool] = False  # the draft's forward/backward and loss chunks compiled (None: on CUDA)

    def validate(self) -> None:
        if self.max_lag is None:
            self.max_lag = TreeSpec.parse(self.tree).depth
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "max_lag", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        for name in ("warmup", "eval_every", "save_every", "eval_chunks", "grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.distill_weight <= 1:
            raise ValueError("min_lr_ratio and distill_weight must be in [0, 1]")
        if self.seq_len < self.max_lag + 2:
            raise ValueError(f"seq_len {self.seq_len} leaves no prediction at lag {self.max_lag}: "
                             f"use seq_len >= max_lag + 2")
        if not self.out:
            raise ValueError("no output directory (--out)")


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up over ``warmup`` steps, then
    cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(config.steps - config.warmup - 1, 1)
    progress = min((step - config.warmup) / span, 1.0)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def sample_chunks(first: int, count: int, n_chunks: int, seed: int) -> torch.Tensor:
    """Chunk indices [count] of global samples ``first..first+count-1``: epoch ``e`` visits the
    chunks in a permutation seeded by ``(seed, e)`` (a pure function: resuming needs only the
    sample counter)."""
    ids = torch.arange(first, first + count)
    out = torch.empty(count, dtype=torch.long)
    for epoch in ids.div(n_chunks, rounding_mode="floor").unique().tolist():
        perm = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        sel = ids // n_chunks == epoch
        out[sel] = perm[ids[sel] % n_chunks]
    return out


def initial_draft(config: TrainConfig, target, source: Optional[Path] = None, resume: bool = False):
    """The float32 draft a run starts from: a fresh one (``source`` None), or one with the
    architecture (head norm, biases, MLP width, reduced vocabulary) of the draft at ``source``:
    ``--init-from``'s draft with its float32 weights (a warm start; its stale acceptance table is
    dropped), or with ``resume`` the run's checkpoint, whose weights the caller loads next (with
    its trainer state). Raises ValueError when it does not fit this run."""
    if source is None:
        widths = {"intermediate_size": config.intermediate_size} if config.intermediate_size else {}
        return init_draft(DraftConfig.for_target(target, window=config.window, **widths), target,
                          seed=config.seed).float()
    c = read_draft_config(source, target)[0]
    for name, ours, theirs in (("window", config.window, c.window),
                               ("intermediate_size", config.intermediate_size or c.intermediate_size,
                                c.intermediate_size)):
        if ours != theirs:
            raise ValueError(f"{source}: the draft there has {name} {theirs}, this run asks for {ours}")
    if resume:
        return init_draft(c, target, seed=config.seed).float()
    torch.manual_seed(config.seed)  # as init_draft seeds a fresh run
    draft = load_draft(source, target, dtype=torch.float32, fuse=False)
    draft.config.acceptance = []
    return draft


def held_out_sample(n: int, k: int) -> torch.Tensor:
    """Indices [min(k, n)] (long) of the held-out chunks one evaluation scores: ``k`` spread evenly
    from the first chunk to the last (all of them for ``k`` 0 or >= n). The held-out chunks come
    document after document, so the first ``k`` alone could all be one file's."""
    if k == 0 or k >= n:
        return torch.arange(n)
    return torch.linspace(0, n - 1, k).round().long()


class Trainer:
    """Holds a run's state; :func:`~longspec.training.run.train` is the entry point."""

    def __init__(self, config: TrainConfig, env: distributed.DistEnv, target, data: PackedData,
                 checkpoint: Optional[Path] = None):
        """``checkpoint``: the run's checkpoint to resume (its draft's architecture is used; the
        caller loads its state)."""
        self.config, self.env, self.target, self.data = config, env, target, data
        target.requires_grad_(False).eval()
        source = checkpoint if checkpoint is not None else (Path(config.init_from) if config.init_from else None)
        self.draft = initial_draft(config, target, source, resume=checkpoint is not None).train()
        compiled = config.compile if config.compile is not None else env.device.type == "cuda"
        self.loss = DraftLoss(self.draft, config.distill_weight, compile=compiled)
        self.model = self.loss
        if env.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # the modules' buffers (RoPE frequencies, the draft's vocabulary subset) are constants:
            # no broadcast before every forward (the option's newer name where PyTorch has it)
            import inspect

            renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
            no_buffer_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
            self.model = DDP(self.loss, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                             gradient_as_bucket_view=True, **no_buffer_sync)
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=config.lr, betas=tuple(config.betas),
                                           weight_decay=config.weight_decay)
        self.offset_gen = torch.Generator().manual_seed(config.seed + 1)
        self.lag_gen = torch.Generator().manual_seed(config.seed + 2)
        self.step = 0
        self.samples_seen = 0
        self.amp_dtype = target.dtype if target.dtype != torch.float32 else None
        self.cache = None  # the target's KV cache, reused across micro-batches of one shape
        self.max_pos = target.config.max_position_embeddings

    # ------------------------------------------------------------------------------ batches
    @property
    def global_batch(self) -> int:
        return self.config.batch_size * self.env.world * self.config.grad_accum

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=self.amp_dtype)

    def _forward(self, model, ids, positions, lag):
        """Target forward (no grad) then draft loss sums for one micro-batch on this rank."""
        if self.env.device.type == "cuda":  # pinned + asynchronous: a pageable copy waits for the GPU
            ids, positions = (x.pin_memory().to(self.env.device, non_blocking=True) for x in (ids, positions))
        else:
            ids, positions = ids.to(self.env.device), positions.to(self.env.device)
        b, t = ids.shape
        if self.cache is None or self.cache.batch_size != b or self.cache.max_len != t:
            self.cache = self.target.new_cache(b, t)
        tgt = target_forward(self.target, ids, positions, want_hidden=self.config.distill, cache=self.cache)
        with self._autocast():
            return model(ids, positions, tgt.k, tgt.v, lag, tgt.hidden)

    def train_step(self) -> dict:
        """One optimizer step over a global batch, without a host synchronisation: returns this
        rank's loss sums (``stats``: float64 [4] on the device) and the gradient norm as device
        tensors, with the step's lr, lag and token count; :meth:`step_metrics` turns a list of
        them into global metrics (one synchronisation and one all-reduce for the whole list)."""
        c, env = self.config, self.env
        lr = lr_at(self.step, c)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        lag = sample_lag(self.lag_gen, c.max_lag, c.noise)
        g = self.global_batch
        chunks = sample_chunks(self.samples_seen, g, self.data.train.shape[0], c.seed)
        positions = anchor_offset_positions(g, c.seq_len, self.max_pos, self.offset_gen, c.anchor_offset)
        n_global = g * (c.seq_len - 1 - lag)
        stats = torch.zeros(4, dtype=torch.float64, device=env.device)
        for a in range(c.grad_accum):
            rows = slice((a * env.world + env.rank) * c.batch_size, (a * env.world + env.rank + 1) * c.batch_size)
            sync = a == c.grad_accum - 1 or not env.distributed
            with contextlib.nullcontext() if sync else self.model.no_sync():
                sums = self._forward(self.model, self.data.train[chunks[rows]], positions[rows], lag)
                (sums.objective * (env.world / n_global)).backward()
            stats += sums.stats()
        norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), c.grad_clip if c.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples_seen += g
        return {"step": self.step, "stats": stats, "grad_norm": norm.detach(), "lr": lr, "lag": lag,
                "tokens": g * c.seq_len}

    def step_metrics(self, pending: list) -> list:
        """Global metrics of the steps ``pending`` (what :meth:`train_step` returned): loss, ce,
        acc, (kl,) lr, lag, grad_norm, tokens per step. Raises FloatingPointError at the first
        step whose loss is not finite."""
        if not pending:
            return []
        c = self.config
        stats = torch.stack([p["stats"] for p in pending])
        norms = torch.stack([p["grad_norm"].double() for p in pending]).tolist()
        self.env.all_reduce_sum(stats)
        rows = []
        for p, (ce, kl, correct, count), norm in zip(pending, stats.tolist(), norms):
            loss = ((1 - c.distill_weight) * ce + c.distill_weight * kl if c.distill else ce) / count
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite training loss at step {p['step']}")
            out = {"loss": loss, "ce": ce / count, "acc": correct / count, "lr": p["lr"], "lag": p["lag"],
                   "grad_norm": norm, "tokens": p["tokens"]}
            if c.distill:
                out["kl"] = kl / count
            rows.append(out)
        return rows

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out CE (``eval_loss``), top-1 accuracy (``eval_acc``) and, with distillation,
        KL, over ``eval_chunks`` held-out chunks spread evenly over the held-out set
        (:func:`held_out_sample`). Chunk ``j`` uses lag
        ``1 + j % max_lag`` (1 without noise) and anchor offsets from a fixed seed: every
        evaluation sees the same inputs, independent of batching and ranks."""
        c, env = self.config, self.env
        chunks = self.data.eval[held_out_sample(self.data.eval.shape[0], c.eval_chunks)]
        m = chunks.shape[0]
        if m == 0:
            return {}
        gen = torch.Generator().manual_seed(c.seed + 3)
        positions = anchor_offset_positions(m, c.seq_len, self.max_pos, gen, c.anchor_offset)
        lags = [1 + j % c.max_lag if c.noise else 1 for j in range(m)]
        mine = [j for j in range(m) if j % env.world == env.rank]
        stats = torch.zeros(4, dtype=torch.float64, device=env.device)
        was_training = self.draft.training
        self.draft.eval()
        for lag in sorted(set(lags)):
            group = [j for j in mine if lags[j] == lag]
            for i in range(0, len(group), c.batch_size):
                idx = torch.tensor(group[i:i + c.batch_size], dtype=torch.long)
                stats += self._forward(self.loss, chunks[idx], positions[idx], lag).stats()
        self.draft.train(was_training)
        env.all_reduce_sum(stats)
        ce, kl, correct, count = stats.tolist()
        out = {"eval_loss": ce / count, "eval_acc": correct / count}
        if c.distill:
            out["eval_kl"] = kl / count
        return out

    # ------------------------------------------------------------------------------ state
    def state(self) -> dict:
        """Everything besides the draft weights needed to continue bit for bit."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {"version": STATE_VERSION, "step": self.step, "samples_seen": self.samples_seen,
                "optimizer": self.optimizer.state_dict(), "offset_rng": self.offset_gen.get_state(),
                "lag_rng": self.lag_gen.get_state(), "torch_rng": torch.get_rng_state(), "cuda_rng": cuda,
                "python_rng": random.getstate(), "world_size": self.env.world, "global_batch": self.global_batch,
                "train_chunks": self.data.train.shape[0],
                "config": json.loads(config_json(self.config))}

    def load_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported trainer state version {state.get('version')!r}")
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.offset_gen.set_state(state["offset_rng"])
        self.lag_gen.set_state(state["lag_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available() and len(state["cuda_rng"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])
        if state.get("train_chunks") != self.data.train.shape[0] and self.env.is_main:
            print(f"[longspec train] warning: the data now packs into {self.data.train.shape[0]} chunks, "
                  f"the checkpoint was trained on {state.get('train_chunks')}: the sample order changes",
                  file=sys.stderr)

    def save(self) -> Path:
        return save_checkpoint(self.config.out, self.step, self.draft, self.state(), self.config.keep_checkpoints)


def config_json(config: TrainConfig) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2, default=str)
