"""torch's private APIs used here (torch 2.13), each with why. Everything else uses
torch's public API (``torch.nn.utils.get_total_norm``, ``parameters_to_vector``,
``torch.compiler.reset``, ...). tests/test_compat.py resolves each entry of `USED`.

>>> sorted(USED)[:2]
['torch._dynamo.config', 'torch._functorch.config']
"""

from __future__ import annotations

from typing import Any

from raytrain_platform.compat import resolve

__all__ = ["USED", "checkpoint_wrapper", "non_persistent_buffers", "post_accumulate_grad_hooks",
           "set_post_accumulate_grad_hooks", "state_dict_names", "default_reduce_scatter", "dynamo_config", "functorch_config",
           "inductor_cxx_check", "local_shape_and_offset", "has_triton", "resolve"]

# "module:attribute" (or a module) -> why it is used and has no public equivalent.
USED: dict[str, str] = {
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper":
        "activation checkpointing of a block that keeps its state_dict keys (torchtitan uses it too; "
        "torch.utils.checkpoint has no module wrapper)",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:DefaultReduceScatter":
        "FSDP2's reduce-scatter, subclassed to count the collectives a step issues (rtp doctor)",
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset":
        "which slice of a full tensor a DTensor shard holds, to read only that slice of a checkpoint",
    "torch._dynamo.config": "the recompile limits per compiled block (parallel.compile)",
    "torch._functorch.config": "the activation memory budget of a block compiled to recompute",
    "torch._inductor.cpp_builder:get_cpp_compiler": "a clear error before Ray when no C++ compiler exists",
    "torch._inductor.exc:InvalidCxxCompiler": "the error TorchInductor raises for a missing C++ compiler",
    "torch._inductor.config": "the C++ compilers TorchInductor looks for, named in that error",
    "torch.utils._triton:has_triton": "a clear error before Ray when a GPU worker has no Triton",
    "torch.distributed.checkpoint.state_dict:_get_fqns":
        "a parameter's names as torch's state_dict reports them (compile and checkpoint-wrapper prefixes "
        "cleaned), to drop a frozen tied alias that ignore_frozen_params keeps",
    "torch:Tensor._post_accumulate_grad_hooks":
        "the hooks registered on a meta-device parameter (TP's, keeping an embedding's own rows of its "
        "gradient), registered again after to_empty gives the parameter new storage",
    "torch.nn:Module()._non_persistent_buffers_set":
        "which buffers a module keeps out of its state_dict (rotary inv_freq, Gemma's embed_scale): rebuilt "
        "after a meta-device build, never read from a checkpoint",
}


def post_accumulate_grad_hooks(tensor: Any) -> list:
    """The post-accumulate-grad hooks registered on `tensor`, in order."""
    return list((tensor._post_accumulate_grad_hooks or {}).values())


def set_post_accumulate_grad_hooks(tensor: Any, hooks: list) -> None:
    """`tensor`'s post-accumulate-grad hooks replaced by `hooks` (registered in order)."""
    tensor._post_accumulate_grad_hooks = None
    for hook in hooks:
        tensor.register_post_accumulate_grad_hook(hook)


def non_persistent_buffers(module: Any) -> set[str]:
    """The names of `module`'s own buffers left out of its state_dict."""
    return set(module._non_persistent_buffers_set)


def state_dict_names(module: Any, name: str) -> set[str]:
    """The names `module`'s torch.distributed state_dict gives its parameter `name`."""
    return set(resolve("torch.distributed.checkpoint.state_dict:_get_fqns")(module, name))


def checkpoint_wrapper(module: Any, **kwargs: Any) -> Any:
    return resolve("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper")(module, **kwargs)


def default_reduce_scatter() -> type:
    return resolve("torch.distributed.fsdp._fully_shard._fsdp_collectives:DefaultReduceScatter")


def local_shape_and_offset(shape: Any, mesh: Any, placements: Any) -> tuple[Any, Any]:
    """(local shape, global offset) of a DTensor of `shape` on `mesh` with `placements`."""
    return resolve("torch.distributed.tensor._utils:compute_local_shape_and_global_offset")(shape, mesh, placements)


def dynamo_config() -> Any:
    return resolve("torch._dynamo.config")


def functorch_config() -> Any:
    return resolve("torch._functorch.config")


def inductor_cxx_check() -> tuple[list[str], bool]:
    """(the C++ compilers TorchInductor tries, whether one of them works)."""
    compilers = [c for c in resolve("torch._inductor.config").cpp.cxx if c]
    try:
        resolve("torch._inductor.cpp_builder:get_cpp_compiler")()
    except resolve("torch._inductor.exc:InvalidCxxCompiler"):
        return compilers, False
    return compilers, True


def has_triton() -> bool:
    return bool(resolve("torch.utils._triton:has_triton")())
