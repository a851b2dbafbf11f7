"""The six sections of a job config: model, data, train, parallel, scaling, run. Each
is a dataclass that checks its own fields in ``__post_init__``; what needs several
sections at once is `job.JobConfig`'s."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.family import TASKS
from raytrain_platform.models.lora import resolve_lora
from raytrain_platform.models.registry import get_family
from raytrain_platform.parallel.dims import PP_SCHEDULES
from raytrain_platform.parallel.registry import STRATEGIES, strategy_names
from raytrain_platform.units import parse_size

__all__ = ["ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig", "ScalingConfig", "RunConfig",
           "TRACKERS"]

_REQUIRED: Any = dataclasses.MISSING
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "$" lets a final newline in
MAX_SYNTHETIC = 100_000_000
SEED_LIMIT = 2**32  # numpy's and every generator's range; torch takes it too
SEED_ALLOWED = "an integer from 0 to 2**32 - 1"
# Experiment trackers `run.tracking` accepts; raytrain_platform/tracking/ implements each.
TRACKERS: tuple[str, ...] = ("mlflow", "tensorboard")
MAX_TORCH_THREADS = 4096  # torch.set_num_threads takes a C int; no machine has more cores


def _check(ok: bool, path: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(path, value, allowed)


@dataclass
class ModelConfig:
    """`name` is a model family (`gpt`, `mlp`, `hf`; models/registry.py) or an import path
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
    val_fraction: float = 0.05  # held out by a hash of each sample's file and place (data/sources.py)
    num_samples: int = 4096  # synthetic
    num_features: int = 16  # synthetic tabular
    num_classes: int = 4  # synthetic classification
    seed: int = 0  # synthetic generator
    glob: str = "**/*.py"  # text: which files under path
    # lm: tokens of context per sample (each sample holds seq_len + 1 tokens: the targets
    # are the inputs shifted by one). Default: the model's context (gpt: block_size; hf:
    # max_position_embeddings, at most 2048).
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
    # jsonl: how documents fill the windows of seq_len + 1 tokens. documents: whole, each
    # apart (its own positions from 0 and attention to itself alone, through position
    # ids; best-fit packed, the rest padded; one longer than a window is truncated, and
    # the count says how many); concat: one stream cut into windows (a document may
    # span two, and attends to those before it). Default: documents for prompt_completion
    # and chat where the model takes position ids (hf), else concat (data/packing.py)
    packing: Union[str, None] = None

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
        _check(self.val_path is None or self.source == "parquet", "data.val_path", self.val_path,
               f"null for data.source {self.source} (a separate validation path is read for parquet; "
               "the other sources hold out data.val_fraction)")
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
        _check(self.packing in (None, "documents", "concat"), "data.packing", self.packing,
               "documents, concat, or null (documents for jsonl prompt_completion and chat)")
        _check(self.packing != "documents" or self.source == "jsonl", "data.packing", self.packing,
               f"concat for data.source {self.source} (documents packs jsonl records)")
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

    @property
    def resolved_packing(self) -> str:
        """``packing``, or where unset the format's default: documents for jsonl
        prompt_completion and chat, concat otherwise (resolve_job sets it to concat for a
        model that takes no position ids).

        >>> DataConfig(source="jsonl", path="d", format="chat", batch_size=8).resolved_packing
        'documents'
        """
        if self.packing is not None:
            return self.packing
        return "documents" if self.source == "jsonl" and self.format != "text" else "concat"

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
    # stops once more than max_nonfinite_skips steps in a row are skipped.
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
        _check(self.torch_threads is None or 1 <= self.torch_threads <= MAX_TORCH_THREADS, "scaling.torch_threads",
               self.torch_threads, f"an integer from 1 to {MAX_TORCH_THREADS} or null")

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
