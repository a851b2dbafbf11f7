"""A validation split smaller than one global batch (issue 46, point 10): evaluated as it
is, a partial micro-batch, and on ranks without a sample a forward that counts nothing
(data/dealing.py `deal_eval`); an empty split is said once and the run trains on.

The data: tools/tiny_llm's 40-record chat file, packed into 128-token windows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, hf_config, torchrun_launch, torchrun_metrics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, Path]:
    from raytrain_platform.tools.tiny_llm import make_all

    return make_all(tmp_path_factory.mktemp("small"), samples=40, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)


def chat_config(tmp: Path, name: str, small: dict, *, val_fraction: float, **sections) -> dict:
    return hf_config(tmp, name, small["model"], data={
        "source": "jsonl", "path": str(small["chat"]), "format": "chat", "seq_len": 128, "batch_size": 8,
        # one stream of windows: the split's size in windows is what these tests are about
        "val_fraction": val_fraction, "packing": "concat"}, train={"max_steps": 1}, run={"checkpoint_every": 1}, **sections)


def _job(cfg: dict):
    from raytrain_platform.config import load_config
    from raytrain_platform.resolve import resolve_job

    return resolve_job(load_config(cfg))


def _manual_val_loss(job, model: torch.nn.Module) -> tuple[float, int]:
    """transformers' model on every validation window, one at a time: the summed
    cross-entropy of the counted next tokens (the assistant turns) over their number."""
    from raytrain_platform.data import sources
    from raytrain_platform.data.sources import SourceSpec

    loss_sum, count, windows = 0.0, 0, 0
    for piece in sources.iter_source(SourceSpec.from_config(job.config, prepared=job.data.prepared), "val", ()):
        for tokens, mask in zip(piece["tokens"], piece["loss_mask"]):
            tokens, mask = torch.as_tensor(tokens).long(), torch.as_tensor(mask)
            with torch.no_grad():
                logits = model(input_ids=tokens[None, :-1]).logits[0].double()
            keep = mask[1:] != 0
            loss_sum += torch.nn.functional.cross_entropy(logits[keep], tokens[1:][keep], reduction="sum").item()
            count += int(keep.sum())
            windows += 1
    return loss_sum / count, windows


# 5 validation windows. One process, micro-batches of 8: one partial micro-batch (less
# than the global batch, refused before). 2 FSDP ranks, micro-batches of 2: rank 0 takes
# 2 + 1 windows, rank 1 takes 2 and runs a marked copy of rank 0's first micro-batch
# again (counted, it would weigh those 2 windows twice).
@pytest.mark.slow
@pytest.mark.parametrize("nproc, strategy, batch", [(1, "none", 8),
                                                     pytest.param(2, "fsdp", 2, marks=pytest.mark.extended)])
def test_a_small_split_is_evaluated_as_it_is_token_weighted(tmp_path, small, nproc, strategy, batch):
    from raytrain_platform.data.dealing import eval_micro_batches
    from raytrain_platform.inference import load_model_for_inference

    name = f"val{nproc}"
    cfg = chat_config(tmp_path, name, small, val_fraction=0.3, parallel={"strategy": strategy},
                      scaling={"num_workers": nproc, "cpus_per_worker": 0.5, "torch_threads": 1})
    cfg["data"]["batch_size"], cfg["run"]["eval_batches"] = batch, 4
    job = _job(cfg)
    assert job.data.num_val == 5, job.data
    micro = eval_micro_batches(5, batch_size=batch, world=nproc, most=4)
    assert (micro, -(-micro // nproc) * nproc - micro) == ((1, 0) if nproc == 1 else (3, 1))  # (read, padded)
    rows = torchrun_metrics(cfg, tmp_path / f"{name}.yaml", nproc)
    ours = load_model_for_inference(tmp_path / name)[0].eval()  # the weights evaluated, at step 1
    expected, windows = _manual_val_loss(job, ours)
    assert windows == job.data.num_val
    # fp32 forwards of a batch against one window at a time (float64 sums here): measured <= 7e-8
    torch.testing.assert_close(rows[-1]["val_loss"], expected, rtol=1e-5, atol=0)


def test_an_empty_split_is_said_once_and_the_run_trains_on(tmp_path, small):
    cfg = chat_config(tmp_path, "empty", small, val_fraction=0.05, parallel={"strategy": "fsdp"},
                      scaling={"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1})
    job = _job(cfg)
    assert job.data.num_val == 0
    assert job.warnings == ("warning: the validation split (data.val_fraction 0.05) has no samples; training "
                            "goes on without evaluation",)
    path = tmp_path / "empty.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "validate", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("has no samples") == 1, proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_an_empty_split_trains_under_torchrun_and_says_it_once(tmp_path, small):
    cfg = chat_config(tmp_path, "empty2", small, val_fraction=0.05, parallel={"strategy": "fsdp"},
                      scaling={"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1})
    path = tmp_path / "empty2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([*torchrun_launch(2), "-m", "raytrain_platform.core", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("has no samples; training goes on without evaluation") == 1, proc.stderr[-3000:]
    assert "done: 1 steps" in proc.stdout
