"""The `rtp` command: parse arguments, call the Python API, map errors to exit codes.

    rtp validate CONFIG [--set KEY=VALUE ...]
    rtp train CONFIG [--set KEY=VALUE ...] [--address ADDR] [--verbose]
    rtp export RUN_DIR_OR_CHECKPOINT [--out DIR] [--format safetensors|hf|peft]
    rtp make-data OUT [--rows N] [--features F] [--classes C] [--files K] [--seed S]
    rtp plan [CONFIG] [--model M | --params N ...] --device-mem SIZE [...] [--json]
    rtp sweep SWEEP.yaml [--set KEY=VALUE ...] [--address ADDR] [--verbose]
    rtp serve RUN_DIR_OR_CHECKPOINT ... [--host 127.0.0.1] [--port 8000] [--replicas N] [--write-config FILE]
    rtp doctor CONFIG [--set KEY=VALUE ...] [--workers 1,2] [--steps N] [--out DIR] [--json]
    rtp eval RUN_OR_EXPORT --tasks T[,T...] [--include DIR] [--base-url URL] [--limit N]

Exit codes: 0 success, 1 the run failed, 2 bad input (config, data, checkpoint).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from raytrain_platform.config import add_set_flag
from raytrain_platform.errors import OneLineParser, UserError, describe_error, first_line, user_cause

__all__ = ["main"]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to the job's YAML config")
    add_set_flag(p)


def _cmd_validate(args: argparse.Namespace) -> int:
    from raytrain_platform.launch.trainer import prepare

    job = prepare(args.config, args.overrides)
    print(f"valid: {job.config.summary()}")
    for note in job.notes:  # `auto` fields, decided on this machine; `rtp train` asks the cluster
        print(f"{note} (on this machine)")
    for warning in job.warnings:
        print(warning)
    print(f"data: {job.data.num_train} training / {job.data.num_val} validation samples; "
          f"{job.steps_per_epoch} optimizer steps per epoch; schedule spans {job.total_steps} steps")
    if job.config.data.packing == "documents":
        print(f"data.packing documents: whole documents in windows of {job.config.seq_len} + 1 tokens; "
              f"{job.data.truncated} longer than that, truncated")
    if job.config.data.format == "preference":
        print(f"data.format preference: one pair per row of {job.config.seq_len} + 1 tokens per side; "
              f"{job.data.truncated} pairs longer than that, their responses' ends cut")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from raytrain_platform.launch.trainer import train

    train(args.config, args.overrides, address=args.address, verbose=args.verbose)
    return 0


def _cmd_make_data(args: argparse.Namespace) -> int:
    from raytrain_platform.data.generate import write_tabular_parquet

    paths = write_tabular_parquet(args.out, rows=args.rows, features=args.features,
                                  classes=args.classes, files=args.files, seed=args.seed)
    print(f"wrote {args.rows} rows ({args.features} features, {args.classes} classes) "
          f"in {len(paths)} Parquet file(s) under {args.out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from raytrain_platform.export import export_checkpoint

    out = export_checkpoint(args.path, args.out, format=args.format, max_shard_size=args.max_shard_size,
                            trust_builder=args.trust_builder)
    if args.format == "hf":
        print(f"exported {out} (Hugging Face layout: config.json, safetensors, tokenizer, export.json)")
    elif args.format == "peft":
        print(f"exported {out} (PEFT adapter: adapter_config.json, adapter_model.safetensors, export.json)")
    else:
        print(f"exported {out}/model.safetensors (+ config.yaml, export.json)")
    return 0


# Commands whose arguments and entry point live in their own package's command module:
# (name, module, its add-arguments function, its run function -> exit code, help).
_PACKAGE_COMMANDS = (
    ("plan", "raytrain_platform.plan.command", "add_plan_arguments", "run_plan",
     "per-device memory of each strategy, which fit, and a recommendation"),
    ("sweep", "raytrain_platform.tune.command", "add_sweep_arguments", "run_sweep",
     "Ray Tune sweep over config fields (rerun to resume)"),
    ("serve", "raytrain_platform.serve.command", "add_serve_arguments", "run_serve",
     "serve checkpoints over HTTP with Ray Serve (batched, multiplexed)"),
    ("doctor", "raytrain_platform.doctor.command", "add_doctor_arguments", "run_doctor",
     "measure at 1 and 2 workers, break the step down, flag pitfalls"),
    ("eval", "raytrain_platform.evaluation.command", "add_eval_arguments", "run_eval",
     "score a run or export on lm-evaluation-harness tasks (local task files)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rtp", description="Ray-native distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)  # of the same class
    p = sub.add_parser("validate", help="check a config (and its data) without training")
    _add_config_args(p)
    p.set_defaults(fn=_cmd_validate)
    p = sub.add_parser("train", help="train on an embedded local Ray or a cluster")
    _add_config_args(p)
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--verbose", action="store_true", help="show Ray's own logs too")
    p.set_defaults(fn=_cmd_train)
    p = sub.add_parser("make-data", help="write a synthetic tabular dataset as Parquet")
    p.add_argument("out", help="folder to write (new or empty)")
    p.add_argument("--rows", type=int, default=20_000, help="1 to 100,000,000 (default 20000)")
    p.add_argument("--features", type=int, default=16, help="1 to 10,000 float32 columns (default 16)")
    p.add_argument("--classes", type=int, default=4, help="2 to 10,000 label values (default 4)")
    p.add_argument("--files", type=int, default=4, help="1 to 10,000 and at most --rows (default 4)")
    p.add_argument("--seed", type=int, default=0, help="0 to 2**32 - 1 (default 0)")
    p.set_defaults(fn=_cmd_make_data)
    p = sub.add_parser("export", help="consolidate a checkpoint into one safetensors file for serving")
    p.add_argument("path", help="a run directory (its latest checkpoint) or a checkpoint directory")
    p.add_argument("--out", default=None, help="output folder (default: <run dir>/export)")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "hf", "peft"],
                   help="safetensors: for rtp serve; hf: a Hugging Face directory (hf models); "
                   "peft: a LoRA run's adapters for peft.PeftModel.from_pretrained (the others merge them)")
    p.add_argument("--max-shard-size", default="5GB", help="hf: safetensors shard size (then an index)")
    p.add_argument("--trust-builder", action="store_true",
                   help="load a run whose model.name is a Python import path (a user builder): building "
                        "it imports and calls the code its config names")
    p.set_defaults(fn=_cmd_export)
    for name, module, add_arguments, run, help_text in _PACKAGE_COMMANDS:
        mod = importlib.import_module(module)  # light: torch and Ray load when the command runs
        p = sub.add_parser(name, help=help_text)
        getattr(mod, add_arguments)(p)
        p.set_defaults(fn=getattr(mod, run))
    return parser


def _run(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed run: its root cause in one line, and where to look
        cause = user_cause(exc)  # ours, raised inside Ray (a worker, a Ray Data task): still bad input
        if cause is not None:
            print(f"error: {first_line(cause)}", file=sys.stderr)
            return 2
        hint = " (rerun with --verbose for Ray's logs)" if hasattr(args, "verbose") else ""
        print(f"error: {args.command} failed: {describe_error(exc)}{hint}", file=sys.stderr)
        return 1


def job_entry(command: str, file_flag: str, argv: list[str] | None = None) -> int:
    """What pipelines/*.py run under `ray job submit`: ``FILE_FLAG FILE`` or
    ``FILE_FLAG=FILE`` (it reads better in a job's command line) as ``rtp COMMAND FILE``;
    without it, one line naming the flag (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv):
        if arg == file_flag and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            argv = argv[:i] + argv[i + 1:]
            break
        if arg.startswith(file_flag + "=") and len(arg) > len(file_flag) + 1:
            argv = argv[:i] + [arg[len(file_flag) + 1:]] + argv[i + 1:]
            break
    else:
        if {"-h", "--help"} & set(argv):
            return main([command, "--help"])
        print(f"error: the following arguments are required: {file_flag} FILE "
              f"(see rtp {command} --help, whose CONFIG it is)", file=sys.stderr)
        return 2
    return main([command, *argv])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's parser: "(see rtp plan --help)"
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    return _run(args.fn, args)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]
