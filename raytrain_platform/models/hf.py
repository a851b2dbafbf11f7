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
  (core/weights.py), found as transformers finds them: its renames (GPT-NeoX's
  ``embed_out``) and conversions (a mixture of experts' per-expert tensors, fused)
  apply (models/hf_weights.py), and a fused tensor is built whole, then sliced.
- ``attn_implementation``: null (default) for the one transformers picks for the
  architecture (sdpa, or eager for Gemma 2), or one of eager, sdpa, flex_attention,
  flash_attention_2 (CUDA and the flash_attn package); an architecture without the
  one asked for is refused before Ray.
- Code from the directory never runs: a ``config.json`` with ``auto_map`` (which
  needs ``trust_remote_code``) is refused, and so are pickled ``pytorch_model.bin``
  weights.
- FSDP shards each decoder layer, then the root; activation checkpointing wraps each
  decoder layer. Tensor parallelism follows transformers' own plan for the
  architecture (its config's ``base_model_tp_plan``, models/hf_parallel.py): e.g.
  q/k/v and gate/up column-wise, o and down row-wise; the embedding by rows and the
  LM head by columns; heads and key/value heads must divide by ``tp_size``. An
  architecture whose config has no plan (gpt2, opt) is refused. Pipeline stages split
  where its ``base_model_pp_plan`` says and run transformers' own forward
  (models/hf_pipeline.py): the embedding on the first stage, the final norm and LM
  head on the last. Tied input and output embeddings take TP (one parameter, both
  splits cutting the vocabulary) and PP (the last stage keeps a copy in step with the
  first's embedding, parallel/pp.py).

Checks that need only the JSON run with the config (no torch); the rest (transformers
knows the architecture, it is a causal LM) run before Ray starts (`precheck`), as do
those of TP and PP sizes above 1, which read transformers' config class (its plans).

>>> HFFamily().resolve_kwargs({"path": "/no/such/dir"})
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: model.kwargs.path = '/no/such/dir': expected a local directory in Hugging Face layout (config.json, safetensors weights, tokenizer files)
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_platform.errors import ConfigError, first_line
from raytrain_platform.units import parse_size
from raytrain_platform.models.family import (ConvertedWeight, ModelFamily, PipelineLayout, ServingSpec,
                                             check_stage_counts)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from raytrain_platform.models.shapes import ModelShape

__all__ = ["HFFamily", "PACKED_DOCUMENT_TYPES"]

_KEYS = {"path": None, "init": "pretrained", "dtype": "float32", "attn_implementation": None}
_DTYPES = ("float32", "bfloat16", "float16")
# transformers' names; None: the one transformers picks for the architecture (sdpa, or
# eager where the architecture has no sdpa path: Gemma 2).
_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2")
_FLASH = "flash_attention_2"
# Shown (tests/test_packing.py): a packed window's loss is each document's alone.
PACKED_DOCUMENT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
                         "phi3", "olmo2", "gpt_neox", "gpt2")
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
        _check_attention(kw["attn_implementation"])
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

    def reference_kwargs(self, kwargs: dict, path: str) -> dict:
        """`kwargs` with the pretrained weights of the model folder `path`: its architecture
        may differ, its vocabulary may not (it scores the policy's token ids)."""
        try:
            ref = self.resolve_kwargs({**kwargs, "path": path, "init": "pretrained"})
        except ConfigError as exc:
            raise ConfigError("train.dpo.reference", path, exc.allowed) from None
        ours, theirs = self.vocab_size(kwargs), self.vocab_size(ref)
        if ours != theirs:
            raise ConfigError("train.dpo.reference", path, f"a model with the policy's vocabulary of {ours} "
                              f"tokens (it has {theirs})")
        return ref

    def resolve_task(self, kwargs: dict, requested: str | None) -> str:
        if requested not in (None, "lm"):
            raise ConfigError("model.task", requested, "'lm' for model hf (or leave it out)")
        return "lm"

    def _config(self, kwargs: dict) -> dict:
        return read_hf_config(kwargs["path"])

    def takes_position_ids(self, kwargs: dict) -> bool:
        # transformers' masking_utils turns restarting position ids into a block-causal mask,
        # where the architecture's forward hands them to it (OPT's does not: its documents
        # would attend to each other); shown per type by tests/test_packing.py. Flash
        # attention builds no such mask: its varlen path reads the ids of a batch of one row
        # only (transformers 5.25), not shown here: concat.
        return (self._config(kwargs).get("model_type") in PACKED_DOCUMENT_TYPES
                and kwargs.get("attn_implementation") != _FLASH)

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
        config = self.auto_config(kwargs)
        attention = kwargs.get("attn_implementation")
        if attention is not None and attention != _FLASH:  # flash: its package is checked, the GPU by the job
            _check_supported_attention(config, attention)

    def check_devices(self, kwargs: dict, *, use_gpu: bool) -> None:
        if kwargs.get("attn_implementation") == _FLASH and not use_gpu:
            raise ConfigError("model.kwargs.attn_implementation", _FLASH, "null, 'eager', 'sdpa' or 'flex_attention' "
                              "when scaling.use_gpu is false (flash attention runs on CUDA GPUs only)")

    def auto_config(self, kwargs: dict) -> Any:
        """transformers' config object (a copy: the caller may change it); unknown or
        non-causal architectures refused. Read once per version of ``config.json``."""
        path = kwargs["path"]
        try:
            stat = (Path(path) / "config.json").stat()
        except OSError:
            stat = None
        return copy.deepcopy(_auto_config(path, None if stat is None else (stat.st_mtime_ns, stat.st_size)))

    def aux_loss_coef(self, kwargs: dict) -> float:
        """``router_aux_loss_coef`` when the config asks the forward for its router's
        load-balancing loss (``output_router_logits``, as transformers' own loss counts it)."""
        config = self.auto_config(kwargs)
        if not getattr(config, "output_router_logits", False):
            return 0.0
        coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise ConfigError("model.kwargs.path", kwargs["path"], f"a config.json whose router_aux_loss_coef is a "
                              f"number >= 0 (it is {coef!r})")
        return float(coef)

    # ---- the module --------------------------------------------------------------------------
    def build(self, kwargs: dict, *, device: "str | torch.device | None" = None) -> "nn.Module":
        """The architecture from ``config.json``, initialised by transformers (seeded by the
        caller); pretrained weights are loaded afterwards (`pretrained_files`)."""
        import torch
        from transformers import AutoModelForCausalLM

        config = self.auto_config(kwargs)
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, kwargs["dtype"]),
                                                     attn_implementation=kwargs.get("attn_implementation"))
        model.config.use_cache = False  # training: no KV cache in forward
        return model

    def pretrained_files(self, kwargs: dict) -> list[str] | None:
        return weight_files(kwargs["path"]) if kwargs["init"] == "pretrained" else None

    def init_buffers(self, model: "nn.Module", device: "torch.device") -> None:
        """Set non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) after
        ``to_empty``, with transformers' own ``_init_weights`` (models/hf_weights.py)."""
        from raytrain_platform.models.hf_weights import init_buffers

        init_buffers(model)

    def checkpoint_sources(self, model: "nn.Module", keys: list[str]) -> "dict[str, str | ConvertedWeight]":
        """Checkpoint keys renamed and converted as transformers loads them (GPT-NeoX's
        ``embed_out``, fused experts): models/hf_weights.py."""
        from raytrain_platform.models.hf_weights import checkpoint_sources

        return checkpoint_sources(model.config, keys)

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
        """TP needs the config class's ``base_model_tp_plan`` (its styles known here) and
        heads dividing by `tp`; PP its ``base_model_pp_plan``, a type whose stages are
        shown to give transformers' logits, and a layer per stage. Read from transformers'
        config object (the counts it builds the model with, defaults included)."""
        if tp * pp == 1:
            return
        from raytrain_platform.models.hf_parallel import UPSTREAM_STYLES, unknown_styles
        from raytrain_platform.models.hf_pipeline import PIPELINE_TYPES

        config = self.auto_config(kwargs).get_text_config()
        model_type = config.model_type
        for size, field_, kind in ((tp, "parallel.tp_size", "tp"), (pp, "parallel.pp_size", "pp")):
            if size > 1 and not getattr(config, f"base_model_{kind}_plan", None):
                raise ConfigError(field_, size, f"1 for model_type {model_type!r} (its transformers config has "
                                  f"no base_model_{kind}_plan)")
        if tp > 1 and (bad := unknown_styles(config.base_model_tp_plan)):
            raise ConfigError("parallel.tp_size", tp, f"1 for model_type {model_type!r} (its base_model_tp_plan "
                              f"uses styles {bad}; the styles run here are {sorted(UPSTREAM_STYLES)})")
        if pp > 1:
            if self.aux_loss_coef(kwargs):  # a stage's output is its hidden states or logits
                raise ConfigError("parallel.pp_size", pp, f"1 for model_type {model_type!r} with "
                                  "output_router_logits (the router's load-balancing loss is not carried "
                                  "across pipeline stages; set output_router_logits false in config.json)")
            if model_type not in PIPELINE_TYPES:
                raise ConfigError("parallel.pp_size", pp, f"1 for model_type {model_type!r} (pipeline stages are "
                                  f"shown to give transformers' logits for {list(PIPELINE_TYPES)})")
            check_stage_counts(config.num_hidden_layers, "num_hidden_layers", pp=pp, stages=stages,
                               pp_split=pp_split, unit="layer")
        if tp == 1:
            return
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads  # null: num_attention_heads
        if heads % tp or kv_heads % tp:
            raise ConfigError("parallel.tp_size", tp, f"a divisor of num_attention_heads ({heads}) and "
                              f"num_key_value_heads ({kv_heads}): each TP rank holds whole heads")

    def pipeline_layout(self, model: "nn.Module") -> PipelineLayout:
        return model.layout  # type: ignore[return-value]  # HFPipelineStage: from base_model_pp_plan

    def pipeline_module(self, model: "nn.Module") -> "nn.Module":
        from raytrain_platform.models.hf_pipeline import HFPipelineStage

        return HFPipelineStage(model)  # the same modules and names, transformers' forward per stage

    def tp_plan(self, model: "nn.Module", kwargs: dict) -> dict[str, str]:
        """transformers' own plan for the architecture (models/hf_parallel.py)."""
        from raytrain_platform.models.hf_parallel import tp_plan_from_upstream
        from raytrain_platform.models.hf_pipeline import HFPipelineStage

        if isinstance(model, HFPipelineStage):  # TP x PP: the whole model's plan, before the split
            with model.assembled() as whole:
                return tp_plan_from_upstream(whole)
        return tp_plan_from_upstream(model)

    # ---- planner, export, serving ----------------------------------------------------------------
    def shape(self, kwargs: dict, *, seq_len: int | None = None) -> "ModelShape":
        """Exact counts from the model built on the meta device (models/hf_shapes.py)."""
        from raytrain_platform.models.hf_shapes import hf_shape

        return hf_shape(self.auto_config(kwargs), name=Path(kwargs["path"]).name or "hf",
                        seq_len=seq_len or self.default_seq_len(kwargs), family=self, kwargs=kwargs)

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


def _check_attention(value: Any) -> None:
    """`ConfigError` for an attention implementation transformers does not have here
    (flash attention: also without its package)."""
    if value is not None and value not in _ATTENTION:
        raise ConfigError("model.kwargs.attn_implementation", value, f"one of {list(_ATTENTION)}, or null for "
                          "the architecture's default")
    if value == _FLASH:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("model.kwargs.attn_implementation", value, "an installed implementation: the "
                              "flash_attn package is not installed (pip install flash-attn), or sdpa")


@functools.lru_cache(maxsize=8)
def _auto_config(path: str, version: tuple[int, int] | None) -> Any:
    """`HFFamily.auto_config`'s read; `version` (config.json's time and size) keys the cache."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for unknown types
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError("model.kwargs.path", path, f"a config transformers can read ({first})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError("model.kwargs.path", path, f"a causal language model architecture (model_type "
                          f"{config.model_type!r} has no AutoModelForCausalLM class)")
    return config


def _check_supported_attention(config: Any, value: str) -> None:
    """`ConfigError` when the architecture has no `value` attention path: transformers'
    own check, on a meta-device build (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=value)
    except Exception as exc:  # ValueError, ImportError, or another of a version without that path
        reason = first_line(exc).split(". ")[0]  # "XForCausalLM does not support ... yet"
        raise ConfigError("model.kwargs.attn_implementation", value, f"an implementation the architecture "
                          f"supports, or null for its default ({reason})") from None


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
