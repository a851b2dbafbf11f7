"""`rtp plan`: the arguments, their parsing (every bad value is a one-line `ConfigError`
naming the flag), and the table / JSON output. No torch import.

    rtp plan --model llama2-7b --device-mem 24GB --devices-per-node 8 --global-batch 64 \\
        --precision bf16 --activation-checkpointing
    rtp plan --model hf:/path/to/Llama-3.1-8B --device-mem 80GiB --devices-per-node 8 --global-batch 64
    rtp plan --params 7e9 --layers 32 --hidden 4096 --seq-len 4096 --device-mem 80GiB --json
    rtp plan pipelines/configs/tabular.yaml --device-mem 16GiB

"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import re
from pathlib import Path
from typing import Any, overload

from raytrain_platform.config import add_set_flag, load_config
from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.auto import refused_splits
from raytrain_platform.plan.dpo import REFERENCES, dpo_reference
from raytrain_platform.plan.guide import LABELS, Plan, make_plan
from raytrain_platform.plan.lora import DEFAULT_TARGETS, LoraSize, lora_size, model_lora_size
from raytrain_platform.models.hf import HFFamily
from raytrain_platform.models.hf_shapes import hf_shape
from raytrain_platform.models.lora import ALL_LINEAR, resolve_lora
from raytrain_platform.models.registry import FAMILIES, family_names, get_family
from raytrain_platform.plan.shapes import PRESETS, ModelShape, generic_shape, preset_shape
from raytrain_platform.units import SIZE_HELP, parse_count, parse_size

MAX_COUNT = 1_000_000  # devices, nodes, global batch, tp, pp
MAX_SHAPE = 1_000_000_000  # a model's sizes
SHAPE_FLAGS = ("--layers", "--hidden", "--heads", "--seq-len", "--vocab")

__all__ = ["add_plan_arguments", "run_plan", "parse_size", "parse_count", "format_plan", "plan_to_dict"]


@overload
def _int(flag: str, text: str | None, default: int) -> int: ...
@overload
def _int(flag: str, text: str | None, default: None = None) -> int | None: ...
def _int(flag: str, text: str | None, default: int | None = None) -> int | None:
    if text is None:
        return default
    # Bounded: the guide enumerates divisors of device counts and batches; model sizes
    # (a 1M-token context, a 256k vocabulary) may be larger.
    limit = MAX_SHAPE if flag in SHAPE_FLAGS else MAX_COUNT
    if not re.fullmatch(r"\+?\d{1,12}", text.strip()) or not 1 <= int(text) <= limit:
        raise ConfigError(flag, text, f"an integer from 1 to {limit:,}")
    return int(text)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="a job's YAML config (model, batch, precision from it)")
    add_set_flag(p, help="with CONFIG: override a config field, e.g. --set model.kwargs.n_layer=24 (repeatable)")
    p.add_argument("--model", help=f"{', '.join(family_names())}, a preset: {', '.join(PRESETS)}, "
                   "or hf:DIR (a Hugging Face model folder: its config.json)")
    for flag, what in (("--params", "parameter count (7B, 125M, 6.7e9)"), ("--layers", "blocks"),
                       ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--seq-len", "sequence length in tokens"), ("--vocab", "vocabulary size")):
        p.add_argument(flag, help=what)
    p.add_argument("--device-mem", help="memory per device: " + SIZE_HELP)
    p.add_argument("--devices-per-node", help="devices per node (default 1, or the config's workers)")
    p.add_argument("--nodes", help="nodes (default 1)")
    p.add_argument("--global-batch", help="samples per optimizer step over all devices")
    p.add_argument("--precision", help="fp32 | bf16 (autocast)")
    p.add_argument("--optimizer", help="adamw | sgd")
    p.add_argument("--activation-checkpointing", action="store_true", default=None)
    p.add_argument("--headroom", default="0.1", help="fraction of device memory kept free")
    p.add_argument("--tp", help="pin the tensor-parallel degree (within a node)")
    p.add_argument("--pp", help="pin the pipeline-parallel degree")
    p.add_argument("--lora-r", help="plan a LoRA run: adapters of this rank, the base frozen (a config's "
                   "model.lora is read without it)")
    p.add_argument("--lora-targets", help="with --lora-r: Linear modules to adapt, comma-separated "
                   f"(default {','.join(DEFAULT_TARGETS)}: peft's rule, every Linear layer but the head)")
    p.add_argument("--dpo", choices=REFERENCES, help="plan a DPO run: each sample a pair (chosen and rejected in "
                   "one forward) and its reference model: copy (frozen, sharded like the policy) or none "
                   "(log-probs precomputed; with LoRA the reference is the base itself)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _check_heads(hidden: int, heads: int | None) -> None:
    if heads is not None and hidden % heads:
        raise ConfigError("--heads", heads, f"a divisor of --hidden ({hidden})")


def _shape_from_flags(args: argparse.Namespace) -> ModelShape:
    layers, hidden = _int("--layers", args.layers), _int("--hidden", args.hidden)
    heads, seq_len = _int("--heads", args.heads), _int("--seq-len", args.seq_len)
    if args.params is not None:
        if layers is None or hidden is None or seq_len is None:
            flag = next(f for f, v in (("--layers", layers), ("--hidden", hidden), ("--seq-len", seq_len))
                        if v is None)
            raise ConfigError(flag, None, "an integer >= 1 (needed with --params)")
        _check_heads(hidden, heads)
        return generic_shape(num_params=parse_count("--params", args.params), n_layer=layers,
                             hidden=hidden, seq_len=seq_len, n_head=heads,
                             vocab=_int("--vocab", args.vocab, 50257))
    if args.model is not None and (args.model == "hf" or args.model.startswith("hf:")):
        _no_size_flags(args, f"the Hugging Face model {args.model!r}",
                       layers=layers, hidden=hidden, heads=heads)
        return _hf_shape(args.model, seq_len=seq_len)
    if args.model in FAMILIES:
        return _family_shape_from_flags(args.model, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len)
    if args.model is not None:
        extra = [f for f, v in (("--layers", layers), ("--hidden", hidden), ("--heads", heads),
                                ("--seq-len", seq_len)) if v is not None]
        if extra and args.model in PRESETS:
            raise ConfigError(extra[0], getattr(args, extra[0][2:].replace("-", "_")),
                              f"not set with the preset {args.model!r} (its sizes are fixed)")
        return preset_shape(args.model)
    raise ConfigError("--model", None, f"a CONFIG, --model NAME ({', '.join(family_names())}, "
                      f"{', '.join(PRESETS)}), or --params with --layers/--hidden/--seq-len")


def _no_size_flags(args: argparse.Namespace, what: str, **values: int | None) -> None:
    for key, value in values.items():
        if value is not None:
            raise ConfigError(f"--{key}", getattr(args, key), f"not set with {what} (its sizes are fixed)")
    if args.vocab is not None:
        raise ConfigError("--vocab", args.vocab, f"not set with {what} (its sizes are fixed)")


def _hf_shape(model: str, *, seq_len: int | None) -> ModelShape:
    """``--model hf:DIR``: the exact shape of the causal LM DIR/config.json describes,
    built on the meta device by transformers (the `hf` family's shape)."""
    folder = model[len("hf:"):]
    what = "hf:DIR, DIR a Hugging Face model folder with a config.json"
    if not folder:
        raise ConfigError("--model", model, what)
    path = Path(folder).expanduser() / "config.json"
    if not path.parent.is_dir():
        raise ConfigError("--model", model, f"{what} (no folder {folder})")
    if not path.is_file():
        raise ConfigError("--model", model, f"{what} (no {path})")
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ConfigError("--model", model, f"{what} ({path} is not JSON: {reason})") from None
    family = get_family("hf")
    assert isinstance(family, HFFamily), "the registry's hf family"
    try:  # the family's checks (auto_map, a causal LM), then the meta build
        kwargs = family.resolve_kwargs({"path": str(path.parent), "init": "random"})
        # (default seq_len: the model's limit, at most DEFAULT_MAX_SEQ_LEN)
        return hf_shape(family.auto_config(kwargs), name=model, seq_len=seq_len, family=family, kwargs=kwargs)
    except ConfigError as exc:
        if not exc.field.startswith("model.kwargs"):
            raise
        raise ConfigError("--model", model, exc.allowed) from None


def _family_shape_from_flags(name: str, *, layers: int | None, hidden: int | None, heads: int | None,
                             seq_len: int | None) -> ModelShape:
    """A family's shape with its sizes from the flags (the rest its defaults)."""
    family = FAMILIES[name]
    return family.shape(family.planner_kwargs(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len))


def _from_config(args: argparse.Namespace) -> tuple[ModelShape, dict]:
    """The model and the defaults (batch, precision, optimizer, workers) from a job config."""
    from raytrain_platform.data.sources import SourceSpec, describe

    if args.model or args.params:
        raise ConfigError("--model" if args.model else "--params", args.model or args.params,
                          "not set with a CONFIG (change the model with --set model.kwargs.KEY=VALUE)")
    cfg = load_config(args.config, args.overrides)
    family, kwargs = get_family(cfg.model.name), cfg.model.kwargs
    if family.needs_data(kwargs):  # the data decides some sizes (the mlp's input and output)
        info = describe(SourceSpec.from_config(cfg))
        kwargs = family.fill_from_data(kwargs, num_features=info.num_features,
                                       num_classes=info.num_classes, task=cfg.model.resolved_task)
    try:
        shape = family.shape(kwargs, seq_len=cfg.seq_len)
    except ConfigError as exc:
        if exc.field.startswith(("model.kwargs", "config.json")):
            raise  # names the model's own setting (an hf config.json's model_type, a size)
        raise ConfigError("model.name", cfg.model.name, f"{exc.allowed} (for rtp plan)") from None
    t, s = cfg.train, cfg.scaling
    defaults: dict[str, Any] = {
        "global_batch": cfg.global_batch,
        "precision": t.precision, "optimizer": t.optimizer, "devices_per_node": s.num_workers,
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
        "refused": refused_splits(family, kwargs, shape, pp_schedule=cfg.parallel.pp_schedule,
                                  pp_split=cfg.parallel.pp_split)}
    if cfg.model.lora is not None:
        # counted on the model itself (a meta-device build): the modules the run adapts
        defaults["lora"] = model_lora_size(family.build(kwargs, device="meta"), cfg.model.lora,
                                           model_name=cfg.model.name)
    if t.objective == "dpo":  # the reference the run holds (--dpo overrides it)
        defaults["dpo_reference"] = dpo_reference(precompute_reference=t.dpo.precompute_reference,
                                                  lora=cfg.model.lora is not None)
    return shape, defaults


def _request(args: argparse.Namespace) -> dict[str, Any]:
    if args.config:
        shape, defaults = _from_config(args)
    else:
        if args.overrides:  # nothing to override: the flags describe the model and the run
            raise ConfigError("--set", args.overrides[0], "set only with a CONFIG (without one, give the "
                              "model and the run with --model, --layers, --precision, ...)")
        shape, defaults = _shape_from_flags(args), {}
        if args.model and args.model.startswith("hf:"):  # a Hugging Face folder: what its family runs
            defaults["refused"] = refused_splits(get_family("hf"), {"path": args.model[len("hf:"):]}, shape)
    if args.device_mem is None:
        raise ConfigError("--device-mem", None, SIZE_HELP)
    try:
        headroom = float(args.headroom)
    except ValueError:
        raise ConfigError("--headroom", args.headroom, "a fraction in [0, 1)") from None
    for flag, value in (("--precision", args.precision), ("--optimizer", args.optimizer)):
        allowed = ("fp32", "bf16") if flag == "--precision" else ("adamw", "sgd")
        if value is not None and value not in allowed:
            raise ConfigError(flag, value, f"one of {list(allowed)}")
    global_batch = _int("--global-batch", args.global_batch, defaults.get("global_batch"))
    if global_batch is None:
        raise ConfigError("--global-batch", None, "an integer >= 1 (samples per optimizer step)")
    ckpt = args.activation_checkpointing or defaults.get("activation_checkpointing", False)
    if ckpt and shape.kind != "transformer":
        raise ConfigError("--activation-checkpointing", True, "off for an mlp (it checkpoints transformer blocks)")
    return dict(model=shape, device_memory=parse_size("--device-mem", args.device_mem),
                devices_per_node=_int("--devices-per-node", args.devices_per_node,
                                      defaults.get("devices_per_node", 1)),
                nodes=_int("--nodes", args.nodes, 1), global_batch=global_batch,
                precision=args.precision or defaults.get("precision", "fp32"),
                optimizer=args.optimizer or defaults.get("optimizer", "adamw"),
                activation_checkpointing=ckpt, headroom=headroom,
                tp=_int("--tp", args.tp), pp=_int("--pp", args.pp), lora=_lora(args, shape, defaults),
                refused=defaults.get("refused", {}), dpo_reference=args.dpo or defaults.get("dpo_reference"))


def _lora(args: argparse.Namespace, shape: ModelShape, defaults: dict) -> LoraSize | None:
    """The adapters to plan: ``--lora-r`` (and ``--lora-targets``), or the config's model.lora."""
    if args.lora_r is None:
        if args.lora_targets is not None:
            raise ConfigError("--lora-targets", args.lora_targets, "set together with --lora-r")
        return defaults.get("lora")
    targets = DEFAULT_TARGETS if args.lora_targets is None else tuple(
        t.strip() for t in args.lora_targets.split(",") if t.strip())
    if not targets:
        raise ConfigError("--lora-targets", args.lora_targets, "comma-separated module names, like q_proj,v_proj")
    r = _int("--lora-r", args.lora_r)
    assert r is not None, "args.lora_r is set"
    try:
        if args.model and args.model.startswith("hf:"):  # counted on the model itself: MoE experts too
            lora = resolve_lora({"r": r, "target_modules": ALL_LINEAR if targets == DEFAULT_TARGETS else list(targets)})
            hf = get_family("hf")
            model = hf.build(hf.resolve_kwargs({"path": args.model[len("hf:"):]}), device="meta")
            return model_lora_size(model, lora, model_name="hf")
        return lora_size(shape, r=r, targets=targets)
    except ConfigError as exc:  # lora_size names model.lora's fields: name the flags typed instead
        if exc.field == "model.lora.target_modules":
            raise ConfigError("--lora-targets", exc.value, exc.allowed) from None
        if exc.field in ("model.lora", "model.lora.r"):  # a model without LoRA's Linear layers (an mlp)
            raise ConfigError("--lora-r", args.lora_r, exc.allowed) from None
        raise


def _fmt(n: int) -> str:
    for unit, size in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def plan_to_dict(plan: Plan) -> dict:
    req = plan.request
    # Full fine-tuning fits nowhere, LoRA does: its strategy and adapters.
    lora_recommended = None
    if plan.lora_option is not None:
        assert plan.lora_size is not None, "make_plan sets lora_option and lora_size together"
        lora_recommended = {**asdict(plan.lora_size), "option": plan.lora_option.to_dict()}
    return {"model": req.model.to_dict(),
            "request": {k: getattr(req, k) for k in ("device_memory", "devices_per_node", "nodes",
                                                     "global_batch", "precision", "optimizer",
                                                     "activation_checkpointing", "headroom", "tp", "pp")}
            | {"devices": req.devices, "budget": req.budget,
               "lora": None if req.lora is None else asdict(req.lora), "dpo_reference": req.dpo_reference},
            "options": [o.to_dict() for o in plan.options],
            "recommended": plan.recommended.strategy if plan.recommended else None,
            "reasons": list(plan.reasons), "warnings": list(plan.warnings),
            "lora_recommended": lora_recommended}


def _kv_heads(m: ModelShape) -> str:
    return f" ({m.n_kv_head} key/value)" if m.n_kv_head and m.n_kv_head != m.n_head else ""


def format_plan(plan: Plan) -> str:
    req, m = plan.request, plan.request.model
    lines = [f"model {m.name}: {m.num_params:,} parameters ({'exact' if m.exact else 'derived'}), "
             f"{m.n_layer} layers" + (f", hidden {m.hidden}, {m.n_head} heads{_kv_heads(m)}, seq {m.seq_len}"
                                       if m.kind == "transformer" else ""),
             f"devices: {req.nodes} node(s) x {req.devices_per_node} of {_fmt(req.device_memory)} "
             f"(usable {_fmt(req.budget)}); global batch {req.global_batch}; {req.precision}, "
             f"{req.optimizer}, activation checkpointing {'on' if req.activation_checkpointing else 'off'}",
             "memory per device (K/M/G/T = KiB/MiB/GiB/TiB):", ""]
    if req.lora is not None:
        lines.insert(2, f"LoRA: rank {req.lora.r} on {', '.join(req.lora.targets)}, {req.lora.params:,} trainable "
                        "parameters; the base is frozen (no gradients or optimizer state for it)")
    if req.dpo_reference is not None:
        ref = ("none (its base, adapters disabled)" if req.lora is not None else
               "a frozen copy sharded like the policy (its weights in 'other')" if req.dpo_reference == "copy"
               else f"none (log-probs precomputed: saves a frozen copy's {_fmt(4 * m.num_params)} of fp32 "
                    "weights, divided over the devices as the policy's)")
        lines.insert(2, f"DPO: each sample a pair, chosen and rejected in one forward; reference model: {ref}")
    if m.num_experts:
        lines.insert(1, f"experts: {m.expert_params:,} parameters in {m.num_experts} routed experts per layer, "
                        f"{m.experts_per_tok} used per token: {m.active_params:,} active parameters per token "
                        "(FSDP shards the experts with their layer)")
    lines[1:1] = list(m.notes)
    head = ("strategy", "dev", "dp", "tp", "pp", "shard", "micro x n", "params", "grads", "optim",
            "activ", "other", "total", "fits")
    rows = [head]
    for o in plan.options:
        if not o.applicable or o.layout is None or o.estimate is None:
            rows.append((LABELS[o.strategy], "-", "", "", "", "", "", "", "", "", "", "", "", f"n/a: {o.note}"))
            continue
        lay, est = o.layout, o.estimate
        rows.append((LABELS[o.strategy], str(lay.devices), str(lay.dp), str(lay.tp), str(lay.pp),
                     str(lay.shard), f"{lay.micro_batch} x {lay.micro_batches}", _fmt(est.params),
                     _fmt(est.grads), _fmt(est.optimizer), _fmt(est.activations), _fmt(est.overhead),
                     _fmt(est.total), "yes" if o.fits else "no"))
    widths = [max(len(r[i]) for r in rows if r[1] != "-" or i < 2) for i in range(len(head))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1])] + [r[-1]]
        lines.append("  ".join(cells).rstrip() if r[1] != "-" else f"{r[0].ljust(widths[0])}  {r[-1]}")
    rec = plan.recommended
    if rec is None and plan.lora_option is not None:
        lines += ["", f"recommended: LoRA with {LABELS[plan.lora_option.strategy]} (full fine-tuning fits nowhere)"]
    else:
        lines += ["", f"recommended: {LABELS[rec.strategy] if rec else 'nothing fits'}"]
    lines += [f"  - {reason}" for reason in plan.reasons]
    lines += ([""] + ["warnings:"] + [f"  - {w}" for w in plan.warnings] if plan.warnings else [])
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """The `rtp plan` command: raises `ConfigError` on bad input (the CLI prints one line)."""
    plan = make_plan(**_request(args))
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else format_plan(plan))
    return 0
