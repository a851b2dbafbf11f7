"""``train.dpo.precompute_reference`` (issue 49, point 3) on real data: one pass before
training scores every pair of the tokenized dataset with the reference and keeps the
numbers with the data (data/ref_logps.py); training then holds no reference model.

The reference's numbers are checked against transformers' own model of the reference
folder on the dataset's rows, the training against a run with a live reference, the
layouts (extended) against one process. Real tokenizer, model and pairs from
`tools/tiny_llm.py`; the Ray-free core (``python -m raytrain_platform.core``), in this
process for one rank and under torchrun for two.

    PYTHONPATH=$PWD python -m pytest -q tests/test_dpo_precompute.py
    PYTHONPATH=$PWD python -m pytest -q -m extended tests/test_dpo_precompute.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from conftest import ROOT, job_config, torchrun_metrics  # noqa: E402

from raytrain_platform.config import load_config  # noqa: E402
from raytrain_platform.data import sources  # noqa: E402
from raytrain_platform.data.ref_logps import ReferenceLogps, reference_file  # noqa: E402
from raytrain_platform.tools import tiny_llm  # noqa: E402

# Log-probs near -250 are fp32 sums (spacing 3.05e-5 there): transformers' full logits and
# the engine's counted head add the same terms in another order. Measured 6.1e-5 at most,
# two fp32 steps (2.4e-7 relative); the tolerance allows three.
LOGPS_RTOL, LOGPS_ATOL = 3.6e-7, 1e-5
TRL_ATOL = 1e-5  # losses and rewards (tests/test_dpo.py)
LAYOUT_RTOL = 1e-5  # a layout against one process (tests/test_dpo.py)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return tiny_llm.make_all(tmp_path_factory.mktemp("tiny"), samples=96)


def pairs_config(tmp: Path, tiny: dict, name: str, **sections) -> dict:
    """DPO of the tiny Llama on its preference JSONL: 4 steps of 4 pairs, 64-token rows,
    reference log-probs precomputed."""
    return job_config(tmp, name, dict(
        model={"name": "hf", "kwargs": {"path": str(tiny["model"])}},
        data={"source": "jsonl", "path": str(tiny["preference"]), "format": "preference",
              "tokenizer": str(tiny["tokenizer"]), "batch_size": 4, "seq_len": 64, "val_fraction": 0.1,
              "cache_path": str(tmp / "datasets")},
        train={"max_steps": 4, "lr": 1e-3, "seed": 0, "objective": "dpo", "dpo": {"precompute_reference": True}},
        run={"eval_every": 2, "checkpoint_every": 2}), **sections)


def train_here(cfg: dict) -> tuple[list[dict], str]:
    """`python -m raytrain_platform.core` in this process (one rank): the metrics rows
    and what it printed."""
    from raytrain_platform.core.__main__ import main

    path = Path(cfg["run"]["storage_path"]) / f"{cfg['run']['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--config", str(path)]) == 0
    run_dir = Path(cfg["run"]["storage_path"]) / cfg["run"]["name"]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()], printed.getvalue()


def dataset_of(cfg: dict) -> str:
    """The tokenized dataset the config's run read (the pass finds its manifest)."""
    return sources.describe(sources.SourceSpec.from_config(load_config(cfg)), on_ray=False).prepared


def table_of(cfg: dict) -> ReferenceLogps:
    from raytrain_platform.core.preference import reference_key
    from raytrain_platform.models.registry import get_family

    job = load_config(cfg)
    table = ReferenceLogps.find(dataset_of(cfg), reference_key(job, get_family(job.model.name)))
    assert table is not None
    return table


@pytest.fixture(scope="module")
def scored(tiny, tmp_path_factory):
    """One precomputing run in one process: its config, rows and output."""
    cfg = pairs_config(tmp_path_factory.mktemp("scored"), tiny, "pre")
    rows, out = train_here(cfg)
    return cfg, rows, out


def test_the_pass_scores_every_pair_as_transformers_reference_does(tiny, scored):
    """The table holds one row per pair of both splits, by the dataset's sample ids, with
    the log-probs transformers' own model of the reference folder gives those rows."""
    from transformers import AutoModelForCausalLM

    from raytrain_platform.models.preference import pair_inputs, sequence_logps

    cfg, _, out = scored
    table = table_of(cfg)
    spec = sources.SourceSpec.from_config(load_config(cfg), prepared=dataset_of(cfg))
    rows = [r for split in ("train", "val") for r in sources.iter_source(spec, split)]
    rows = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    assert table.path == reference_file(spec.prepared, table.path.rsplit("/", 1)[1].removesuffix(".parquet"))
    assert len(table) == len(rows["sample_id"]) == 96
    assert table.sample_id.tolist() == sorted(rows["sample_id"].tolist())
    model = AutoModelForCausalLM.from_pretrained(tiny["model"], local_files_only=True).eval()
    inputs, targets = pair_inputs({k: torch.from_numpy(v) for k, v in rows.items()})
    with torch.no_grad():
        logps, _ = sequence_logps(model(inputs).logits, targets)
    chosen, rejected = table.lookup(rows["sample_id"])
    torch.testing.assert_close(torch.from_numpy(np.concatenate([chosen, rejected])), logps,
                               rtol=LOGPS_RTOL, atol=LOGPS_ATOL)
    assert "reference log-probs: scoring 89 train and 7 validation pairs once" in out, out
    assert "96 pairs scored" in out and table.path in out


def test_training_on_the_table_equals_a_live_reference_and_holds_none(tiny, scored, tmp_path):
    """Losses, rewards and validation equal a run that keeps a reference copy; the memory
    report has no reference bytes (the live run's has)."""
    cfg, pre, _ = scored
    live_cfg = pairs_config(tmp_path, tiny, "live", train={"dpo": {"precompute_reference": False}})
    live, _ = train_here(live_cfg)
    assert [r["step"] for r in pre] == [r["step"] for r in live] == [1, 2, 3, 4]
    for name in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
        torch.testing.assert_close(torch.tensor([r[name] for r in pre]), torch.tensor([r[name] for r in live]),
                                   rtol=LOGPS_RTOL, atol=TRL_ATOL)
    evals = [(a["val_loss"], b["val_loss"]) for a, b in zip(pre, live) if "val_loss" in a]
    assert len(evals) == 2 and all(abs(a - b) < TRL_ATOL for a, b in evals)
    assert "ref_param_bytes" not in pre[0] and live[0]["ref_param_bytes"] == live[0]["param_bytes"]


def test_a_second_run_finds_the_table(tiny, scored, tmp_path):
    """Another run on the same data and reference reads the table: no pass, the same numbers."""
    cfg, pre, _ = scored
    table = table_of(cfg)
    stamp = os.stat(table.path).st_mtime_ns
    again, out = train_here({**cfg, "run": {**cfg["run"], "name": "again"}})
    assert f"reference log-probs: 96 pairs found in {table.path}" in out and "scoring" not in out, out
    assert os.stat(table.path).st_mtime_ns == stamp
    assert [r["loss"] for r in again] == [r["loss"] for r in pre]


def test_a_lora_run_scores_with_its_adapters_off(tiny, scored, tmp_path):
    """With LoRA the pass needs no copy: the policy scores with its adapters off, and
    its table (the same reference, the same key) holds the copy's numbers."""
    cfg, _, _ = scored
    lora = pairs_config(tmp_path, tiny, "lora", model={"lora": {"r": 4}}, train={"max_steps": 2})
    rows, out = train_here(lora)
    assert "reference log-probs: scoring" in out and "ref_param_bytes" not in rows[0]
    ours, theirs = table_of(lora), table_of(cfg)
    assert Path(ours.path).name == Path(theirs.path).name  # one key: the reference is the base
    assert np.array_equal(ours.sample_id, theirs.sample_id)
    np.testing.assert_allclose(ours.chosen, theirs.chosen, rtol=LOGPS_RTOL, atol=LOGPS_ATOL)
    np.testing.assert_allclose(ours.rejected, theirs.rejected, rtol=LOGPS_RTOL, atol=LOGPS_ATOL)


def test_the_key_follows_the_reference_not_the_layout(tiny, tmp_path):
    """One key for the same reference (LoRA's base included, any layout); another for
    another precision, head mode or reference folder, or once the folder's files change."""
    from raytrain_platform.core.preference import reference_key
    from raytrain_platform.models.registry import get_family
    from raytrain_platform.tools.tiny_llm import make_model

    def key(**sections) -> str:
        job = load_config(pairs_config(tmp_path, tiny, "k", **sections))
        return reference_key(job, get_family(job.model.name))

    base = key()
    assert key(model={"lora": {"r": 4}}) == key(parallel={"strategy": "fsdp"}, scaling={"num_workers": 2}) == base
    other = make_model(tmp_path / "other", vocab_size=512)
    changed = [key(train={"precision": "bf16"}), key(train={"logits": "all"}),
               key(train={"dpo": {"precompute_reference": True, "reference": str(other)}})]
    assert len({base, *changed}) == 4
    config = Path(tiny["model"]) / "config.json"
    stat = config.stat()
    try:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert key() != base
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert key() == base


def test_a_table_that_cannot_be_written_is_one_line_exit_2(tiny, tmp_path, capsys):
    """Where the dataset's folder takes no table (here a file named `reference` is in the
    way), the run ends with one line naming the folder and exit 2, on every rank."""
    from raytrain_platform.core.__main__ import main

    cfg = pairs_config(tmp_path, tiny, "blocked")
    (Path(dataset_of(cfg)) / "reference").write_text("not a folder")
    path = tmp_path / "blocked.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--config", str(path)]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in said if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == said[-1], said  # the tokenizing pass's lines come before
    assert errors[0].startswith(f"error: {dataset_of(cfg)}: the reference log-probs cannot be written there ("), said


def test_a_table_of_other_pairs_is_one_line(tiny, scored, tmp_path):
    """A table that lacks a batch's pair names the file and what to do."""
    from raytrain_platform.errors import DataError

    table = table_of(scored[0])
    with pytest.raises(DataError) as err:
        table.lookup(np.array([table.sample_id[0], 12345], dtype=np.int64))
    assert str(err.value) == (f"{table.path}: no reference log-probs for pair 12345 (the table was written for "
                              "other data); delete it to compute them again")


# ---------------------------------------------------------------- layouts (extended)


@pytest.mark.extended
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_a_two_rank_pass_equals_one_process(tiny, scored, tmp_path, layout):
    """Two ranks share the pass (FSDP: each scores half the pairs; TP: a group scores the
    same pairs once): the same table and the same losses as one process."""
    cfg, pre, _ = scored
    parallel = {"fsdp2": {"strategy": "fsdp"}, "tp2": {"strategy": "none", "tp_size": 2}}[layout]
    # two ranks x 2 pairs: the same 4 pairs per step as one process
    two = pairs_config(tmp_path, tiny, layout, parallel=parallel, scaling={"num_workers": 2},
                       data={"batch_size": 2 if layout == "fsdp2" else 4})
    rows = torchrun_metrics(two, tmp_path / f"{layout}.yaml", 2)
    ours, theirs = table_of(two), table_of(cfg)
    assert np.array_equal(ours.sample_id, theirs.sample_id)
    np.testing.assert_allclose(ours.chosen, theirs.chosen, rtol=LOGPS_RTOL, atol=LOGPS_ATOL)
    np.testing.assert_allclose(ours.rejected, theirs.rejected, rtol=LOGPS_RTOL, atol=LOGPS_ATOL)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in pre], dtype=torch.float64),
                               rtol=LAYOUT_RTOL, atol=1e-6)


@pytest.mark.extended
def test_resume_at_another_world_size_reads_the_table(tiny, scored, tmp_path):
    """A 2-rank FSDP run's checkpoint at step 2 resumes in one process: the table its pass
    wrote is found, and steps 3-4 are the uninterrupted run's."""
    import shutil

    cfg, pre, _ = scored
    two = pairs_config(tmp_path, tiny, "resume", parallel={"strategy": "fsdp"}, scaling={"num_workers": 2},
                       data={"batch_size": 2})
    torchrun_metrics(two, tmp_path / "resume.yaml", 2)
    shutil.rmtree(tmp_path / "resume" / "checkpoint_000004")  # as if it had stopped after step 2
    rows, out = train_here(pairs_config(tmp_path, tiny, "resume"))
    assert "pairs found in" in out and "scoring" not in out, out
    assert "step 4: loss" in out and "step 2: loss" not in out, out  # resumed: only step 4 ran here
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in pre], dtype=torch.float64),
                               rtol=LAYOUT_RTOL, atol=1e-6)


@pytest.mark.extended
@pytest.mark.timeout(600)
def test_rtp_train_on_ray_precomputes_then_trains(tiny, tmp_path):
    """``rtp train`` of pipelines/configs/dpo.yaml with the setting, on an embedded Ray with
    two FSDP workers: the pass, its lines echoed by the driver, then training with no
    reference; a second run on the same dataset finds the table."""
    cfg = yaml.safe_load((ROOT / "pipelines/configs/dpo.yaml").read_text())
    cfg["model"]["kwargs"]["path"] = str(tiny["model"])
    cfg["data"].update(path=str(tiny["preference"]), seq_len=64, batch_size=4)
    cfg["train"].update(max_steps=4, dpo={**cfg["train"]["dpo"], "precompute_reference": True})
    cfg["run"].update(storage_path=str(tmp_path), eval_every=2, checkpoint_every=4)
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "HF_HUB_OFFLINE": "1"}
    outs = []
    for name in ("first", "second"):
        proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "train", str(path), "--set",
                               f"run.name={name}"], capture_output=True, text=True, cwd=ROOT, timeout=500, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout + proc.stderr)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 4 and "ref_param_bytes" not in rows[0] and "val_rewards/accuracies" in rows[-1]
    # rank 0's lines reach the driver through the run directory's notes.log
    assert "reference log-probs: scoring 93 train and 3 validation pairs once" in outs[0], outs[0][-3000:]
    assert "reference log-probs: 96 pairs scored in" in outs[0], outs[0][-3000:]
    assert "reference log-probs: 96 pairs found in" in outs[1] and "scoring" not in outs[1], outs[1][-3000:]
