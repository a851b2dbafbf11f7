"""LoRA's default targets on a mixture of experts whose experts transformers 5 fused into
3-D parameters (Qwen3-MoE, Mixtral; tests/hf_archs.py): adapted as peft's own
``get_peft_model(model, LoraConfig(target_modules="all-linear"))`` adapts them, the
attention's Linear layers plus the experts and the router as parameter adapters
(``lora.ParamWrapper``), while the model keeps its class and module paths.

- in one process: the same adapter names, shapes and logits as get_peft_model; a few steps
  change the adapters only; merging gives the adapted logits; `rtp plan`'s count is the
  trainable count; `reset_adapters` starts from the base model;
- (extended) FSDP2 on 2 ranks equals one process under torchrun, its adapter-only
  checkpoint resumes in one process, and the run's ``--format
  peft`` export loads with ``PeftModel.from_pretrained`` with our logits, the merged ``hf``
  export with ``from_pretrained``, and the run serves over the shared base with them.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ROOT, assert_losses_close, hf_config, torchrun_metrics
from hf_archs import MOE, arch_config, make_arch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 512
R, ALPHA = 4, 8


def _model(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(arch_config(arch, vocab_size=VOCAB, bos=None, eos=0, pad=0)).eval()


def _peft_all_linear(model: torch.nn.Module) -> torch.nn.Module:
    """peft's own all-linear on a copy of `model` (the reference)."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(copy.deepcopy(model), LoraConfig(target_modules="all-linear", r=R, lora_alpha=ALPHA))


def _ours(model: torch.nn.Module) -> torch.nn.Module:
    from raytrain_platform.models.lora import apply_lora, resolve_lora

    return apply_lora(copy.deepcopy(model), resolve_lora({"r": R, "alpha": ALPHA}), model_name="hf")


def _x() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", MOE)
def test_default_targets_adapt_attention_experts_and_router_as_get_peft_model_does(arch):
    from peft.tuners.lora import ParamWrapper

    from raytrain_platform.models.lora import resolve_lora, resolve_targets
    from raytrain_platform.plan.lora import model_lora_size

    model = _model(arch)
    lora = resolve_lora({"r": R, "alpha": ALPHA})
    fused = {"qwen3_moe": ["gate", "gate_proj", "up_proj", "down_proj"], "mixtral": ["gate", "w1", "w3", "w2"]}
    assert resolve_targets(model, lora, model_name="hf")["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", *fused[arch]]
    planned = model_lora_size(model, lora, model_name="hf")
    ours, theirs = _ours(model), _peft_all_linear(model)
    assert type(ours) is type(model)  # injected: the model keeps its class and paths
    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    ref = {n.removeprefix("base_model.model."): p for n, p in theirs.named_parameters() if p.requires_grad}
    assert {n: p.shape for n, p in mine.items()} == {n: p.shape for n, p in ref.items()}
    wrapped = {n for n, m in ours.named_modules() if isinstance(m, ParamWrapper)}
    assert wrapped == {f"model.layers.{i}.mlp.{m}" for i in range(2)
                       for m in ("experts", "experts.base_layer", "gate")}, sorted(wrapped)
    assert any(".self_attn.q_proj.lora_A." in n for n in mine)
    count = sum(p.numel() for p in mine.values())
    assert planned.params == count == sum(p.numel() for p in ref.values()) and planned.tensors == len(mine)

    # the same adapters give the same logits: same rank and alpha on each (gate_up_proj: 2r, 2 alpha)
    with torch.no_grad():
        for n, p in ref.items():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
            mine[n].copy_(p)
        x = _x()
        expected = theirs(input_ids=x).logits
        assert (expected - model(input_ids=x).logits).abs().max() > 1e-3  # the adapters act
        torch.testing.assert_close(ours(input_ids=x).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("arch", MOE)
def test_a_few_steps_train_the_adapters_only_and_merge_gives_their_logits(arch):
    from raytrain_platform.core.adapters import reset_adapters
    from raytrain_platform.models.lora import adapter_state, base_source_name, is_adapter, merge_lora

    model = _model(arch)
    ours = _ours(model)
    reset_adapters(ours, seed=3)
    x = _x()
    with torch.no_grad():  # B = 0: the adapted model starts as the base
        torch.testing.assert_close(ours(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)
    trainable = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    frozen = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    # every frozen tensor is the base model's, by base_source_name (what pretrained loading reads)
    assert {base_source_name(n) for n in frozen} == {n for n, _ in model.named_parameters()}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ours.train()
    for _ in range(3):
        ours(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    ours.eval()
    after = dict(ours.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    assert all(after[n].abs().max() > 0 for n in trainable if ".lora_B." in n)  # every B (experts, router) trained
    assert len(adapter_state(ours)) == len(trainable)

    with torch.no_grad():
        expected = ours(input_ids=x).logits
        merged = merge_lora(copy.deepcopy(ours))
        assert not any(hasattr(m, "lora_A") for m in merged.modules())
        assert [n for n, _ in merged.named_parameters()] == [n for n, _ in model.named_parameters()]
        # W + B A alpha/r folded once in fp32 (per expert for the fused tensors): measured <= 2.7e-7
        torch.testing.assert_close(merged(input_ids=x).logits, expected, rtol=0, atol=1e-5)
        assert (expected - model(input_ids=x).logits).abs().max() > 1e-4


def test_half_of_a_fused_pair_is_one_line():
    from raytrain_platform.errors import ConfigError
    from raytrain_platform.models.lora import check_targets, resolve_lora

    model = _model("qwen3_moe")
    listed = resolve_lora({"target_modules": ["q_proj", "gate_proj", "up_proj"]})
    assert check_targets(model, listed, model_name="hf") == [
        f"model.layers.{i}.self_attn.q_proj" for i in range(2)]  # the experts are parameter targets
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules = \['gate_proj'\]: expected targets peft "
                                          r"can convert on this model: Cannot convert .*up_proj"):
        check_targets(model, resolve_lora({"target_modules": ["gate_proj"]}), model_name="hf")


def test_rtp_plan_lora_r_on_an_moe_folder_counts_what_get_peft_model_trains(tmp_path):
    """``rtp plan --model hf:DIR --lora-r`` counts the adapters on the model itself (experts
    and router included), not the Linear layers of its shape; the run's summary names them."""
    import json

    from raytrain_platform.tools.tiny_llm import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    model_dir = make_arch(tmp_path / "moe", "qwen3_moe", tmp_path / "tok")
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "plan", "--model", f"hf:{model_dir}",
                           "--device-mem", "80GiB", "--global-batch", "8", "--lora-r", str(R), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    planned = json.loads(proc.stdout)["request"]["lora"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    ref = {n: p for n, p in _peft_all_linear(model).named_parameters() if p.requires_grad}
    assert (planned["params"], planned["tensors"]) == (sum(p.numel() for p in ref.values()), len(ref))
    assert planned["targets"][-4:] == ["gate", "gate_proj", "up_proj", "down_proj"]
    # the run's summary names them (resolved before Ray, kept in the run's config)
    from raytrain_platform.config import load_config
    from raytrain_platform.resolve import resolve_job

    cfg = hf_config(tmp_path, "names", model_dir)
    cfg["model"]["lora"] = {"r": R}
    assert (" with LoRA r 4 on q_proj, k_proj, v_proj, o_proj, gate, gate_proj, up_proj, down_proj (only the "
            "adapters train) ") in resolve_job(load_config(cfg)).config.summary()


# Three torchrun launches of <= 4 steps, two exports and a served load per architecture: about 90 s on 2 loaded cores.
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", MOE)
def test_moe_lora_fsdp_matches_one_process_and_exports_load_in_peft(tmp_path, arch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain_platform.export import export_checkpoint, load_model_for_inference
    from raytrain_platform.serve.adapters import SharedBases
    from raytrain_platform.tools.tiny_llm import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    model_dir = make_arch(tmp_path / arch, arch, tmp_path / "tok")

    def cfg(name: str, **sections) -> dict:
        c = hf_config(tmp_path, name, model_dir, train={"lr": 1e-2, "max_steps": 4},
                      run={"keep_checkpoints": 2, "checkpoint_every": 2}, **sections)
        c["model"]["lora"] = {"r": R, "alpha": ALPHA}  # default targets
        return c

    one = torchrun_metrics(cfg("one", data={"batch_size": 4}), tmp_path / "one.yaml", 1)
    fsdp = torchrun_metrics(cfg("fsdp", parallel={"strategy": "fsdp"}, data={"batch_size": 2}),
                            tmp_path / "fsdp.yaml", 2)
    # fp32 on gloo: measured <= 7.7e-8 relative (FSDP and the resumed run) for both architectures
    assert_losses_close([r["loss"] for r in fsdp], [r["loss"] for r in one], rtol=1e-5)
    assert one[-1]["trainable_params"] == fsdp[-1]["trainable_params"]
    # the FSDP run's adapter-only checkpoint of step 2 resumes in one process as it went on
    shutil.copytree(tmp_path / "fsdp", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint_000004")
    resumed = torchrun_metrics(cfg("resumed", data={"batch_size": 4}), tmp_path / "resumed.yaml", 1)
    assert (tmp_path / "resumed" / "checkpoint_000004").is_dir()  # steps 3 and 4 ran again
    assert_losses_close([r["loss"] for r in resumed if r["step"] > 2], [r["loss"] for r in fsdp if r["step"] > 2],
                        rtol=1e-5)

    run_dir = tmp_path / "fsdp"
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "export", str(run_dir), "--format", "peft",
                           "--out", str(tmp_path / "peft")], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    export_checkpoint(run_dir, tmp_path / "hf", format="hf")
    ours = load_model_for_inference(run_dir, merge_adapters=False)[0]
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        start = base(x).logits
        expected = ours(x).logits
        assert (expected - start).abs().max() > 1e-3
        # the reference: peft's own model from the export, its trainable count that of the run
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        assert one[-1]["trainable_params"] == sum(p.numel() for n, p in peft_model.named_parameters()
                                                  if ".lora_" in n)
        assert peft_model.peft_config["default"].target_parameters
        torch.testing.assert_close(peft_model(input_ids=x).logits, expected, rtol=0, atol=0)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
        # merging adds B A alpha/r into W once: fp32 rounding (the in-process merge measured <= 2.7e-7)
        torch.testing.assert_close(merged(x).logits, expected, rtol=0, atol=1e-5)
        view = SharedBases().load(arch, str(run_dir))
        torch.testing.assert_close(view(input_ids=x).logits, expected, rtol=0, atol=0)
