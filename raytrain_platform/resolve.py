"""Turn a validated config into a runnable job: look at the data (sizes, columns)
without reading it, let the model's family fill in what the config left to the data
(the MLP's input and output sizes) and check what it can before Ray starts (a user
builder imports and returns a module; a tokenizer loads and fits the model's
embeddings and positions; every JSONL line parses), and check that the data can feed
one optimizer step on every rank.

Everything here happens before any Ray resource is requested; no Ray, and torch only
for a user builder's check.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

from raytrain_platform.config import JobConfig
from raytrain_platform.data.encode import check_fits
from raytrain_platform.data.prepared import check_cache_root
from raytrain_platform.data.sources import DataInfo, SourceSpec, describe
from raytrain_platform.errors import ConfigError, DataError
from raytrain_platform.models.family import ModelFamily
from raytrain_platform.models.lora import resolve_targets
from raytrain_platform.models.registry import get_family
from raytrain_platform.parallel.dims import ParallelDims
from raytrain_platform.plan.auto import Hardware, has_auto, local_hardware, resolve_auto

__all__ = ["ResolvedJob", "resolve_job"]


@dataclass(frozen=True)
class ResolvedJob:
    config: JobConfig
    data: DataInfo
    steps_per_epoch: int  # optimizer steps in one pass over the training split
    total_steps: int  # what the LR schedule spans
    notes: tuple[str, ...] = ()  # what the `auto` fields became, and why (plan/auto.py)
    warnings: tuple[str, ...] = ()  # what the run goes on without (an empty validation split)

    @property
    def global_batch(self) -> int:
        """Samples in one optimizer step over all ranks (`JobConfig.global_batch`)."""
        return self.config.global_batch

    def at_world_size(self, world: int) -> "ResolvedJob":
        """This job on the `world` workers an elastic run got: accumulation makes up the
        missing workers, so the global batch, the steps per epoch and the LR schedule are
        the run's own (resolve_job checked the division for every size in range)."""
        s, t = self.config.scaling, self.config.train
        if world == s.num_workers:
            return self
        assert s.min_workers is not None, "only an elastic run gets another worker count"
        accum = t.grad_accum_steps * s.num_workers // world
        cfg = self.config.replace({"scaling.num_workers": world, "scaling.min_workers": min(s.min_workers, world),
                                   "train.grad_accum_steps": accum, "train.global_batch_size": None})
        return dataclasses.replace(self, config=cfg)

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "data": dataclasses.asdict(self.data),
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                "notes": list(self.notes), "warnings": list(self.warnings)}

    @classmethod
    def from_dict(cls, d: dict) -> "ResolvedJob":
        data = dict(d["data"])
        data["feature_columns"] = tuple(data.get("feature_columns", ()))
        return cls(config=JobConfig.from_dict(d["config"]), data=DataInfo(**data),
                   steps_per_epoch=d["steps_per_epoch"], total_steps=d["total_steps"],
                   notes=tuple(d.get("notes", ())), warnings=tuple(d.get("warnings", ())))


def resolve_job(cfg: JobConfig, hardware: "Hardware | None" = None, *,
                start_ray: Callable[[], None] | None = None) -> ResolvedJob:
    """Raises `DataError` / `ConfigError` with one line naming the problem.

    ``auto`` fields are decided here, on `hardware` (the cluster's, from the launcher)
    or, without it, on this machine (plan/auto.py). A tokenized source is tokenized once
    (data/tokenize_pass.py), after every other check: on Ray where `start_ray` is given
    (it connects or starts it) or this process is connected, else in this process."""
    family = get_family(cfg.model.name)
    tokenizer = cfg.data.tokenizer
    if tokenizer and not os.path.isabs(tokenizer):  # Ray's tasks do not share this working directory
        cfg = cfg.replace({"data.tokenizer": os.path.abspath(os.path.expanduser(tokenizer))})
    cfg = _resolve_packing(cfg, family)
    spec = SourceSpec.from_config(cfg)
    if spec.tokenized:  # the tokenizer loads, has what the format needs and fits the model
        for part in spec.parts or (spec,):  # a mixture: each of its sources
            check_fits(part.token_spec(), vocab_size=family.vocab_size(cfg.model.kwargs),
                       max_positions=family.max_seq_len(cfg.model.kwargs))
        assert spec.cache_root
        check_cache_root(spec.cache_root)
    # Tabular sources are looked at first (their shape fills the model's sizes); a
    # tokenized one last, after every check that needs no data.
    info = None if spec.tokenized else describe(spec)
    if info is not None:
        cfg = _fill_from_data(cfg, family, info)
    # User builders: imported, called with their kwargs on the meta device (no memory).
    needs_blocks = next(iter(cfg.parallel.block_options_set()), None)
    family.precheck(cfg.model.kwargs, block_class=cfg.model.block_class, needs_blocks=needs_blocks)
    if cfg.model.lora is not None:  # every target names linear modules (a meta-device build: no memory)
        # the default, peft's all-linear, becomes the names it picks on this model: the summary shows them
        lora = resolve_targets(family.build(cfg.model.kwargs, device="meta"), cfg.model.lora,
                               model_name=cfg.model.name)
        if lora != cfg.model.lora:
            cfg = cfg.replace({"model.lora": lora})
    if info is None:
        if start_ray is not None:
            start_ray()
        info = describe(spec)
    notes: list[str] = []
    if has_auto(cfg):
        cfg, notes = resolve_auto(cfg, hardware or local_hardware(cfg))
    # Data-parallel ranks: the ranks of one TP/PP group read the same micro-batches.
    world, batch, accum = ParallelDims.from_config(cfg).dp, cfg.data.micro_batch, cfg.train.grad_accum_steps
    ranks = (f"scaling.num_workers ({world})" if world == cfg.scaling.num_workers else
             f"data-parallel ranks ({world}: scaling.num_workers {cfg.scaling.num_workers} / "
             f"(tp_size x pp_size))")
    if info.num_train == 0:
        raise DataError(f"data.source = {cfg.data.source!r}: the training split is empty")
    # Each epoch deals whole rounds of one micro-batch per rank (see data/ray_data.py);
    # unsplit, every rank reads the whole split.
    rounds = info.num_train // ((world if cfg.data.split_across_workers else 1) * batch)
    steps_per_epoch = rounds // accum
    if steps_per_epoch == 0:
        raise DataError(
            f"the training split has {info.num_train} rows, fewer than one optimizer step needs: "
            f"{ranks} x data.batch_size ({batch}) x train.grad_accum_steps ({accum}) = {cfg.global_batch}")
    # A validation split smaller than a round of micro-batches is evaluated as it is
    # (data/dealing.py deal_eval); an empty one is said once, and the run trains on.
    warnings = _val_warnings(cfg, info.num_val)
    if cfg.scaling.elastic:
        _check_elastic(cfg)
    limits = []
    if cfg.train.max_steps:
        limits.append(cfg.train.max_steps)
    if cfg.train.epochs:
        limits.append(cfg.train.epochs * steps_per_epoch)
    return ResolvedJob(config=cfg, data=info, steps_per_epoch=steps_per_epoch, total_steps=min(limits),
                       notes=tuple(notes), warnings=warnings)


def _fill_from_data(cfg: JobConfig, family: ModelFamily, info: DataInfo) -> JobConfig:
    """The config with what the model's family fills in from the data (an MLP's sizes)."""
    kwargs = family.fill_from_data(cfg.model.kwargs, num_features=info.num_features,
                                   num_classes=info.num_classes, task=cfg.model.resolved_task)
    return cfg.replace({"model.kwargs": kwargs}) if kwargs != cfg.model.kwargs else cfg


def _val_warnings(cfg: JobConfig, num_val: int) -> tuple[str, ...]:
    """The sentence for a validation split that was asked for and has no sample; a
    `DataError` for one a pipeline cannot evaluate (less than one whole micro-batch: its
    stages have fixed shapes)."""
    d = cfg.data
    if not (d.val_fraction > 0 or d.val_path):
        return ()
    asked = f"data.val_path {d.val_path!r}" if d.val_path else f"data.val_fraction {d.val_fraction}"
    if num_val == 0:
        return (f"warning: the validation split ({asked}) has no samples; training goes on without "
                "evaluation",)
    if cfg.parallel.pp_size > 1 and num_val < d.micro_batch:
        raise DataError(f"the validation split has {num_val} rows, fewer than one micro-batch "
                        f"(data.batch_size {d.micro_batch}) for pipeline stages of fixed shape; raise "
                        f"{asked.split()[0]}, or set data.val_fraction to 0 to skip validation")
    return ()


def _resolve_packing(cfg: JobConfig, family: ModelFamily) -> JobConfig:
    """The config with ``data.packing`` set: documents (the default for jsonl
    prompt_completion and chat) needs a model that takes position ids and no pipeline
    stages; where unset, concat instead, and a ConfigError where asked for."""
    packing = cfg.data.resolved_packing
    if packing == "documents":
        why = None
        if cfg.parallel.pp_size > 1:
            why = "parallel.pp_size > 1 (the pipeline's stages pass no position ids)"
        elif not family.takes_position_ids(cfg.model.kwargs):
            why = (f"model '{cfg.model.name}' (its forward is not shown to keep packed documents apart "
                   "by their position ids)")
        if why is not None and cfg.data.packing is not None:
            raise ConfigError("data.packing", "documents", f"concat for {why}")
        packing = "concat" if why is not None else packing
    return cfg if cfg.data.packing == packing else cfg.replace({"data.packing": packing})


def _check_elastic(cfg: JobConfig) -> None:
    """Every worker count an elastic run may get must keep the global batch: the
    accumulation it then needs, grad_accum_steps x max / n, is a whole number."""
    import math

    lo, hi, accum = cfg.scaling.min_workers, cfg.scaling.num_workers, cfg.train.grad_accum_steps
    assert lo is not None, "called for elastic runs, which have min_workers"
    bad = [n for n in range(lo, hi + 1) if (accum * hi) % n]
    if bad:
        need = math.lcm(*range(lo, hi + 1))
        fix = need // math.gcd(need, hi)
        raise ConfigError("train.grad_accum_steps", accum,
                          f"a multiple of {fix}: with scaling.num_workers from {lo} to {hi}, "
                          f"grad_accum_steps x {hi} must divide by every worker count, so the global "
                          f"batch stays the same on {bad[0]} worker(s)")
