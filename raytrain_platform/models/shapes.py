"""A model as the memory planner (`rtp plan`, plan/) sees it: how many parameters and
tensors it has, how they split into repeated blocks and the rest, which of them tensor
parallelism shards, and the sizes that drive activation memory. Each model family
answers with one of these (`ModelFamily.shape`).

Counts are exact for the built-in `gpt` and `mlp` (checked against real modules in
tests/test_plan.py). No torch here.

>>> from raytrain_platform.models.specs import GPTSpec
>>> shape = gpt_shape(GPTSpec(n_layer=2, n_embd=64, n_head=4, block_size=32))
>>> shape.num_params == GPTSpec(n_layer=2, n_embd=64, n_head=4, block_size=32).num_params()
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.specs import GPTSpec, MLPSpec

__all__ = ["ModelShape", "transformer_shape", "gpt_shape", "mlp_shape"]


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it. Invariant:
    ``num_params == first_params + n_layer * layer_params + last_params``."""

    name: str
    kind: str  # "transformer" (repeated blocks) | "dense" (Linear layers of different widths)
    num_params: int
    num_tensors: int  # parameter tensors (AdamW keeps one `step` tensor per tensor)
    n_layer: int  # repeated blocks (transformer) or Linear layers (mlp)
    layer_params: int  # parameters in one block (0 for mlp: its layers differ)
    layer_tensors: int
    first_params: int  # outside the blocks, on the first pipeline stage (embeddings)
    first_tensors: int
    last_params: int  # outside the blocks, on the last stage (final norm, LM head)
    last_tensors: int
    tp_layer_params: int  # of layer_params, those TP shards (the blocks' linear layers)
    layer_matmul_params: int  # weights autocast casts to bf16 (linear layers)
    last_matmul_params: int
    hidden: int = 0
    n_head: int = 1
    seq_len: int = 1
    vocab: int = 0
    ffn_hidden: int = 0  # MLP inner width of a block
    gated_mlp: bool = False  # SwiGLU (gate, up, down) instead of GeLU (up, down)
    dropout: float = 0.0
    resid_dropouts: int = 2  # dropout layers per block that save a mask (after attention, MLP)
    attention: str = "sdpa"  # "sdpa" (flash / memory-efficient: no s^2 term) | "eager"
    widths: tuple[int, ...] = ()  # mlp: input, hidden..., outputs
    exact: bool = True
    tp_last_params: int = 0  # of last_params, those TP shards (an untied LM head)
    tied: bool = False  # the LM head is the token embedding (counted in first_params)

    def to_dict(self) -> dict:
        return asdict(self)


def transformer_shape(name: str, *, n_layer: int, hidden: int, n_head: int, seq_len: int, vocab: int,
                 ffn_hidden: int, gated: bool, bias: bool, learned_pos: bool, tied: bool,
                 dropout: float = 0.0) -> ModelShape:
    """Exact counts for a GPT-2 style (LayerNorm, GeLU, optional biases, learned positions)
    or Llama style (RMSNorm, SwiGLU, no biases) decoder."""
    h, f, b = hidden, ffn_hidden, 1 if bias else 0
    norm, norm_tensors = (2 * h, 2) if (bias and not gated) else (h, 1)
    attn = 4 * h * h + 4 * h * b
    mlp = (3 * h * f if gated else 2 * h * f) + (f + h) * b * (0 if gated else 1)
    layer = 2 * norm + attn + mlp
    linear_tensors = (4 + (3 if gated else 2)) * (2 if b else 1)
    # Column-parallel (q, k, v, up/gate) weights and biases are sharded; row-parallel
    # (o, down) weights are sharded, their biases replicated (Megatron's split).
    tp_layer = 4 * h * h + (3 * h * f if gated else 2 * h * f) + (3 * h + (0 if gated else f)) * b
    first = vocab * h + (seq_len * h if learned_pos else 0)
    last = norm + (0 if tied else h * vocab)
    return ModelShape(
        name=name, kind="transformer",
        num_params=first + n_layer * layer + last,
        num_tensors=(1 + int(learned_pos)) + n_layer * (2 * norm_tensors + linear_tensors)
        + norm_tensors + (0 if tied else 1),
        n_layer=n_layer, layer_params=layer, layer_tensors=2 * norm_tensors + linear_tensors,
        first_params=first, first_tensors=1 + int(learned_pos),
        last_params=last, last_tensors=norm_tensors + (0 if tied else 1),
        tp_layer_params=tp_layer,
        layer_matmul_params=4 * h * h + (3 if gated else 2) * h * f,
        last_matmul_params=h * vocab,  # tied or not, the head is a matmul
        hidden=h, n_head=n_head, seq_len=seq_len, vocab=vocab, ffn_hidden=f, gated_mlp=gated,
        dropout=dropout, tp_last_params=0 if tied else h * vocab, tied=tied)


def gpt_shape(spec: GPTSpec, *, name: str = "gpt") -> ModelShape:
    """The built-in `gpt` (models/gpt.py): untied LM head, learned positions, SDPA attention."""
    spec.validate()
    shape = transformer_shape(name, n_layer=spec.n_layer, hidden=spec.n_embd, n_head=spec.n_head,
                         seq_len=spec.block_size, vocab=spec.vocab_size, ffn_hidden=4 * spec.n_embd,
                         gated=False, bias=spec.bias, learned_pos=True, tied=False,
                         dropout=spec.dropout)
    # models/gpt.py drops out after the MLP only (attention dropout is inside SDPA).
    shape = replace(shape, resid_dropouts=1)
    # The source of truth for the count is the spec; the split above must agree with it.
    assert shape.num_params == spec.num_params(), (shape.num_params, spec.num_params())
    return shape


def mlp_shape(spec: MLPSpec, *, name: str = "mlp") -> ModelShape:
    """The built-in `mlp` (models/mlp.py): Linear -> GeLU -> Dropout per hidden layer."""
    spec.validate()
    if spec.input_dim is None or spec.num_outputs is None:
        raise ConfigError("model.kwargs.input_dim", spec.input_dim,
                          "an integer >= 1 (with num_outputs) for planning an mlp")
    widths = (spec.input_dim, *spec.hidden_sizes, spec.num_outputs)
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    n_linear = len(widths) - 1
    return ModelShape(
        name=name, kind="dense", num_params=params, num_tensors=2 * n_linear, n_layer=n_linear,
        layer_params=0, layer_tensors=0, first_params=params, first_tensors=2 * n_linear,
        last_params=0, last_tensors=0, tp_layer_params=0, layer_matmul_params=0,
        last_matmul_params=sum(a * b for a, b in zip(widths, widths[1:])),
        hidden=max(widths), dropout=spec.dropout, widths=widths)
