"""Bytes of model state this rank holds, exact, from the tensors themselves.

Used by the engine's metrics (``param_bytes``, ``grad_bytes``, ``optim_bytes``) and by
``rtp plan``'s check of its memory model against reality (tools/measure_memory.py).

>>> import torch
>>> m = torch.nn.Linear(4, 2)
>>> state_bytes(m, torch.optim.SGD(m.parameters(), lr=0.1))["params"]
40
"""

from __future__ import annotations

from typing import Any

__all__ = ["local_tensor", "state_bytes"]


def local_tensor(t: Any) -> Any:
    """A DTensor (FSDP2, TP) holds only its shard on this rank: that part."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: Any) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: bytes of this rank's local shards."""
    params = list(model.parameters())
    optim = sum(_nbytes(v) for state in optimizer.state.values() for v in state.values()
                if hasattr(v, "element_size"))
    return {"params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": optim}
