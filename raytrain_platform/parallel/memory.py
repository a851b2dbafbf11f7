"""Bytes of model state this rank holds, exact, from the tensors themselves, and of
the activations autograd keeps for backward.

Used by the engine's metrics (``param_bytes``, ``grad_bytes``, ``optim_bytes``) and by
``rtp plan``'s check of its memory model against reality (tools/measure_memory.py).

>>> import torch
>>> m = torch.nn.Linear(4, 2)
>>> state_bytes(m, torch.optim.SGD(m.parameters(), lr=0.1))["params"]
40
>>> x = torch.ones(3, 4)
>>> _, saved = saved_activation_bytes(lambda: m(x).relu().sum(), list(m.parameters()))
>>> saved  # float32: x (3, 4), which the linear keeps, and relu's (3, 2) output; not the weight
72
"""

from __future__ import annotations

from typing import Any

__all__ = ["local_tensor", "saved_activation_bytes", "state_bytes"]


def local_tensor(t: Any) -> Any:
    """A DTensor (FSDP2, TP) holds only its shard on this rank: that part."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage(t: Any) -> Any:
    local = local_tensor(t)
    # A DTensor whose redistribution is still in flight (TP: an hf decoder layer's input) gives an
    # AsyncCollectiveTensor, a wrapper without storage: its result tensor holds the bytes.
    if hasattr(local, "trigger_wait"):
        local = local.trigger_wait()
    return local.untyped_storage()


def saved_activation_bytes(fn: Any, params: list) -> tuple[Any, int]:
    """Run `fn` and count the bytes autograd holds for backward once it returns, each
    storage once; parameters (and views of them, like a Linear's transposed weight)
    excluded, and so are FSDP2's gathered weights that a block saved: FSDP2 frees them
    after the block's forward (they are gathered again for its backward)."""
    import torch

    param_storages = {_storage(p).data_ptr() for p in params}
    seen: dict[int, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in param_storages:
            seen.setdefault(storage.data_ptr(), storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storage.nbytes() for storage in seen.values())  # a freed storage: 0


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
