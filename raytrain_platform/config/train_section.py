"""The ``train`` section of a job config, with its ``train.dpo`` section
(config/sections.py lists them all)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Union

from raytrain_platform.config.fields import SEED_ALLOWED, SEED_LIMIT, check_field

__all__ = ["DpoConfig", "TrainConfig"]


@dataclass
class DpoConfig:
    """`train.dpo`: preference tuning (`train.objective: dpo`); the losses as TRL defines them
    (models/preference.py). See [preference.md](preference.md)."""

    SECTION: ClassVar[str] = "train.dpo"
    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are `beta` x (policy - reference)
    log-probs of a response; for `ipo`, the regularization `tau` of the IPO paper. A number > 0."""
    loss: str = "sigmoid"
    """`sigmoid` (DPO), `ipo` (squared loss on the length-normalized log-ratio margin) or `hinge` (SLiC), as
    TRL's `DPOTrainer` computes them."""
    label_smoothing: float = 0.0
    """Conservative DPO (`loss: sigmoid` only): the share of preference labels assumed flipped, in [0, 0.5)."""
    reference: str = "auto"
    """The frozen reference model. `auto`: the policy's own starting weights (the pretrained files or the
    seed's initialization): a frozen copy sharded like the policy, or with `model.lora` the same model with
    its adapters switched off (no second copy). A path: a Hugging Face model folder (`hf` models) with the
    same vocabulary, built and sharded like the policy."""
    precompute_reference: bool = False
    """One pass before training scores every pair with the reference and keeps the log-probs with the
    tokenized data (found again by reruns, resumes and sweep trials): no reference model is held while
    training. See [preference.md](preference.md#precomputed-reference-log-probs)."""

    _LOSSES: ClassVar[tuple[str, ...]] = ("sigmoid", "ipo", "hinge")

    def __post_init__(self) -> None:
        check_field(self.beta > 0, "train.dpo.beta", self.beta, "a number > 0")
        check_field(self.loss in self._LOSSES, "train.dpo.loss", self.loss, f"one of {list(self._LOSSES)}")
        check_field(0.0 <= self.label_smoothing < 0.5, "train.dpo.label_smoothing", self.label_smoothing,
                    "a number in [0, 0.5)")
        check_field(self.label_smoothing == 0.0 or self.loss == "sigmoid", "train.dpo.label_smoothing",
                    self.label_smoothing, f"0 for train.dpo.loss {self.loss} (label smoothing is sigmoid's)")
        check_field(bool(self.reference.strip()), "train.dpo.reference", self.reference,
                    "'auto' or a Hugging Face model folder")
        if self.reference != "auto":
            self.reference = os.path.abspath(os.path.expanduser(self.reference))  # workers: another cwd


@dataclass
class TrainConfig:
    SECTION: ClassVar[str] = "train"
    max_steps: Union[int, None] = None  # optimizer steps; stops at whichever of these comes first
    """Optimizer steps; the run stops at whichever of `max_steps` and `epochs` comes first (at least one is
    required)."""
    epochs: Union[int, None] = None
    """Passes over the training split."""
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    """Micro-steps per optimizer step; the gradient sync runs only on the last one (derived when
    `data.batch_size` is `auto`)."""
    global_batch_size: Union[int, None] = None  # with data.batch_size auto: samples per optimizer step
    """Samples per optimizer step over all replicas; required with `data.batch_size: auto`, otherwise optional
    and must equal `batch_size x grad_accum_steps x data-parallel workers`."""
    lr: float = 1e-3
    """Peak learning rate."""
    optimizer: str = "adamw"  # adamw | sgd
    """`adamw` (the fused single-kernel AdamW on CPU and CUDA, DTensors included) or `sgd` (multi-tensor)."""
    weight_decay: float = 0.0
    """On matrices only (not biases and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    momentum: float = 0.9  # sgd
    """SGD momentum."""
    lr_schedule: str = "cosine"  # cosine | constant (both after warmup)
    """`cosine` (down to `min_lr_ratio` x lr) or `constant`, both after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    """Cosine floor as a fraction of `lr`."""
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    """Max global gradient norm; 0 = off."""
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    """`fp32` or `bf16` (autocast)."""
    seed: int = 0
    """Weights, dropout and shuffling; the same config twice gives the same losses (0 to 2**32 - 1)."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: `stop` (exit 1 at that step, one line naming it and the
    newest checkpoint whose loss was finite) or `skip_step` (no update; counted as `nonfinite_skips` in the
    metrics). See [clusters.md](clusters.md#diverged-runs-keep-their-good-checkpoints)."""
    max_nonfinite_skips: int = 10
    """`skip_step`: more skipped steps than this in a row stop the run as `stop` does."""
    logits: str = "counted"
    """Language models on instruction data (a loss mask): `counted` runs the output head, the fp32 cast and the
    cross-entropy on the tokens the loss counts only (the same loss and gradients, less compute and
    activation memory where the head is a large share of the weight matmuls; see
    [hf.md](hf.md#the-head-on-counted-tokens)); `all` on every position, as Hugging Face's own loss does.
    Without a loss mask every token counts and both are the same. `hf` models (and `gpt`'s head; a pipeline
    stage, or a head whose input is a sequence shard, runs every position); a model whose forward reshapes
    its head's output is refused at the first step, naming `all`."""

    objective: str = "sft"
    """`sft`: next-token cross-entropy on the counted tokens (pretraining, instruction tuning). `dpo`:
    preference tuning on pairs of a chosen and a rejected response (`lm` models, not with
    `parallel.pp_size > 1`), set in `train.dpo`; see [preference.md](preference.md)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Preference tuning, read with `train.objective: dpo`: the keys below."""

    _ON_NONFINITE: ClassVar[tuple[str, ...]] = ("stop", "skip_step")
    _OBJECTIVES: ClassVar[tuple[str, ...]] = ("sft", "dpo")
    _LOGITS: ClassVar[tuple[str, ...]] = ("counted", "all")

    def __post_init__(self) -> None:
        check_field(self.max_steps is not None or self.epochs is not None, "train.max_steps",
               self.max_steps, "an integer >= 1 (or set train.epochs)")
        check_field(self.max_steps is None or self.max_steps >= 1, "train.max_steps", self.max_steps,
               "an integer >= 1 or null")
        check_field(self.epochs is None or self.epochs >= 1, "train.epochs", self.epochs,
               "an integer >= 1 or null")
        check_field(self.grad_accum_steps >= 1, "train.grad_accum_steps", self.grad_accum_steps,
               "an integer >= 1")
        check_field(self.global_batch_size is None or self.global_batch_size >= 1, "train.global_batch_size",
               self.global_batch_size, "an integer >= 1 or null")
        check_field(self.lr > 0, "train.lr", self.lr, "a number > 0")
        check_field(0 <= self.seed < SEED_LIMIT, "train.seed", self.seed, SEED_ALLOWED)
        check_field(self.optimizer in ("adamw", "sgd"), "train.optimizer", self.optimizer,
               "one of ['adamw', 'sgd']")
        check_field(self.logits in self._LOGITS, "train.logits", self.logits, f"one of {list(self._LOGITS)}")
        check_field(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "a number >= 0")
        check_field(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas",
               self.betas, "two numbers in [0, 1)")
        check_field(0 <= self.momentum < 1, "train.momentum", self.momentum, "a number in [0, 1)")
        check_field(self.lr_schedule in ("cosine", "constant"), "train.lr_schedule", self.lr_schedule,
               "one of ['cosine', 'constant']")
        check_field(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "an integer >= 0")
        check_field(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio,
               "a number in [0, 1]")
        check_field(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "a number >= 0 (0 = off)")
        check_field(self.precision in ("fp32", "bf16"), "train.precision", self.precision,
               "one of ['fp32', 'bf16']")
        check_field(self.on_nonfinite in self._ON_NONFINITE, "train.on_nonfinite", self.on_nonfinite,
               f"one of {list(self._ON_NONFINITE)}")
        check_field(self.max_nonfinite_skips >= 1, "train.max_nonfinite_skips", self.max_nonfinite_skips,
               "an integer >= 1 (consecutive skipped steps before the run stops)")
        check_field(self.objective in self._OBJECTIVES, "train.objective", self.objective,
                    f"one of {list(self._OBJECTIVES)}")
