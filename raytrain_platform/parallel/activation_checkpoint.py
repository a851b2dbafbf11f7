"""Activation checkpointing per block: each block's activations are dropped after its
forward and recomputed in backward (memory for compute), on the blocks the model's
family names (`ModelFamily.blocks`).

``checkpoint_wrapper`` keeps state_dict keys unchanged (its hooks strip the wrapper
prefix), so checkpoints load with or without it. With ``parallel.compile`` too, blocks
are not wrapped: each is compiled to recompute inside its own graph
(parallel/compile.py says why).
"""

from __future__ import annotations

from torch import nn
from raytrain_platform.compat.torch_private import checkpoint_wrapper

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, *, blocks: list[tuple[str, nn.Module]]) -> None:
    """Wrap each of `blocks` (``(fully qualified name, module)``) in place."""
    for fqn, block in blocks:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # preserve_rng_state: the recomputed forward draws the same dropout masks.
        wrapped = checkpoint_wrapper(block, preserve_rng_state=True)
        if isinstance(parent, nn.ModuleList):
            parent[int(child)] = wrapped
        elif isinstance(parent, nn.ModuleDict):
            parent[child] = wrapped
        else:
            setattr(parent, child, wrapped)
