"""The built-in families: `gpt` (a byte-level decoder, models/gpt.py) and `mlp` (a
feed-forward net for tabular data, models/mlp.py).

>>> fam = GPTFamily()
>>> kw = fam.resolve_kwargs({"n_layer": 2, "n_head": 2, "n_embd": 16})
>>> sorted(fam.tp_plan(fam.build(kw), kw).items())[:2]
[('blocks.0.attn', 'sequence_gather'), ('blocks.0.attn.k_proj', 'colwise')]
>>> fam.pipeline_layout(fam.build(kw)).first
('wte', 'wpe')
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.family import ModelFamily, PipelineLayout, ServingSpec, check_stage_counts
from raytrain_platform.models.specs import GPTSpec, MLPSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from raytrain_platform.models.shapes import ModelShape

__all__ = ["GPTFamily", "MLPFamily"]


def _resolve_spec(family: str, spec_cls: type, kwargs: Any) -> Any:
    if not isinstance(kwargs, dict):
        raise ConfigError("model.kwargs", kwargs, "a mapping")
    allowed = [f.name for f in dataclasses.fields(spec_cls)]
    for key in kwargs:
        if key not in allowed:
            raise ConfigError(f"model.kwargs.{key}", kwargs[key],
                              f"no such key for model {family}; keys are {allowed}")
    spec = spec_cls(**kwargs)
    if isinstance(spec.dropout, int) and not isinstance(spec.dropout, bool):
        spec.dropout = float(spec.dropout)
    spec.validate()
    return spec


def _fixed_task(family: str, task: str, requested: str | None, *, tasks: tuple[str, ...] = ()) -> str:
    """The model's task; `tasks`: those its ``model.kwargs.task`` may choose."""
    if requested not in (None, task):
        choose = (f"; model.kwargs.task chooses it (one of {list(tasks)})"
                  if requested in tasks else "")
        raise ConfigError("model.task", requested, f"'{task}' for model {family} (or leave it out){choose}")
    return task


def _on(device: "str | torch.device | None"):
    import torch

    return torch.device(device or "cpu")


class GPTFamily(ModelFamily):
    name = "gpt"
    description = "a small byte-level decoder (nanoGPT-style), vocabulary 256"

    def resolve_kwargs(self, kwargs: Any) -> dict:
        return dataclasses.asdict(_resolve_spec(self.name, GPTSpec, kwargs))

    def resolve_task(self, kwargs: dict, requested: str | None) -> str:
        return _fixed_task(self.name, kwargs["task"], requested)

    def default_seq_len(self, kwargs: dict) -> int:
        return kwargs["block_size"]

    def max_seq_len(self, kwargs: dict) -> int:
        return kwargs["block_size"]

    def vocab_size(self, kwargs: dict) -> int:
        return kwargs["vocab_size"]  # 256: byte-level ids

    def build(self, kwargs: dict, *, device: "str | torch.device | None" = None) -> "nn.Module":
        from raytrain_platform.models.gpt import GPT

        with _on(device):
            return GPT(GPTSpec(**kwargs))

    def blocks(self, model: "nn.Module", *, block_class: str | None = None) -> list[tuple[str, "nn.Module"]]:
        if block_class is not None:
            return super().blocks(model, block_class=block_class)
        return [(f"blocks.{name}", block) for name, block in model.blocks.named_children()]  # type: ignore[union-attr]

    def output_head(self, model: "nn.Module") -> "nn.Module | None":
        return model.lm_head  # type: ignore[return-value]  # None on a pipeline stage without it

    def check_model_parallel(self, kwargs: dict, *, tp: int, pp: int, stages: int,
                             pp_split: list[int] | None) -> None:
        if tp > 1 and kwargs["n_head"] % tp:
            raise ConfigError("parallel.tp_size", tp, f"a divisor of model.kwargs.n_head "
                              f"({kwargs['n_head']}): each TP rank holds whole heads")
        if pp > 1:
            check_stage_counts(kwargs["n_layer"], "model.kwargs.n_layer", pp=pp, stages=stages, pp_split=pp_split)

    def tp_plan(self, model: "nn.Module", kwargs: dict) -> dict[str, str]:
        # Megatron's split: q/k/v and MLP up column-wise (whole heads per rank), the
        # attention output and MLP down row-wise; embeddings by rows, the head by columns.
        plan = {"wte": "embedding", "wpe": "position_embedding", "lm_head": "head", "ln_f": "norm"}
        for name in model.blocks:  # type: ignore[union-attr]
            p = f"blocks.{name}."
            plan.update({p + "attn.q_proj": "colwise", p + "attn.k_proj": "colwise",
                         p + "attn.v_proj": "colwise", p + "attn.o_proj": "rowwise",
                         p + "mlp.up_proj": "colwise", p + "mlp.down_proj": "rowwise",
                         p + "ln_1": "norm", p + "ln_2": "norm",
                         p + "attn": "sequence_gather", p + "mlp": "sequence_gather"})
        return plan

    def pipeline_layout(self, model: "nn.Module") -> PipelineLayout:
        return PipelineLayout(blocks="blocks", first=("wte", "wpe"), last=("ln_f", "lm_head"))

    def shape(self, kwargs: dict, *, seq_len: int | None = None) -> "ModelShape":
        from raytrain_platform.models.shapes import gpt_shape

        return gpt_shape(GPTSpec(**kwargs), name=self.name)

    def planner_kwargs(self, *, layers: int | None, hidden: int | None, heads: int | None,
                       seq_len: int | None) -> dict:
        kw = {k: v for k, v in (("n_layer", layers), ("n_embd", hidden), ("n_head", heads),
                                ("block_size", seq_len)) if v is not None}
        if hidden is not None and hidden % (heads or GPTSpec.n_head):
            raise ConfigError("--heads", heads or GPTSpec.n_head, f"a divisor of --hidden ({hidden})")
        return self.resolve_kwargs(kw)

    def serving(self, kwargs: dict, task: str) -> ServingSpec:
        return ServingSpec("generate", {"block_size": kwargs["block_size"],
                                        "vocab_size": kwargs["vocab_size"]},
                           context_len=kwargs["block_size"])


class MLPFamily(ModelFamily):
    name = "mlp"
    description = "a feed-forward net for tabular classification or regression"
    has_blocks = False  # Linear layers of different widths: nothing repeats

    def resolve_kwargs(self, kwargs: Any) -> dict:
        return dataclasses.asdict(_resolve_spec(self.name, MLPSpec, kwargs))

    def resolve_task(self, kwargs: dict, requested: str | None) -> str:
        return _fixed_task(self.name, kwargs["task"], requested, tasks=("classification", "regression"))

    def needs_data(self, kwargs: dict) -> bool:
        return kwargs["input_dim"] is None or kwargs["num_outputs"] is None

    def fill_from_data(self, kwargs: dict, *, num_features: int, num_classes: int, task: str) -> dict:
        want_out = num_classes if task == "classification" else 1
        if kwargs["input_dim"] is not None and kwargs["input_dim"] != num_features:
            raise ConfigError("model.kwargs.input_dim", kwargs["input_dim"],
                              f"{num_features} (the number of feature columns in the data) or null")
        if kwargs["num_outputs"] is not None and task == "classification" and kwargs["num_outputs"] < want_out:
            raise ConfigError("model.kwargs.num_outputs", kwargs["num_outputs"],
                              f"at least {want_out} (the data has class indices up to {want_out - 1}) or null")
        return {**kwargs, "input_dim": num_features, "num_outputs": kwargs["num_outputs"] or want_out}

    def build(self, kwargs: dict, *, device: "str | torch.device | None" = None) -> "nn.Module":
        from raytrain_platform.models.mlp import MLP

        with _on(device):
            return MLP(MLPSpec(**kwargs))

    def init_weights(self, model: "nn.Module") -> None:
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if reset is not None and module is not model:
                reset()

    def blocks(self, model: "nn.Module", *, block_class: str | None = None) -> list[tuple[str, "nn.Module"]]:
        return super().blocks(model, block_class=block_class) if block_class else []

    def planner_kwargs(self, *, layers: int | None, hidden: int | None, heads: int | None,
                       seq_len: int | None) -> dict:
        # --layers hidden layers of --hidden units; 16 features, 4 classes (synthetic defaults)
        return self.resolve_kwargs({"hidden_sizes": [hidden or 64] * (layers or 2), "input_dim": 16,
                                    "num_outputs": 4})

    def shape(self, kwargs: dict, *, seq_len: int | None = None) -> "ModelShape":
        from raytrain_platform.models.shapes import mlp_shape

        return mlp_shape(MLPSpec(**kwargs), name=self.name)
