"""A small decoder-only transformer over bytes, in the spirit of nanoGPT.

Separate q/k/v projections (not one fused ``c_attn``) so that tensor parallelism
can shard them column-wise by heads; the LM head is not tied to the embedding,
which keeps pipeline stages and TP plans free of shared parameters.

>>> import torch
>>> from raytrain_platform.models.specs import GPTSpec
>>> m = GPT(GPTSpec(n_layer=1, n_head=2, n_embd=16, block_size=8))
>>> m(torch.zeros(3, 8, dtype=torch.long)).shape  # (B, T, vocab)
torch.Size([3, 8, 256])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_platform.models.specs import GPTSpec

__all__ = ["GPT", "Block"]


class Attention(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        d = spec.n_embd
        self.head_dim = d // spec.n_head
        self.q_proj = nn.Linear(d, d, bias=spec.bias)
        self.k_proj = nn.Linear(d, d, bias=spec.bias)
        self.v_proj = nn.Linear(d, d, bias=spec.bias)
        self.o_proj = nn.Linear(d, d, bias=spec.bias)
        self.dropout = spec.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads, not n_head: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.up_proj = nn.Linear(spec.n_embd, 4 * spec.n_embd, bias=spec.bias)
        self.down_proj = nn.Linear(4 * spec.n_embd, spec.n_embd, bias=spec.bias)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.n_embd, bias=spec.bias)
        self.attn = Attention(spec)
        self.ln_2 = nn.LayerNorm(spec.n_embd, bias=spec.bias)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab_size, spec.n_embd)
        self.wpe = nn.Embedding(spec.block_size, spec.n_embd)
        self.drop = nn.Dropout(spec.dropout)
        # A ModuleDict keyed "0".."L-1" (not a ModuleList) so that pipeline stages can
        # delete the blocks they do not own and keep the others' names and FQNs.
        self.blocks = nn.ModuleDict({str(i): Block(spec) for i in range(spec.n_layer)})
        self.ln_f = nn.LayerNorm(spec.n_embd, bias=spec.bias)
        self.lm_head = nn.Linear(spec.n_embd, spec.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.spec.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p) if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") \
                    or name.endswith("ln_f.weight") else nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                # GPT-2: residual projections scaled so the residual stream's variance stays put.
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.spec.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # Each stage of a pipeline may lack wte / lm_head; those parts are skipped.
        if self.wte is not None:
            T = idx.shape[1]
            pos = torch.arange(T, device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d)
        else:
            x = idx
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)
