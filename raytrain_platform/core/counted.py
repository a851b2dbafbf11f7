"""The LM head on counted tokens only (``train.logits: counted``).

Instruction data counts the loss on completion and assistant tokens only; the prompt
tokens are context. Hugging Face's own loss, and a plain training loop, still run the
output head (``hidden -> vocab``) and the fp32 cross-entropy on every position, then
throw the prompt positions away. With a real vocabulary that is a large part of a
step: the head is 21% of Llama 3.2 1B's weight matmuls (128,256 x 2,048) and 28% of
Qwen2.5 0.5B's (7% of Llama 3 8B's), and its logits (``tokens x vocab``, fp32 for the
loss, plus their gradient) are the largest activation of the step.

`counted_positions` runs the model's own forward with a pre-hook on its output head
that keeps only the rows of the head's input (``(B, T, hidden)`` -> ``(N, hidden)``)
whose target the loss counts, so the head, the fp32 cast and the cross-entropy see N
tokens instead of ``B x T``. The loss is the same sum over the same tokens (only the
order of the additions differs), and so are the gradients: a prompt position's logits
never reached the loss. Everything before the head (the embeddings, the blocks, the
final norm) runs as before, inside the model's own forward, so FSDP's and TP's hooks
and activation checkpointing are untouched.

The hook leaves the input alone, and the loss takes every position, where it cannot
select rows: a DTensor input (sequence-parallel TP), or an input that is not
``(B, T, hidden)`` for the batch's ``(B, T)`` targets.

>>> import torch
>>> from torch import nn
>>> class Tiny(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.body, self.lm_head = nn.Linear(4, 4), nn.Linear(4, 10)
...     def forward(self, x):
...         return self.lm_head(self.body(x))
>>> m, x = Tiny(), torch.randn(2, 3, 4)
>>> targets = torch.tensor([[-100, 1, 2], [-100, -100, 3]])
>>> with counted_positions(m.lm_head, targets) as sel:
...     logits = m(x)
>>> tuple(logits.shape), sel.targets(logits).tolist()
((3, 10), [1, 2, 3])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import EllipsisType

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.tasks import IGNORE_INDEX

__all__ = ["Selection", "counted_positions", "counted_rows"]


class Selection:
    """What the head ran on: every position (``rows is None``) or the counted rows of
    the flattened ``(B*T,)`` targets; `targets` gives the loss's targets to match."""

    def __init__(self, targets: torch.Tensor):
        self._targets = targets
        self.rows: torch.Tensor | None = None

    def targets(self, logits: torch.Tensor) -> torch.Tensor:
        """The targets for `logits`: as given, or the counted ones, flattened, when the
        head ran on the counted rows (then the logits must be ``(N, vocab)``)."""
        if self.rows is None:
            return self._targets
        n = self.rows.numel()
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ConfigError("train.logits", "counted", "'all' for this model: its forward changed the shape "
                              f"of its output head's result (logits {tuple(logits.shape)}, {n} counted "
                              "tokens in, (tokens, vocab) expected)")
        return self._targets.reshape(-1).index_select(0, self.rows)


def counted_rows(targets: torch.Tensor) -> torch.Tensor | None:
    """The flattened indices of the counted targets; None when every target counts.
    On a GPU this waits for the device (the count is data): the engine takes every
    micro-batch's rows at the start of a step, where it counts the targets anyway."""
    rows = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    return None if rows.numel() == targets.numel() else rows


@contextlib.contextmanager
def counted_positions(head: nn.Module | None, targets: torch.Tensor,
                      rows: torch.Tensor | None | EllipsisType = ...) -> Iterator[Selection]:
    """While open, `head`'s forward runs on the rows of its ``(B, T, hidden)`` input whose
    `targets` (``(B, T)``) are counted (`rows`, from `counted_rows`; taken here when not
    given); `head` None, or rows None (every target counts), keeps every position."""
    selection = Selection(targets)
    keep = counted_rows(targets) if head is not None and rows is ... else rows
    if head is None or keep is None or keep is ...:
        yield selection
        return

    def keep_counted(module: nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args else None
        if (not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() != 3
                or tuple(x.shape[:2]) != tuple(targets.shape)):
            return None  # not the (B, T, hidden) it can select from: every position
        selection.rows = keep
        return (x.reshape(-1, x.size(-1)).index_select(0, keep), *args[1:])

    # prepend: before a TP style's hook turns the input into a DTensor
    handle = head.register_forward_pre_hook(keep_counted, prepend=True)
    try:
        yield selection
    finally:
        handle.remove()
