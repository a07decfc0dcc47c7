"""Tensor parallelism (Megatron style) for inference: the target's attention heads, MLP columns
and vocabulary split over the processes of a group, one process per device.

* :mod:`.group`: the process group (:class:`TensorParallel`) and its collectives;
* :mod:`.sharding`: which part of each weight a rank holds (:class:`Shard`), the parallel layers
  and the per-rank loading of safetensors slices;
* :mod:`.mirror`: :class:`~.mirror.Driver`, which starts one process per device, keeps this
  process as rank 0 and has the others repeat the calls it makes on its object;
* :mod:`.workers`: :class:`ParallelGenerator`, a Generator driven that way;
* :mod:`.serving`: the engine of ``longspec serve --tensor-parallel N``, driven that way.
"""
import importlib

from .group import TensorParallel, from_env
from .sharding import Shard

__all__ = ["TensorParallel", "Shard", "from_env", "ParallelGenerator"]


def __getattr__(name: str):
    """:class:`ParallelGenerator` loads on first use: the layers below the engine (the models
    import :mod:`.sharding`) do not pull in the Generator above them."""
    if name != "ParallelGenerator":
        raise AttributeError(f"module 'longspec.parallel' has no attribute {name!r}")
    return importlib.import_module(".workers", __name__).ParallelGenerator
