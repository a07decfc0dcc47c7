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
from .group import TensorParallel, from_env
from .sharding import Shard
from .workers import ParallelGenerator

__all__ = ["TensorParallel", "Shard", "from_env", "ParallelGenerator"]
