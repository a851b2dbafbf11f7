"""`rtp eval`: arguments, checks before any model is loaded (bad input: one line, exit
2), the evaluation, a line per task, the results file.

    rtp eval runs/ft --tasks docmc --include eval_tasks/
    rtp eval runs/ft/export --tasks eval_tasks/docmc.yaml --limit 50
    rtp eval runs/ft --tasks docmc --include eval_tasks/ --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from raytrain_platform.errors import ConfigError
from raytrain_platform.evaluation.harness import EvalSpec, evaluate
from raytrain_platform.evaluation.record import record_results
from raytrain_platform.evaluation.target import prepared_target
from raytrain_platform.evaluation.tasks import check_loadable, check_tasks

__all__ = ["add_eval_arguments", "run_eval", "spec_from_args"]


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="RUN_OR_EXPORT",
                   help="a run directory (its latest checkpoint), a checkpoint, or an export (rtp export; "
                        "a run is exported as a Hugging Face folder first, into a temporary folder)")
    p.add_argument("--tasks", required=True, help="lm_eval tasks, comma-separated: names (of --include folders "
                                                  "or lm_eval's own) or task YAML files")
    p.add_argument("--include", action="append", default=[], metavar="DIR",
                   help="a folder of lm_eval task YAML files (repeatable)")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="score through a server (rtp serve) at URL, like http://127.0.0.1:8000, with lm_eval's "
                        "local-completions; default: lm_eval's hf model in this process. Its API key: "
                        "$OPENAI_API_KEY, else the first of $RTP_API_KEY")
    p.add_argument("--served-model", default=None, metavar="ID",
                   help="the model id at --base-url (default: the only one it lists)")
    p.add_argument("--limit", default=None, help="score the first N documents of each task only")
    p.add_argument("--num-fewshot", default=None, help="examples in each prompt (default: the task's, else 0)")
    p.add_argument("--batch-size", default="8", help="requests per forward (hf) or per HTTP request (default 8)")
    p.add_argument("--device", default="cpu", help="hf: the torch device, like cpu or cuda:0 (default cpu)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the results JSON (default: eval/ in the run directory, else in the export)")
    p.add_argument("--trust-builder", action="store_true",
                   help="load a run whose model.name is a Python import path (imports and calls that code)")


def _int(flag: str, text: str | None, minimum: int) -> int | None:
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < minimum:
        raise ConfigError(flag, text, f"an integer >= {minimum}")
    return int(text)


def spec_from_args(args: argparse.Namespace) -> EvalSpec:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        raise ConfigError("--base-url", args.base_url, "an http:// or https:// URL of the server")
    if args.served_model is not None and args.base_url is None:
        raise ConfigError("--served-model", args.served_model, "only with --base-url (the server's model id)")
    return EvalSpec(tasks=tasks, include=list(args.include), base_url=args.base_url,
                    served_model=args.served_model, batch_size=_int("--batch-size", args.batch_size, 1) or 8,
                    limit=_int("--limit", args.limit, 1), num_fewshot=_int("--num-fewshot", args.num_fewshot, 0),
                    device=args.device)


def run_eval(args: argparse.Namespace) -> int:
    """`rtp eval`: tasks checked and their data read, the model prepared, scored, recorded."""
    spec = spec_from_args(args)
    manager = check_tasks(spec.tasks, spec.include)
    check_loadable(manager, spec.tasks)
    with prepared_target(args.path, trust_builder=args.trust_builder) as target:
        record = evaluate(target, spec, manager=manager)
        path = record_results(target, record, out=Path(args.out) if args.out else None)
    for task, scores in record["scores"].items():
        shown = ", ".join(f"{metric} {value:.4f}" for metric, value in scores.items())
        count = (record["n_samples"].get(task) or {}).get("effective")
        print(f"{task}: {shown}" + (f" ({count} documents)" if count is not None else ""))
    print(f"step {target.step} ({record['backend']}); results in {path}")
    return 0
