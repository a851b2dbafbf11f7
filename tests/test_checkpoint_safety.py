"""Sharded checkpoints never unpickle arbitrary objects: a DCP ``.metadata`` whose
pickle would run code is refused, and the code never runs. Plain processes, no Ray."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import yaml

from raytrain_platform.core.sharded import SafeFileSystemReader, load_full_model_state
from raytrain_platform.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


class _TouchMarker:
    """Unpickling this creates `path` (what an attacker's payload would do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _ExecMarker(_TouchMarker):
    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _sharded_checkpoint(tmp_path, payload: bytes):
    ckpt = tmp_path / "checkpoint_000001"
    (ckpt / "sharded").mkdir(parents=True)
    (ckpt / "sharded" / ".metadata").write_bytes(payload)
    cfg = {"model": {"name": "gpt", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}},
           "data": {"source": "synthetic", "batch_size": 4}, "train": {"max_steps": 1},
           "run": {"name": "evil", "storage_path": str(tmp_path)}}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    state = {"format_version": 2, "sharded": True, "metrics": {},
             "state": {"step": 1, "epoch": 0, "batches_in_epoch": 1, "samples_seen": 4}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return ckpt


@pytest.mark.parametrize("payload_cls", [_TouchMarker, _ExecMarker])
def test_malicious_metadata_is_refused_and_never_runs(tmp_path, payload_cls):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(payload_cls(str(marker)))
    # The payload is live: plain pickle (what torch's FileSystemReader does) runs it.
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    from raytrain_platform.export import export_checkpoint
    from raytrain_platform.models import build_model
    from raytrain_platform.config import ModelConfig

    ckpt = _sharded_checkpoint(tmp_path, payload)
    with pytest.raises(CheckpointError, match="not allowed in a DCP index"):
        export_checkpoint(ckpt, tmp_path / "out")
    model = build_model(ModelConfig(name="gpt", kwargs={"n_layer": 1, "n_head": 2, "n_embd": 16,
                                                        "block_size": 8}))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_full_model_state(ckpt, model)
    with pytest.raises(CheckpointError):
        SafeFileSystemReader(str(ckpt / "sharded")).read_metadata()
    assert not marker.exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_metadata_module_attributes_that_are_not_its_classes_are_refused(tmp_path):
    # GLOBAL metadata.dataclass (a function the module imports, not one of its classes), called.
    payload = b"ctorch.distributed.checkpoint.metadata\ndataclass\n)R."
    ckpt = _sharded_checkpoint(tmp_path, payload)
    with pytest.raises(CheckpointError, match="not allowed"):
        SafeFileSystemReader(str(ckpt / "sharded")).read_metadata()


def test_real_dcp_metadata_is_accepted_and_loads(tmp_path):
    """A genuine single-process DCP save reads back through the safe reader."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "c" / "sharded"),
             no_dist=True)
    meta = SafeFileSystemReader(str(tmp_path / "c" / "sharded")).read_metadata()
    assert "model.weight" in meta.state_dict_metadata
    fresh = torch.nn.Linear(4, 3)
    loaded = load_full_model_state(tmp_path / "c", fresh)
    torch.testing.assert_close(loaded["weight"], model.weight.detach())


def test_truncated_metadata_is_a_checkpoint_error(tmp_path):
    ckpt = _sharded_checkpoint(tmp_path, pickle.dumps({"a": 1})[:5])
    with pytest.raises(CheckpointError, match="unreadable DCP metadata"):
        SafeFileSystemReader(str(ckpt / "sharded")).read_metadata()


def _linear_checkpoint(tmp_path, state: dict):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "c" / "sharded"), no_dist=True)
    return tmp_path / "c"


def test_a_bytes_entry_that_would_run_code_is_refused(tmp_path):
    """DCP's own planner reads entries its index calls bytes with
    torch.load(weights_only=False): a weight saved as a pickled object runs code."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    ckpt = _linear_checkpoint(tmp_path, {"weight": _TouchMarker(str(marker)),
                                         "bias": torch.zeros(3)})
    victim = {"model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}}
    dcp.load(victim, checkpoint_id=str(ckpt / "sharded"), no_dist=True)  # torch's own path
    assert marker.exists(), "the payload is live under DCP's default planner"
    marker.unlink()

    with pytest.raises(CheckpointError, match="'model.weight' refused"):
        load_full_model_state(ckpt, torch.nn.Linear(4, 3))
    assert not marker.exists()


def test_plain_data_where_a_weight_belongs_is_refused(tmp_path):
    ckpt = _linear_checkpoint(tmp_path, {"weight": 7, "bias": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="are not tensors"):
        load_full_model_state(ckpt, torch.nn.Linear(4, 3))


def test_index_naming_other_files_or_missing_shards_is_refused(tmp_path):
    ckpt = _linear_checkpoint(tmp_path, torch.nn.Linear(4, 3).state_dict())
    meta_path = ckpt / "sharded" / ".metadata"
    original = meta_path.read_bytes()
    meta = pickle.loads(original)  # our own file, written just above
    for info in meta.storage_data.values():
        info.relative_path = "../../outside.distcp"
    meta_path.write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="only this checkpoint's own"):
        load_full_model_state(ckpt, torch.nn.Linear(4, 3))
    meta_path.write_bytes(original)
    for shard in (ckpt / "sharded").glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        load_full_model_state(ckpt, torch.nn.Linear(4, 3))


def test_tied_weights_are_saved_under_each_name_and_load_back_tied(tmp_path):
    """An LM head tied to its embedding (Llama 3.2 1B, many small Qwens): safetensors
    refuses shared memory, so the full-state writer stores each name; loading fills the
    one shared parameter."""
    from raytrain_platform.core.checkpoint import write_weights
    from safetensors.torch import load_file

    from user_models import tied_mlp

    model = tied_mlp()
    write_weights(tmp_path / "model.safetensors", model)
    state = load_file(str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(state["back.weight"], state["inp.weight"], rtol=0, atol=0)
    fresh = tied_mlp()
    fresh.load_state_dict(state)
    assert fresh.back.weight is fresh.inp.weight
    torch.testing.assert_close(fresh.inp.weight, model.inp.weight, rtol=0, atol=0)
