"""The plan's search: each strategy's layout on the given devices, sized by the memory
model (plan/memory.py) at the largest micro-batch that fits, a model-parallel one at the
smallest degree that fits (less communication). plan/guide.py picks among them and says
why.

>>> from raytrain_platform.plan.shapes import preset_shape
>>> req = PlanRequest(model=preset_shape("gpt2"), device_memory=80 * 2**30, devices_per_node=8, global_batch=64)
>>> [(o.strategy, o.fits) for o in options(req)][:4]
[('none', True), ('accum', True), ('ddp', True), ('fsdp', True)]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from raytrain_platform.plan.lora import LoraSize
from raytrain_platform.plan.dpo import estimate_dpo_memory
from raytrain_platform.plan.memory import Layout, MemoryEstimate, estimate_memory
from raytrain_platform.plan.shapes import ModelShape

__all__ = ["Fit", "LABELS", "Option", "PlanRequest", "SPLITS", "STRATEGY_ORDER", "fit_layout", "options"]

STRATEGY_ORDER = ("none", "accum", "ddp", "fsdp", "tp", "pp", "tp_fsdp", "pp_dp", "tp_pp")
LABELS = {"none": "none", "accum": "grad accumulation", "ddp": "DDP", "fsdp": "FSDP", "tp": "TP",
          "pp": "PP", "tp_fsdp": "TP x FSDP", "pp_dp": "PP x DP", "tp_pp": "TP x PP (x FSDP)"}


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked: the model, the devices and the training setup."""

    model: ModelShape
    device_memory: int  # bytes per device
    devices_per_node: int = 1
    nodes: int = 1
    global_batch: int = 1  # sequences (or rows) per optimizer step, over all replicas
    precision: str = "fp32"
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    headroom: float = 0.1  # fraction of device memory kept free (CUDA context, fragmentation)
    tp: int | None = None  # pin the TP degree
    pp: int | None = None  # pin the PP degree
    lora: LoraSize | None = None  # LoRA adapters: the base is frozen (plan/lora.py)
    # A DPO run's reference model, "copy" | "none" (plan/dpo.py; with LoRA always none); None: not DPO
    dpo_reference: str | None = None
    # Splits the model's family cannot run ("tp"/"pp" -> why; plan/auto.py:refused_splits)
    refused: tuple[tuple[str, str], ...] = ()

    def refusal(self, dim: str) -> str | None:
        return dict(self.refused).get(dim)

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def budget(self) -> int:
        return int(self.device_memory * (1 - self.headroom))


@dataclass(frozen=True)
class Option:
    """One strategy on these devices: its layout (with the largest micro-batch that fits),
    the estimate, and whether it fits. ``applicable`` False means it cannot run here."""

    strategy: str
    applicable: bool
    fits: bool = False
    layout: Layout | None = None
    estimate: MemoryEstimate | None = None
    note: str = ""

    @property
    def fitted_layout(self) -> Layout:
        """`layout` of an option that was sized (one that fits always was)."""
        assert self.layout is not None, f"{self.strategy} has no layout ({self.note or 'not sized'})"
        return self.layout

    @property
    def grad_accum_steps(self) -> int:
        return self.layout.micro_batches if self.layout else 0

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "label": LABELS[self.strategy],
                "applicable": self.applicable, "fits": self.fits,
                "layout": None if self.layout is None else {
                    **{k: getattr(self.layout, k) for k in ("dp", "tp", "pp", "shard", "micro_batch",
                                                              "micro_batches")},
                    "devices": self.layout.devices},
                "memory": None if self.estimate is None else self.estimate.to_dict(),
                "note": self.note}


@functools.lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    """Ascending. Cached: a plan asks for the same device counts and batches several
    times (its options, and the plans of its warnings), up to 10**12 devices."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


class Fit(NamedTuple):
    layout: Layout
    estimate: MemoryEstimate
    fits: bool


def fit_layout(req: PlanRequest, *, dp: int, tp: int = 1, pp: int = 1, shard: int = 1,
               accumulate: bool = True) -> Fit:
    """The largest micro-batch (a divisor of the per-replica batch) that fits; if none
    does, micro-batch 1 with fits=False."""
    per_replica = math.ceil(req.global_batch / dp)

    def estimate(micro: int) -> Fit:
        layout = Layout(dp=dp, tp=tp, pp=pp, shard=shard, micro_batch=micro,
                        micro_batches=per_replica // micro)
        if req.dpo_reference is None:
            est = estimate_memory(model=req.model, layout=layout, precision=req.precision,
                                  optimizer=req.optimizer,
                                  activation_checkpointing=req.activation_checkpointing, lora=req.lora)
        else:  # LoRA's reference is its own base, adapters disabled: no copy
            est = estimate_dpo_memory(model=req.model, layout=layout, precision=req.precision,
                                      optimizer=req.optimizer, activation_checkpointing=req.activation_checkpointing,
                                      lora=req.lora, reference="none" if req.lora else req.dpo_reference)
        return Fit(layout, est, est.total <= req.budget)

    if not accumulate:
        return estimate(per_replica)
    # Micro-batch 1 first: no micro-batch b needs less (each block's activations of b
    # sequences are at least b times those of one, and at most b times fewer of them are
    # in flight), so if 1 does not fit, none does and the answer is 1 -- one estimate,
    # not one per divisor, for each of the many degrees a search may try.
    smallest = estimate(1)
    if not smallest.fits:
        return smallest
    for micro in reversed(_divisors(per_replica)):
        if micro == 1:
            return smallest
        fit = estimate(micro)
        if fit.fits:
            return fit
    raise AssertionError("1 divides every batch")  # pragma: no cover


def _tp_degrees(req: PlanRequest) -> list[int]:
    """TP within one node: divisors of the node's devices that split the heads (and the
    key/value heads of grouped-query attention) evenly."""
    if req.tp is not None:
        return [req.tp] if req.tp > 1 else []
    heads, kv_heads = req.model.n_head, req.model.n_kv_head or req.model.n_head
    return [d for d in _divisors(req.devices_per_node) if d > 1 and heads % d == 0 and kv_heads % d == 0]


def _pp_degrees(req: PlanRequest, *, need_dp: bool) -> list[int]:
    if req.pp is not None:
        ok = req.pp > 1 and (not need_dp or req.devices // req.pp >= 2)
        return [req.pp] if ok else []
    return [d for d in _divisors(req.devices)
            if 1 < d <= req.model.n_layer and (not need_dp or req.devices // d >= 2)]


# the splits each option needs
SPLITS = {"tp": ("tp",), "tp_fsdp": ("tp",), "pp": ("pp",), "pp_dp": ("pp",), "tp_pp": ("tp", "pp")}


def _tp_pp_degrees(req: PlanRequest, tps: list[int]) -> list[tuple[int, int]]:
    """(tp, pp) pairs for 3-D parallelism: TP within a node (`tps`), the pipeline over
    what is left (across nodes), data parallel over the rest; fewest model-parallel
    ranks first, then the smaller pipeline."""
    pairs = [(t, p) for t in tps for p in _divisors(req.devices // t)
             if 1 < p <= req.model.n_layer and (req.pp is None or p == req.pp)]
    return sorted(pairs, key=lambda tp: (tp[0] * tp[1], tp[1]))


def _search(req: PlanRequest, strategy: str, degrees: Sequence[int | tuple[int, int]], build) -> Option:
    """The smallest model-parallel degree that fits (less communication), else the largest."""
    if not degrees:
        return Option(strategy, False, note="no degree fits these devices and this model")
    for degree in degrees:
        found = fit_layout(req, **build(degree))
        if found.fits:
            break
    return _sized(strategy, found)


def options(req: PlanRequest) -> list[Option]:
    """Every strategy of `STRATEGY_ORDER` estimated on these devices (a model-parallel one
    at the smallest degree that fits), or marked not applicable with why."""
    n, per_node, nodes = req.devices, req.devices_per_node, req.nodes
    out = [_sized("none", fit_layout(req, dp=1, accumulate=False)), _sized("accum", fit_layout(req, dp=1))]
    out.append(_sized("ddp", fit_layout(req, dp=n)) if n > 1 else
               Option("ddp", False, note="needs 2 or more devices"))
    # On several nodes FSDP shards within a node and replicates across nodes.
    shard = n if nodes == 1 else per_node
    out.append(_sized("fsdp", fit_layout(req, dp=n, shard=shard)) if shard > 1 else
               Option("fsdp", False, note="needs 2 or more devices per node"))
    if req.model.kind != "transformer" or req.lora is not None:
        note = "LoRA runs on DDP or FSDP" if req.lora is not None else "TP and PP split transformer blocks"
        return out + [Option(s, False, note=note) for s in ("tp", "pp", "tp_fsdp", "pp_dp", "tp_pp")]
    tps = _tp_degrees(req)
    out.append(_search(req, "tp", tps, lambda t: {"dp": 1, "tp": t}))
    out.append(_search(req, "pp", _pp_degrees(req, need_dp=False), lambda p: {"dp": 1, "pp": p}))
    out.append(_search(req, "tp_fsdp", tps, lambda t: {
        "dp": n // t, "tp": t, "shard": n // t if nodes == 1 else per_node // t}))
    out.append(_search(req, "pp_dp", _pp_degrees(req, need_dp=True), lambda p: {"dp": n // p, "pp": p}))
    # 3-D: FSDP over the data-parallel replicas (DDP over TP groups is refused); on several
    # nodes, like FSDP and TP x FSDP above, the replicas that share a node (tp innermost)
    out.append(_search(req, "tp_pp", _tp_pp_degrees(req, tps), lambda tp_pp: {
        "dp": (dp := n // (tp_pp[0] * tp_pp[1])), "tp": tp_pp[0], "pp": tp_pp[1],
        "shard": dp if nodes == 1 else max(1, min(dp, per_node // tp_pp[0]))}))
    # A split the model's family refuses is no option, whatever it would fit.
    return [Option(o.strategy, False, note=why) if (why := _refused(req, o.strategy)) else o for o in out]


def _refused(req: PlanRequest, strategy: str) -> str | None:
    return next((why for dim in SPLITS.get(strategy, ()) if (why := req.refusal(dim))), None)


def _sized(strategy: str, found: Fit) -> Option:
    return Option(strategy, True, found.fits, found.layout, found.estimate)
