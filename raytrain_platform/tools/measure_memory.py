"""Check the memory model against real tensors: build a built-in model, wrap it with a
real strategy from the registry, run a real forward, backward and optimizer step, and
count the bytes each rank holds, next to what `estimate_memory` says.

Run it alone (``none``) or under torchrun (``ddp``, ``fsdp``; TP, PP and 2-D layouts
as ``--parallel``, a JSON list of ``parallel`` config sections), gloo on CPU:

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29731 -m raytrain_platform.tools.measure_memory --model gpt mlp --strategy ddp fsdp
    python -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 \\
        --master-port 29732 -m raytrain_platform.tools.measure_memory --model gpt \\
        --parallel '[{"tp_size": 2, "strategy": "fsdp"},
                     {"pp_size": 2, "strategy": "ddp", "pp_split": [1, 3]}]' \\
        --kwargs '{"n_layer": 4, "n_embd": 32, "n_head": 2, "block_size": 16}'

``--model``, ``--strategy`` and ``--parallel`` take several values; rank 0 prints one
JSON line per run and rank: ``{"measured": {...}, "estimated": {...}, "rank": ..., ...}``,
each rank's estimate for its own pipeline stage.
Activation bytes are measured too (tensors autograd saves, each storage once, the
parameters' own storages excluded) and compared with ``estimated_saved``: the
activation estimate plus, under bf16, autocast's weight copies, less, with activation
checkpointing, the block live again during its recompute. Not under PP (None): the
schedule frees each chunk's activations during its step.

>>> import json, subprocess, sys
>>> out = subprocess.run([sys.executable, "-m", "raytrain_platform.tools.measure_memory", "--model", "mlp"],
...                      capture_output=True, text=True, check=True).stdout
>>> json.loads(out)["measured"]["params"] > 0
True
"""

from __future__ import annotations

import json
import os
from typing import Any

from raytrain_platform.errors import OneLineParser
from raytrain_platform.models.registry import family_names, get_family
from raytrain_platform.parallel.memory import saved_activation_bytes, state_bytes

__all__ = ["state_bytes", "measure"]


def _build(model_name: str, kwargs: dict) -> tuple[Any, Any, Any]:
    from raytrain_platform.models.registry import get_family

    family = get_family(model_name)
    kwargs = family.resolve_kwargs(kwargs)
    return family.build(kwargs), family.shape(kwargs), family


def _batch(shape: Any, micro_batch: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    if shape.kind == "transformer":
        tokens = torch.randint(0, shape.vocab, (micro_batch, shape.seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(micro_batch, shape.widths[0], generator=g)
    return x, torch.randint(0, shape.widths[-1], (micro_batch,), generator=g)


def _layout(par: Any, world: int, micro_batch: int) -> tuple[Any, int]:
    """The planner's `Layout` of a `ParallelConfig` on `world` ranks, and this rank's pipeline rank."""
    import torch.distributed as dist

    from raytrain_platform.parallel.dims import PP_SCHEDULES, ParallelDims
    from raytrain_platform.plan.memory import Layout

    dims = ParallelDims(dp=world // (par.tp_size * par.pp_size), tp=par.tp_size, pp=par.pp_size)
    chunks = (par.pp_microbatches or par.pp_size) if par.pp_size > 1 else 1
    layout = Layout(dp=dims.dp, tp=dims.tp, pp=dims.pp, shard=dims.dp if par.strategy == "fsdp" else 1,
                    micro_batch=max(1, micro_batch // chunks), micro_batches=chunks,
                    stages_per_rank=PP_SCHEDULES[par.pp_schedule] if par.pp_size > 1 else 1,
                    pp_split=tuple(par.pp_split) if par.pp_split else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return layout, dims.coords(rank)[0]


def measure(*, model_name: str, strategy: str = "none", parallel: dict | None = None,
            optimizer: str = "adamw", precision: str = "fp32", micro_batch: int = 4,
            kwargs: dict | None = None) -> dict:
    """Measured and estimated bytes on this rank after one real training step.
    `parallel`: a ``parallel`` config section (TP/PP sizes...); default ``{"strategy": strategy}``."""
    import torch

    from raytrain_platform.config import ParallelConfig, TrainConfig
    from raytrain_platform.core.dist import DistEnv
    from raytrain_platform.core.optim import build_optimizer
    from raytrain_platform.models.tasks import get_task
    from raytrain_platform.parallel.compose import parallelize
    from raytrain_platform.plan.memory import estimate_memory

    torch.manual_seed(0)
    model, shape, family = _build(model_name, kwargs or {})
    env = DistEnv.current(use_gpu=False)
    par_cfg = ParallelConfig(**(parallel or {"strategy": strategy}))
    layout, pp_rank = _layout(par_cfg, env.world_size, micro_batch)
    # Before building: an impossible layout (TP of an mlp) is a ConfigError, not a crash.
    est = estimate_memory(model=shape, layout=layout, precision=precision, optimizer=optimizer,
                          activation_checkpointing=par_cfg.activation_checkpointing, pp_rank=pp_rank)
    wrapped = parallelize(model, env=env, cfg=par_cfg, family=family, model_kwargs=family.resolve_kwargs(kwargs or {}))
    opt = build_optimizer(wrapped.base, TrainConfig(max_steps=1, optimizer=optimizer, precision=precision))
    inputs, targets = _batch(shape, micro_batch)
    task = get_task("lm" if shape.kind == "transformer" else "classification")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    act_bytes: int | None = None
    if wrapped.pipeline is not None:  # the schedule runs forward and backward of every chunk
        with autocast:
            wrapped.pipeline.train(inputs, targets, task.loss)
    else:
        def forward() -> Any:
            with autocast:
                return task.loss(wrapped.module(inputs), targets)

        loss, act_bytes = saved_activation_bytes(forward, list(wrapped.base.parameters()))
        loss.backward()
    opt.step()
    measured = {**state_bytes(wrapped.base, opt), "activations": act_bytes}
    # What autograd saves under autocast includes the bf16 weight copies (overhead); with
    # activation checkpointing, not the block recomputed in backward.
    saved = est.activations - est.recomputed + dict(est.overhead_parts).get("bf16_weight_copies", 0)
    return {"estimated_saved": saved, "model": model_name, "strategy": par_cfg.strategy,
            "parallel": parallel or {"strategy": strategy}, "optimizer": optimizer, "precision": precision,
            "world_size": env.world_size, "rank": env.rank, "pp_rank": pp_rank,
            "num_params": shape.num_params, "measured": measured, "estimated": est.to_dict()}


def _print_all_ranks(result: dict) -> None:
    """Rank 0 prints every rank's result, one JSON line each."""
    import torch.distributed as dist

    rows = [result]
    if dist.is_initialized():
        rows = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(rows, result)
    if result["rank"] == 0:
        for row in rows:
            print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m raytrain_platform.tools.measure_memory")
    p.add_argument("--model", nargs="+", choices=family_names(), required=True)
    p.add_argument("--strategy", nargs="+", default=["none"])
    p.add_argument("--parallel", default=None,
                   help='JSON list of parallel sections, e.g. \'[{"tp_size": 2}]\' (instead of --strategy); '
                        'those with tp_size/pp_size > 1 run for models with blocks (gpt, hf)')
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--kwargs", default="{}", help="the model's model.kwargs as JSON (gpt sizes, hf path)")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    sections = json.loads(args.parallel) if args.parallel else [{"strategy": s} for s in args.strategy]
    for section in sections:  # one process group, a fresh model per run
        for model in args.model:
            family = get_family(model)
            if not family.has_blocks and section.get("tp_size", 1) * section.get("pp_size", 1) > 1:
                continue  # TP and PP split a model's blocks; an mlp has none
            # --kwargs are the transformer's; a model without blocks gets the synthetic data's sizes
            kwargs = json.loads(args.kwargs) if family.has_blocks else family.planner_kwargs(
                layers=None, hidden=None, heads=None, seq_len=None)
            _print_all_ranks(measure(model_name=model, parallel=section, optimizer=args.optimizer,
                                     precision=args.precision, micro_batch=args.micro_batch, kwargs=kwargs))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
