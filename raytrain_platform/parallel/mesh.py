"""The one place device meshes are built (for FSDP alone too): a 3-D ``(pp, dp, tp)`` `DeviceMesh` over
all ranks (tp innermost, see parallel/dims.py), handed to each strategy, which takes
the sub-mesh it works on (``mesh["tp"]``, ``mesh["dp"]``, ``mesh["pp"]``).

>>> # mesh = build_mesh(env, ParallelDims(dp=2, tp=2)); mesh["tp"].size() == 2
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raytrain_platform.parallel.dims import ParallelDims

__all__ = ["MESH_DIMS", "build_mesh", "data_parallel_mesh"]

MESH_DIMS = ("pp", "dp", "tp")


def build_mesh(env, dims: ParallelDims) -> DeviceMesh:
    """Collective: every rank builds the same mesh (and its sub-groups)."""
    if not dist.is_initialized():
        # A plain single process: DTensor/FSDP still need a group, so a private one-rank one.
        backend = "nccl" if env.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world != dims.world:  # config validation makes this unreachable from a config
        raise RuntimeError(f"world size {world} != pp {dims.pp} x dp {dims.dp} x tp {dims.tp}")
    return init_device_mesh(env.device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(env) -> DeviceMesh:
    """The 1-D mesh of a job without TP/PP: every rank on the ``dp`` dimension."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return build_mesh(env, ParallelDims(dp=world))["dp"]
