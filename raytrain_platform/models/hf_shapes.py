"""The planner's shape of a Hugging Face causal LM, read from its ``config.json`` alone
(no torch, no transformers): exact parameter and tensor counts for the Llama-style
decoders (``model_type`` llama, mistral, qwen2, qwen3): RMSNorm, SwiGLU MLP, rotary
positions, grouped-query attention, tied or untied LM head, and each type's biases as
transformers builds them (Llama: ``attention_bias`` on q, k, v and o, ``mlp_bias`` on
gate, up and down; Qwen2: q, k and v always; Qwen3: ``attention_bias`` on q, k, v and
o, plus per-head RMSNorms on q and k; Mistral: none). Keys the file leaves out
take the defaults of transformers' config class for that type. Checked against real
`AutoModelForCausalLM.from_config` modules in tests/test_plan_hf.py.

>>> cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
...        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
...        "vocab_size": 128256, "max_position_embeddings": 131072}  # Llama 3.1 8B
>>> shape = hf_config_shape(cfg)
>>> shape.num_params, shape.n_kv_head, shape.seq_len
(8030261248, 8, 4096)
"""

from __future__ import annotations

from typing import Any

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.shapes import ModelShape, transformer_shape

__all__ = ["CONFIG_DEFAULTS", "DEFAULT_MAX_SEQ_LEN", "SUPPORTED_MODEL_TYPES", "hf_config_shape"]

DEFAULT_MAX_SEQ_LEN = 4096  # planned sequence length when none is given (capped by the model's)

# transformers' config class defaults (5.x) for keys a config.json may leave out;
# tests/test_plan_hf.py checks them against LlamaConfig(), MistralConfig(), Qwen2Config().
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "head_dim": None},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "head_dim": None},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "tie_word_embeddings": False, "head_dim": None},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "tie_word_embeddings": False, "head_dim": 128,
              "attention_bias": False},
}
SUPPORTED_MODEL_TYPES = tuple(CONFIG_DEFAULTS)


def _layer_options(model_type: str, cfg: dict) -> dict[str, bool]:
    """Which linear layers have biases and whether q and k have norms, as transformers'
    modeling code builds them (it ignores ``attention_bias`` for mistral and qwen2)."""
    if model_type in ("llama", "qwen3"):
        attn = bool(cfg.get("attention_bias"))
        mlp = model_type == "llama" and bool(cfg.get("mlp_bias"))
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": mlp, "qk_norm": model_type == "qwen3"}
    return {"qkv_bias": model_type == "qwen2", "out_bias": False, "mlp_bias": False, "qk_norm": False}


def _positive(cfg: dict, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json {key}", value, "an integer >= 1")
    return value


def _sizes(cfg: dict) -> dict[str, int]:
    """The integer sizes, checked (one line naming the key) as the model would need them."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
            "max_position_embeddings")
    sizes = {key: _positive(cfg, key) for key in keys}
    heads = sizes["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    sizes["num_key_value_heads"] = heads if kv_heads is None else _positive(cfg, "num_key_value_heads")
    if heads % sizes["num_key_value_heads"]:
        raise ConfigError("config.json num_key_value_heads", sizes["num_key_value_heads"],
                          f"a divisor of num_attention_heads ({heads})")
    if cfg["head_dim"] is not None:
        sizes["head_dim"] = _positive(cfg, "head_dim")
    elif sizes["hidden_size"] % heads:
        raise ConfigError("config.json num_attention_heads", heads,
                          f"a divisor of hidden_size ({sizes['hidden_size']}) when head_dim is not set")
    else:
        sizes["head_dim"] = sizes["hidden_size"] // heads
    return sizes


def hf_config_shape(config: dict, *, name: str = "hf", seq_len: int | None = None) -> ModelShape:
    """The exact `ModelShape` of the causal LM a ``config.json`` dict describes, planned
    at `seq_len` tokens (default: its ``max_position_embeddings``, at most 4096).
    Another ``model_type`` is a `ConfigError` naming the supported ones.

    >>> hf_config_shape({"model_type": "gpt2"})
    Traceback (most recent call last):
    ...
    raytrain_platform.errors.ConfigError: model.kwargs.path = 'gpt2': expected a Llama-style decoder (llama, mistral, qwen2, qwen3) for rtp plan; for others use --params/--layers/--hidden/--seq-len
    """
    if not isinstance(config, dict):
        raise ConfigError("config.json", type(config).__name__, "a JSON object (a Hugging Face model config)")
    model_type = config.get("model_type")
    if model_type not in CONFIG_DEFAULTS:
        raise ConfigError("model.kwargs.path", model_type,
                          f"a Llama-style decoder ({', '.join(SUPPORTED_MODEL_TYPES)}) for rtp plan; "
                          "for others use --params/--layers/--hidden/--seq-len")
    cfg = {**CONFIG_DEFAULTS[model_type], **config}
    sizes = _sizes(cfg)
    if seq_len is None:
        seq_len = min(sizes["max_position_embeddings"], DEFAULT_MAX_SEQ_LEN)
    elif isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "an integer >= 1 (tokens per sequence)")
    return transformer_shape(
        name, n_layer=sizes["num_hidden_layers"], hidden=sizes["hidden_size"],
        n_head=sizes["num_attention_heads"], n_kv_head=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"], seq_len=seq_len, vocab=sizes["vocab_size"],
        ffn_hidden=sizes["intermediate_size"], gated=True, bias=False, learned_pos=False,
        tied=bool(cfg["tie_word_embeddings"]), **_layer_options(model_type, cfg))
