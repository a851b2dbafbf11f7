"""The architecture matrix of the `hf` family's tests: tiny random causal LMs made on the
spot with transformers' own config classes and ``save_pretrained`` (nothing downloaded),
all sharing one tokenizer (tools/tiny_llm's byte-level BPE with a chat template).

    from hf_archs import ARCHS, make_arch
    model_dir = make_arch(tmp_path / "gemma2", "gemma2", tokenizer_dir)

No dropout (GPT-2 and OPT default to 0.1): layouts draw their masks differently, and the
equality tests compare layouts. Sizes are the smallest that keep each architecture's structure: 2 layers (Gemma 2/3
alternate sliding and global attention over them), 4 query heads over 2 key/value heads
where the architecture has grouped-query attention (so TP of 2 splits whole heads), 4
experts choosing 2 for the mixtures of experts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = ["ARCHS", "DENSE", "MOE", "arch_config", "make_arch"]

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, POSITIONS = 64, 2, 4, 2, 128, 256

# model_type -> (config class name, the architecture's own keyword names for the sizes)
_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": HIDDEN // HEADS}),
    "mistral": ("MistralConfig", {}),
    "gpt2": ("GPT2Config", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_inner": FFN,
                            "n_positions": POSITIONS, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoXConfig", {"tie_word_embeddings": False}),
    "phi3": ("Phi3Config", {}),
    "gemma2": ("Gemma2Config", {"head_dim": HIDDEN // HEADS, "sliding_window": 8}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": HIDDEN // HEADS, "sliding_window": 8}),
    "opt": ("OPTConfig", {"ffn_dim": FFN, "word_embed_proj_dim": HIDDEN, "dropout": 0.0}),
    "olmo2": ("Olmo2Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": HIDDEN // HEADS, "moe_intermediate_size": 32, "num_experts": 4,
                                     "num_experts_per_tok": 2, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
ARCHS = tuple(_SPECS)
MOE = ("qwen3_moe", "mixtral")
DENSE = tuple(a for a in ARCHS if a not in MOE)
# Architectures whose config class has no grouped-query attention key.
_NO_KV_HEADS = ("gpt2", "gpt_neox", "opt")


def arch_config(arch: str, *, vocab_size: int, bos: int | None, eos: int, pad: int | None, **overrides: Any) -> Any:
    """transformers' config object of a tiny `arch` model."""
    import transformers

    cls_name, own = _SPECS[arch]
    common: dict[str, Any] = {"vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos,
                              "pad_token_id": pad}
    if arch != "gpt2":
        common.update(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      max_position_embeddings=POSITIONS)
        if arch != "opt":
            common["intermediate_size"] = FFN
        if arch not in _NO_KV_HEADS:
            common["num_key_value_heads"] = KV_HEADS
    return getattr(transformers, cls_name)(**{**common, **own, **overrides})


def make_arch(out: str | Path, arch: str, tokenizer_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialised tiny `arch` causal LM to `out` (safetensors, config,
    generation config) with the tokenizer of `tokenizer_dir` beside it; returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = arch_config(arch, vocab_size=len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id,
                         pad=tok.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out)
    model.save_pretrained(str(out))
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out
