"""Replica memory for N LoRA runs over one base: the shared base with N adapters
(serve/adapters.py, what a replica does) against N merged models (what serving each
run's export would hold).

    python benchmarks/lora_serving.py                   # gpt of ~25M parameters, N = 1, 2, 4, 8
    python benchmarks/lora_serving.py --smoke           # a tiny gpt, N = 2 (what the tests run)

N LoRA runs are trained first (3 steps each, the Ray-free core, in this process; all
on the same base: gpt, seed 0; their adapters differ by learning rate). Each side and N
then loads in a fresh process, as a replica would, and reports:

- ``rss_mib``: resident set growth while loading the N models (after the imports both
  sides need), the replica's memory as the OS sees it;
- ``tensor_mib``: bytes of distinct tensor storages the loaded models hold (shared
  storages once).

Writes benchmarks/lora_serving.json (``--out``; not with --smoke) and prints a table;
``--page`` also writes it to benchmarks/results/lora-serving-DATE.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from common import ROOT, finish, harness_parser


def _train(root: Path, name: str, *, kwargs: dict, lr: float) -> Path:
    from raytrain_platform.core.__main__ import main as core_main

    cfg = {"model": {"name": "gpt", "kwargs": kwargs, "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}},
           "data": {"source": "synthetic", "batch_size": 2, "num_samples": 64, "val_fraction": 0.0},
           "train": {"max_steps": 3, "lr": lr, "seed": 0},
           "scaling": {"torch_threads": 1},
           "run": {"name": name, "storage_path": str(root), "checkpoint_every": 0, "eval_every": 0}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert core_main(["--config", str(path)]) == 0
    return root / name


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(side: str, runs: list[str]) -> dict:
    """In this (fresh) process: load `runs` as one replica would, on `side`."""
    import gc

    import peft  # noqa: F401  imported before measuring: both sides use it, it is not model memory
    import torch

    import raytrain_platform.core.adapters  # noqa: F401
    import raytrain_platform.core.sharded  # noqa: F401
    from raytrain_platform.inference import load_model_for_inference
    from raytrain_platform.serve.adapters import SharedBases

    torch.set_num_threads(1)
    gc.collect()
    before = _rss()
    if side == "merged":
        models = [load_model_for_inference(run)[0] for run in runs]
    else:
        bases = SharedBases()
        models = [bases.load(f"run{i}", run) for i, run in enumerate(runs)]
    gc.collect()
    grown = _rss() - before
    storages = {}
    for model in models:
        for t in list(model.parameters()) + list(model.buffers()):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return {"side": side, "n": len(runs), "rss_mib": round(grown / 2**20, 1),
            "tensor_mib": round(sum(storages.values()) / 2**20, 1)}


def main(argv: list[str] | None = None) -> None:
    # One load per side and N (no --repeats: memory, not time); --smoke: a tiny gpt, N = 2.
    p = harness_parser(__doc__, out=ROOT / "benchmarks" / "lora_serving.json", page="lora-serving",
                       repeats=False)
    p.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)  # internal: SIDE RUN...
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1:])))
        return
    kwargs = ({"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16} if args.smoke else
              {"n_layer": 8, "n_embd": 512, "n_head": 8, "block_size": 64})
    counts = [2] if args.smoke else [1, 2, 4, 8]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [str(_train(Path(tmp), f"run{i}", kwargs=kwargs, lr=0.01 * (i + 1))) for i in range(max(counts))]
        for n in counts:
            for side in ("merged", "shared"):
                out = subprocess.run([sys.executable, __file__, "--measure", side, *runs[:n]], cwd=ROOT,
                                     capture_output=True, text=True, check=True, timeout=600)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = ["| side | N | RSS growth (MiB) | tensor storage (MiB) |", "|---|---|---|---|"]
    table += [f"| {r['side']} | {r['n']} | {r['rss_mib']} | {r['tensor_mib']} |" for r in rows]
    big = [r for r in rows if r["n"] == max(counts)]
    merged, shared = (next(r for r in big if r["side"] == s) for s in ("merged", "shared"))
    table += ["", f"N = {max(counts)}: shared base {shared['rss_mib']} MiB vs merged {merged['rss_mib']} MiB "
                  f"({merged['rss_mib'] / max(shared['rss_mib'], 0.1):.1f}x)"]
    finish(args, {"kwargs": kwargs, "rows": rows}, script=__file__, argv=argv,
           title="Replica memory for N LoRA runs: a shared base against merged models", table="\n".join(table))


if __name__ == "__main__":
    main()
