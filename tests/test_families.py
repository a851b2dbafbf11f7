"""Model families (models/family.py): one interface for every model.

Pure tests of the registry and what a family answers; a user model that returns a
Hugging Face output (a `transformers` `LlamaForCausalLM` built from a config) trained
with FSDP per decoder layer under torchrun against one process; and the same model
through Ray Train with text data and ``data.seq_len`` (no ``block_size`` key).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LM_TRAIN, ROOT, assert_losses_close, job_config, torchrun_metrics

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # user_models, as model.name "user_models:..."
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
# fp32 on gloo: FSDP's reduce-scatter and one process's single batch sum in another order
# (measured here: <= 3e-7 relative over 10 steps); 1e-5 still catches a lost gradient.
RTOL = 1e-5


def llama_config(tmp: Path, name: str, **sections) -> dict:
    return job_config(tmp, name, dict(
        model={"name": "user_models:tiny_llama", "task": "lm", "kwargs": {}},
        data={"source": "text", "batch_size": 4, "seq_len": 32, "max_files": 12, "val_fraction": 0.05},
        train=dict(LM_TRAIN), run={"checkpoint_every": 10, "eval_every": 10}), **sections)


# ---------------------------------------------------------------- pure


def test_registry_lists_the_families_and_the_import_path_form():
    from raytrain_platform import ConfigError
    from raytrain_platform.models import family_names, get_family
    from raytrain_platform.models.user import UserFamily

    assert family_names() == ["gpt", "hf", "mlp"]
    assert isinstance(get_family("user_models:tiny_llama"), UserFamily)
    with pytest.raises(ConfigError) as err:
        get_family("resnet")
    assert str(err.value) == ("model.name = 'resnet': expected one of ['gpt', 'hf', 'mlp'] or an import path "
                              "'pkg.module:build_fn'")


def test_blocks_are_the_largest_modulelist_of_one_class_or_named_by_class():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from raytrain_platform import ConfigError
    from raytrain_platform.models import find_blocks, get_family
    from user_models import tiny_llama

    model = tiny_llama(num_layers=3)
    found = find_blocks(model)
    assert [n for n, _ in found] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert all(isinstance(m, LlamaDecoderLayer) for _, m in found)
    assert [n for n, _ in find_blocks(model, block_class="LlamaRMSNorm")][:2] == [
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"]
    with pytest.raises(ConfigError, match="model.block_class = 'Nope'.*LlamaDecoderLayer"):
        find_blocks(model, block_class="Nope")
    gpt = get_family("gpt")
    kw = gpt.resolve_kwargs({"n_layer": 3})
    assert [n for n, _ in gpt.blocks(gpt.build(kw))] == ["blocks.0", "blocks.1", "blocks.2"]
    mlp = get_family("mlp")
    assert mlp.blocks(mlp.build(mlp.resolve_kwargs({"input_dim": 4, "num_outputs": 2}))) == []


def test_outputs_become_logits_or_fail_naming_the_model():
    from raytrain_platform import ConfigError
    from raytrain_platform.models.tasks import get_task
    from user_models import dict_output, tiny_llama, tuple_output

    tokens = torch.randint(0, 256, (2, 9))
    task = get_task("lm", "user_models:x")
    inputs, targets = task.split({"tokens": tokens})
    llama = tiny_llama()
    out = llama(inputs)
    assert type(out).__name__ == "CausalLMOutputWithPast" and not isinstance(out, torch.Tensor)
    torch.testing.assert_close(task.loss(out, targets), torch.nn.functional.cross_entropy(
        out.logits.reshape(-1, 256), targets.reshape(-1)))
    assert task.loss(dict_output()(inputs), targets).ndim == 0
    with pytest.raises(ConfigError) as err:
        task.loss(tuple_output()(inputs), targets)
    assert str(err.value) == ("model.name = 'user_models:x': expected a module whose forward returns "
                              "logits (a tensor) or an output with .logits; it returned tuple")


def test_loss_mask_counts_only_marked_targets():
    from raytrain_platform.models.tasks import get_task

    tokens = torch.randint(0, 256, (2, 9))
    mask = torch.zeros(2, 9, dtype=torch.uint8)
    mask[:, 5:] = 1  # targets 5..8 count; positions 1..4 are prompt
    logits = torch.randn(2, 8, 256)
    task = get_task("lm")
    inputs, targets = task.split({"tokens": tokens, "loss_mask": mask})
    want = torch.nn.functional.cross_entropy(logits[:, 4:].reshape(-1, 256), tokens[:, 5:].reshape(-1))
    torch.testing.assert_close(task.loss(logits, targets), want)
    sums = task.eval_sums(logits, targets)
    assert float(sums[1]) == 8.0  # 2 samples x 4 counted targets


@pytest.mark.parametrize("task_name", ["lm", "classification", "regression"])
def test_eval_sums_stay_on_the_outputs_device(task_name):
    """The evaluation sums are all-reduced where the model ran: a count made on the CPU
    beside a GPU's loss failed `torch.stack` at the first evaluation of a GPU mlp job.
    The meta device stands in for a GPU here (any device but the CPU shows it)."""
    from raytrain_platform.models.tasks import get_task

    task = get_task(task_name)
    outputs = torch.zeros(4, 8, 16, device="meta") if task_name == "lm" else torch.zeros(
        4, 3 if task_name == "classification" else 1, device="meta")
    targets = (torch.zeros(4, 8, dtype=torch.long, device="meta") if task_name == "lm" else
               torch.zeros(4, dtype=torch.long, device="meta") if task_name == "classification" else
               torch.zeros(4, 1, device="meta"))
    sums = task.eval_sums(outputs, targets)
    assert sums.device.type == "meta" and sums.shape == (3,)


def test_process_group_backend_keeps_gloo_beside_nccl_for_cpu_offload():
    """FSDP's CPU offload all-reduces host tensors (the gradient norm, the weights
    check): NCCL has none, so gloo serves the CPU beside it. Both torch and Ray Train's
    TorchConfig read the same string (Ray then sets up NCCL as for "nccl")."""
    from ray.train.torch.config import _is_backend_nccl
    from torch.distributed.distributed_c10d import BackendConfig

    from raytrain_platform.core.dist import process_group_backend

    offload = process_group_backend(use_gpu=True, cpu_offload=True)
    assert BackendConfig(offload).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert _is_backend_nccl(offload)
    assert (process_group_backend(use_gpu=True), process_group_backend(use_gpu=False)) == ("nccl", "gloo")


def test_gpt_head_on_counted_tokens_gives_the_same_loss_accuracy_and_gradients():
    """gpt's output head (`lm_head`, after `ln_f`) run on the counted rows only
    (core/counted.py): the summed loss, the eval sums (loss, count, correct) and every
    gradient equal those over every position; without a head, every position."""
    from raytrain_platform.core.counted import counted_positions
    from raytrain_platform.models import get_family
    from raytrain_platform.models.tasks import get_task

    torch.manual_seed(0)
    family, task = get_family("gpt"), get_task("lm")
    kwargs = family.resolve_kwargs({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16})
    model = family.build(kwargs)
    tokens = torch.randint(0, 256, (3, 17))
    mask = (torch.rand(3, 17) < 0.4).to(torch.uint8)
    inputs, targets = task.split({"tokens": tokens, "loss_mask": mask})
    results = []
    for head in (family.output_head(model), None):
        with counted_positions(head, targets) as kept:
            out = model(inputs)
        kept_targets = kept.targets(out)
        loss = task.loss_sum(out, kept_targets)
        loss.backward()
        results.append((out.shape, float(loss.detach()), task.eval_sums(out.detach(), kept_targets),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (shape_c, loss_c, sums_c, grads_c), (shape_a, loss_a, sums_a, grads_a) = results
    counted = int((targets != -100).sum())
    assert tuple(shape_c) == (counted, 256) and tuple(shape_a) == (3, 16, 256) and 0 < counted < 48
    assert loss_c == pytest.approx(loss_a, rel=1e-6)
    torch.testing.assert_close(sums_c, sums_a, rtol=1e-6, atol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_c[name], grads_a[name], rtol=1e-5, atol=1e-7)


def test_meta_build_allocates_nothing_and_initialises_after_to_empty():
    from raytrain_platform.models import get_family

    fam = get_family("gpt")
    kw = fam.resolve_kwargs({"n_layer": 2, "n_embd": 32, "n_head": 2})
    meta = fam.build(kw, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    fam.init_weights(meta)
    torch.manual_seed(0)
    cpu = fam.build(kw)
    torch.manual_seed(0)
    fam.init_weights(cpu)  # the same draws in the same order: the same weights
    for (name, a), (_, b) in zip(meta.named_parameters(), cpu.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_tp_and_pp_ask_the_family():
    from raytrain_platform import ConfigError, load_config

    base = llama_config(Path("/tmp"), "x")
    for patch, field in (({"tp_size": 2}, "parallel.tp_size"), ({"pp_size": 2}, "parallel.pp_size")):
        cfg = {**base, "parallel": patch, "scaling": {"num_workers": 2}}
        with pytest.raises(ConfigError) as err:
            load_config(cfg)
        assert err.value.field == field and "for model 'user_models:tiny_llama'" in str(err.value)
        assert "exist for gpt" in str(err.value)


@pytest.mark.parametrize("patch,field,needle", [
    ({"model": {"name": "no_such_module_xyz:build", "task": "lm"}}, "model.name", "an importable module"),
    ({"model": {"name": "user_models:tiny_llama", "task": "lm", "kwargs": {"layers": 2}}},
     "model.kwargs", "arguments that user_models:tiny_llama accepts"),
    ({"model": {"name": "user_models:not_a_module", "task": "lm"}}, "model.name",
     "a function returning torch.nn.Module (it returned dict)"),
    ({"model": {"name": "user_models:tiny_llama", "task": "lm", "block_class": "Nope"},
      "parallel": {"strategy": "fsdp"}}, "model.block_class", "LlamaDecoderLayer"),
    ({"data": {"source": "text", "batch_size": 4, "seq_len": None}}, "data.seq_len",
     "an integer >= 1 for the language model 'user_models:tiny_llama'"),
])
def test_what_can_be_checked_before_ray_is_checked_then(tmp_path, patch, field, needle):
    """`rtp validate` (no Ray): the builder imports, takes its kwargs, returns a module."""
    import yaml

    cfg = llama_config(tmp_path, "pre", **patch)
    if "model" in patch:
        cfg["model"] = patch["model"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "validate", str(path)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field} = ") and needle in lines[0], lines
    assert proc.stdout == ""


def test_compile_and_checkpointing_need_blocks_and_say_which_field_asked():
    """A user model whose blocks cannot be found: the field that needs them is named,
    before Ray (precheck), and `apply_compile` given no blocks says the same."""
    from raytrain_platform import ConfigError
    from raytrain_platform.models import get_family
    from raytrain_platform.parallel.compile import apply_compile

    fam = get_family("user_models:no_linear")  # a Sequential of a reshape, a Conv1d, a flatten
    fam.precheck({}, block_class=None, needs_blocks=None)
    for field in ("parallel.activation_checkpointing", "parallel.compile"):
        with pytest.raises(ConfigError) as err:
            fam.precheck({}, block_class=None, needs_blocks=field)
        assert err.value.field == field and "model.block_class" in str(err.value)
    with pytest.raises(ConfigError, match=r"parallel.compile = True: expected false for a model without"):
        apply_compile([], device=torch.device("cpu"))


_SAVED_BY_OPTION = """
import json, sys
import torch
from raytrain_platform.config import ParallelConfig
from raytrain_platform.core.dist import DistEnv
from raytrain_platform.models import get_family
from raytrain_platform.parallel.compose import parallelize
from raytrain_platform.parallel.memory import saved_activation_bytes

fam = get_family(sys.argv[1])
kwargs, out = fam.resolve_kwargs(json.loads(sys.argv[2])), {}
env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
eager = None
for option, par in {"eager": {}, "checkpointed": {"activation_checkpointing": True}, "compiled": {"compile": True},
                    "both": {"compile": True, "activation_checkpointing": True}}.items():
    torch.manual_seed(0)
    model = parallelize(fam.build(kwargs), env=env, cfg=ParallelConfig(strategy="none", **par), family=fam,
                        model_kwargs=kwargs).module
    logits, saved = saved_activation_bytes(lambda: model(ids), list(model.parameters()))
    getattr(logits, "logits", logits).float().square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    eager = eager or grads  # all gradients against eager's, as one vector: |g - e| / |e|
    diff = sum(((g - e) ** 2).sum() for g, e in zip(grads, eager, strict=True)) ** 0.5
    out[option] = {"saved": saved, "grad_diff": (diff / sum((e ** 2).sum() for e in eager) ** 0.5).item()}
print("SAVED " + json.dumps(out))
"""


@pytest.mark.timeout(240)
# Both cases are extended (~30 s compiling each; the default suite's tests/test_hf.py
# fsdp2_compile_ac compiles checkpointed blocks by default)
@pytest.mark.extended
@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_checkpointing_inside_compiled_blocks_keeps_what_eager_checkpointing_keeps(tmp_path, tiny, family):
    """Both block options: each compiled block recomputes inside its graph
    (parallel/compile.py), so autograd keeps, besides the weights, what the eager
    checkpoint wrapper keeps (measured: gpt the same bytes; the tiny Llama 2.5% more, the
    rotary cos/sin its layers' graphs take as inputs), far less than compile alone
    (a tenth to a fifth here), with the same gradients (all of them as one vector:
    measured 2.9e-7 relative, compile's own rounding). One process, in its own interpreter: dynamo's graphs
    and Inductor's compile workers stay out of pytest's. "both" compiles the same block
    class after "compiled" did in that interpreter, so a graph reused from it (which
    keeps what compile alone keeps) fails the test."""
    kwargs = ({"vocab_size": 256, "block_size": 64, "n_layer": 3, "n_head": 4, "n_embd": 64} if family == "gpt"
              else {"path": str(tiny["model"])})
    proc = subprocess.run([sys.executable, "-c", _SAVED_BY_OPTION, family, json.dumps(kwargs)], capture_output=True,
                          text=True, timeout=220, cwd=ROOT,
                          env={**os.environ, **ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SAVED "))[6:])
    saved = {option: got[option]["saved"] for option in got}
    assert saved["checkpointed"] < 0.2 * saved["eager"], saved  # the wrapper really drops activations
    assert saved["checkpointed"] <= saved["both"] <= 1.05 * saved["checkpointed"], saved
    assert saved["both"] < 0.25 * saved["compiled"], saved
    for option in ("checkpointed", "compiled", "both"):
        assert got[option]["grad_diff"] < 1e-5, got


def test_gpt_seq_len_defaults_to_block_size_and_may_not_exceed_it(tmp_path):
    from raytrain_platform import ConfigError, load_config

    cfg = llama_config(tmp_path, "g")
    cfg["model"] = {"name": "gpt", "kwargs": {"block_size": 16}}
    cfg["data"] = {**cfg["data"], "seq_len": None}
    assert load_config(cfg).seq_len == 16
    cfg["data"]["seq_len"] = 8
    assert load_config(cfg).seq_len == 8
    cfg["data"]["seq_len"] = 17
    with pytest.raises(ConfigError, match=r"data.seq_len = 17: expected at most 16"):
        load_config(cfg)


# ---------------------------------------------------------------- torchrun (no Ray)


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One process, and FSDP over 2 ranks, of the Hugging Face user model (10 steps)."""
    tmp = tmp_path_factory.mktemp("llama")
    runs = {}
    for name, nproc, sections in (("one", 1, {"data": {"batch_size": 8}}),
                                  ("fsdp", 2, {"parallel": {"strategy": "fsdp"}})):
        cfg = llama_config(tmp, name, **sections)
        runs[name] = torchrun_metrics(cfg, tmp / f"{name}.yaml", nproc, env=ENV, timeout=240)
    return runs


@pytest.mark.slow
def test_hf_output_user_model_fsdp_matches_one_process(llama_runs):
    one, fsdp = ([r["loss"] for r in llama_runs[k]] for k in ("one", "fsdp"))
    assert len(one) == 10 and one[-1] < one[0] - 0.3, one  # it learns
    assert_losses_close(fsdp, one, rtol=RTOL)


@pytest.mark.slow
def test_fsdp_shards_each_decoder_layer_then_the_root(tmp_path):
    """The units FSDP made, read back from the modules: every LlamaDecoderLayer and the
    root, nothing else (one process, its own gloo group)."""
    code = (
        "import torch, sys; sys.path.insert(0, %r)\n"
        "from raytrain_platform.config import ParallelConfig\n"
        "from raytrain_platform.core.dist import DistEnv\n"
        "from raytrain_platform.models import get_family\n"
        "from raytrain_platform.parallel.compose import parallelize\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "fam = get_family('user_models:tiny_llama')\n"
        "model = fam.build({'num_layers': 3})\n"
        "cfg = ParallelConfig(strategy='fsdp', activation_checkpointing=True)\n"
        "parallelize(model, env=DistEnv.current(use_gpu=False), cfg=cfg, family=fam, model_kwargs={})\n"
        "units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]\n"
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper\n"
        "ac = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]\n"
        "print(units); print(ac)\n") % str(TESTS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, **ENV})
    assert out.returncode == 0, out.stderr[-2000:]
    units, ac = (eval(line) for line in out.stdout.strip().splitlines()[-2:])  # noqa: S307 (our own print)
    assert units == ["", "model.layers.0", "model.layers.1", "model.layers.2"], units
    assert ac == ["model.layers.0", "model.layers.1", "model.layers.2"], ac


# ---------------------------------------------------------------- Ray


@pytest.mark.extended  # the Ray launcher equals the torchrun core: test_ray_train shows it for DDP in the default run
@pytest.mark.ray
@pytest.mark.timeout(420)
def test_hf_output_user_model_under_ray_matches_torchrun_and_exports_its_own_names(
        ray_cluster, tmp_path, llama_runs):
    """Through TorchTrainer with Ray Data text ingest and data.seq_len (no block_size):
    the FSDP run's losses equal the torchrun one's; the export keeps the model's own
    parameter names (no wrapper prefix)."""
    from raytrain_platform.export import export_checkpoint
    from raytrain_platform.launch.trainer import train

    cfg = llama_config(tmp_path, "ray_fsdp", parallel={"strategy": "fsdp"},
                       scaling={"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1})
    result = train(cfg, progress=False)
    assert_losses_close([r["loss"] for r in result.metrics], [r["loss"] for r in llama_runs["fsdp"]],
                        rtol=RTOL)
    out = export_checkpoint(result.run_dir, tmp_path / "export", trust_builder=True)  # a user builder's run
    from safetensors.torch import load_file

    names = sorted(load_file(str(out / "model.safetensors")))
    from user_models import tiny_llama

    assert names == sorted(tiny_llama().state_dict()), names[:5]
    info = json.loads((out / "export.json").read_text())
    assert info["model"]["name"] == "user_models:tiny_llama" and info["step"] == 10


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_an_output_without_logits_fails_on_the_first_step_in_one_line(ray_cluster, tmp_path):
    from raytrain_platform.errors import ConfigError, user_cause
    from raytrain_platform.launch.trainer import train

    cfg = llama_config(tmp_path, "bad_output", model={"name": "user_models:tuple_output", "task": "lm"})
    with pytest.raises(Exception) as err:
        train(cfg, progress=False)
    cause = user_cause(err.value)
    assert isinstance(cause, ConfigError), repr(err.value)[:500]
    assert str(cause) == ("model.name = 'user_models:tuple_output': expected a module whose forward "
                          "returns logits (a tensor) or an output with .logits; it returned tuple")
