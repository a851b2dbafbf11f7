"""User models: ``model.name: "pkg.module:build_fn"``, a function that takes
``model.kwargs`` and returns an ``nn.Module``.

Its forward may return logits, or a Hugging Face-style output (an object or dict with
``.logits``; ``.loss`` is ignored, the platform computes the loss itself). Its
repeated blocks, which FSDP shards one by one and activation checkpointing wraps, are
found as its largest ``nn.ModuleList`` of modules of one class, or named by class with
``model.block_class``. For a language model, ``data.seq_len`` sets the tokens per
sample. Before Ray starts, the builder is imported, its kwargs bound to its signature,
and the module built on the meta device (no memory) to check what it returns.

>>> fam = UserFamily("collections:OrderedDict")
>>> fam.precheck({}, block_class=None, needs_blocks=None)
Traceback (most recent call last):
...
raytrain_platform.errors.ConfigError: model.name = 'collections:OrderedDict': expected a function returning torch.nn.Module (it returned OrderedDict)
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import TYPE_CHECKING, Any, Callable

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.family import ModelFamily, ServingSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["UserFamily", "IMPORT_PATH", "load_user_builder"]

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_user_builder(import_path: str) -> Callable[..., Any]:
    """``"pkg.module:build_fn"`` -> the function; a clear `ConfigError` if it is not there."""
    module_name, _, fn_name = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("model.name", import_path, f"an importable module ({exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError("model.name", import_path,
                          f"a callable '{fn_name}' in module '{module_name}'")
    return fn


class UserFamily(ModelFamily):
    """One user builder, by its import path."""

    description = "a user builder 'pkg.module:build_fn' returning an nn.Module"

    def __init__(self, import_path: str):
        self.name = import_path

    def resolve_task(self, kwargs: dict, requested: str | None) -> str:
        return super().resolve_task(kwargs, requested)

    def serving(self, kwargs: dict, task: str) -> ServingSpec:
        """Tabular tasks through ``predict``, the row width and output count read off the
        module built on the meta device (its first and last ``nn.Linear``; None when it
        has none: the request is then not checked); an LM through ``generate``, called as
        ``model(ids)`` over the last ``data.seq_len`` tokens (its training context; the
        serving catalog fills it in), reading the tokenizer it was trained with."""
        if task == "lm":
            return ServingSpec("generate", {}, context_len=0, kv_cache=False)
        from torch import nn

        linears = [m for m in self.build(kwargs, device="meta").modules() if isinstance(m, nn.Linear)]
        return ServingSpec("predict", {"num_features": linears[0].in_features if linears else None,
                                       "num_outputs": linears[-1].out_features if linears else None})

    def takes_position_ids(self, kwargs: dict) -> bool:
        """Whether the module's forward names ``position_ids`` and ``use_cache`` parameters
        (a Hugging Face model's does), read off a meta-device build; a builder that fails
        is `precheck`'s to report."""
        try:
            forward = self.build(kwargs, device="meta").forward
            return {"position_ids", "use_cache"} <= set(inspect.signature(forward).parameters)
        except Exception:  # the user's code: precheck says what is wrong
            return False

    def _checked(self, model: Any) -> "nn.Module":
        from torch import nn

        if not isinstance(model, nn.Module):
            raise ConfigError("model.name", self.name,
                              f"a function returning torch.nn.Module (it returned {type(model).__name__})")
        return model

    def build(self, kwargs: dict, *, device: "str | torch.device | None" = None) -> "nn.Module":
        import torch

        fn = load_user_builder(self.name)
        with torch.device(device or "cpu"):
            return self._checked(fn(**kwargs))

    def precheck(self, kwargs: dict, *, block_class: str | None, needs_blocks: str | None) -> None:
        fn = load_user_builder(self.name)
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as exc:
            raise ConfigError("model.kwargs", kwargs, f"arguments that {self.name} accepts "
                              f"{inspect.signature(fn)} ({exc})") from None
        except ValueError:  # a builtin without a signature: building it will tell
            pass
        try:
            model = self.build(kwargs, device="meta")  # shapes only, no memory
        except ConfigError:
            raise
        except Exception as exc:  # the user's own code failed: say where, in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError("model.name", self.name, f"a builder that runs with model.kwargs "
                              f"{kwargs} (it raised {type(exc).__name__}: {first})") from None
        blocks = self.blocks(model, block_class=block_class)
        if needs_blocks and not blocks:  # the field that works on blocks
            raise ConfigError(needs_blocks, True,
                              f"false for model '{self.name}': it has no repeated blocks (no "
                              "nn.ModuleList of one class); name their class with model.block_class")
