"""The process group of a tensor-parallel model and the three collectives its forward uses: a
sum over ranks (after the row-parallel projections and the vocabulary-parallel embedding), a
gather of vocabulary shards (the logits) and a broadcast of host objects (the driver's calls).

Eager code calls ``torch.distributed`` in place; inside ``torch.compile`` the traceable
functional collectives are used. NCCL collectives may be captured in CUDA graphs (each rank
captures its own graphs, with the collectives inside), so a captured round needs no host step
between layers."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``world`` processes, computing
    on ``device``. ``group``: the process group of the model's collectives (None: the default
    group); ``control``: a CPU (gloo) group for host objects (the same group under gloo)."""

    rank: int
    world: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None
    control: Any = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks (every rank gets the same bits)."""
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(t, "sum", self.group or dist.group.WORLD)
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def gather_last(self, t: torch.Tensor, full: int) -> torch.Tensor:
        """Every rank's ``t`` [..., C] (the same shape on every rank) side by side along the
        last dimension, in rank order, cut to ``full`` columns -> [..., full]."""
        lead, chunk = t.shape[:-1], t.shape[-1]
        flat = t.reshape(-1, chunk).contiguous()
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            out = funcol.all_gather_tensor(flat, 0, self.group or dist.group.WORLD)
        else:
            out = torch.empty(self.world * flat.shape[0], chunk, dtype=t.dtype, device=t.device)
            _all_gather(out, flat, group=self.group)
        out = out.view(self.world, flat.shape[0], chunk).permute(1, 0, 2).reshape(*lead, self.world * chunk)
        return out[..., :full]

    def broadcast(self, obj: Any = None) -> Any:
        """The driver's ``obj`` on every rank (a picklable host object)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_objects(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def close(self) -> None:
        """Leaves the group (the default process group is destroyed)."""
        if dist.is_initialized():
            dist.destroy_process_group()


# (all_gather_single: the name from torch 2.13 on; all_gather_into_tensor before)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


CONTROL_TIMEOUT = timedelta(days=365)


def device_for(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA, else the CPU."""
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def join(rank: int, world: int, init_method: str, device_type: str = "cpu", timeout_s: float = 600.0) -> TensorParallel:
    """Joins (creates) the default process group as ``rank`` of ``world``: NCCL on CUDA (one
    device per rank), gloo on the CPU; a gloo group without a practical timeout carries the host
    objects."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process: tensor parallelism "
                           "starts its own (use longspec.parallel.from_env() under torchrun)")
    device = device_for(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    # the host objects' group: followers wait there for the driver's next call, as long as a
    # server stays idle (the model's collectives keep ``timeout_s``)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, world, device, None, control)


def from_env(device_type: Optional[str] = None) -> TensorParallel:
    """The group of a ``torchrun`` launch (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``; one
    device per rank: ``cuda:LOCAL_RANK``). Every rank then loads its shard
    (``load_target(path, tensor_parallel=tp)``) and runs the same calls with the same inputs."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", rank))
    tp = join(rank, world, "env://", "cpu" if device_type != "cuda" else "cuda")
    if device_type == "cuda" and local != rank:  # one host per group: its ranks are its devices
        raise ValueError(f"tensor parallelism runs on one host (RANK {rank} != LOCAL_RANK {local})")
    return tp
