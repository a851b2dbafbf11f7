"""`rtp doctor`: measure a config at 1 and 2 workers (more when the cluster has room),
break each step into data wait, forward+backward, gradient communication and
optimizer, and flag the tutorial's pitfalls with their evidence and their fix.

>>> from raytrain_platform.doctor import doctor                       # doctest: +SKIP
>>> report = doctor("pipelines/configs/tabular.yaml")                  # doctest: +SKIP
>>> [f.check for f in report.findings]                                 # doctest: +SKIP
[]

Writes ``doctor.json`` and ``doctor.png`` into its output folder (default
``<run.storage_path>/<run.name>-doctor``), beside one run directory per worker count.
The folder is local (the runs and the report are local files): with a URI
``run.storage_path``, ``out`` names one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from raytrain_platform.doctor.checks import THRESHOLDS, Finding, RunStats, diagnose, scaling_efficiency
from raytrain_platform.core.rundir import write_json

__all__ = ["doctor", "DoctorReport", "format_report", "DOCTOR_FILE", "DOCTOR_PLOT"]

DOCTOR_FILE = "doctor.json"
DOCTOR_PLOT = "doctor.png"


@dataclass
class DoctorReport:
    out_dir: Path
    runs: list[RunStats]
    findings: list[Finding]

    @property
    def efficiency(self) -> dict[int, float]:
        return scaling_efficiency(self.runs)

    def to_dict(self) -> dict:
        return {"runs": [r.to_dict() for r in self.runs],
                "scaling_efficiency": {str(k): v for k, v in self.efficiency.items()},
                "findings": [f.to_dict() for f in self.findings], "thresholds": THRESHOLDS,
                "healthy": not self.findings}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def format_report(report: DoctorReport) -> str:
    eff = report.efficiency
    head = ("workers", "strategy", "samples/s", "efficiency", "data wait", "step ms", "data ms",
            "fwd+bwd ms", "comm ms", "optim ms", "other ms")
    rows = [head] + [(
        str(r.workers), r.strategy, f"{r.samples_per_s:,.0f}",
        f"{100 * eff[r.workers]:.0f}%" if r.workers in eff else "-", f"{100 * r.data_wait_frac:.1f}%",
        _ms(r.step_s), _ms(r.data_wait_s), _ms(r.compute_s), _ms(r.comm_s), _ms(r.optimizer_s),
        _ms(r.other_s))
        for r in report.runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", "samples/s and data wait: normal steps; the ms columns: breakdown steps, where the "
              "gradient all-reduce runs after backward so that it can be timed (comm '-': the "
              "strategy overlaps it, e.g. FSDP)", ""]
    if not report.findings:
        lines.append("no pitfalls found: data keeps up, communication is a small part of the step, "
                     "every rank trains on its own samples, and scaling is near linear")
    for f in report.findings:
        lines += [f"[{f.check}] {f.title}", f"  evidence: {f.evidence}", f"  fix: {f.fix}"]
    lines += ["", f"report: {report.out_dir / DOCTOR_FILE}, plot: {report.out_dir / DOCTOR_PLOT}"]
    return "\n".join(lines)


def plot_report(report: DoctorReport, path: Path) -> Path:
    """Stacked bars: one per worker count, ms per step in each phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.workers} worker(s)" for r in report.runs]
    phases = [("data wait", lambda r: r.data_wait_s), ("forward+backward", lambda r: r.compute_s),
              ("gradient all-reduce", lambda r: r.comm_s or 0.0), ("optimizer", lambda r: r.optimizer_s)]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * len(labels)))
    left = [0.0] * len(labels)
    for name, get in phases:
        widths = [1000 * get(r) for r in report.runs]
        ax.barh(labels, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    eff = report.efficiency
    for i, r in enumerate(report.runs):
        note = f"{r.samples_per_s:,.0f} samples/s" + (f", {100 * eff[r.workers]:.0f}% of linear"
                                                      if r.workers in eff else "")
        ax.text(left[i], i, "  " + note, va="center", fontsize=8)
    ax.set_xlabel("ms per optimizer step (breakdown steps)")
    ax.set_xlim(0, max(left) * 1.6 if max(left) > 0 else 1)
    ax.legend(fontsize=7, loc="lower right")
    flags = ", ".join(f.check for f in report.findings) or "no pitfalls found"
    ax.set_title(f"rtp doctor: {flags}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _output_folder(cfg: Any, out: str | os.PathLike | None) -> Path:
    """The doctor's output folder, checked before Ray starts: a local folder that exists
    or can be created (its nearest existing parent a writable folder). Nothing is created
    here. The doctor's runs and report are local files: a URI is refused (with a URI
    ``run.storage_path``, `out` must name a local folder)."""
    from raytrain_platform.errors import ConfigError, folder_problem

    out = None if out is None else os.fspath(out)
    if out is None and "://" in cfg.run.storage_path:
        raise ConfigError("run.storage_path", cfg.run.storage_path,
                          "a local folder for rtp doctor, or --out naming one (the doctor writes its "
                          "runs and report as local files)")
    if out is not None and not out.strip():
        raise ConfigError("--out", out, "a path to a local folder")
    if out is not None and "://" in out:
        raise ConfigError("--out", out, "a local folder (the doctor writes its runs and report as local files)")
    given = out if out is not None else os.path.join(cfg.run.storage_path, f"{cfg.run.name}-doctor")
    default = "" if out is not None else "; the default is <run.storage_path>/<run.name>-doctor"
    try:
        target = Path(os.path.expanduser(given)).resolve()
        problem = folder_problem(target)
    except OSError as exc:
        problem = exc.strerror or type(exc).__name__
    except RuntimeError as exc:  # a symlink loop (Path.resolve)
        problem = str(exc)
    if problem is not None:
        raise ConfigError("--out", given, f"a folder that can be created and written ({problem}){default}")
    return target


def _make_folder(target: Path) -> None:
    from raytrain_platform.errors import ConfigError

    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # changed since `_output_folder` checked it
        raise ConfigError("--out", str(target),
                          f"a folder that can be created and written ({exc.strerror or type(exc).__name__})") from None


def doctor(config: Any, overrides: list[str] | None = None, *, workers: list[int] | None = None,
           steps: int = 10, warmup: int = 5, out: str | os.PathLike | None = None, address: str | None = None,
           min_efficiency: float = THRESHOLDS["scaling_efficiency"],
           emit: Callable[[str], None] = print) -> DoctorReport:
    """Measure `config` at several worker counts and diagnose it (see the module docstring)."""
    from raytrain_platform.config import load_config
    from raytrain_platform.doctor.measure import check_requested_counts, measure_run, worker_counts
    from raytrain_platform.errors import ConfigError
    from raytrain_platform.launch.resources import cluster_hardware
    from raytrain_platform.launch.session import init_ray
    from raytrain_platform.launch.trainer import prepare
    from raytrain_platform.plan.auto import has_auto

    for flag, value, low in (("--steps", steps, 2), ("--warmup", warmup, 1)):
        if not isinstance(value, int) or value < low:
            raise ConfigError(flag, value, f"an integer >= {low}")
    if not 0 < min_efficiency <= 1:
        raise ConfigError("--min-efficiency", min_efficiency, "a fraction in (0, 1]")
    cfg = load_config(config, overrides)
    # What the config and the flags alone decide, before Ray starts.
    out_dir = _output_folder(cfg, out)
    check_requested_counts(cfg, workers)
    if has_auto(cfg):  # checked against the cluster (each run decides its own `auto` fields)
        init_ray(address, verbose=False)
        prepare(cfg, hardware=cluster_hardware(cfg))
    else:
        prepare(cfg, start_ray=lambda: init_ray(address, verbose=False))  # validated before Ray starts
        init_ray(address, verbose=False)
    import ray

    counts = worker_counts(cfg, ray.cluster_resources(), workers)  # the cluster's room
    _make_folder(out_dir)
    runs = [measure_run(cfg, workers=n, warmup=warmup, steps=steps, out_dir=out_dir, emit=emit)
            for n in counts]
    report = DoctorReport(out_dir=out_dir, runs=runs,
                          findings=diagnose(runs, min_efficiency=min_efficiency))
    write_json(out_dir / DOCTOR_FILE, report.to_dict())
    plot_report(report, out_dir / DOCTOR_PLOT)
    return report
