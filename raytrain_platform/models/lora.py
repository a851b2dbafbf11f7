"""LoRA adapters on any family's model, through ``peft``.

    model:
      name: hf
      kwargs: {path: /models/Llama-3.1-8B}
      lora: {r: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, k_proj, v_proj, o_proj]}

Why ``peft.inject_adapter_in_model`` and not ``get_peft_model``: injection keeps the
model's own class and module paths (``q_proj`` becomes a LoRA layer holding
``q_proj.base_layer`` and ``q_proj.lora_A.default``), so everything a family says of
its model (blocks for FSDP and activation checkpointing, ``logits``, ``init_buffers``,
``save_pretrained`` for an hf export) holds unchanged. ``get_peft_model`` wraps the
model in a ``PeftModel`` (names gain ``base_model.model.``, and ``save_pretrained``
then writes the adapter, not the model). Checked with peft 0.21 and torch 2.13: the
injected model builds on the meta device, and FSDP2 ``fully_shard`` per decoder layer
trains only the adapters.

The default target, ``all-linear``, is peft's own rule (``peft.tuners.tuners_utils.
_maybe_include_all_linear_layers``): every ``nn.Linear`` and transformers ``Conv1D``
(GPT-2's ``c_attn``, ``c_fc``, ``c_proj``) but the output layer. It is resolved against the
model (`resolve_targets`, a meta-device build in resolve.py) into the names the run's
summary shows, e.g. ``[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]``
on Llama, ``[query_key_value, dense, dense_h_to_4h, dense_4h_to_h]`` on GPT-NeoX. An
explicit list names modules by the end of their path, as peft matches them (``q_proj``
matches ``model.layers.3.self_attn.q_proj``); each target must match at least one
``nn.Linear`` or ``Conv1D`` (otherwise one line naming the ones the model has).

A mixture of experts whose experts transformers 5 fused into 3-D parameters (Mixtral,
Qwen3-MoE) is adapted as ``get_peft_model`` adapts it: peft's ``inject_adapter`` converts
the experts' and router's v4 module names (Qwen3-MoE's ``gate``, ``gate_proj``, ``up_proj``,
``down_proj``; Mixtral's ``gate``, ``w1``, ``w3``, ``w2``) into ``target_parameters``, adapted
by ``lora.ParamWrapper`` (the fused ``gate_up_proj`` with rank and alpha doubled). ``all-linear``
resolves to the attention's linear layers plus those names (compat/hf_private.py
`fused_expert_names`, peft's own expansion), and an explicit list may name them too.

No torch at module level: the config layer checks the section through `resolve_lora`.

>>> resolve_lora({"r": 4})["target_modules"]
'all-linear'
>>> resolve_lora({"target_modules": "q_proj"})["target_modules"]
['q_proj']
>>> resolve_lora({"r": 0})
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: model.lora.r = 0: expected an integer >= 1 (the adapters' rank)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from typing import TYPE_CHECKING, Any

from raytrain_platform.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ADAPTER", "ALL_LINEAR", "LORA_DEFAULTS", "adapted_peft_config", "adapter_state", "adapters_disabled",
           "apply_lora",
           "base_source_name", "check_targets", "is_adapter", "linear_names", "merge_lora", "model_peft_config",
           "peft_config", "resolve_lora", "resolve_targets", "stores_in_out"]

ADAPTER = "default"  # peft's adapter name: every run trains one adapter
ALL_LINEAR = "all-linear"  # peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND
# Every linear layer of the attention and MLP blocks, as peft picks them on any architecture.
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ALL_LINEAR}
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def resolve_lora(section: Any) -> dict:
    """``model.lora`` with defaults filled in; one-line `ConfigError` naming the key."""
    if not isinstance(section, dict):
        raise ConfigError("model.lora", section, f"a mapping with keys {list(LORA_DEFAULTS)}, or null")
    for key in section:
        if key not in LORA_DEFAULTS:
            raise ConfigError(f"model.lora.{key}", section[key], f"no such key; model.lora keys are "
                              f"{list(LORA_DEFAULTS)}")
    lora = {**LORA_DEFAULTS, **section}
    r, alpha, dropout, targets = lora["r"], lora["alpha"], lora["dropout"], lora["target_modules"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError("model.lora.r", r, "an integer >= 1 (the adapters' rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < math.inf:
        raise ConfigError("model.lora.alpha", alpha, "a finite number > 0 (adapter outputs are scaled by alpha / r)")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise ConfigError("model.lora.dropout", dropout, "a number in [0, 1)")
    if targets == ALL_LINEAR:
        return {"r": r, "alpha": alpha, "dropout": float(dropout), "target_modules": ALL_LINEAR}
    if isinstance(targets, str):
        targets = [targets]
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t and not t.startswith(".") for t in targets)):
        raise ConfigError("model.lora.target_modules", targets, f"{ALL_LINEAR!r} (the default) or a non-empty "
                          "list of module names (the end of their path, e.g. [q_proj, v_proj])")
    return {"r": r, "alpha": alpha, "dropout": float(dropout), "target_modules": list(dict.fromkeys(targets))}


@contextlib.contextmanager
def adapters_disabled(model: "nn.Module") -> Iterator[None]:
    """While open, every peft adapter layer of `model` runs its base layer alone (peft's
    ``enable_adapters(False)``, what ``PeftModel.disable_adapter()`` does): the base model,
    a LoRA preference run's reference, with no second copy. peft's switch also clears and
    sets the adapters' ``requires_grad``; each parameter's flag is put back as it was."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of targets: the whole path, or its end after a dot."""
    return name == target or name.endswith("." + target)


def _is_linear(module: "nn.Module") -> bool:
    """peft's linear layers: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def linear_names(model: "nn.Module") -> list[str]:
    """Paths of the model's ``nn.Linear`` and ``Conv1D`` modules."""
    return [name for name, m in model.named_modules() if _is_linear(m)]


def _all_linear(model: "nn.Module", model_name: str) -> list[str]:
    """peft's ``all-linear`` pick, in module order. peft leaves out the output layer of a
    transformers model (``get_output_embeddings``); the family's `output_head` does the
    same for any other model (the builtin gpt's ``lm_head``)."""
    from raytrain_platform.compat.hf_private import all_linear_names
    from raytrain_platform.models.registry import get_family

    picked = all_linear_names(model)
    head = get_family(model_name).output_head(model)
    return [name for name, m in model.named_modules() if name in picked and m is not head]


def _parameter_targets(model: "nn.Module", lora: dict) -> list[str]:
    """The targets of `lora` that peft's conversion turns into ``target_parameters`` on
    `model` (the v4 names of a mixture of experts' fused experts and router), in order."""
    from raytrain_platform.compat.hf_private import converted_targets, fused_expert_names

    targets = lora["target_modules"]
    if targets == ALL_LINEAR:
        return fused_expert_names(model)
    try:
        kept = converted_targets(peft_config(lora), model).target_modules
    except ValueError as exc:  # half of a fused pair, e.g. gate_proj without up_proj
        raise ConfigError("model.lora.target_modules", targets, f"targets peft can convert on this model: {exc}")
    return [t for t in targets if t not in kept]


def check_targets(model: "nn.Module", lora: dict, *, model_name: str) -> list[str]:
    """The paths of the Linear / Conv1D modules `lora`'s targets pick, in module order
    (built on the meta device, this is free); a `ConfigError` for a model with no linear
    layer or a target that matches none. Targets that peft adapts as parameters (a
    mixture of experts' fused experts, `_parameter_targets`) are not among the paths."""
    linears = linear_names(model)
    if not linears:
        classes = sorted({type(m).__name__ for m in model.modules()})[:8]
        raise ConfigError("model.lora", lora, f"a model with nn.Linear layers for LoRA adapters; model "
                          f"{model_name!r} has none (its modules are {classes})")
    params = _parameter_targets(model, lora)
    if lora["target_modules"] == ALL_LINEAR:
        picked = _all_linear(model, model_name)
        if not picked and not params:
            raise ConfigError("model.lora.target_modules", ALL_LINEAR, f"a list of module names: model "
                              f"{model_name!r} has no linear layer but its output layer ({linears})")
        return picked
    short = sorted({n.rsplit(".", 1)[-1] for n in linears})
    hit: set[str] = set()
    for target in (t for t in lora["target_modules"] if t not in params):
        hits = [n for n in linears if _matches(n, target)]
        if not hits:
            other = [n for n, _ in model.named_modules() if n and _matches(n, target)]
            why = (f" ({other[0]} is of class {type(model.get_submodule(other[0])).__name__}, not nn.Linear "
                   "or Conv1D)" if other else "")
            raise ConfigError("model.lora.target_modules", target, f"names of Linear modules of model "
                              f"{model_name!r}{why}: it has {short}")
        hit.update(hits)
    return [n for n in linears if n in hit]


def _names(model: "nn.Module", picked: list[str]) -> list[str]:
    """`picked` as peft targets: their last names (in module order) when those match
    exactly the picked modules and no other, else the full paths."""
    short = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in picked))
    matched = {n for n, _ in model.named_modules() if n and any(_matches(n, t) for t in short)}
    return short if matched == set(picked) else list(picked)


def _peft_targets(model: "nn.Module", lora: dict, picked: list[str]) -> list[str]:
    """The ``target_modules`` to hand peft: the `picked` modules' names, then the names
    peft's conversion makes parameter targets of."""
    params = _parameter_targets(model, lora)
    return [n for n in _names(model, picked) if n not in params] + params


def resolve_targets(model: "nn.Module", lora: dict, *, model_name: str) -> dict:
    """`lora` with ``all-linear`` replaced by the names it picks on `model` (an explicit
    list is checked and kept as it is)."""
    picked = check_targets(model, lora, model_name=model_name)
    if lora["target_modules"] != ALL_LINEAR:
        return dict(lora)
    return {**lora, "target_modules": _peft_targets(model, lora, picked)}


def peft_config(lora: dict, *, base_path: str | None = None, task_type: str | None = None,
                fan_in_fan_out: bool = False) -> Any:
    """The ``peft.LoraConfig`` of ``model.lora``. `fan_in_fan_out`: the targets store
    their weight as (in, out), as transformers' ``Conv1D`` does."""
    from peft import LoraConfig

    targets = lora["target_modules"]
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=targets if targets == ALL_LINEAR else list(targets), bias="none",
                      fan_in_fan_out=fan_in_fan_out, base_model_name_or_path=base_path, task_type=task_type)


def model_peft_config(model: "nn.Module", lora: dict, *, model_name: str, base_path: str | None = None,
                      task_type: str | None = None) -> Any:
    """The ``peft.LoraConfig`` that adapts exactly the modules `check_targets` picks on
    `model`: ``all-linear`` resolved here (peft would keep a non-transformers model's
    output layer), and ``fan_in_fan_out`` set when the targets are ``Conv1D``."""
    from transformers.pytorch_utils import Conv1D

    picked = check_targets(model, lora, model_name=model_name)
    conv1d = bool(picked) and all(isinstance(model.get_submodule(n), Conv1D) for n in picked)
    return peft_config({**lora, "target_modules": _peft_targets(model, lora, picked)}, base_path=base_path,
                       task_type=task_type, fan_in_fan_out=conv1d)


def adapted_peft_config(model: "nn.Module", lora: dict, *, base_path: str | None = None,
                        task_type: str | None = None) -> Any:
    """The ``peft.LoraConfig`` describing `model`'s injected adapters as they are: the
    modules that hold one, and ``fan_in_fan_out`` as peft set it on them (what an adapter
    directory saves, for ``PeftModel.from_pretrained`` to adapt the same modules).
    Parameter adapters (``lora.ParamWrapper``) are saved as peft's conversion set them
    when injecting: ``target_parameters`` with their ``rank_pattern`` / ``alpha_pattern``."""
    from peft.tuners.lora import ParamWrapper

    wrapped = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A]
    adapted = [n for n, m in wrapped if not isinstance(m, ParamWrapper)]
    flipped = any(getattr(model.get_submodule(n), "fan_in_fan_out", False) for n in adapted)
    config = peft_config({**lora, "target_modules": _names(model, adapted)}, base_path=base_path,
                         task_type=task_type, fan_in_fan_out=flipped)
    if len(adapted) < len(wrapped):
        own: Any = getattr(model, "peft_config")[ADAPTER]  # set by inject_adapter_in_model, converted by peft
        config.target_parameters = sorted(own.target_parameters)
        config.rank_pattern, config.alpha_pattern = dict(own.rank_pattern), dict(own.alpha_pattern)
    return config


def stores_in_out(model: "nn.Module", lora: dict) -> bool:
    """Whether the modules `lora`'s (listed) targets name on `model` are transformers'
    ``Conv1D``, weights stored (in, out): peft's ``fan_in_fan_out``. An adapted module
    counts by its base layer (a model that holds adapters already)."""
    from transformers.pytorch_utils import Conv1D

    targets = lora["target_modules"]
    named = [m for n, m in model.named_modules() if targets != ALL_LINEAR and any(_matches(n, t) for t in targets)]
    return bool(named) and all(isinstance(getattr(m, "base_layer", m), Conv1D) for m in named)


def apply_lora(model: "nn.Module", lora: dict, *, model_name: str) -> "nn.Module":
    """`model` with LoRA adapters injected in place (same class, same paths); only the
    adapters require gradients. Works on a meta-device model: its adapters are then on
    the meta device too, and are initialised after ``to_empty`` (core/adapters.py)."""
    import warnings

    from peft import inject_adapter_in_model

    config = model_peft_config(model, lora, model_name=model_name)
    with warnings.catch_warnings():
        # peft's own conversion sets the fused experts' rank_pattern; it applies to the parameter
        # adapters, though peft's check of modules says it matched none (get_peft_model says so too)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    """Whether a parameter path is a LoRA adapter's (``...lora_A.default.weight``)."""
    return any(part in f".{name}" for part in _ADAPTER_PARTS)


def base_source_name(name: str) -> str | None:
    """The base model's name of a LoRA model's tensor (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``, as in the pretrained files); None for an adapter's own.

    >>> base_source_name("model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> base_source_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    True

    Parameter adapters nest (``experts`` wraps ``experts.base_layer``, which wraps the experts):

    >>> base_source_name("model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj")
    'model.layers.0.mlp.experts.gate_up_proj'
    """
    if is_adapter(name):
        return None
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def adapter_state(model: "nn.Module") -> dict:
    """The adapters' tensors under PEFT's saved names (``base_model.model.<path>.lora_A.weight``,
    what ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` reads)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {f"base_model.model.{k}": v.detach().contiguous() for k, v in state.items()}


def merge_lora(model: "nn.Module") -> "nn.Module":
    """Adapters folded into their base weights (W + B A x alpha / r), each LoRA layer
    replaced by its plain base module: the model's original structure and names. As
    peft's ``merge_and_unload`` does it: the outer of nested parameter adapters
    (``lora.ParamWrapper``) merges and unwraps the inner ones."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    done: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, BaseTunerLayer) or any(name.startswith(d + ".") for d in done):
            continue
        if hasattr(module, "unload_and_optionally_merge_module"):
            base = module.unload_and_optionally_merge_module(merge=True, safe_merge=True, adapter_names=[ADAPTER])
        else:
            module.merge(safe_merge=True, adapter_names=[ADAPTER])
            base = module.get_base_layer()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
        done.append(name)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model
