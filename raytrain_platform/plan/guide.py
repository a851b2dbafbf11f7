"""The decision guide: estimate every strategy on the given devices, say which fit,
and recommend one, following the tutorial's table (docs: "Kapan Memakai Strategi
Apa: Decision Guide"):

| situation                                  | start with                              |
|--------------------------------------------|-----------------------------------------|
| fits one device, training slow             | data parallelism (DDP)                  |
| fits one device, big batch does not        | gradient accumulation                   |
| fits one node, need throughput             | DDP, then tune the batch                |
| does not fit one device                    | FSDP, then tensor/pipeline parallelism  |
| 8 GPUs, big model                          | tensor (within the node) + data         |
| across nodes                               | pipeline + data parallelism             |

and its pitfalls: TP only within a node (cross-node links are too slow for its
per-layer collectives), a too small per-device batch lets communication dominate.
On several nodes FSDP, TP x FSDP and TP x PP x FSDP are estimated sharded within a node
and replicated across nodes (DP on top), so their heavy collectives stay on the fast
intra-node links; the run itself shards over all its data-parallel ranks (FSDP2 on
the whole data-parallel mesh), which holds less than the estimate. ``--tp``/``--pp``
pin a split: the recommendation is then a layout that has it.

>>> from raytrain_platform.plan.shapes import preset_shape
>>> plan = make_plan(model=preset_shape("gpt2"), device_memory=80 * 2**30, devices_per_node=8,
...                  global_batch=64, precision="bf16")
>>> plan.recommended.strategy
'ddp'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.lora import DEFAULT_R, LoraSize, default_targets, lora_size
from raytrain_platform.plan.memory import Layout, MemoryEstimate, estimate_memory
from raytrain_platform.plan.shapes import ModelShape
from raytrain_platform.units import format_size

__all__ = ["PlanRequest", "Option", "Plan", "make_plan", "STRATEGY_ORDER"]

STRATEGY_ORDER = ("none", "accum", "ddp", "fsdp", "tp", "pp", "tp_fsdp", "pp_dp", "tp_pp")
LABELS = {"none": "none", "accum": "grad accumulation", "ddp": "DDP", "fsdp": "FSDP", "tp": "TP",
          "pp": "PP", "tp_fsdp": "TP x FSDP", "pp_dp": "PP x DP", "tp_pp": "TP x PP (x FSDP)"}
SMALL_PER_DEVICE_BATCH = 4  # below this, DP's gradient traffic tends to dominate


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


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    options: tuple[Option, ...]
    recommended: Option | None
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # When full fine-tuning fits nowhere: the strategy a LoRA run would use, and its adapters.
    lora_option: Option | None = None
    lora_size: LoraSize | None = None

    def option(self, strategy: str) -> Option:
        return next(o for o in self.options if o.strategy == strategy)


@functools.lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    """Ascending. Cached: a plan asks for the same device counts and batches several
    times (its options, and the plans of its warnings), up to 10**12 devices."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def _fit(req: PlanRequest, *, dp: int, tp: int = 1, pp: int = 1, shard: int = 1,
         accumulate: bool = True) -> tuple[Layout, MemoryEstimate, bool]:
    """The largest micro-batch (a divisor of the per-replica batch) that fits; if none
    does, micro-batch 1 with fits=False."""
    per_replica = math.ceil(req.global_batch / dp)

    def estimate(micro: int) -> tuple[Layout, MemoryEstimate, bool]:
        layout = Layout(dp=dp, tp=tp, pp=pp, shard=shard, micro_batch=micro,
                        micro_batches=per_replica // micro)
        est = estimate_memory(model=req.model, layout=layout, precision=req.precision,
                              optimizer=req.optimizer,
                              activation_checkpointing=req.activation_checkpointing, lora=req.lora)
        return layout, est, est.total <= req.budget

    if not accumulate:
        return estimate(per_replica)
    # Micro-batch 1 first: no micro-batch b needs less (each block's activations of b
    # sequences are at least b times those of one, and at most b times fewer of them are
    # in flight), so if 1 does not fit, none does and the answer is 1 -- one estimate,
    # not one per divisor, for each of the many degrees a search may try.
    smallest = estimate(1)
    if not smallest[2]:
        return smallest
    for micro in reversed(_divisors(per_replica)):
        if micro == 1:
            return smallest
        fit = estimate(micro)
        if fit[2]:
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
_SPLITS = {"tp": ("tp",), "tp_fsdp": ("tp",), "pp": ("pp",), "pp_dp": ("pp",), "tp_pp": ("tp", "pp")}


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
        layout, est, fits = _fit(req, **build(degree))
        if fits:
            break
    return Option(strategy, True, fits, layout, est)


def _options(req: PlanRequest) -> list[Option]:
    n, per_node, nodes = req.devices, req.devices_per_node, req.nodes
    out = [Option("none", True, *_swap(_fit(req, dp=1, accumulate=False))),
           Option("accum", True, *_swap(_fit(req, dp=1)))]
    out.append(Option("ddp", True, *_swap(_fit(req, dp=n))) if n > 1 else
               Option("ddp", False, note="needs 2 or more devices"))
    # On several nodes FSDP shards within a node and replicates across nodes.
    shard = n if nodes == 1 else per_node
    out.append(Option("fsdp", True, *_swap(_fit(req, dp=n, shard=shard))) if shard > 1 else
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
    return next((why for dim in _SPLITS.get(strategy, ()) if (why := req.refusal(dim))), None)


def _swap(fit: tuple[Layout, MemoryEstimate, bool]) -> tuple[bool, Layout, MemoryEstimate]:
    layout, est, fits = fit
    return fits, layout, est


def _need(o: Option) -> str:
    if o.estimate is None or o.layout is None:
        return f"n/a ({o.note})" if o.note else "n/a"
    return f"{format_size(o.estimate.total)} at micro-batch {o.layout.micro_batch}"


def _batch_words(o: Option) -> str:
    lay = o.fitted_layout
    if lay.micro_batches == 1:
        return f"batch {lay.micro_batch} per replica"
    return f"micro-batch {lay.micro_batch} x {lay.micro_batches} accumulation steps per replica"


def _fits_one_device(req: PlanRequest, o: dict[str, Option]) -> tuple[Option, list[str]]:
    none, accum, ddp = o["none"], o["accum"], o["ddp"]
    budget = format_size(req.budget)
    if none.fits:
        head = f"fits one device at the full batch of {req.global_batch} ({_need(none)} of {budget})"
        if req.devices == 1 or not ddp.fits:
            return none, [head + (": nothing to distribute" if req.devices == 1 else
                                  f"; DDP's gradient buckets would not fit ({_need(ddp)})")]
        return ddp, [head + "; table row 'fits one GPU, training slow' / 'fits one node, need "
                     f"throughput': DDP over {req.devices} devices, {_batch_words(ddp)}",
                     "DDP pays off once one device is busy (95%+ utilisation) and communication does "
                     "not dominate: measure scaling on 2 devices before using more"]
    head = (f"the model fits one device but the batch of {req.global_batch} does not "
            f"({format_size(none.estimate.total) if none.estimate else '?'} > {budget})")
    if req.devices == 1:
        return accum, [head + f"; table row 'big batch does not fit': gradient accumulation, "
                       f"{_batch_words(accum)}"]
    if not ddp.fits:  # the replica fits, but not with DDP's gradient buckets beside it
        fallback = o["fsdp"] if o["fsdp"].fits else accum
        return fallback, [head + f"; DDP does not fit either ({_need(ddp)}: its gradient buckets "
                          f"copy the gradients), so {LABELS[fallback.strategy]}, "
                          f"{_batch_words(fallback)}"]
    return ddp, [head + f"; DDP over {req.devices} devices splits it: {_batch_words(ddp)}"
                 + (" (gradient accumulation, table row 'big batch does not fit')"
                    if ddp.grad_accum_steps > 1 else "")]


def _too_big(req: PlanRequest, o: dict[str, Option]) -> tuple[Option | None, list[str]]:
    accum = o["accum"]
    assert accum.estimate is not None, "_options always estimates accum"
    head = f"does not fit one device even at micro-batch 1 ({format_size(accum.estimate.total)} > {format_size(req.budget)})"
    where = " within each node, replicated across nodes" if req.nodes > 1 else ""
    fsdp, tp_fsdp, pp_dp = o["fsdp"], o["tp_fsdp"], o["pp_dp"]
    if fsdp.fits:
        return fsdp, [head + f"; FSDP shards parameters, gradients and optimizer state over "
                      f"{fsdp.fitted_layout.shard} devices{where}: {_batch_words(fsdp)}"]
    if tp_fsdp.fits:
        lay = tp_fsdp.fitted_layout
        return tp_fsdp, [head + "; FSDP alone does not fit"
                         + (f" ({_need(fsdp)})" if fsdp.estimate else ""),
                         f"table row '8 GPUs, big model': tensor parallelism of degree {lay.tp} within "
                         f"a node (its per-layer collectives need the fast intra-node links) x FSDP "
                         f"over {lay.shard}{where}: {_batch_words(tp_fsdp)}"]
    for pipe in (pp_dp, o["pp"], o["tp_pp"]):  # pipelines across nodes, then 3-D
        if pipe.fits:
            lay = pipe.fitted_layout
            across = "across nodes" if req.nodes > 1 else "within the node"
            if pipe.strategy == "tp_pp":
                why, how = ("no 2-D layout fits (FSDP, TP x FSDP, PP x DP)",
                            f"3-D parallelism: tensor parallelism of degree {lay.tp} within a node x a "
                            f"pipeline of {lay.pp} stages ({across})")
            else:
                why, how = ("neither FSDP nor TP x FSDP fits", f"table row 'across nodes': a pipeline of "
                            f"{lay.pp} stages ({across}; only activations cross stage boundaries)")
            sharded = f" (FSDP over {lay.shard})" if lay.shard > 1 else ""
            return pipe, [head + "; " + why, f"{how} x {lay.dp} data-parallel replica(s){sharded}: "
                          f"{lay.micro_batches} micro-batches of {lay.micro_batch} per step"]
    estimated = [(x.estimate.total, x) for x in o.values() if x.estimate]
    smallest = min(estimated, key=lambda te: te[0])[1]
    return None, [head + f"; no strategy fits: the smallest is {LABELS[smallest.strategy]} at "
                  f"{_need(smallest)}, budget {format_size(req.budget)}",
                  "more devices or nodes, " + ("" if req.activation_checkpointing else "activation checkpointing, ")
                  + "or a smaller model/sequence"]


def _warnings(req: PlanRequest, rec: Option | None) -> list[str]:
    out = []
    if not req.model.exact:
        out.append("the model is known by its sizes only: the split of parameters into blocks "
                   "and embeddings is derived (GPT-2 style blocks, untied embeddings)")
    lay = rec.layout if rec is not None else None
    if lay is not None and lay.dp > 1 and lay.micro_batch * lay.micro_batches < SMALL_PER_DEVICE_BATCH:
        out.append(f"per-replica batch {lay.micro_batch * lay.micro_batches} per step is small: "
                   "gradient communication may dominate (pitfall 'batch per GPU too small'); "
                   "raise the global batch (with gradient accumulation if needed)")
    if req.nodes > 1 and (rec is None or rec.strategy in ("pp", "pp_dp")):
        layout, est, fits = _fit(req, dp=req.devices, shard=req.devices)
        if fits:
            out.append(f"FSDP sharded over all {req.devices} devices would also fit ({format_size(est.total)}, "
                       f"micro-batch {layout.micro_batch}), with per-layer all-gathers across nodes: "
                       "worth it only with fast inter-node links")
    needs_help = rec is None or (rec.layout is not None and rec.layout.micro_batches > 1
                                 and rec.layout.pp == 1)
    if needs_help and req.model.kind == "transformer" and not req.activation_checkpointing:
        alt = make_plan(**{**req.__dict__, "activation_checkpointing": True})
        if alt.recommended is not None:
            out.append(f"with activation checkpointing (--activation-checkpointing): "
                       f"{LABELS[alt.recommended.strategy]}, {_batch_words(alt.recommended)}")
    return out


def _validate(req: PlanRequest) -> None:
    def positive(flag: str, value: object) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(flag, value, "an integer >= 1")

    positive("--devices-per-node", req.devices_per_node)
    positive("--nodes", req.nodes)
    positive("--global-batch", req.global_batch)
    if not (isinstance(req.device_memory, int) and req.device_memory > 0):
        raise ConfigError("--device-mem", req.device_memory, "a size > 0, like 80GiB or 24GB")
    if not 0 <= req.headroom < 1:
        raise ConfigError("--headroom", req.headroom, "a fraction in [0, 1)")
    m = req.model
    if req.tp is not None:
        positive("--tp", req.tp)
        if req.tp > req.devices_per_node:
            raise ConfigError("--tp", req.tp, f"at most --devices-per-node ({req.devices_per_node}): "
                              "TP across nodes needs the fastest links (pitfall: keep TP within a node)")
        if req.devices_per_node % req.tp or m.kind != "transformer" or m.n_head % req.tp:
            raise ConfigError("--tp", req.tp, f"a divisor of --devices-per-node ({req.devices_per_node}) "
                              f"and of the attention heads ({m.n_head}) of a transformer")
    for dim, pin in (("tp", req.tp), ("pp", req.pp)):
        if pin is not None and pin > 1 and (why := req.refusal(dim)):
            raise ConfigError(f"--{dim}", pin, f"1: {why}")
    if req.pp is not None:
        positive("--pp", req.pp)
        if req.devices % req.pp or m.kind != "transformer" or req.pp > m.n_layer:
            raise ConfigError("--pp", req.pp, f"a divisor of the devices ({req.devices}) and at most "
                              f"the transformer's layers ({m.n_layer})")


def make_plan(*, model: ModelShape, device_memory: int, devices_per_node: int = 1, nodes: int = 1,
              global_batch: int = 1, precision: str = "fp32", optimizer: str = "adamw",
              activation_checkpointing: bool = False, headroom: float = 0.1,
              tp: int | None = None, pp: int | None = None, lora: LoraSize | None = None,
              refused: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> Plan:
    """Estimate every strategy, mark which fit in ``device_memory * (1 - headroom)``, and
    recommend one with its reasons (see the module docstring for the rules).

    >>> from raytrain_platform.plan.shapes import generic_shape
    >>> big = generic_shape(num_params=70_000_000_000, n_layer=80, hidden=8192, seq_len=4096, n_head=64)
    >>> make_plan(model=big, device_memory=80 * 10**9, devices_per_node=8, nodes=16,
    ...           global_batch=256, precision="bf16", activation_checkpointing=True).recommended.strategy
    'pp_dp'
    """
    req = PlanRequest(model=model, device_memory=device_memory, devices_per_node=devices_per_node,
                      nodes=nodes, global_batch=global_batch, precision=precision,
                      optimizer=optimizer, activation_checkpointing=activation_checkpointing,
                      headroom=headroom, tp=tp, pp=pp, lora=lora, refused=tuple(sorted(dict(refused).items())))
    _validate(req)
    options = _options(req)
    by_name = {o.strategy: o for o in options}
    rec: Option | None
    if by_name["accum"].fits:
        rec, reasons = _fits_one_device(req, by_name)
    else:
        rec, reasons = _too_big(req, by_name)
    pinned = [d for d in ("tp", "pp") if (getattr(req, d) or 1) > 1]
    if pinned and (rec is None or not set(pinned) <= set(_SPLITS.get(rec.strategy, ()))):
        rec, reasons = _pinned(req, options, pinned)
    lora_option, size = (None, None) if rec is not None else _lora_instead(req, reasons)
    return Plan(request=req, options=tuple(options), recommended=rec, reasons=tuple(reasons),
                warnings=tuple(_warnings(req, rec)), lora_option=lora_option, lora_size=size)


def _pinned(req: PlanRequest, options: list[Option], pinned: list[str]) -> tuple[Option | None, list[str]]:
    """The recommendation when ``--tp``/``--pp`` pin a split: the first option (in
    `STRATEGY_ORDER`) that has every pinned split and fits."""
    pins = " ".join(f"--{d} {getattr(req, d)}" for d in pinned)
    with_pins = [o for o in options if set(pinned) <= set(_SPLITS.get(o.strategy, ())) and o.applicable]
    fit = next((o for o in with_pins if o.fits), None)
    if fit is None:
        sizes = ", ".join(f"{LABELS[o.strategy]} {_need(o)}" for o in with_pins) or "none applies"
        return None, [f"{pins} pinned: no layout with it fits ({sizes}; budget {format_size(req.budget)})"]
    lay = fit.fitted_layout
    return fit, [f"{pins} pinned: {LABELS[fit.strategy]} fits ({_need(fit)} of {format_size(req.budget)}): "
                 f"tp {lay.tp} x pp {lay.pp} x {lay.dp} data-parallel replica(s), {_batch_words(fit)}"]


def _lora_instead(req: PlanRequest, reasons: list[str]) -> tuple[Option | None, LoraSize | None]:
    """Full fine-tuning fits nowhere: would LoRA (the base frozen: no gradients or
    optimizer state for it) fit? If so, say how, as one more reason."""
    # Pinned TP/PP sizes above 1 are a model-parallel request (LoRA has no TP/PP plan).
    if req.lora is not None or req.model.kind != "transformer" or (req.tp or 1) > 1 or (req.pp or 1) > 1:
        return None, None
    size = lora_size(req.model, r=DEFAULT_R, targets=default_targets(req.model))
    alt = make_plan(**{**req.__dict__, "lora": size})
    if alt.recommended is None:
        return None, None
    opt = alt.recommended
    reasons.append(f"LoRA fits: rank {size.r} adapters on {', '.join(size.targets)} ({size.params:,} trainable "
                   f"parameters; the frozen base has no gradients or optimizer state): {LABELS[opt.strategy]}"
                   f"{f' over {opt.layout.shard} devices' if opt.layout and opt.layout.shard > 1 else ''}, "
                   f"{_batch_words(opt)}, {_need(opt)}. Set model.lora: {{r: {size.r}, target_modules: "
                   f"[{', '.join(size.targets)}]}} (rtp plan --lora-r to plan it)")
    return opt, size
