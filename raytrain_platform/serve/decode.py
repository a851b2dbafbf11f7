"""The forward passes of batched generation: rows (requests) that decode together, one
token per row per step, in one forward.

Two kinds of batch, chosen by what the model's family says of its forward
(`ServingSpec.kv_cache`):

- `KVCacheBatch`: a Hugging Face-style forward (a ``DynamicCache``, ``attention_mask``,
  ``position_ids``). The rows share one ``DynamicCache``, (B, kv_heads, L, head_dim) keys
  and values per layer (its ``layers``, transformers 5), left-padded to a common length L with an attention mask (B, L) that zeroes
  the padding. A prompt is run once (prefill); after that each step feeds one token per
  row. New rows join a running batch between steps: their own prefill cache is
  left-padded (or the running one is) to the longer length and concatenated on the batch
  dimension. Finished rows leave by index, and columns that are padding in every row
  left are dropped, so the cache is never longer than the longest live row.
- `RecomputeBatch`: any other forward (``model(ids) -> logits``, a byte-level gpt or a
  user model): each step re-runs the last `context_len` tokens of every row, one forward
  per group of equal lengths (no padding, so no mask is needed).

Plain torch, no asyncio and no Serve: `raytrain_platform.serve.engine` drives these
from its scheduler, on the replica's compute thread.

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> torch.manual_seed(0) and None
>>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
>>> model = LlamaForCausalLM(cfg).eval()
>>> batch = KVCacheBatch(model, logits_of=lambda out: out.logits)
>>> first = batch.prefill([[1, 2, 3], [4, 5]])             # (2, vocab): each row's next-token logits
>>> batch.advance(first.argmax(-1).tolist())
>>> batch.select([1])                                     # row 0 finished
>>> with torch.no_grad():
...     alone = model(torch.tensor([[4, 5, int(first[1].argmax())]])).logits[0, -1]
>>> torch.allclose(batch.decode()[0], alone, atol=1e-5)
True
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["KVCacheBatch", "RecomputeBatch"]

LogitsOf = Callable[[Any], torch.Tensor]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class KVCacheBatch:
    """Rows sharing one left-padded KV cache; see the module docstring."""

    def __init__(self, model: nn.Module, *, logits_of: LogitsOf, pad_id: int = 0):
        self.model, self.logits_of, self.pad_id = model, logits_of, pad_id
        self.device = _device(model)
        # transformers 5.2x names the cache argument `cache` (`past_key_values` before);
        # `logits_to_keep=1`: the prefill computes the LM head for the last position only.
        accepted = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self.cache: Any = None  # a DynamicCache, updated in place by each forward
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (B, L): 1 = a real token
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,): next token's position
        self.next_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,): token to feed next

    def __len__(self) -> int:
        return self.mask.shape[0]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: cache}, **self._extra)
        return self.logits_of(out)[:, -1, :].float()  # (B, vocab): the next token

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Run new prompts (left-padded together), add them as rows after the current
        ones; returns their next-token logits (len(prompts), vocab). Their next token is
        set with `advance`."""
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding gets position 0 (masked anyway)
        from transformers import DynamicCache

        cache = DynamicCache()
        if not hasattr(cache, "layers"):  # transformers 4 kept key_cache/value_cache lists instead
            import transformers

            raise RuntimeError(f"KV-cache generation needs transformers >= 5 (DynamicCache.layers); "
                               f"this is {transformers.__version__}")
        logits = self._forward(ids, mask, positions, cache)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        self._append_rows(cache, mask, lengths)
        return logits

    def _append_rows(self, cache: Any, mask: torch.Tensor, positions: torch.Tensor) -> None:
        if not len(self):
            self.cache, self.mask, self.positions = cache, mask, positions
            self.next_ids = torch.zeros_like(positions)
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)])
            mine.values = torch.cat([_left_pad(mine.values, length), _left_pad(theirs.values, length)])
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(mask, length)])
        self.positions = torch.cat([self.positions, positions])
        self.next_ids = torch.cat([self.next_ids, torch.zeros_like(positions)])

    def advance(self, tokens: list[int]) -> None:
        """The token each row feeds at the next `decode` (the one just sampled for it)."""
        self.next_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def decode(self) -> torch.Tensor:
        """One step for every row: feed its next token; returns (B, vocab) logits."""
        mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long, device=self.device)], dim=1)
        logits = self._forward(self.next_ids[:, None], mask, self.positions[:, None], self.cache)
        self.mask, self.positions = mask, self.positions + 1
        return logits

    @torch.inference_mode()
    def score(self, prompt: list[int]) -> torch.Tensor:
        """(len(prompt), vocab) logits of one prompt, every position (no cache; the rows
        are left as they are)."""
        ids = torch.tensor([prompt], device=self.device)
        out = self.model(input_ids=ids, use_cache=False)
        return self.logits_of(out)[0].float().cpu()

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in this order); drop columns that are padding in all of them."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask, self.positions, self.next_ids = self.mask[index], self.positions[index], self.next_ids[index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        if not keep:
            self.cache = None
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, start:], layer.values[index, :, start:]


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zeros before dim 2 (a cache: B, H, L, D) or dim 1 (a mask: B, L) up to `length`."""
    dim = 2 if t.dim() == 4 else 1
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class RecomputeBatch:
    """Rows of a model without a KV cache: every step re-runs each row's last
    `context_len` tokens (0: all of them), one forward per group of equal lengths."""

    def __init__(self, model: nn.Module, *, logits_of: LogitsOf, context_len: int = 0):
        self.model, self.logits_of = model, logits_of
        self.context_len = context_len or 1 << 62
        self.device = _device(model)
        self.rows: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        groups: dict[int, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            groups[min(len(row), self.context_len)].append(i)
        out: torch.Tensor | None = None
        for length, members in groups.items():
            context = torch.tensor([rows[i][-length:] for i in members], device=self.device)
            logits = self.logits_of(self.model(context))[:, -1, :].float()  # (n, vocab)
            if out is None:
                out = logits.new_empty(len(rows), logits.shape[-1])
            out[members] = logits
        assert out is not None
        return out

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        self.rows += [list(p) for p in prompts]
        return self._logits([list(p) for p in prompts])

    def advance(self, tokens: list[int]) -> None:
        for row, token in zip(self.rows, tokens):
            row.append(token)

    def decode(self) -> torch.Tensor:
        return self._logits(self.rows)

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    @torch.inference_mode()
    def score(self, prompt: list[int]) -> torch.Tensor:
        """(len(prompt), vocab) logits of one prompt, every position (the prompt fits the
        context: requests are checked against it)."""
        return self.logits_of(self.model(torch.tensor([prompt], device=self.device)))[0].float().cpu()
