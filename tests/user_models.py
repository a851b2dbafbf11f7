"""A user model, loaded by import path (``model.name: "user_models:slow_mlp"``).

It sleeps in forward so that a test can kill a run between two checkpoints
without racing it; the math is an ordinary MLP.
"""

import time

from torch import nn


class SlowMLP(nn.Module):
    def __init__(self, input_dim: int, num_outputs: int, delay_s: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_dim, 32), nn.GELU(), nn.Linear(32, num_outputs))
        self.delay_s = delay_s

    def forward(self, x):
        if self.training:
            time.sleep(self.delay_s)
        return self.net(x)


def slow_mlp(input_dim: int = 16, num_outputs: int = 4, delay_s: float = 0.05) -> nn.Module:
    return SlowMLP(input_dim, num_outputs, delay_s)


def tiny_llama(vocab_size: int = 256, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
               num_kv_heads: int = 2, max_positions: int = 64):
    """A Hugging Face `LlamaForCausalLM` built from a config (no download), returned as it
    is: its forward gives a `CausalLMOutputWithPast` (``.logits``), not a tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


class DictOutput(nn.Module):
    """Returns ``{"logits": ...}``, as some model zoos do."""

    def __init__(self, vocab_size: int = 256, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x).relu()
        return {"logits": self.head(x)}


def dict_output(vocab_size: int = 256, width: int = 16) -> nn.Module:
    return DictOutput(vocab_size, width)


class TupleOutput(DictOutput):
    def forward(self, idx):
        return (super().forward(idx)["logits"],)


def tuple_output() -> nn.Module:
    """Returns a tuple: neither logits nor an output with .logits."""
    return TupleOutput()


def not_a_module(width: int = 4):
    return {"width": width}
