"""Pipeline stages of a Hugging Face causal LM, split where its ``base_model_pp_plan``
says (models/hf_parallel.py `layout_from_pp_plan`), run by transformers' own forward.

A pipeline stage holds some of the decoder layers and at most one end, so
`HFPipelineStage` holds the causal LM's modules under the same names (``model.layers.N``
stays ``model.layers.N``: the checkpoint's and the safetensors files' keys), the layers
in a ``ModuleDict`` keyed by index, so a stage deletes the others (parallel/pp.py).

Its forward calls the architecture's own forward, as transformers' own pipeline
(``transformers/distributed/pipeline_parallel.py``) does: every part the stage lacks
stands in as an identity for the call (a layer of another stage, the final norm before
the last stage, the embedding's dropout after the first), the first stage passes the
token ids, the others the previous stage's hidden states as ``inputs_embeds``; the
last stage runs the causal LM's forward (the head and what follows it: Gemma's
logit soft-capping), the others the base model's. Positions, rotary embeddings and
masks (causal, sliding by layer type) are the architecture's own, computed on each
stage. `PIPELINE_TYPES` are the model types for which tests/test_hf_pipeline.py shows
the stages chained give transformers' logits.

Training only: no KV cache, no padding mask (windows are packed, as the platform feeds
them).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from raytrain_platform.models.family import PipelineLayout
from raytrain_platform.models.hf_parallel import layout_from_pp_plan

__all__ = ["HFPipelineStage", "PIPELINE_TYPES"]

# Shown (tests/test_hf_pipeline.py): two stages chained give the whole model's logits.
PIPELINE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "phi3",
                  "olmo2", "gpt_neox")


class _Absent(nn.Module):
    """What a stage lacks, for one call of the architecture's forward: its input through."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class HFPipelineStage(nn.Module):
    """`causal_lm` (a transformers ``...ForCausalLM``) as a module a pipeline can cut:
    its submodules under their names, the decoder layers in a ``ModuleDict``; the ends a
    stage lacks are None. It takes `causal_lm`'s modules over: use the stage, not
    `causal_lm`, from then on."""

    def __init__(self, causal_lm: Any):
        super().__init__()
        self.layout: PipelineLayout = layout_from_pp_plan(causal_lm)
        own = [*causal_lm.parameters(recurse=False), *causal_lm.buffers(recurse=False)]
        if own:
            raise ValueError(f"{type(causal_lm).__name__} holds tensors of its own: its stages could not "
                             "keep their names")
        for name, child in list(causal_lm.named_children()):
            self.add_module(name, child)
        parent, attr = self._parent(self.layout.blocks)
        layers = getattr(parent, attr)
        self.n_layers = len(layers)
        setattr(parent, attr, nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)}))
        self.config = causal_lm.config
        causal_lm._modules.clear()  # a shell: its forward, given this stage's modules per call
        self.__dict__["_shell"] = causal_lm  # not a submodule: no second name for anything

    def _parent(self, path: str) -> tuple[nn.Module, str]:
        head, _, attr = path.rpartition(".")
        return (self.get_submodule(head) if head else self), attr

    @contextlib.contextmanager
    def assembled(self) -> Iterator[Any]:
        """The causal LM, for one call: this stage's modules, `_Absent` for the rest
        (the layers a ``ModuleList`` again, as its forward iterates them)."""
        shell = self.__dict__["_shell"]
        swapped: list[tuple[nn.Module, str, nn.Module | None]] = []  # to put back
        try:
            for path in (*self.layout.first, *self.layout.last):
                parent, attr = self._parent(path)
                if parent._modules.get(attr) is None:
                    swapped.append((parent, attr, None))
                    parent._modules[attr] = _Absent()
            parent, attr = self._parent(self.layout.blocks)
            held = parent._modules[attr]
            swapped.append((parent, attr, held))
            layers: Any = held  # the ModuleDict of this stage's layers
            parent._modules[attr] = nn.ModuleList(
                [layers[str(i)] if str(i) in layers else _Absent() for i in range(self.n_layers)])
            shell._modules.update(self._modules)
            yield shell
        finally:
            for parent, attr, original in reversed(swapped):
                parent._modules[attr] = original
            shell._modules.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = all(self._get(p) is not None for p in self.layout.first)
        last = all(self._get(p) is not None for p in self.layout.last)
        inputs = {"input_ids" if first else "inputs_embeds": x}
        with self.assembled() as lm:
            if last:
                return lm(**inputs, use_cache=False).logits
            return lm.base_model(**inputs, use_cache=False).last_hidden_state

    def _get(self, path: str) -> nn.Module | None:
        parent, attr = self._parent(path)
        return parent._modules.get(attr)
