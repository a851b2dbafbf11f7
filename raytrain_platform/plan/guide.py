"""The decision guide: with every strategy estimated on the given devices
(plan/search.py), say which fit, and recommend one, following the tutorial's table (docs: "Kapan Memakai Strategi
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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.dpo import REFERENCES
from raytrain_platform.plan.lora import DEFAULT_R, DEFAULT_TARGETS, LoraSize, lora_size
from raytrain_platform.plan.search import (LABELS, SPLITS, STRATEGY_ORDER, Option, PlanRequest, fit_layout,
                                           options)
from raytrain_platform.plan.shapes import ModelShape
from raytrain_platform.units import format_size

__all__ = ["PlanRequest", "Option", "Plan", "make_plan", "STRATEGY_ORDER", "LABELS"]

SMALL_PER_DEVICE_BATCH = 4  # below this, DP's gradient traffic tends to dominate


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


def _need(option: Option) -> str:
    if option.estimate is None or option.layout is None:
        return f"n/a ({option.note})" if option.note else "n/a"
    return f"{format_size(option.estimate.total)} at micro-batch {option.layout.micro_batch}"


def _batch_words(option: Option) -> str:
    lay = option.fitted_layout
    if lay.micro_batches == 1:
        return f"batch {lay.micro_batch} per replica"
    return f"micro-batch {lay.micro_batch} x {lay.micro_batches} accumulation steps per replica"


def _fits_one_device(req: PlanRequest, by_name: dict[str, Option]) -> tuple[Option, list[str]]:
    none, accum, ddp = by_name["none"], by_name["accum"], by_name["ddp"]
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
        fallback = by_name["fsdp"] if by_name["fsdp"].fits else accum
        return fallback, [head + f"; DDP does not fit either ({_need(ddp)}: its gradient buckets "
                          f"copy the gradients), so {LABELS[fallback.strategy]}, "
                          f"{_batch_words(fallback)}"]
    return ddp, [head + f"; DDP over {req.devices} devices splits it: {_batch_words(ddp)}"
                 + (" (gradient accumulation, table row 'big batch does not fit')"
                    if ddp.grad_accum_steps > 1 else "")]


def _too_big(req: PlanRequest, by_name: dict[str, Option]) -> tuple[Option | None, list[str]]:
    accum = by_name["accum"]
    assert accum.estimate is not None, "options() always estimates accum"
    head = f"does not fit one device even at micro-batch 1 ({format_size(accum.estimate.total)} > {format_size(req.budget)})"
    where = " within each node, replicated across nodes" if req.nodes > 1 else ""
    fsdp, tp_fsdp, pp_dp = by_name["fsdp"], by_name["tp_fsdp"], by_name["pp_dp"]
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
    for pipe in (pp_dp, by_name["pp"], by_name["tp_pp"]):  # pipelines across nodes, then 3-D
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
    estimated = [(x.estimate.total, x) for x in by_name.values() if x.estimate]
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
        found = fit_layout(req, dp=req.devices, shard=req.devices)
        if found.fits:
            out.append(f"FSDP sharded over all {req.devices} devices would also fit ({format_size(found.estimate.total)}, "
                       f"micro-batch {found.layout.micro_batch}), with per-layer all-gathers across nodes: "
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
    if req.dpo_reference not in (None, *REFERENCES):
        raise ConfigError("--dpo", req.dpo_reference, f"one of {list(REFERENCES)}")
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
              refused: Mapping[str, str] | Iterable[tuple[str, str]] = (),
              dpo_reference: str | None = None) -> Plan:
    """Estimate every strategy, mark which fit in ``device_memory * (1 - headroom)``, and
    recommend one with its reasons (see the module docstring for the rules). With
    `dpo_reference` ("copy" | "none"), a DPO run: each sample a pair, and the reference
    model (plan/dpo.py).

    >>> from raytrain_platform.plan.shapes import generic_shape
    >>> big = generic_shape(num_params=70_000_000_000, n_layer=80, hidden=8192, seq_len=4096, n_head=64)
    >>> make_plan(model=big, device_memory=80 * 10**9, devices_per_node=8, nodes=16,
    ...           global_batch=256, precision="bf16", activation_checkpointing=True).recommended.strategy
    'pp_dp'
    """
    req = PlanRequest(model=model, device_memory=device_memory, devices_per_node=devices_per_node,
                      nodes=nodes, global_batch=global_batch, precision=precision,
                      optimizer=optimizer, activation_checkpointing=activation_checkpointing,
                      headroom=headroom, tp=tp, pp=pp, lora=lora, refused=tuple(sorted(dict(refused).items())),
                      dpo_reference=dpo_reference)
    _validate(req)
    found = options(req)
    by_name = {o.strategy: o for o in found}
    rec: Option | None
    if by_name["accum"].fits:
        rec, reasons = _fits_one_device(req, by_name)
    else:
        rec, reasons = _too_big(req, by_name)
    pinned = [d for d in ("tp", "pp") if (getattr(req, d) or 1) > 1]
    if pinned and (rec is None or not set(pinned) <= set(SPLITS.get(rec.strategy, ()))):
        rec, reasons = _pinned(req, found, pinned)
    lora_option, size = (None, None) if rec is not None else _lora_instead(req, reasons)
    return Plan(request=req, options=tuple(found), recommended=rec, reasons=tuple(reasons),
                warnings=tuple(_warnings(req, rec)), lora_option=lora_option, lora_size=size)


def _pinned(req: PlanRequest, sized: list[Option], pinned: list[str]) -> tuple[Option | None, list[str]]:
    """The recommendation when ``--tp``/``--pp`` pin a split: the first option (in
    `STRATEGY_ORDER`) that has every pinned split and fits."""
    pins = " ".join(f"--{d} {getattr(req, d)}" for d in pinned)
    with_pins = [o for o in sized if set(pinned) <= set(SPLITS.get(o.strategy, ())) and o.applicable]
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
    size = lora_size(req.model, r=DEFAULT_R, targets=DEFAULT_TARGETS)
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
