"""LoRA's default targets (peft's ``all-linear``, models/lora.py) on every architecture
of the hf matrix (tests/hf_archs.py), and a Conv1D model (GPT-2) through the platform.

- in one process, for each architecture: the adapters go on every nn.Linear / Conv1D of
  the decoder layers (read from the model itself) and on no other module (a mixture of
  experts' fused experts and router get parameter adapters too: test_lora_moe.py); a few optimizer
  steps change the adapters only; merging gives the adapted model's logits;
- `rtp plan`'s LoRA count (plan/lora.py `model_lora_size`) equals the parameters peft
  made;
- GPT-2 (Conv1D attention and MLP) with the default targets: FSDP on 2 ranks (torchrun)
  equals one process, the run names its modules, and both exports load in transformers
  and peft with our logits, and it serves over the shared base with them.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ROOT, assert_losses_close, hf_config, mlp_config, torchrun_metrics
from hf_archs import ARCHS, arch_config, make_arch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 300


def _model(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = arch_config(arch, vocab_size=VOCAB, bos=1, eos=2, pad=0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _linears_in_blocks(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """(every nn.Linear / Conv1D inside the decoder layers, every one outside them)."""
    from transformers.pytorch_utils import Conv1D

    from raytrain_platform.models.family import find_blocks

    blocks = [name for name, _ in find_blocks(model)]
    assert len(blocks) == 2, blocks  # hf_archs' 2 layers
    linears = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    inside = {n for n in linears if any(n.startswith(b + ".") for b in blocks)}
    return inside, linears - inside


@pytest.mark.parametrize("arch", ARCHS)
def test_default_targets_adapt_every_linear_of_the_layers_train_only_them_and_merge(arch):
    from peft.tuners.lora import ParamWrapper

    from raytrain_platform.models.lora import apply_lora, is_adapter, merge_lora, resolve_lora
    from raytrain_platform.plan.lora import model_lora_size

    model = _model(arch)
    inside, outside = _linears_in_blocks(model)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    assert inside and head in outside, (inside, outside)
    lora = resolve_lora({"r": 4, "alpha": 8})
    planned = model_lora_size(model, lora, model_name="hf")
    model = apply_lora(model, lora, model_name="hf")
    # a mixture of experts' experts and router are parameter adapters besides (test_lora_moe.py)
    adapted = {n for n, m in model.named_modules() if hasattr(m, "lora_A") and not isinstance(m, ParamWrapper)}
    assert adapted == inside, sorted(adapted ^ inside)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert planned.params == sum(p.numel() for p in trainable.values()) and planned.tensors == len(trainable)
    assert not any(".embed" in n or "wte" in n for n in trainable)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    x = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    for _ in range(3):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    after = dict(model.named_parameters())
    for n, p in frozen.items():
        assert torch.equal(after[n], p), n
    assert all(not torch.equal(after[n], p) for n, p in adapters.items() if ".lora_B." in n)

    with torch.no_grad():
        expected = model(input_ids=x).logits
        merged = merge_lora(copy.deepcopy(model))
        assert not any(hasattr(m, "lora_A") for m in merged.modules())
        # W + B A alpha/r folded once: fp32 rounding, measured <= 5e-7 over the matrix (B ~ N(0, 0.05))
        torch.testing.assert_close(merged(input_ids=x).logits, expected, rtol=0, atol=1e-5)
        assert (expected - _model(arch)(input_ids=x).logits).abs().max() > 1e-4  # the adapters did change it


def test_summary_names_the_chosen_modules_and_a_target_may_be_a_conv1d(tmp_path):
    """resolve_job turns all-linear into the names peft picks; an explicit Conv1D target works;
    a target matching no linear layer is one line."""
    from raytrain_platform.config import load_config
    from raytrain_platform.errors import ConfigError
    from raytrain_platform.resolve import resolve_job

    model_dir = _saved_gpt2(tmp_path)
    cfg = hf_config(tmp_path, "names", model_dir)
    cfg["model"]["lora"] = {}
    job = resolve_job(load_config(cfg))
    assert job.config.model.lora["target_modules"] == ["c_attn", "c_proj", "c_fc"]
    assert " with LoRA r 8 on c_attn, c_proj, c_fc (only the adapters train) " in job.config.summary()
    cfg["model"]["lora"] = {"target_modules": ["c_fc"]}
    assert resolve_job(load_config(cfg)).config.model.lora["target_modules"] == ["c_fc"]
    cfg["model"]["lora"] = {"target_modules": ["q_proj"]}
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules = 'q_proj': expected names of Linear "
                                          r"modules of model 'hf': it has \['c_attn', 'c_fc', 'c_proj', "
                                          r"'lm_head'\]$"):
        resolve_job(load_config(cfg))
    cfg["model"]["lora"] = {"target_modules": ["wte"]}
    with pytest.raises(ConfigError, match=r"transformer.wte is of class Embedding, not nn.Linear or Conv1D"):
        resolve_job(load_config(cfg))
    # not a transformers model: the family's output head (the builtin gpt's lm_head) is left out
    gpt = mlp_config(tmp_path, "gpt", model={"name": "gpt", "kwargs": {"n_layer": 1, "n_embd": 16, "n_head": 2,
                                                                       "block_size": 16}, "lora": {}})
    assert resolve_job(load_config(gpt)).config.model.lora["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def _saved_gpt2(tmp_path) -> "os.PathLike":
    from raytrain_platform.tools.tiny_llm import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    # without dropout (GPT-2's default is 0.1): each rank draws its own masks
    return make_arch(tmp_path / "gpt2", "gpt2", tmp_path / "tok", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# Two torchrun launches of 4 steps and two exports: about 60 s on 2 loaded cores.
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_gpt2_conv1d_lora_fsdp_matches_one_process_and_exports(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain_platform.export import export_checkpoint, load_model_for_inference
    from raytrain_platform.serve.adapters import SharedBases

    model_dir = _saved_gpt2(tmp_path)

    def cfg(name: str, **sections) -> dict:
        c = hf_config(tmp_path, name, model_dir, train={"lr": 1e-2, "max_steps": 4},
                      run={"keep_checkpoints": 2, "checkpoint_every": 4}, **sections)
        c["model"]["lora"] = {"r": 4, "alpha": 8}  # default targets
        return c

    one = torchrun_metrics(cfg("one", data={"batch_size": 4}), tmp_path / "one.yaml", 1)
    fsdp = torchrun_metrics(cfg("fsdp", parallel={"strategy": "fsdp"}, data={"batch_size": 2}),
                            tmp_path / "fsdp.yaml", 2)
    # fp32 on gloo; the Llama layouts of test_lora.py measured <= 1.6e-7 relative
    assert_losses_close([r["loss"] for r in fsdp], [r["loss"] for r in one], rtol=1e-5)
    # r 4 on c_attn (64 -> 192), attn c_proj (64 -> 64), c_fc (64 -> 128), mlp c_proj (128 -> 64); 2 layers
    assert one[-1]["trainable_params"] == 2 * 4 * (256 + 128 + 192 + 192) == fsdp[-1]["trainable_params"]

    run_dir = tmp_path / "fsdp"
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "export", str(run_dir), "--format", "peft",
                           "--out", str(tmp_path / "peft")], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    export_checkpoint(run_dir, tmp_path / "hf", format="hf")
    ours = load_model_for_inference(run_dir, merge_adapters=False)[0]
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        start = base(x).logits
        expected = ours(x).logits
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        assert peft_model.peft_config["default"].fan_in_fan_out  # Conv1D stores its weight (in, out)
        torch.testing.assert_close(peft_model(input_ids=x).logits, expected, rtol=0, atol=0)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
        # merging adds B A alpha/r into W once: fp32 rounding (Llama measured <= 3e-7)
        torch.testing.assert_close(merged(x).logits, expected, rtol=0, atol=1e-5)
        assert (expected - start).abs().max() > 1e-3
    # served over the shared base (serve/adapters.py): the same logits, the Conv1D layout given to peft
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fan_in_fan_out.*")
        view = SharedBases().load("gpt2", str(run_dir))
    with torch.no_grad():
        torch.testing.assert_close(view(input_ids=x).logits, expected, rtol=0, atol=0)
