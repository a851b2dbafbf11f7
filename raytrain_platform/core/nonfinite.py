"""What a step with a NaN or infinite loss or gradient norm does (``train.on_nonfinite``).

A diverged run must not train on and rotate its good checkpoints away:

- ``stop`` (default): the first such step raises `NonFiniteError`, one line naming the
  step and the newest checkpoint whose recorded loss was finite; the optimizer step
  is not taken, so no checkpoint is ever written from the non-finite update;
- ``skip_step``: the optimizer step is skipped (weights and optimizer state stay as
  they were), counted in the metrics as ``nonfinite_skips``; more than
  ``train.max_nonfinite_skips`` skipped steps in a row stop the run the same way.

Every rank must decide the same, or one rank skips (or stops) while the others wait
in the next collective forever: the decision is one small all-reduce of
``[loss, loss non-finite, gradient norm non-finite, units]`` per optimizer step, the
one sync per step that gradient-norm clipping implies anyway. The step's metrics (the
global batch's loss and token count) come from the same all-reduce: `totals`.

>>> guard = NonFiniteGuard(policy="skip_step", max_skips=2, run_dir=None)
>>> import torch
>>> guard.step_ok(torch.tensor(float("nan")), 1.0, [], step=7)
False
>>> guard.skipped, guard.step_ok(torch.tensor(0.5), 1.0, [], step=8, units=32), guard.consecutive
(1, True, 0)
>>> guard.totals  # summed over the ranks (one here): loss, units
(0.5, 32.0)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

from raytrain_platform.core.dist import all_reduce_sum
from raytrain_platform.core.rundir import checkpoint_name, newest_finite_checkpoint
from raytrain_platform.errors import NonFiniteError

__all__ = ["NonFiniteGuard"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's shard under FSDP/TP)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _grads_finite(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Whether this rank's gradients are all finite, as a 0-d bool tensor (no sync):
    the largest magnitude (inf-norm) is finite exactly when every element is."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(True)
    return torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=float("inf")))


class NonFiniteGuard:
    """Per-step finiteness check and the ``train.on_nonfinite`` policy (module docstring)."""

    def __init__(self, *, policy: str, max_skips: int, run_dir: str | None):
        self.policy, self.max_skips, self.run_dir = policy, max_skips, run_dir
        self.skipped = 0  # steps skipped by this process (the metric nonfinite_skips)
        self.consecutive = 0
        self.last_saved: str | None = None  # the newest checkpoint this process wrote
        self.totals = (0.0, 0.0)  # the last step's loss and units, summed over the ranks

    def step_ok(self, loss_sum: torch.Tensor, grad_norm: float | None,
                params: Iterable[torch.nn.Parameter], *, step: int, units: int = 0) -> bool:
        """Collective. True: take the optimizer step. False: skip it (``skip_step``).
        Raises `NonFiniteError` to stop. `grad_norm`: the global norm when clipping
        computed one (the same on every rank), else None (this rank's gradients are
        checked, and the all-reduce shares the verdict). `units`: this rank's tokens (or
        rows) in the step, summed into `totals` with the loss."""
        loss = loss_sum.detach().float().reshape(())
        grads_ok = (torch.tensor(math.isfinite(grad_norm)) if grad_norm is not None
                    else _grads_finite(params))
        packed = torch.stack([loss, (~torch.isfinite(loss)).float(),
                              (~grads_ok.to(loss.device)).float(),
                              torch.tensor(float(units), device=loss.device)])
        loss_total, loss_bad, grads_bad, units_total = all_reduce_sum(packed).tolist()
        self.totals = (loss_total, units_total)
        if not (loss_bad or grads_bad):
            self.consecutive = 0
            return True
        what = (f"loss {loss_total}" if loss_bad else
                f"gradient norm {grad_norm if grad_norm is not None else 'not finite'}")
        if self.policy == "stop":
            raise NonFiniteError(self._message(step, f"{what} (train.on_nonfinite: stop)"))
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive > self.max_skips:
            raise NonFiniteError(self._message(
                step, f"{what}: {self.consecutive} non-finite steps in a row, more than "
                      f"train.max_nonfinite_skips ({self.max_skips})"))
        return False

    def check_weights(self, module: torch.nn.Module, *, step: int) -> None:
        """Collective, before a checkpoint is written: a finite loss and gradient can
        still make an update that overflows the weights; such weights are never saved."""
        ok = all(bool(torch.isfinite(_local(p)).all()) for p in module.parameters())
        bad = all_reduce_sum(torch.tensor(0.0 if ok else 1.0, device=_device(module)))
        if float(bad):
            raise NonFiniteError(self._message(step, "the weights are not finite after the "
                                                     "optimizer step; no checkpoint written"))

    def saved(self, step: int) -> None:
        if self.run_dir:
            self.last_saved = os.path.join(self.run_dir, checkpoint_name(step))

    def _message(self, step: int, what: str) -> str:
        newest = (newest_finite_checkpoint(self.run_dir) if self.run_dir else None) or self.last_saved
        where = f"newest finite checkpoint: {newest}" if newest else "no finite checkpoint was written"
        return f"step {step}: {what}; {where}"


def _device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return _local(p).device
    return torch.device("cpu")
