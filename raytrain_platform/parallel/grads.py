"""Gradient helpers shared by the strategies: global gradient-norm clipping when
parameters live on several meshes, and one flat all-reduce of a replica's gradients.

Clipping.

Under TP, TP x FSDP and PP a model's gradients are a mix: DTensors on the TP mesh,
on the 2-D (dp, tp) mesh, on the dp mesh, and plain replicated tensors; a pipeline
rank holds only its stages' gradients. ``torch.nn.utils.clip_grad_norm_`` cannot stack
norms across meshes, so: one norm per (mesh, placements) group (DTensor reduces its
shards), squares summed, then summed over pipeline stages. Plain tensors are replicas
(TP norms, DDP after its all-reduce) and count once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

__all__ = ["clip_grad_norm", "allreduce_grads"]

# A gradient's (mesh, placements) for a DTensor; None for a plain tensor.
_GroupKey = tuple[DeviceMesh, tuple[Placement, ...]] | None


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, *,
                   stage_group: dist.ProcessGroup | None = None,
                   uncounted: Iterable[torch.Tensor] = ()) -> float:
    """Scale gradients in place so their global L2 norm is at most `max_norm`, as
    ``clip_grad_norm_`` does on one process; returns the norm before clipping.
    Collective over every rank (and `stage_group`, the pipeline stages). `uncounted`:
    parameters among `params` scaled but left out of the norm (the last stage's copy of
    a tied LM head: the first stage counts the one parameter they are)."""
    params = list(params)
    skip = {id(p) for p in uncounted}
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[_GroupKey, list[torch.Tensor]] = {}
    for g in (p.grad for p in params if p.grad is not None and id(p) not in skip):
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), device=device)
    # The same order on every rank: by mesh dim names and placements, not rank lists.
    for key in sorted(groups, key=lambda k: "" if k is None else f"{k[0].mesh_dim_names}{k[1]}"):
        norm = torch.nn.utils.get_total_norm(groups[key], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float().to(device) ** 2
    if stage_group is not None:
        dist.all_reduce(total_sq, group=stage_group)
    total = total_sq.sqrt()
    # The same clamped coefficient torch uses (a multiply by 1.0 changes nothing).
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype) if not isinstance(g, DTensor) else float(coef))
    return float(total)


def allreduce_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average the gradients over ranks in one flat all-reduce: what DDP computes, done
    after backward instead of overlapped with it (the doctor times it this way)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.nn.utils.parameters_to_vector(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    with torch.no_grad():
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
