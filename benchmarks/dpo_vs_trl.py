"""Preference tuning (DPO, issue 49) through the platform and through TRL's
``DPOTrainer``, on the same model and pairs, at 1 and 2 processes: tokens/s, medians of
interleaved repeats.

    pip install -e '.[bench]'                  # trl, accelerate
    python benchmarks/dpo_vs_trl.py            # ~4 min on 2 quiet CPU cores (TRL's side)
    python benchmarks/dpo_vs_trl.py --smoke    # tiny, 1 repeat, writes nothing (a test)

The job: a Llama-style model from `raytrain_platform.tools.tiny_llm` (2 layers, d 128,
its 512-token BPE), the text-shaped pairs it writes (``preference.jsonl``: a stdlib
docstring chosen, a shuffled or cut copy rejected), ``seq_len`` 128 (each side of a
pair at most 129 tokens, the start kept), 4 pairs per process per step, beta 0.1,
sigmoid loss, the reference a frozen copy of the model, fp32, one torch thread per
process.

Sides, each at 1 and 2 processes (2: DDP on gloo, 127.0.0.1 only):

- ``trl``: `_trl_dpo.py`, ``DPOTrainer`` as a user runs it (``python``, or ``torchrun``
  for 2 processes with ``use_cpu``); TRL tokenizes the records itself.
- ``platform``: the same job on the Ray-free core (``torchrun -m raytrain_platform.core``)
  with ``train.objective: dpo``, its pairs tokenized once by the tokenizing pass (in the
  first process, before the timed steps). In a checkout without ``train.objective`` this
  side reports ``unavailable`` and no ratio is computed.

Figure: tokens per second = pairs per second (pairs per step over the median step time,
after the first 3 steps) x the mean real tokens of a pair (prompt + response on both
sides, as each side tokenized and truncated them; padding not counted). Ratios are
platform / TRL at the same process count.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, finish, free_port, harness_parser, rotated, torchrun_core  # noqa: E402

BENCH = ROOT / "benchmarks"
TRL_SCRIPT = BENCH / "_trl_dpo.py"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
SIZES = {
    "full": {"samples": 1000, "hidden": 128, "layers": 2, "seq_len": 128, "batch": 4, "steps": 30, "repeats": 3},
    "smoke": {"samples": 60, "hidden": 32, "layers": 1, "seq_len": 64, "batch": 2, "steps": 5, "repeats": 1},
}


def make_llm(folder: Path, size: dict) -> dict[str, Path]:
    from raytrain_platform.tools import tiny_llm

    return tiny_llm.make_all(folder, samples=size["samples"], hidden_size=size["hidden"],
                             num_layers=size["layers"], intermediate_size=2 * size["hidden"])


def trl_run(llm: dict[str, Path], processes: int, size: dict, work: Path, name: str) -> dict:
    out = work / f"{name}.json"
    script = [str(TRL_SCRIPT), "--model", str(llm["model"]), "--data", str(llm["preference"]),
              "--seq-len", str(size["seq_len"]), "--batch-size", str(size["batch"]), "--steps", str(size["steps"]),
              "--warmup", "3" if size["steps"] > 3 else "0", "--work", str(work / name), "--out", str(out)]
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    proc = subprocess.run([*launch, *script], cwd=ROOT, env={**os.environ, **OFFLINE_ENV}, capture_output=True,
                          text=True, timeout=900, check=False)
    if proc.returncode:
        raise RuntimeError(f"{name}: TRL failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(out.read_text())
    if got["processes"] != processes:
        raise RuntimeError(f"{name}: asked for {processes} processes, TRL ran {got['processes']}")
    return got


def platform_available() -> bool:
    """Whether this checkout's config has ``train.objective`` (issue 49's training side)."""
    from raytrain_platform.config.train_section import TrainConfig

    return "objective" in {f.name for f in fields(TrainConfig)}


def _pair_tokens(llm: dict[str, Path], size: dict) -> float:
    """Mean real tokens of a pair as the platform encodes them: each side's tokens up to
    its last trained one (responses end the rows; padding follows)."""
    import numpy as np

    from raytrain_platform.data.encode import load_tokenizer
    from raytrain_platform.data.preference import PairSpec, encode_pairs

    records = [json.loads(line) for line in Path(llm["preference"]).read_text().splitlines() if line.strip()]
    tok = load_tokenizer(str(llm["tokenizer"]), need_chat_template=False)
    rows, _ = encode_pairs(tok, records, PairSpec(row_len=size["seq_len"] + 1), np.arange(len(records)))
    width = rows["chosen_mask"].shape[1]
    ends = [width - m[:, ::-1].argmax(axis=1) for m in (rows["chosen_mask"], rows["rejected_mask"])]
    return float((ends[0] + ends[1]).mean())


def platform_run(llm: dict[str, Path], processes: int, size: dict, work: Path, name: str) -> dict:
    """The platform's side (see the module docstring)."""
    import yaml

    from raytrain_platform.core.rundir import read_metrics

    if not platform_available():
        return {"unavailable": "train.objective comes with issue 49's training side (h-dpo)"}
    cfg = yaml.safe_load((ROOT / "pipelines/configs/dpo.yaml").read_text())
    cfg["model"]["kwargs"]["path"] = str(llm["model"])
    cfg["data"].update(path=str(llm["preference"]), seq_len=size["seq_len"], batch_size=size["batch"],
                       val_fraction=0.0)
    cfg["train"].update(max_steps=size["steps"], warmup_steps=0, lr=1e-4)
    cfg["parallel"]["strategy"] = "none" if processes == 1 else "ddp"
    cfg["scaling"]["num_workers"] = processes
    cfg["run"].update(name=name, storage_path=str(work), checkpoint_every=0, eval_every=0)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    torchrun_core(processes, path, label=name)
    rows = read_metrics(work / name)[3:]
    pairs_per_s = statistics.median(r["samples_per_s"] for r in rows)
    tokens = _pair_tokens(llm, size)
    return {"processes": processes, "pairs_per_s": pairs_per_s, "tokens_per_pair": tokens,
            "tokens_per_s": pairs_per_s * tokens}


def summarize(runs: dict[str, list[dict]], processes: list[int]) -> dict:
    out: dict = {}
    for n in processes:
        for side in ("trl", "platform"):
            got = [r for r in runs[f"{side}_{n}"] if "tokens_per_s" in r]
            out[f"{side}_{n}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in got) if got else None
            out[f"{side}_{n}_tokens_per_pair"] = got[0]["tokens_per_pair"] if got else None
        t, p = out[f"trl_{n}_tokens_per_s"], out[f"platform_{n}_tokens_per_s"]
        out[f"ratio_{n}"] = p / t if t and p else None
    return out


def table(result: dict, processes: list[int]) -> str:
    s = result["summary"]
    lines = ["| processes | TRL tokens/s | platform tokens/s | platform / TRL | tokens per pair (TRL, platform) |",
             "|---|---|---|---|---|"]
    for n in processes:
        def fmt(v, spec=".0f"):
            return "not measured" if v is None else format(v, spec)
        lines.append(f"| {n} | {fmt(s[f'trl_{n}_tokens_per_s'])} | {fmt(s[f'platform_{n}_tokens_per_s'])} | "
                     f"{fmt(s[f'ratio_{n}'], '.3f')} | {fmt(s[f'trl_{n}_tokens_per_pair'], '.1f')}, "
                     f"{fmt(s[f'platform_{n}_tokens_per_pair'], '.1f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = harness_parser(__doc__, out=BENCH / "dpo_vs_trl.json", page="dpo-vs-trl")
    p.add_argument("--processes", default="1,2", help="comma-separated process counts")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    processes = [int(x) for x in args.processes.split(",")]
    with tempfile.TemporaryDirectory(prefix="rtp-dpo-vs-trl-") as tmp:
        work = Path(tmp)
        llm = make_llm(work / "llm", size)
        sides = {f"{side}_{n}": (lambda tag, side=side, n=n: (trl_run if side == "trl" else platform_run)(
            llm, n, size, work, f"{side}_{n}_{tag}")) for n in processes for side in ("trl", "platform")}
        runs = rotated(sides, args.repeats or size["repeats"], 0.0 if args.smoke else 3.0,
                       lambda runs, done: None, label="dpo_vs_trl")
    result = {"size": size, "runs": runs, "summary": summarize(runs, processes)}
    finish(args, result, script=__file__, argv=argv, title="DPO: the platform vs TRL's DPOTrainer",
           table=table(result, processes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
