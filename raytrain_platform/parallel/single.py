"""`none`: one process, the model as it is."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from raytrain_platform.parallel.base import Parallelized

__all__ = ["apply_none"]


def apply_none(model: nn.Module, *, env, cfg, blocks: Sequence[tuple[str, nn.Module]] = ()) -> Parallelized:
    """No wrapping; used with exactly one worker."""
    return Parallelized(module=model, base=model, sync_grads=lambda: None)  # nothing to sync
