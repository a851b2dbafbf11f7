"""What preference tuning (DPO, issue 49) adds to a run's memory per device, on top of
`memory.estimate_memory`:

- a pair's chosen and rejected go through one forward, concatenated: the activations
  of ``2 x data.batch_size`` sequences;
- the reference model (``reference="copy"``): a frozen copy of the policy (or of the
  model `reference_shape` describes), sharded as the policy is (TP, FSDP): its fp32
  weights only, no gradients, no optimizer state. None (``"none"``) with
  ``train.dpo.precompute_reference`` (its log-probs are kept with the data: two numbers
  per pair) or with LoRA (the reference is the base with the adapters disabled).

Not modelled: the reference forward's transient memory (it runs under ``no_grad``
before the policy's forward, so one block's activations and its log-probabilities live
only while nothing of the policy's forward is held; under FSDP its gathered units take
the place the policy's take a moment later).

>>> from raytrain_platform.plan.memory import Layout
>>> from raytrain_platform.plan.shapes import preset_shape
>>> m = preset_shape("gpt2")
>>> reference_bytes(model=m, layout=Layout(), reference="copy") == 4 * m.num_params
True
>>> dpo_reference(precompute_reference=False, lora=True)
'none'
"""

from __future__ import annotations

import dataclasses
import math

from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.lora import LoraSize
from raytrain_platform.plan.memory import Layout, MemoryEstimate, estimate_memory, rank_params
from raytrain_platform.plan.shapes import ModelShape

__all__ = ["REFERENCES", "REFERENCE_PART", "dpo_reference", "reference_bytes", "estimate_dpo_memory"]

REFERENCES = ("copy", "none")
REFERENCE_PART = "dpo_reference_weights"  # its name among a MemoryEstimate's overhead parts


def dpo_reference(*, precompute_reference: bool, lora: bool) -> str:
    """The reference a DPO run holds: "none" where its log-probs are precomputed or
    where LoRA is on (the base, adapters disabled), else "copy"."""
    return "none" if precompute_reference or lora else "copy"


def reference_bytes(*, model: ModelShape, layout: Layout, reference: str, pp_rank: int = 0,
                    reference_shape: ModelShape | None = None) -> int:
    """Bytes of the reference model on one device of `layout` (pipeline rank `pp_rank`):
    with "copy", the fp32 weights of what that device holds of `reference_shape` (default
    `model`, the policy) after TP, PP and FSDP, as the policy's own; with "none", 0."""
    if reference not in REFERENCES:
        raise ConfigError("reference", reference, f"one of {list(REFERENCES)} (a frozen copy, or none: "
                          "precomputed log-probs or LoRA)")
    if reference == "none":
        return 0
    params, _ = rank_params(reference_shape or model, layout, pp_rank)
    return 4 * math.ceil(params / layout.shard)


def estimate_dpo_memory(*, model: ModelShape, layout: Layout, reference: str, precision: str = "fp32",
                        optimizer: str = "adamw", momentum: float = 0.9, activation_checkpointing: bool = False,
                        pp_rank: int | None = None, lora: LoraSize | None = None,
                        reference_shape: ModelShape | None = None) -> MemoryEstimate:
    """`estimate_memory` of a DPO run: `layout.micro_batch` pairs are ``2 x`` as many
    sequences in one forward, and the reference's weights (`reference_bytes`) are an
    overhead part named `REFERENCE_PART`. ``reference="copy"`` with `lora` is refused:
    LoRA's reference is the base itself."""
    if lora is not None and reference == "copy" and reference_shape is None:
        raise ConfigError("reference", reference, "none with LoRA (the reference is the base with the "
                          "adapters disabled: no copy)")
    pairs = dataclasses.replace(layout, micro_batch=2 * layout.micro_batch)
    est = estimate_memory(model=model, layout=pairs, precision=precision, optimizer=optimizer, momentum=momentum,
                          activation_checkpointing=activation_checkpointing, pp_rank=pp_rank, lora=lora)
    held = reference_bytes(model=model, layout=layout, reference=reference, pp_rank=est.pp_rank,
                           reference_shape=reference_shape)
    if not held:
        return est
    return dataclasses.replace(est, overhead=est.overhead + held,
                               overhead_parts=est.overhead_parts + ((REFERENCE_PART, held),))
