"""Typed job config: one root (`JobConfig`) with sections model, data, train,
parallel, scaling, run. Loaded from YAML, overridden with ``--set a.b=value``
(values parsed as YAML scalars), or built from Python.

No torch or Ray import here: validation runs before any Ray resource is asked for.

>>> cfg = JobConfig.from_dict({
...     "model": {"name": "mlp"},
...     "data": {"source": "synthetic", "batch_size": 32},
...     "train": {"max_steps": 10},
...     "run": {"name": "demo"},
... })
>>> cfg.parallel.strategy, cfg.scaling.num_workers
('none', 1)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Union

import yaml

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.family import TASKS
from raytrain_platform.models.lora import resolve_lora
from raytrain_platform.models.registry import get_family
from raytrain_platform.parallel.dims import PP_SCHEDULES, ParallelDims
from raytrain_platform.parallel.registry import STRATEGIES, recompute_dropout_error, strategy_names
from raytrain_platform.units import parse_size

__all__ = [
    "JobConfig",
    "read_yaml",
    "ModelConfig",
    "DataConfig",
    "TrainConfig",
    "ParallelConfig",
    "ScalingConfig",
    "RunConfig",
    "TRACKERS",
    "load_config",
    "apply_overrides",
    "add_set_flag",
]

_REQUIRED: Any = dataclasses.MISSING
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "$" lets a final newline in
MAX_SYNTHETIC = 100_000_000
SEED_LIMIT = 2**32  # numpy's and every generator's range; torch takes it too
SEED_ALLOWED = "an integer from 0 to 2**32 - 1"
# Experiment trackers `run.tracking` accepts; raytrain_platform/tracking/ implements each.
TRACKERS: tuple[str, ...] = ("mlflow", "tensorboard")


def _check(ok: bool, path: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(path, value, allowed)


@dataclass
class ModelConfig:
    """`name` is a model family (`gpt`, `mlp`; models/registry.py) or an import path
    ``pkg.module:build_fn`` whose function takes ``**kwargs`` and returns an ``nn.Module``.
    The family validates `kwargs` and decides the task."""

    SECTION: ClassVar[str] = "model"
    name: str = _REQUIRED
    kwargs: dict = field(default_factory=dict)
    task: Union[str, None] = None  # classification | regression | lm; built-ins know theirs
    # The class name of the repeated blocks (FSDP units, activation checkpointing);
    # default: the children of the model's largest ModuleList of one class.
    block_class: Union[str, None] = None
    # LoRA adapters {r, alpha, dropout, target_modules}: only they train (models/lora.py).
    lora: Union[dict, None] = None

    def __post_init__(self) -> None:
        family = get_family(self.name)
        _check(self.task is None or self.task in TASKS, "model.task", self.task, f"one of {list(TASKS)}")
        # Fills in defaults and rejects unknown or bad keys with the field named.
        self.kwargs = family.resolve_kwargs(self.kwargs)
        self.task = family.resolve_task(self.kwargs, self.task)
        _check(self.block_class is None or bool(re.fullmatch(r"[A-Za-z_]\w*", self.block_class)),
               "model.block_class", self.block_class, "a Python class name, or null")
        if self.lora is not None:
            self.lora = resolve_lora(self.lora)

    @property
    def resolved_task(self) -> str:
        """`task` as ``__post_init__`` settled it (the family's own when the config gave none)."""
        assert self.task is not None, "ModelConfig.__post_init__ resolves the task from its family"
        return self.task


@dataclass
class DataConfig:
    SECTION: ClassVar[str] = "data"
    source: str = _REQUIRED  # parquet | synthetic | text | jsonl
    batch_size: Union[int, str] = _REQUIRED  # per-worker micro-batch, or "auto" (train.global_batch_size)
    path: Union[str, None] = None  # parquet/jsonl file, folder or URI; text folder (default: Python's stdlib)
    # jsonl records: text | prompt_completion | chat (rendered by the tokenizer's chat template)
    format: str = "text"
    # A local Hugging Face tokenizer folder (text, jsonl). Default: the model family's own
    # (an hf model's directory); without one, text is read as bytes and jsonl is refused.
    tokenizer: Union[str, None] = None
    text_field: str = "text"  # jsonl field names, per format
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    feature_columns: Union[list[str], None] = None  # parquet: input columns (default: all but label)
    label_column: str = "label"
    val_path: Union[str, None] = None  # parquet: separate validation data (else val_fraction)
    val_fraction: float = 0.05  # held out by a hash of the sample id
    num_samples: int = 4096  # synthetic
    num_features: int = 16  # synthetic tabular
    num_classes: int = 4  # synthetic classification
    seed: int = 0  # synthetic generator
    glob: str = "**/*.py"  # text: which files under path
    # lm: tokens of context per sample (each sample holds seq_len + 1 tokens: the targets
    # are the inputs shifted by one). Default: the model's context (gpt: block_size).
    seq_len: Union[int, None] = None
    max_files: Union[int, None] = None  # text: use only the first N files (sorted)
    prefetch_batches: int = 2
    shuffle_buffer: int = 0  # local shuffle buffer in rows per worker; 0 = source order
    shuffle_seed: Union[int, None] = None  # default: train.seed
    # false: every worker reads the whole training set (Ray Train's unsplit datasets):
    # the same samples on every rank, which `rtp doctor` flags; true is what DDP needs.
    split_across_workers: bool = True
    max_read_rows_per_s: Union[float, None] = None  # throttle each read task (simulate slow storage)
    # text/jsonl through a tokenizer: keep the packed windows in the token cache
    # ($RTP_CACHE_DIR, ~5 bytes per token), so that a piece is tokenized once, not by
    # the driver's count and again by every read of it (data/window_cache.py)
    window_cache: bool = True
    # text/jsonl through a tokenizer: processes the driver's count pass tokenizes with
    # (data/pool.py): auto = 1 below 16 MiB to tokenize, else one per core (at most 16)
    tokenize_processes: Union[int, str] = "auto"

    _ALLOWED: ClassVar[dict[str, str]] = {
        "batch_size": "an integer >= 1, or 'auto' (with train.global_batch_size)",
        "tokenize_processes": "an integer >= 1, or 'auto' (one per core for 16 MiB or more to tokenize)"}

    _SOURCES: ClassVar[tuple[str, ...]] = ("parquet", "synthetic", "text", "jsonl")
    _FORMATS: ClassVar[tuple[str, ...]] = ("text", "prompt_completion", "chat")  # data/jsonl.py
    _FIELDS: ClassVar[tuple[str, ...]] = ("text_field", "prompt_field", "completion_field", "messages_field")

    def __post_init__(self) -> None:
        _check(self.source in self._SOURCES, "data.source", self.source, f"one of {list(self._SOURCES)}")
        _check(self.format in self._FORMATS, "data.format", self.format, f"one of {list(self._FORMATS)}")
        _check(self.format == "text" or self.source == "jsonl", "data.format", self.format,
               f"'text' for data.source {self.source} (prompt_completion and chat are jsonl formats)")
        if self.tokenizer is not None:
            _check(self.source in ("text", "jsonl"), "data.tokenizer", self.tokenizer,
                   f"null for data.source {self.source} (a tokenizer reads text or jsonl)")
            _check(bool(self.tokenizer), "data.tokenizer", self.tokenizer, "a tokenizer folder, or null")
        for name in self._FIELDS:
            _check(bool(getattr(self, name)), f"data.{name}", getattr(self, name), "a JSON field name")
        _check(self.source != "jsonl" or bool(self.path), "data.path", self.path,
               "a .jsonl file, a folder of them or a URI when data.source is jsonl")
        _check(self.batch_size == "auto" or (isinstance(self.batch_size, int) and self.batch_size >= 1),
               "data.batch_size", self.batch_size, self._ALLOWED["batch_size"])
        _check(self.tokenize_processes == "auto" or (type(self.tokenize_processes) is int
                                                     and self.tokenize_processes >= 1),
               "data.tokenize_processes", self.tokenize_processes, self._ALLOWED["tokenize_processes"])
        _check(self.source != "parquet" or bool(self.path), "data.path", self.path,
               "a folder or URI of Parquet files when data.source is parquet")
        _check(0.0 <= self.val_fraction < 1.0, "data.val_fraction", self.val_fraction,
               "a number in [0, 1)")
        _check(1 <= self.num_samples <= MAX_SYNTHETIC, "data.num_samples", self.num_samples,
               f"an integer from 1 to {MAX_SYNTHETIC:,} (synthetic data: its sample ids are held in memory)")
        _check(self.num_features >= 1, "data.num_features", self.num_features, "an integer >= 1")
        _check(self.num_classes >= 2, "data.num_classes", self.num_classes, "an integer >= 2")
        _check(self.max_files is None or self.max_files >= 1, "data.max_files", self.max_files,
               "an integer >= 1 or null")
        _check(self.seq_len is None or self.seq_len >= 1, "data.seq_len", self.seq_len,
               "an integer >= 1 or null (the model's context)")
        for name in ("seed", "shuffle_seed"):
            value = getattr(self, name)
            _check(value is None or 0 <= value < SEED_LIMIT, f"data.{name}", value, SEED_ALLOWED)
        _check(self.prefetch_batches >= 0, "data.prefetch_batches", self.prefetch_batches,
               "an integer >= 0")
        _check(self.shuffle_buffer >= 0, "data.shuffle_buffer", self.shuffle_buffer,
               "an integer >= 0 (0 = no shuffle)")
        _check(self.max_read_rows_per_s is None or self.max_read_rows_per_s > 0,
               "data.max_read_rows_per_s", self.max_read_rows_per_s, "a number > 0 or null (no limit)")
        _check(self.feature_columns is None or len(self.feature_columns) > 0,
               "data.feature_columns", self.feature_columns, "a non-empty list of column names or null")

    @property
    def micro_batch(self) -> int:
        """``batch_size`` as the number a run uses: ``auto`` is decided before Ray starts
        (resolve_job, plan/auto.py), so a resolved job's config always has one.

        >>> DataConfig(source="synthetic", batch_size=8).micro_batch
        8
        """
        if isinstance(self.batch_size, int):
            return self.batch_size
        raise ConfigError("data.batch_size", self.batch_size,
                          "a number here: 'auto' is decided when the job is resolved (rtp validate, rtp train)")

    def tokenizer_for(self, model: ModelConfig) -> str | None:
        """The tokenizer folder text and jsonl are read with: ``data.tokenizer``, else the
        model family's own (an hf model's directory); None: text is read as bytes."""
        if self.source not in ("text", "jsonl"):
            return None
        return self.tokenizer or get_family(model.name).default_tokenizer(model.kwargs)


@dataclass
class TrainConfig:
    SECTION: ClassVar[str] = "train"
    max_steps: Union[int, None] = None  # optimizer steps; stops at whichever of these comes first
    epochs: Union[int, None] = None
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    global_batch_size: Union[int, None] = None  # with data.batch_size auto: samples per optimizer step
    lr: float = 1e-3
    optimizer: str = "adamw"  # adamw | sgd
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd
    lr_schedule: str = "cosine"  # cosine | constant (both after warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    seed: int = 0
    # A step whose loss or gradient norm is NaN/inf: stop (exit 1, naming the step and the
    # newest finite checkpoint) or skip_step (no update; counted as nonfinite_skips), which
    # stops after max_nonfinite_skips skipped steps in a row.
    on_nonfinite: str = "stop"
    max_nonfinite_skips: int = 10
    # Language models with a loss mask (instruction data): counted runs the output head and
    # the loss on the tokens the loss counts only (core/counted.py); all on every position.
    logits: str = "counted"

    _ON_NONFINITE: ClassVar[tuple[str, ...]] = ("stop", "skip_step")
    _LOGITS: ClassVar[tuple[str, ...]] = ("counted", "all")

    def __post_init__(self) -> None:
        _check(self.max_steps is not None or self.epochs is not None, "train.max_steps",
               self.max_steps, "an integer >= 1 (or set train.epochs)")
        _check(self.max_steps is None or self.max_steps >= 1, "train.max_steps", self.max_steps,
               "an integer >= 1 or null")
        _check(self.epochs is None or self.epochs >= 1, "train.epochs", self.epochs,
               "an integer >= 1 or null")
        _check(self.grad_accum_steps >= 1, "train.grad_accum_steps", self.grad_accum_steps,
               "an integer >= 1")
        _check(self.global_batch_size is None or self.global_batch_size >= 1, "train.global_batch_size",
               self.global_batch_size, "an integer >= 1 or null")
        _check(self.lr > 0, "train.lr", self.lr, "a number > 0")
        _check(0 <= self.seed < SEED_LIMIT, "train.seed", self.seed, SEED_ALLOWED)
        _check(self.optimizer in ("adamw", "sgd"), "train.optimizer", self.optimizer,
               "one of ['adamw', 'sgd']")
        _check(self.logits in self._LOGITS, "train.logits", self.logits, f"one of {list(self._LOGITS)}")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "a number >= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas",
               self.betas, "two numbers in [0, 1)")
        _check(0 <= self.momentum < 1, "train.momentum", self.momentum, "a number in [0, 1)")
        _check(self.lr_schedule in ("cosine", "constant"), "train.lr_schedule", self.lr_schedule,
               "one of ['cosine', 'constant']")
        _check(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "an integer >= 0")
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio,
               "a number in [0, 1]")
        _check(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "a number >= 0 (0 = off)")
        _check(self.precision in ("fp32", "bf16"), "train.precision", self.precision,
               "one of ['fp32', 'bf16']")
        _check(self.on_nonfinite in self._ON_NONFINITE, "train.on_nonfinite", self.on_nonfinite,
               f"one of {list(self._ON_NONFINITE)}")
        _check(self.max_nonfinite_skips >= 1, "train.max_nonfinite_skips", self.max_nonfinite_skips,
               "an integer >= 1 (consecutive skipped steps before the run stops)")


@dataclass
class ParallelConfig:
    SECTION: ClassVar[str] = "parallel"
    strategy: str = "none"
    ddp_bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    # FSDP only (parallel/fsdp.py). mixed_precision and cpu_offload need GPUs: rejected on CPU.
    mixed_precision: bool = False  # bf16 parameters in forward/backward, fp32 gradient reduction
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3)
    cpu_offload: bool = False  # sharded parameters, gradients, optimizer state in host memory
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile each repeated block (parallel/compile.py)
    # Model parallelism (gpt; parallel/dims.py): data-parallel size = num_workers / (tp x pp).
    tp_size: int = 1  # tensor-parallel ranks per model replica (heads split across them)
    pp_size: int = 1  # pipeline-parallel ranks (stages) per model replica
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_microbatches: Union[int, None] = None  # pipeline chunks per micro-batch; default pp_size
    pp_split: Union[list[int], None] = None  # blocks (decoder layers) per stage; default balanced
    sequence_parallel: bool = False  # TP: norms and dropout on sequence shards

    _FSDP_ONLY: ClassVar[dict[str, bool]] = {
        "mixed_precision": False, "reshard_after_forward": True, "cpu_offload": False}
    # Options that work on the model's repeated blocks, on every layout (parallel/compose.py):
    # field -> (what it does to a block, what the run summary says the blocks are).
    BLOCK_OPTIONS: ClassVar[dict[str, tuple[str, str]]] = {
        "activation_checkpointing": ("checkpoint", "checkpointed"),
        "compile": ("compile", "compiled (TorchInductor, during the first step)")}

    def block_options_set(self) -> list[str]:
        """The `BLOCK_OPTIONS` turned on, as config fields (``parallel.compile``...)."""
        return [f"parallel.{name}" for name in self.BLOCK_OPTIONS if getattr(self, name)]

    def __post_init__(self) -> None:
        _check(self.strategy in STRATEGIES or self.strategy == "auto", "parallel.strategy",
               self.strategy, f"one of {strategy_names()} or 'auto' (chosen by the plan at launch)")
        _check(self.ddp_bucket_cap_mb > 0, "parallel.ddp_bucket_cap_mb", self.ddp_bucket_cap_mb,
               "a number > 0")
        for name in ("tp_size", "pp_size"):
            _check(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "an integer >= 1")
        _check(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
               f"one of {list(PP_SCHEDULES)}")
        _check(self.pp_microbatches is None or self.pp_microbatches >= 1, "parallel.pp_microbatches",
               self.pp_microbatches, "an integer >= 1 or null")
        _check(self.pp_split is None or all(n >= 1 for n in self.pp_split), "parallel.pp_split",
               self.pp_split, "a list of block counts >= 1, or null")
        _check(self.tp_size > 1 or not self.sequence_parallel, "parallel.sequence_parallel",
               self.sequence_parallel, "false unless parallel.tp_size > 1")
        if self.strategy not in ("fsdp", "auto"):
            for name, default in self._FSDP_ONLY.items():
                _check(getattr(self, name) == default, f"parallel.{name}", getattr(self, name),
                       f"{str(default).lower()} unless parallel.strategy is 'fsdp'")


@dataclass
class ScalingConfig:
    SECTION: ClassVar[str] = "scaling"
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    torch_threads: Union[int, None] = None  # intra-op threads per worker; default from CPUs
    memory_budget: Union[str, None] = None  # per CPU worker, for the auto fields, e.g. "4GiB"
    # Elastic: `num_workers: {min: 1, max: 4}` is stored as num_workers 4, min_workers 1. Ray
    # starts with what the cluster has (>= min) and restarts smaller or larger after a
    # failure; the global batch stays num_workers x batch x accum (accumulation makes it up).
    min_workers: Union[int, None] = None
    placement_strategy: str = "PACK"  # Ray placement group: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD

    _PLACEMENT: ClassVar[tuple[str, ...]] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

    @classmethod
    def normalize(cls, data: dict) -> dict:
        """``num_workers: {min: m, max: M}`` -> ``num_workers: M, min_workers: m``."""
        n = data.get("num_workers")
        if not isinstance(n, dict):
            return data
        _check(set(n) == {"min", "max"} and all(isinstance(v, int) and not isinstance(v, bool)
                                                 for v in n.values()),
               "scaling.num_workers", n, "an integer >= 1, or {min: M, max: N} with integers (elastic)")
        _check("min_workers" not in data, "scaling.min_workers", data.get("min_workers"),
               "unset when scaling.num_workers is {min, max}")
        return {**data, "num_workers": n["max"], "min_workers": n["min"]}

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    def __post_init__(self) -> None:
        _check(self.min_workers is None or 1 <= self.min_workers <= self.num_workers,
               "scaling.min_workers", self.min_workers,
               f"null or an integer from 1 to scaling.num_workers ({self.num_workers})")
        _check(self.placement_strategy in self._PLACEMENT, "scaling.placement_strategy",
               self.placement_strategy, f"one of {list(self._PLACEMENT)}")
        if self.memory_budget is not None:
            parse_size("scaling.memory_budget", self.memory_budget)
        _check(self.num_workers >= 1, "scaling.num_workers", self.num_workers, "an integer >= 1")
        _check(self.cpus_per_worker > 0, "scaling.cpus_per_worker", self.cpus_per_worker,
               "a number > 0")
        _check(self.torch_threads is None or self.torch_threads >= 1, "scaling.torch_threads",
               self.torch_threads, "an integer >= 1 or null")

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_size("scaling.memory_budget", self.memory_budget)


@dataclass
class RunConfig:
    SECTION: ClassVar[str] = "run"
    name: str = _REQUIRED
    storage_path: str = "./runs"  # local folder (or shared mount) holding run directories
    checkpoint_every: int = 50  # optimizer steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2
    max_failures: int = 0  # worker-failure retries (FailureConfig); -1 = unlimited
    eval_every: int = 50  # optimizer steps between validation passes; 0 = only at the end
    eval_batches: int = 8  # validation micro-batches per rank per pass
    log_every: int = 1  # optimizer steps between metric reports
    # Experiment trackers fed from rank 0 at every report (raytrain_platform/tracking/).
    tracking: list[str] = field(default_factory=list)  # any of TRACKERS; none by default
    # MLflow store; default MLFLOW_TRACKING_URI, else sqlite:///<storage_path>/mlflow.db
    tracking_uri: Union[str, None] = None
    experiment: Union[str, None] = None  # MLflow experiment; default "raytrain_platform"
    log_checkpoints: bool = False  # also log the best checkpoint to MLflow (large)

    _ALLOWED: ClassVar[dict[str, str]] = {
        "tracking": f"a list of trackers, any of {list(TRACKERS)} (default: none)"}

    @classmethod
    def normalize(cls, data: dict) -> dict:
        """``tracking: mlflow`` (or ``--set run.tracking=mlflow``) -> ``tracking: [mlflow]``."""
        value = data.get("tracking")
        if isinstance(value, str):
            return {**data, "tracking": [value]}
        return {**data, "tracking": []} if "tracking" in data and value is None else data

    def __post_init__(self) -> None:
        _check(bool(_RUN_NAME.fullmatch(self.name)), "run.name", self.name,
               "1-128 characters of letters, digits, '_', '-', '.' starting with a letter or digit")
        _check(bool(self.storage_path), "run.storage_path", self.storage_path, "a non-empty path")
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", self.checkpoint_every,
               "an integer >= 0")
        _check(self.keep_checkpoints >= 1, "run.keep_checkpoints", self.keep_checkpoints,
               "an integer >= 1")
        _check(self.max_failures >= -1, "run.max_failures", self.max_failures,
               "an integer >= -1 (-1 = unlimited)")
        _check(self.eval_every >= 0, "run.eval_every", self.eval_every, "an integer >= 0")
        _check(self.eval_batches >= 1, "run.eval_batches", self.eval_batches, "an integer >= 1")
        _check(self.log_every >= 1, "run.log_every", self.log_every, "an integer >= 1")
        self._check_tracking()

    def _check_tracking(self) -> None:
        for i, name in enumerate(self.tracking):
            _check(name in TRACKERS, f"run.tracking[{i}]", name, f"one of {list(TRACKERS)}")
        self.tracking = list(dict.fromkeys(self.tracking))
        for key in ("tracking_uri", "experiment"):
            _check(getattr(self, key) is None or bool(getattr(self, key).strip()), f"run.{key}",
                   getattr(self, key), "a non-empty string, or null (the default)")
        mlflow = "mlflow" in self.tracking
        _check(mlflow or not self.log_checkpoints, "run.log_checkpoints", self.log_checkpoints,
               "false unless run.tracking includes mlflow")
        # The default store is a SQLite file in storage_path, which must then be a local path.
        _check(not mlflow or self.tracking_uri is not None or "://" not in self.storage_path
               or bool(os.environ.get("MLFLOW_TRACKING_URI")), "run.tracking_uri", None,
               f"an MLflow tracking URI when run.storage_path is a URI ({self.storage_path}): "
               "the default SQLite store needs a local storage_path (or set MLFLOW_TRACKING_URI)")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.name)


_Section = ModelConfig | DataConfig | TrainConfig | ParallelConfig | ScalingConfig | RunConfig
_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "scaling": ScalingConfig,
    "run": RunConfig,
}


@dataclass
class JobConfig:
    """The root config. Build with `from_dict`, `load_config`, or the section classes."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    run: RunConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            _check(isinstance(getattr(self, name), cls), name, type(getattr(self, name)).__name__,
                   f"a {cls.__name__}")
        par = self.parallel
        if par.strategy == "auto":  # decided at launch (plan/auto.py), then validated in full
            for name in ("tp_size", "pp_size"):
                _check(getattr(par, name) == 1, f"parallel.{name}", getattr(par, name),
                       "1 with parallel.strategy auto (the plan chooses the model-parallel sizes)")
        else:
            strat = STRATEGIES[par.strategy]
            _validate_parallel_dims(self)
            n = ParallelDims.from_config(self).dp  # the strategy spans the data-parallel ranks
            _check(strat.min_workers <= n and (strat.max_workers is None or n <= strat.max_workers),
                   "scaling.num_workers", self.scaling.num_workers,
                   f"{strat.describe_workers()} per model replica (data-parallel size {n}) for "
                   f"parallel.strategy '{par.strategy}'")
        if self.scaling.elastic:
            _check(par.tp_size == par.pp_size == 1 and par.strategy in ("ddp", "fsdp", "auto"),
                   "scaling.min_workers", self.scaling.min_workers,
                   "null (fixed size) unless parallel.strategy is ddp, fsdp or auto with tp_size and "
                   "pp_size 1: an elastic worker group changes the data-parallel size only")
        t = self.train
        if self.data.batch_size == "auto":
            _check(t.global_batch_size is not None, "train.global_batch_size", None,
                   "an integer >= 1 when data.batch_size is auto (samples per optimizer step)")
            _check(t.grad_accum_steps == 1, "train.grad_accum_steps", t.grad_accum_steps,
                   "1 (unset) when data.batch_size is auto: it is derived from the global batch")
        elif t.global_batch_size is not None:  # given beside an explicit batch: must agree
            dp, product = ParallelDims.from_config(self).dp, self.global_batch  # strategy auto: tp, pp 1
            _check(t.global_batch_size == product, "train.global_batch_size", t.global_batch_size,
                   f"null, or data.batch_size ({self.data.batch_size}) x train.grad_accum_steps "
                   f"({t.grad_accum_steps}) x data-parallel workers ({dp}) = {product}")
        for name in ("mixed_precision", "cpu_offload"):
            _check(self.scaling.use_gpu or not getattr(par, name), f"parallel.{name}",
                   getattr(par, name), "false when scaling.use_gpu is false (GPU-only FSDP option)")
        family = get_family(self.model.name)
        for name, (verb, _) in par.BLOCK_OPTIONS.items():
            _check(family.has_blocks or not getattr(par, name), f"parallel.{name}", getattr(par, name),
                   f"false for model '{self.model.name}' (it has no repeated blocks to {verb})")
        if par.compile and par.activation_checkpointing:  # the model's own dropout: parallel/compile.py checks it
            for where, p in (("model.kwargs.dropout", self.model.kwargs.get("dropout")),
                             ("model.lora.dropout", (self.model.lora or {}).get("dropout"))):
                if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                    raise recompute_dropout_error(f"{where} = {p}")
        task = self.model.task
        if task == "lm":
            seq_len = self.seq_len
            if seq_len is None:
                raise ConfigError("data.seq_len", None,
                                  f"an integer >= 1 for the language model '{self.model.name}' (tokens per sample)")
            limit = family.max_seq_len(self.model.kwargs)
            _check(limit is None or seq_len <= limit, "data.seq_len", self.data.seq_len,
                   f"at most {limit} (the context of model '{self.model.name}'), or null")
        else:
            _check(self.data.seq_len is None, "data.seq_len", self.data.seq_len,
                   f"null for a {task} model (tokens per sample are for lm models)")
        if self.data.source in ("text", "jsonl"):
            _check(task == "lm", "data.source", self.data.source, f"a tabular source (parquet, "
                   f"synthetic) for a {task} model; {self.data.source} needs an lm model")
        elif self.data.source == "parquet":
            _check(task != "lm", "data.source", "parquet",
                   "'text', 'jsonl' or 'synthetic' for an lm model (Parquet input is tabular)")
        if self.data.source == "jsonl":
            _check(self.data.tokenizer_for(self.model) is not None, "data.tokenizer", None,
                   f"a local tokenizer folder for data.source jsonl (model '{self.model.name}' "
                   "has no tokenizer of its own)")

    @property
    def seq_len(self) -> int | None:
        """Tokens of context per lm sample: ``data.seq_len``, else the model's own."""
        if self.model.task != "lm":
            return None
        return self.data.seq_len or get_family(self.model.name).default_seq_len(self.model.kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "JobConfig":
        _check(isinstance(data, dict), "config", type(data).__name__, "a mapping of sections")
        unknown = sorted(set(data) - set(_SECTIONS), key=str)
        _check(not unknown, unknown[0] if unknown else "", data.get(unknown[0]) if unknown else None,
               f"no such section; sections are {list(_SECTIONS)}")
        missing = [s for s in ("model", "data", "train", "run") if s not in data]
        _check(not missing, missing[0] if missing else "", None, "a section (required)")
        sections = {name: _build_section(cls_, data.get(name) or {}) for name, cls_ in _SECTIONS.items()}
        return cls(**sections)

    def to_dict(self) -> dict:
        return {name: _section_dict(getattr(self, name)) for name in _SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, overrides: dict[str, Any]) -> "JobConfig":
        """A new config with dotted-path overrides applied and everything revalidated."""
        data = self.to_dict()
        for key, value in overrides.items():
            _set_path(data, key, value)
        return JobConfig.from_dict(data)

    @property
    def global_batch(self) -> int:
        """Samples in one optimizer step over all ranks: ``data.batch_size`` x
        ``train.grad_accum_steps`` x the data-parallel size (the ranks of one TP/PP group
        read the same micro-batches, so it is not ``num_workers`` under TP or PP), or
        ``train.global_batch_size`` while the batch is ``auto``.

        >>> cfg = load_config({"model": {"name": "gpt"}, "data": {"source": "synthetic", "batch_size": 4},
        ...                    "train": {"max_steps": 1, "grad_accum_steps": 2}, "run": {"name": "doc"},
        ...                    "scaling": {"num_workers": 4}, "parallel": {"strategy": "fsdp", "tp_size": 2}})
        >>> cfg.global_batch  # 4 x 2 x (4 workers / tp 2)
        16
        """
        d, t = self.data, self.train
        if isinstance(d.batch_size, int):
            return d.batch_size * t.grad_accum_steps * ParallelDims.from_config(self).dp
        assert t.global_batch_size is not None, "validation requires it with data.batch_size auto"
        return t.global_batch_size

    def summary(self) -> str:
        t, d, s = self.train, self.data, self.scaling
        stop = " / ".join(x for x in (
            f"{t.max_steps} steps" if t.max_steps else "", f"{t.epochs} epochs" if t.epochs else "") if x)
        global_batch = self.global_batch
        lora = self.model.lora
        adapters = (f" with LoRA r {lora['r']} on {', '.join(lora['target_modules'])} (only the adapters train)"
                    if lora else "")
        par = self.parallel
        split = [x for x in (f"tp {par.tp_size}" if par.tp_size > 1 else "",
                             f"pp {par.pp_size} {par.pp_schedule}" if par.pp_size > 1 else "") if x]
        blocks = " and ".join(done for name, (_, done) in par.BLOCK_OPTIONS.items() if getattr(par, name))
        return (f"run '{self.run.name}': model {self.model.name} ({self.model.task}){adapters} on {d.source} data; "
                f"{par.strategy} x {s.num_workers} worker(s) "
                f"{f'(elastic, from {s.min_workers}) ' if s.elastic else ''}"
                f"({', '.join([*split, 'GPU' if s.use_gpu else 'CPU'])})"
                f"{f'; blocks {blocks}' if blocks else ''}; micro-batch {d.batch_size} x accum "
                f"{t.grad_accum_steps} = global batch {global_batch}; {stop}; "
                f"run dir {self.run.run_dir}")


def _validate_parallel_dims(cfg: JobConfig) -> None:
    """The checks that need several sections: sizes multiply to the workers, and the
    model's family can split it that way. Each failure is one line naming the numbers."""
    par, n = cfg.parallel, cfg.scaling.num_workers
    tp, pp = par.tp_size, par.pp_size
    _check(n % (tp * pp) == 0, "scaling.num_workers", n,
           f"a multiple of parallel.tp_size ({tp}) x parallel.pp_size ({pp}) = {tp * pp} "
           f"(data-parallel size = num_workers / (tp_size x pp_size) = {n}/{tp * pp} must be whole)")
    if tp * pp == 1:
        return
    _check(cfg.model.lora is None, "parallel.tp_size" if tp > 1 else "parallel.pp_size", tp if tp > 1 else pp,
           "1 with model.lora (LoRA adapters have no tensor-parallel or pipeline plan: use fsdp or ddp)")
    dp = n // (tp * pp)
    stages = pp * PP_SCHEDULES[par.pp_schedule]
    family = get_family(cfg.model.name)
    _check(not par.sequence_parallel or family.sequence_parallel, "parallel.sequence_parallel", True,
           f"false for model '{cfg.model.name}' (its forward computes positions from the sequence shard it "
           "holds; TP without sequence parallelism works)")
    family.check_model_parallel(cfg.model.kwargs, tp=tp, pp=pp, stages=stages, pp_split=par.pp_split)
    _check(tp == 1 or pp == 1, "parallel.pp_size", pp,
           f"1 when parallel.tp_size is {tp} (TP x PP in one job is not supported; use one of them)")
    _check(par.strategy != "ddp" or tp == 1 or dp == 1, "parallel.strategy", par.strategy,
           f"'fsdp' for data parallel over tensor-parallel groups (tp_size {tp} x dp {dp}: TP x FSDP)")
    if pp > 1:
        _validate_pipeline(cfg)


def _validate_pipeline(cfg: JobConfig) -> None:
    par, batch = cfg.parallel, cfg.data.batch_size
    micro = par.pp_microbatches or par.pp_size
    _check(batch == "auto" or batch % micro == 0, "parallel.pp_microbatches", micro,
           f"a divisor of data.batch_size ({batch}): each micro-batch is cut into equal pipeline chunks")
    _check(par.pp_schedule == "gpipe" or micro >= par.pp_size, "parallel.pp_microbatches", micro,
           f"at least parallel.pp_size ({par.pp_size}) for {par.pp_schedule}")
    if par.pp_schedule == "interleaved_1f1b":
        _check(micro % par.pp_size == 0, "parallel.pp_microbatches", micro,
               f"a multiple of parallel.pp_size ({par.pp_size}) for interleaved_1f1b")


def _section_dict(section: Any) -> dict:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def _build_section(cls: type[_Section], data: Any) -> Any:
    section = cls.SECTION
    _check(isinstance(data, dict), section, data, "a mapping of keys to values")
    if hasattr(cls, "normalize"):  # a section's shorthand forms, e.g. elastic num_workers
        data = cls.normalize(data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        _check(key in fields, f"{section}.{key}", data[key],
               f"no such key; {section} keys are {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            try:
                kwargs[name] = _coerce(f"{section}.{name}", data[name], hints[name])
            except ConfigError as exc:  # a field's own words for what it takes, where it has them
                allowed = getattr(cls, "_ALLOWED", {}).get(name)
                raise (ConfigError(exc.field, exc.value, allowed) if allowed else exc) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{section}.{name}", None, "a value (required)")
    return cls(**kwargs)


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against a type hint; ints widen to float, nothing else is guessed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        allowed = []
        for option in inner:  # the first type that takes the value (int before str: 8 stays 8)
            try:
                return _coerce(path, value, option)
            except ConfigError as exc:
                allowed.append(exc.allowed)
        raise ConfigError(path, value, " or ".join(allowed) + (" or null" if type(None) in args else ""))
    if tp is bool:
        _check(isinstance(value, bool), path, value, "true or false")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), path, value, "an integer")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok and value == value and abs(value) != float("inf"), path, value, "a finite number")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), path, value, "a string")
        return value
    if origin is list:
        _check(isinstance(value, list), path, value, "a list")
        return [_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        _check(isinstance(value, dict), path, value, "a mapping")
        return dict(value)
    raise TypeError(f"unsupported config type {tp} for {path}")  # a bug in this module


def _set_path(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    _check(len(parts) >= 2 and all(parts), dotted, value, "a dotted path like 'train.lr'")
    node = data
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        _check(isinstance(nxt, dict), dotted, value, f"a path into a mapping ('{part}' is not one)")
        node = nxt
    node[parts[-1]] = value


def add_set_flag(parser: argparse.ArgumentParser,
                 help: str = "override a config field, e.g. --set train.lr=3e-4 (repeatable)") -> None:
    """The ``--set KEY=VALUE`` flag of every command that takes a config (its values, in
    ``args.overrides``, go to `load_config` and `parse_override`)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=3e-4"`` -> ``("train.lr", 0.0003)``; the value is a YAML scalar."""
    key, sep, raw = text.partition("=")
    _check(bool(sep) and bool(key.strip()), "--set", text, "KEY=VALUE, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(key.strip(), raw, f"a YAML value ({str(exc).splitlines()[0]})") from None
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
        value = float(value)  # YAML 1.1 reads "3e-4" as a string; people mean the number
    return key.strip(), value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    for text in overrides or []:
        key, value = parse_override(text)
        _set_path(data, key, value)
    return data


def load_config(source: str | os.PathLike | dict | JobConfig,
                overrides: list[str] | None = None) -> JobConfig:
    """Load a config from a YAML path, a dict or a `JobConfig`, then apply ``--set`` overrides.

    >>> load_config({"model": {"name": "mlp"}, "data": {"source": "synthetic", "batch_size": 8},
    ...              "train": {"max_steps": 5}, "run": {"name": "x"}}, ["train.lr=0.01"]).train.lr
    0.01
    """
    if isinstance(source, JobConfig):
        data = source.to_dict()
    elif isinstance(source, dict):
        data = dict(source)
    else:
        data = read_yaml(Path(source))
        if data is None:
            data = {}
    return JobConfig.from_dict(apply_overrides(data, overrides))


def read_yaml(path: Path, what: str = "config") -> Any:
    """A YAML file's data (``safe_load``: tags that would build Python objects are
    refused), or one `ConfigError` naming `what` and the file: missing, unreadable, not
    UTF-8, or not YAML (with the line)."""
    if not path.is_file():
        raise ConfigError(what, str(path), "an existing YAML file")
    try:
        return yaml.safe_load(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(what, str(path), f"a readable YAML file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(what, str(path), f"a UTF-8 YAML file (byte {exc.start} is not UTF-8)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or "").split())
        detail = f"{where}: {problem}" if problem else where
        raise ConfigError(what, str(path), f"valid YAML (parse error{detail})") from None
