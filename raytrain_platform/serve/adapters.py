"""Several LoRA runs over one base, served from one replica: the base is loaded once
per replica (one per base identity: path and content hash, core/adapters.py), each
run's adapters join it under the run's model id, and a request runs its model's
adapters only.

Why one module with many adapters and not one merged model per run: a merged model is
a full copy of the base per run; adapters are ``r x (in + out)`` per adapted layer
(benchmarks/lora_serving.py measures both). Switching is safe because a replica runs
all compute on one thread (serve/app.py): a forward sets its adapters active, then runs.

>>> bases = SharedBases()                                                    # doctest: +SKIP
>>> model = bases.load("run-a", "runs/run-a/checkpoint_000060")              # doctest: +SKIP
>>> del model  # its adapters leave the base (and the base, with its last adapters)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import itertools
import re
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["AdapterView", "SharedBases"]


class AdapterView(nn.Module):
    """One served LoRA run: the shared base, with this run's adapters active in forward."""

    def __init__(self, base: nn.Module, adapter: str, layers: list[Any]):
        super().__init__()
        # `layers`: every LoRA layer of the base, kept current by `SharedBases` (a run
        # loaded later may adapt layers this one does not: they must be switched too).
        self.base, self.adapter, self._layers = base, adapter, layers
        view = weakref.ref(self)  # not `self`: a cycle would keep the adapters until a GC pass

        def forward(*args: Any, **kwargs: Any) -> Any:
            alive = view()
            assert alive is not None, "called as the view's own attribute: the view is alive"
            return alive._forward(*args, **kwargs)

        # With the base's own signature: serving inspects it (the KV cache argument's name).
        self.forward = functools.wraps(base.forward)(forward)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        for layer in self._layers:  # layers without this run's adapter run as the base
            layer.set_adapter(self.adapter)
        return self.base(*args, **kwargs)


class SharedBases:
    """The bases a replica holds, each once, and the adapters each carries.

    A run's adapters stay on its base as long as anything holds its `AdapterView` (the
    multiplexing cache, or a batch about to run), and are deleted after (through
    `defer`: the replica runs it on its compute thread); a base with no adapters left
    goes too. Each load gets its own adapter name, so a run evicted and loaded again
    never shares adapters with a view still in use."""

    def __init__(self, device: torch.device | str = "cpu",
                 defer: Callable[..., Any] = lambda fn, *args: fn(*args)):
        self.device, self._defer = torch.device(device), defer
        self._bases: dict[str, nn.Module] = {}  # base sha256 -> the base with its adapters
        self._layers: dict[str, list[Any]] = {}  # base sha256 -> its LoRA layers (one list, updated)
        self._adapters: dict[str, set[str]] = {}  # base sha256 -> adapter names on it
        self._loads = itertools.count()

    @property
    def num_bases(self) -> int:
        return len(self._bases)

    def adapters(self) -> int:
        """Adapters held now, over all bases."""
        return sum(len(names) for names in self._adapters.values())

    def load(self, model_id: str, checkpoint: str, *, trust_builder: bool = False) -> AdapterView:
        """The LoRA run of `checkpoint` as a module: its base (loaded now if this replica
        has not got it yet) with the run's adapters added."""
        from peft import inject_adapter_in_model

        from raytrain_platform.core.adapters import run_base
        from raytrain_platform.core.checkpoint import read_state
        from raytrain_platform.inference import (attach_adapters, find_checkpoint, load_job_config, load_lora_base,
                                                 read_adapters)
        from raytrain_platform.models.lora import peft_config, stores_in_out
        from raytrain_platform.models.registry import get_family

        ckpt = find_checkpoint(Path(checkpoint))
        cfg = load_job_config(ckpt, trust_builder=trust_builder)
        lora, base_id = cfg.model.lora, run_base(cfg)
        assert lora is not None and base_id is not None, "called for LoRA runs only (the catalog's lora)"
        key = base_id["sha256"]
        if key not in self._bases:
            torch.manual_seed(cfg.train.seed)  # a base initialised from the seed, as in training
            base = get_family(cfg.model.name).build(cfg.model.kwargs)
            load_lora_base(base, cfg, ckpt)
            self._bases[key], self._layers[key], self._adapters[key] = base.to(self.device).eval(), [], set()
        base = self._bases[key]
        name = f"m{next(self._loads)}_" + re.sub(r"\W", "_", model_id)  # peft adapter names: no dots
        with warnings.catch_warnings():  # "multiple adapters in the model": that is the intent
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            config = peft_config(lora, fan_in_fan_out=stores_in_out(base, lora))  # GPT-2's Conv1D: (in, out)
            inject_adapter_in_model(config, base, adapter_name=name)
        attach_adapters(base, read_adapters(ckpt, sharded=bool(read_state(ckpt).get("sharded"))), ckpt=ckpt,
                        adapter=name)
        base.to(self.device)
        self._adapters[key].add(name)
        self._layers[key][:] = [m for m in base.modules() if hasattr(m, "lora_A")]
        view = AdapterView(base, name, self._layers[key]).eval()
        weakref.finalize(view, self._defer, self._drop, key, name)
        return view

    def _drop(self, key: str, name: str) -> None:
        """Delete adapter `name` from base `key`; the base goes with its last adapter."""
        base = self._bases.get(key)
        if base is None or name not in self._adapters[key]:
            return
        module: Any  # peft's LoRA layers among them (peft is not type-checked)
        for module in base.modules():
            if hasattr(module, "lora_A") and name in module.lora_A:
                module.delete_adapter(name)
        self._adapters[key].discard(name)
        if not self._adapters[key]:
            del self._bases[key], self._layers[key], self._adapters[key]
