"""`ddp`: DistributedDataParallel, with a comm hook that counts the all-reduces.

With gradient accumulation the engine runs every micro-step but the last inside
``no_sync()``, so gradients are all-reduced once per optimizer step (nanoGPT's
``require_backward_grad_sync`` trick, through DDP's public context manager).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from raytrain_platform.parallel.base import CommCounter, Parallelized

__all__ = ["apply_ddp"]


def _counting_allreduce(counter, bucket):  # no annotations: DDP inspects them
    counter.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def allreduce_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average the gradients over ranks in one flat all-reduce: what DDP computes, done
    after backward instead of overlapped with it (the doctor times it this way)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    with torch.no_grad():
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def apply_ddp(model: nn.Module, *, env, cfg, mesh: DeviceMesh | None = None) -> Parallelized:
    """Wrap `model` (already on its device) in DDP over the default process group, or
    over the data-parallel `mesh` (a 1-D sub-mesh) when pipeline stages divide the ranks.

    Without a process group (a plain single-process run) there is nothing to sync."""
    if not dist.is_initialized():
        return Parallelized(module=model, base=model, sync_grads=lambda: None)
    ddp = DistributedDataParallel(
        model,
        process_group=mesh.get_group() if mesh is not None else None,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
    )
    counter = CommCounter()
    ddp.register_comm_hook(counter, _counting_allreduce)
    return Parallelized(module=ddp, base=model, no_sync=ddp.no_sync, comm=counter,
                        sync_grads=lambda: allreduce_grads(model))
