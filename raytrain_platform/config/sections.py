"""The six sections of a job config: model, data, train, parallel, scaling, run. Each
is a dataclass that checks its own fields in ``__post_init__``; what needs several
sections at once is `job.JobConfig`'s. The string below each field documents it for users:
config/docs.py turns those into docs/configuration.md. The model, data and train
sections have their own modules (`model_section`, `data_section`, `train_section`); the
parallel, scaling and run sections are here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import ClassVar, Union

from raytrain_platform.config.data_section import DataConfig, SourceEntry
from raytrain_platform.config.fields import MAX_MIX_SOURCES, REQUIRED, check_field
from raytrain_platform.config.model_section import ModelConfig
from raytrain_platform.config.train_section import DpoConfig, TrainConfig
from raytrain_platform.parallel.dims import PP_SCHEDULES
from raytrain_platform.parallel.registry import STRATEGIES, strategy_names
from raytrain_platform.units import parse_size

__all__ = ["ModelConfig", "DataConfig", "DpoConfig", "TrainConfig", "ParallelConfig", "ScalingConfig", "RunConfig",
           "SECTIONS", "SECTION_MODULES", "Section", "SourceEntry", "TRACKERS", "MAX_MIX_SOURCES", "check_field"]

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "$" lets a final newline in
# Experiment trackers `run.tracking` accepts; raytrain_platform/tracking/ implements each.
TRACKERS: tuple[str, ...] = ("mlflow", "tensorboard")
MAX_TORCH_THREADS = 4096  # torch.set_num_threads takes a C int; no machine has more cores


@dataclass
class ParallelConfig:
    SECTION: ClassVar[str] = "parallel"
    strategy: str = "none"
    """`none` (exactly 1 worker), `ddp`, `fsdp`, or `auto` (the decision guide picks, for the cluster it runs
    on: see [plan-and-doctor.md](plan-and-doctor.md#let-the-plan-decide-auto)); an unknown name lists the
    known ones."""
    ddp_bucket_cap_mb: float = 25.0
    """DDP gradient bucket size."""
    find_unused_parameters: bool = False
    """DDP: for models whose forward skips parameters."""
    # FSDP only (parallel/fsdp.py). mixed_precision and cpu_offload need GPUs: rejected on CPU.
    mixed_precision: bool = False  # bf16 parameters in forward/backward, fp32 gradient reduction
    """FSDP on GPU: bf16 parameters, fp32 gradient reduction."""
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3)
    """FSDP: free gathered parameters after forward (ZeRO-3); false keeps them until backward (ZeRO-2-like,
    more memory, less communication)."""
    cpu_offload: bool = False  # sharded parameters, gradients, optimizer state in host memory
    """FSDP on GPU: keep sharded parameters, gradients and optimizer state in host memory."""
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    """Recompute each block's activations in backward; any model with repeated blocks (`gpt`, `hf`, user
    models; not `mlp`), on every layout: `none`, `ddp`, `fsdp`, TP (x FSDP) and pipeline stages; with
    `parallel.compile`, inside each compiled block's graph."""
    compile: bool = False  # torch.compile each repeated block (parallel/compile.py)
    """`torch.compile` (TorchInductor) each repeated block in place, after TP shards it and before DDP/FSDP
    wrap it; any model with repeated blocks, on every layout. The first step compiles; a CPU worker needs a
    C++ compiler (`$CXX`, else `g++`), a GPU worker Triton. See
    [parallelism.md](parallelism.md#compiled-blocks-parallelcompile)."""
    # Model parallelism (gpt, hf; parallel/dims.py): data-parallel size = num_workers / (tp x pp).
    tp_size: int = 1  # tensor-parallel ranks per model replica (heads split across them)
    """`gpt`, or an `hf` architecture whose transformers config has a `base_model_tp_plan` (not gpt2, opt):
    tensor-parallel ranks per model replica (must divide the heads, and the kv heads). The data-parallel size
    is `scaling.num_workers / (tp_size x pp_size)`; `strategy` is the data-parallel layer over it (`fsdp` for
    TP x FSDP)."""
    pp_size: int = 1  # pipeline-parallel ranks (stages) per model replica
    """`gpt`, or an `hf` architecture with a `base_model_pp_plan` whose stages are shown to give transformers'
    logits (`PIPELINE_TYPES` in models/hf_pipeline.py), tied embeddings included: pipeline stages (ranks) per
    model replica; `strategy: ddp` or `fsdp` on top gives PP x DP; with `tp_size` > 1
    too, each stage is tensor parallel (TP x PP, and `fsdp` on top for 3-D)."""
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    """`gpipe`, `1f1b`, `interleaved_1f1b` (2 stages per rank)."""
    pp_microbatches: Union[int, None] = None  # pipeline chunks per micro-batch; default pp_size
    """Pipeline chunks each micro-batch is cut into (default: `pp_size`); divides `data.batch_size`, at least
    `pp_size` for the 1F1B schedules, and a multiple of `pp_size` for `interleaved_1f1b`."""
    pp_split: Union[list[int], None] = None  # blocks (decoder layers) per stage; default balanced
    """Blocks per stage, e.g. `[1, 3]` (default: balanced); one entry per stage (2 x `pp_size` for
    interleaved), summing to `n_layer` (`num_hidden_layers` for `hf`)."""
    sequence_parallel: bool = False  # TP: norms and dropout on sequence shards
    """TP: layer norms and dropout run on sequence shards (activation memory / tp). Refused for `hf` before
    launch (transformers builds its rotary positions from the sequence shard a rank holds)."""

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
        check_field(self.strategy in STRATEGIES or self.strategy == "auto", "parallel.strategy",
               self.strategy, f"one of {strategy_names()} or 'auto' (chosen by the plan at launch)")
        check_field(self.ddp_bucket_cap_mb > 0, "parallel.ddp_bucket_cap_mb", self.ddp_bucket_cap_mb,
               "a number > 0")
        for name in ("tp_size", "pp_size"):
            check_field(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "an integer >= 1")
        check_field(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
               f"one of {list(PP_SCHEDULES)}")
        check_field(self.pp_microbatches is None or self.pp_microbatches >= 1, "parallel.pp_microbatches",
               self.pp_microbatches, "an integer >= 1 or null")
        check_field(self.pp_split is None or all(n >= 1 for n in self.pp_split), "parallel.pp_split",
               self.pp_split, "a list of block counts >= 1, or null")
        check_field(self.tp_size > 1 or not self.sequence_parallel, "parallel.sequence_parallel",
               self.sequence_parallel, "false unless parallel.tp_size > 1")
        if self.strategy not in ("fsdp", "auto"):
            for name, default in self._FSDP_ONLY.items():
                check_field(getattr(self, name) == default, f"parallel.{name}", getattr(self, name),
                       f"{str(default).lower()} unless parallel.strategy is 'fsdp'")


@dataclass
class ScalingConfig:
    SECTION: ClassVar[str] = "scaling"
    num_workers: int = 1
    """Training workers (one process each, one GPU each with `use_gpu`); `{min: M, max: N}` for an elastic run
    (stored as `num_workers: N`, `min_workers: M`)."""
    use_gpu: bool = False
    """GPUs and nccl; otherwise CPUs and gloo."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker. Keep `num_workers x cpus_per_worker` at least 0.5 below the cluster's CPUs, or
    Ray Data has none left to read with (rejected up front)."""
    torch_threads: Union[int, None] = None  # intra-op threads per worker; default from CPUs
    """Intra-op threads per worker, 1 to 4,096 (default: `floor(cpus_per_worker)`, at least 1)."""
    memory_budget: Union[str, None] = None  # per CPU worker, for the auto fields, e.g. "4GiB"
    """CPU workers: memory per worker the `auto` fields plan against, e.g. `4GiB` (default: 80% of a node's
    memory shared by its workers); GPUs use the device's memory."""
    min_workers: Union[int, None] = None
    """Elastic: Ray starts with what the cluster has from `min_workers` up to `num_workers`, and restarts
    smaller after a lost node; accumulation keeps the global batch (`grad_accum_steps x num_workers` must
    divide by every count in between). ddp, fsdp or auto, with `tp_size` and `pp_size` 1."""
    placement_strategy: str = "PACK"  # Ray placement group: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    """Ray placement group of the workers: `PACK`, `SPREAD` (one node each where possible), `STRICT_PACK`,
    `STRICT_SPREAD`."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

    @classmethod
    def normalize(cls, data: dict) -> dict:
        """``num_workers: {min: m, max: M}`` -> ``num_workers: M, min_workers: m``."""
        n = data.get("num_workers")
        if not isinstance(n, dict):
            return data
        check_field(set(n) == {"min", "max"} and all(isinstance(v, int) and not isinstance(v, bool)
                                                 for v in n.values()),
               "scaling.num_workers", n, "an integer >= 1, or {min: M, max: N} with integers (elastic)")
        check_field("min_workers" not in data, "scaling.min_workers", data.get("min_workers"),
               "unset when scaling.num_workers is {min, max}")
        return {**data, "num_workers": n["max"], "min_workers": n["min"]}

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    def __post_init__(self) -> None:
        check_field(self.min_workers is None or 1 <= self.min_workers <= self.num_workers,
               "scaling.min_workers", self.min_workers,
               f"null or an integer from 1 to scaling.num_workers ({self.num_workers})")
        check_field(self.placement_strategy in self._PLACEMENT, "scaling.placement_strategy",
               self.placement_strategy, f"one of {list(self._PLACEMENT)}")
        if self.memory_budget is not None:
            parse_size("scaling.memory_budget", self.memory_budget)
        check_field(self.num_workers >= 1, "scaling.num_workers", self.num_workers, "an integer >= 1")
        check_field(self.cpus_per_worker > 0, "scaling.cpus_per_worker", self.cpus_per_worker,
               "a number > 0")
        check_field(self.torch_threads is None or 1 <= self.torch_threads <= MAX_TORCH_THREADS, "scaling.torch_threads",
               self.torch_threads, f"an integer from 1 to {MAX_TORCH_THREADS} or null")

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_size("scaling.memory_budget", self.memory_budget)


@dataclass
class RunConfig:
    SECTION: ClassVar[str] = "run"
    name: str = REQUIRED
    """The run directory's name under `storage_path`; the same name again resumes."""
    storage_path: str = "./runs"  # local folder (or shared mount) holding run directories
    """Local folder, shared mount or URI holding run directories; `rtp validate` and `rtp train` check, before
    Ray, that a folder exists or can be created and is writable (a URI: that its pyarrow filesystem
    resolves)."""
    checkpoint_every: int = 50  # optimizer steps between checkpoints; 0 = only at the end
    """Optimizer steps between checkpoints (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept, and always the newest whose loss was finite."""
    max_failures: int = 0  # worker-failure retries (FailureConfig); -1 = unlimited
    """Worker-failure retries from the latest checkpoint (Ray `FailureConfig`); -1 = unlimited."""
    eval_every: int = 50  # optimizer steps between validation passes; 0 = only at the end
    """Optimizer steps between validation passes (and at the end); 0 = only at the end."""
    eval_batches: int = 8  # validation micro-batches per rank per pass
    """Validation micro-batches per data-parallel rank per pass (the ranks of one TP or PP group share them)."""
    log_every: int = 1  # optimizer steps between metric reports
    """Optimizer steps between metric reports (console line, `metrics.jsonl`)."""
    tracking: list[str] = field(default_factory=list)  # any of TRACKERS; none by default
    """Experiment trackers fed at every report: any of `mlflow`, `tensorboard` (see
    [tracking.md](tracking.md))."""
    tracking_uri: Union[str, None] = None
    """MLflow store: `MLFLOW_TRACKING_URI` if set, else `sqlite:///<storage_path>/mlflow.db`; a relative path
    (`mlruns`, `file:./mlruns`, `sqlite:///m.db`) is relative to the directory the driver runs in."""
    experiment: Union[str, None] = None  # MLflow experiment; default "raytrain_platform"
    """MLflow experiment; null = `raytrain_platform`."""
    log_checkpoints: bool = False  # also log the best checkpoint to MLflow (large)
    """Also log the best checkpoint to MLflow (with `mlflow` only; large)."""
    eval_tasks: list[str] = field(default_factory=list)  # lm-evaluation-harness tasks after training
    """lm-evaluation-harness tasks scored at the end of `rtp train` on the final checkpoint (hf models; needs
    the `eval` extra): names of tasks in `eval_include` folders or of lm_eval, or task YAML files; as
    `rtp eval` (see [evaluation.md](evaluation.md)), results in the run's `eval/` folder and trackers."""
    eval_include: list[str] = field(default_factory=list)  # folders of lm_eval task YAML files
    """Folders of lm_eval task YAML files that `eval_tasks` names come from (`rtp eval --include`)."""

    _ALLOWED: ClassVar[dict[str, str]] = {
        "tracking": f"a list of trackers, any of {list(TRACKERS)} (default: none)"}

    @classmethod
    def normalize(cls, data: dict) -> dict:
        """``tracking: mlflow`` (or ``--set run.tracking=mlflow``) -> ``tracking: [mlflow]``;
        ``eval_tasks: a,b`` -> ``[a, b]``."""
        for key in ("eval_tasks", "eval_include"):
            if isinstance(data.get(key), str):
                data = {**data, key: [t.strip() for t in data[key].split(",") if t.strip()]}
        value = data.get("tracking")
        if isinstance(value, str):
            return {**data, "tracking": [value]}
        return {**data, "tracking": []} if "tracking" in data and value is None else data

    def __post_init__(self) -> None:
        check_field(bool(_RUN_NAME.fullmatch(self.name)), "run.name", self.name,
               "1-128 characters of letters, digits, '_', '-', '.' starting with a letter or digit")
        check_field(bool(self.storage_path), "run.storage_path", self.storage_path, "a non-empty path")
        check_field(self.checkpoint_every >= 0, "run.checkpoint_every", self.checkpoint_every,
               "an integer >= 0")
        check_field(self.keep_checkpoints >= 1, "run.keep_checkpoints", self.keep_checkpoints,
               "an integer >= 1")
        check_field(self.max_failures >= -1, "run.max_failures", self.max_failures,
               "an integer >= -1 (-1 = unlimited)")
        check_field(self.eval_every >= 0, "run.eval_every", self.eval_every, "an integer >= 0")
        check_field(self.eval_batches >= 1, "run.eval_batches", self.eval_batches, "an integer >= 1")
        check_field(self.log_every >= 1, "run.log_every", self.log_every, "an integer >= 1")
        self._check_tracking()
        for name in ("eval_tasks", "eval_include"):
            values = getattr(self, name)
            for i, value in enumerate(values):
                check_field(isinstance(value, str) and bool(value.strip()), f"run.{name}[{i}]", value,
                            "a non-empty string" + (" (a task name or task YAML file)" if name == "eval_tasks"
                                                    else " (a folder of task YAML files)"))
        check_field(not self.eval_include or bool(self.eval_tasks), "run.eval_include", self.eval_include,
                    "[] unless run.eval_tasks names tasks")

    def _check_tracking(self) -> None:
        for i, name in enumerate(self.tracking):
            check_field(name in TRACKERS, f"run.tracking[{i}]", name, f"one of {list(TRACKERS)}")
        self.tracking = list(dict.fromkeys(self.tracking))
        for key in ("tracking_uri", "experiment"):
            check_field(getattr(self, key) is None or bool(getattr(self, key).strip()), f"run.{key}",
                   getattr(self, key), "a non-empty string, or null (the default)")
        mlflow = "mlflow" in self.tracking
        check_field(mlflow or not self.log_checkpoints, "run.log_checkpoints", self.log_checkpoints,
               "false unless run.tracking includes mlflow")
        # The default store is a SQLite file in storage_path, which must then be a local path.
        check_field(not mlflow or self.tracking_uri is not None or "://" not in self.storage_path
               or bool(os.environ.get("MLFLOW_TRACKING_URI")), "run.tracking_uri", None,
               f"an MLflow tracking URI when run.storage_path is a URI ({self.storage_path}): "
               "the default SQLite store needs a local storage_path (or set MLFLOW_TRACKING_URI)")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.name)


Section = ModelConfig | DataConfig | TrainConfig | ParallelConfig | ScalingConfig | RunConfig
SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "scaling": ScalingConfig,
    "run": RunConfig,
}
# The modules whose classes document the sections' fields (config/docs.py reads their source).
SECTION_MODULES = ("model_section", "data_section", "train_section", "sections")
