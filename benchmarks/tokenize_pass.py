"""The tokenizing pass (data/tokenize_pass.py) against two anchors on the same cores, and
the first step's latency before and after it.

Corpus: a JSONL of real text, the standard library's sources one file per record
(``data.format: text``), repeated to ``--mb`` megabytes; the tiny_llm tokenizer.

Sides, interleaved, each repeat on a fresh cache folder (so every pass tokenizes):

- ``pass``: the platform's pass on an embedded Ray of ``--cpus`` CPUs: ranges tokenized
  side by side, packed per file, windows written as Parquet (`describe(spec)`).
- ``ray_data``: plain ``ray.data.read_json(path).map_batches(tokenize)`` on the same Ray,
  consumed and dropped (no packing, nothing written): the goal is >= 0.9x of it.
- ``datasets``: ``datasets.Dataset.from_json(path).map(tokenize, batched=True,
  num_proc=CPUS)``, in its own cache folder.

Tokens/s is each side's tokens over its wall time. With ``--before CHECKOUT`` (a
checkout of the platform before the pass, e.g. ``git worktree add /tmp/old 5ebb169``),
also the first step's latency: ``rtp train`` of a tiny model on the corpus, from the
command's start to its first step line, with this checkout and with that one (its
driver counted the windows first; its token cache in a fresh folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (ROOT, compare, finish, harness_parser, interleaved, local_ray,  # noqa: E402
                               median)

SIZES = {"full": {"mb": 100, "repeats": 2}, "smoke": {"mb": 1, "repeats": 1}}
SEQ_LEN = 1024


def write_corpus(path: Path, mb: float) -> int:
    """The stdlib's .py files as {"text": ...} records, in order, repeated to `mb` MB; records."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    target, written, records = int(mb * 1e6), 0, 0
    with path.open("w") as f:
        while written < target:
            for p in files:
                line = json.dumps({"text": p.read_text(errors="replace")}) + "\n"
                f.write(line)
                written, records = written + len(line.encode()), records + 1
                if written >= target:
                    break
    return records


def _spec(corpus: Path, tok: Path, cache: Path):
    from raytrain_platform.data.sources import SourceSpec

    return SourceSpec(kind="jsonl", task="lm", val_fraction=0.01, seq_len=SEQ_LEN + 1, path=str(corpus),
                      format="text", tokenizer=str(tok), packing="concat", cache_root=str(cache))


def side_pass(corpus: Path, tok: Path, work: Path, i: int) -> dict:
    from raytrain_platform.data.prepared import load_manifest
    from raytrain_platform.data.sources import describe

    t0 = time.perf_counter()
    info = describe(_spec(corpus, tok, work / f"pass-{i}"), on_ray=True)
    seconds = time.perf_counter() - t0
    tokens = load_manifest(info.prepared).content["tokens"]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "windows": info.num_train}


def _tokenize_batch(batch: dict, tok_dir: str) -> dict:
    import numpy as np

    from raytrain_platform.data.encode import load_tokenizer

    tok = load_tokenizer(tok_dir, need_chat_template=False)
    ids = tok(list(batch["text"]), add_special_tokens=False)["input_ids"]
    return {"tokens": np.array([len(x) + 1 for x in ids])}  # + EOS, as the pass counts


def side_ray_data(corpus: Path, tok: Path, work: Path, i: int) -> dict:
    import ray.data

    t0 = time.perf_counter()
    ds = ray.data.read_json(str(corpus)).map_batches(_tokenize_batch, fn_kwargs={"tok_dir": str(tok)},
                                                     batch_size=64, batch_format="numpy")
    tokens = sum(int(b["tokens"].sum()) for b in ds.iter_batches(batch_size=None, batch_format="numpy"))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def side_datasets(corpus: Path, tok: Path, work: Path, i: int, cpus: int) -> dict:
    import datasets

    from raytrain_platform.data.encode import load_tokenizer

    def tokenize(batch: dict) -> dict:
        ids = load_tokenizer(str(tok), need_chat_template=False)(batch["text"], add_special_tokens=False)
        return {"n": [len(x) + 1 for x in ids["input_ids"]]}

    datasets.disable_progress_bars()
    cache = work / f"datasets-{i}"
    t0 = time.perf_counter()
    ds = datasets.Dataset.from_json(str(corpus), cache_dir=str(cache))
    out = ds.map(tokenize, batched=True, batch_size=64, num_proc=cpus, remove_columns=["text"],
                 cache_file_name=str(cache / "mapped.arrow"))
    tokens = int(sum(out["n"]))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def first_step(checkout: Path, corpus: Path, tiny: dict, work: Path, label: str) -> dict:
    """`rtp train` of the tiny model on the corpus from `checkout`: seconds to its first step."""
    import yaml

    cfg = {"model": {"name": "hf", "kwargs": {"path": str(tiny["model"])}},
           "data": {"source": "jsonl", "path": str(corpus), "format": "text", "batch_size": 2, "seq_len": 256,
                    "val_fraction": 0.01},
           "train": {"max_steps": 2}, "scaling": {"cpus_per_worker": 1},
           "run": {"name": label, "storage_path": str(work / f"runs-{label}"), "eval_every": 100,
                   "checkpoint_every": 100}}
    path = work / f"{label}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(checkout), "RTP_CACHE_DIR": str(work / f"token-cache-{label}"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_platform", "train", str(path)], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first is None and line.startswith("step ") and "loss" in line:
            first = time.perf_counter() - t0
    proc.wait()
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{label}: rtp train failed:\n{''.join(lines[-30:])}")
    return {"first_step_s": first, "total_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = harness_parser(__doc__, page="tokenize-pass")
    p.add_argument("--mb", type=float, default=None, help="corpus size in MB (default 100; smoke 1)")
    p.add_argument("--cpus", type=int, default=2, help="the embedded Ray's CPUs, and datasets' num_proc")
    p.add_argument("--before", type=Path, default=None, help="a checkout from before the pass: first-step latency")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    mb, repeats = args.mb or size["mb"], args.repeats or size["repeats"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from raytrain_platform.tools.tiny_llm import make_all

    with tempfile.TemporaryDirectory(prefix="rtp-tokpass-") as tmp:
        work = Path(tmp)
        corpus = work / "corpus.jsonl"
        records = write_corpus(corpus, mb)
        tiny = make_all(work / "tiny", samples=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
        tok = Path(tiny["tokenizer"])
        local_ray(args.cpus)
        side_ray_data(corpus, tok, work, -1)  # warm: the workers import transformers once, for every side
        runs = interleaved({"pass": lambda i: side_pass(corpus, tok, work, i),
                            "ray_data": lambda i: side_ray_data(corpus, tok, work, i),
                            "datasets": lambda i: side_datasets(corpus, tok, work, i, args.cpus)}, repeats)
        counted = {side: {r["tokens"] for r in rows} for side, rows in runs.items()}
        if len(set().union(*counted.values())) != 1:  # the same work on every side, or the ratio means nothing
            raise RuntimeError(f"the sides counted different tokens: {counted}")
        result = {"corpus_mb": mb, "records": records, "cpus": args.cpus, "runs": runs,
                  "tokens_per_s": compare(runs, "tokens_per_s", "ray_data")}
        import ray

        ray.shutdown()
        if args.before:
            result["first_step"] = {label: first_step(checkout, corpus, tiny, work, label)
                                    for label, checkout in (("before", args.before.resolve()), ("after", ROOT))}
    med, ratio = result["tokens_per_s"]["median"], result["tokens_per_s"]["ratio"]
    rows = [f"| {side} | {median(runs[side], 'seconds'):.1f} | {med[side]:,.0f} | {ratio[side]:.2f}x |"
            for side in runs]
    table = (f"{mb:g} MB JSONL ({records:,} records of the stdlib's sources, `data.format: text`), tiny_llm "
             f"tokenizer, {args.cpus} CPUs, median of {repeats} interleaved repeat(s):\n\n"
             "| side | seconds | tokens/s | vs ray_data |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if "first_step" in result:
        fs = result["first_step"]
        table += ("\nFirst step of `rtp train` (tiny model, 2 steps), from the command's start:\n\n"
                  "| checkout | first step (s) | whole run (s) |\n|---|---|---|\n" +
                  "\n".join(f"| {k} | {v['first_step_s']:.1f} | {v['total_s']:.1f} |" for k, v in fs.items()) + "\n")
    finish(args, result, script=__file__, argv=argv, title="The tokenizing pass against Ray Data and datasets.map",
           table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
