"""FSDP2 (parallel.strategy: fsdp) on CPU/gloo, real processes under torchrun (Ray absent):
loss equivalence with DDP and one process, reduce-scatter counts under accumulation,
resume across world sizes and strategies, memory, export. One test under Ray TorchTrainer.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import LM_TRAIN, ROOT, job_config, torchrun_metrics

N_LAYER = 2
# fp32 everywhere. On gloo, FSDP's reduce-scatter and DDP's all-reduce add the same
# two gradients per element and sharded AdamW is elementwise: measured identical
# losses. One process (one batch of 16 instead of two of 8: other matmul blocking,
# other summation order) measured <= 1.8e-7 relative over 10 steps. 1e-5 leaves room
# for other CPUs/BLAS builds while still catching any real divergence (a lost
# gradient, a missed reduce, a wrong data position changes losses by > 1e-3).
RTOL, ATOL = 1e-5, 1e-6


def gpt_config(tmp: Path, name: str, **sections) -> dict:
    return job_config(tmp, name, dict(
        model={"name": "gpt", "kwargs": {"n_layer": N_LAYER, "n_head": 2, "n_embd": 32,
                                            "block_size": 16}},
        data={"source": "synthetic", "batch_size": 8, "num_samples": 2048, "val_fraction": 0.05},
        train={**LM_TRAIN, "weight_decay": 0.1}, run={"keep_checkpoints": 4}), **sections)


def torchrun(tmp: Path, name: str, nproc: int, **sections) -> list[dict]:
    """Train with the Ray-free core under torchrun; returns the metrics it logged."""
    return torchrun_metrics(gpt_config(tmp, name, **sections), tmp / f"{name}.yaml", nproc,
                            timeout=120)


def _close(a: list[float], b: list[float], rtol: float = RTOL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(x) + ATOL for x, y in zip(a, b))


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("patch,field", [
    ({"parallel": {"strategy": "fsdp", "cpu_offload": True}}, "parallel.cpu_offload"),
    ({"parallel": {"strategy": "fsdp", "mixed_precision": True}}, "parallel.mixed_precision"),
    ({"parallel": {"strategy": "ddp", "reshard_after_forward": False}},
     "parallel.reshard_after_forward"),
    ({"model": {"name": "mlp", "kwargs": {}},
      "parallel": {"strategy": "fsdp", "activation_checkpointing": True}},
     "parallel.activation_checkpointing"),
    ({"model": {"name": "mlp", "kwargs": {}}, "parallel": {"strategy": "ddp", "compile": True}},
     "parallel.compile"),
    ({"parallel": {"compile": "yes please"}}, "parallel.compile"),
    # Both block options recompute inside compiled graphs, which would redraw dropout masks.
    ({"model": {"name": "gpt", "kwargs": {"dropout": 0.1}},
      "parallel": {"compile": True, "activation_checkpointing": True}}, "parallel.activation_checkpointing"),
    ({"model": {"name": "gpt", "kwargs": {}, "lora": {"dropout": 0.05, "target_modules": ["q_proj"]}},
      "parallel": {"compile": True, "activation_checkpointing": True}}, "parallel.activation_checkpointing"),
])
def test_fsdp_options_are_validated(tmp_path, patch, field):
    from raytrain_platform import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(gpt_config(tmp_path, "v", **patch))
    assert err.value.field == field and "\n" not in str(err.value)


def test_fsdp_options_accepted(tmp_path):
    from raytrain_platform import load_config

    cfg = load_config(gpt_config(tmp_path, "v", parallel={
        "strategy": "fsdp", "activation_checkpointing": True, "reshard_after_forward": False}))
    assert cfg.parallel.activation_checkpointing and not cfg.parallel.mixed_precision
    # Activation checkpointing and compile need blocks, not FSDP, and work on every layout,
    # alone or together: data parallel, TP (x FSDP) and pipeline stages
    # (tests/test_model_parallel.py, test_hf.py).
    layouts = [({"strategy": "none"}, 1), ({"strategy": "ddp"}, 2), ({"tp_size": 2}, 2),
               ({"tp_size": 2, "strategy": "fsdp"}, 4), ({"pp_size": 2}, 2), ({"pp_size": 2, "strategy": "ddp"}, 4)]
    words = {"activation_checkpointing": "checkpointed", "compile": "compiled (TorchInductor, during the first step)"}
    for layout, workers in layouts:
        for names in (["activation_checkpointing"], ["compile"], ["activation_checkpointing", "compile"]):
            cfg = load_config(gpt_config(tmp_path, "v", parallel={**layout, **dict.fromkeys(names, True)},
                                         scaling={"num_workers": workers}))
            assert cfg.parallel.block_options_set() == [f"parallel.{name}" for name in names]
            # What `rtp train` prints first: the split, and that the first step compiles.
            split = "".join({"tp_size": "tp 2", "pp_size": "pp 2 1f1b"}.get(k, "") for k in layout)
            summary = cfg.summary()
            assert f"worker(s) ({split + ', ' if split else ''}CPU); blocks " + " and ".join(
                words[name] for name in names) in summary, summary
    gpu = load_config(gpt_config(tmp_path, "g", parallel={"strategy": "fsdp", "mixed_precision": True,
                                                          "cpu_offload": True},
                                 scaling={"use_gpu": True}))
    assert gpu.parallel.mixed_precision and gpu.parallel.cpu_offload


_RUNS = {  # the same global batch of 16 sequences per optimizer step
    "one": dict(data={"batch_size": 16}),
    "ddp": dict(parallel={"strategy": "ddp"}),
    "fsdp": dict(parallel={"strategy": "fsdp"}),
}


@pytest.fixture(scope="module")
def base_runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Uninterrupted 10-step runs, checkpoints at 5 and 10: one process, DDP x2, FSDP x2."""
    tmp = tmp_path_factory.mktemp("fsdp_base")
    return {name: (tmp / name, torchrun(tmp, name, 1 if name == "one" else 2, **patch))
            for name, patch in _RUNS.items()}


@pytest.mark.timeout(120)
def test_fsdp_matches_ddp_and_single_process(base_runs):
    one, ddp, fsdp = (losses(base_runs[k][1]) for k in ("one", "ddp", "fsdp"))
    assert len(one) == 10 and one[-1] < one[0] - 0.2, one
    assert _close(ddp, one), (ddp, one)
    assert _close(fsdp, ddp), (fsdp, ddp)
    assert _close(fsdp, one), (fsdp, one)
    # One reduce-scatter per FSDP unit (each block, then the root) per optimizer step.
    assert {r["grad_allreduces"] for r in base_runs["fsdp"][1]} == {N_LAYER + 1}
    sharded = base_runs["fsdp"][0] / "checkpoint_000010" / "sharded"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.timeout(120)
def test_fsdp_accumulation_skips_reduce_scatter(tmp_path, base_runs):
    """accum 2 x batch 4 per rank == the base runs' batch 8; the reduce-scatter runs on
    the last micro-step only, so the count per optimizer step does not change."""
    accum = {"train": {**gpt_config(tmp_path, "x")["train"], "grad_accum_steps": 2}}
    one = losses(torchrun(tmp_path, "one_acc", 1, data={"batch_size": 8}, **accum))
    ddp = losses(torchrun(tmp_path, "ddp_acc", 2, data={"batch_size": 4},
                          parallel={"strategy": "ddp"}, **accum))
    # Also exercises activation checkpointing per block and no reshard after forward:
    # both change memory and communication, never the numbers.
    fsdp_rows = torchrun(tmp_path, "fsdp_acc", 2, data={"batch_size": 4},
                         parallel={"strategy": "fsdp", "activation_checkpointing": True,
                                   "reshard_after_forward": False}, **accum)
    fsdp = losses(fsdp_rows)
    assert _close(fsdp, ddp) and _close(fsdp, one) and _close(ddp, one), (fsdp, ddp, one)
    assert _close(fsdp, losses(base_runs["fsdp"][1])), "accumulation changed the trajectory"
    assert [r["grad_allreduces"] for r in fsdp_rows] == [N_LAYER + 1] * 10


def _resume_from(tmp: Path, source: Path, name: str, nproc: int, **sections) -> list[float]:
    """A new run directory holding only `source`'s step-5 checkpoint, trained to step 10."""
    (tmp / name).mkdir()
    shutil.copytree(source / "checkpoint_000005", tmp / name / "checkpoint_000005")
    rows = torchrun(tmp, name, nproc, **sections)
    assert [r["step"] for r in rows] == list(range(6, 11)), "did not resume at step 5"
    return losses(rows)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("source,nproc,target", [
    ("fsdp", 1, "fsdp"),  # 2 -> 1, sharded -> sharded at another world size
    ("one", 2, "fsdp"),  # 1 -> 2, unsharded -> sharded
    ("ddp", 2, "fsdp"),  # DDP -> FSDP
    ("fsdp", 2, "ddp"),  # FSDP -> DDP (DCP shards into full tensors)
])
def test_resume_at_another_size_or_strategy(tmp_path, base_runs, source, nproc, target):
    src_dir, src_rows = base_runs[source]
    batch = 16 // nproc  # same global batch; the data position is converted on load
    resumed = _resume_from(tmp_path, src_dir, f"{source}_to_{target}{nproc}", nproc,
                           data={"batch_size": batch}, parallel={"strategy": target})
    uninterrupted = losses(src_rows)[5:]
    assert _close(resumed, uninterrupted), (resumed, uninterrupted)


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_an_unsplit_run_resumes_at_another_size_where_it_stopped(tmp_path, base_runs):
    """data.split_across_workers false: every rank reads every micro-batch, so 2 ranks x
    16 train as one process of 16. The position was mapped as if the 2 ranks had read
    2 x 16 rows a round: resumed on one process it skipped 5 micro-batches."""
    unsplit = dict(data={"batch_size": 16, "split_across_workers": False}, parallel={"strategy": "ddp"})
    rows = torchrun(tmp_path, "unsplit", 2, **unsplit)
    one = losses(base_runs["one"][1])
    assert _close(losses(rows), one), (losses(rows), one)
    resumed = _resume_from(tmp_path, tmp_path / "unsplit", "unsplit_to_one", 1, data={"batch_size": 16})
    assert _close(resumed, one[5:]), (resumed, one[5:])


@pytest.mark.timeout(60)
def test_resume_refuses_a_position_that_does_not_map(tmp_path, base_runs):
    """Step 5 of a 2 x 8 run is 80 rows into the epoch: not whole rounds of 1 x 48."""
    from raytrain_platform.core.checkpoint import TrainState, _map_position, read_state
    from raytrain_platform.errors import CheckpointError

    data = read_state(base_runs["fsdp"][0] / "checkpoint_000005")
    assert data["layout"] == {"world_size": 2, "batch_size": 8, "split": True, "val_split": 2}
    assert _map_position("c", data, world_size=1, batch_size=16, epoch_rows=1920) == TrainState(
        step=5, epoch=0, batches_in_epoch=5, samples_seen=80)
    with pytest.raises(CheckpointError, match="not a whole number of rounds"):
        _map_position("c", data, world_size=1, batch_size=48, epoch_rows=1920)


@pytest.mark.timeout(90)
def test_fsdp_memory_per_rank_at_most_055_of_ddp(tmp_path):
    """The quickstart gpt (pipelines/configs/quickstart.yaml model) with 2 workers."""
    quick = yaml.safe_load((ROOT / "pipelines" / "configs" / "quickstart.yaml").read_text())
    common = dict(model=quick["model"], train={"max_steps": 1},
                  run={"checkpoint_every": 0, "eval_every": 0, "eval_batches": 1})
    ddp = torchrun(tmp_path, "mem_ddp", 2, parallel={"strategy": "ddp"}, **common)[-1]
    fsdp = torchrun(tmp_path, "mem_fsdp", 2, parallel={"strategy": "fsdp"}, **common)[-1]
    ddp_total = ddp["param_bytes"] + ddp["grad_bytes"] + ddp["optim_bytes"]
    fsdp_total = fsdp["param_bytes"] + fsdp["grad_bytes"] + fsdp["optim_bytes"]
    from raytrain_platform.models.specs import GPTSpec

    n_params = GPTSpec(**quick["model"]["kwargs"]).num_params()
    assert ddp["param_bytes"] == ddp["grad_bytes"] == 4 * n_params  # full fp32 replicas
    assert fsdp_total <= 0.55 * ddp_total, (fsdp_total, ddp_total)
    print(f"\nper-rank bytes ddp {ddp_total} fsdp {fsdp_total} ratio {fsdp_total / ddp_total:.3f}")


@pytest.mark.timeout(90)
def test_export_sharded_and_unsharded(tmp_path, base_runs):
    """The exported safetensors, loaded into a fresh model in this plain process, gives
    the validation loss the training model (FSDP x2 / DDP x2) logged at step 10."""
    from safetensors.torch import load_file

    from raytrain_platform import export_checkpoint, load_config
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.models import build_model
    from raytrain_platform.models.tasks import get_task
    from raytrain_platform.resolve import resolve_job

    exported = {}
    for source in ("fsdp", "ddp"):
        run_dir, rows = base_runs[source]
        out = export_checkpoint(run_dir, tmp_path / source)
        assert json.loads((out / "export.json").read_text())["step"] == 10
        cfg = load_config(yaml.safe_load((out / "config.yaml").read_text()))
        model = build_model(cfg.model)
        exported[source] = load_file(str(out / "model.safetensors"))
        model.load_state_dict(exported[source])
        job = resolve_job(cfg.replace({"parallel.strategy": "none", "scaling.num_workers": 1}))
        # The run evaluated eval_batches (2) x world (2) micro-batches of 8: the first 32 rows.
        task, sums = get_task("lm"), torch.zeros(3)
        with torch.no_grad():
            for batch in LocalBatches(job, rank=0, world_size=1).val_batches(4):
                inputs, targets = task.split({"tokens": batch["tokens"].long()})
                sums += task.eval_sums(model(inputs), targets)
        val_loss = float(sums[0] / sums[1])
        assert abs(val_loss - rows[-1]["val_loss"]) <= 1e-5 * val_loss, (source, val_loss, rows[-1])
    assert exported["fsdp"].keys() == exported["ddp"].keys()
    for k, v in exported["fsdp"].items():
        torch.testing.assert_close(v, exported["ddp"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_cli_export(tmp_path, base_runs):
    run = [sys.executable, "-m", "raytrain_platform", "export"]
    ok = subprocess.run(run + [str(base_runs["fsdp"][0] / "checkpoint_000005"), "--out",
                               str(tmp_path / "e")], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "e" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "e" / "export.json").read_text())["step"] == 5
    bad = subprocess.run(run + [str(tmp_path / "nope")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.extended  # the Ray launcher equals the torchrun core: test_ray_train shows it for DDP in the default run
@pytest.mark.ray
@pytest.mark.timeout(240)
def test_fsdp_under_ray_train_matches_torchrun(ray_cluster, tmp_path, base_runs):
    """2 FSDP workers under TorchTrainer (Ray Data ingest): same losses as torchrun,
    sharded checkpoints from both ranks in one checkpoint directory."""
    from raytrain_platform.launch.trainer import train

    cfg = gpt_config(tmp_path, "ray_fsdp", parallel={"strategy": "fsdp"},
                     scaling={"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1})
    result = train(cfg, progress=False)
    assert _close(losses(result.metrics), losses(base_runs["fsdp"][1])), (
        losses(result.metrics), losses(base_runs["fsdp"][1]))
    assert {m["grad_allreduces"] for m in result.metrics} == {N_LAYER + 1}
    sharded = result.checkpoint / "sharded"
    assert sorted(p.name for p in sharded.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.timeout(120)
def test_fsdp_evaluation_with_an_odd_number_of_validation_batches(tmp_path):
    """Every rank evaluates the same number of batches: with an odd count of validation
    micro-batches and eval_batches larger than what exists, FSDP's collectives in the
    evaluation forward would otherwise wait forever on the rank with one batch fewer."""
    from raytrain_platform.launch.trainer import prepare

    for fraction in (0.05, 0.06, 0.07, 0.08, 0.09):
        job = prepare(gpt_config(tmp_path, "probe", data={"val_fraction": fraction},
                                 parallel={"strategy": "fsdp"}, scaling={"num_workers": 2}))
        if (job.data.num_val // 8) % 2 == 1:
            break
    else:
        pytest.fail("no val_fraction gave an odd number of validation batches")
    rows = torchrun(tmp_path, "fsdp_val", 2, data={"val_fraction": fraction},
                    parallel={"strategy": "fsdp"}, run={"eval_batches": 50})
    assert [r["step"] for r in rows] == list(range(1, 11)) and "val_loss" in rows[-1]


def test_data_position_mapping_between_layouts():
    """Rows into the epoch = batches x world x batch; the next epoch once the new
    layout's whole epoch is consumed; a position between rounds is refused."""
    from raytrain_platform.core.checkpoint import _map_position
    from raytrain_platform.errors import CheckpointError

    def state(batches):
        return {"state": {"step": batches, "epoch": 0, "batches_in_epoch": batches, "samples_seen": 0},
                "layout": {"world_size": 2, "batch_size": 8}}

    mid = _map_position("c", state(2), world_size=1, batch_size=16, epoch_rows=96)
    assert (mid.epoch, mid.batches_in_epoch) == (0, 2)  # 32 rows = 2 rounds of 16
    end = _map_position("c", state(6), world_size=2, batch_size=32, epoch_rows=64)
    assert (end.epoch, end.batches_in_epoch) == (1, 0)  # 96 rows >= the new epoch's 64
    with pytest.raises(CheckpointError, match="not a whole number of rounds"):
        _map_position("c", state(2), world_size=3, batch_size=8, epoch_rows=96)
    # Unsplit (every rank reads every micro-batch): a rank's count times its batch.
    unsplit = {**state(4), "layout": {"world_size": 2, "batch_size": 8, "split": False}}
    for world in (1, 2, 4):
        assert _map_position("c", unsplit, world_size=world, batch_size=8, epoch_rows=96,
                             split=False).batches_in_epoch == 4
    assert _map_position("c", unsplit, world_size=2, batch_size=16, epoch_rows=96,
                         split=False).batches_in_epoch == 2
    assert _map_position("c", unsplit, world_size=2, batch_size=4, epoch_rows=96).batches_in_epoch == 4
    # A layout written before `split` was recorded: taken as the resuming run's.
    assert _map_position("c", state(4), world_size=1, batch_size=16, epoch_rows=96,
                         split=False).batches_in_epoch == 2
    with pytest.raises(CheckpointError, match=r"rounds of data.batch_size 24 \(unsplit"):
        _map_position("c", unsplit, world_size=2, batch_size=24, epoch_rows=96, split=False)
