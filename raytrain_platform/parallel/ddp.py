"""`ddp`: DistributedDataParallel, with a comm hook that counts the all-reduces.

With gradient accumulation the engine runs every micro-step but the last inside
``no_sync()``, so gradients are all-reduced once per optimizer step (nanoGPT's
``require_backward_grad_sync`` trick, through DDP's public context manager).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from raytrain_platform.parallel.base import CommCounter, Parallelized
from raytrain_platform.parallel.grads import allreduce_grads

__all__ = ["apply_ddp"]


def _counting_allreduce(counter, bucket):  # no annotations: DDP inspects them
    counter.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def apply_ddp(model: nn.Module, *, env, cfg, mesh: DeviceMesh | None = None,
              blocks: Sequence[tuple[str, nn.Module]] = ()) -> Parallelized:
    """Wrap `model` (already on its device) in DDP over the default process group, or
    over the data-parallel `mesh` (a 1-D sub-mesh) when pipeline stages divide the ranks.

    Without a process group (a plain single-process run) there is nothing to sync.
    DDP buckets gradients by size, not by block: `blocks` is not used."""
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
