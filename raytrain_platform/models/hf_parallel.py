"""The `hf` family's tensor-parallel plan and pipeline split, read from transformers.

transformers publishes, per architecture, which modules split how
(``base_model_tp_plan`` of the config class, the causal LM's own ``_tp_plan`` for its
head) and how the base model's forward is laid out (``base_model_pp_plan``: the
modules before the decoder layers, the layers, the modules after). Here they become
the platform's plan (module path -> one of `family.TP_KINDS`, which parallel/tp.py
turns into DTensor styles) and `PipelineLayout`. No architecture is named here.

- Upstream styles map to kinds (`UPSTREAM_STYLES`); a plan with a style that has no
  equivalent here (expert parallelism, packed or MLA projections, ...) is refused.
- The module `get_output_embeddings()` returns is the LM head, split by vocabulary
  columns with its logits gathered (upstream's ``colwise_gather_output``), and
  `get_input_embeddings()` the embedding, split by vocabulary rows, whether or not the
  plan names them (upstream adds ``embed_tokens`` only under that name). Every other
  module holding parameters that the plan leaves out is replicated: its parameters
  become Replicate DTensors. A norm (vectors only) computes on them; a module with
  matrices (a router, experts the plan does not split) on their local tensors, as
  some of its ops (grouped expert matmuls) do not run on DTensors.

No torch at module level; no torch.distributed (models/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_platform.models.family import PipelineLayout

if TYPE_CHECKING:
    from torch import nn

__all__ = ["UPSTREAM_STYLES", "layout_from_pp_plan", "tp_plan_from_upstream", "unknown_styles"]

# transformers' TP style (transformers/distributed/tensor_parallel.py) -> the platform's kind.
UPSTREAM_STYLES = {
    "colwise": "colwise",  # input whole, output features split (heads, MLP units)
    "rowwise": "rowwise",  # input features split, partial sums all-reduced
    # output gathered: the next op needs every feature (Phi-3's qkv slicing, OLMo-2's q/k norms)
    "colwise_gather_output": "colwise_gather", "colwise_rep": "colwise_gather",
    # whole input, each rank its slice of it; partial sums all-reduced
    "rowwise_split_input": "rowwise_split", "rowwise_rep": "rowwise_split",
    "embedding_rowwise": "embedding",
    # per-head norms on this rank's heads: one weight, its gradient summed over ranks
    "replicated_with_grad_allreduce": "local_norm",
}


def unknown_styles(plan: dict[str, str] | None) -> list[str]:
    """The styles of an upstream plan that have no kind here, sorted."""
    return sorted({s for s in (plan or {}).values() if s not in UPSTREAM_STYLES})


def _matches(name: str, rule: str) -> bool:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return replace_layer_number_by_wildcard(name) == rule


def tp_plan_from_upstream(model: "nn.Module") -> dict[str, str]:
    """`model`'s (a transformers causal LM) plan, module path -> kind, from its own
    ``tp_plan`` (the base model's prefixed rules and the head's); ValueError for a style
    with no kind or a rule naming a parameter rather than a module."""
    upstream: dict[str, str] = dict(model.tp_plan)  # type: ignore[arg-type]
    if bad := unknown_styles(upstream):
        raise ValueError(f"{type(model).__name__}'s tensor-parallel plan uses styles {bad}: supported are "
                         f"{sorted(UPSTREAM_STYLES)}")
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters()}
    plan: dict[str, str] = {}
    for rule, style in upstream.items():
        found = [n for n in modules if n and _matches(n, rule)]
        if not found and any(_matches(p, rule) for p in params):
            raise ValueError(f"tensor-parallel rule {rule!r} ({style}) names parameters, not a module")
        plan.update(dict.fromkeys(found, UPSTREAM_STYLES[style]))  # a rule naming nothing: not applied
    ends = {"embedding": model.get_input_embeddings(), "head": model.get_output_embeddings()}  # type: ignore[operator]
    for kind, end in ends.items():
        name = next((n for n, m in modules.items() if m is end), None)
        if name is not None:
            plan[name] = kind  # the plan's own entry for it is the same split
    covered = tuple(f"{n}." for n in plan)
    for name, module in modules.items():
        own = [p.dim() for p in module.parameters(recurse=False)]
        if own and name not in plan and not name.startswith(covered):
            # vectors only: a norm's scale and shift; matrices: a router, experts
            plan[name] = "norm" if max(own) == 1 else "replicate"
    return plan


def layout_from_pp_plan(model: "nn.Module") -> PipelineLayout:
    """The stage split of `model` (a transformers causal LM) from its ``pp_plan``: the
    base model's entries before its decoder layers (the ``ModuleList``) go on the first
    stage, those after it and the causal LM's own (the head) on the last."""
    from torch import nn

    plan: dict[str, Any] = dict(model.pp_plan)  # type: ignore[arg-type]
    prefix = f"{model.base_model_prefix}."
    base = [k for k in plan if k.startswith(prefix)]
    layers = [k for k in base if isinstance(model.get_submodule(k), (nn.ModuleList, nn.ModuleDict))]
    if len(layers) != 1:
        raise ValueError(f"{type(model).__name__}'s pipeline plan {list(plan)} names {len(layers)} module lists "
                         "(expected one: the decoder layers)")
    at = base.index(layers[0])
    if at == 0 or at == len(base) - 1:  # a stage tells first from others by what it holds
        raise ValueError(f"{type(model).__name__}'s pipeline plan {list(plan)} has no module before or after "
                         "its decoder layers")
    own = tuple(k for k in plan if not k.startswith(prefix))
    return PipelineLayout(blocks=layers[0], first=tuple(base[:at]), last=(*base[at + 1:], *own))
