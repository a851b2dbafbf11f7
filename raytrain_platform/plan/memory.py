"""Per-device training memory of a model under a parallel layout, in bytes, split into
parameters, gradients, optimizer state, activations and overhead (collective buffers,
gathered FSDP units, bf16 weight copies).

**Precision** is what this platform does: ``fp32`` trains in fp32; ``bf16`` is
autocast (core/engine.py), so weights, gradients and optimizer state stay fp32 and
activations are mostly 16-bit, with bf16 copies of matmul weights kept for backward.
Under FSDP with ``bf16`` the gathered units are bf16 (``parallel.mixed_precision``).

**Model state** per device: ``P_local = stage params, TP-sharded, / shard``, following
parallel/pp.py, tp.py and fsdp.py. Pipeline rank ``r`` holds its stages' blocks
(``parallel.pp_split``, or balanced with earlier stages taking the remainder, as
parallel/dims.py `stage_blocks` splits them; interleaved 1F1B: stages ``r`` and
``r + pp``), the embeddings with stage 0 and the final norm and LM head with the last
stage (a tied head: the last stage keeps its own copy of the embedding). TP divides
what the model's TP plan shards (the shape's ``tp_*_params``: the blocks' linear layers,
the embeddings by rows, the LM head by columns) by ``tp``; norms, row-parallel biases
and what the plan leaves out (a Mixture of Experts' experts) stay replicated. FSDP divides
what is left by its shard degree. Bytes: parameters 4, gradients 4, AdamW 8 (exp_avg,
exp_avg_sq) plus one 4-byte ``step`` tensor per parameter tensor (torch keeps it; on
CUDA it lives on the host unless ``capturable``), SGD with momentum 4, without 0.
Pipeline ranks differ: `estimate_memory` gives one rank (``pp_rank``) or, by default,
the rank that needs the most (the device that must fit).

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
block's full activations are live while it is recomputed. Pipeline: with 1F1B rank ``r``
holds ``min(pp - r, micro-batches)`` micro-batches in flight (the first stage the most).

Not modelled: allocator fragmentation and CUDA/NCCL context (the planner keeps a
headroom for them), temporaries of single kernels, sequence parallelism, GQA. Blocks
other than the GPT-2 and Llama-style ones (extra norms, fused projections, routed
experts: a token's ``top_k`` experts count as one MLP of their width) are estimated
with the Llama-style terms, and the model's shape says so (``ModelShape.notes``).

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
from raytrain_platform.parallel.dims import rank_blocks
from raytrain_platform.plan.lora import LoraSize
from raytrain_platform.plan.shapes import ModelShape

__all__ = ["Layout", "MemoryEstimate", "RankPart", "estimate_memory", "rank_params", "rank_part"]

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class Layout:
    """Degrees of one parallel layout: ``dp`` data-parallel replicas or shards, ``shard``
    the FSDP degree (1 = replicated state, as DDP), ``tp`` tensor, ``pp`` pipeline;
    ``micro_batch`` sequences per forward, ``micro_batches`` forwards per optimizer step
    (gradient accumulation, or a pipeline's micro-batches); ``stages_per_rank`` pipeline
    stages each rank holds (2 for interleaved 1F1B) and ``pp_split`` the blocks of each
    stage (``parallel.pp_split``; None: balanced)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    shard: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    stages_per_rank: int = 1
    pp_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "shard", "micro_batch", "micro_batches", "stages_per_rank"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"layout.{name}", value, "an integer >= 1")
        if self.dp % self.shard:
            raise ConfigError("layout.shard", self.shard, f"a divisor of layout.dp ({self.dp})")
        if self.pp_split is not None and (len(self.pp_split) != self.stages or min(self.pp_split) < 1):
            raise ConfigError("layout.pp_split", list(self.pp_split),
                              f"{self.stages} block counts >= 1 "
                              f"(pp {self.pp} x {self.stages_per_rank} stages per rank)")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank


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
    pp_rank: int = 0  # the pipeline rank estimated
    # Of `activations`: one block's, live again while it is recomputed (activation
    # checkpointing), so not among what the forward saves.
    recomputed: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead

    def to_dict(self) -> dict:
        # `recomputed` is a part of `activations`, not another term of the total: left out.
        fields = {k: v for k, v in asdict(self).items() if k != "recomputed"}
        return {**fields, "overhead_parts": dict(self.overhead_parts), "total": self.total}


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank holds: its stages' blocks, the embeddings (stage 0) or not,
    the final norm and LM head (the last stage) or not."""

    blocks: int
    first: bool
    last: bool


def rank_part(model: ModelShape, layout: Layout, pp_rank: int = 0) -> RankPart:
    """The stages parallel/pp.py gives `pp_rank`: ``r, r + pp, ...`` (looped), each with
    the blocks `stage_blocks` assigns it.

    >>> from raytrain_platform.models.specs import GPTSpec
    >>> from raytrain_platform.plan.shapes import gpt_shape
    >>> m = gpt_shape(GPTSpec(n_layer=4, n_embd=32, n_head=2, block_size=16))
    >>> rank_part(m, Layout(pp=2, pp_split=(1, 3)), 1)
    RankPart(blocks=3, first=False, last=True)
    """
    if not 0 <= pp_rank < layout.pp:
        raise ConfigError("pp_rank", pp_rank, f"a pipeline rank from 0 to {layout.pp - 1}")
    _check_stages(model, layout)
    return _part(model, layout, pp_rank)


def _check_stages(model: ModelShape, layout: Layout) -> None:
    """The layout's stages can split `model` (checked once per layout: O(stages))."""
    if model.kind != "transformer":
        if layout.tp > 1 or layout.stages > 1:
            raise ConfigError("layout", f"tp={layout.tp}, pp={layout.pp}",
                              f"tp=1 and pp=1 for a {model.kind} model (TP and PP split transformer blocks)")
        return
    if model.n_layer < layout.stages:
        raise ConfigError("layout.pp", layout.pp, f"at most {model.n_layer} pipeline stages in all "
                          f"(the model's blocks; {layout.stages_per_rank} stage(s) per rank)")
    if layout.pp_split and sum(layout.pp_split) != model.n_layer:
        raise ConfigError("layout.pp_split", list(layout.pp_split),
                          f"block counts summing to the model's {model.n_layer} blocks")


def _part(model: ModelShape, layout: Layout, pp_rank: int) -> RankPart:
    """`rank_part` of a checked layout: the blocks of its stages ``r, r + pp, ...`` as
    the pipeline cuts them (`parallel.dims.rank_blocks`, O(1) for the planner's
    layouts of up to a million stages)."""
    if model.kind != "transformer":
        return RankPart(blocks=0, first=True, last=True)  # an mlp's parameters are all "first"
    blocks = rank_blocks(model.n_layer, layout.stages, layout.pp, pp_rank, layout.pp_split)
    return RankPart(blocks=blocks, first=pp_rank == 0, last=pp_rank == layout.pp - 1)


def _heaviest_candidates(layout: Layout) -> range | list[int]:
    """The pipeline ranks that can need the most. Balanced stages: rank 0 (embeddings),
    rank 1 and the last rank (final norm and head). Ranks 1 .. pp-2 hold no ends, and
    their blocks (earlier stages take the remainder) and micro-batches in flight
    (``pp - r``) never grow with the rank, nor does any term of their estimate: rank 1
    needs at least as much as any of them, and ``max`` keeps the first of equals, as a
    scan of every rank would. An explicit ``pp_split``: every rank."""
    if layout.pp_split:
        return range(layout.pp)
    return sorted({0, min(1, layout.pp - 1), layout.pp - 1})


def _tp_block_params(model: ModelShape, tp: int) -> int:
    """One block's parameters on one TP rank (shards rounded up, as the first ranks hold)."""
    return model.layer_params - model.tp_layer_params + -(-model.tp_layer_params // tp)


def _ends(model: ModelShape, part: RankPart, tp: int) -> tuple[int, int]:
    """(parameters, tensors) outside the blocks on one TP rank of this pipeline rank:
    row-split embeddings, the replicated final norm, the column-split LM head."""
    params = tensors = 0
    if part.first:
        split = model.first_params if model.tp_first_params is None else model.tp_first_params
        params, tensors = model.first_params - split + -(-split // tp), model.first_tensors
    if part.last:
        params += model.last_params - model.tp_last_params + -(-model.tp_last_params // tp)
        tensors += model.last_tensors
        if model.tied and not part.first:  # the last stage's own copy of the tied head (Megatron)
            params, tensors = params + -(-model.last_matmul_params // tp), tensors + 1
    return params, tensors


def rank_params(model: ModelShape, layout: Layout, pp_rank: int = 0) -> tuple[int, int]:
    """(parameters, parameter tensors) of pipeline rank `pp_rank` on one TP rank, before FSDP."""
    return _part_params(model, layout, rank_part(model, layout, pp_rank))


def _part_params(model: ModelShape, layout: Layout, part: RankPart) -> tuple[int, int]:
    if model.kind != "transformer":
        return model.num_params, model.num_tensors
    ends, end_tensors = _ends(model, part, layout.tp)
    blocks = part.blocks * _tp_block_params(model, layout.tp)
    return blocks + ends, part.blocks * model.layer_tensors + end_tensors


def _state_bytes(model: ModelShape, layout: Layout, part: RankPart, optimizer: str,
                 momentum: float, lora: LoraSize | None = None) -> tuple[int, int, int, int]:
    params, tensors = _part_params(model, layout, part)
    if lora is not None:  # the base and the adapters held; only the adapters train (plan/lora.py)
        params, tensors = params + lora.params, lora.tensors
    local = math.ceil(params / layout.shard)
    trained = local if lora is None else math.ceil(lora.params / layout.shard)
    if optimizer == "adamw":
        opt = 8 * trained + 4 * tensors  # exp_avg + exp_avg_sq in fp32, one fp32 step per tensor
    else:
        opt = 4 * trained if momentum > 0 else 0  # momentum_buffer
    return 4 * local, 4 * trained, opt, local


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


def _activations(model: ModelShape, layout: Layout, pp_rank: int, part: RankPart, e: int, r: int,
                 checkpointing: bool) -> tuple[int, int]:
    """(activation bytes, of them the block live again during its recompute)."""
    b = layout.micro_batch
    if model.kind == "dense":
        return _mlp_activations(model, b, e), 0
    full_block = _block_activations(model, b, layout.tp, e, r)
    if checkpointing:
        # Only block inputs are kept; one block is live again while it is recomputed.
        per_block, live = model.seq_len * b * model.hidden * r, full_block
    else:
        per_block, live = full_block, 0
    in_flight = min(layout.pp - pp_rank, layout.micro_batches)  # 1F1B: rank r holds pp - r micro-batches
    acts = part.blocks * per_block * in_flight + live
    return acts + (_head_activations(model, b, e, r) if part.last else 0), live


def _overhead(model: ModelShape, layout: Layout, part: RankPart, precision: str,
              local_params: int, lora: LoraSize | None = None) -> list[tuple[str, int]]:
    parts: list[tuple[str, int]] = []
    grad = 4 if lora is None else 0  # LoRA: a frozen unit has no gradients (its adapters' are tiny)
    if layout.shard > 1:
        # FSDP gathers one block (and prefetches the next) and keeps the root unit
        # (embeddings, head) gathered; a unit's full gradients exist until reduce-scatter.
        gather = 2 if precision == "bf16" else 4
        if model.kind == "transformer":
            ends, _ = _ends(model, part, layout.tp)
            fsdp = _tp_block_params(model, layout.tp) * (2 * gather + grad) + ends * gather
        else:  # no blocks: the whole model is the one (root) unit
            fsdp = model.num_params * (gather + 4)
        parts.append(("fsdp_gathered_units", fsdp))
    elif layout.dp > 1:
        # DDP's flat gradient buckets (gradient_as_bucket_view=False, parallel/ddp.py); a
        # pipeline's replicas all-reduce one flat copy of the gradients (parallel/pp.py).
        name = "ddp_gradient_buckets" if layout.pp == 1 else "flat_gradient_allreduce"
        parts.append((name, 4 * (local_params if lora is None else lora.params)))
    if precision == "bf16" and layout.shard == 1:
        # Autocast's bf16 copies of matmul weights, saved for backward.
        parts.append(("bf16_weight_copies", 2 * _local_matmul_params(model, layout, part)))
    return parts


def _local_matmul_params(model: ModelShape, layout: Layout, part: RankPart) -> int:
    if model.kind == "dense":
        return model.last_matmul_params
    head = -(-model.last_matmul_params // layout.tp) if part.last else 0
    return part.blocks * model.layer_matmul_params // layout.tp + head


def _estimate_rank(model: ModelShape, layout: Layout, pp_rank: int, precision: str, optimizer: str,
                   momentum: float, activation_checkpointing: bool,
                   lora: LoraSize | None = None) -> MemoryEstimate:
    part = _part(model, layout, pp_rank)
    params, grads, opt, local = _state_bytes(model, layout, part, optimizer, momentum, lora)
    e = 2 if precision == "bf16" else 4
    r = 4  # the residual stream stays fp32 under autocast
    acts, recomputed = _activations(model, layout, pp_rank, part, e, r, activation_checkpointing)
    parts = _overhead(model, layout, part, precision, local, lora)
    return MemoryEstimate(params=params, grads=grads, optimizer=opt, activations=acts,
                          overhead=sum(b for _, b in parts), local_params=local,
                          overhead_parts=tuple(parts), pp_rank=pp_rank, recomputed=recomputed)


def estimate_memory(*, model: ModelShape, layout: Layout, precision: str = "fp32",
                    optimizer: str = "adamw", momentum: float = 0.9,
                    activation_checkpointing: bool = False, pp_rank: int | None = None,
                    lora: LoraSize | None = None) -> MemoryEstimate:
    """Bytes on one device for training `model` with `layout` (see the module docstring):
    on pipeline rank `pp_rank`, or (None) on the rank that needs the most. With `lora`,
    the base is frozen: gradients and optimizer state for the adapters only (DDP/FSDP).

    >>> from raytrain_platform.plan.shapes import preset_shape
    >>> m = preset_shape("llama2-7b")
    >>> full = estimate_memory(model=m, layout=Layout(dp=8, shard=8, micro_batch=1))
    >>> full.params == 4 * -(-m.num_params // 8)
    True
    >>> pp = Layout(pp=2, pp_split=(8, 24))  # stage 1: 24 blocks, final norm and head
    >>> estimate_memory(model=m, layout=pp).pp_rank
    1
    >>> estimate_memory(model=m, layout=pp, pp_rank=0).local_params == 8 * m.layer_params + m.first_params
    True
    """
    if precision not in PRECISIONS:
        raise ConfigError("--precision", precision, f"one of {list(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError("--optimizer", optimizer, f"one of {list(OPTIMIZERS)}")
    if activation_checkpointing and model.kind != "transformer":
        raise ConfigError("--activation-checkpointing", True, "off for an mlp (it checkpoints transformer blocks)")
    if lora is not None and layout.tp * layout.pp > 1:
        raise ConfigError("layout", f"tp={layout.tp}, pp={layout.pp}", "tp=1 and pp=1 with LoRA (DDP or FSDP)")
    if pp_rank is not None and not 0 <= pp_rank < layout.pp:
        raise ConfigError("pp_rank", pp_rank, f"a pipeline rank from 0 to {layout.pp - 1}")
    _check_stages(model, layout)
    ranks = _heaviest_candidates(layout) if pp_rank is None else [pp_rank]
    return max((_estimate_rank(model, layout, rank, precision, optimizer, momentum, activation_checkpointing, lora)
                for rank in ranks), key=lambda est: est.total)
