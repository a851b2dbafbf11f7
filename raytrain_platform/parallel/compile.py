"""``parallel.compile``: each of the model's repeated blocks compiled with
``torch.compile`` (TorchInductor), in place, as torchtitan does (``apply_compile``):
after tensor parallelism shards them (DTensor traces into the graph) and on each
pipeline stage, before FSDP or DDP wraps the model (parallel/compose.py).

With ``parallel.activation_checkpointing`` too, the checkpointing happens inside each
block's compiled graph (``recompute=True``): the partitioner that splits the graph into
forward and backward is given an activation memory budget of 0, so the forward keeps
only the graph's inputs (the block's input, and references to its weights) and the
backward recomputes everything else, fused. That is full activation checkpointing per
block, PyTorch's own memory-budget API (torch/_functorch/partitioners.py:
``choose_saved_values_set`` returns the inputs at budget 0). Refused while the blocks
draw dropout: at budget 0 a random op is recomputed without being replayed, so the
backward would draw other masks than the forward did. The eager wrapper
(parallel/activation_checkpoint.py) does not compose with compile here: a checkpointed
Hugging Face decoder layer does not trace (its forward mutates a context variable inside
the checkpoint, so dynamo falls back to eager and nothing is compiled), and a block
compiled first and checkpointed after can fail PyTorch's recompute check when the
forward and the recompute pick different compiled graphs (pytorch#166926).

Per block, not the whole model: every block is an FSDP unit, so FSDP's all-gathers and
reduce-scatters stay between compiled graphs, and blocks of one class share a graph.
``Module.compile()`` compiles in place, so parameter names, and with them checkpoints,
exports and resumes, are the same as without it. Compiling happens at the first
forward (and the first backward) of each block: the first step takes longer.

The fused kernels change float rounding, so a compiled run matches an eager one within
float tolerance, not bit for bit (tests/test_hf.py states the tolerance).

On a CPU worker TorchInductor builds C++: the worker needs a C++ compiler, found by
TorchInductor's own search (`require_compiler`), checked when the model is built rather
than failing inside the first step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from raytrain_platform.compat.torch_private import dynamo_config, functorch_config, has_triton, inductor_cxx_check

from raytrain_platform.errors import ConfigError
from raytrain_platform.parallel.registry import recompute_dropout_error

__all__ = ["apply_compile", "require_compiler"]


def require_compiler(device: torch.device) -> None:
    """A clear error when this process cannot compile for `device`: no C++ compiler on a
    CPU (TorchInductor's own search: ``$CXX``, else ``g++``), no Triton on a GPU."""
    if device.type == "cpu":
        tried, found = inductor_cxx_check()
        if not found:
            raise ConfigError("parallel.compile", True, "false on a CPU worker without a C++ compiler "
                              f"(TorchInductor builds C++ there and found none of {tried}: install g++, "
                              "or set CXX to one)") from None
    elif device.type == "cuda":
        if not has_triton():
            raise ConfigError("parallel.compile", True, "false on a GPU worker without Triton "
                              "(TorchInductor's GPU kernels; pip install triton)")


def apply_compile(blocks: Sequence[tuple[str, nn.Module]], *, device: torch.device, announce: bool = False,
                  recompute: bool = False) -> None:
    """Compile each of `blocks` (``(fully qualified name, module)``) in place; with
    `recompute`, each block's graph keeps only its inputs for backward (activation
    checkpointing inside the graph); with `announce` (rank 0, once per model), say that
    the first step will take longer. As composed in parallel/compose.py, after TP and
    before FSDP::

        apply_compile(blocks(model), device=env.device, announce=env.is_rank0,
                      recompute=cfg.activation_checkpointing)
        apply_fsdp(model, env=env, cfg=cfg, blocks=blocks(model))
    """
    if not blocks:  # the config and resolve_job's precheck refuse these first; this is the last word
        raise ConfigError("parallel.compile", True, "false for a model without repeated blocks "
                          "(name their class with model.block_class)")
    require_compiler(device)
    where = _dropout(blocks) if recompute else None
    if where:
        raise recompute_dropout_error(where)
    if announce:
        print("parallel.compile: the model's blocks compile during the first step (TorchInductor; "
              "later runs reuse its cache)", flush=True)
    # Blocks of one class share a graph, but each grad mode (training; evaluation under
    # no_grad) and each new shape takes an entry, and a block's guards may hold its own
    # attributes: room for several entries per block, or later blocks would run eager
    # past the default limit (8). Only ever raised. (torch < 2.7 names: *cache_size_limit.)
    config = dynamo_config()
    for new, old, floor in (("recompile_limit", "cache_size_limit", max(64, 4 * len(blocks))),
                            ("accumulated_recompile_limit", "accumulated_cache_size_limit", 8 * len(blocks))):
        name = new if hasattr(config, new) else old
        setattr(config, name, max(getattr(config, name), floor))
    for _, block in blocks:
        if recompute:
            _compile_recomputing(block)
        else:
            block.compile()


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _dropout(blocks: Sequence[tuple[str, nn.Module]]) -> str | None:
    """The first place `blocks` draw dropout in training, or None: a dropout module with
    p > 0 (peft's LoRA dropout is one), or a probability an attention passes to its kernel
    (`gpt`'s ``dropout``, transformers' ``attention_dropout``)."""
    for fqn, block in blocks:
        for name, module in block.named_modules():
            where = f"{fqn}.{name}" if name else fqn
            if isinstance(module, _DROPOUT_MODULES) and module.p > 0:
                return f"{where} p = {module.p}"
            for attr in ("dropout", "attention_dropout", "dropout_p"):
                p = vars(module).get(attr)  # a plain attribute, not a submodule
                if isinstance(p, float) and p > 0:
                    return f"{where}.{attr} = {p}"
    return None


def _compile_recomputing(block: nn.Module) -> None:
    """Compile `block`'s forward in place with the activation memory budget at 0 while
    its graphs compile (the first call, and any recompile for a new shape), so that each
    saves only its inputs. Scoped to this block's calls, not the process (one thread runs
    a model's blocks). The forward, not ``Module.compile()``'s whole call: the module's
    hooks (FSDP2's all-gather and reshard, which dynamo does not trace) run eagerly around
    one graph instead of breaking it into pieces that each keep their own inputs. And a
    function of its own: dynamo keeps compiled graphs per code object, so a process that
    compiled the same class without recomputing never hands this block that graph, nor
    the other way round (AOTAutograd's on-disk cache has the budget in its key)."""
    forward = block.forward

    def forward_recomputing(*args, **kwargs):
        return forward(*args, **kwargs)

    compiled = torch.compile(forward_recomputing)
    config = functorch_config()

    @functools.wraps(forward_recomputing)
    def call(*args, **kwargs):
        with config.patch(activation_memory_budget=0.0):
            return compiled(*args, **kwargs)

    block.forward = call  # an instance attribute: nn.Module's call runs its hooks around it
