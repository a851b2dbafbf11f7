"""What the memory planner needs to know about a model: how many parameters (and
tensors) it has, how they split into repeated blocks and the rest, which of them
tensor parallelism shards, and the sizes that drive activation memory.

Counts are exact for the built-in `gpt` and `mlp` (checked against real modules in
tests/test_plan.py) and for the presets; for a model given only by
``--params/--layers/--hidden`` they are derived and marked ``exact=False``.

No torch here.

>>> from raytrain_platform.models.specs import GPTSpec
>>> shape = gpt_shape(GPTSpec(n_layer=2, n_embd=64, n_head=4, block_size=32))
>>> shape.num_params == GPTSpec(n_layer=2, n_embd=64, n_head=4, block_size=32).num_params()
True
>>> preset_shape("llama2-7b").num_params
6738415616
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.specs import GPTSpec, MLPSpec

__all__ = ["ModelShape", "gpt_shape", "mlp_shape", "generic_shape", "preset_shape", "PRESETS"]


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it. Invariant:
    ``num_params == first_params + n_layer * layer_params + last_params``."""

    name: str
    family: str  # "transformer" | "mlp"
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


def _transformer(name: str, *, n_layer: int, hidden: int, n_head: int, seq_len: int, vocab: int,
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
        name=name, family="transformer",
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
    shape = _transformer(name, n_layer=spec.n_layer, hidden=spec.n_embd, n_head=spec.n_head,
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
        name=name, family="mlp", num_params=params, num_tensors=2 * n_linear, n_layer=n_linear,
        layer_params=0, layer_tensors=0, first_params=params, first_tensors=2 * n_linear,
        last_params=0, last_tensors=0, tp_layer_params=0, layer_matmul_params=0,
        last_matmul_params=sum(a * b for a, b in zip(widths, widths[1:])),
        hidden=max(widths), dropout=spec.dropout, widths=widths)


def generic_shape(*, num_params: int, n_layer: int, hidden: int, seq_len: int,
                  n_head: int | None = None, vocab: int = 50257) -> ModelShape:
    """A decoder known only by its sizes: GPT-2 style blocks (GeLU MLP of 4*hidden), an
    untied ``vocab x hidden`` embedding and head; what the blocks hold is what is left.

    >>> s = generic_shape(num_params=7_000_000_000, n_layer=32, hidden=4096, seq_len=4096)
    >>> s.n_head, s.exact
    (32, False)
    """
    heads = n_head if n_head is not None else max(1, hidden // 128)
    embed = vocab * hidden
    layer = (num_params - 2 * embed) // n_layer
    if layer < hidden * hidden:
        raise ConfigError("--params", num_params,
                          f"a count that leaves each of {n_layer} blocks at least hidden^2 = "
                          f"{hidden * hidden} parameters after the {2 * embed} of embedding and "
                          f"head (vocab {vocab} x hidden {hidden} x 2)")
    h = hidden
    return ModelShape(
        name="custom", family="transformer", num_params=num_params,
        num_tensors=2 + 16 * n_layer + 2, n_layer=n_layer, layer_params=layer, layer_tensors=16,
        first_params=embed, first_tensors=1, last_params=num_params - embed - n_layer * layer,
        last_tensors=3, tp_layer_params=min(layer, 12 * h * h + 7 * h),
        layer_matmul_params=min(layer, 12 * h * h), last_matmul_params=h * vocab,
        hidden=h, n_head=heads, seq_len=seq_len, vocab=vocab, ffn_hidden=4 * h, exact=False,
        tp_last_params=embed)


def _gpt2(name: str, n_layer: int, hidden: int, n_head: int) -> ModelShape:
    return _transformer(name, n_layer=n_layer, hidden=hidden, n_head=n_head, seq_len=1024,
                        vocab=50257, ffn_hidden=4 * hidden, gated=False, bias=True,
                        learned_pos=True, tied=True)


def _llama2(name: str, n_layer: int, hidden: int, n_head: int, ffn: int) -> ModelShape:
    return _transformer(name, n_layer=n_layer, hidden=hidden, n_head=n_head, seq_len=4096,
                        vocab=32000, ffn_hidden=ffn, gated=True, bias=False, learned_pos=False,
                        tied=False)


# Published architectures (multi-head attention only: GQA models would need a kv-head count).
PRESETS = {
    "gpt2": lambda: _gpt2("gpt2", 12, 768, 12),  # 124,439,808 params
    "gpt2-medium": lambda: _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": lambda: _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": lambda: _gpt2("gpt2-xl", 48, 1600, 25),
    "llama2-7b": lambda: _llama2("llama2-7b", 32, 4096, 32, 11008),  # 6,738,415,616 params
    "llama2-13b": lambda: _llama2("llama2-13b", 40, 5120, 40, 13824),
}


def preset_shape(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ConfigError("--model", name, f"a built-in model ['gpt', 'mlp'] or a preset {sorted(PRESETS)}")
    return PRESETS[name]()
