"""The ``model`` section of a job config (config/sections.py lists them all)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Union

from raytrain_platform.config.fields import REQUIRED, check_field
from raytrain_platform.models.family import TASKS
from raytrain_platform.models.lora import resolve_lora
from raytrain_platform.models.registry import get_family

__all__ = ["ModelConfig"]


@dataclass
class ModelConfig:
    """`name` is a model family (`gpt`, `mlp`, `hf`; models/registry.py) or an import path
    ``pkg.module:build_fn`` whose function takes ``**kwargs`` and returns an ``nn.Module``.
    The family validates `kwargs` and decides the task."""

    SECTION: ClassVar[str] = "model"
    name: str = REQUIRED
    """A model family: `gpt`, `mlp`, `hf` (a Hugging Face causal LM from `model.kwargs.path`; see
    [hf.md](hf.md)), or a user model `pkg.module:build_fn` (a function taking `**kwargs` and returning an
    `nn.Module`; see [models.md](models.md))."""
    kwargs: dict = field(default_factory=dict)
    """The model's sizes. `gpt`: `n_layer` 2, `n_head` 4, `n_embd` 128, `block_size` 64 (context length),
    `dropout` 0.0, `bias` true, `init_std` 0.02 (byte-level vocabulary of 256). `mlp`: `hidden_sizes` [64,
    64], `dropout` 0.0, `input_dim`/`num_outputs` (default: from the data), `task` classification or
    regression. `hf`: `path`, `init` (pretrained), `dtype` (float32), `attn_implementation` (null: transformers'
    pick for the architecture); see [hf.md](hf.md). User models: passed as keyword arguments."""
    task: Union[str, None] = None  # classification | regression | lm; built-ins know theirs
    """`classification`, `regression` or `lm`; needed only for user models (default classification); the
    built-in families know theirs."""
    block_class: Union[str, None] = None
    """The class name of the model's repeated blocks, which FSDP shards one by one and activation checkpointing
    wraps (default: the children of its largest `nn.ModuleList` of one class)."""
    lora: Union[dict, None] = None
    """LoRA adapters `{r, alpha, dropout, target_modules}` (defaults 8, 16, 0.0, `all-linear`: peft's rule,
    every `nn.Linear` and `Conv1D` but the output head, resolved to module names before Ray; on a mixture of
    experts, its fused experts and router too, as peft's `get_peft_model` adapts them): the base is frozen and only the adapters train; see
    [hf.md](hf.md#lora-fine-tuning-modellora)."""

    def __post_init__(self) -> None:
        family = get_family(self.name)
        check_field(self.task is None or self.task in TASKS, "model.task", self.task, f"one of {list(TASKS)}")
        # Fills in defaults and rejects unknown or bad keys with the field named.
        self.kwargs = family.resolve_kwargs(self.kwargs)
        self.task = family.resolve_task(self.kwargs, self.task)
        check_field(self.block_class is None or bool(re.fullmatch(r"[A-Za-z_]\w*", self.block_class)),
               "model.block_class", self.block_class, "a Python class name, or null")
        if self.lora is not None:
            self.lora = resolve_lora(self.lora)

    @property
    def resolved_task(self) -> str:
        """`task` as ``__post_init__`` settled it (the family's own when the config gave none)."""
        assert self.task is not None, "ModelConfig.__post_init__ resolves the task from its family"
        return self.task
