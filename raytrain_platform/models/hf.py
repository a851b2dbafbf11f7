"""The `hf` family: any ``transformers.AutoModelForCausalLM`` architecture, from a local
directory in Hugging Face layout (``config.json``, ``model.safetensors`` or sharded
safetensors with ``model.safetensors.index.json``, the tokenizer files).

    model:
      name: hf
      kwargs: {path: /models/Llama-3.2-1B, init: pretrained, dtype: float32}

- ``init: pretrained`` (default) trains from the directory's weights; ``random``
  builds from ``config.json`` alone. Pretrained weights go straight into shards: the
  engine builds on the meta device, applies FSDP, TP or the pipeline split, then each
  rank reads only its own slices (or its stages' tensors) of the safetensors files
  (core/weights.py).
- Code from the directory never runs: a ``config.json`` with ``auto_map`` (which
  needs ``trust_remote_code``) is refused, and so are pickled ``pytorch_model.bin``
  weights.
- FSDP shards each decoder layer, then the root; activation checkpointing wraps each
  decoder layer. Llama-style decoders (llama, mistral, qwen2, qwen3) have a TP plan:
  q/k/v and gate/up column-wise, o and down row-wise, the embedding by rows and the
  LM head by columns; heads and key/value heads must divide by ``tp_size``. They also
  split into pipeline stages by decoder layer (models/hf_pipeline.py): the embedding on
  the first stage, the final norm and LM head on the last. Tied input and output
  embeddings take TP (one parameter, both splits cutting the vocabulary) and PP (the
  last stage keeps a copy in step with the first's embedding, parallel/pp.py).

Checks that need only the JSON run with the config (no torch); the rest (transformers
knows the architecture, it is a causal LM) run before Ray starts (`precheck`).

>>> HFFamily().resolve_kwargs({"path": "/no/such/dir"})
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: model.kwargs.path = '/no/such/dir': expected a local directory in Hugging Face layout (config.json, safetensors weights, tokenizer files)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_platform.errors import ConfigError, first_line
from raytrain_platform.units import parse_size
from raytrain_platform.models.family import ModelFamily, PipelineLayout, ServingSpec, check_stage_counts

if TYPE_CHECKING:
    import torch
    from torch import nn

    from raytrain_platform.models.shapes import ModelShape

__all__ = ["HFFamily", "LLAMA_STYLE_TYPES"]

_KEYS = {"path": None, "init": "pretrained", "dtype": "float32", "attn_implementation": "sdpa"}
_DTYPES = ("float32", "bfloat16", "float16")
# Decoders whose layers are self_attn.{q,k,v,o}_proj + mlp.{gate,up,down}_proj (the TP plan's
# names) and whose forward models/hf_pipeline.py reproduces stage by stage.
LLAMA_STYLE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


def read_hf_config(path: str) -> dict:
    """``config.json`` of a model directory as a dict; one-line `ConfigError`s."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError("model.kwargs.path", path, "a local directory in Hugging Face layout "
                          "(config.json, safetensors weights, tokenizer files)")
    file = root / "config.json"
    if not file.is_file():
        raise ConfigError("model.kwargs.path", path, "a directory with a config.json (Hugging Face layout)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model.kwargs.path", path, f"a readable config.json ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError("model.kwargs.path", path, "a config.json with a model_type")
    for key in _CONFIG_COUNTS:  # what the checks and the planner read, where present
        value = config.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError("model.kwargs.path", path, f"a config.json whose {key} is an integer >= 1 "
                              f"(it is {value!r})")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError("model.kwargs.path", path, f"a config.json whose architectures is a list of "
                          f"names (it is {archs!r})")
    return config


# What the platform's own checks compare (seq_len, tokenizer size, TP heads); other keys
# are the architecture's business (Gemma 3n's intermediate_size is a list).
_CONFIG_COUNTS = ("max_position_embeddings", "vocab_size", "num_attention_heads", "num_key_value_heads")


def weight_files(path: str) -> list[str]:
    """The safetensors files of a model directory, in index order."""
    root = Path(path)
    if (root / SAFETENSORS).is_file():
        return [str(root / SAFETENSORS)]
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not (isinstance(weight_map, dict)
                    and all(isinstance(v, str) and v for v in weight_map.values())):
                raise ValueError("weight_map: expected an object of tensor name -> shard file name")
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError("model.kwargs.path", path, f"a readable {SAFETENSORS_INDEX} ({exc})") from None
        missing = [n for n in names if not (root / n).is_file()]
        if missing or any("/" in n or n.startswith(".") for n in names):
            raise ConfigError("model.kwargs.path", path, f"every shard its {SAFETENSORS_INDEX} names, in the "
                              f"directory (missing: {missing[:3]})")
        return [str(root / n) for n in names]
    pickled = [p.name for p in root.glob("pytorch_model*.bin")]
    detail = (f"; it has {pickled[0]}, a pickle, which is never loaded: convert it to safetensors"
              if pickled else "")
    raise ConfigError("model.kwargs.path", path, f"{SAFETENSORS} or {SAFETENSORS_INDEX} with its shards "
                      f"for model.kwargs.init pretrained (or init: random){detail}")


class HFFamily(ModelFamily):
    name = "hf"
    description = "a Hugging Face causal LM from a local directory (AutoModelForCausalLM)"
    # transformers' forward builds its rotary positions (and masks) from the length of
    # the tensor it holds, a sequence shard under sequence parallelism: refused, not wrong.
    sequence_parallel = False

    def resolve_kwargs(self, kwargs: Any) -> dict:
        if not isinstance(kwargs, dict):
            raise ConfigError("model.kwargs", kwargs, "a mapping with path (a model directory)")
        for key in kwargs:
            if key not in _KEYS:
                raise ConfigError(f"model.kwargs.{key}", kwargs[key], f"no such key for model hf; keys are {list(_KEYS)}")
        kw = {**_KEYS, **kwargs}
        if not isinstance(kw["path"], str) or not kw["path"]:
            raise ConfigError("model.kwargs.path", kw["path"], "a local directory in Hugging Face layout (required)")
        # Absolute: Ray workers do not share the driver's working directory.
        kw["path"] = os.path.abspath(os.path.expanduser(kw["path"]))
        if kw["init"] not in ("pretrained", "random"):
            raise ConfigError("model.kwargs.init", kw["init"], "one of ['pretrained', 'random']")
        if kw["dtype"] not in _DTYPES:
            raise ConfigError("model.kwargs.dtype", kw["dtype"], f"one of {list(_DTYPES)}")
        if kw["attn_implementation"] not in ("sdpa", "eager"):
            raise ConfigError("model.kwargs.attn_implementation", kw["attn_implementation"], "'sdpa' or 'eager'")
        config = read_hf_config(kw["path"])
        if "auto_map" in config:
            raise ConfigError("model.kwargs.path", kw["path"], "a model transformers knows without the "
                              "directory's own code (its config.json has auto_map, which needs "
                              "trust_remote_code: refused)")
        archs = config.get("architectures") or []
        if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            raise ConfigError("model.kwargs.path", kw["path"], f"a causal language model (its config.json "
                              f"names architectures {archs})")
        if kw["init"] == "pretrained":
            weight_files(kw["path"])
        return kw

    def resolve_task(self, kwargs: dict, requested: str | None) -> str:
        if requested not in (None, "lm"):
            raise ConfigError("model.task", requested, "'lm' for model hf (or leave it out)")
        return "lm"

    def _config(self, kwargs: dict) -> dict:
        return read_hf_config(kwargs["path"])

    def takes_position_ids(self, kwargs: dict) -> bool:
        # transformers' masking_utils turns restarting position ids into a block-causal mask
        return True

    def max_seq_len(self, kwargs: dict) -> int | None:
        return self._config(kwargs).get("max_position_embeddings")

    def default_seq_len(self, kwargs: dict) -> int | None:
        limit = self.max_seq_len(kwargs)
        return min(limit, 2048) if limit else None

    def default_tokenizer(self, kwargs: dict) -> str:
        return kwargs["path"]

    def vocab_size(self, kwargs: dict) -> int | None:
        return self._config(kwargs).get("vocab_size")

    def precheck(self, kwargs: dict, *, block_class: str | None, needs_blocks: str | None) -> None:
        self.auto_config(kwargs)

    def auto_config(self, kwargs: dict) -> Any:
        """transformers' config object; unknown or non-causal architectures refused."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        path = kwargs["path"]
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # transformers raises ValueError/OSError/KeyError for unknown types
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise ConfigError("model.kwargs.path", path, f"a config transformers can read ({first})") from None
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError("model.kwargs.path", path, f"a causal language model architecture (model_type "
                              f"{config.model_type!r} has no AutoModelForCausalLM class)")
        return config

    # ---- the module --------------------------------------------------------------------------
    def build(self, kwargs: dict, *, device: "str | torch.device | None" = None) -> "nn.Module":
        """The architecture from ``config.json``, initialised by transformers (seeded by the
        caller); pretrained weights are loaded afterwards (`pretrained_files`)."""
        import torch
        from transformers import AutoModelForCausalLM

        config = self.auto_config(kwargs)
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, kwargs["dtype"]),
                                                     attn_implementation=kwargs["attn_implementation"])
        model.config.use_cache = False  # training: no KV cache in forward
        return model

    def pretrained_files(self, kwargs: dict) -> list[str] | None:
        return weight_files(kwargs["path"]) if kwargs["init"] == "pretrained" else None

    def init_buffers(self, model: "nn.Module", device: "torch.device") -> None:
        """Recompute non-persistent buffers (rotary ``inv_freq``) after ``to_empty``: they
        are not in any checkpoint, and a meta build left them empty."""
        import torch

        for module in model.modules():
            own = [n for n, _ in module.named_buffers(recurse=False)
                   if n in getattr(module, "_non_persistent_buffers_set", set())]
            if not own:
                continue
            config = getattr(module, "config", None)
            if config is None:
                raise RuntimeError(f"cannot rebuild buffers {own} of {type(module).__name__} after a "
                                   "meta-device build")  # a bug for an architecture: say which
            with torch.device(device):
                fresh = type(module)(config)
            for name in own:
                setattr(module, name, getattr(fresh, name).to(device))

    def blocks(self, model: "nn.Module", *, block_class: str | None = None) -> list[tuple[str, "nn.Module"]]:
        from raytrain_platform.models.family import find_blocks

        return find_blocks(model, block_class=block_class)  # the decoder layers (model.layers)

    def output_head(self, model: "nn.Module") -> "nn.Module | None":
        # transformers' causal LMs: logits = lm_head(hidden), then at most a scale or a
        # softcap (elementwise); counted.Selection refuses a forward that reshapes them.
        return model.get_output_embeddings()  # type: ignore[operator]

    # ---- parallel plans ------------------------------------------------------------------------
    def check_model_parallel(self, kwargs: dict, *, tp: int, pp: int, stages: int,
                             pp_split: list[int] | None) -> None:
        if tp * pp == 1:
            return
        config = self._config(kwargs)
        model_type = config.get("model_type")
        field_, size = ("parallel.tp_size", tp) if tp > 1 else ("parallel.pp_size", pp)
        if model_type not in LLAMA_STYLE_TYPES:
            raise ConfigError(field_, size, f"1 for model_type {model_type!r} (a tensor-parallel plan and a "
                              f"pipeline split exist for {list(LLAMA_STYLE_TYPES)})")
        from raytrain_platform.models.hf_shapes import hf_config_shape

        if pp > 1:
            check_stage_counts(hf_config_shape(config).n_layer, "num_hidden_layers", pp=pp, stages=stages,
                               pp_split=pp_split, unit="layer")
        if tp == 1:
            return
        # The head counts the model is built with, as the planner reads them: what a
        # config.json leaves out comes from transformers' defaults for its type (32 and 8
        # for mistral), a null num_key_value_heads is num_attention_heads.
        shape = hf_config_shape(config)
        heads, kv_heads = shape.n_head, shape.n_kv_head or shape.n_head
        if heads % tp or kv_heads % tp:
            raise ConfigError("parallel.tp_size", tp, f"a divisor of num_attention_heads ({heads}) and "
                              f"num_key_value_heads ({kv_heads}): each TP rank holds whole heads")

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(blocks="model.layers", first=("model.embed_tokens",),
                              last=("model.norm", "lm_head"))

    def pipeline_module(self, model: "nn.Module") -> "nn.Module":
        from raytrain_platform.models.hf_pipeline import HFPipelineStage

        return HFPipelineStage(model)  # the same modules and names, a forward per stage

    def tp_plan(self, model: "nn.Module", kwargs: dict) -> dict[str, str]:
        plan = {"model.embed_tokens": "embedding", "model.norm": "norm", "lm_head": "head"}
        for i in range(len(model.model.layers)):  # type: ignore[union-attr, arg-type]
            p = f"model.layers.{i}."
            plan.update({p + "self_attn.q_proj": "colwise", p + "self_attn.k_proj": "colwise",
                         p + "self_attn.v_proj": "colwise", p + "self_attn.o_proj": "rowwise",
                         p + "mlp.gate_proj": "colwise", p + "mlp.up_proj": "colwise",
                         p + "mlp.down_proj": "rowwise",
                         p + "input_layernorm": "norm", p + "post_attention_layernorm": "norm"})
            attn = model.get_submodule(p + "self_attn")
            for norm in ("q_norm", "k_norm"):  # qwen3: per-head norms, over head_dim: replicated
                if hasattr(attn, norm):
                    plan[p + f"self_attn.{norm}"] = "norm"
        return plan

    # ---- planner, export, serving ----------------------------------------------------------------
    def shape(self, kwargs: dict, *, seq_len: int | None = None) -> "ModelShape":
        from raytrain_platform.models.hf_shapes import hf_config_shape

        return hf_config_shape(self._config(kwargs), name=Path(kwargs["path"]).name or "hf",
                               seq_len=seq_len or self.default_seq_len(kwargs))

    def export_hf(self, model: "nn.Module", kwargs: dict, out: str, *, tokenizer: str | None = None,
                  max_shard_size: str = "5GB") -> None:
        """`model` as a Hugging Face directory: ``config.json``, safetensors (sharded with
        an index above `max_shard_size`), ``generation_config.json`` and the tokenizer
        (from `tokenizer`, default the model's own directory)."""
        from transformers import AutoTokenizer

        source = tokenizer or kwargs["path"]
        try:  # before anything is written
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # missing or unreadable tokenizer files
            raise ConfigError("data.tokenizer", source, "a tokenizer directory to export with the model "
                              f"({first_line(exc)})") from None
        # off for training (build); the export keeps the base's
        model.config.use_cache = self._config(kwargs).get("use_cache", True)  # type: ignore[union-attr]
        # a transformers model; nn.Module types its attributes as Tensor | Module
        # As bytes: transformers' own parser reads "5gb" as gigabits and refuses "1.5GB".
        model.save_pretrained(out, max_shard_size=parse_size("--max-shard-size", max_shard_size))  # type: ignore[operator]
        tok.save_pretrained(out)
        # The base's generation settings (its end-of-turn ids, sampling defaults), not the
        # ones save_pretrained derives from config.json: serving stops where they say.
        generation = Path(kwargs["path"]) / "generation_config.json"
        if generation.is_file():
            shutil.copyfile(generation, Path(out) / "generation_config.json")

    def serving(self, kwargs: dict, task: str) -> ServingSpec:
        """Text generation with a KV cache, the directory's tokenizer (and chat template),
        stopping at the end-of-sequence tokens of ``generation_config.json`` (else
        ``config.json``); the context is ``max_position_embeddings``."""
        config = self._config(kwargs)
        return ServingSpec("generate", {"vocab_size": config.get("vocab_size"),
                                        "max_position_embeddings": config.get("max_position_embeddings")},
                           context_len=int(config.get("max_position_embeddings") or 0),
                           tokenizer=kwargs["path"], kv_cache=True, stop_token_ids=_eos_ids(kwargs["path"], config))


def _eos_ids(path: str, config: dict) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's (an int or a list)."""
    eos = config.get("eos_token_id")
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        except (OSError, ValueError, AttributeError):
            pass  # an unreadable generation config: config.json's ids
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))
