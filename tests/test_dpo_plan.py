"""`rtp plan` for preference tuning (issue 49, point 6): the reference model's bytes
per device (a frozen copy sharded like the policy, or none with precomputed log-probs
or LoRA) and a pair's two sequences in one forward (`plan/dpo.py`). Pure: no Ray."""

from __future__ import annotations

import os

import pytest

from raytrain_platform.errors import ConfigError
from raytrain_platform.plan.dpo import REFERENCE_PART, dpo_reference, estimate_dpo_memory, reference_bytes
from raytrain_platform.plan.lora import lora_size
from raytrain_platform.plan.memory import Layout, estimate_memory
from raytrain_platform.plan.shapes import preset_shape

LAYOUTS = [Layout(), Layout(dp=8, shard=8), Layout(dp=4, shard=4, tp=2), Layout(tp=4), Layout(dp=2),
           Layout(pp=2, pp_split=(8, 24))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"dp{lay.dp}-shard{lay.shard}-tp{lay.tp}-pp{lay.pp}")
def test_the_reference_copy_holds_what_the_policy_holds_on_each_device(layout):
    """Sharded like the policy: on every device its weights are the policy's parameter
    bytes there (after TP, PP and FSDP), and it adds no gradients or optimizer state."""
    m = preset_shape("llama2-7b")
    policy = estimate_memory(model=m, layout=layout)
    est = estimate_dpo_memory(model=m, layout=layout, reference="copy")
    held = reference_bytes(model=m, layout=layout, reference="copy", pp_rank=est.pp_rank)
    assert held == policy.params and dict(est.overhead_parts)[REFERENCE_PART] == held
    assert (est.params, est.grads, est.optimizer) == (policy.params, policy.grads, policy.optimizer)


def test_the_reference_of_a_real_model_is_its_parameter_bytes(tmp_path):
    """A frozen copy of the tiny Llama (`copy.deepcopy`, as a trainer makes it) holds
    4 bytes per parameter: the count transformers builds, not the planner's own."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    pytest.importorskip("transformers")
    import copy

    from transformers import AutoModelForCausalLM

    from raytrain_platform.models import get_family
    from raytrain_platform.tools import tiny_llm

    folder = tiny_llm.make_model(tmp_path / "m", vocab_size=300, num_layers=2)
    family = get_family("hf")
    shape = family.shape(family.resolve_kwargs({"path": str(folder), "init": "random"}), seq_len=32)
    reference = copy.deepcopy(AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)).requires_grad_(False)
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert reference_bytes(model=shape, layout=Layout(), reference="copy") == weights
    assert reference_bytes(model=shape, layout=Layout(dp=2, shard=2), reference="copy") == weights // 2


def test_a_pair_is_two_sequences_in_one_forward_and_the_reference_an_overhead_part():
    m = preset_shape("gpt2")
    layout = Layout(dp=2, shard=2, micro_batch=4)
    sft, doubled = estimate_memory(model=m, layout=layout), estimate_memory(model=m, layout=Layout(dp=2, shard=2, micro_batch=8))
    none = estimate_dpo_memory(model=m, layout=layout, reference="none")
    copy = estimate_dpo_memory(model=m, layout=layout, reference="copy")
    assert none.activations == doubled.activations > sft.activations and none == doubled
    assert copy.total - none.total == reference_bytes(model=m, layout=layout, reference="copy") > 0
    assert REFERENCE_PART not in dict(none.overhead_parts)


def test_no_reference_with_precomputed_log_probs_or_lora():
    assert [dpo_reference(precompute_reference=p, lora=lo) for p, lo in
            ((False, False), (True, False), (False, True), (True, True))] == ["copy", "none", "none", "none"]
    m = preset_shape("llama2-7b")
    lora = lora_size(m, r=16, targets=("q_proj", "v_proj"))
    est = estimate_dpo_memory(model=m, layout=Layout(dp=2), reference="none", lora=lora)
    assert est == estimate_memory(model=m, layout=Layout(dp=2, micro_batch=2), lora=lora)
    with pytest.raises(ConfigError, match="none with LoRA"):
        estimate_dpo_memory(model=m, layout=Layout(), reference="copy", lora=lora)
    with pytest.raises(ConfigError) as err:
        reference_bytes(model=m, layout=Layout(), reference="auto")
    assert err.value.field == "reference" and "one of ['copy', 'none']" in str(err.value)


def _plan(capsys, *flags: str) -> dict:
    import json

    from raytrain_platform.cli import main

    assert main(["plan", "--model", "llama2-7b", "--device-mem", "80GiB", "--devices-per-node", "8",
                 "--global-batch", "64", "--precision", "bf16", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_rtp_plan_counts_the_reference_per_layout_and_none_with_lora(capsys):
    """``rtp plan --dpo copy``: every option's overhead holds the reference's weights for
    its layout, and its activations are those of twice the sequences; ``--dpo none`` and
    LoRA hold no reference (the bytes saved are the difference)."""
    m = preset_shape("llama2-7b")
    copy, none, sft = _plan(capsys, "--dpo", "copy"), _plan(capsys, "--dpo", "none"), _plan(capsys)
    assert copy["request"]["dpo_reference"] == "copy" and sft["request"]["dpo_reference"] is None
    for c, n in zip(copy["options"], none["options"]):
        if not c["applicable"]:
            continue
        lay = Layout(**{k: c["layout"][k] for k in ("dp", "tp", "pp", "shard", "micro_batch", "micro_batches")})
        held = estimate_dpo_memory(model=m, layout=lay, reference="copy", precision="bf16")
        assert c["memory"]["overhead_parts"][REFERENCE_PART] == dict(held.overhead_parts)[REFERENCE_PART], c
        assert c["memory"]["total"] == held.total
        assert REFERENCE_PART not in n["memory"]["overhead_parts"]
    # The same model without DPO fits the one device's accumulation at no more memory.
    assert sft["options"][1]["memory"]["total"] < none["options"][1]["memory"]["total"]
    lora = _plan(capsys, "--dpo", "copy", "--lora-r", "16")
    assert all(REFERENCE_PART not in o["memory"]["overhead_parts"] for o in lora["options"] if o["memory"])
    assert "reference model: none (its base, adapters disabled)" in _text(capsys, "--dpo", "copy", "--lora-r", "16")


def _text(capsys, *flags: str) -> str:
    from raytrain_platform.cli import main

    assert main(["plan", "--model", "llama2-7b", "--device-mem", "80GiB", "--devices-per-node", "8",
                 "--global-batch", "64", *flags]) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------- from a job config


@pytest.fixture(scope="module")
def dpo_job(tmp_path_factory) -> dict:
    """A DPO job config of a tiny hf Llama (its preference file is never read: planning
    needs no data)."""
    pytest.importorskip("transformers")
    from raytrain_platform.tools.tiny_llm import make_model

    tmp = tmp_path_factory.mktemp("dpo-job")
    model = make_model(tmp / "model", vocab_size=512, hidden_size=64, num_layers=2)
    return {"model": {"name": "hf", "kwargs": {"path": str(model)}},
            "data": {"source": "jsonl", "format": "preference", "path": str(tmp / "pairs.jsonl"), "seq_len": 128,
                     "batch_size": 4},
            "train": {"max_steps": 4, "grad_accum_steps": 8, "objective": "dpo"},
            "parallel": {"strategy": "ddp"}, "scaling": {"num_workers": 2},
            "run": {"name": "dpo", "storage_path": str(tmp)}}


@pytest.mark.parametrize("sets, reference", [
    ([], "copy"), (["train.dpo.precompute_reference=true"], "none"), (["model.lora={r: 4}"], "none"),
    (["--dpo", "none"], "none")])
def test_rtp_plan_of_a_dpo_config_plans_its_reference(dpo_job, tmp_path, capsys, sets, reference):
    """``rtp plan CONFIG``: a config with ``train.objective: dpo`` is planned as DPO, the
    reference as the run holds it (none with precomputed log-probs or LoRA; --dpo overrides)."""
    import json

    import yaml

    from raytrain_platform.cli import main

    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(dpo_job))
    flags = sets if sets[:1] == ["--dpo"] else [f for s in sets for f in ("--set", s)]
    assert main(["plan", str(path), "--device-mem", "1GiB", "--json", *flags]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["request"]["dpo_reference"] == reference
    held = [REFERENCE_PART in o["memory"]["overhead_parts"] for o in plan["options"] if o["memory"]]
    assert held and all(h == (reference == "copy") for h in held)


def test_rtp_plan_says_what_precomputed_log_probs_save(dpo_job, tmp_path, capsys):
    """The text plan of a precomputing run names the bytes of the reference copy it does
    not hold, which the same run with a copy counts in 'other'."""
    import yaml

    from raytrain_platform.cli import main

    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(dpo_job))
    plans = {}
    for flag in ("false", "true"):
        assert main(["plan", str(path), "--device-mem", "1GiB", "--set",
                     f"train.dpo.precompute_reference={flag}"]) == 0
        plans[flag] = capsys.readouterr().out
    params = int(plans["true"].split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))
    saved = f"{4 * params / 2**10:.1f}K"  # the tiny model's fp32 weights: under a MiB
    assert (f"reference model: none (log-probs precomputed: saves a frozen copy's {saved} of fp32 weights"
            in plans["true"]), plans["true"]
    assert "a frozen copy sharded like the policy (its weights in 'other')" in plans["false"]


def test_an_auto_batch_of_a_dpo_run_fits_its_pairs_and_reference(dpo_job):
    """``data.batch_size: auto`` of a DPO run: the largest micro-batch of pairs whose DPO
    estimate (two sequences a pair, the reference copy) fits, smaller than SFT's."""
    import copy

    from raytrain_platform.config import load_config
    from raytrain_platform.plan.auto import Hardware, _shape, resolve_auto

    budget = 24 * 2**20  # where DPO's pairs and reference halve the micro-batch SFT gets
    hw = Hardware(device_memory=budget, devices_per_node=2)
    dpo = copy.deepcopy(dpo_job)
    dpo["data"]["batch_size"] = "auto"
    del dpo["train"]["grad_accum_steps"]
    dpo["train"]["global_batch_size"] = 64
    sft = copy.deepcopy(dpo)
    sft["data"]["format"], sft["train"]["objective"] = "chat", "sft"
    cfg, _ = resolve_auto(load_config(dpo), hw)
    micro = cfg.data.batch_size
    assert micro < resolve_auto(load_config(sft), hw)[0].data.batch_size

    def total(m: int) -> int:
        return estimate_dpo_memory(model=_shape(cfg), layout=Layout(dp=2, micro_batch=m, micro_batches=1),
                                   reference="copy").total

    assert total(micro) <= budget < total(2 * micro)
