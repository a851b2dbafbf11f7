"""Where this process sits in the job: rank, world size, device. Works under
Ray Train (which has already made the process group) and under torchrun."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "init_torchrun", "all_reduce_sum", "all_gather_objects", "barrier"]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls, *, use_gpu: bool) -> "DistEnv":
        """From the initialised process group (or a single process when there is none)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_gpu:
            if not torch.cuda.is_available():
                raise RuntimeError("scaling.use_gpu is true but this worker sees no CUDA device")
            # Ray Train and torchrun both leave one device per local rank visible.
            index = local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        else:
            device = torch.device("cpu")
        return cls(rank=rank, world_size=world, local_rank=local_rank, device=device)


def process_group_backend(*, use_gpu: bool, cpu_offload: bool = False) -> str:
    """gloo on CPUs; NCCL on GPUs, with gloo beside it under FSDP's CPU offload
    (torchtitan's choice): the offloaded parameters and gradients live in host memory,
    and the gradient norm and the weights check all-reduce CPU tensors there, which NCCL
    cannot ("No backend type associated with device type cpu", pytorch/pytorch#148532).

    >>> process_group_backend(use_gpu=True, cpu_offload=True)
    'cpu:gloo,cuda:nccl'
    """
    if not use_gpu:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def init_torchrun(*, use_gpu: bool, cpu_offload: bool = False) -> DistEnv:
    """Initialise the default process group from torchrun's environment variables."""
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(process_group_backend(use_gpu=use_gpu, cpu_offload=cpu_offload),
                                timeout=datetime.timedelta(minutes=10))
    return DistEnv.current(use_gpu=use_gpu)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj: object) -> list:
    """Every rank's `obj`, in rank order (pickled over the process group: small objects)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
