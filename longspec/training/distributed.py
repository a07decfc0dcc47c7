"""Multi-process data parallelism with PyTorch's own stack: start with ``torchrun``
(``torchrun --nproc_per_node N -m longspec.cli train ...``); this module reads the environment
torchrun sets (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), initialises the default process group
(NCCL on CUDA, gloo on the CPU) and offers the few collectives the trainer needs."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    """This process's place in the job: ``rank`` of ``world`` processes, ``local_rank`` on its
    host, and the ``device`` it computes on. ``owns_group``: this module initialised the
    process group (and so tears it down)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a no-op in one process). gloo reduces on the CPU, NCCL on
        the GPU; the tensor is moved there and back as needed."""
        if not self.distributed:
            return tensor
        work = tensor.to(self.device) if self.device.type == "cuda" else tensor.cpu()
        dist.all_reduce(work, op=dist.ReduceOp.SUM)
        tensor.copy_(work)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Leaves the process group (after a barrier on success: a rank that tore its gloo group
        down while the other still ended its own once aborted that one, "terminate called without
        an active exception")."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def setup(device: Optional[str] = None) -> DistEnv:
    """Detects a torchrun launch and joins the process group; picks this rank's device
    (``cuda:LOCAL_RANK`` under torchrun with CUDA). ``device`` None: CUDA when available."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    owns = False
    if world > 1 and not dist.is_initialized():
        cuda = dev.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=dev if cuda else None)
        owns = True
    if world > 1 and dist.get_world_size() != world:
        raise ValueError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks")
    return DistEnv(rank, world, local_rank, dev, owns)


def die_with_parent() -> None:
    """Linux: this process is killed when its parent dies. torchrun starts each worker in a session
    of its own, so a launcher killed with SIGKILL (by hand or by a job scheduler) would otherwise
    leave its workers training on and writing checkpoints into the run's directory."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc prctl: nothing to do
        return
    if os.getppid() == 1:  # the parent already died before the request took effect
        os._exit(1)

