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
    """A model as the planner sees it. Invariant (blocks of one size):
    ``num_params == first_params + n_layer * layer_params + last_params``; where blocks
    differ, ``layer_params`` is the largest and a note says so."""

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
    tp_first_params: int | None = None  # of first_params, those TP shards (None: all, by rows)
    tied: bool = False  # the LM head is the token embedding (counted in first_params)
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0: as many as n_head
    # Mixture of experts: parameters of the routed experts (all blocks), experts per
    # block, those each token uses; active_params: parameters one token uses (0: dense).
    expert_params: int = 0
    num_experts: int = 0
    experts_per_tok: int = 0
    active_params: int = 0
    notes: tuple[str, ...] = ()  # where the estimate is not exact for this model, said in the output
    # Linear layers LoRA can adapt: (module name, in features, out features, how many),
    # read off a built model; empty: plan/lora.py derives them from the sizes.
    linears: tuple[tuple[str, int, int, int], ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Block:
    """One decoder block's counts: parameters, tensors, those TP shards, matmul weights."""

    params: int
    tensors: int
    norm: int  # parameters of one norm (the final norm is the same)
    norm_tensors: int
    tp_params: int
    matmul_params: int


def _block(*, hidden: int, n_head: int, n_kv_head: int, head_dim: int, ffn_hidden: int, gated: bool,
           norm_bias: bool, qkv_bias: bool, out_bias: bool, mlp_bias: bool, qk_norm: bool) -> _Block:
    h, f = hidden, ffn_hidden
    q_dim, kv_dim = n_head * head_dim, n_kv_head * head_dim  # GQA: k and v have n_kv_head heads
    n_up = 2 if gated else 1  # (gate, up) or (up)
    norm, norm_tensors = (2 * h, 2) if norm_bias else (h, 1)  # LayerNorm with bias | RMSNorm, LayerNorm
    attn_w, mlp_w = h * (q_dim + 2 * kv_dim) + q_dim * h, (n_up + 1) * h * f
    qkv_b, up_b = (q_dim + 2 * kv_dim) * qkv_bias, n_up * f * mlp_bias
    params = 2 * norm + attn_w + mlp_w + qkv_b + h * out_bias + up_b + h * mlp_bias + 2 * head_dim * qk_norm
    tensors = (2 * norm_tensors + 4 + (n_up + 1) + 3 * qkv_bias + out_bias + (n_up + 1) * mlp_bias
               + 2 * qk_norm)
    # Column-parallel (q, k, v, gate/up) weights and biases are sharded; row-parallel
    # (o, down) weights are sharded, their biases replicated (Megatron's split).
    return _Block(params=params, tensors=tensors, norm=norm, norm_tensors=norm_tensors,
                  tp_params=attn_w + mlp_w + qkv_b + up_b, matmul_params=attn_w + mlp_w)


def transformer_shape(name: str, *, n_layer: int, hidden: int, n_head: int, seq_len: int, vocab: int,
                 ffn_hidden: int, gated: bool, bias: bool, learned_pos: bool, tied: bool,
                 dropout: float = 0.0, n_kv_head: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool | None = None, out_bias: bool | None = None,
                 mlp_bias: bool | None = None, qk_norm: bool = False) -> ModelShape:
    """Exact counts for a GPT-2 style decoder (LayerNorm, GeLU MLP, optional biases,
    learned positions) or a Llama style one (``gated``: RMSNorm, SwiGLU MLP, rotary
    positions). ``bias`` puts a bias on every linear layer (and LayerNorm); the three
    flags override it per group, as Llama's ``attention_bias`` (q, k, v, o) and
    ``mlp_bias`` or Qwen2's q/k/v-only biases need. Grouped-query attention: k and v
    project to ``n_kv_head * head_dim`` (defaults: ``n_head``, ``hidden // n_head``);
    ``qk_norm``: RMSNorms over ``head_dim`` on q and k (Qwen3), replicated under TP.

    >>> mha = transformer_shape("m", n_layer=2, hidden=64, n_head=4, seq_len=8, vocab=100,
    ...                         ffn_hidden=128, gated=True, bias=False, learned_pos=False, tied=False)
    >>> gqa = transformer_shape("g", n_layer=2, hidden=64, n_head=4, seq_len=8, vocab=100,
    ...                         ffn_hidden=128, gated=True, bias=False, learned_pos=False, tied=False,
    ...                         n_kv_head=1)
    >>> mha.layer_params - gqa.layer_params  # k and v: 64 x 48 smaller each
    6144
    """
    h = hidden
    kv_heads = n_head if n_kv_head is None else n_kv_head
    block = _block(hidden=h, n_head=n_head, n_kv_head=kv_heads,
                   head_dim=h // n_head if head_dim is None else head_dim, ffn_hidden=ffn_hidden,
                   gated=gated, norm_bias=bias and not gated,
                   qkv_bias=bias if qkv_bias is None else qkv_bias,
                   out_bias=bias if out_bias is None else out_bias,
                   mlp_bias=bias if mlp_bias is None else mlp_bias, qk_norm=qk_norm)
    first, first_tensors = vocab * h + (seq_len * h if learned_pos else 0), 1 + int(learned_pos)
    last, last_tensors = block.norm + (0 if tied else h * vocab), block.norm_tensors + (0 if tied else 1)
    return ModelShape(
        name=name, kind="transformer",
        num_params=first + n_layer * block.params + last,
        num_tensors=first_tensors + n_layer * block.tensors + last_tensors,
        n_layer=n_layer, layer_params=block.params, layer_tensors=block.tensors,
        first_params=first, first_tensors=first_tensors, last_params=last, last_tensors=last_tensors,
        tp_layer_params=block.tp_params, layer_matmul_params=block.matmul_params,
        last_matmul_params=h * vocab,  # tied or not, the head is a matmul
        hidden=h, n_head=n_head, seq_len=seq_len, vocab=vocab, ffn_hidden=ffn_hidden, gated_mlp=gated,
        dropout=dropout, tp_last_params=0 if tied else h * vocab, tied=tied, n_kv_head=kv_heads)


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
