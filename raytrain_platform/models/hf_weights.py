"""What a meta-device build of a Hugging Face model needs before it holds a checkpoint,
taken from transformers itself rather than a list kept here:

- `checkpoint_sources`: where each tensor of the model is in the safetensors files.
  transformers 5 renames and fuses tensors while loading (its conversion mapping:
  GPT-NeoX's ``embed_out`` is ``lm_head``, a mixture of experts' per-expert
  ``mlp.experts.N.gate_proj.weight`` are stacked into one ``mlp.experts.gate_up_proj``,
  legacy ``gamma``/``beta`` names); each checkpoint key goes through the same
  ``rename_source_key`` as ``from_pretrained``, and a converted tensor is built with the
  converter's own ``convert``.
- `init_buffers`: the non-persistent buffers (rotary ``inv_freq``, Gemma's
  ``embed_scale``), which no checkpoint holds, set by the architecture's own
  ``_init_weights``, as ``from_pretrained`` sets them after its meta-device build.

>>> from transformers import GPTNeoXConfig
>>> config = GPTNeoXConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
...                        vocab_size=64, tie_word_embeddings=False)
>>> sources = checkpoint_sources(config, ["embed_out.weight", "gpt_neox.final_layer_norm.weight"])
>>> sources["lm_head.weight"], sources["gpt_neox.final_layer_norm.weight"]
('embed_out.weight', 'gpt_neox.final_layer_norm.weight')
"""

from __future__ import annotations

import copy
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from raytrain_platform.compat.hf_private import INIT_FLAG, init_weights
from raytrain_platform.compat.torch_private import non_persistent_buffers
from raytrain_platform.errors import CheckpointError, first_line
from raytrain_platform.models.family import ConvertedWeight

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["checkpoint_sources", "init_buffers"]


def _meta_twin(config: Any) -> Any:
    """The causal LM of `config` on the meta device: what transformers' mapping is read
    from (the model being loaded may be an FSDP class, a pipeline stage or hold LoRA
    layers; the checkpoint's layout is the plain model's)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def checkpoint_sources(config: Any, keys: list[str]) -> dict[str, str | ConvertedWeight]:
    """Each tensor of the causal LM of `config` (by its state-dict name) from a
    checkpoint holding `keys`: the key it is stored under, or a `ConvertedWeight` built
    from several. Checkpoint keys the model does not hold are left out, as transformers
    leaves them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    twin = _meta_twin(config)
    transforms = get_model_conversion_mapping(twin)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    names = twin.state_dict()  # rename_source_key adds or strips the base model's prefix by these
    prefix = twin.base_model_prefix
    sources: dict[str, str | ConvertedWeight] = {}
    groups: dict[str, list[tuple[str, str]]] = {}  # target -> (checkpoint key, converter pattern)
    # transformers' order: a converter stacks its tensors (experts 0, 1, ... 10) as they come
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if target not in names and key in names:  # renamed away from a name the model holds as it is
            target, pattern = rename_source_key(key, [], [], prefix, names)
        if target not in names:
            continue
        if pattern is None:
            sources[target] = key
        else:
            groups.setdefault(target, []).append((key, pattern))
    for target, parts in groups.items():
        converter = converter_of[parts[0][1]]
        weight = ConvertedWeight(tuple(k for k, _ in parts), partial(_convert, converter, target, parts, twin))
        for produced in converter.target_patterns:  # one to many (a fused qkv split): every target
            sources[target.replace(converter.target_patterns[0], produced)] = weight
    return sources


def _convert(converter: Any, target: str, parts: list[tuple[str, str]], twin: Any,
             read: Callable[[str], "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """Every tensor `converter` makes of the checkpoint tensors `parts`, whole, by name."""
    conv = copy.deepcopy(converter)  # convert() consumes what it collected
    for key, pattern in parts:
        conv.add_tensor(target, key, pattern, partial(read, key))  # read when convert() asks
    try:
        made = conv.convert(target, model=twin, config=twin.config)
    except CheckpointError:
        raise
    except Exception as exc:  # the ops raise torch's errors for tensors that do not fit together
        ops = ", ".join(type(op).__name__ for op in conv.operations)
        raise CheckpointError(f"{parts[0][0]} and {len(parts) - 1} more: transformers' {ops} cannot build "
                              f"{target} of them ({first_line(exc)})") from None
    return {name: t[0] if isinstance(t, list) else t for name, t in made.items()}


def init_buffers(model: "nn.Module") -> None:
    """Set the non-persistent buffers of `model` (given storage after a meta-device
    build) with transformers' ``_init_weights`` of the pretrained model that holds each
    buffer's module, every parameter and persistent buffer flagged as initialised so
    that it is left as it is (transformers' init functions skip flagged tensors). A
    floating buffer that no ``_init_weights`` sets is a `RuntimeError` naming it."""
    import torch
    from transformers import initialization

    owned = _buffer_owners(model)
    if not owned:
        return
    # tied tensors once; a tensor flagged already keeps its flag
    kept = {id(t): t for t in [*model.parameters(), *(b for _, b in _buffers(model, persistent=True))]
            if not getattr(t, INIT_FLAG, False)}
    for t in kept.values():
        setattr(t, INIT_FLAG, True)
    unset: list[str] = []
    try:
        with torch.no_grad(), initialization.guard_torch_init_functions():
            for name, module, owner in owned:
                own = [b for n, b in module.named_buffers(recurse=False) if n in non_persistent_buffers(module)]
                for b in own:
                    if b.is_floating_point():
                        b.fill_(float("nan"))  # what `_init_weights` leaves unset stays NaN
                init_weights(owner, module)
                unset += [f"{name}.{n}" for n, b in module.named_buffers(recurse=False)
                          if n in non_persistent_buffers(module) and b.is_floating_point() and b.isnan().all()]
    finally:
        for t in kept.values():
            delattr(t, INIT_FLAG)
    if unset:
        raise RuntimeError(f"transformers' _init_weights does not set the buffers {unset[:3]} after a meta-device "
                           "build")  # a bug for an architecture: say which


def _buffer_owners(model: "nn.Module") -> list[tuple[str, "nn.Module", Any]]:
    """(name, module, the nearest pretrained model above or at it) for each module with
    non-persistent buffers: transformers initialises a module with that model's
    ``_init_weights`` (``initialize_weights``' dispatch)."""
    from transformers import PreTrainedModel

    found = []

    def walk(module: "nn.Module", name: str, owner: Any) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if any(n in non_persistent_buffers(module) for n, _ in module.named_buffers(recurse=False)):
            if owner is None:
                raise RuntimeError(f"cannot set the buffers of {name or type(module).__name__}: no transformers "
                                   "model holds it")
            found.append((name, module, owner))
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, owner)

    walk(model, "", None)
    return found


def _buffers(model: "nn.Module", *, persistent: bool) -> list[tuple[str, "torch.Tensor"]]:
    out = []
    for module_name, module in model.named_modules():
        for n, b in module.named_buffers(recurse=False):
            if (n not in non_persistent_buffers(module)) == persistent:
                out.append((f"{module_name}.{n}" if module_name else n, b))
    return out
