"""Tensor-parallel generation with its own worker processes, as ``vllm --tensor-parallel-size``
does: :class:`ParallelGenerator` starts ``N - 1`` follower processes (one device each), keeps the
calling process as rank 0 (the driver) and loads every rank's share of the target.

Each call of the driver is broadcast to the followers, which make the same call on their own
:class:`~longspec.decoding.generator.Generator`: every rank runs the same steps with the same
tokens (the logits, gathered over the vocabulary, are the same bits on every rank, so are the
acceptance decisions; a sampled call draws from a generator seeded identically everywhere: the
driver picks a seed when the call has none). After each call the ranks compare a digest of
their outputs, so a rank that went its own way is an error, not silent garbage."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import GenerationConfig
from .group import TensorParallel, join


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
    from ..decoding.generator import Generator
    from ..models.checkpoint import load_target

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


def digest(result, error: Optional[BaseException]) -> str:
    """What the ranks compare after a call: the generated tokens (not the timings), or the error."""
    if error is not None:
        return f"error {type(error).__name__}: {error}"
    tokens = getattr(result, "sequences", result)
    return hashlib.sha256(repr(tokens).encode()).hexdigest()


def run_call(obj, call) -> tuple:
    """Runs ``call`` = (method name, args, kwargs) on ``obj``: (result, None) or (None, error)."""
    name, args, kwargs = call
    try:
        return getattr(obj, name)(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - every rank reports it; the driver raises it
        return None, err


def follow(rank: int, world: int, init_method: str, spec: ParallelSpec) -> None:
    """A follower process: joins the group, builds its share, then makes every call the driver
    broadcasts until it broadcasts None."""
    tp = join(rank, world, init_method, spec.device)
    try:
        try:
            generator, error = build_generator(spec, tp), None
        except Exception as err:  # noqa: BLE001 - reported to the driver
            generator, error = None, err
        if any(tp.gather_objects(None if error is None else repr(error))):
            return
        while True:
            call = tp.broadcast()
            if call is None:
                return
            with torch.inference_mode():
                result, error = run_call(generator, call)
            tp.gather_objects(digest(result, error))
    finally:
        tp.close()


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
        self._dir = tempfile.mkdtemp(prefix="longspec-tp-")
        init = f"file://{os.path.join(self._dir, 'store')}"
        context = torch.multiprocessing.get_context("spawn")
        self.workers = [context.Process(target=follow, args=(r, tensor_parallel, init, self.spec), daemon=True)
                        for r in range(1, tensor_parallel)]
        for w in self.workers:
            w.start()
        self.tp = join(0, tensor_parallel, init, device)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shut_down, self.tp, self.workers, self._dir)
        try:
            self.generator, error = build_generator(self.spec, self.tp), None
        except Exception as err:  # noqa: BLE001 - raised after the followers hear of it
            self.generator, error = None, err
        failures = [e for e in self.tp.gather_objects(None if error is None else repr(error)) if e]
        if failures:
            self.close(stop_workers=False)
            if error is not None:
                raise error
            raise RuntimeError(f"a tensor-parallel worker failed to start: {failures[0]}")

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
        return self.call("generate", prompts, config, local_kwargs={"streamer": streamer})

    def call(self, name: str, *args, local_kwargs: Optional[dict] = None, **kwargs):
        """Calls ``Generator.<name>(*args, **kwargs)`` on every rank (``local_kwargs``: on the
        driver only) and returns the driver's result; raises if the ranks' outputs differ."""
        if self._closed:
            raise RuntimeError("this ParallelGenerator is closed")
        if isinstance(prompts := args[0] if args else None, torch.Tensor):
            args = (prompts.tolist(), *args[1:])
        self.tp.broadcast((name, args, kwargs))
        with torch.inference_mode():
            result, error = run_call(self.generator, (name, args, {**kwargs, **(local_kwargs or {})}))
        digests = self.tp.gather_objects(digest(result, error))
        if len(set(digests)) > 1:
            raise RuntimeError(f"tensor-parallel ranks disagree after {name}: {digests}")
        if error is not None:
            raise error
        return result

    def close(self, stop_workers: bool = True) -> None:
        """Stops the followers and leaves the process group."""
        if self._closed:
            return
        self._closed = True
        if stop_workers:
            self.tp.broadcast(None)
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shut_down(tp: TensorParallel, workers: list, directory: str) -> None:
    for w in workers:
        w.join(timeout=60)
        if w.is_alive():
            w.terminate()
    tp.close()
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
