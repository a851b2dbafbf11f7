"""The planner's shape of any Hugging Face causal LM, read off the model itself:
transformers builds it from its config on the meta device (no memory, no weights) and
every count is its parameters' (no per-architecture formula here).

- blocks: the family's repeated blocks (the decoder layers FSDP wraps and PP cuts);
  the embeddings outside them (``nn.Embedding``: tokens, learned positions) go to the
  first pipeline stage, everything else outside them (final norm, LM head) to the last;
- tensor parallelism: the parameters the family's TP plan (``HFFamily.tp_plan`` on the
  meta model) shards: column-wise modules (weight and bias), row-wise weights (their
  biases replicated), embeddings and the head; a model the plan does not fit shards none;
- mixture of experts: the routed experts are the modules holding ``num_experts``
  stacked expert tensors (transformers' fused experts); each token uses ``top_k`` of
  them (the router's), so active parameters per token are the rest plus ``top_k /
  num_experts`` of the experts;
- activations stay the Llama-style formula of plan/memory.py: a block that is not a
  Llama-style one (q, k, v, o and gate, up, down projections, two norms) gets a note.

Building is cheap: Llama 3.1 8B's config builds on meta in about 0.1 s once transformers'
modeling module is imported (about 1 s the first time).

>>> cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
...        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
...        "vocab_size": 128256, "max_position_embeddings": 131072}  # Llama 3.1 8B
>>> from raytrain_platform.models.hf import HFFamily
>>> shape = hf_shape(cfg, family=HFFamily())
>>> shape.num_params, shape.n_kv_head, shape.seq_len
(8030261248, 8, 4096)
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from raytrain_platform.errors import ConfigError, first_line
from raytrain_platform.models.shapes import ModelShape

if TYPE_CHECKING:
    from torch import nn

    from raytrain_platform.models.family import ModelFamily

__all__ = ["DEFAULT_MAX_SEQ_LEN", "auto_config_of", "meta_model", "model_shape", "hf_shape"]

DEFAULT_MAX_SEQ_LEN = 4096  # planned sequence length when none is given (capped by the model's)
# The block the activation formula of plan/memory.py describes (relative parameter names).
_LLAMA_BLOCK = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
    "input_layernorm.weight", "post_attention_layernorm.weight"}
_LLAMA_OPTIONAL = {f"self_attn.{p}_proj.bias" for p in "qkvo"} | {
    f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")} | {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def auto_config_of(config: dict) -> Any:
    """transformers' config object for a ``config.json`` dict (its class's defaults for
    the keys left out); an unknown ``model_type`` is a `ConfigError`."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(config, dict):
        raise ConfigError("config.json", type(config).__name__, "a JSON object (a Hugging Face model config)")
    if "auto_map" in config:
        raise ConfigError("model.kwargs.path", config.get("model_type"), "a model transformers knows without "
                          "the directory's own code (auto_map needs trust_remote_code: refused)")
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError("model.kwargs.path", model_type, f"a model_type transformers knows "
                          f"({len(CONFIG_MAPPING)} in this version, without remote code)")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as exc:  # a value its config class refuses
        raise ConfigError("model.kwargs.path", model_type,
                          f"a config transformers can read ({first_line(exc)[:200]})") from None


def meta_model(config: Any) -> "nn.Module":
    """``AutoModelForCausalLM.from_config(config)`` on the meta device: the modules and
    parameter shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # an architecture without a causal LM class, sizes it refuses
        raise ConfigError("model.kwargs.path", getattr(config, "model_type", None),
                          f"a causal LM transformers can build from its config ({first_line(exc)[:200]})") from None


def _tp_sharded(model: "nn.Module", plan: dict[str, str] | None) -> set[int]:
    """ids of the parameters the TP plan shards (see the module docstring). A plan
    naming a path the model lacks does not fit it: nothing is sharded."""
    if not plan:
        return set()
    sharded: set[int] = set()
    params = dict(model.named_parameters(remove_duplicate=False))
    for path, kind in plan.items():
        if path in params:  # an entry naming a parameter (fused experts)
            own = [("weight", params[path])]
        else:
            try:
                own = list(model.get_submodule(path).named_parameters(recurse=False))
            except AttributeError:
                return set()
        for name, p in own:
            if any(k in kind for k in ("colwise", "embedding", "head")) or ("rowwise" in kind and name != "bias"):
                sharded.add(id(p))
    return sharded


def _experts(block: "nn.Module") -> tuple[int, int, int, int]:
    """(routed expert parameters, experts, experts per token, one expert's inner width)
    of one block; zeros if dense."""
    params = experts = width = 0
    for module in block.modules():
        n = getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if isinstance(n, int) and n > 1 and not hasattr(module, "top_k") and own \
                and all(p.dim() >= 2 and p.shape[0] == n for p in own):
            params, experts = params + sum(p.numel() for p in module.parameters()), n
            inner = getattr(module, "intermediate_dim", None)
            width = inner if isinstance(inner, int) else 0
    if not experts:
        return 0, 0, 0, 0
    top_k = next((k for k in (getattr(m, "top_k", None) for m in block.modules()) if isinstance(k, int)), None)
    if top_k is None:
        raise ConfigError("model.kwargs.path", type(block).__name__, "a mixture of experts whose router has "
                          "top_k (the experts each token uses) for rtp plan")
    return params, experts, top_k, width


def _counts(params: list["nn.Parameter"], sharded: set[int]) -> tuple[int, int, int, int]:
    """(parameters, tensors, of them TP-sharded, matmul weights: 2-D and up)."""
    return (sum(p.numel() for p in params), len(params), sum(p.numel() for p in params if id(p) in sharded),
            sum(p.numel() for p in params if p.dim() >= 2))


def _linears(model: "nn.Module") -> tuple[tuple[str, int, int, int], ...]:
    """The layers peft's LoRA adapts (``nn.Linear``, GPT-2's ``Conv1D``, whose weight is
    in x out) by their last name: (name, in, out, how many)."""
    from collections import Counter

    from torch import nn

    found: Counter[tuple[str, int, int]] = Counter()
    for path, module in model.named_modules():
        name = path.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            found[name, module.in_features, module.out_features] += 1
        elif type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int):
            found[name, int(module.weight.shape[0]), module.nf] += 1
    return tuple((name, fan_in, fan_out, n) for (name, fan_in, fan_out), n in found.items())


def _text_sizes(config: Any) -> dict[str, int]:
    """The sizes the activation estimate reads, from the text config (attribute maps
    give GPT-2's n_embd as hidden_size)."""
    text = config.get_text_config()
    hidden = text.hidden_size
    heads = text.num_attention_heads
    ffn = next((v for v in (getattr(text, k, None) for k in ("intermediate_size", "ffn_dim", "n_inner"))
                if isinstance(v, int)), 4 * hidden)
    return {"hidden": hidden, "n_head": heads, "n_kv_head": getattr(text, "num_key_value_heads", None) or heads,
            "vocab": text.vocab_size, "ffn_hidden": ffn,
            "max_positions": getattr(text, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN}


def _notes(model_type: str, blocks: list["nn.Module"], block_params: list[int]) -> tuple[str, ...]:
    """Where the estimate is not exact: blocks of different sizes, a block the
    activation formula does not describe."""
    notes = []
    if len(set(block_params)) > 1:
        notes.append(f"layers differ ({min(block_params):,} to {max(block_params):,} parameters): "
                     "per-rank bytes take the largest")
    names = {n for n, _ in blocks[0].named_parameters()} if blocks else set()
    if not _LLAMA_BLOCK <= names <= _LLAMA_BLOCK | _LLAMA_OPTIONAL:
        notes.append(f"activations: estimated with the Llama-style formula; not exact for {model_type}")
    return tuple(notes)


def model_shape(model: "nn.Module", *, blocks: list["nn.Module"], tp_plan: dict[str, str] | None,
                name: str, seq_len: int) -> ModelShape:
    """The `ModelShape` of a (meta) transformers causal LM with these `blocks` and TP plan."""
    from torch import nn

    lm: Any = model  # a transformers PreTrainedModel: its embeddings' getters, its config

    sharded = _tp_sharded(model, tp_plan)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    every = list(model.parameters())  # a tied head is the embedding: listed once
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    first = [p for p in every if id(p) in embeddings and id(p) not in in_blocks]
    last = [p for p in every if id(p) not in embeddings and id(p) not in in_blocks]
    per_block = [_counts(list(b.parameters()), sharded) for b in blocks]
    layer = max(per_block, default=(0, 0, 0, 0))
    head = lm.get_output_embeddings()
    tied = head is not None and head.weight is lm.get_input_embeddings().weight
    moe = [_experts(b) for b in blocks]
    expert_params = sum(m[0] for m in moe)
    active = sum(p.numel() for p in every) - expert_params + sum(m[0] * m[2] // m[1] for m in moe if m[1])
    routed = next((m for m in moe if m[1]), (0, 0, 0, 0))
    sizes = _text_sizes(lm.config)
    if routed[3]:  # the MLP activations a token makes: its experts' (the formula's one MLP)
        sizes["ffn_hidden"] = routed[2] * routed[3]
    last_counts = _counts(last, sharded)
    attention = getattr(lm.config, "_attn_implementation", None)
    return ModelShape(
        name=name, kind="transformer", num_params=sum(p.numel() for p in every), num_tensors=len(every),
        n_layer=len(blocks), layer_params=layer[0], layer_tensors=layer[1],
        first_params=sum(p.numel() for p in first), first_tensors=len(first),
        tp_first_params=sum(p.numel() for p in first if id(p) in sharded),
        last_params=last_counts[0], last_tensors=last_counts[1], tp_layer_params=layer[2],
        layer_matmul_params=layer[3], last_matmul_params=0 if head is None else head.weight.numel(),
        hidden=sizes["hidden"], n_head=sizes["n_head"], seq_len=seq_len, vocab=sizes["vocab"],
        ffn_hidden=sizes["ffn_hidden"], gated_mlp=any("gate_" in n for n, _ in blocks[0].named_parameters())
        if blocks else False, attention="eager" if attention == "eager" else "sdpa",
        tp_last_params=last_counts[2], tied=tied, n_kv_head=sizes["n_kv_head"],
        expert_params=expert_params, num_experts=routed[1], experts_per_tok=routed[2],
        active_params=active, notes=_notes(lm.config.model_type, blocks, [b[0] for b in per_block]),
        linears=_linears(model))


def hf_shape(config: dict | Any, *, family: "ModelFamily", name: str = "hf", seq_len: int | None = None,
             kwargs: dict | None = None) -> ModelShape:
    """The exact `ModelShape` of the causal LM `config` describes (a ``config.json`` dict
    or transformers' config object), built on meta, planned at `seq_len` tokens
    (default: its ``max_position_embeddings``, at most 4096). `family` (the `hf` family,
    or one derived from it) names its blocks and TP plan, called with `kwargs`.

    >>> from raytrain_platform.models.hf import HFFamily
    >>> hf_shape({"model_type": "no_such_model"}, family=HFFamily())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    raytrain_platform.errors.ConfigError: model.kwargs.path = 'no_such_model': expected a model_type transformers knows (... in this version, without remote code)
    """
    obj = auto_config_of(config) if isinstance(config, dict) else config
    model = meta_model(obj)
    if seq_len is None:
        seq_len = min(_text_sizes(obj)["max_positions"], DEFAULT_MAX_SEQ_LEN)
    elif isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "an integer >= 1 (tokens per sequence)")
    try:
        plan: dict[str, str] | None = family.tp_plan(model, kwargs or {})
    except (ConfigError, AttributeError, TypeError):  # no TP plan for this architecture
        plan = None
    blocks = [m for _, m in family.blocks(model)]
    shape = model_shape(model, blocks=blocks, tp_plan=plan, name=name, seq_len=seq_len)
    # the attention transformers picks (eager where the architecture needs it), or the job's
    return replace(shape, attention="eager") if (kwargs or {}).get("attn_implementation") == "eager" else shape
