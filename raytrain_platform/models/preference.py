"""Preference tuning: DPO and its IPO and hinge variants, as TRL's ``DPOTrainer``
computes them (trl 1.16, ``DPOTrainer._compute_loss``), in plain torch.

The batch contract, between the data side (``data.format: preference``) and the engine:
a DPO batch is a dict of tensors

- ``chosen_tokens``, ``rejected_tokens``: int (B, L), one pair per row (never packed),
  right-padded;
- ``chosen_mask``, ``rejected_mask``: uint8 (B, L), as a ``loss_mask``: ``mask[t] = 1``
  where token t is a trained target (the logits at t - 1 predict it); only response
  tokens are 1, the prompt and the padding 0 (so ``mask[:, 0]`` is 0: nothing predicts
  the first token);
- ``sample_id``: int64 (B,);
- optional ``ref_chosen_logps``, ``ref_rejected_logps``: float32 (B,), the reference
  model's `sequence_logps` of each response (``train.dpo.precompute_reference``).

No ``position_ids``: a pair's two rows are whole sequences starting at 0. A micro-batch
holds whole pairs, so a pair is never split across ranks or micro-steps.

The chosen and rejected rows go through the model in one forward, concatenated along
the batch (``[chosen; rejected]``, 2B rows). A response's log-prob is the sum of its
tokens' log-probs; with ``r = logp(policy) - logp(reference)`` per response and
``d = r_chosen - r_rejected``, the loss of one pair is

- ``sigmoid``: ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)`` (``e``:
  ``label_smoothing``, conservative DPO; TRL 1.16's ``sigmoid`` is the ``e = 0`` case and
  keeps this form under ``aot``);
- ``ipo``: ``(r_chosen / n_chosen - r_rejected / n_rejected - 1 / (2 beta))^2``, ``n``: the
  response's token count;
- ``hinge``: ``relu(1 - beta d)``.

The rewards are ``beta r`` (detached); accuracy counts the pairs whose chosen reward is
above the rejected one.

>>> import torch
>>> pair = dpo_loss(torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([-4.0]), torch.tensor([-4.0]),
...                 beta=0.1, loss="sigmoid")
>>> [round(float(v[0]), 4) for v in pair]  # loss, chosen reward, rejected reward
[0.5981, 0.1, -0.1]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from raytrain_platform.models.tasks import IGNORE_INDEX

__all__ = ["PAIR_KEYS", "REF_KEYS", "METRICS", "PairLosses", "is_pair_batch", "pair_inputs",
           "sequence_logps", "dpo_loss", "pair_sums", "pair_metrics"]

PAIR_KEYS = ("chosen_tokens", "rejected_tokens", "chosen_mask", "rejected_mask")
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
# The metrics a step and a validation pass report, in `pair_sums`' order after the loss and count.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


class PairLosses(NamedTuple):
    losses: torch.Tensor  # (B,) each pair's loss
    chosen_rewards: torch.Tensor  # (B,) beta x (policy - reference) log-prob of the chosen, detached
    rejected_rewards: torch.Tensor  # (B,) the same for the rejected


def is_pair_batch(batch: dict[str, torch.Tensor]) -> bool:
    """Whether `batch` is a DPO batch (has the pair keys)."""
    return all(k in batch for k in PAIR_KEYS)


def pair_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The one forward's inputs and targets: chosen rows then rejected rows, ``(2B, L-1)``
    each; a target the loss does not count (prompt, padding) is `IGNORE_INDEX`."""
    tokens = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]]).long()  # (2B, L)
    mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
    targets = tokens[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return tokens[:, :-1], targets


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-prob of its counted targets, and its count of them, ``(R,)``
    each (fp32). `logits`: ``(R, T, V)`` for `targets` ``(R, T)``, or ``(N, V)`` for the
    counted positions only, `rows` their flat indices into ``targets`` (core/counted.py)."""
    counts = (targets != IGNORE_INDEX).sum(1).float()
    if rows is None:
        picked = -F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                  reduction="none")  # (R, T), 0 where not counted
        return picked.sum(1), counts
    flat = targets.reshape(-1).index_select(0, rows)
    picked = -F.cross_entropy(logits.float(), flat, reduction="none")  # (N,)
    owner = torch.div(rows, targets.shape[1], rounding_mode="floor")
    return torch.zeros(targets.shape[0], device=logits.device).index_add(0, owner, picked), counts


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float, loss: str, label_smoothing: float = 0.0,
             chosen_counts: torch.Tensor | None = None,
             rejected_counts: torch.Tensor | None = None) -> PairLosses:
    """Each pair's loss and rewards from the four ``(B,)`` sequence log-probs; `ipo` also
    takes each response's token count (`sequence_logps`)."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss == "ipo":
        assert chosen_counts is not None and rejected_counts is not None, "ipo normalizes by response length"
        ipo_delta = chosen_ratio / chosen_counts.clamp(min=1.0) - rejected_ratio / rejected_counts.clamp(min=1.0)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss!r}")  # config/train_section.py checks train.dpo.loss
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def pair_sums(pair: PairLosses, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> torch.Tensor:
    """``[loss sum, pairs, then the sum of each of METRICS]`` over a micro-batch's pairs
    (fp32, detached): summed over micro-batches and ranks, then divided by the pairs."""
    chosen, rejected = pair.chosen_rewards, pair.rejected_rewards
    parts = [pair.losses.detach(), torch.ones_like(chosen), chosen, rejected, chosen - rejected,
             (chosen > rejected).float(), chosen_logps.detach(), rejected_logps.detach()]
    return torch.stack([p.float().sum() for p in parts])


def pair_metrics(sums: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """`pair_sums` summed over micro-batches and ranks -> ``{loss, rewards/..., logps/...}``
    as means over the pairs, each name after `prefix` (``val_`` for validation).

    >>> pair_metrics(torch.tensor([1.0, 2.0, 0.2, -0.2, 0.4, 2.0, -6.0, -10.0]), "val_")["val_rewards/accuracies"]
    1.0
    """
    values = [float(v) for v in sums]
    pairs = max(values[1], 1.0)
    out = {f"{prefix}loss": values[0] / pairs}
    out.update({f"{prefix}{name}": v / pairs for name, v in zip(METRICS, values[2:])})
    return out
