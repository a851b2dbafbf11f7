"""Shapes the planner knows besides the model families' own (models/shapes.py): the
presets (published architectures) and a decoder known only by its sizes
(``--params/--layers/--hidden``, marked ``exact=False``).

No torch here.

>>> preset_shape("llama2-7b").num_params
6738415616
"""

from __future__ import annotations

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.registry import family_names
from raytrain_platform.models.shapes import ModelShape, gpt_shape, mlp_shape, transformer_shape

__all__ = ["ModelShape", "gpt_shape", "mlp_shape", "generic_shape", "preset_shape", "PRESETS"]


def generic_shape(*, num_params: int, n_layer: int, hidden: int, seq_len: int,
                  n_head: int | None = None, vocab: int = 50257) -> ModelShape:
    """A decoder known only by its sizes: GPT-2 style blocks (GeLU MLP of 4*hidden), an
    untied ``vocab x hidden`` embedding and head; what the blocks hold is what is left.

    >>> s = generic_shape(num_params=7_000_000_000, n_layer=32, hidden=4096, seq_len=4096)
    >>> s.n_head, s.exact
    (32, False)
    """
    heads = n_head if n_head is not None else max(1, hidden // 128)
    embed = vocab * hidden
    layer = (num_params - 2 * embed) // n_layer
    if layer < hidden * hidden:
        raise ConfigError("--params", num_params,
                          f"a count that leaves each of {n_layer} blocks at least hidden^2 = "
                          f"{hidden * hidden} parameters after the {2 * embed} of embedding and "
                          f"head (vocab {vocab} x hidden {hidden} x 2)")
    h = hidden
    return ModelShape(
        name="custom", kind="transformer", num_params=num_params,
        num_tensors=2 + 16 * n_layer + 2, n_layer=n_layer, layer_params=layer, layer_tensors=16,
        first_params=embed, first_tensors=1, last_params=num_params - embed - n_layer * layer,
        last_tensors=3, tp_layer_params=min(layer, 12 * h * h + 7 * h),
        layer_matmul_params=min(layer, 12 * h * h), last_matmul_params=h * vocab,
        hidden=h, n_head=heads, seq_len=seq_len, vocab=vocab, ffn_hidden=4 * h, exact=False,
        tp_last_params=embed)


def _gpt2(name: str, n_layer: int, hidden: int, n_head: int) -> ModelShape:
    return transformer_shape(name, n_layer=n_layer, hidden=hidden, n_head=n_head, seq_len=1024,
                        vocab=50257, ffn_hidden=4 * hidden, gated=False, bias=True,
                        learned_pos=True, tied=True)


def _llama2(name: str, n_layer: int, hidden: int, n_head: int, ffn: int) -> ModelShape:
    return transformer_shape(name, n_layer=n_layer, hidden=hidden, n_head=n_head, seq_len=4096,
                        vocab=32000, ffn_hidden=ffn, gated=True, bias=False, learned_pos=False,
                        tied=False)


# Published architectures (multi-head attention only: GQA models would need a kv-head count).
PRESETS = {
    "gpt2": lambda: _gpt2("gpt2", 12, 768, 12),  # 124,439,808 params
    "gpt2-medium": lambda: _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": lambda: _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": lambda: _gpt2("gpt2-xl", 48, 1600, 25),
    "llama2-7b": lambda: _llama2("llama2-7b", 32, 4096, 32, 11008),  # 6,738,415,616 params
    "llama2-13b": lambda: _llama2("llama2-13b", 40, 5120, 40, 13824),
}


def preset_shape(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ConfigError("--model", name, f"a built-in model {family_names()} or a preset {sorted(PRESETS)}")
    return PRESETS[name]()
