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


class NanMLP(nn.Module):
    """An MLP whose training forwards number `nan_from` to `nan_until` - 1 (counted from 0,
    one per optimizer step without accumulation) return NaN: a run that diverges at a
    known step, and (with `nan_until`) recovers. `nan_rank`: on that rank only."""

    def __init__(self, input_dim: int, num_outputs: int, nan_from: int, nan_until: int | None,
                 nan_rank: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_dim, 32), nn.GELU(), nn.Linear(32, num_outputs))
        self.nan_from, self.nan_until, self.calls = nan_from, nan_until, 0
        if nan_rank is not None:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_rank() != nan_rank:
                self.nan_from = 10**9

    def forward(self, x):
        out = self.net(x)
        if self.training:
            bad = self.calls >= self.nan_from and (self.nan_until is None or self.calls < self.nan_until)
            self.calls += 1
            if bad:
                return out * float("nan")
        return out


def nan_mlp(input_dim: int = 16, num_outputs: int = 4, nan_from: int = 5, nan_until: int | None = None,
            nan_rank: int | None = None):
    return NanMLP(input_dim, num_outputs, nan_from, nan_until, nan_rank)


class TiedEmbeddingMLP(nn.Module):
    """Two layers share one weight (tied, as an LM head and its embedding often are)."""

    def __init__(self, input_dim: int, num_outputs: int):
        super().__init__()
        self.inp = nn.Linear(input_dim, input_dim, bias=False)
        self.out = nn.Linear(input_dim, num_outputs)
        self.back = nn.Linear(input_dim, input_dim, bias=False)
        self.back.weight = self.inp.weight

    def forward(self, x):
        return self.out(self.back(self.inp(x).relu()))


def tied_mlp(input_dim: int = 16, num_outputs: int = 4):
    return TiedEmbeddingMLP(input_dim, num_outputs)


def failing_save_mlp(input_dim: int = 16, num_outputs: int = 4):
    """An MLP whose state cannot be read once it has trained: a checkpoint save fails
    (as a full disk or a lost bucket would), with an OSError."""
    model = NanMLP(input_dim, num_outputs, nan_from=10**9, nan_until=None)

    def fail(module, state_dict, prefix, local_metadata):
        if module.calls > 0:
            raise OSError("checkpoint write failed: no space left on device (injected)")
    model._register_state_dict_hook(fail)
    return model


def failing_mlp(input_dim: int = 16, num_outputs: int = 4, fail_at: int = 2):
    """An MLP whose training forward number `fail_at` raises ValueError (a bug in user code)."""
    model = NanMLP(input_dim, num_outputs, nan_from=10**9, nan_until=None)

    def check(module, args):
        if module.training and module.calls == fail_at:
            raise ValueError(f"user model failed on forward {fail_at}")
    model.register_forward_pre_hook(check)
    return model


def no_linear(input_dim: int = 16, num_outputs: int = 4) -> nn.Module:
    """A classifier with no nn.Linear (a 1x1 convolution over features): LoRA refuses it
    (tests/test_lora.py)."""
    return nn.Sequential(nn.Unflatten(1, (input_dim, 1)), nn.Conv1d(input_dim, num_outputs, 1), nn.Flatten())


def leaves_a_mark(path: str) -> nn.Module:
    """A builder with a side effect: it writes `path` (the trust test: a run directory
    naming it must not get it called unless trusted)."""
    from pathlib import Path

    Path(path).write_text("built")
    return nn.Linear(16, 4)
