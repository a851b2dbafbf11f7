"""Parameters held by several modules (an LM head tied to its embedding: Llama 3.2 1B,
the small Qwens) stay one parameter through what replaces parameters module by module:
`nn.Module.to_empty` from the meta device gives each module its own new tensor
(core/weights.py `materialize`), and `parallelize_module` distributes each module's
parameters on its own (parallel/tp.py). Record the groups before, restore them after.

>>> import torch
>>> from torch import nn
>>> with torch.device("meta"):
...     head, emb = nn.Linear(4, 8, bias=False), nn.Embedding(8, 4)
>>> head.weight = emb.weight
>>> model = nn.ModuleDict({"emb": emb, "head": head})
>>> groups = shared_parameters(model)
>>> groups
[['emb.weight', 'head.weight']]
>>> _ = model.to_empty(device="cpu")
>>> model.head.weight is model.emb.weight
False
>>> retie(model, groups)
>>> model.head.weight is model.emb.weight
True
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["retie", "shared_parameters"]


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that more than one module holds, in module order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    groups = [list(dict.fromkeys(group)) for group in names.values()]
    return [group for group in groups if len(group) > 1]


def retie(model: nn.Module, groups: list[list[str]],
          check: Callable[[str, nn.Parameter, str, nn.Parameter], None] | None = None) -> None:
    """Make each group of names one parameter again, the first name's: `check(first,
    kept, name, other)` may refuse one that cannot take its place."""
    for first, *others in groups:
        kept = model.get_parameter(first)
        for name in others:
            other = model.get_parameter(name)
            if other is kept:
                continue
            if check is not None:
                check(first, kept, name, other)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, kept)
