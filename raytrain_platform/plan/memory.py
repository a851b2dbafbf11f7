"""Per-device training memory of a model under a parallel layout, in bytes, split into
parameters, gradients, optimizer state, activations and overhead (collective buffers,
gathered FSDP units, bf16 weight copies).

**Precision** is what this platform does: ``fp32`` trains in fp32; ``bf16`` is
autocast (core/engine.py), so weights, gradients and optimizer state stay fp32 and
activations are mostly 16-bit, with bf16 copies of matmul weights kept for backward.
Under FSDP with ``bf16`` the gathered units are bf16 (``parallel.mixed_precision``).

**Model state** per device: ``P_local = stage params, TP-sharded, / shard``, where a
pipeline stage holds ``ceil(L / pp)`` blocks plus the embeddings (first stage) or the
final norm and head (last stage), TP divides the blocks' linear layers by ``tp``
(norms, row-parallel biases, embeddings and head stay replicated), and FSDP divides
what is left by its shard degree. Bytes: parameters 4, gradients 4, AdamW 8 (exp_avg,
exp_avg_sq) plus one 4-byte ``step`` tensor per parameter tensor (torch keeps it; on
CUDA it lives on the host unless ``capturable``), SGD with momentum 4, without 0.

**Activations** per block, per micro-batch of ``b`` sequences of ``s`` tokens,
hidden ``h``, ``a`` heads (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4: ``s*b*h*(34 + 5*a*s/h)`` bytes in
16-bit with dropout, ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with TP degree ``t``),
re-derived per saved tensor so dtypes can differ:

- replicated: 2 norm inputs in the residual dtype (fp32 under autocast) + the 2 inputs
  of the q/k/v and up projections in the activation dtype ``e`` (2 bytes bf16, 4 fp32)
  + 1-byte dropout masks after attention and MLP when dropout > 0 (CUDA's fused
  dropout; on CPU a mask is a full-width float, and SDPA with dropout falls back to
  the math kernel that stores ``s x s``: CPU estimates with dropout are low);
- divided by ``t``: q, k, v and the attention output (4 ``e``), the MLP's inner
  tensors (GeLU: 2 of width ``ffn``; SwiGLU: 4);
- attention: SDPA/flash stores no ``s x s`` matrix, only a fp32 log-sum-exp per head
  and token; eager attention stores ``a*s*s*b`` softmax outputs (+ mask and dropout
  output with dropout);
- the head: final norm input, head input and fp32 log-probabilities ``4*s*b*vocab``
  (the loss runs in fp32, models/tasks.py).

With activation checkpointing each block keeps only its input (residual dtype) and one
block's full activations are live while it is recomputed. Pipeline: with 1F1B the first
stage holds ``min(pp, micro-batches)`` micro-batches in flight.

Not modelled: allocator fragmentation and CUDA/NCCL context (the planner keeps a
headroom for them), temporaries of single kernels, sequence parallelism, GQA.

>>> from raytrain_platform.plan.shapes import preset_shape
>>> est = estimate_memory(model=preset_shape("gpt2"), layout=Layout(micro_batch=8),
...                       precision="bf16", optimizer="adamw")
>>> round(est.params / 2**20), round(est.optimizer / 2**20)
(475, 949)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.shapes import ModelShape

__all__ = ["Layout", "MemoryEstimate", "estimate_memory", "stage_params"]

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class Layout:
    """Degrees of one parallel layout: ``dp`` data-parallel replicas or shards, ``shard``
    the FSDP degree (1 = replicated state, as DDP), ``tp`` tensor, ``pp`` pipeline;
    ``micro_batch`` sequences per forward, ``micro_batches`` forwards per optimizer step
    (gradient accumulation, or a pipeline's micro-batches)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    shard: int = 1
    micro_batch: int = 1
    micro_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "shard", "micro_batch", "micro_batches"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"layout.{name}", value, "an integer >= 1")
        if self.dp % self.shard:
            raise ConfigError("layout.shard", self.shard, f"a divisor of layout.dp ({self.dp})")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device; ``total`` is their sum. ``overhead_parts`` name what the overhead holds."""

    params: int
    grads: int
    optimizer: int
    activations: int
    overhead: int
    local_params: int  # parameters this device holds (after TP, PP, FSDP)
    overhead_parts: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead_parts": dict(self.overhead_parts), "total": self.total}


def stage_params(model: ModelShape, *, tp: int = 1, pp: int = 1) -> tuple[int, int]:
    """(parameters, parameter tensors) of the largest pipeline stage on one TP rank."""
    if model.family != "transformer":
        if tp > 1 or pp > 1:
            raise ConfigError("layout", f"tp={tp}, pp={pp}",
                              f"tp=1 and pp=1 for a {model.family} model (TP and PP split transformer blocks)")
        return model.num_params, model.num_tensors
    layers = math.ceil(model.n_layer / pp)
    per_layer = model.layer_params - model.tp_layer_params + model.tp_layer_params // tp
    if pp == 1:
        ends, end_tensors = model.first_params + model.last_params, model.first_tensors + model.last_tensors
    else:  # the first or the last stage, whichever holds more
        ends, end_tensors = max((model.first_params, model.first_tensors),
                                (model.last_params, model.last_tensors))
    return layers * per_layer + ends, layers * model.layer_tensors + end_tensors


def _state_bytes(model: ModelShape, layout: Layout, optimizer: str, momentum: float) -> tuple[int, int, int, int]:
    params, tensors = stage_params(model, tp=layout.tp, pp=layout.pp)
    local = math.ceil(params / layout.shard)
    if optimizer == "adamw":
        opt = 8 * local + 4 * tensors  # exp_avg + exp_avg_sq in fp32, one fp32 step per tensor
    else:
        opt = 4 * local if momentum > 0 else 0  # momentum_buffer
    return 4 * local, 4 * local, opt, local


def _block_activations(model: ModelShape, b: int, tp: int, e: int, r: int) -> int:
    """Bytes one transformer block saves for backward (see the module docstring)."""
    s, h, a = model.seq_len, model.hidden, model.n_head
    sbh = s * b * h
    mask = 1 if model.dropout > 0 else 0
    replicated = sbh * (2 * r + 2 * e + model.resid_dropouts * mask)
    mlp_inner = (4 if model.gated_mlp else 2) * model.ffn_hidden * s * b * e
    sharded = 4 * sbh * e + mlp_inner
    if model.attention == "eager":
        sharded += a * s * s * b * (e + mask * (1 + e))
    else:
        sharded += 4 * a * s * b  # fp32 log-sum-exp per head and token
    return replicated + sharded // tp


def _head_activations(model: ModelShape, b: int, e: int, r: int) -> int:
    s = model.seq_len
    return s * b * model.hidden * (r + e) + 4 * s * b * model.vocab


def _mlp_activations(model: ModelShape, b: int, e: int) -> int:
    """Each Linear saves its input, each GeLU its input (+ a dropout mask); fp32 log-probs."""
    widths = model.widths
    hidden = widths[1:-1]
    mask = 1 if model.dropout > 0 else 0
    linear_inputs = sum(widths[:-1]) * b * e
    return linear_inputs + sum(hidden) * b * (e + mask) + 4 * b * widths[-1]


def _activations(model: ModelShape, layout: Layout, e: int, r: int, checkpointing: bool) -> int:
    b = layout.micro_batch
    if model.family == "mlp":
        return _mlp_activations(model, b, e)
    layers = math.ceil(model.n_layer / layout.pp)
    full_block = _block_activations(model, b, layout.tp, e, r)
    if checkpointing:
        # Only block inputs are kept; one block is live again while it is recomputed.
        per_block, live = model.seq_len * b * model.hidden * r, full_block
    else:
        per_block, live = full_block, 0
    in_flight = min(layout.pp, layout.micro_batches)  # 1F1B: first stage holds pp micro-batches
    first_stage = layers * per_block * in_flight + live
    last_stage = layers * per_block + live + _head_activations(model, b, e, r)
    return last_stage if layout.pp == 1 else max(first_stage, last_stage)


def _overhead(model: ModelShape, layout: Layout, precision: str, local_params: int) -> list[tuple[str, int]]:
    parts: list[tuple[str, int]] = []
    if layout.shard > 1:
        # FSDP gathers one block (and prefetches the next) and keeps the root unit
        # (embeddings, head) gathered; a unit's full gradients exist until reduce-scatter.
        gather = 2 if precision == "bf16" else 4
        if model.family == "transformer":
            block = model.layer_params - model.tp_layer_params + model.tp_layer_params // layout.tp
            fsdp = block * (2 * gather + 4) + (model.first_params + model.last_params) * gather
        else:  # no blocks: the whole model is the one (root) unit
            fsdp = model.num_params * (gather + 4)
        parts.append(("fsdp_gathered_units", fsdp))
    elif layout.dp > 1:
        # DDP's flat gradient buckets (gradient_as_bucket_view=False, parallel/ddp.py)
        parts.append(("ddp_gradient_buckets", 4 * local_params))
    if precision == "bf16" and layout.shard == 1:
        # Autocast's bf16 copies of matmul weights, saved for backward.
        parts.append(("bf16_weight_copies", 2 * _local_matmul_params(model, layout)))
    return parts


def _local_matmul_params(model: ModelShape, layout: Layout) -> int:
    if model.family == "mlp":
        return model.last_matmul_params
    layers = math.ceil(model.n_layer / layout.pp)
    return layers * model.layer_matmul_params // layout.tp + model.last_matmul_params


def estimate_memory(*, model: ModelShape, layout: Layout, precision: str = "fp32",
                    optimizer: str = "adamw", momentum: float = 0.9,
                    activation_checkpointing: bool = False) -> MemoryEstimate:
    """Bytes per device for training `model` with `layout` (see the module docstring).

    >>> from raytrain_platform.plan.shapes import preset_shape
    >>> m = preset_shape("llama2-7b")
    >>> full = estimate_memory(model=m, layout=Layout(dp=8, shard=8, micro_batch=1))
    >>> full.params == 4 * -(-m.num_params // 8)
    True
    """
    if precision not in PRECISIONS:
        raise ConfigError("--precision", precision, f"one of {list(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError("--optimizer", optimizer, f"one of {list(OPTIMIZERS)}")
    if activation_checkpointing and model.family != "transformer":
        raise ConfigError("--activation-checkpointing", True, "off for an mlp (it checkpoints transformer blocks)")
    params, grads, opt, local = _state_bytes(model, layout, optimizer, momentum)
    e = 2 if precision == "bf16" else 4
    r = 4  # the residual stream stays fp32 under autocast
    acts = _activations(model, layout, e, r, activation_checkpointing)
    parts = _overhead(model, layout, precision, local)
    return MemoryEstimate(params=params, grads=grads, optimizer=opt, activations=acts,
                          overhead=sum(b for _, b in parts), local_params=local,
                          overhead_parts=tuple(parts))
