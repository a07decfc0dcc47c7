"""``longspec serve --tensor-parallel N``: every rank builds the same serving engine over its share
of the target; rank 0's server worker makes its engine calls through a
:class:`~longspec.parallel.mirror.Driver`, so the other ranks repeat them (they never see HTTP)."""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..models.checkpoint import load_target
from ..serving.engine_calls import EngineCalls, build_engine
from ..spec.proposers import build_proposer
from .group import TensorParallel
from .mirror import Driver


@dataclass
class EngineSpec:
    """What every rank builds: the target folder, dtype and device type ("cpu": gloo, "cuda":
    NCCL, rank r on ``cuda:r``), the proposer (``draft``: a folder, None: the default model's
    shipped draft) and the engine's settings (``bucket_trees`` chosen on rank 0). ``seed``: the
    unseeded requests' shared generator, the same on every rank."""

    target: str
    dtype: str
    device: str
    proposer: str = "none"
    draft: Optional[str] = None
    tree: Optional[str] = None
    window: int = 512
    threads: Optional[int] = None
    max_batch: int = 8
    max_len: int = 4096
    buckets: Optional[list] = None
    bucket_trees: dict = field(default_factory=dict)
    prefill_chunk: Optional[int] = None
    prefix_cache: bool = True
    compile_steps: bool = True  # False: CUDA graphs of uncompiled steps (``longspec serve --no-compile``)
    seed: int = field(default_factory=lambda: random.SystemRandom().randrange(2 ** 62))


def build_engine_calls(spec: EngineSpec, tp: TensorParallel):
    """This rank's share of the target, its proposer and engine, as :class:`EngineCalls`."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    target = load_target(spec.target, spec.dtype, tensor_parallel=tp)
    target.compile_steps = target.compile_steps and spec.compile_steps
    proposer = build_proposer(spec.proposer, target, spec.draft, window=spec.window)
    calls = EngineCalls(build_engine(target, proposer, spec.tree, spec.max_batch, spec.max_len, spec.buckets,
                                     spec.bucket_trees, spec.prefill_chunk, spec.prefix_cache))
    calls.seed_shared(spec.seed)
    return calls


class ParallelEngine:
    """Rank 0's engine of a tensor-parallel server: ``engine`` (read it freely) and ``calls``
    (what changes it, repeated on every rank; a ``streamer`` stays on rank 0)."""

    def __init__(self, spec: EngineSpec, tensor_parallel: int):
        self.driver = Driver(build_engine_calls, spec, tensor_parallel, spec.device, local=("streamer",))
        self.engine = self.driver.obj.engine
        self.calls = _Calls(self.driver)

    def close(self) -> None:
        self.driver.close()


class _Calls:
    """``calls.name(...)``: ``driver.call("name", ...)``."""

    def __init__(self, driver: Driver):
        self._driver = driver

    def __getattr__(self, name: str):
        return functools.partial(self._driver.call, name)
