"""Preference tuning (``train.objective: dpo``), the training side: the loss equals TRL's,
one process equals every layout, the LoRA reference is the base model, precomputed
reference log-probs give the live reference's loss, bad config is one line.

The batches are built here from tokenized text (tests/dpo_pairs.py: a standard-library
docstring as the chosen answer, its words shuffled as the rejected), not through data/.

    PYTHONPATH=$PWD python -m pytest -q tests/test_dpo.py            # default slice
    PYTHONPATH=$PWD python -m pytest -q -m extended tests/test_dpo.py  # the other layouts
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, torchrun_launch
from dpo_pairs import pair_tensors, run_engine, take, text_pairs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LENGTH = 64  # tokens per row (data.seq_len + 1)
# TRL: our loss and rewards minus TRL's own, fp32 on CPU: measured at most 1.9e-6 (the
# same sums in another order, TRL's attention mask over the padding). Log-probs near -200
# are summed in fp32, whose spacing there is 1.5e-5: within 2e-7 relative (two fp32 steps;
# measured 7.5e-8 through the engine, 0 for the loss functions alone).
TRL_ATOL, LOGPS_RTOL = 1e-5, 2e-7


def _near(ours: float, theirs: float, name: str) -> bool:
    return ours == pytest.approx(theirs, abs=TRL_ATOL, rel=LOGPS_RTOL if name.startswith("logps/") else 0)
# Layout losses over 5 steps (see COMPARED): a wrong scale or a missed pair moves them by > 1e-3.
LAYOUT_RTOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A pretrained tiny Llama (2 layers of 64, GQA 4/2) and its tokenizer, and a second
    copy of it moved by noise: the policy, so that policy and reference differ."""
    from transformers import AutoModelForCausalLM

    from raytrain_platform.tools.tiny_llm import make_all

    paths = make_all(tmp_path_factory.mktemp("tiny"), samples=20, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(paths["model"], local_files_only=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    policy = paths["model"].parent.parent / "policy"
    model.save_pretrained(policy)
    for f in paths["model"].iterdir():  # the tokenizer's files
        if not (policy / f.name).exists():
            (policy / f.name).write_bytes(f.read_bytes())
    return {**paths, "policy": policy}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["model"], local_files_only=True)


@pytest.fixture(scope="module")
def pairs(tokenizer) -> dict[str, torch.Tensor]:
    return pair_tensors(tokenizer, text_pairs(40), LENGTH)


def dpo_config(tmp: Path, model_dir: Path, name: str, **sections) -> dict:
    """A DPO job on the hf model in `model_dir`: 5 steps of 8 pairs (one process: micro-batch 4 x accumulation 2);
    `sections` update it key by key. The data section names a preference file that is
    never read: the tests feed their own pairs (dpo_pairs.FixedPairs)."""
    cfg: dict = {
        "model": {"name": "hf", "kwargs": {"path": str(model_dir)}},
        "data": {"source": "jsonl", "format": "preference", "path": str(tmp / "pairs.jsonl"), "batch_size": 4,
                 "seq_len": LENGTH - 1},
        "train": {"max_steps": 5, "grad_accum_steps": 2, "lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0,
                  "objective": "dpo"},
        "parallel": {"strategy": "none"},
        "scaling": {"num_workers": 1, "torch_threads": 1},
        "run": {"name": name, "storage_path": str(tmp), "eval_every": 0, "checkpoint_every": 0},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def _load(cfg: dict):
    from raytrain_platform.config import load_config

    return load_config(copy.deepcopy(cfg))


# ------------------------------------------------------------------ TRL's own functions


def _trl_trainer(tmp: Path, policy, reference, tokenizer, text, **args):
    """TRL's DPOTrainer on `policy` and `reference` (its data pipeline only sees `text`;
    the batches below are handed to its loss function directly)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_dict({"prompt": [p for p, _, _ in text], "chosen": [c for _, c, _ in text],
                              "rejected": [r for _, _, r in text]})
    config = DPOConfig(output_dir=str(tmp / "trl"), report_to="none", use_cpu=True, bf16=False, seed=0,
                       per_device_train_batch_size=4, **args)
    return DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=data, processing_class=tokenizer)


def _trl_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our pairs as TRL's collator gives them: [chosen; rejected] ids, attention on the
    real tokens, ``completion_mask`` on the response (the same convention as our masks)."""
    ids = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]])
    completion = torch.cat([batch["chosen_mask"], batch["rejected_mask"]]).long()
    last = (completion * torch.arange(ids.shape[1])).argmax(1)  # each row's EOS: its last real token
    attention = (torch.arange(ids.shape[1])[None] <= last[:, None]).long()
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _ours(policy, reference, batch, **loss):
    from raytrain_platform.models.preference import dpo_loss, pair_inputs, sequence_logps

    inputs, targets = pair_inputs(batch)
    with torch.no_grad():
        logps, counts = sequence_logps(policy(inputs).logits, targets)
        ref, _ = sequence_logps(reference(inputs).logits, targets)
    chosen, rejected = logps.chunk(2)
    pair = dpo_loss(chosen, rejected, *ref.chunk(2), chosen_counts=counts.chunk(2)[0],
                    rejected_counts=counts.chunk(2)[1], **loss)
    return pair, chosen, rejected


def _hf(path: Path):
    """transformers' own model from the folder, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def _trl_metrics(trainer) -> dict[str, float]:
    """What TRL logged at its last loss call (under "eval": the models are in eval mode)."""
    return {k: v[-1] for k, v in trainer._metrics["eval"].items()}


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_loss_rewards_and_logps_equal_trls_dpo_trainer(tmp_path, tiny, tokenizer, pairs, loss):
    """Our loss functions (models/preference.py) on transformers' logits against TRL's own
    loss function, DPOTrainer._compute_loss, each on its own copy of the same two models."""
    batch = take(pairs, slice(0, 4))
    pair, chosen, rejected = _ours(_hf(tiny["policy"]), _hf(tiny["model"]), batch, beta=0.1, loss=loss)
    trainer = _trl_trainer(tmp_path, _hf(tiny["policy"]), _hf(tiny["model"]), tokenizer, text_pairs(4),
                           beta=0.1, loss_type=[loss])
    with torch.no_grad():
        trl_loss = trainer._compute_loss(trainer.model, _trl_inputs(batch), return_outputs=False)
    theirs = _trl_metrics(trainer)
    ours = {"loss": float(pair.losses.mean()), "rewards/chosen": float(pair.chosen_rewards.mean()),
            "rewards/rejected": float(pair.rejected_rewards.mean()),
            "rewards/margins": float((pair.chosen_rewards - pair.rejected_rewards).mean()),
            "rewards/accuracies": float((pair.chosen_rewards > pair.rejected_rewards).float().mean()),
            "logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean())}
    theirs["loss"] = float(trl_loss)
    assert abs(ours["rewards/margins"]) > 1e-2  # policy and reference differ
    for name, value in ours.items():
        print(f"TRL {loss} {name}: ours {value!r} theirs {theirs[name]!r} diff {abs(value - theirs[name]):.2e}")
        assert _near(value, theirs[name], name), (name, value, theirs[name])


def test_label_smoothing_equals_trls_conservative_form(tmp_path, tiny, tokenizer, pairs):
    """TRL 1.16's ``sigmoid`` has no label smoothing; its ``aot`` loss keeps the conservative
    form (-(1 - e) log s(b d) - e log s(-b d)), on sorted log-ratios: one pair at a time,
    sorting is nothing, and it is conservative DPO."""
    trainer = _trl_trainer(tmp_path, _hf(tiny["policy"]), _hf(tiny["model"]), tokenizer, text_pairs(4),
                           beta=0.1, loss_type=["aot"], label_smoothing=0.2)
    batch = take(pairs, slice(0, 4))
    policy, reference = _hf(tiny["policy"]), _hf(tiny["model"])
    pair, _, _ = _ours(policy, reference, batch, beta=0.1, loss="sigmoid", label_smoothing=0.2)
    plain, _, _ = _ours(policy, reference, batch, beta=0.1, loss="sigmoid")
    for i in range(4):
        with torch.no_grad():
            theirs = trainer._compute_loss(trainer.model, _trl_inputs(take(batch, slice(i, i + 1))), False)
        print(f"TRL aot pair {i}: diff {abs(float(pair.losses[i]) - float(theirs)):.2e}")
        assert float(pair.losses[i]) == pytest.approx(float(theirs), abs=TRL_ATOL)
    assert (pair.losses - plain.losses).abs().max() > 1e-3  # the smoothing changed the losses


def test_the_engines_first_step_equals_trl_with_a_reference_folder(tmp_path, tiny, tokenizer, pairs):
    """Through the engine (train.dpo.reference: the base folder, the output head on the
    counted tokens only): the first step's metrics, taken before its update, are TRL's on
    the same 8 pairs."""
    cfg = dpo_config(tmp_path, tiny["policy"], "engine-trl", train={"max_steps": 1, "dpo": {
        "reference": str(tiny["model"])}})
    rows = run_engine(_load(cfg), take(pairs, slice(0, 8)))
    trainer = _trl_trainer(tmp_path, _hf(tiny["policy"]), _hf(tiny["model"]), tokenizer, text_pairs(4))
    with torch.no_grad():
        trl_loss = trainer._compute_loss(trainer.model, _trl_inputs(take(pairs, slice(0, 8))), False)
    theirs = {**_trl_metrics(trainer), "loss": float(trl_loss)}
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        print(f"TRL engine {name}: ours {rows[0][name]!r} theirs {theirs[name]!r} "
              f"diff {abs(rows[0][name] - theirs[name]):.2e}")
        assert _near(rows[0][name], theirs[name], name), (name, rows[0][name], theirs[name])


# ------------------------------------------------------------------ layouts


def _torchrun_rows(tmp: Path, cfg: dict, pairs: dict, nproc: int, checkpoints: Path | None = None) -> list[dict]:
    name = cfg["run"]["name"]
    config, data, out = tmp / f"{name}.yaml", tmp / f"{name}.pt", tmp / f"{name}.json"
    config.write_text(yaml.safe_dump(cfg))
    torch.save({"train": pairs, "val": pairs}, data)
    cmd = [*torchrun_launch(nproc), str(ROOT / "tests" / "dpo_pairs.py"), str(config), str(data), str(out),
           *([str(checkpoints)] if checkpoints else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


# name -> (processes, config sections): 8 pairs per optimizer step in each, with accumulation
LAYOUTS = {
    "fsdp2": (2, {"parallel": {"strategy": "fsdp"}, "data": {"batch_size": 2}}),
    "ddp2": (2, {"parallel": {"strategy": "ddp"}, "data": {"batch_size": 2}}),
    "tp2": (2, {"parallel": {"tp_size": 2, "strategy": "none"}}),
    "tp2_fsdp2": (4, {"parallel": {"tp_size": 2, "strategy": "fsdp"}, "data": {"batch_size": 2}}),
}
# name -> (rtol, atol). Measured over 5 steps, every layout: losses within 1.2e-6 relative
# (TP splits the matmuls' sums, DDP and FSDP reduce gradients in another order); rewards
# within 1.6e-6 absolute: beta x a difference of two fp32 log-prob sums near -200, whose
# fp32 spacing is 1.5e-5 (so 3e-6 is two steps); log-probs within 1.5e-7 relative.
COMPARED = {"loss": (LAYOUT_RTOL, 0.0), "val_loss": (LAYOUT_RTOL, 0.0), "rewards/chosen": (0.0, 5e-6),
            "rewards/rejected": (0.0, 5e-6), "rewards/margins": (0.0, 5e-6), "val_rewards/margins": (0.0, 5e-6),
            "logps/chosen": (1e-6, 0.0), "logps/rejected": (1e-6, 0.0)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny, pairs) -> list[dict]:
    """The reference run: one process, in this one (no torchrun)."""
    tmp = tmp_path_factory.mktemp("one")
    return run_engine(_load(dpo_config(tmp, tiny["model"], "one", run={"eval_every": 5, "eval_batches": 2})),
                      pairs, pairs)


LORA = {"model": {"lora": {"r": 4}}, "train": {"lr": 1e-2}}


@pytest.fixture(scope="module")
def one_process_lora(tmp_path_factory, tiny, pairs) -> list[dict]:
    tmp = tmp_path_factory.mktemp("one-lora")
    return run_engine(_load(dpo_config(tmp, tiny["model"], "one-lora", run={"eval_every": 5, "eval_batches": 2},
                                       **LORA)), pairs, pairs)


def _layout(tmp_path, tiny, pairs, one_process, layout: str, extra: dict | None = None) -> None:
    nproc, sections = LAYOUTS[layout]
    cfg = dpo_config(tmp_path, tiny["model"], layout, run={"eval_every": 5, "eval_batches": 2})
    for section, values in [*sections.items(), *(extra or {}).items()]:
        cfg[section] = {**cfg[section], **values}
    cfg["scaling"]["num_workers"] = nproc
    rows = _torchrun_rows(tmp_path, cfg, pairs, nproc)
    assert len(rows) == len(one_process) == 5
    if extra is None:  # a frozen copy, sharded as the policy is (LoRA: none, the policy itself)
        assert rows[0]["ref_param_bytes"] == rows[0]["param_bytes"]
        whole = one_process[0]["ref_param_bytes"]
        assert rows[0]["ref_param_bytes"] == whole if layout == "ddp2" else rows[0]["ref_param_bytes"] < whole
    else:
        assert "ref_param_bytes" not in rows[0]
    assert one_process[-1]["loss"] < one_process[0]["loss"]  # it trained
    for name, (rtol, atol) in COMPARED.items():
        ours = [r[name] for r in rows if name in r]
        ref = [r[name] for r in one_process if name in r]
        assert len(ours) == len(ref) > 0, name
        worst = max(abs(a - b) for a, b in zip(ours, ref))
        relative = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ref))
        print(f"layout {layout} {name}: max difference {worst:.1e} ({relative:.1e} relative) over {len(ref)} values")
        torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                                   rtol=rtol, atol=atol, msg=lambda m, n=name: f"{layout} {n}: {m}")


def test_fsdp_with_accumulation_equals_one_process(tmp_path, tiny, pairs, one_process):
    _layout(tmp_path, tiny, pairs, one_process, "fsdp2")


@pytest.mark.extended
@pytest.mark.parametrize("layout", ["ddp2", "tp2", "tp2_fsdp2"])
def test_layout_with_accumulation_equals_one_process(tmp_path, tiny, pairs, one_process, layout):
    _layout(tmp_path, tiny, pairs, one_process, layout)


@pytest.mark.extended
@pytest.mark.parametrize("layout", ["ddp2", "fsdp2"])
def test_lora_layout_with_accumulation_equals_one_process(tmp_path, tiny, pairs, one_process_lora, layout):
    """LoRA (the reference: the policy with its adapters off) on the layouts it composes with."""
    _layout(tmp_path, tiny, pairs, one_process_lora, layout, LORA)


# ------------------------------------------------------------------ reference models


def _engine(cfg: dict):
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.sources import DataInfo
    from raytrain_platform.resolve import ResolvedJob

    job = ResolvedJob(config=_load(cfg), data=DataInfo(num_train=40, num_val=0), steps_per_epoch=5, total_steps=5)
    return Engine(job, init_torchrun(use_gpu=False))


def test_lora_reference_is_the_base_with_adapters_off(tmp_path, tiny, pairs):
    """model.lora with reference auto: no second model; the reference log-probs are those
    of the base model loaded on its own by transformers, while the adapters move the
    policy's; the adapters' gradient flags are as before."""
    from raytrain_platform.models.preference import pair_inputs, sequence_logps

    engine = _engine(dpo_config(tmp_path, tiny["model"], "lora", model={"lora": {"r": 4}}))
    assert engine.preference.reference.copy is None and engine.preference.memory() == {}
    torch.manual_seed(0)
    with torch.no_grad():  # adapters that change the outputs (lora_B starts at 0)
        for name, p in engine.wrapped.base.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    trainable = [n for n, p in engine.wrapped.base.named_parameters() if p.requires_grad]
    batch = engine._to_device(take(pairs, slice(0, 4)))
    inputs, targets = pair_inputs(batch)
    chosen, rejected = engine.preference.reference_logps(batch, inputs, targets, engine._rows(batch))
    base = _hf(tiny["model"])
    with torch.no_grad():
        expected, _ = sequence_logps(base(inputs).logits, targets)
        adapted, _ = sequence_logps(engine.wrapped.module(inputs).logits, targets)
    # measured 2.3e-7 relative at most (log-probs near -200): the counted head's sums, in another order
    torch.testing.assert_close(torch.cat([chosen, rejected]), expected, rtol=1e-6, atol=0)
    assert (adapted - expected).abs().min() > 1e-2  # the adapters do change the policy
    assert [n for n, p in engine.wrapped.base.named_parameters() if p.requires_grad] == trainable


def test_lora_run_starts_at_log2_and_learns(tmp_path, tiny, pairs):
    """With LoRA the policy starts as its reference (lora_B is 0): the first loss is log 2,
    the rewards 0; then the adapters alone move it."""
    rows = run_engine(_load(dpo_config(tmp_path, tiny["model"], "lora-run", model={"lora": {"r": 4}},
                                       train={"lr": 1e-2}, run={"eval_every": 5, "eval_batches": 2})),
                      pairs, pairs)
    assert rows[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1e-3 and rows[-1]["rewards/margins"] > 0
    assert "val_rewards/accuracies" in rows[-1] and "trainable_params" in rows[-1]


def test_precomputed_reference_gives_the_live_references_losses(tmp_path, tiny, pairs):
    """Reference log-probs carried by the batches (train.dpo.precompute_reference, fed to
    the engine directly), computed here by transformers' own model of the reference
    folder: no reference model is built, and the losses are those of the live reference."""
    from raytrain_platform.models.preference import pair_inputs, sequence_logps

    cfg = dpo_config(tmp_path, tiny["policy"], "live", train={"max_steps": 3, "dpo": {
        "reference": str(tiny["model"])}})
    live = run_engine(_load(cfg), pairs)
    inputs, targets = pair_inputs(pairs)
    with torch.no_grad():
        logps, _ = sequence_logps(_hf(tiny["model"])(inputs).logits, targets)
    chosen, rejected = logps.chunk(2)
    stored = {**pairs, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
    built = []
    cfg["train"]["dpo"]["precompute_reference"] = True
    cfg["run"]["name"] = "precomputed"
    pre = run_engine(_load(cfg), stored,
                     engine_hook=lambda e: built.append(e.preference.reference or e.preference.table))
    assert built == [None]
    # transformers' full logits against the engine's counted head, the same sums in another
    # order: measured loss 1.1e-6, rewards 2.1e-6, log-probs 3.1e-5 near -200 (1.5e-7 relative)
    for name in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen"):
        torch.testing.assert_close(torch.tensor([r[name] for r in pre]), torch.tensor([r[name] for r in live]),
                                   rtol=LOGPS_RTOL, atol=TRL_ATOL)
    with pytest.raises(KeyError, match="ref_chosen_logps"):  # no stored log-probs and no dataset to score
        run_engine(_load({**cfg, "run": {**cfg["run"], "name": "missing"}}), pairs)


@pytest.mark.extended
def test_resume_from_fsdp_checkpoint_in_one_process(tmp_path, tiny, pairs, one_process):
    """A 2-rank FSDP run's sharded checkpoint at step 3 resumes in one process (its
    reference rebuilt from the pretrained files, not the checkpoint): steps 4 and 5 are
    the uninterrupted run's."""
    cfg = dpo_config(tmp_path, tiny["model"], "fsdp-ckpt", parallel={"strategy": "fsdp"},
                     data={"batch_size": 2}, scaling={"num_workers": 2},
                     run={"checkpoint_every": 3, "eval_every": 0})
    _torchrun_rows(tmp_path, cfg, pairs, 2, checkpoints=tmp_path / "ckpt")
    resumed = run_engine(_load(dpo_config(tmp_path, tiny["model"], "resumed")), pairs,
                         resume=str(tmp_path / "ckpt" / "step_3"))
    assert [r["step"] for r in resumed] == [4, 5]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in one_process[3:]], dtype=torch.float64),
                               rtol=LAYOUT_RTOL, atol=1e-6)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("key, value, expected", [
    ("objective", "ppo", "train.objective = 'ppo': expected one of ['sft', 'dpo']"),
    ("dpo.beta", 0, "train.dpo.beta = 0.0: expected a number > 0"),
    ("dpo.loss", "kto", "train.dpo.loss = 'kto': expected one of ['sigmoid', 'ipo', 'hinge']"),
    ("dpo.label_smoothing", 0.5, "train.dpo.label_smoothing = 0.5: expected a number in [0, 0.5)"),
    ("dpo.bogus", 1, "train.dpo.bogus = 1: expected no such key"),
])
def test_bad_dpo_values_are_one_line(tmp_path, tiny, key, value, expected):
    from raytrain_platform.errors import ConfigError

    cfg = dpo_config(tmp_path, tiny["model"], "bad")
    section, _, leaf = key.rpartition(".")
    (cfg["train"].setdefault(section, {}) if section else cfg["train"])[leaf] = value
    with pytest.raises(ConfigError) as err:
        _load(cfg)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_dpo_for_a_model_that_is_no_language_model_exits_2(tmp_path, capsys):
    """`objective: dpo` with a tabular model: one line and exit 2, before any process group."""
    from raytrain_platform.core.__main__ import main

    path = tmp_path / "mlp.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "mlp"}, "data": {"source": "synthetic", "batch_size": 8},
                                    "train": {"max_steps": 1, "objective": "dpo"},
                                    "run": {"name": "mlp", "storage_path": str(tmp_path)}}))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: train.objective = 'dpo': expected 'sft' for a classification model "
                   "(dpo tunes a language model: model.task lm)")
    assert not torch.distributed.is_initialized()


def test_reference_folder_with_another_vocabulary_is_refused(tmp_path, tiny):
    from raytrain_platform.errors import ConfigError
    from raytrain_platform.tools.tiny_llm import make_model

    other = make_model(tmp_path / "other", vocab_size=300)
    with pytest.raises(ConfigError, match="train.dpo.reference = .*the policy's vocabulary of"):
        _load(dpo_config(tmp_path, tiny["model"], "vocab", train={"dpo": {"reference": str(other)}}))
    with pytest.raises(ConfigError, match=r"train.dpo.reference = .*'auto' for model 'gpt'"):
        _load({**dpo_config(tmp_path, tiny["model"], "gpt", train={"dpo": {"reference": str(other)}},
                            data={"tokenizer": str(tiny["model"])}), "model": {"name": "gpt"}})


def test_a_lora_dpo_checkpoint_exports_the_policy(tmp_path, tiny, pairs):
    """A DPO run's checkpoint holds the policy only (with LoRA: the adapters). `rtp export
    --format hf` gives the merged policy, which transformers loads on its own; `--format
    peft` gives the adapters, which peft's `PeftModel.from_pretrained` puts on the base:
    both score the pairs as the trained policy does."""
    from peft import PeftModel

    from raytrain_platform.cli import main as rtp
    from raytrain_platform.models.preference import pair_inputs, sequence_logps

    engines = []
    cfg = dpo_config(tmp_path, tiny["model"], "export", model={"lora": {"r": 4}},
                     train={"max_steps": 2, "lr": 1e-2}, run={"checkpoint_every": 2})
    run_engine(_load(cfg), pairs, checkpoints=str(tmp_path / "ckpt"), engine_hook=engines.append)
    for form in ("hf", "peft"):
        assert rtp(["export", str(tmp_path / "ckpt" / "step_2"), "--format", form,
                    "--out", str(tmp_path / form)]) == 0
    merged, base = _hf(tmp_path / "hf"), _hf(tiny["model"])
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    inputs, targets = pair_inputs(take(pairs, slice(0, 4)))
    with torch.no_grad():
        ours, _ = sequence_logps(engines[0].wrapped.module(inputs).logits, targets)
        before, _ = sequence_logps(base(inputs).logits, targets)
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        theirs = {"hf": sequence_logps(merged(inputs).logits, targets)[0],
                  "peft": sequence_logps(adapted(inputs).logits, targets)[0]}
    # measured: 7.3e-8 relative merged into the weights, 0 as peft's adapters on the base
    for logps in theirs.values():
        torch.testing.assert_close(logps, ours, rtol=1e-5, atol=0)
    assert (ours - before).abs().max() > 1e-2  # the trained policy, not the reference


@pytest.mark.extended
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_dpo_run_serves_to_the_openai_client(tmp_path, tiny, pairs, ray_cluster):
    """A LoRA DPO run's checkpoint and its `--format hf` export, served by one Serve app
    as any SFT run's: the `openai` client's greedy completion and chat answer from each
    are transformers' own greedy generation from the export."""
    import openai
    from conftest import serve_app

    from raytrain_platform.cli import main as rtp
    from raytrain_platform.serve.builder import app
    from raytrain_platform.serve.text import HFTokenizer

    cfg = dpo_config(tmp_path, tiny["model"], "served", model={"lora": {"r": 4}},
                     train={"max_steps": 2, "lr": 1e-2}, run={"checkpoint_every": 2})
    run_engine(_load(cfg), pairs, checkpoints=str(tmp_path / "ckpt"))
    ckpt = tmp_path / "ckpt" / "step_2"
    assert rtp(["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    model, tok = _hf(tmp_path / "hf"), HFTokenizer(str(tmp_path / "hf"))
    eos = list(model.generation_config.eos_token_id)

    def greedy(ids: list[int], n: int) -> str:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        return tok.decode(out[0, len(ids):].tolist())

    prompt = "What does `os.path.join` do?\n"
    messages = [{"role": "user", "content": "What does `os.path.join` do?"}]
    with serve_app(app({"checkpoint": f"dpo={ckpt},merged={tmp_path / 'hf'}", "max_batch_size": 4})) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list()} == {"dpo", "merged"}
        for name in ("dpo", "merged"):
            done = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            assert done.choices[0].text == greedy(tok.encode(prompt), 12), name
            chat = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0)
            assert chat.choices[0].message.content == greedy(tok.encode_rendered(tok.render_chat(messages)), 10)


def test_the_progress_line_shows_the_reward_accuracy():
    from raytrain_platform.launch.progress import format_progress

    line = format_progress({"step": 3, "epoch": 0, "loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.2,
                            "val_loss": 0.5, "val_rewards/accuracies": 0.875, "samples_per_s": 10.0,
                            "data_wait_frac": 0.0, "lr": 1e-3}, 5)
    assert "reward_acc 0.750 margin 0.200" in line and "val_loss 0.5000 | val_reward_acc 0.875" in line


def test_rtp_train_refuses_dpo_on_a_tabular_model_before_ray(tmp_path):
    """The CLI: one line on stderr, exit 2, and no Ray started (no session directory)."""
    import sys

    path = tmp_path / "mlp.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "mlp"}, "data": {"source": "synthetic", "batch_size": 8},
                                    "train": {"max_steps": 1, "objective": "dpo"},
                                    "run": {"name": "mlp", "storage_path": str(tmp_path)}}))
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "train", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                                 "RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: train.objective = 'dpo': expected 'sft' for a classification model (dpo tunes a language "
        "model: model.task lm)"]
    assert not (tmp_path / "ray").exists()
