"""LoRA in the planner: the adapters' size from a model's shape, and what a frozen base
changes in the memory of one device.

A LoRA run (models/lora.py) keeps the whole base (fp32, sharded by FSDP like any
parameter) but has gradients and optimizer state for the adapters only: ``r x (in +
out)`` parameters per adapted Linear, 2 tensors (A and B) each. FSDP's gathered units
hold no full gradients of frozen weights, and DDP's buckets hold only adapter
gradients. Activations are those of full fine-tuning: backward still runs through
every block to reach the first adapters. The rank-``r`` intermediates are left out
(``r`` values per token per adapter).

With a model to build (a config's ``model``), `model_lora_size` counts the adapters the
run makes on that model itself, built on the meta device (`models.lora.apply_lora`:
peft's ``all-linear`` by default, a mixture of experts' experts included); from a shape alone (``rtp plan --lora-r``),
`lora_size` counts the Linear layers a shape lists (read off the built model by
`rtp plan`; a preset's are a decoder's projections), ``all-linear`` being all but the LM head.

>>> from raytrain_platform.plan.shapes import preset_shape
>>> lora_size(preset_shape("llama2-7b"), r=16, targets=("q_proj", "v_proj"))
LoraSize(params=8388608, tensors=128, r=16, targets=('q_proj', 'v_proj'))
>>> lora_size(preset_shape("llama2-7b"), r=16, targets=DEFAULT_TARGETS).targets
('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.lora import ALL_LINEAR
from raytrain_platform.plan.shapes import ModelShape

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DEFAULT_R", "DEFAULT_TARGETS", "LoraSize", "lora_size", "model_lora_size"]

# What `rtp plan` suggests when full fine-tuning fits nowhere: model.lora's default targets.
DEFAULT_R, DEFAULT_TARGETS = 16, (ALL_LINEAR,)


@dataclass(frozen=True)
class LoraSize:
    """Adapter parameters and tensors over the whole model, and what they came from."""

    params: int
    tensors: int
    r: int
    targets: tuple[str, ...]


def _linears(model: ModelShape) -> dict[str, list[tuple[int, int, int]]]:
    """Linear modules by name: (in features, out features, how many in the model) for
    each size of that name (GPT-2's two ``c_proj``), in a block's order. A shape read off
    a built model lists its own; else the decoder's, from its sizes."""
    if model.linears:
        out: dict[str, list[tuple[int, int, int]]] = {}
        for name, fan_in, fan_out, count in model.linears:
            out.setdefault(name, []).append((fan_in, fan_out, count))
        return out
    h, f, L = model.hidden, model.ffn_hidden, model.n_layer
    head_dim = h // model.n_head  # Llama, Mistral, Qwen2 and GPT-2
    q, kv = model.n_head * head_dim, (model.n_kv_head or model.n_head) * head_dim
    sizes = {"q_proj": (h, q, L), "k_proj": (h, kv, L), "v_proj": (h, kv, L), "o_proj": (q, h, L),
             **({"gate_proj": (h, f, L)} if model.gated_mlp else {}),
             "up_proj": (h, f, L), "down_proj": (f, h, L), "lm_head": (h, model.vocab, 1)}
    return {name: [size] for name, size in sizes.items()}


def lora_size(model: ModelShape, *, r: int, targets: tuple[str, ...] | list[str]) -> LoraSize:
    """The adapters of rank `r` on the Linear modules named `targets` (their last name,
    as ``model.lora.target_modules``) of a transformer shape."""
    if model.kind != "transformer":
        raise ConfigError("model.lora", {"r": r}, f"a transformer model for rtp plan's LoRA estimate "
                          f"(model {model.name} is {model.kind})")
    if not (isinstance(r, int) and r >= 1):
        raise ConfigError("--lora-r", r, "an integer >= 1")
    linears = _linears(model)
    if targets == ALL_LINEAR or tuple(targets) == (ALL_LINEAR,):  # peft's rule: every Linear but the LM head
        targets = tuple(n for n, sizes in linears.items() if all(out != model.vocab for _, out, _ in sizes))
    params = tensors = 0
    for target in targets:
        name = target.rsplit(".", 1)[-1]
        if name not in linears:
            raise ConfigError("model.lora.target_modules", target, f"one of {sorted(linears)} for rtp plan "
                              f"(the Linear modules of a {'gated ' if model.gated_mlp else ''}decoder)")
        for fan_in, fan_out, count in linears[name]:
            params += count * r * (fan_in + fan_out)
            tensors += 2 * count
    return LoraSize(params=params, tensors=tensors, r=r, targets=tuple(targets))


def model_lora_size(model: "nn.Module", lora: dict, *, model_name: str) -> LoraSize:
    """The adapters of ``model.lora`` `lora` on `model`, counted on a copy of it with
    the adapters injected as the run injects them (`models.lora.apply_lora`; a
    meta-device build is enough and costs nothing): ``r x (in + out)`` for each adapted
    Linear, and what peft gives a mixture of experts' fused experts and router."""
    import copy

    from raytrain_platform.models.lora import apply_lora, is_adapter, resolve_targets

    targets = resolve_targets(model, lora, model_name=model_name)["target_modules"]
    adapted = apply_lora(copy.deepcopy(model), lora, model_name=model_name)
    sizes = [p.numel() for n, p in adapted.named_parameters() if is_adapter(n)]
    return LoraSize(params=sum(sizes), tensors=len(sizes), r=lora["r"], targets=tuple(targets))
