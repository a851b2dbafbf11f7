"""The architecture matrix through the platform's training core (tests/hf_archs.py: 13
tiny causal LMs from transformers' config classes, pretrained weights read by the real
loader), Ray-free under torchrun, 5 steps each:

- one process against FSDP2 on 2 ranks (each rank reading only its shards);
- a LoRA run with the default targets (peft's all-linear) on one process against DDP on
  2 ranks, training as many parameters as peft's own ``get_peft_model`` makes adapters.

The default suite runs FSDP2 for three architectures (GPT-2: Conv1D layers and learned
positions; Gemma 3: a non-persistent embedding scale, sliding windows; Qwen3-MoE: fused
experts); the rest of the matrix is `extended`. The other points of the matrix live
beside their code: loading and export (test_hf_archs.py), serving (test_hf_archs_serve.py),
packing (test_packing.py), TP and PP (test_hf_tp_archs.py, test_hf_pipeline.py),
LoRA targets (test_lora_archs.py), mixtures of experts (test_hf_moe.py).
"""

from __future__ import annotations

import os

import pytest
from conftest import LayoutRuns, assert_losses_close, hf_config
from hf_archs import ARCHS, make_arch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# fp32 on gloo, as tests/test_hf.py's layouts (measured there: <= 9e-8 relative over 10 steps);
# a lost gradient or a wrong shard moves the losses by > 1e-3.
RTOL = 1e-5
STEPS = 5
DEFAULT_FSDP = ("gpt2", "gemma3_text", "qwen3_moe")
LORA = {"r": 4, "alpha": 8}

LAYOUTS = {
    "fsdp2": (2, {"parallel": {"strategy": "fsdp"}, "data": {"batch_size": 4}}),
    "lora_one": (1, {"model": {"lora": LORA}}),
    "lora_ddp2": (2, {"model": {"lora": LORA}, "parallel": {"strategy": "ddp"}, "data": {"batch_size": 4}}),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from raytrain_platform.tools.tiny_llm import make_tokenizer

    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tokenizer_dir):
    """Each architecture's layouts, trained when a test first asks for one."""
    made: dict[str, LayoutRuns] = {}

    def runs(arch: str) -> LayoutRuns:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"matrix_{arch}")
            model_dir = make_arch(root / "model", arch, tokenizer_dir)

            def config(root, name, **sections):
                cfg = hf_config(root, name, model_dir, **{k: v for k, v in sections.items() if k != "model"},
                                train={"max_steps": STEPS, "lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0,
                                       "seed": 0}, run={"checkpoint_every": 0, "eval_every": 0})
                cfg["model"] = {**cfg["model"], **sections.get("model", {})}
                return cfg
            made[arch] = LayoutRuns(root, LAYOUTS, config)
        return made[arch]
    return runs


def _losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in DEFAULT_FSDP else [pytest.mark.extended])
                                  for a in ARCHS])
def test_fsdp2_on_two_ranks_trains_every_architecture_as_one_process(matrix, arch):
    runs = matrix(arch)
    one = _losses(runs["one"])
    assert len(one) == STEPS and one[-1] < one[0], one  # it learns the synthetic tokens
    assert_losses_close(_losses(runs["fsdp2"]), one, rtol=RTOL)


@pytest.mark.extended
@pytest.mark.parametrize("arch", ARCHS)
def test_lora_with_the_default_targets_trains_every_architecture_alike_under_ddp(matrix, arch):
    runs = matrix(arch)
    one, ddp = runs["lora_one"], runs["lora_ddp2"]
    # the adapters only, and those of peft's own get_peft_model with all-linear (MoE experts included)
    assert one[0]["trainable_params"] == _peft_all_linear_params(runs.root / "model"), one[0]
    assert_losses_close(_losses(ddp), _losses(one), rtol=RTOL)


def _peft_all_linear_params(model_dir) -> int:
    """Trainable parameters of ``get_peft_model(model, LoraConfig(target_modules="all-linear"))``
    at `LORA`'s rank and alpha, on the model of `model_dir` built on the meta device."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: peft sets fan_in_fan_out and says so
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
        peft_model = get_peft_model(model, LoraConfig(target_modules="all-linear", r=LORA["r"],
                                                      lora_alpha=LORA["alpha"]))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
