"""Progress lines on the driver: each report a worker writes to metrics.jsonl, echoed
while the job trains (restarted workers' rewrites included), and the lines rank 0 adds
to notes.log (long work outside the steps, such as DPO's reference pass)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from raytrain_platform.core.rundir import METRICS_FILE, NOTES_FILE, read_metrics

__all__ = ["format_progress", "progress_poller", "tail_progress"]


def format_progress(m: dict, total: int) -> str:
    parts = [f"step {m['step']:>5}/{total}", f"epoch {m['epoch']}", f"loss {m['loss']:.4f}"]
    if "aux_loss" in m:  # a mixture of experts' router load-balancing loss (unweighted)
        parts.append(f"aux_loss {m['aux_loss']:.4f}")
    if "rewards/accuracies" in m:  # DPO: pairs whose chosen response out-rewards the rejected one
        parts.append(f"reward_acc {m['rewards/accuracies']:.3f} margin {m['rewards/margins']:.3f}")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
        if "val_rewards/accuracies" in m:
            parts.append(f"val_reward_acc {m['val_rewards/accuracies']:.3f}")
        elif "val_perplexity" in m:
            parts.append(f"val_ppl {m['val_perplexity']:.2f}")
        elif "val_accuracy" in m:
            parts.append(f"val_acc {m['val_accuracy']:.3f}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    parts += [f"{m['samples_per_s']:,.1f} samples/s", f"data wait {100 * m['data_wait_frac']:.1f}%",
              f"lr {m['lr']:.2e}"]
    return " | ".join(parts)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _notes_reader(run_dir: Path) -> Callable[[], list[str]]:
    """Each call returns the whole lines added to notes.log since the last (those already
    there when the reader is made, an earlier attempt's, are skipped)."""
    path = run_dir / NOTES_FILE
    try:
        offset = path.stat().st_size
    except OSError:
        offset = 0

    def read() -> list[str]:
        nonlocal offset
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                added = f.read()
        except OSError:
            return []
        whole = added[:added.rfind(b"\n") + 1]  # a line still being written waits
        offset += len(whole)
        return whole.decode(errors="replace").splitlines()

    return read


def progress_poller(run_dir: Path, total: int, emit: Callable[[str], None],
                     resume_step: int = 0) -> Callable[[], None]:
    """Each call echoes notes.log's new lines, then metrics.jsonl's new reports. A (re)started worker rewrites the
    file without the lines past its checkpoint (core/rundir.py `MetricsLog`, a new file)
    and logs those steps again: what follows the lines the file still shares with the
    last read is printed. The lines an earlier attempt left past `resume_step` are never
    printed: they are skipped until the file is rewritten, so the poller is made before
    any worker starts."""
    path = run_dir / METRICS_FILE
    stale_file = _inode(path)  # a first attempt killed before its first checkpoint left lines too
    shown = [m for m in read_metrics(run_dir) if m.get("step", 0) <= resume_step]
    notes = _notes_reader(run_dir)

    def poll() -> None:
        nonlocal stale_file, shown
        for line in notes():
            emit(line)
        inode = _inode(path)  # before the read: a read after the rewrite sees the new file
        rows = read_metrics(run_dir)
        if inode == stale_file:  # not rewritten yet
            rows = [m for m in rows if m.get("step", 0) <= resume_step]
        else:
            stale_file = None  # a later file may get the old inode number
        kept = len(shown)  # appended to since the last read, the usual case
        if len(rows) < kept or (shown and rows[kept - 1] != shown[-1]):  # rewritten
            kept = next((i for i, (a, b) in enumerate(zip(rows, shown)) if a != b),
                        min(len(rows), len(shown)))
        for m in rows[kept:]:
            emit(format_progress(m, total))
        shown = rows

    return poll


def tail_progress(poll: Callable[[], None], stop: threading.Event) -> None:
    while True:
        poll()
        if stop.is_set():
            return
        stop.wait(0.5)
