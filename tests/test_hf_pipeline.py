"""Pipeline parallelism for Hugging Face decoders (models/hf_pipeline.py): a stage's
forward is transformers' own forward, cut by decoder layer.

- Applied to a whole model, the stage module gives transformers' logits exactly (llama,
  mistral, qwen2, qwen3 with sliding-window layers, under sdpa and eager attention; a
  llama config with a stray ``sliding_window`` key).
- For every architecture of the matrix with a ``base_model_pp_plan`` (tests/hf_archs.py),
  three stages chained in one process give the whole model's logits, and their
  parameters split the model's names between them, disjoint; that list is
  `PIPELINE_TYPES`, what the config check lets through.
- Interleaved 1F1B (two stages per rank) on a pretrained 4-layer Llama under torchrun
  matches one process over 10 steps, each rank holding about half the parameters (it
  read only its stages' weights), and its export loads in `transformers` with the
  platform's logits. 1F1B, GPipe x FSDP and compiled checkpointed stages run in
  tests/test_hf.py's layouts.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, LayoutRuns, assert_losses_close, hf_config, tied_copy, torchrun_metrics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(600)

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _model(arch: str, attn: str):
    """A random model of `arch`; the sliding ones with a window of 5 on some layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config = {"llama": lambda: LlamaConfig(**SMALL),
              # a stray key transformers keeps and Llama's forward ignores: still causal masks
              "llama_stray_window": lambda: LlamaConfig(**SMALL, sliding_window=5),
              "mistral": lambda: MistralConfig(**SMALL, sliding_window=5),  # every layer
              "qwen2": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=2),
              "qwen3": lambda: Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=5,
                                           max_window_layers=1)}[arch]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "llama_stray_window", "mistral", "qwen2", "qwen3"])
def test_the_stage_forward_is_transformers_forward(arch, attn):
    from raytrain_platform.models.hf_pipeline import HFPipelineStage

    model = _model(arch, attn)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        stage = HFPipelineStage(copy.deepcopy(model))
        assert list(stage.state_dict()) == list(model.state_dict())  # the checkpoint's names
        torch.testing.assert_close(stage(ids), want, rtol=0, atol=0)


def _three_stages(fam, model):
    from raytrain_platform.parallel.pp import _prune

    def stage(blocks: range, first: bool, last: bool):
        staged = fam.pipeline_module(copy.deepcopy(model))
        return _prune(staged, fam.pipeline_layout(staged), blocks, first=first, last=last)
    return stage(range(0, 1), True, False), stage(range(1, 2), False, False), stage(range(2, 3), False, True)


def test_the_architectures_with_stages_are_the_ones_shown_here():
    """`PIPELINE_TYPES` (what `check_model_parallel` lets through) is the matrix's
    architectures with a ``base_model_pp_plan``: each shown below."""
    from hf_archs import ARCHS, arch_config

    from raytrain_platform.models.hf_pipeline import PIPELINE_TYPES

    with_plan = [a for a in ARCHS if arch_config(a, vocab_size=97, bos=1, eos=2, pad=0).base_model_pp_plan]
    assert sorted(PIPELINE_TYPES) == sorted(a for a in with_plan)
    assert set(ARCHS) - set(with_plan) == {"gpt2", "opt"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gpt_neox", "phi3", "gemma2",
                                  "gemma3_text", "olmo2", "qwen3_moe", "mixtral"])
def test_three_stages_chained_are_transformers_forward_for_each_architecture(arch):
    """The split comes from the architecture's ``base_model_pp_plan`` (GPT-NeoX:
    ``gpt_neox.embed_in`` and its dropout first, ``final_layer_norm`` last); the first,
    a middle and the last stage chained give transformers' logits exactly (the middle
    and last stages take hidden states as ``inputs_embeds``: nothing before the layers
    runs twice), and their parameters split the model's names, disjoint."""
    from hf_archs import arch_config
    from transformers import AutoModelForCausalLM

    from raytrain_platform.models import get_family

    fam = get_family("hf")
    config = arch_config(arch, vocab_size=97, bos=1, eos=2, pad=0, num_hidden_layers=3)
    torch.manual_seed(0)
    # Gemma: eager attention (Gemma 2's soft-capped scores); windows of 8 in 20 tokens matter
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager" if "gemma" in arch else "sdpa")
    model.eval()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    first, middle, last = _three_stages(fam, model)
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(last(middle(first(ids))), want, rtol=0, atol=0)
    names = [set(s.state_dict()) for s in (first, middle, last)]
    assert not (names[0] & names[1] or names[1] & names[2] or names[0] & names[2])
    assert set().union(*names) == set(model.state_dict())
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    assert f"{embedding}.weight" in names[0] and "lm_head.weight" in names[2]


def test_two_stages_chained_are_the_whole_model_and_split_its_names():
    from raytrain_platform.models import get_family
    from raytrain_platform.parallel.pp import _prune

    fam = get_family("hf")
    model = _model("qwen2", "sdpa")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    staged = fam.pipeline_module(copy.deepcopy(model))
    layout = fam.pipeline_layout(staged)
    with torch.no_grad():
        want = model(ids).logits
        first = _prune(staged, layout, range(0, 1), first=True, last=False)
        last = _prune(fam.pipeline_module(copy.deepcopy(model)), layout, range(1, 4), first=False, last=True)
        torch.testing.assert_close(last(first(ids)), want, rtol=0, atol=0)
    a, b = set(first.state_dict()), set(last.state_dict())
    assert not a & b and a | b == set(model.state_dict())
    assert "model.embed_tokens.weight" in a and {"model.norm.weight", "lm_head.weight"} <= b
    assert {n.split(".")[2] for n in a if n.startswith("model.layers.")} == {"0"}


# ---------------------------------------------------------------- interleaved, pretrained


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A pretrained tiny Llama of 4 layers: 2 ranks x 2 stages each, one layer a stage."""
    from raytrain_platform.tools.tiny_llm import make_all

    return make_all(tmp_path_factory.mktemp("tiny4"), samples=200, hidden_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=2)


@pytest.mark.slow
def test_interleaved_stages_load_their_own_weights_match_one_process_and_export(tmp_path_factory, tiny4, tmp_path):
    from transformers import AutoModelForCausalLM

    from raytrain_platform.inference import load_model_for_inference

    layouts = {"pp2_interleaved": (2, {"parallel": {"pp_size": 2, "pp_schedule": "interleaved_1f1b",
                                                    "pp_microbatches": 4}})}
    runs = LayoutRuns(tmp_path_factory.mktemp("pp_runs"), layouts,
                      lambda root, name, **sections: hf_config(root, name, tiny4["model"], **sections))
    one, pp = runs["one"], runs["pp2_interleaved"]
    # fp32: measured 1.7e-7 relative at most (each stage's matmuls on a chunk of 4 rows)
    assert_losses_close([r["loss"] for r in pp], [r["loss"] for r in one], rtol=1e-5)
    assert one[-1]["loss"] < one[0]["loss"] - 0.3  # the pretrained start still learns
    # Rank 0 holds the embedding and layers 0 and 2, built on the meta device and filled
    # from the safetensors file with those tensors only: about half the model.
    assert pp[-1]["param_bytes"] < 0.6 * one[-1]["param_bytes"], (pp[-1]["param_bytes"], one[-1]["param_bytes"])

    run_dir, out = runs.root / "pp2_interleaved", tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "export", str(run_dir), "--format", "hf",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    ours, _, info = load_model_for_inference(run_dir)
    single, _, _ = load_model_for_inference(runs.root / "one")
    assert info["step"] == 10 and json.loads((out / "export.json").read_text())
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(ours(ids).logits, single(ids).logits, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- a tied LM head, interleaved


@pytest.fixture(scope="module")
def tied4(tmp_path_factory, tiny4):
    """`tiny4` with its LM head tied to the embedding (`conftest.tied_copy`)."""
    return tied_copy(tiny4["model"], tmp_path_factory.mktemp("tied4") / "model")


def _tied_runs(root, model, layouts) -> LayoutRuns:
    return LayoutRuns(root, layouts, lambda r, name, **sections: hf_config(r, name, model, **sections))


@pytest.mark.slow
@pytest.mark.extended  # ~30 s; the tied head on 1F1B stages (tests/test_hf.py) runs by default
def test_a_tied_head_on_interleaved_stages_matches_one_process_and_exports_tied(tmp_path_factory, tied4, tmp_path):
    """Rank 0 holds stages 0 and 2 (the embedding), rank 1 stages 1 and 3 (the head: a
    copy of the embedding, read from the embedding's tensor in the file). Their
    gradients are summed over the two ranks before each step (parallel/pp.py), and the
    gradient norm counts the weight once: losses and norms are one process's. The
    export is a tied model again: one tensor, the logits the platform's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from raytrain_platform.inference import load_model_for_inference

    runs = _tied_runs(tmp_path_factory.mktemp("tied_pp_runs"), tied4, {
        "pp2_interleaved": (2, {"parallel": {"pp_size": 2, "pp_schedule": "interleaved_1f1b",
                                             "pp_microbatches": 4}})})
    one, pp = runs["one"], runs["pp2_interleaved"]
    assert_losses_close([r["loss"] for r in pp], [r["loss"] for r in one], rtol=1e-5)
    assert_losses_close([r["grad_norm"] for r in pp], [r["grad_norm"] for r in one], rtol=1e-4)
    assert one[-1]["loss"] < one[0]["loss"] - 0.3

    run_dir, out = runs.root / "pp2_interleaved", tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "export", str(run_dir), "--format", "hf",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    ours, _, _ = load_model_for_inference(run_dir)
    single, _, _ = load_model_for_inference(runs.root / "one")
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(ours(ids).logits, single(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.extended  # 3 and 4 processes on 2 cores (~1 min)
@pytest.mark.parametrize("name, nproc, sections", [
    # 3 stages: the head's copy two ranks from the embedding, a middle rank holding neither
    # (the pair's own process group); built from config.json with the run's seed
    ("pp3_random", 3, {"parallel": {"pp_size": 3, "pp_split": [2, 1, 1], "pp_microbatches": 4}}),
    # both stages under FSDP: the copies' gradients are shards, summed shard by shard
    ("pp2_fsdp2", 4, {"parallel": {"pp_size": 2, "pp_schedule": "gpipe", "strategy": "fsdp"},
                      "data": {"batch_size": 4}}),
])
def test_a_tied_head_on_more_stages_or_sharded_stages_matches_one_process(tmp_path_factory, tied4, name, nproc,
                                                                          sections):
    random = name.endswith("random")
    init = {"model": {"name": "hf", "kwargs": {"path": str(tied4), "init": "random"}}} if random else {}
    runs = _tied_runs(tmp_path_factory.mktemp("tied_pp_more"), tied4, {
        "reference": (1, {**init}), name: (nproc, {**sections, **init})})
    one, got = runs["reference"], runs[name]
    assert_losses_close([r["loss"] for r in got], [r["loss"] for r in one], rtol=1e-5)
    assert_losses_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in one], rtol=1e-4)
    if random:
        # The 3 stages' step-5 checkpoint into one process: the saved param-group lists are
        # one rank's (DCP keeps one copy), here maybe the middle stage's, which names
        # neither end; the optimizer takes its own lists, so the tied weight's state loads.
        # Its config names the model's files with halved weights: a run that started over
        # from them instead of resuming would train other losses.
        import shutil

        from safetensors.torch import load_file, save_file

        src, dst, halved = runs.root / name, runs.root / f"{name}_resumed_on_1", runs.root / "halved"
        shutil.copytree(src, dst)
        shutil.rmtree(dst / "checkpoint_000010")
        shutil.copytree(tied4, halved)
        save_file({k: v * 0.5 for k, v in load_file(halved / "model.safetensors").items()},
                  halved / "model.safetensors", metadata={"format": "pt"})
        rows = torchrun_metrics(hf_config(runs.root, dst.name, halved), runs.root / f"{dst.name}.yaml", 1,
                                timeout=300)
        resumed = [r for r in rows if r["step"] > 5]
        assert [r["step"] for r in resumed] == list(range(6, 11)), rows
        assert_losses_close([r["loss"] for r in resumed], [r["loss"] for r in got if r["step"] > 5], rtol=1e-5)


def test_a_pipeline_rank_reads_its_part_of_a_whole_checkpoint_and_refuses_another_models(tmp_path):
    """A one-process (or DDP) checkpoint resumed as pipeline stages: each rank takes its
    stages' tensors from the whole model's file; a file with tensors the unsplit model
    lacks (a deeper model of the same widths) is refused, as it is without stages."""
    from torch import nn

    from raytrain_platform.core.checkpoint import WEIGHTS_FILE, read_weights, write_weights
    from raytrain_platform.errors import CheckpointError

    whole = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    part = copy.deepcopy(whole)
    del part[1]  # the first stage: layer 0
    write_weights(tmp_path / WEIGHTS_FILE, whole)
    got = read_weights(tmp_path, part, whole=set(whole.state_dict()))
    assert sorted(got) == ["0.bias", "0.weight"] and torch.equal(got["0.weight"], whole[0].weight)
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    write_weights(deeper / WEIGHTS_FILE, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(CheckpointError, match=r"checkpoint is for another model \(unexpected \['2.bias', "
                                              r"'2.weight'\]\)"):
        read_weights(deeper, part, whole=set(whole.state_dict()))
