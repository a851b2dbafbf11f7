"""transformers' and peft's private APIs used here (transformers 5.25, peft 0.21), each
with why: the same steps their own loading and peft's ``get_peft_model`` take.
tests/test_compat.py resolves each entry of `USED`.

>>> INIT_FLAG
'_is_hf_initialized'
"""

from __future__ import annotations

import copy
from typing import Any

from raytrain_platform.compat import resolve

__all__ = ["INIT_FLAG", "USED", "all_linear_names", "converted_targets", "fused_expert_names", "init_weights"]

# The flag transformers' init functions read to leave a tensor as it is (set by its own
# loading on every tensor read from a checkpoint).
INIT_FLAG = "_is_hf_initialized"

USED: dict[str, str] = {
    "peft.tuners.tuners_utils:_maybe_include_all_linear_layers":
        "peft's all-linear rule (every Linear and Conv1D but the output layer) as names: "
        "inject_adapter_in_model, which keeps the model's own class, does not expand it",
    "peft.utils.transformers_weight_conversion:convert_peft_config_for_transformers":
        "what inject_adapter does to a LoraConfig first on a mixture of experts whose experts transformers 5 "
        "fused (Mixtral, Qwen2/3-MoE): the experts' and router's v4 module names become target_parameters "
        "(ParamWrapper), the fused gate_up_proj with twice r and alpha; run on a copy to check and count targets",
    "peft.utils.transformers_weight_conversion:_resolve_string_target_modules":
        "how that conversion expands all-linear on such a model (the attention's linear layers plus the v4 "
        "names of the experts and router), so that get_peft_model's all-linear and ours adapt the same",
    "peft.utils.transformers_weight_conversion:_MODEL_TO_CONVERSION_PATTERN":
        "the model types that conversion applies to (qwen3_moe -> qwen2_moe), looked up as it looks them up",
    "peft.utils.transformers_weight_conversion:_MOE_TARGET_MODULE_MAPPING":
        "the v4 names of the experts and router per converted model type",
    "peft.utils.transformers_weight_conversion:_MOE_FUSED_TARGETS":
        "the conversion applies only where this names fused experts",
    "transformers:PreTrainedModel._init_weights":
        "the non-persistent buffers (rotary inv_freq, Gemma's embed_scale) set after a meta-device "
        "build, as from_pretrained sets them",
}


def all_linear_names(model: Any) -> set[str]:
    """The module names peft's ``all-linear`` picks in `model`."""
    from peft import LoraConfig

    expand = resolve("peft.tuners.tuners_utils:_maybe_include_all_linear_layers")
    return set(expand(LoraConfig(target_modules="all-linear"), model).target_modules)


def fused_expert_names(model: Any) -> list[str]:
    """The names peft's ``all-linear`` adds on a mixture of experts whose experts transformers 5
    fused into parameters (Mixtral ``[gate, w1, w3, w2]``, Qwen3-MoE ``[gate, gate_proj, up_proj,
    down_proj]``: the v4 module names, which peft's conversion turns into ``target_parameters``);
    ``[]`` for any other model. As ``_convert_peft_config_moe`` finds them."""
    from peft import LoraConfig

    mod = "peft.utils.transformers_weight_conversion"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base = resolve(f"{mod}:_MODEL_TO_CONVERSION_PATTERN").get(model_type)
    mapping = resolve(f"{mod}:_MOE_TARGET_MODULE_MAPPING").get(base)
    if not mapping or not resolve(f"{mod}:_MOE_FUSED_TARGETS").get(base):
        return []
    expand = resolve(f"{mod}:_resolve_string_target_modules")
    picked = expand(LoraConfig(target_modules="all-linear"), model, mapping)
    return [name for name in mapping if name in picked]


def converted_targets(config: Any, model: Any) -> Any:
    """A copy of the ``LoraConfig`` `config` as peft's ``inject_adapter`` converts it for `model`
    before injecting (``target_parameters``, ``rank_pattern``, ``alpha_pattern`` set on a
    mixture of experts with fused experts; unchanged elsewhere). A ``ValueError`` of peft's
    for a target naming half of a fused pair (``gate_proj`` without ``up_proj``)."""
    config = copy.deepcopy(config)
    if hasattr(getattr(model, "config", None), "model_type"):
        resolve("peft.utils.transformers_weight_conversion:convert_peft_config_for_transformers")(
            config, model=model, conversions=None)
    return config


def init_weights(owner: Any, module: Any) -> None:
    """transformers' own initialisation of `module` by the pretrained model `owner`."""
    owner._init_weights(module)
