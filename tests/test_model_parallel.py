"""Tensor, pipeline and 2-D parallelism for gpt on CPU/gloo: each layout matches the
single-process reference loss over 10 optimizer steps, with and without gradient
accumulation; data goes to data-parallel ranks only (sample ids); sharded checkpoints
resume (also into another layout) and export to one safetensors file; configs that
cannot be split are refused with the numbers named.

Tolerance: fp32. TP splits each matmul's reduction over ranks (row-wise layers add
partial sums in another order), PP and accumulation sum chunk losses instead of one
mean. Measured on this machine: every layout below within 2.7e-7 relative of the
reference at every step (6th decimal of a loss ~5.5). RTOL 2e-5 leaves room for
other BLAS builds while any real error (a missing all-reduce, a gradient scaled
twice, a wrong shard of data) moves losses by > 1e-3.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import LayoutRuns, torchrun_metrics
from test_fsdp import gpt_config as fsdp_config
from test_fsdp import losses

RTOL, ATOL = 2e-5, 1e-6
MODEL = {"name": "gpt", "kwargs": {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16}}


def gpt_config(tmp: Path, name: str, **sections) -> dict:
    """test_fsdp's gpt config with 4 blocks (2 per stage, 4 for interleaved) and a
    micro-batch of 16: the global batch of every layout below."""
    merged: dict = {"model": MODEL, "data": {"batch_size": 16}}
    for section, values in sections.items():
        merged[section] = {**merged.get(section, {}), **values}
    return fsdp_config(tmp, name, **merged)


def torchrun(tmp: Path, name: str, nproc: int, **sections) -> list[dict]:
    return torchrun_metrics(gpt_config(tmp, name, **sections), tmp / f"{name}.yaml", nproc,
                            timeout=150)


def _inductor(name: str) -> dict[str, str]:
    """A compiled layout's TorchInductor cache, in its own folder (formatted with the
    run's folder): the C++ kernels it holds afterwards show the blocks really compiled."""
    return {"TORCHINDUCTOR_CACHE_DIR": "{root}/inductor-" + name}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(x) + ATOL for x, y in zip(a, b))


def accum(n: int) -> dict:
    return {**gpt_config(Path("."), "x")["train"], "grad_accum_steps": n}


# The same global batch of 16 sequences per optimizer step in every layout:
# data-parallel size x batch_size x grad_accum_steps = 16.
LAYOUTS = {
    "tp2_sp_accum2": (2, dict(parallel={"tp_size": 2, "sequence_parallel": True},
                              data={"batch_size": 8}, train=accum(2))),
    "pp2_gpipe": (2, dict(parallel={"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": 4})),
    "pp2_1f1b_accum2": (2, dict(parallel={"pp_size": 2, "pp_schedule": "1f1b"},
                                data={"batch_size": 8}, train=accum(2))),
    "pp2_interleaved_accum2": (2, dict(parallel={"pp_size": 2, "pp_schedule": "interleaved_1f1b",
                                                 "pp_microbatches": 4},
                                       data={"batch_size": 8}, train=accum(2))),
    "tp2_fsdp2_accum2": (4, dict(parallel={"tp_size": 2, "strategy": "fsdp"},
                                 data={"batch_size": 4}, train=accum(2))),
    "pp2_ddp2_accum2": (4, dict(parallel={"pp_size": 2, "strategy": "ddp", "pp_split": [1, 3]},
                                data={"batch_size": 4}, train=accum(2))),
    # Two stages per rank under DDP: one flat all-reduce over both per step (this layout
    # once crashed at its first sync, incrementing a read-only sum of the stages' counters).
    "pp2_interleaved_ddp2": (4, dict(parallel={"pp_size": 2, "pp_schedule": "interleaved_1f1b",
                                               "pp_microbatches": 4, "strategy": "ddp"},
                                     data={"batch_size": 4}, train=accum(2))),
    # Activation checkpointing and compile on model-parallel layouts: blocks checkpointed or
    # compiled after TP shards them, and on each pipeline stage (two per rank, interleaved).
    "tp2_sp_compile_accum2": (2, dict(parallel={"tp_size": 2, "sequence_parallel": True, "compile": True},
                                      data={"batch_size": 8}, train=accum(2)), _inductor("tp2_sp")),
    "pp2_1f1b_ac_accum2": (2, dict(parallel={"pp_size": 2, "pp_schedule": "1f1b", "activation_checkpointing": True},
                                   data={"batch_size": 8}, train=accum(2))),
    "pp2_interleaved_compile_accum2": (2, dict(parallel={"pp_size": 2, "pp_schedule": "interleaved_1f1b",
                                                         "pp_microbatches": 4, "compile": True},
                                               data={"batch_size": 8}, train=accum(2)), _inductor("pp2")),
    "tp2_ac_accum2": (2, dict(parallel={"tp_size": 2, "activation_checkpointing": True},
                              data={"batch_size": 8}, train=accum(2))),
    # Both options: each stage's blocks compiled to recompute inside their graphs.
    "pp2_1f1b_compile_ac_accum2": (2, dict(parallel={"pp_size": 2, "pp_schedule": "1f1b", "compile": True,
                                                     "activation_checkpointing": True},
                                           data={"batch_size": 8}, train=accum(2)), _inductor("pp2_1f1b")),
    # TP with sequence parallel, blocks compiled to recompute: the all-gathers run again in backward.
    "tp2_sp_compile_ac_accum2": (2, dict(parallel={"tp_size": 2, "sequence_parallel": True, "compile": True,
                                                   "activation_checkpointing": True},
                                         data={"batch_size": 8}, train=accum(2)), _inductor("tp2_sp_ac")),
    # Stages under FSDP with checkpointed blocks (4 processes: extended).
    "pp2_fsdp2_ac_accum2": (4, dict(parallel={"pp_size": 2, "strategy": "fsdp", "activation_checkpointing": True},
                                    data={"batch_size": 4}, train=accum(2))),
    # TP x PP: each stage's blocks split over 2 ranks; with sequence parallel and two
    # looped stages per rank; and 3-D, FSDP over 2 such replicas (8 processes).
    "tp2_pp2_accum2": (4, dict(parallel={"tp_size": 2, "pp_size": 2, "pp_schedule": "1f1b"},
                               data={"batch_size": 8}, train=accum(2))),
    "tp2_sp_pp2_interleaved_accum2": (4, dict(parallel={"tp_size": 2, "sequence_parallel": True, "pp_size": 2,
                                                        "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4},
                                              data={"batch_size": 8}, train=accum(2))),
    "tp2_pp2_fsdp2_ac_accum2": (8, dict(parallel={"tp_size": 2, "pp_size": 2, "pp_schedule": "gpipe",
                                                  "strategy": "fsdp", "activation_checkpointing": True},
                                        data={"batch_size": 4}, train=accum(2))),
}
# 4 or more processes, the compiled TP and pipeline layouts (tests/test_hf.py's fsdp2_compile_ac
# compiles checkpointed blocks by default); TP x PP runs by default in tests/test_hf.py (the tiny
# Llama, pretrained weights into both splits).
_EXTENDED = {"pp2_fsdp2_ac_accum2", "tp2_sp_compile_accum2", "tp2_sp_compile_ac_accum2", "pp2_1f1b_compile_ac_accum2",
             "pp2_interleaved_compile_accum2", "tp2_pp2_accum2", "tp2_sp_pp2_interleaved_accum2",
             "tp2_pp2_fsdp2_ac_accum2"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The single-process run every layout is compared with."""
    tmp = tmp_path_factory.mktemp("ref")
    return tmp / "one", torchrun(tmp, "one", 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    """Each layout's 10 steps (and "one": the single process), in ``runs.root / name``."""
    return LayoutRuns(tmp_path_factory.mktemp("mp"), LAYOUTS, gpt_config, timeout=240)


@pytest.mark.timeout(300)  # one torchrun job (a compiled one ~30 s on 2 idle cores)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.extended] if n in _EXTENDED else [])
                                  for n in LAYOUTS])
def test_layout_matches_single_process(runs, name):
    one, rows = losses(runs["one"]), runs[name]
    assert len(one) == 10 and one[-1] < one[0] - 0.2, one
    assert _close(losses(rows), one), (name, losses(rows), one)
    if len(LAYOUTS[name]) == 3:  # compiled: TorchInductor built C++ kernels in the run's own cache
        cache = Path(LAYOUTS[name][2]["TORCHINDUCTOR_CACHE_DIR"].format(root=runs.root))
        assert list(cache.rglob("*.so")), cache
    # The global grad norm (over meshes and stages) agrees too.
    assert abs(rows[-1]["grad_norm"] - runs["one"][-1]["grad_norm"]) <= 1e-4 * rows[-1]["grad_norm"]
    assert rows[-1]["samples_seen"] == 160


@pytest.mark.timeout(900)  # trains the 5 layouts it reads when run alone
def test_state_is_split_across_model_parallel_ranks(runs):
    """Per-rank (rank 0) parameter bytes: TP halves every matrix (norms replicated),
    PP holds its stages only, TP x FSDP quarters everything."""
    full = runs["one"][-1]["param_bytes"]
    assert runs["tp2_sp_accum2"][-1]["param_bytes"] < 0.52 * full
    assert runs["pp2_gpipe"][-1]["param_bytes"] < 0.6 * full
    assert runs["tp2_fsdp2_accum2"][-1]["param_bytes"] < 0.27 * full
    # TP x FSDP: one reduce-scatter per FSDP unit (4 blocks + root) per optimizer step.
    assert {r["grad_allreduces"] for r in runs["tp2_fsdp2_accum2"]} == {5}
    # PP x DDP: one flat all-reduce of the stage's gradients per optimizer step.
    assert {r["grad_allreduces"] for r in runs["pp2_ddp2_accum2"]} == {1}
    assert {r["grad_allreduces"] for r in runs["pp2_interleaved_ddp2"]} == {1}


def test_data_goes_to_data_parallel_ranks_only(tmp_path):
    """tp2 x dp2 (4 ranks): ranks of one TP group read the same micro-batches; the two
    DP groups' micro-batch j together are the single process's micro-batch j."""
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.launch.trainer import prepare
    from raytrain_platform.parallel.dims import ParallelDims

    def ids(cfg, rank):
        job = prepare(cfg)
        dims = ParallelDims.from_config(job.config)
        source = LocalBatches(job, rank=dims.data_rank(rank), world_size=dims.dp)
        return [b["sample_id"].tolist() for b in source.train_epoch(0)][:6]

    cfg = gpt_config(tmp_path, "ids", parallel={"tp_size": 2, "strategy": "fsdp"},
                     data={"batch_size": 8}, scaling={"num_workers": 4})
    per_rank = [ids(cfg, r) for r in range(4)]
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    one = ids(gpt_config(tmp_path, "ids1"), 0)
    assert [a + b for a, b in zip(per_rank[0], per_rank[2])] == one[:6]
    pp = gpt_config(tmp_path, "idspp", parallel={"pp_size": 2, "strategy": "ddp"},
                    data={"batch_size": 8}, scaling={"num_workers": 4})
    assert [ids(pp, r) for r in range(4)] == [per_rank[0], per_rank[2], per_rank[0], per_rank[2]]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("source,nproc,target", [
    ("tp2_fsdp2_accum2", 2, "pp2_1f1b_accum2"),  # TP x FSDP 2-D shards -> pipeline stages
    ("pp2_ddp2_accum2", 2, "tp2_sp_accum2"),  # PP x DP stages -> TP shards (DCP reshards by name)
    ("pp2_interleaved_accum2", 1, None),  # interleaved stages -> one process
    # TP x PP's 2-D shards -> one process, and 3-D shards -> TP x PP on 4 ranks
    pytest.param("tp2_sp_pp2_interleaved_accum2", 1, None, marks=pytest.mark.extended),
    pytest.param("tp2_pp2_fsdp2_ac_accum2", 4, "tp2_pp2_accum2", marks=pytest.mark.extended),
])
def test_resume(tmp_path, runs, source, nproc, target):
    """A run directory holding only `source`'s step-5 checkpoint, trained on to step 10."""
    name = f"{source}_to_{target}"
    runs[source]  # trained
    shutil.copytree(runs.root / source / "checkpoint_000005", tmp_path / name / "checkpoint_000005")
    rows = torchrun(tmp_path, name, nproc, **(LAYOUTS[target][1] if target else {}))
    assert [r["step"] for r in rows] == list(range(6, 11)), "did not resume at step 5"
    assert _close(losses(rows), losses(runs["one"])[5:]), losses(rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["tp2_fsdp2_accum2", "pp2_ddp2_accum2",
                                    "pp2_interleaved_accum2", "tp2_sp_accum2", "pp2_1f1b_ac_accum2",
                                    pytest.param("pp2_interleaved_compile_accum2", marks=pytest.mark.extended),
                                    pytest.param("pp2_1f1b_compile_ac_accum2", marks=pytest.mark.extended),
                                    pytest.param("tp2_sp_compile_accum2", marks=pytest.mark.extended),
                                    pytest.param("tp2_pp2_fsdp2_ac_accum2", marks=pytest.mark.extended)])
def test_export_consolidates(tmp_path, runs, source):
    """`rtp export` of a TP / PP / 2-D checkpoint: one safetensors file whose weights,
    in a plain model here, give the validation loss the run logged at step 10. Compiled
    and checkpointed blocks save under the model's own names (no ``_orig_mod`` or
    wrapper prefix): the plain model loads them strictly."""
    from safetensors.torch import load_file

    from raytrain_platform import export_checkpoint, load_config
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.models import build_model
    from raytrain_platform.models.tasks import get_task
    from raytrain_platform.resolve import resolve_job

    run_dir, rows = runs.root / source, runs[source]
    out = export_checkpoint(run_dir, tmp_path / source)
    assert json.loads((out / "export.json").read_text())["step"] == 10
    cfg = load_config(yaml.safe_load((out / "config.yaml").read_text()))
    model = build_model(cfg.model)
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    job = resolve_job(cfg.replace({"parallel.strategy": "none", "parallel.tp_size": 1,
                                   "parallel.pp_size": 1, "parallel.sequence_parallel": False,
                                   "parallel.pp_split": None, "scaling.num_workers": 1,
                                   "data.batch_size": 8}))
    dp = {"tp2_fsdp2_accum2": 2, "pp2_ddp2_accum2": 2, "tp2_pp2_fsdp2_ac_accum2": 2}.get(source, 1)
    # The run evaluated eval_batches (2) x dp micro-batches of its batch size.
    n_rows = 2 * dp * cfg.data.batch_size
    task, sums = get_task("lm"), torch.zeros(3)
    with torch.no_grad():
        for batch in LocalBatches(job, rank=0, world_size=1).val_batches(n_rows // 8):
            inputs, targets = task.split({"tokens": batch["tokens"].long()})
            sums += task.eval_sums(model(inputs), targets)
    val_loss = float(sums[0] / sums[1])
    assert abs(val_loss - rows[-1]["val_loss"]) <= 1e-5 * val_loss, (source, val_loss, rows[-1])


_HOOK_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from raytrain_platform.core.weights import materialize
from raytrain_platform.parallel.tp import apply_tp
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
with torch.device("meta"):
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
apply_tp(model, mesh=init_device_mesh("cpu", (1,)), plan={"0": "embedding", "1": "head"},
         sequence_parallel=False, reshard_grads=True)
materialize(model, torch.device("cpu"))
with torch.no_grad():
    for p in model.parameters():
        p.normal_()
model(torch.tensor([[1, 2, 3]])).sum().backward()
w = model[0].weight
print("PLACEMENTS", w.placements == w.grad.placements, w.placements, w.grad.placements)
"""


def test_tp_gradient_hooks_survive_a_meta_device_build(tmp_path):
    """TP keeps only a row-split embedding's own rows of its gradient with a hook on the
    parameter; a pretrained or resumed model is built on the meta device, and
    `to_empty` gave it new parameters without the hook: each TP rank held the whole
    vocabulary's gradient (and a tied head's two pipeline copies could not be summed,
    their local shapes differing). `materialize` moves the hooks to the new parameters."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", _HOOK_SCRIPT], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PLACEMENTS True (Shard(dim=0),) (Shard(dim=0),)" in proc.stdout, proc.stdout


_BLOCKS_SCRIPT = """
import json, sys, torch.distributed as dist
from raytrain_platform.config import ParallelConfig
from raytrain_platform.core.dist import DistEnv
from raytrain_platform.models import get_family
from raytrain_platform.parallel.compose import parallelize
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
dist.init_process_group("gloo")
fam, kwargs, out = get_family("gpt"), json.loads(sys.argv[1]), {}
for name, par in json.loads(sys.argv[2]).items():
    model = fam.build(kwargs)
    wrapped = parallelize(model, env=DistEnv.current(use_gpu=False), cfg=ParallelConfig(**par), family=fam,
                          model_kwargs=kwargs)
    modules = list(wrapped.base.named_modules())  # a pipeline: this rank's stages, merged
    # Compiled: by Module.compile(), or its forward compiled to recompute inside the graph.
    recomputing = sorted(n for n, m in modules if getattr(vars(m).get("forward"), "__name__", "") == "forward_recomputing")
    out[name] = {"checkpointed": sorted(n for n, m in modules if isinstance(m, CheckpointWrapper)),
                 "compiled": sorted({n for n, m in modules if m._compiled_call_impl is not None} | set(recomputing)),
                 "recomputing": recomputing}
if dist.get_rank() == 0:
    print("BLOCKS " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_block_options_reach_every_layouts_blocks(tmp_path):
    """Which modules `parallelize` checkpointed or compiled (with both options: compiled
    to recompute inside their graphs), read back on rank 0 of 2: every block of the
    TP-sharded model, and every block of the rank's pipeline stages (1F1B: blocks 0-1
    of 4; interleaved: stages 0 and 2, blocks 0 and 2), nothing else."""
    import subprocess

    from conftest import ROOT, torchrun_launch

    layouts = {"tp_ac": {"tp_size": 2, "activation_checkpointing": True},
               "tp_compile": {"tp_size": 2, "compile": True},
               "pp_ac": {"pp_size": 2, "activation_checkpointing": True},
               "pp_interleaved_compile": {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "compile": True},
               "tp_both": {"tp_size": 2, "compile": True, "activation_checkpointing": True},
               "pp_interleaved_both": {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "compile": True,
                                       "activation_checkpointing": True}}
    script = tmp_path / "blocks.py"
    script.write_text(_BLOCKS_SCRIPT)
    proc = subprocess.run([*torchrun_launch(2), str(script),
                           json.dumps(MODEL["kwargs"]), json.dumps(layouts)],
                          capture_output=True, text=True, cwd=ROOT, timeout=110,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("BLOCKS "))[7:])
    every = [f"blocks.{i}" for i in range(4)]
    assert got["tp_ac"] == {"checkpointed": every, "compiled": [], "recomputing": []}, got
    assert got["tp_compile"] == {"checkpointed": [], "compiled": every, "recomputing": []}, got
    assert got["pp_ac"] == {"checkpointed": ["blocks.0", "blocks.1"], "compiled": [], "recomputing": []}, got
    rank0 = ["blocks.0", "blocks.2"]
    assert got["pp_interleaved_compile"] == {"checkpointed": [], "compiled": rank0, "recomputing": []}, got
    assert got["tp_both"] == {"checkpointed": [], "compiled": every, "recomputing": every}, got
    assert got["pp_interleaved_both"] == {"checkpointed": [], "compiled": rank0, "recomputing": rank0}, got
    # Rank 0 says once per compiled model that the first step compiles, not once per stage.
    assert proc.stdout.count("parallel.compile: ") == 4, proc.stdout


_SAVED_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from raytrain_platform.config import ParallelConfig
from raytrain_platform.core.dist import DistEnv
from raytrain_platform.models import get_family
from raytrain_platform.parallel.compose import parallelize
from raytrain_platform.parallel.memory import saved_activation_bytes
dist.init_process_group("gloo")
fam, out = get_family("gpt"), {}
kwargs = fam.resolve_kwargs(json.loads(sys.argv[1]))
ids = torch.randint(0, kwargs["vocab_size"], (2, kwargs["block_size"]), generator=torch.Generator().manual_seed(0))
for name, par in json.loads(sys.argv[2]).items():  # in this order, in this one process
    torch.manual_seed(0)
    wrapped = parallelize(fam.build(kwargs), env=DistEnv.current(use_gpu=False), cfg=ParallelConfig(**par),
                          family=fam, model_kwargs=kwargs)
    for _ in range(2):  # the second step runs the compiled graphs
        logits, saved = saved_activation_bytes(lambda: wrapped.module(ids), list(wrapped.base.parameters()))
        logits.float().square().mean().backward()
    out[name] = saved
if dist.get_rank() == 0:
    print("SAVED " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.extended  # 4 torchrun processes compiling, ~45 s: one process shows the same by default (test_families)
@pytest.mark.timeout(240)
def test_both_block_options_keep_what_checkpointing_keeps_under_fsdp2_and_tp(tmp_path):
    """Compile with checkpointing on FSDP2 and TP layouts, rank 0 of 2: the bytes autograd
    holds for backward after a step's forward are at most what the eager wrapper holds
    (FSDP2's gathered weights, which both free after each block, not counted), far
    below compile alone. Each "both" runs after "compile" of the same blocks in the same
    process, so a graph reused from it fails here. Measured: FSDP2 21 KB with both, 25 KB
    checkpointed, 262 KB compiled; TP 25, 25 and 175 KB. Under FSDP2 this needs the
    forward compiled alone, FSDP2's hooks outside it: compiling the module's whole call
    (as ``Module.compile()`` does) kept 266 KB here, as much as compile alone."""
    import subprocess

    from conftest import ROOT, torchrun_launch

    layouts = {f"{kind}_{option}": {**split, **flags} for kind, split in
               (("fsdp", {"strategy": "fsdp"}), ("tp", {"tp_size": 2}))
               for option, flags in (("compile", {"compile": True}),
                                     ("both", {"compile": True, "activation_checkpointing": True}),
                                     ("ac", {"activation_checkpointing": True}))}
    script = tmp_path / "saved.py"
    script.write_text(_SAVED_SCRIPT)
    proc = subprocess.run([*torchrun_launch(2), str(script), json.dumps(MODEL["kwargs"]), json.dumps(layouts)],
                          capture_output=True, text=True, cwd=ROOT, timeout=230,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SAVED "))[6:])
    for kind in ("fsdp", "tp"):
        assert 0 < saved[f"{kind}_both"] <= 1.05 * saved[f"{kind}_ac"], saved
        assert saved[f"{kind}_ac"] < 0.25 * saved[f"{kind}_compile"], saved


@pytest.mark.parametrize("patch,field,needle", [
    ({"parallel": {"tp_size": 3}, "scaling": {"num_workers": 4}}, "scaling.num_workers",
     "multiple of parallel.tp_size (3) x parallel.pp_size (1) = 3"),
    ({"parallel": {"tp_size": 4}, "scaling": {"num_workers": 4}}, "parallel.tp_size",
     "divisor of model.kwargs.n_head (2)"),
    ({"parallel": {"pp_size": 8}, "scaling": {"num_workers": 8}}, "parallel.pp_size",
     "at most model.kwargs.n_layer (4)"),
    ({"parallel": {"pp_size": 2, "pp_microbatches": 3}, "scaling": {"num_workers": 2}},
     "parallel.pp_microbatches", "divisor of data.batch_size (16)"),
    ({"parallel": {"pp_size": 2, "pp_split": [1, 2]}, "scaling": {"num_workers": 2}},
     "parallel.pp_split", "summing to model.kwargs.n_layer (4)"),
    ({"parallel": {"pp_size": 2, "pp_schedule": "zb"}, "scaling": {"num_workers": 2}},
     "parallel.pp_schedule", "one of ['gpipe', '1f1b', 'interleaved_1f1b']"),
    ({"parallel": {"tp_size": 2, "strategy": "ddp"}, "scaling": {"num_workers": 4}},
     "parallel.strategy", "'fsdp' for data parallel over tensor-parallel groups"),
    ({"parallel": {"tp_size": 2}, "scaling": {"num_workers": 4}}, "scaling.num_workers",
     "exactly 1 worker(s) per model replica (data-parallel size 2)"),
    ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel", "tp_size > 1"),
    ({"parallel": {"tp_size": 2, "pp_size": 2, "strategy": "ddp"}, "scaling": {"num_workers": 8}}, "parallel.strategy",
     "'fsdp' for data parallel over tensor-parallel groups (tp_size 2 x dp 2"),
    ({"parallel": {"tp_size": 4, "pp_size": 2}, "scaling": {"num_workers": 8}}, "parallel.tp_size",
     "divisor of model.kwargs.n_head (2)"),
    ({"model": {"name": "mlp", "kwargs": {}}, "parallel": {"tp_size": 2},
      "scaling": {"num_workers": 2}}, "parallel.tp_size", "for model 'mlp'"),
])
def test_bad_layouts_are_refused_naming_the_numbers(tmp_path, patch, field, needle):
    from raytrain_platform import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(gpt_config(tmp_path, "bad", **patch))
    assert err.value.field == field and needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.extended  # the Ray launcher equals the torchrun core: test_ray_train shows it for DDP in the default run
@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp2_fsdp2_accum2", "tp2_pp2_accum2"])
def test_tp_fsdp_under_ray_train_matches_reference(ray_cluster, tmp_path, reference, layout):
    """tp2 x dp2, and tp2 x pp2, through TorchTrainer (4 workers at 0.25 CPU, Ray Data
    ingest): the same losses as the single process, sharded checkpoints from all 4 ranks."""
    from raytrain_platform.launch.trainer import train

    cfg = gpt_config(tmp_path, "ray_tp", **LAYOUTS[layout][1],
                     scaling={"num_workers": 4, "cpus_per_worker": 0.25, "torch_threads": 1})
    result = train(cfg, progress=False)
    assert _close(losses(result.metrics), losses(reference[1])), losses(result.metrics)
    shards = sorted(p.name for p in (result.checkpoint / "sharded").glob("*.distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_ray_data_deals_micro_batches_to_data_parallel_ranks(ray_cluster, tmp_path):
    """The real Ray Data pipeline of a tp2 x dp2 job is unsplit; each of 4 readers deals
    it by data-parallel rank: TP peers get identical sample ids, the DP groups disjoint
    ones that together cover whole rounds in source order."""
    import ray

    from raytrain_platform.data.ray_data import build_datasets, ingest_options
    from raytrain_platform.launch.trainer import prepare
    from raytrain_platform.launch.worker import deal
    from raytrain_platform.parallel.dims import ParallelDims

    job = prepare(gpt_config(tmp_path, "rayids", parallel={"tp_size": 2, "strategy": "fsdp"},
                             data={"batch_size": 8}, scaling={"num_workers": 4}))
    ds = build_datasets(job.config, job.data)["train"]
    ds.context.execution_options = ingest_options()
    dims = ParallelDims.from_config(job.config)

    @ray.remote(num_cpus=0)
    def ids_of(rank):
        batches = ds.iter_batches(batch_size=8, drop_last=True, batch_format="numpy")
        return [b["sample_id"].tolist() for b in deal(batches, rank=dims.data_rank(rank),
                                                      world=dims.dp, rounds=3)]

    per_rank = ray.get([ids_of.remote(r) for r in range(4)])
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    assert len(per_rank[0]) == 3 and not set(sum(per_rank[0], [])) & set(sum(per_rank[2], []))
    # In source order: the single process's micro-batches of 16 (torchrun reader, the
    # same order contract) are DP group 0's then group 1's micro-batch of 8.
    from raytrain_platform.data.local import LocalBatches

    one = prepare(gpt_config(tmp_path, "rayids1"))
    first = [b["sample_id"].tolist() for b in LocalBatches(one, rank=0, world_size=1).train_epoch(0)][:3]
    assert [a + b for a, b in zip(per_rank[0], per_rank[2])] == first
