"""`parallel.strategy: auto` and `data.batch_size: auto`: the decision guide (guide.py)
applied to a training config on the hardware it will run on.

- strategy ``auto``: `make_plan` over the job's workers and their memory, and its
  recommendation becomes the config (none, ddp, fsdp, or tp/pp sizes where the
  model's family has those splits);
- micro-batch ``auto`` (with ``train.global_batch_size``): the largest per-worker
  micro-batch the memory model fits under the chosen strategy, and
  ``grad_accum_steps`` = per-replica batch / micro-batch.

The memory is the device's (GPUs) or ``scaling.memory_budget`` per worker (CPUs; by
default a share of the machine's RAM). Every decision comes back as a sentence for
the log. No torch, no Ray: the launcher measures the hardware and passes it in.

>>> from raytrain_platform.config import load_config
>>> cfg = load_config({"model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_embd": 64}},
...     "data": {"source": "synthetic", "batch_size": "auto"},
...     "train": {"max_steps": 5, "global_batch_size": 64}, "parallel": {"strategy": "auto"},
...     "scaling": {"num_workers": 2, "memory_budget": "64MiB"}, "run": {"name": "doc"}})
>>> cfg, why = resolve_auto(cfg, Hardware(device_memory=64 * 2**20, devices_per_node=2))
>>> cfg.parallel.strategy, cfg.data.batch_size, cfg.train.grad_accum_steps
('ddp', 32, 1)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from raytrain_platform.config import JobConfig
from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.dpo import dpo_reference
from raytrain_platform.plan.guide import LABELS, Option, make_plan
from raytrain_platform.plan.lora import model_lora_size
from raytrain_platform.models.family import ModelFamily
from raytrain_platform.models.registry import get_family
from raytrain_platform.models.shapes import ModelShape
from raytrain_platform.parallel.dims import PP_SCHEDULES
from raytrain_platform.units import format_size

__all__ = ["Hardware", "has_auto", "resolve_auto", "local_hardware", "cpu_hardware"]

RAM_SHARE = 0.8  # of a machine's RAM that CPU workers may use together, by default


@dataclass(frozen=True)
class Hardware:
    device_memory: int  # bytes per worker (GPU memory, or the CPU memory budget)
    devices_per_node: int = 1
    nodes: int = 1
    source: str = ""  # where device_memory came from, for the log
    headroom: float = 0.0  # fraction kept free (CUDA context); an explicit budget is used whole

    @classmethod
    def for_workers(cls, workers: int, per_node: int, **kw) -> "Hardware":
        """`workers` devices packed `per_node` to a node; a partly filled last node is
        planned as if all were on one node (the plan wants equal nodes)."""
        per_node = max(1, min(workers, per_node))
        if workers % per_node:
            return cls(devices_per_node=workers, nodes=1, **kw)
        return cls(devices_per_node=per_node, nodes=workers // per_node, **kw)


def has_auto(cfg: JobConfig) -> bool:
    return cfg.parallel.strategy == "auto" or cfg.data.batch_size == "auto"


def cpu_hardware(cfg: JobConfig, *, node_memory: int, workers_per_node: int) -> Hardware:
    """CPU workers: ``scaling.memory_budget`` each, else RAM_SHARE of the node's memory
    split between the workers on it."""
    n = cfg.scaling.num_workers
    per_node = max(1, min(n, workers_per_node))
    if cfg.scaling.memory_budget is not None:
        budget, source = cfg.scaling.memory_budget_bytes, f"scaling.memory_budget {cfg.scaling.memory_budget}"
    else:
        budget = int(node_memory * RAM_SHARE / per_node)
        source = (f"{RAM_SHARE:.0%} of the node's {node_memory / 2**30:.1f} GiB over {per_node} "
                  "worker(s); set scaling.memory_budget to choose")
    return Hardware.for_workers(n, per_node, device_memory=budget, source=source)


def local_hardware(cfg: JobConfig) -> Hardware:
    """This machine as the whole cluster (`rtp validate`, the torchrun core)."""
    if cfg.scaling.use_gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("parallel.strategy" if cfg.parallel.strategy == "auto" else "data.batch_size",
                              "auto", "an explicit value here: this machine has no GPU to size it "
                              "against (`rtp train` asks the cluster's GPUs)")
        mem = torch.cuda.get_device_properties(0).total_memory
        return Hardware.for_workers(cfg.scaling.num_workers, torch.cuda.device_count(),
                                    device_memory=mem, headroom=0.1,
                                    source=f"{torch.cuda.get_device_name(0)}, {mem / 2**30:.1f} GiB")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cpu_hardware(cfg, node_memory=ram, workers_per_node=cfg.scaling.num_workers)


def _shape(cfg: JobConfig) -> ModelShape:
    try:
        return get_family(cfg.model.name).shape(cfg.model.kwargs, seq_len=cfg.seq_len)
    except ConfigError as exc:
        raise ConfigError("parallel.strategy" if cfg.parallel.strategy == "auto" else "data.batch_size",
                          "auto", f"an explicit value for model '{cfg.model.name}': the memory model "
                          f"needs {exc.allowed}") from None


# plan option -> config fields, given the option's layout
def _strategy_fields(opt: Option) -> dict[str, str | int]:
    lay = opt.fitted_layout
    replicated = "none" if lay.dp == 1 else "ddp"
    fields: dict[str, dict[str, str | int]] = {
        "none": {"parallel.strategy": "none"}, "accum": {"parallel.strategy": "none"},
        "ddp": {"parallel.strategy": "ddp"}, "fsdp": {"parallel.strategy": "fsdp"},
        "tp": {"parallel.strategy": replicated, "parallel.tp_size": lay.tp},
        "pp": {"parallel.strategy": replicated, "parallel.pp_size": lay.pp},
        "tp_fsdp": {"parallel.strategy": "fsdp", "parallel.tp_size": lay.tp},
        "pp_dp": {"parallel.strategy": "ddp", "parallel.pp_size": lay.pp},
        "tp_pp": {"parallel.strategy": "none" if lay.dp == 1 else "fsdp", "parallel.tp_size": lay.tp,
                  "parallel.pp_size": lay.pp}}
    return fields[opt.strategy]


def _option_for(cfg: JobConfig, plan) -> Option:
    """The plan's option for an explicitly configured strategy."""
    par, n = cfg.parallel, cfg.scaling.num_workers
    if par.tp_size > 1 and par.pp_size > 1:
        name = "tp_pp"
    elif par.tp_size > 1:
        name = "tp_fsdp" if par.strategy == "fsdp" else "tp"
    elif par.pp_size > 1:
        name = "pp_dp" if n > par.pp_size else "pp"
    else:
        name = {"none": "accum"}.get(par.strategy, par.strategy)
    if name in ("ddp", "fsdp") and n == 1:  # one worker holds the whole model either way
        name = "accum"
    return plan.option(name)


def refused_splits(family: ModelFamily, kwargs: dict, shape: ModelShape, *, pp_schedule: str = "1f1b",
                   pp_split: list[int] | None = None) -> dict[str, str]:
    """The splits ("tp", "pp") the model's family refuses of those the plan could pick,
    each with the family's reason: an `hf` model of a type without a TP plan and
    pipeline split has neither, and no model has more stages than blocks. The plan then shows them as no
    option (`rtp plan`), and `auto` chooses among layouts that run or says none fits.
    Sizes the plan never picks (TP not dividing the heads, PP above the layer count) are
    not asked about; PP is asked with the config's schedule and split."""
    refused: dict[str, str] = {}
    if shape.kind != "transformer":  # the plan offers TP and PP to transformers only
        return refused
    heads = math.gcd(shape.n_head, shape.n_kv_head or shape.n_head)
    tp = next((d for d in range(2, heads + 1) if heads % d == 0), None)
    stages = 2 * PP_SCHEDULES[pp_schedule]  # 2 stages per rank when interleaved
    for dim, sizes in (("tp", tp and {"tp": tp, "pp": 1, "stages": 1}),
                       ("pp", shape.n_layer >= 2 and {"tp": 1, "pp": 2, "stages": stages})):
        if sizes:
            try:
                family.check_model_parallel(kwargs, pp_split=pp_split, **sizes)
            except ConfigError as exc:
                refused[dim] = f"{exc.field} must be {exc.allowed}"
    return refused


def resolve_auto(cfg: JobConfig, hw: Hardware) -> tuple[JobConfig, list[str]]:
    """The config with its ``auto`` fields decided on `hw`, and one sentence per decision."""
    if not has_auto(cfg):
        return cfg, []
    n, t = cfg.scaling.num_workers, cfg.train
    # None: "auto" (validation lets through an integer or "auto")
    explicit_batch = cfg.data.batch_size if isinstance(cfg.data.batch_size, int) else None
    # An explicit batch with strategy auto: tp and pp are 1 until the plan picks, so x n workers.
    global_batch = cfg.global_batch
    shape, lora = _shape(cfg), cfg.model.lora
    pins: dict[str, int | None] = {}
    refused: dict[str, str] = {}
    if cfg.parallel.strategy != "auto":  # only the batch is auto: plan for the given layout
        pins = {"tp": cfg.parallel.tp_size if cfg.parallel.tp_size > 1 else None,
                "pp": cfg.parallel.pp_size if cfg.parallel.pp_size > 1 else None}
    else:  # choose among the splits the model's family runs
        refused = refused_splits(get_family(cfg.model.name), cfg.model.kwargs, shape,
                                 pp_schedule=cfg.parallel.pp_schedule, pp_split=cfg.parallel.pp_split)
    plan = make_plan(model=shape, device_memory=hw.device_memory,
                     devices_per_node=hw.devices_per_node, nodes=hw.nodes, global_batch=global_batch,
                     precision=t.precision, optimizer=t.optimizer, headroom=hw.headroom,
                     activation_checkpointing=cfg.parallel.activation_checkpointing, tp=pins.get("tp"),
                     pp=pins.get("pp"), refused=refused,
                     # LoRA: the frozen base, and DDP or FSDP only (plan/lora.py)
                     lora=None if lora is None else model_lora_size(
                         get_family(cfg.model.name).build(cfg.model.kwargs, device="meta"), lora,
                         model_name=cfg.model.name),
                     # DPO: pairs of sequences, and the reference model it holds (plan/dpo.py)
                     dpo_reference=None if t.objective != "dpo" else dpo_reference(
                         precompute_reference=t.dpo.precompute_reference, lora=lora is not None))
    budget = f"{format_size(plan.request.budget)} per worker ({hw.source})"
    why, changes = [], {}
    if cfg.parallel.strategy == "auto":
        opt = plan.recommended
        if opt is None:
            raise ConfigError("parallel.strategy", "auto", "a layout that fits, and none does: "
                              + "; ".join(plan.reasons) + f"; budget {budget}")
        changes.update(_strategy_fields(opt))
        if opt.strategy in ("none", "accum") and n > 1:
            raise ConfigError("scaling.num_workers", n, f"1: the plan puts the model on one device "
                              f"({'; '.join(plan.reasons)}), so more workers would idle")
        why.append(f"parallel.strategy auto -> {LABELS[opt.strategy]}: {plan.reasons[0]} "
                   f"[memory: {budget}]")
    else:
        opt = _option_for(cfg, plan)
    if explicit_batch is None:
        if not opt.applicable or opt.layout is None or not opt.fits:
            need = format_size(opt.estimate.total) if opt.estimate else "n/a"
            raise ConfigError("data.batch_size", "auto", f"a micro-batch that fits under "
                              f"{LABELS[opt.strategy]}: even micro-batch 1 needs {need}, budget {budget}")
        lay = opt.layout
        assert opt.estimate is not None, "an option fits only with its estimate"
        if global_batch % lay.dp:
            raise ConfigError("train.global_batch_size", global_batch, f"a multiple of the {lay.dp} "
                              f"data-parallel replicas of {LABELS[opt.strategy]} (each takes an equal share)")
        changes.update({"data.batch_size": lay.micro_batch, "train.grad_accum_steps": lay.micro_batches})
        why.append(f"data.batch_size auto -> {lay.micro_batch} per worker x grad_accum_steps "
                   f"{lay.micro_batches} x {lay.dp} data-parallel replica(s) = global batch "
                   f"{global_batch}: the largest micro-batch dividing {global_batch // lay.dp} that "
                   f"fits ({format_size(opt.estimate.total)} of {budget})")
    elif opt.fits and opt.layout is not None and explicit_batch > opt.layout.micro_batch:
        why.append(f"warning: data.batch_size {explicit_batch} exceeds the {opt.layout.micro_batch} "
                   f"the memory model fits in {budget}; consider data.batch_size: auto")
    try:
        return cfg.replace(changes), why
    except ConfigError as exc:  # a setting that cannot go with what the plan chose
        chose = ", ".join(f"{k} {v}" for k, v in changes.items())
        raise ConfigError(exc.field, exc.value, f"{exc.allowed}; here the auto fields became {chose} "
                          "(set them explicitly to keep this setting)") from None
