"""A feed-forward net for tabular data.

>>> import torch
>>> from raytrain_platform.models.specs import MLPSpec
>>> MLP(MLPSpec(input_dim=4, hidden_sizes=[8], num_outputs=3))(torch.zeros(2, 4)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

import torch
from torch import nn

from raytrain_platform.models.specs import MLPSpec

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, spec: MLPSpec):
        super().__init__()
        if spec.input_dim is None or spec.num_outputs is None:
            raise ValueError("MLPSpec.input_dim and num_outputs must be resolved before building")
        layers: list[nn.Module] = []
        width = spec.input_dim
        for hidden in spec.hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(spec.dropout)]
            width = hidden
        layers.append(nn.Linear(width, spec.num_outputs))
        self.net = nn.Sequential(*layers)
        self.regression = spec.task == "regression"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)  # (B, num_outputs)
        return out.squeeze(-1) if self.regression else out
