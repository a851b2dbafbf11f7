"""`parallel.strategy: auto` and `data.batch_size: auto` (plan/auto.py): the decision
guide's choice becomes the config, the micro-batch is the largest that the memory
model fits, and a real `rtp train` logs what it chose and why."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from raytrain_platform.errors import ConfigError
from raytrain_platform.launch.trainer import prepare
from raytrain_platform.models.specs import GPTSpec
from raytrain_platform.plan.memory import Layout, estimate_memory
from raytrain_platform.plan.shapes import gpt_shape

GPT = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128}


def _cfg(tmp_path, budget, *, strategy="auto", batch="auto", global_batch=64, workers=2, **train):
    return {"model": {"name": "gpt", "kwargs": GPT},
            "data": {"source": "synthetic", "batch_size": batch, "num_samples": 4096},
            "train": {"max_steps": 6, "lr": 1e-3, "global_batch_size": global_batch, **train},
            "parallel": {"strategy": strategy},
            "scaling": {"num_workers": workers, "cpus_per_worker": 0.5, "torch_threads": 1,
                        "memory_budget": budget},
            "run": {"name": "auto", "storage_path": str(tmp_path), "eval_every": 3,
                    "checkpoint_every": 0, "eval_batches": 1}}


def _total(micro: int, **layout) -> int:
    lay = Layout(micro_batch=micro, micro_batches=1, **layout)
    return estimate_memory(model=gpt_shape(GPTSpec(**GPT)), layout=lay).total


@pytest.mark.parametrize("budget, strategy, tp, label", [
    ("1GiB", "ddp", 1, "DDP"), ("60MiB", "fsdp", 1, "FSDP"), ("40MiB", "fsdp", 2, "TP x FSDP")])
def test_strategy_follows_the_decision_guide(tmp_path, budget, strategy, tp, label):
    # 1 GiB: a replica and its batch fit -> DDP. 60 MiB: DDP's replica plus gradient
    # buckets do not fit even at micro-batch 1, FSDP's shard does -> FSDP. 40 MiB: FSDP's
    # activations no longer fit either; TP splits them across the 2 workers -> TP x FSDP.
    job = prepare(_cfg(tmp_path, budget, global_batch=16))
    assert (job.config.parallel.strategy, job.config.parallel.tp_size) == (strategy, tp)
    assert job.notes[0].startswith(f"parallel.strategy auto -> {label}: ")
    assert budget in job.notes[0]  # says where the memory figure came from


def test_auto_plans_any_layout_with_compile_or_checkpointing_on(tmp_path):
    # Compile and activation checkpointing work on every layout, so the plan is not
    # pinned to data parallel. At 40 MiB the plan picks TP x FSDP (above), compiled too
    # (compile does not change the memory). Checkpointing keeps only block inputs: FSDP
    # alone then fits at 40 MiB; at 28 MiB it does not, and TP x FSDP with checkpointing
    # does, with compile too. At 26 MiB nothing fits, and the ways out no longer name
    # checkpointing.
    def plan(budget, **parallel):
        cfg = _cfg(tmp_path, budget, global_batch=16)
        cfg["parallel"].update(parallel)
        return prepare(cfg).config.parallel

    par = plan("40MiB", compile=True)
    assert (par.strategy, par.tp_size, par.compile) == ("fsdp", 2, True), par
    assert plan("40MiB", activation_checkpointing=True).tp_size == 1
    assert plan("28MiB", activation_checkpointing=True).tp_size == 2
    # Both: compiled blocks recompute in their graphs, planned as checkpointed blocks.
    both = plan("28MiB", activation_checkpointing=True, compile=True)
    assert (both.strategy, both.tp_size, both.compile, both.activation_checkpointing) == ("fsdp", 2, True, True)
    with pytest.raises(ConfigError) as err:
        plan("26MiB", activation_checkpointing=True)
    msg = str(err.value)
    assert err.value.field == "parallel.strategy" and "none does" in msg and "\n" not in msg, msg
    assert "activation checkpointing" not in msg and "LoRA fits" in msg, msg


def test_micro_batch_is_the_largest_that_fits(tmp_path):
    job = prepare(_cfg(tmp_path, "200MiB", strategy="ddp"))
    cfg, budget = job.config, 200 * 2**20
    micro, accum = cfg.data.batch_size, cfg.train.grad_accum_steps
    assert micro * accum * 2 == 64 and accum > 1  # the global batch is kept, accumulation derived
    assert _total(micro, dp=2) <= budget < _total(2 * micro, dp=2)
    assert job.global_batch == 64
    assert "data.batch_size auto -> " in job.notes[-1]


def test_auto_batch_for_an_explicit_strategy_and_one_worker(tmp_path):
    job = prepare(_cfg(tmp_path, "200MiB", strategy="none", workers=1, global_batch=32))
    micro, accum = job.config.data.batch_size, job.config.train.grad_accum_steps
    assert micro * accum == 32 and _total(micro) <= 200 * 2**20 < _total(2 * micro)


def test_auto_batch_for_an_explicit_tp_x_pp_layout(tmp_path):
    """An explicit 3-D layout (TP 2 x PP 2 on 4 workers, one replica): the batch is
    planned for that layout, the largest micro-batch whose estimate fits."""
    cfg = _cfg(tmp_path, "40MiB", strategy="none", workers=4, global_batch=16)
    cfg["parallel"].update(tp_size=2, pp_size=2)
    job = prepare(cfg)
    micro, accum = job.config.data.batch_size, job.config.train.grad_accum_steps
    assert micro * accum == 16 and 1 < micro < 16, (micro, accum)  # the budget decides, not the bounds

    def total(m: int) -> int:
        lay = Layout(tp=2, pp=2, micro_batch=m, micro_batches=16 // m)
        return estimate_memory(model=gpt_shape(GPTSpec(**GPT)), layout=lay).total

    assert total(micro) <= 40 * 2**20 and (micro == 16 or total(2 * micro) > 40 * 2**20), (micro, accum)


@pytest.mark.parametrize("patch, field", [
    ({"global_batch": None}, "train.global_batch_size"),        # auto batch needs the global batch
    ({"global_batch": 63}, "train.global_batch_size"),          # not divisible over 2 replicas
    ({"grad_accum_steps": 4}, "train.grad_accum_steps"),       # derived, not set
    ({"budget": "20MiB"}, "parallel.strategy"),                 # nothing fits: says so, with sizes
    ({"budget": "lots"}, "scaling.memory_budget"),
    ({"batch": 3.5}, "data.batch_size"),
    ({"batch": 8, "strategy": "ddp"}, "train.global_batch_size"),  # 8 x 1 x 2 != 64
])
def test_bad_auto_configs_are_one_line_errors(tmp_path, patch, field):
    kwargs = {"budget": "1GiB", **patch}
    with pytest.raises(ConfigError) as err:
        prepare(_cfg(tmp_path, kwargs.pop("budget"), **kwargs))
    assert err.value.field == field and "\n" not in str(err.value)


def test_a_setting_that_does_not_go_with_the_plans_choice_says_what_auto_became(tmp_path):
    # reshard_after_forward is an FSDP option; at 1 GiB the plan picks DDP
    cfg = _cfg(tmp_path, "1GiB")
    cfg["parallel"]["reshard_after_forward"] = False
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    msg = str(err.value)
    assert err.value.field == "parallel.reshard_after_forward" and "\n" not in msg
    assert "the auto fields became parallel.strategy ddp" in msg and "set them explicitly" in msg


@pytest.mark.extended  # an rtp train run (~1 min); auto's choices are tested above without one
@pytest.mark.slow
def test_rtp_train_logs_its_choice_and_trains(tmp_path):
    """A real `rtp train` on an embedded Ray: the cluster's memory decides, the run
    directory's config holds the decision, training runs to the end."""
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, "60MiB", global_batch=16)))
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "train", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [ln for ln in proc.stdout.splitlines() if " auto -> " in ln]
    assert notes[0].startswith("parallel.strategy auto -> FSDP") and "60MiB" in notes[0]
    assert notes[1].startswith("data.batch_size auto -> ")
    saved = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    assert saved["parallel"]["strategy"] == "fsdp" and isinstance(saved["data"]["batch_size"], int)
    rows = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6


def test_auto_picks_only_splits_the_model_family_runs(tmp_path, tiny):
    # An hf model with tied input and output embeddings has TP (the tie kept, parallel/tp.py)
    # and PP (the last stage's copy kept in step, parallel/pp.py); the plan never picks a
    # layout the config check refuses (parallel.pp_size: here 2 ranks x 2 interleaved
    # stages for 2 layers).
    tied = tmp_path / "tied"
    shutil.copytree(tiny["model"], tied)
    conf = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**conf, "tie_word_embeddings": True}))

    def plan(model, budget):
        return prepare({"model": {"name": "hf", "kwargs": {"path": str(model)}},
                        "data": {"source": "jsonl", "path": str(tiny["chat"]), "format": "chat",
                                 "seq_len": 64, "batch_size": "auto", "val_fraction": 0.1},
                        "train": {"max_steps": 4, "global_batch_size": 16}, "parallel": {"strategy": "auto"},
                        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "memory_budget": budget},
                        "run": {"name": "tied", "storage_path": str(tmp_path)}}).config.parallel

    from raytrain_platform.config import load_config
    from raytrain_platform.models import get_family
    from raytrain_platform.plan.auto import _shape, refused_splits

    def pins(config):  # the splits refused, as the plan's pins of 1
        cfg = load_config(config)
        par = cfg.parallel
        return {dim: 1 for dim in refused_splits(get_family(cfg.model.name), cfg.model.kwargs, _shape(cfg),
                                                 pp_schedule=par.pp_schedule, pp_split=par.pp_split)}

    hf = {"model": {"name": "hf", "kwargs": {"path": str(tied)}},
          "data": {"source": "jsonl", "path": str(tiny["chat"]), "format": "chat", "seq_len": 64, "batch_size": 4},
          "train": {"max_steps": 4}, "run": {"name": "p", "storage_path": str(tmp_path)}}
    assert pins(hf) == {}  # tied embeddings: both splits
    assert pins({**hf, "model": {"name": "hf", "kwargs": {"path": str(tiny["model"])}}}) == {}  # a Llama: both
    interleaved = {**hf, "parallel": {"pp_schedule": "interleaved_1f1b"}}
    assert pins(interleaved) == {"pp": 1}  # 2 ranks x 2 stages each need 4 layers
    gpt3 = _cfg(tmp_path, "1GiB")
    gpt3["model"]["kwargs"] = {**GPT, "n_layer": 3}
    assert pins(gpt3) == {}  # gpt: both splits
    gpt3["parallel"]["pp_schedule"] = "interleaved_1f1b"
    assert pins(gpt3) == {"pp": 1}  # 2 ranks x 2 stages each need 4 blocks
    mlp = _cfg(tmp_path, "1GiB")
    mlp.update(model={"name": "mlp", "kwargs": {"input_dim": 16, "num_outputs": 4}},
               data={"source": "synthetic", "batch_size": "auto"})
    assert pins(mlp) == {} and prepare(mlp).config.parallel.strategy == "ddp"  # the plan offers mlp no TP/PP

    # rtp plan shows the tied model's PP as an option, and a refused split as no option,
    # with the family's reason, refusing --pp 2 for it; TP x FSDP stays an option.
    plan_cmd = [sys.executable, "-m", "raytrain_platform", "plan", "--device-mem", "8MiB",
                "--devices-per-node", "2", "--global-batch", "16"]
    out = subprocess.run([*plan_cmd, "--seq-len", "64", "--model", f"hf:{tied}"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[0]: line for line in out.stdout.splitlines()}
    assert "n/a" not in rows["TP x FSDP"] and "n/a" not in rows["PP"], out.stdout
    config = tmp_path / "interleaved.yaml"
    config.write_text(json.dumps(interleaved))
    out = subprocess.run([*plan_cmd, str(config)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[0]: line for line in out.stdout.splitlines()}
    assert "n/a" not in rows["TP x FSDP"], out.stdout
    assert "n/a: parallel.pp_size must be at most num_hidden_layers (2) pipeline stages" in rows["PP x DP"], \
        out.stdout
    out = subprocess.run([*plan_cmd, str(config), "--pp", "2"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("error: --pp = 2: expected "), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1

    budgets = [f"{kib}KiB" for kib in range(16384, 1024, -512)]
    tp_budget = next(b for b in budgets if plan(tiny["model"], b).tp_size == 2)  # untied: TP x FSDP here
    par = plan(tied, tp_budget)
    assert (par.tp_size, par.pp_size) == (2, 1), par  # tied: TP x FSDP too (on one node, no plan splits stages)
