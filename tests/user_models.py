"""A user model, loaded by import path (``model.name: "user_models:slow_mlp"``).

It sleeps in forward so that a test can kill a run between two checkpoints
without racing it; the math is an ordinary MLP.
"""

import time

from torch import nn


class SlowMLP(nn.Module):
    def __init__(self, input_dim: int, num_outputs: int, delay_s: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_dim, 32), nn.GELU(), nn.Linear(32, num_outputs))
        self.delay_s = delay_s

    def forward(self, x):
        if self.training:
            time.sleep(self.delay_s)
        return self.net(x)


def slow_mlp(input_dim: int = 16, num_outputs: int = 4, delay_s: float = 0.05) -> nn.Module:
    return SlowMLP(input_dim, num_outputs, delay_s)
