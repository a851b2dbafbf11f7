"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), read without
unpickling arbitrary objects.

Every rank writes its own shard (``__<rank>_0.distcp``) and rank 0 the index
(``.metadata``); no rank gathers the whole model. DCP loads into whatever layout
the target holds: FSDP shards at another world size, or full tensors of a plain
or DDP model, or a single process with no process group (export).

Safety, three holes closed, each with a test (tests/test_checkpoint_safety.py):

- torch's `FileSystemReader.read_metadata` calls ``pickle.load`` on ``.metadata``;
  `SafeFileSystemReader` reads it with an unpickler that resolves only the classes
  DCP metadata is made of and refuses anything else with `CheckpointError`;
- entries the index calls bytes (optimizer hyperparameters, or any key a crafted
  index declares so) are read by DCP's `DefaultLoadPlanner` with
  ``torch.load(weights_only=False)``; `_SafeLoadPlanner` reads them with
  ``weights_only=True``;
- the index names the files to read: only this checkpoint's own ``__R_I.distcp``
  files are accepted (no ``../``), and all of them must be there (a checkpoint
  whose shards did not all arrive is incomplete, not half-loaded).

>>> # dcp.load(state, storage_reader=SafeFileSystemReader("run/checkpoint_000010/model"))
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from raytrain_platform.errors import CheckpointError

__all__ = ["SHARDED_DIR", "SafeFileSystemReader", "safe_load_metadata", "save_sharded",
           "load_sharded", "load_full_model_state", "load_saved_tensors"]

SHARDED_DIR = "sharded"  # DCP files live in <checkpoint>/sharded/
_METADATA_FILE = ".metadata"

# (module, name) pairs DCP metadata pickles reference, beyond the metadata module's own classes.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks up a torch.layout by its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only plain metadata classes; a pickle naming anything else is refused."""

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which is not "
                              "allowed in a DCP index (refusing to unpickle it)")


def safe_load_metadata(data: bytes, *, source: str = ".metadata") -> Metadata:
    try:
        obj = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    except Exception as exc:  # truncated or corrupt pickles raise many types
        raise CheckpointError(f"{source}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, Metadata):
        raise CheckpointError(f"{source}: not DCP metadata (found {type(obj).__name__})")
    return obj


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose ``.metadata`` is read by `safe_load_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(f.read(), source=str(path))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor entries are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # weights_only refuses anything that is not plain data
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"entry {read_item.dest_index.fqn!r} refused or unreadable "
                                  f"({first})") from None
        # Hand DCP a re-serialisation of the plain data just read, so its own
        # bookkeeping (flattened keys, mappings) runs unchanged.
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def _reader(directory: str | os.PathLike) -> SafeFileSystemReader:
    path = Path(directory) / SHARDED_DIR
    if not (path / _METADATA_FILE).is_file():
        raise CheckpointError(f"{directory}: no {SHARDED_DIR}/{_METADATA_FILE} (partial sharded checkpoint)")
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()  # refused here with a plain CheckpointError, not wrapped by DCP
    # Each shard must hold every byte range the index places in it: a shard cut short by
    # a kill during its copy to storage is refused here, not read as garbage.
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        if not (isinstance(name, str) and _SHARD_FILE.match(name)):
            raise CheckpointError(f"{path}: the index names file {name!r}; only this checkpoint's "
                                  "own __<rank>_<n>.distcp shard files are read")
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: shard {name} is missing (incomplete sharded checkpoint)")
        if (path / name).stat().st_size < end:
            raise CheckpointError(f"{path}: shard {name} is {(path / name).stat().st_size} bytes, the "
                                  f"index needs {end} (cut short: incomplete sharded checkpoint)")
    return reader


def shards_complete(directory: str | os.PathLike) -> bool:
    """Whether a sharded checkpoint's index reads and every shard it names is whole."""
    try:
        _reader(directory)
    except CheckpointError:
        return False
    return True


def _load(state: dict, directory: str | os.PathLike, what: str, **kwargs) -> None:
    """`dcp.load` through the safe reader and planner; any failure is one CheckpointError."""
    try:
        dcp.load(state, storage_reader=_reader(directory), planner=_SafeLoadPlanner(), **kwargs)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps rank failures in a BaseException
        ours = re.search(r"CheckpointError: (.+)", str(exc))
        if ours:
            raise CheckpointError(f"{directory}: {ours.group(1)}") from None
        raise CheckpointError(f"{directory}: sharded checkpoint could not be loaded into this "
                              f"{what} ({_short(exc)})") from None


def save_sharded(directory: str | os.PathLike, *, module: nn.Module,
                 optimizer: torch.optim.Optimizer, adapters_only: bool = False) -> None:
    """Collective: every rank writes its shard of model and optimizer state (FQN-keyed);
    with `adapters_only` (LoRA), the trainable parameters only, not the frozen base."""
    model_sd, optim_sd = get_state_dict(module, optimizer,
                                        options=StateDictOptions(ignore_frozen_params=adapters_only))
    if adapters_only:
        model_sd = _trained_only(module, model_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(directory) / SHARDED_DIR))


def _trained_only(module: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """`model_sd` without frozen parameters that ``ignore_frozen_params`` keeps: a tied
    weight's second name (GPT-2's ``lm_head.weight``, the frozen embedding's) is not
    among the parameters torch checks, which it lists once each."""
    # torch's own name cleaning (compile and checkpoint-wrapper prefixes), as ignore_frozen_params does
    from raytrain_platform.compat.torch_private import state_dict_names

    frozen = {fqn for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad
              for fqn in state_dict_names(module, n)}
    return {k: v for k, v in model_sd.items() if k not in frozen}


def load_sharded(directory: str | os.PathLike, *, module: nn.Module,
                 optimizer: torch.optim.Optimizer, adapters_only: bool = False,
                 optim_aliases: dict[str, str] | None = None) -> None:
    """Collective: restore model and optimizer from DCP shards into `module`'s own layout
    (FSDP shards at any world size, or the full tensors of a plain/DDP model); with
    `adapters_only`, the trainable parameters (the frozen base is loaded already).
    `optim_aliases`: parameters whose optimizer state is read under another name (the
    last pipeline stage's copy of a tied LM head: the unsplit model keys the one
    parameter's state by its first name, the embedding's; the copies' states are equal)."""
    options = StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
    if adapters_only:
        model_sd = _trained_only(module, model_sd)
    wanted: dict[str, Any] = optim_sd.get("state", {})  # type: ignore[assignment]
    moved = {name: other for name, other in (optim_aliases or {}).items() if name in wanted}
    for name, other in moved.items():
        wanted[other] = wanted.pop(name)
    # This optimizer's own parameter names per group: the file holds one saving rank's
    # lists (DCP keeps one copy of a key every rank wrote), another layout's names.
    groups: list[dict[str, Any]] = optim_sd.get("param_groups", [])  # type: ignore[assignment]
    own = [list(g["params"]) for g in groups]
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # dcp.load fills it in place
    _load(state, directory, "model/optimizer")
    for group, names in zip(state["optim"].get("param_groups", []), own):
        group["params"] = names
    loaded: dict[str, Any] = state["optim"].setdefault("state", {})
    for name, other in moved.items():
        loaded[name] = loaded.pop(other)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)


def load_full_model_state(directory: str | os.PathLike, model: nn.Module,
                          keys: "set[str] | None" = None) -> dict[str, torch.Tensor]:
    """Consolidate the model weights of a sharded checkpoint into `model`'s full (plain,
    CPU) state dict, in this one process, without a process group; only `keys` (a LoRA
    checkpoint's adapters) when given."""
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()
                       if keys is None or k in keys}}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load(state, directory, "model", no_dist=not dist.is_initialized())
    wrong = sorted(k for k, v in state["model"].items() if not isinstance(v, torch.Tensor))
    if wrong:  # an index may call a weight "bytes": plain data then, but still not a tensor
        raise CheckpointError(f"{directory}: entries {wrong[:3]} are not tensors")
    return state["model"]


def load_saved_tensors(directory: str | os.PathLike, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor a sharded checkpoint saved under `prefix` (a LoRA checkpoint's
    adapters), full and on the CPU, shaped as its index says: no model needed."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = _reader(directory).read_metadata()
    state = {"model": {key[len(prefix):]: torch.empty(info.size, dtype=info.properties.dtype)
                       for key, info in meta.state_dict_metadata.items()
                       if key.startswith(prefix) and isinstance(info, TensorStorageMetadata)}}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load(state, directory, "set of tensors", no_dist=not dist.is_initialized())
    return state["model"]


def _short(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(exc).__name__
