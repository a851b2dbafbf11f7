"""What every strategy returns: the module to run, how to skip gradient sync on
non-final micro-steps, and how to count gradient communication."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

from torch import nn

__all__ = ["Parallelized", "CommCounter"]


@dataclass
class CommCounter:
    """Counts gradient collectives (one per DDP bucket, per FSDP reduce-scatter...)."""

    calls: int = 0

    def take(self) -> int:
        n, self.calls = self.calls, 0
        return n


@dataclass
class Parallelized:
    module: nn.Module  # call forward on this
    base: nn.Module  # the unwrapped model: its state_dict names are the checkpoint's
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext
    sharded: bool = False  # True: each rank holds only its shard (checkpoint with DCP)
    comm: CommCounter = field(default_factory=CommCounter)
