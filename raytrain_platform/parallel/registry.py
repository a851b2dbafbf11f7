"""The one registry of parallel strategies, by name. Importing it is cheap (no torch):
the config layer checks names against it; `get_strategy` imports the implementation.

An unknown name lists the known ones:

>>> strategy_names()
['ddp', 'fsdp', 'none']
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Union

from raytrain_platform.errors import ConfigError

__all__ = ["Strategy", "STRATEGIES", "strategy_names", "get_strategy", "recompute_dropout_error"]


@dataclass(frozen=True)
class Strategy:
    name: str
    target: str  # "module:function" of the keyword-only apply_*(model, *, env, cfg, blocks, ...)
    min_workers: int = 1
    max_workers: Union[int, None] = None
    shards_state: bool = False  # True when each rank holds only part of the model state
    description: str = ""

    def describe_workers(self) -> str:
        if self.max_workers == self.min_workers:
            return f"exactly {self.min_workers} worker(s)"
        if self.max_workers is None:
            return f"{self.min_workers} or more workers"
        return f"{self.min_workers} to {self.max_workers} workers"

    def load(self) -> Callable:
        module, _, fn = self.target.partition(":")
        return getattr(importlib.import_module(module), fn)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("none", "raytrain_platform.parallel.single:apply_none", 1, 1,
                 description="one process, no gradient communication"),
        Strategy("ddp", "raytrain_platform.parallel.ddp:apply_ddp", 1, None,
                 description="replicated model, gradients all-reduced (DistributedDataParallel)"),
        Strategy("fsdp", "raytrain_platform.parallel.fsdp:apply_fsdp", 1, None, shards_state=True,
                 description="parameters, gradients and optimizer state sharded (FSDP2 fully_shard)"),
    )
}


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError("parallel.strategy", name, f"one of {strategy_names()}")
    return STRATEGIES[name]


def recompute_dropout_error(where: str) -> ConfigError:
    """Compile with activation checkpointing recomputes each block inside its compiled
    graph, where dropout would draw other masks than the forward drew (PyTorch replays
    no random op it recomputes there): refused while `where` draws dropout. Here, in a
    torch-free module: config/job.py raises it before Ray, parallel/compile.py when the
    model is built."""
    return ConfigError("parallel.activation_checkpointing", True,
                       f"false with parallel.compile while the blocks draw dropout ({where}): recomputed inside "
                       "a compiled graph, dropout would draw other masks than the forward did; set the dropout "
                       "to 0, or turn one of the two options off")
