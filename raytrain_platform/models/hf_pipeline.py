"""Pipeline stages of a Hugging Face Llama-style decoder (llama, mistral, qwen2, qwen3).

transformers' ``...ForCausalLM.forward`` runs the whole model: the embedding, every
layer of a ``ModuleList`` and the final norm. A pipeline stage holds some of the layers
and at most one of the ends, so `HFPipelineStage` holds the same modules under the same
names (``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head``: the
checkpoint's and the safetensors files' keys) and runs what it holds:

- the layers are a ``ModuleDict`` keyed by their index, so a stage deletes the others
  and keeps its own names (``model.layers.5`` stays ``model.layers.5``);
- the first stage embeds the token ids, the others take the previous stage's hidden
  states; the last stage applies the final norm and the LM head;
- every stage computes the positions, the rotary embedding and the attention masks
  itself, from the sequence it holds, with transformers' own functions: a causal mask,
  or a sliding-window one for each layer the config makes sliding (``layer_types`` of
  qwen2 and qwen3, ``sliding_window`` of mistral), as the architectures' own forwards
  choose them. Applied to a whole model, the stage's forward gives transformers'
  logits (tests/test_hf_pipeline.py, each of the four architectures).

Training only: no KV cache, no padding mask (windows are packed, as the platform feeds
them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["HFPipelineStage"]


def _layer_types(config: Any) -> list[str]:
    """Each layer's attention: "full_attention" or "sliding_attention", as the
    architecture's own forward picks its mask (by model type: a llama config.json that
    carries a stray ``sliding_window`` key still gets causal masks)."""
    n = config.num_hidden_layers
    if config.model_type in ("qwen2", "qwen3"):  # per layer (use_sliding_window, max_window_layers)
        return list(config.layer_types)
    if config.model_type == "mistral" and config.sliding_window is not None:  # every layer, when set
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class HFPipelineStage(nn.Module):
    """`causal_lm` (a transformers ``...ForCausalLM`` of a Llama-style decoder) as a
    module a pipeline can cut: the same submodules and parameter names, its layers in a
    ``ModuleDict``; the ends a stage lacks are None. It takes `causal_lm`'s modules
    over (its ``model.layers`` becomes the ``ModuleDict``): use the stage, not
    `causal_lm`, from then on."""

    def __init__(self, causal_lm: Any):
        super().__init__()
        inner = causal_lm.model
        inner.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
        self.model = inner
        self.lm_head: Any = causal_lm.lm_head
        self.config = causal_lm.config
        self._types = _layer_types(self.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        inner: Any = self.model
        hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        masks: dict[str, Any] = {}
        for key, layer in inner.layers.items():
            kind = self._types[int(key)]
            if kind not in masks:
                make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                masks[kind] = make(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                   position_ids=position_ids)
            hidden = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                           position_ids=position_ids)
        if self.lm_head is None:
            return hidden
        return self.lm_head(inner.norm(hidden))
