"""What every strategy returns: the module to run, how to skip gradient sync on
non-final micro-steps, and how to count gradient communication."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

from torch import nn

__all__ = ["Parallelized", "CommCount", "CommCounter"]


class CommCount(Protocol):
    """What the engine reads: gradient collectives so far (a counter, or a sum of them)."""

    @property
    def calls(self) -> int: ...


@dataclass
class CommCounter:
    """Counts gradient collectives (one per DDP bucket, per FSDP reduce-scatter...)."""

    calls: int = 0


@dataclass
class Parallelized:
    module: nn.Module  # call forward on this
    base: nn.Module  # the unwrapped model: its state_dict names are the checkpoint's
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext
    sharded: bool = False  # True: each rank holds only its shard (checkpoint with DCP)
    comm: CommCount = field(default_factory=CommCounter)
    # Model parallel (tp/pp) only; None keeps the engine's plain path.
    clip_grad_norm: Callable[[float], float] | None = None  # max_norm -> total norm, all ranks
    pipeline: Any = None  # a PipelineRunner (parallel/pp.py): runs forward+backward itself
    loss_ranks: int | None = None  # ranks holding a loss (PP: last-stage ranks); None = all
    # All-reduce the gradients now (after a backward run under no_sync): lets the doctor
    # time communication on its own. None: the strategy cannot separate it (FSDP).
    sync_grads: Callable[[], None] | None = None
