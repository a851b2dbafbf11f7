"""`fsdp`: PyTorch FSDP2 (``fully_shard`` on a 1-D `DeviceMesh`).

Each rank keeps 1/world of every parameter, gradient and optimizer state (as
DTensor shards). A unit's full parameters are all-gathered just before its
forward and backward; its gradients are reduce-scattered after its backward.
Each of the model's repeated blocks (its family's `blocks`: gpt's transformer blocks,
a Llama's decoder layers) is its own unit, then the root (embeddings, final norm, LM
head), so besides the root only the running block (and the next, prefetched) is ever
gathered in full.

Gradient accumulation: ``no_sync()`` maps to ``set_requires_gradient_sync(False)``,
so non-final micro-steps accumulate unsharded local gradients and skip the
reduce-scatter; the final micro-step reduces the sum once. ``comm`` counts the
reduce-scatters that really run (a counting subclass of FSDP's own collective).

Order of techniques follows torchtitan (parallel/compose.py): (TP), activation
checkpointing, compile (parallel/compile.py), FSDP.

Run it (Ray absent)::

    torchrun --nproc-per-node 2 -m raytrain_platform.core --config pipelines/configs/quickstart.yaml \\
        --set parallel.strategy=fsdp --set parallel.activation_checkpointing=true
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from raytrain_platform.compat.torch_private import default_reduce_scatter
from raytrain_platform.parallel.base import CommCounter, Parallelized

__all__ = ["apply_fsdp"]


class _CountingReduceScatter(default_reduce_scatter()):  # type: ignore[misc]
    """FSDP's default reduce-scatter, counted each time it is issued."""

    def __init__(self, counter: CommCounter):
        super().__init__()
        self.counter = counter

    def __call__(self, *args, **kwargs):
        self.counter.calls += 1
        return super().__call__(*args, **kwargs)


def apply_fsdp(model: nn.Module, *, env, cfg, mesh: DeviceMesh | None = None,
               blocks: Sequence[tuple[str, nn.Module]] = ()) -> Parallelized:
    """Shard `model` (already on its device) across all ranks with FSDP2, or across the
    data-parallel `mesh` (a 1-D sub-mesh) when TP/PP divide the ranks (parallel/mesh.py):
    each of `blocks` as its own unit, then the root.

    `cfg` is the `ParallelConfig`: ``mixed_precision`` (bf16 params, fp32 reduction),
    ``reshard_after_forward``, ``cpu_offload``."""
    if mesh is None:  # FSDP alone: every rank is data parallel
        from raytrain_platform.parallel.mesh import data_parallel_mesh

        mesh = data_parallel_mesh(env)
    options: dict = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for _, unit in blocks:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    counter = CommCounter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(_CountingReduceScatter(counter))
    root: FSDPModule = model  # type: ignore[assignment]

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        root.set_requires_gradient_sync(False)  # recurses into every unit
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    return Parallelized(module=model, base=model, no_sync=no_sync, sharded=True, comm=counter)
