"""Hyperparameters of the built-in models, as plain dataclasses (no torch here).

Their families (models/builtin.py) validate ``model.kwargs`` against these before
anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from raytrain_platform.errors import ConfigError

__all__ = ["GPTSpec", "MLPSpec"]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class GPTSpec:
    """A small decoder-only transformer over bytes (vocab 256), nanoGPT-style."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64  # context length in tokens
    vocab_size: int = 256  # byte-level
    dropout: float = 0.0
    bias: bool = True
    init_std: float = 0.02
    task: str = "lm"

    def validate(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"model.kwargs.{name}", value, "an integer >= 1")
        if self.n_embd % self.n_head:
            raise ConfigError("model.kwargs.n_embd", self.n_embd,
                              f"a multiple of model.kwargs.n_head ({self.n_head})")
        if self.vocab_size != 256:
            raise ConfigError("model.kwargs.vocab_size", self.vocab_size, "256 (byte-level tokens)")
        if not (_is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("model.kwargs.dropout", self.dropout, "a number in [0, 1)")
        if not (_is_number(self.init_std) and 0 < self.init_std < math.inf):
            raise ConfigError("model.kwargs.init_std", self.init_std, "a finite number > 0")
        if not isinstance(self.bias, bool):
            raise ConfigError("model.kwargs.bias", self.bias, "true or false")
        if self.task != "lm":
            raise ConfigError("model.kwargs.task", self.task, "'lm' for gpt")

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)` (the LM head is its own matrix)."""
        d, L, T, V = self.n_embd, self.n_layer, self.block_size, self.vocab_size
        b = 1 if self.bias else 0
        ln = 2 * d if self.bias else d
        block = 2 * ln + (3 * d * d + 3 * d * b) + (d * d + d * b) + (4 * d * d + 4 * d * b) + (4 * d * d + d * b)
        return V * d + T * d + L * block + ln + d * V


@dataclass
class MLPSpec:
    """A feed-forward net for tabular classification or regression."""

    input_dim: Union[int, None] = None  # default: the number of feature columns
    hidden_sizes: list = field(default_factory=lambda: [64, 64])
    num_outputs: Union[int, None] = None  # classes (classification) or 1 (regression)
    dropout: float = 0.0
    task: str = "classification"

    def validate(self) -> None:
        if self.task not in ("classification", "regression"):
            raise ConfigError("model.kwargs.task", self.task, "'classification' or 'regression'")
        for name in ("input_dim", "num_outputs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                          and value >= 1):
                raise ConfigError(f"model.kwargs.{name}", value, "an integer >= 1 or null")
        if not (isinstance(self.hidden_sizes, list)
                and all(isinstance(h, int) and not isinstance(h, bool) and h >= 1
                        for h in self.hidden_sizes)):
            raise ConfigError("model.kwargs.hidden_sizes", self.hidden_sizes,
                              "a list of integers >= 1")
        if not (_is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("model.kwargs.dropout", self.dropout, "a number in [0, 1)")
