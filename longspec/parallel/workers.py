"""Tensor-parallel generation with its own worker processes, as ``vllm --tensor-parallel-size``
does: :class:`ParallelGenerator` starts ``N - 1`` follower processes (one device each), keeps the
calling process as rank 0 (the driver) and loads every rank's share of the target.

Each call of the driver is repeated by the followers on their own
:class:`~longspec.decoding.generator.Generator` (:class:`~longspec.parallel.mirror.Driver`):
every rank runs the same steps with the same tokens (the logits, gathered over the vocabulary,
are the same bits on every rank, so are the acceptance decisions; a sampled call draws from a
generator seeded identically everywhere: the driver picks a seed when the call has none)."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import GenerationConfig
from ..decoding.generator import Generator
from ..models.checkpoint import load_target
from .group import TensorParallel
from .mirror import Driver


@dataclass
class ParallelSpec:
    """What every rank builds: the target folder and dtype, the device type ("cpu": gloo, "cuda":
    NCCL, rank r on ``cuda:r``) and the Generator's settings (``draft``: a checkpoint folder)."""

    target: str
    dtype: str = "float32"
    device: str = "cpu"
    proposer: Optional[str] = None
    draft: Optional[str] = None
    tree: Optional[str] = None
    max_len: Optional[int] = None
    cuda_graphs: Optional[bool] = None
    window: int = 512
    threads: Optional[int] = None
    compile_steps: Optional[bool] = None  # None: load_target's default for the device


def build_generator(spec: ParallelSpec, tp: TensorParallel):
    """This rank's share of the target and a Generator over it."""
    if spec.proposer == "auto":
        raise ValueError("proposer 'auto' measures step times, which differ between ranks: pick one of none, pld, "
                         "streaming, longspec, hybrid under tensor parallelism")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    target = load_target(spec.target, spec.dtype, tensor_parallel=tp)
    if spec.compile_steps is not None:
        target.compile_steps = spec.compile_steps
    return Generator(target, spec.proposer, spec.tree, spec.max_len, spec.cuda_graphs, draft=spec.draft,
                     window=spec.window)


class ParallelGenerator:
    """A :class:`~longspec.decoding.generator.Generator` over a target split across
    ``tensor_parallel`` processes (one per device: ``cuda:0 ..`` with NCCL, or CPU processes with
    gloo). This process is rank 0 and must not hold a ``torch.distributed`` group of its own.

    ``target``: the checkpoint folder (each rank reads its slices); ``draft``: a draft folder
    (replicated on every rank); the other arguments as for Generator. :meth:`generate` takes and
    returns what ``Generator.generate`` does; call :meth:`close` (or use ``with``) to stop the
    workers."""

    def __init__(self, target, tensor_parallel: int, proposer: Optional[str] = None, draft=None, tree=None,
                 dtype: str = "float32", device: Optional[str] = None, max_len: Optional[int] = None,
                 cuda_graphs: Optional[bool] = None, window: int = 512, threads: Optional[int] = None,
                 compile_steps: Optional[bool] = None):
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a positive number of processes, got {tensor_parallel!r}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (rank r uses cuda:r), got {device!r}")
        if device == "cuda" and torch.cuda.device_count() < tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} GPUs, "
                             f"{torch.cuda.device_count()} visible")
        self.spec = ParallelSpec(str(Path(target)), str(dtype).replace("torch.", ""), device, proposer,
                                 None if draft is None else str(draft), None if tree is None else str(tree), max_len,
                                 cuda_graphs, window, threads or torch.get_num_threads(), compile_steps)
        self.driver = Driver(build_generator, self.spec, tensor_parallel, device, local=("streamer",))
        self.generator = self.driver.obj

    @property
    def target(self):
        """Rank 0's share of the target (its config is the whole model's)."""
        return self.generator.target

    def generate(self, prompts, config: Optional[GenerationConfig] = None, streamer=None):
        """As ``Generator.generate``, on every rank; ``streamer`` runs on the driver only. An
        unseeded sampled call gets a fresh seed here, the same on every rank."""
        config = config or GenerationConfig()
        if not config.greedy and config.seed is None:
            config = dataclasses.replace(config, seed=random.SystemRandom().randrange(2 ** 62))
        return self.call("generate", prompts, config, streamer=streamer)

    def call(self, name: str, *args, **kwargs):
        """Calls ``Generator.<name>(*args, **kwargs)`` on every rank (``streamer``: on the driver
        only) and returns the driver's result; raises if the ranks' outputs differ."""
        if isinstance(prompts := args[0] if args else None, torch.Tensor):
            args = (prompts.tolist(), *args[1:])
        return self.driver.call(name, *args, **kwargs)

    def close(self) -> None:
        """Stops the followers and leaves the process group."""
        self.driver.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
