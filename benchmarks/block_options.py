"""Activation checkpointing and compile, alone and together, side by side on
`vs_accelerate.py`'s fine-tune in one process: tokens/s, and the activation bytes
autograd keeps for backward.

    python benchmarks/block_options.py            # 3 rotated repeats, ~8 min on 2 CPU cores; writes benchmarks/block_options.json
    python benchmarks/block_options.py --smoke    # the smoke model, 1 repeat (nothing written unless --out)

The job is `vs_accelerate.py`'s (tiny_llm's Llama, 4 layers x d 256, 4 heads / 2 KV
heads, 512-token BPE, chat JSONL of 2,000 records, 256-token windows, micro-batch 8,
fp32, 40 steps; tokens/s of the median step after the first 3, so that a compiled
side's compiling first step is left out), on the Ray-free core under torchrun with one
process and one torch thread: the block options change each process's compute, and one
process keeps DDP's all-reduce and Ray's own processes out of the figure. Sides:

- ``eager``;
- ``checkpointed``: ``parallel.activation_checkpointing`` (the eager wrapper per layer);
- ``compiled``: ``parallel.compile`` (each layer compiled, TorchInductor);
- ``both``: each layer compiled to recompute inside its own graph (parallel/compile.py).

Repeats rotate the order. Inductor's cache is the benchmark's own temporary folder, so
the first repeat's compiled sides compile cold and later ones load it; neither is in
tokens/s. Every side trains the same windows from the same weights: the losses agree
within compile's rounding (``loss_max_abs_diff`` against eager, every run).

Activation bytes: one micro-batch (8 x 256 tokens) through the model as each side
builds it (`parallelize`), counted by `parallel/memory.py`'s `saved_activation_bytes`
(each storage once, the weights left out), in this process, in the order above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import in_temp_folder, rotated, stamp, torchrun_core, write_result  # noqa: E402
import vs_accelerate as va  # noqa: E402

BENCH = Path(__file__).resolve().parent
SIDES = {"eager": {}, "checkpointed": {"activation_checkpointing": True}, "compiled": {"compile": True},
         "both": {"activation_checkpointing": True, "compile": True}}


def run(llm: Path, size: dict, storage: Path, name: str, options: dict) -> dict:
    """One run of vs_accelerate's config on the torchrun core, 1 process, with `options`."""
    import yaml

    from raytrain_platform.core.rundir import read_metrics

    config = va.platform_config(llm, 1, size, storage, name)
    config["parallel"].update(options)
    path = storage / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    torchrun_core(1, path, label=name)
    figures = va._platform_figures(read_metrics(storage / name), 1, size)
    return {k: figures[k] for k in ("tokens_per_s", "step_s", "losses")}


def activation_bytes(llm: Path, size: dict) -> dict[str, int]:
    """Bytes autograd keeps for one micro-batch's backward, the model built as each side builds it."""
    import torch

    from raytrain_platform.config import ParallelConfig
    from raytrain_platform.core.dist import DistEnv
    from raytrain_platform.models import get_family
    from raytrain_platform.parallel.compose import parallelize
    from raytrain_platform.parallel.memory import saved_activation_bytes

    torch.set_num_threads(1)
    family = get_family("hf")
    kwargs = family.resolve_kwargs({"path": str(llm / "model"), "init": "pretrained"})
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq_len"]), generator=torch.Generator().manual_seed(0))
    out = {}
    for side, options in SIDES.items():
        model = parallelize(family.build(kwargs), env=env, cfg=ParallelConfig(strategy="none", **options),
                            family=family, model_kwargs=kwargs).module
        _, out[side] = saved_activation_bytes(lambda: model(ids), list(model.parameters()))
    return out


def measure(work: Path, *, smoke: bool, repeats: int, partial: Path | None) -> dict:
    size = {**va.SIZES["smoke" if smoke else "full"], "vocab": 512}
    os.environ.update(va.OFFLINE_ENV)
    os.environ["RTP_CACHE_DIR"] = str(work / "token-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    llm = va.make_llm(work / "tiny-llm", size)
    sides = {side: lambda suffix, side=side: run(llm, size, work / "runs", f"{side}_{suffix}", SIDES[side])
             for side in SIDES}

    def summary(runs: dict[str, list[dict]], done: int) -> dict:
        med = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
        eager = runs["eager"][0]["losses"]
        return {**stamp(), "job": "vs_accelerate.py's fine-tune, 1 process on the torchrun core (512-token BPE)",
                "size": size, "repeats": repeats, "complete": done == repeats, "runs": runs,
                "tokens_per_s_median": {k: round(v, 1) for k, v in med.items()},
                "over_eager": {k: round(v / med["eager"], 3) for k, v in med.items()},
                "both_over_checkpointed": round(med["both"] / med["checkpointed"], 3),
                "loss_max_abs_diff": max(abs(x - y) for rs in runs.values() for r in rs
                                         for x, y in zip(r["losses"], eager))}

    def after_repeat(runs: dict[str, list[dict]], done: int) -> None:
        write_result(summary(runs, done), partial)  # a long run keeps what it has

    runs = rotated(sides, repeats, size["settle_s"], after_repeat, label="block options")
    return {**summary(runs, repeats), "activation_bytes": activation_bytes(llm, size)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the smoke model, 1 repeat (checks it runs)")
    p.add_argument("--repeats", type=int, default=None, help="rotated repeats (default 3; smoke 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result (default benchmarks/block_options.json; with --smoke: none)")
    args = p.parse_args(argv)
    out = args.out or (None if args.smoke else BENCH / "block_options.json")
    result = in_temp_folder("block_options.py", argv, lambda folder: measure(
        folder, smoke=args.smoke, repeats=args.repeats or (1 if args.smoke else 3), partial=out))
    print(json.dumps({k: result[k] for k in ("tokens_per_s_median", "over_eager", "both_over_checkpointed",
                                             "activation_bytes", "loss_max_abs_diff")}))
    write_result(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
