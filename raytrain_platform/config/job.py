"""The root config, `JobConfig`: its sections, the checks that need several of them,
and `load_config`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raytrain_platform.config.parse import build_section, section_dict, set_path, apply_overrides, read_yaml
from raytrain_platform.config.sections import (
    SECTIONS,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TrainConfig,
    check_field,
)
from raytrain_platform.errors import ConfigError
from raytrain_platform.models.registry import get_family
from raytrain_platform.parallel.dims import PP_SCHEDULES, ParallelDims
from raytrain_platform.parallel.registry import STRATEGIES, recompute_dropout_error

__all__ = ["JobConfig", "load_config"]


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
        for name, cls in SECTIONS.items():
            check_field(isinstance(getattr(self, name), cls), name, type(getattr(self, name)).__name__,
                   f"a {cls.__name__}")
        self._check_layout()
        self._check_batch()
        self._check_block_options()
        self._check_model_data()
        self._check_objective()

    def _check_objective(self) -> None:
        """``train.objective: dpo`` trains a language model on preference pairs
        (``data.format: preference``, which no other objective reads), without pipeline
        stages (a pipeline chunk would split a pair); a reference folder must suit the model."""
        t = self.train
        check_field(t.objective == "dpo" or self.data.format != "preference", "data.format", self.data.format,
                    f"not preference with train.objective {t.objective} (preference pairs train with dpo)")
        if t.objective != "dpo":
            return
        check_field(self.model.task == "lm", "train.objective", t.objective,
                    f"'sft' for a {self.model.task} model (dpo tunes a language model: model.task lm)")
        check_field(self.data.format == "preference", "train.objective", t.objective,
                    f"sft for data.format {self.data.format} (dpo trains on data.format preference: pairs)")
        check_field(self.parallel.pp_size == 1, "parallel.pp_size", self.parallel.pp_size,
                    "1 with train.objective dpo (pipeline chunks would split a chosen/rejected pair)")
        if t.dpo.reference != "auto":
            get_family(self.model.name).reference_kwargs(self.model.kwargs, t.dpo.reference)

    def _check_layout(self) -> None:
        """Strategy, model-parallel sizes and workers agree (sizes multiply to the workers)."""
        par = self.parallel
        if par.strategy == "auto":  # decided at launch (plan/auto.py), then validated in full
            for name in ("tp_size", "pp_size"):
                check_field(getattr(par, name) == 1, f"parallel.{name}", getattr(par, name),
                       "1 with parallel.strategy auto (the plan chooses the model-parallel sizes)")
        else:
            strat = STRATEGIES[par.strategy]
            _validate_parallel_dims(self)
            n = ParallelDims.from_config(self).dp  # the strategy spans the data-parallel ranks
            check_field(strat.min_workers <= n and (strat.max_workers is None or n <= strat.max_workers),
                   "scaling.num_workers", self.scaling.num_workers,
                   f"{strat.describe_workers()} per model replica (data-parallel size {n}) for "
                   f"parallel.strategy '{par.strategy}'")
        if self.scaling.elastic:
            check_field(par.tp_size == par.pp_size == 1 and par.strategy in ("ddp", "fsdp", "auto"),
                   "scaling.min_workers", self.scaling.min_workers,
                   "null (fixed size) unless parallel.strategy is ddp, fsdp or auto with tp_size and "
                   "pp_size 1: an elastic worker group changes the data-parallel size only")

    def _check_batch(self) -> None:
        """A global batch given beside the micro-batch equals their product; `auto` needs it."""
        t = self.train
        if self.data.batch_size == "auto":
            check_field(t.global_batch_size is not None, "train.global_batch_size", None,
                   "an integer >= 1 when data.batch_size is auto (samples per optimizer step)")
            check_field(t.grad_accum_steps == 1, "train.grad_accum_steps", t.grad_accum_steps,
                   "1 (unset) when data.batch_size is auto: it is derived from the global batch")
        elif t.global_batch_size is not None:  # given beside an explicit batch: must agree
            dp, product = ParallelDims.from_config(self).dp, self.global_batch  # strategy auto: tp, pp 1
            check_field(t.global_batch_size == product, "train.global_batch_size", t.global_batch_size,
                   f"null, or data.batch_size ({self.data.batch_size}) x train.grad_accum_steps "
                   f"({t.grad_accum_steps}) x data-parallel workers ({dp}) = {product}")

    def _check_block_options(self) -> None:
        """GPU-only FSDP options (and model kwargs, the family says which) need GPUs; checkpointing and compiling need repeated
        blocks; recomputing inside compiled blocks refuses dropout."""
        par, family = self.parallel, get_family(self.model.name)
        for name in ("mixed_precision", "cpu_offload"):
            check_field(self.scaling.use_gpu or not getattr(par, name), f"parallel.{name}",
                   getattr(par, name), "false when scaling.use_gpu is false (GPU-only FSDP option)")
        family.check_devices(self.model.kwargs, use_gpu=self.scaling.use_gpu)
        for name, (verb, _) in par.BLOCK_OPTIONS.items():
            check_field(family.has_blocks or not getattr(par, name), f"parallel.{name}", getattr(par, name),
                   f"false for model '{self.model.name}' (it has no repeated blocks to {verb})")
        if par.compile and par.activation_checkpointing:  # the model's own dropout: parallel/compile.py checks it
            for where, p in (("model.kwargs.dropout", self.model.kwargs.get("dropout")),
                             ("model.lora.dropout", (self.model.lora or {}).get("dropout"))):
                if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                    raise recompute_dropout_error(f"{where} = {p}")

    def _check_model_data(self) -> None:
        """The model's task decides the sources and whether ``data.seq_len`` applies."""
        task, family = self.model.task, get_family(self.model.name)
        if task == "lm":
            seq_len = self.seq_len
            if seq_len is None:
                raise ConfigError("data.seq_len", None,
                                  f"an integer >= 1 for the language model '{self.model.name}' (tokens per sample)")
            limit = family.max_seq_len(self.model.kwargs)
            check_field(limit is None or seq_len <= limit, "data.seq_len", self.data.seq_len,
                   f"at most {limit} (the context of model '{self.model.name}'), or null")
        else:
            check_field(self.data.seq_len is None, "data.seq_len", self.data.seq_len,
                   f"null for a {task} model (tokens per sample are for lm models)")
        if self.data.source in ("text", "jsonl", "hf_dataset"):
            check_field(task == "lm", "data.source", self.data.source, f"a tabular source (parquet, "
                   f"synthetic) for a {task} model; {self.data.source} needs an lm model")
        elif self.data.source == "parquet":
            self._check_parquet(task)
        if self.data.reads_records(self.model) or self.data.sources is not None:  # token windows
            what = "data.sources" if self.data.sources is not None else f"data.source {self.data.source}"
            check_field(self.data.tokenizer_for(self.model) is not None, "data.tokenizer", None,
                   f"a local tokenizer folder for {what} (model '{self.model.name}' "
                   "has no tokenizer of its own)")

    def _check_parquet(self, task: str | None) -> None:
        """Parquet is tabular for a classification or regression model, and records of
        ``data.format`` for an lm model: each refuses the other's options."""
        d = self.data
        if task != "lm":
            why = f"for tabular parquet (a {task} model; records of data.format are read for an lm model)"
            check_field(d.format == "text", "data.format", d.format, f"'text' (unset) {why}")
            check_field(d.tokenizer is None, "data.tokenizer", d.tokenizer, f"null {why}")
            check_field(d.packing != "documents", "data.packing", d.packing, f"concat or null {why}")
            return
        why = "for parquet records (an lm model; they hold out data.val_fraction)"
        check_field(d.val_path is None, "data.val_path", d.val_path, f"null {why}")
        check_field(d.feature_columns is None, "data.feature_columns", d.feature_columns,
               "null for parquet records (an lm model reads the columns of data.format)")

    @property
    def seq_len(self) -> int | None:
        """Tokens of context per lm sample: ``data.seq_len``, else the model's own."""
        if self.model.task != "lm":
            return None
        return self.data.seq_len or get_family(self.model.name).default_seq_len(self.model.kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "JobConfig":
        check_field(isinstance(data, dict), "config", type(data).__name__, "a mapping of sections")
        unknown = sorted(set(data) - set(SECTIONS), key=str)
        check_field(not unknown, unknown[0] if unknown else "", data.get(unknown[0]) if unknown else None,
               f"no such section; sections are {list(SECTIONS)}")
        missing = [s for s in ("model", "data", "train", "run") if s not in data]
        check_field(not missing, missing[0] if missing else "", None, "a section (required)")
        sections = {name: build_section(cls_, data.get(name) or {}) for name, cls_ in SECTIONS.items()}
        return cls(**sections)

    def to_dict(self) -> dict:
        return {name: section_dict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, overrides: dict[str, Any]) -> "JobConfig":
        """A new config with dotted-path overrides applied and everything revalidated."""
        data = self.to_dict()
        for key, value in overrides.items():
            set_path(data, key, value)
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
        targets: Any = lora["target_modules"] if lora else ""  # all-linear until resolve_job names them
        names = targets if isinstance(targets, str) else ", ".join(targets)
        adapters = f" with LoRA r {lora['r']} on {names} (only the adapters train)" if lora else ""
        par = self.parallel
        split = [x for x in (f"tp {par.tp_size}" if par.tp_size > 1 else "",
                             f"pp {par.pp_size} {par.pp_schedule}" if par.pp_size > 1 else "") if x]
        blocks = " and ".join(done for name, (_, done) in par.BLOCK_OPTIONS.items() if getattr(par, name))
        dpo = (f"; dpo ({t.dpo.loss}, beta {t.dpo.beta}, reference "
               f"{'precomputed' if t.dpo.precompute_reference else t.dpo.reference})"
               if t.objective == "dpo" else "")
        return (f"run '{self.run.name}': model {self.model.name} ({self.model.task}){adapters} on {d.source} data; "
                f"{par.strategy} x {s.num_workers} worker(s) "
                f"{f'(elastic, from {s.min_workers}) ' if s.elastic else ''}"
                f"({', '.join([*split, 'GPU' if s.use_gpu else 'CPU'])})"
                f"{f'; blocks {blocks}' if blocks else ''}; micro-batch {d.batch_size} x accum "
                f"{t.grad_accum_steps} = global batch {global_batch}{dpo}; {stop}; "
                f"run dir {self.run.run_dir}")


def _validate_parallel_dims(cfg: JobConfig) -> None:
    """The checks that need several sections: sizes multiply to the workers, and the
    model's family can split it that way. Each failure is one line naming the numbers."""
    par, n = cfg.parallel, cfg.scaling.num_workers
    tp, pp = par.tp_size, par.pp_size
    check_field(n % (tp * pp) == 0, "scaling.num_workers", n,
           f"a multiple of parallel.tp_size ({tp}) x parallel.pp_size ({pp}) = {tp * pp} "
           f"(data-parallel size = num_workers / (tp_size x pp_size) = {n}/{tp * pp} must be whole)")
    if tp * pp == 1:
        return
    check_field(cfg.model.lora is None, "parallel.tp_size" if tp > 1 else "parallel.pp_size", tp if tp > 1 else pp,
           "1 with model.lora (LoRA adapters have no tensor-parallel or pipeline plan: use fsdp or ddp)")
    dp = n // (tp * pp)
    stages = pp * PP_SCHEDULES[par.pp_schedule]
    family = get_family(cfg.model.name)
    check_field(not par.sequence_parallel or family.sequence_parallel, "parallel.sequence_parallel", True,
           f"false for model '{cfg.model.name}' (its forward computes positions from the sequence shard it "
           "holds; TP without sequence parallelism works)")
    family.check_model_parallel(cfg.model.kwargs, tp=tp, pp=pp, stages=stages, pp_split=par.pp_split)
    check_field(par.strategy != "ddp" or tp == 1 or dp == 1, "parallel.strategy", par.strategy,
           f"'fsdp' for data parallel over tensor-parallel groups (tp_size {tp} x dp {dp}: TP x FSDP)")
    if pp > 1:
        _validate_pipeline(cfg)


def _validate_pipeline(cfg: JobConfig) -> None:
    par, batch = cfg.parallel, cfg.data.batch_size
    micro = par.pp_microbatches or par.pp_size
    check_field(batch == "auto" or batch % micro == 0, "parallel.pp_microbatches", micro,
           f"a divisor of data.batch_size ({batch}): each micro-batch is cut into equal pipeline chunks")
    check_field(par.pp_schedule == "gpipe" or micro >= par.pp_size, "parallel.pp_microbatches", micro,
           f"at least parallel.pp_size ({par.pp_size}) for {par.pp_schedule}")
    if par.pp_schedule == "interleaved_1f1b":
        check_field(micro % par.pp_size == 0, "parallel.pp_microbatches", micro,
               f"a multiple of parallel.pp_size ({par.pp_size}) for interleaved_1f1b")


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
