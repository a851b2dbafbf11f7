"""``data.packing: documents`` against TRL's best-fit packing and against ``concat``:
the padding share of the windows, and tokens/s of training steps.

    python benchmarks/packing.py            # ~1 min on 2 quiet CPU cores
    python benchmarks/packing.py --smoke    # tiny, writes nothing

Records: the chat JSONL of `tools/tiny_llm.py` (stdlib docstring Q/A pairs, its 512-token
tokenizer), every record a document (val_fraction 0). Padding: our windows
(`jsonl.jsonl_windows`, best-fit decreasing over 512 documents at a time) against
TRL's ``pack_dataset(strategy="bfd")`` on the same documents (token ids as the platform
encodes them) with ``seq_length`` = our window's tokens, its rows counted as windows of
that length (TRL's padding-free collator pads none, but its rows then differ in length).
Steps: a Llama from `tools/tiny_llm.py` on the Ray-free engine in this process, one
engine per packing, 5-step phases alternating; tokens/s counts window positions, padding
included, and the counted (trained-on) targets per second beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, load_avg, stamp  # noqa: E402

SIZES = {
    "full": {"samples": 2000, "windows": [128, 256, 1024], "hidden": 128, "layers": 2, "seq_len": 256, "batch": 8,
             "warmup": 2, "phases": 6, "phase": 5},
    "smoke": {"samples": 100, "windows": [128], "hidden": 32, "layers": 1, "seq_len": 64, "batch": 2,
              "warmup": 1, "phases": 2, "phase": 1},
}


def padding(llm: dict, context: int) -> dict:
    """Padding share of our documents windows and of TRL's best-fit rows, `context` + 1 tokens each."""
    import dataclasses

    from raytrain_platform.data.encode import encode_record, load_tokenizer
    from raytrain_platform.data.sources import SourceSpec, local_windows

    spec = SourceSpec(kind="jsonl", task="lm", path=str(llm["chat"]), format="chat", tokenizer=str(llm["tokenizer"]),
                      seq_len=context + 1, val_fraction=0.0, packing="documents",
                      cache_root=str(Path(llm["chat"]).parent / "datasets"))
    tok = load_tokenizer(spec.tokenizer, need_chat_template=True)
    docs = [encode_record(tok, json.loads(line), spec.token_spec())[0]
            for line in Path(spec.path).read_text().splitlines()]
    kept = sum(min(len(d), spec.seq_len) for d in docs)
    ours = len(local_windows(spec, "train")["sample_id"])
    concat = len(local_windows(dataclasses.replace(spec, packing="concat"), "train")["sample_id"])
    out = {"window_tokens": spec.seq_len, "documents": len(docs), "truncated": sum(len(d) > spec.seq_len for d in docs),
           "ours_windows": ours, "ours_padding": round(1 - kept / (ours * spec.seq_len), 4), "concat_windows": concat}
    try:
        from datasets import Dataset
        from trl import pack_dataset
    except ImportError:
        return {**out, "trl": "not installed"}
    rows = pack_dataset(Dataset.from_dict({"input_ids": docs}), seq_length=spec.seq_len, strategy="bfd")
    trl_tokens = sum(len(r) for r in rows["input_ids"])
    assert trl_tokens == kept, (trl_tokens, kept)  # both keep each document, cut to the window
    return {**out, "trl_rows": len(rows), "trl_padding": round(1 - kept / (len(rows) * spec.seq_len), 4)}


def _config(llm: dict, size: dict, storage: Path, packing: str) -> dict:
    return {
        "model": {"name": "hf", "kwargs": {"path": str(llm["model"]), "init": "pretrained"}},
        "data": {"source": "jsonl", "path": str(llm["chat"]), "format": "chat", "packing": packing,
                 "seq_len": size["seq_len"], "batch_size": size["batch"], "val_fraction": 0.0},
        "train": {"max_steps": 1000, "lr": 1e-3, "lr_schedule": "constant", "grad_clip": 1.0, "seed": 0},
        "scaling": {"num_workers": 1, "torch_threads": 1},
        "run": {"name": packing, "storage_path": str(storage), "checkpoint_every": 0, "eval_every": 0},
    }


def steps(llm: dict, size: dict, work: Path) -> dict:
    """Median step time of each packing, phases alternating, and what it trains on."""
    import torch
    import yaml

    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.resolve import resolve_job

    torch.set_num_threads(1)
    env = init_torchrun(use_gpu=False)
    runs = {}
    for packing in ("documents", "concat"):
        path = work / f"{packing}.yaml"
        path.write_text(yaml.safe_dump(_config(llm, size, work / "runs", packing)))
        job = resolve_job(load_config(path))
        source = LocalBatches(job, rank=0, world_size=1)
        runs[packing] = {"engine": Engine(job, env), "batches": _forever(source), "times": [], "counted": 0,
                         "positions": 0}

    def step(packing: str) -> None:
        run = runs[packing]
        engine = run["engine"]
        batch = engine._to_device(next(run["batches"]))
        targets = engine.task.split(batch)[1]
        run["counted"] += engine.task.num_targets(targets)
        run["positions"] += targets.numel()
        t0 = time.perf_counter()
        engine.train_step([batch], started=t0, data_wait=0.0)
        run["times"].append(time.perf_counter() - t0)

    for packing in runs:
        for _ in range(size["warmup"]):
            step(packing)
        runs[packing].update(times=[], counted=0, positions=0)
    for i in range(size["phases"]):
        packing = ("documents", "concat")[i % 2]
        for _ in range(size["phase"]):
            step(packing)
        print(f"phase {i + 1}/{size['phases']} ({packing}): median "
              f"{statistics.median(runs[packing]['times'][-size['phase']:]):.3f}s, load {load_avg():.1f}", flush=True)
    out = {}
    for packing, run in runs.items():
        step_s = statistics.median(run["times"])
        counted_share = run["counted"] / run["positions"]
        out[packing] = {"step_s": round(step_s, 4), "tokens_per_s": round(size["batch"] * size["seq_len"] / step_s, 1),
                        "counted_share": round(counted_share, 3),
                        "counted_per_s": round(size["batch"] * size["seq_len"] * counted_share / step_s, 1),
                        "steps": len(run["times"])}
    return out


def _forever(source):
    epoch = 0
    while True:
        yield from source.train_epoch(epoch)
        epoch += 1


def report(result: dict) -> str:
    lines = [f"# data.packing: documents vs TRL best-fit and vs concat ({result['date']})", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"Load (1 min) at start: {result['load_avg_1m']}; took {result['seconds']} s", "",
             "## Padding share (the same records and token ids)", "",
             f"{result['padding'][0]['documents']} chat records of tools/tiny_llm, each a document.", "",
             "| window tokens | truncated documents | ours: windows | ours: padding | TRL bfd: rows | "
             "TRL bfd: padding (rows as windows) | concat: windows |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in result["padding"]:
        trl = (f"{p['trl_rows']} | {p['trl_padding']:.2%}" if "trl_rows" in p else "n/a | n/a (trl not installed)")
        lines.append(f"| {p['window_tokens']} | {p['truncated']} | {p['ours_windows']} | {p['ours_padding']:.2%} | "
                     f"{trl} | {p['concat_windows']} |")
    s = result["steps"]
    lines += ["", f"## Training steps ({result['job']})", "",
              "| packing | median step s | tokens/s (window positions) | counted share | counted targets/s |",
              "|---|---:|---:|---:|---:|"]
    for packing, r in s.items():
        lines.append(f"| {packing} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['counted_share']:.1%} | "
                     f"{r['counted_per_s']:,.0f} |")
    ratio = s["documents"]["tokens_per_s"] / s["concat"]["tokens_per_s"]
    lines += ["", f"documents / concat tokens/s: {ratio:.3f} ({s['documents']['steps']} timed steps each, "
              "phases alternating)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; writes nothing")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from raytrain_platform.tools.tiny_llm import make_all

    t0 = time.perf_counter()
    result = {**stamp(), "command": " ".join(["python benchmarks/packing.py", *(argv or sys.argv[1:])]),
              "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                         f"Python {platform.python_version()}",
              "job": f"tiny_llm llama {size['layers']} layers x d {size['hidden']}, chat JSONL, seq {size['seq_len']}, "
                     f"micro-batch {size['batch']}, fp32, sdpa, 1 process, 1 thread"}
    with tempfile.TemporaryDirectory(prefix="rtp-packing-") as tmp:
        llm = make_all(Path(tmp) / "llm", samples=size["samples"], num_layers=size["layers"],
                       hidden_size=size["hidden"], num_heads=4, num_kv_heads=2, intermediate_size=2 * size["hidden"])
        result["padding"] = [padding(llm, w) for w in size["windows"]]
        result["steps"] = steps(llm, size, Path(tmp))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    text = report(result)
    print(text)
    if not args.smoke:
        out = ROOT / "benchmarks" / "results" / f"packing-{time.strftime('%Y-%m-%d')}.md"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
