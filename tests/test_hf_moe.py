"""Mixtures of experts through the `hf` family (tests/hf_archs.py: Qwen3-MoE and
Mixtral, 4 experts choosing 2): one process against DDP and FSDP2 on 2 ranks (the
experts' fused ``(experts, ...)`` tensors sharded with their decoder layer), and the
router's load-balancing loss counted when the config asks for it (``output_router_logits``,
``router_aux_loss_coef``) and logged as ``aux_loss``. Ray-free (torchrun)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import LayoutRuns, assert_losses_close, hf_config
from hf_archs import MOE, make_arch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# fp32 on gloo, as tests/test_hf.py's layouts: a lost gradient or a wrong shard is > 1e-3.
RTOL = 1e-5
AUX_COEF = 0.05
STEPS = 5


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from raytrain_platform.tools.tiny_llm import make_tokenizer

    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return out


def _config(model_dir, root, name, **sections):
    own = {"train": {"max_steps": STEPS, "lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0, "seed": 0},
           "run": {"checkpoint_every": 0, "eval_every": 0}}
    for section, values in sections.items():
        own[section] = {**own.get(section, {}), **values}
    return hf_config(root, name, model_dir, **own)


def _random(cfg: dict) -> dict:
    """The same job from the architecture's own initialisation (seeded) instead of the files."""
    return {**cfg, "model": {**cfg["model"], "kwargs": {**cfg["model"]["kwargs"], "init": "random"}}}


LAYOUTS = {
    # one process taking the step's batch in the two micro-batches the two ranks take
    "one_accum2": (1, {"train": {"grad_accum_steps": 2}, "data": {"batch_size": 4}}),
    "ddp2": (2, {"parallel": {"strategy": "ddp"}, "data": {"batch_size": 4}}),
    "fsdp2": (2, {"parallel": {"strategy": "fsdp"}, "data": {"batch_size": 4}}),
}


def _runs(tmp_path_factory, tokenizer_dir, arch: str, **overrides) -> LayoutRuns:
    root = tmp_path_factory.mktemp(f"moe_{arch}")
    model = make_arch(root / "model", arch, tokenizer_dir, **overrides)

    def config(root, name, **sections):
        return _random(_config(model, root, name, **sections))
    return LayoutRuns(root, LAYOUTS, config)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, tokenizer_dir):
    """Each architecture's layouts, made when a test first asks for them."""
    made: dict[str, LayoutRuns] = {}

    def runs(arch: str) -> LayoutRuns:
        if arch not in made:
            made[arch] = _runs(tmp_path_factory, tokenizer_dir, arch, output_router_logits=True,
                               router_aux_loss_coef=AUX_COEF)
        return made[arch]
    return runs


# Extended: the default suite trains Qwen3-MoE under FSDP2 from its checkpoint in
# tests/test_hf_matrix.py, and the router loss's weight against transformers below.
@pytest.mark.extended
@pytest.mark.parametrize("arch, layout", [(arch, layout) for arch in MOE for layout in ("ddp2", "fsdp2")])
def test_a_mixture_of_experts_trains_alike_on_every_layout_with_its_router_loss(moe_runs, arch, layout):
    runs = moe_runs(arch)
    one = runs["one_accum2"]
    assert len(one) == STEPS and all(r["aux_loss"] > 0 for r in one), one
    assert_losses_close([r["loss"] for r in runs[layout]], [r["loss"] for r in one], rtol=RTOL)
    assert_losses_close([r["aux_loss"] for r in runs[layout]], [r["aux_loss"] for r in one], rtol=RTOL)


def test_the_router_loss_weighs_in_as_transformers_own_loss_counts_it(tmp_path, tokenizer_dir):
    """One micro-step of the engine gives the gradients of transformers' own loss on the
    same batch (mean cross-entropy + router_aux_loss_coef x aux_loss, with labels), and
    logs transformers' aux_loss; with the coefficient at 0 the gradients differ."""
    import yaml
    from transformers import AutoModelForCausalLM

    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.resolve import resolve_job

    model_dir = make_arch(tmp_path / "m", "qwen3_moe", tokenizer_dir, output_router_logits=True,
                          router_aux_loss_coef=AUX_COEF)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_random(_config(model_dir, tmp_path, "c"))))
    engine = Engine(resolve_job(load_config(path)), init_torchrun(use_gpu=False))
    tokens = torch.randint(0, 500, (4, 17), generator=torch.Generator().manual_seed(1))
    engine.micro_step({"tokens": tokens, "sample_id": torch.arange(4)}, sync=True)
    ours = {n: p.grad.clone() for n, p in engine.wrapped.module.named_parameters()}

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    ref.load_state_dict(engine.wrapped.module.state_dict())
    # the targets of every position, as the engine takes them (transformers would shift labels itself)
    targets = tokens[:, 1:].contiguous()
    out = ref(tokens[:, :-1], labels=targets, shift_labels=targets)
    out.loss.backward()
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert float(engine._aux_sum) == pytest.approx(float(out.aux_loss), rel=1e-5)

    ref.zero_grad()
    ref.config.router_aux_loss_coef = 0.0  # the same forward, the router loss not counted
    ref.router_aux_loss_coef = 0.0
    ref(tokens[:, :-1], labels=targets, shift_labels=targets).loss.backward()
    router = [n for n in ours if n.endswith("mlp.gate.weight")]
    assert router and any(not torch.allclose(ours[n], theirs[n].grad, rtol=1e-4, atol=1e-6) for n in router)


def test_pipeline_stages_refuse_a_router_loss_and_flash_attention_packs_no_documents(tmp_path, tokenizer_dir):
    """A pipeline stage passes hidden states or logits on, not the router's loss: with
    output_router_logits, pp_size > 1 is one line. Flash attention builds no block-causal
    mask from position ids: documents packing is not offered with it."""
    from raytrain_platform.errors import ConfigError
    from raytrain_platform.models import get_family

    fam = get_family("hf")
    with_loss = fam.resolve_kwargs({"path": str(make_arch(tmp_path / "m", "qwen3_moe", tokenizer_dir,
                                                           output_router_logits=True))})
    with pytest.raises(ConfigError, match=r"^parallel.pp_size = 2: expected 1 for model_type 'qwen3_moe' with "
                                          r"output_router_logits \(the router's load-balancing loss"):
        fam.check_model_parallel(with_loss, tp=1, pp=2, stages=2, pp_split=None)
    without = fam.resolve_kwargs({"path": str(make_arch(tmp_path / "n", "qwen3_moe", tokenizer_dir))})
    fam.check_model_parallel(without, tp=1, pp=2, stages=2, pp_split=None)  # no router loss: stages run
    assert fam.takes_position_ids(without)
    assert not fam.takes_position_ids({**without, "attn_implementation": "flash_attention_2"})
