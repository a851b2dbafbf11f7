"""transformers' and peft's private APIs used here (transformers 5.25, peft 0.21), each
with why: the same steps their own loading and peft's ``get_peft_model`` take.
tests/test_compat.py resolves each entry of `USED`.

>>> INIT_FLAG
'_is_hf_initialized'
"""

from __future__ import annotations

from typing import Any

from raytrain_platform.compat import resolve

__all__ = ["INIT_FLAG", "USED", "all_linear_names", "init_weights"]

# The flag transformers' init functions read to leave a tensor as it is (set by its own
# loading on every tensor read from a checkpoint).
INIT_FLAG = "_is_hf_initialized"

USED: dict[str, str] = {
    "peft.tuners.tuners_utils:_maybe_include_all_linear_layers":
        "peft's all-linear rule (every Linear and Conv1D but the output layer) as names: "
        "inject_adapter_in_model, which keeps the model's own class, does not expand it",
    "transformers:PreTrainedModel._init_weights":
        "the non-persistent buffers (rotary inv_freq, Gemma's embed_scale) set after a meta-device "
        "build, as from_pretrained sets them",
}


def all_linear_names(model: Any) -> set[str]:
    """The module names peft's ``all-linear`` picks in `model`."""
    from peft import LoraConfig

    expand = resolve("peft.tuners.tuners_utils:_maybe_include_all_linear_layers")
    return set(expand(LoraConfig(target_modules="all-linear"), model).target_modules)


def init_weights(owner: Any, module: Any) -> None:
    """transformers' own initialisation of `module` by the pretrained model `owner`."""
    owner._init_weights(module)
