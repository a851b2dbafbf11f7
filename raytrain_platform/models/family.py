"""The model-family interface: everything the rest of the platform needs to know of a
model, answered in one place (torchtitan's ``TrainSpec`` is the pattern).

A family says how to build its module (on the meta device when weights will be loaded
into shards), what its task is and how its outputs become a loss, which repeated blocks
FSDP shards and activation checkpointing wraps, its tensor-parallel plan and pipeline
split (or a clear error naming the family), its shapes for ``rtp plan``, its
checkpoint key names for export, and how it is served. Nothing outside ``models/``
tests a model's name: config, resolve, parallel/, plan/ and serve/ ask the family
(`raytrain_platform.models.registry.get_family`).

No torch at module level (the config layer validates through families before
anything is imported); no Ray and no torch.distributed anywhere in models/.

>>> from raytrain_platform.models.registry import get_family
>>> fam = get_family("gpt")
>>> kw = fam.resolve_kwargs({"n_layer": 1})
>>> fam.resolve_task(kw, None), fam.default_seq_len(kw), fam.serving(kw, "lm").endpoint
('lm', 64, 'generate')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from raytrain_platform.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from raytrain_platform.models.shapes import ModelShape

__all__ = ["ConvertedWeight", "ModelFamily", "PipelineLayout", "ServingSpec", "TASKS", "check_stage_counts",
           "find_blocks", "logits_of"]

TASKS = ("classification", "regression", "lm")

# Tensor-parallel plan entries: module FQN -> one of these kinds; parallel/tp.py turns
# each into a DTensor ParallelStyle (the family itself never imports torch.distributed).
TP_KINDS = (
    "colwise",  # output features split (q/k/v, MLP up/gate): no communication in forward
    "rowwise",  # input features split (attention out, MLP down): partial sums all-reduced
    "colwise_gather",  # output features split, then gathered: the next op needs all of them
    "rowwise_split",  # input whole, each rank multiplies its slice of it; partial sums all-reduced
    "embedding",  # vocabulary rows split; the output is whole (or sequence-sharded with SP)
    "position_embedding",  # learned positions, split like the token embedding
    "head",  # LM head, vocabulary columns split, logits gathered for the loss
    "norm",  # replicated parameters (or run on sequence shards with SP): the layer norms
    "replicate",  # a module left whole (a router, unsplit experts): replicated, computing on local tensors
    "local_norm",  # replicated, on this rank's own activations (per-head norms): gradients summed
    "sequence_gather",  # with SP only: gather the sequence before attention / the MLP
)


@dataclass(frozen=True)
class PipelineLayout:
    """How a model splits into pipeline stages: the submodule holding its blocks (a
    ModuleDict keyed "0".."L-1"), and the submodules that live on the first and the
    last stage, each a dotted path ("model.layers"). A stage's forward must skip the
    ends it lacks (set to None)."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]


@dataclass(frozen=True)
class ServingSpec:
    """How a model is served: the endpoint (``predict`` for tabular rows, ``generate``
    for text), what a request's input must look like, and (generate) the context, the
    tokenizer, the end-of-sequence tokens and whether its forward keeps a KV cache."""

    endpoint: str  # "predict" | "generate"
    inputs: dict = field(default_factory=dict)  # shown in GET /v1/models; checked per request
    # generate: tokens of context the model sees (0: as many as the serving config says:
    # data.seq_len). With kv_cache, prompt + generated tokens must fit in it; without,
    # the last context_len tokens are the context (a window that slides).
    context_len: int = 0
    tokenizer: str | None = None  # a local Hugging Face tokenizer folder; None: UTF-8 bytes
    # The forward takes Hugging Face's cache arguments (input_ids, attention_mask,
    # position_ids, a DynamicCache, use_cache) and returns an output with .logits; else it
    # is called as model(ids) and re-run over the context for every token.
    kv_cache: bool = False
    stop_token_ids: tuple[int, ...] = ()  # generation ends at any of these (end of sequence)


@dataclass(frozen=True)
class ConvertedWeight:
    """A tensor a checkpoint stores in another form (a mixture of experts' per-expert
    tensors, of which the model holds one stacked tensor): built whole from the
    checkpoint tensors `sources` by `build`, which reads each with the function it is
    given (checkpoint key -> tensor) and returns every tensor it makes, by model name."""

    sources: tuple[str, ...]
    build: Callable[[Callable[[str], "torch.Tensor"]], dict[str, "torch.Tensor"]]


_NAMED_FAMILIES: list[type["ModelFamily"]] = []  # filled as the subclasses are defined


class ModelFamily:
    """Base class of the families. Subclasses set `name` and override what they have;
    the defaults describe a model with no parallel plan, no planner shape and the
    model's own parameter names as its checkpoint keys."""

    name: str = ""
    description: str = ""
    # Whether its modules have repeated blocks to shard and checkpoint (mlp: none).
    has_blocks: bool = True
    # Whether its TP plan runs with parallel.sequence_parallel (sequence-sharded norms).
    sequence_parallel: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):  # a family named by its class (gpt, hf, mlp; not a user builder)
            _NAMED_FAMILIES.append(cls)

    @staticmethod
    def _families_with(method: str) -> str:
        """The named families that override `method`, for a message (family.py imports no registry)."""
        return ", ".join(sorted(c.name for c in _NAMED_FAMILIES
                                if getattr(c, method) is not getattr(ModelFamily, method)))

    # ---- config: kwargs, task, sequence length ------------------------------------
    def resolve_kwargs(self, kwargs: Any) -> dict:
        """Defaults filled in and every key checked; `ConfigError` naming the key."""
        if not isinstance(kwargs, dict):
            raise ConfigError("model.kwargs", kwargs, "a mapping")
        return dict(kwargs)

    def resolve_task(self, kwargs: dict, requested: str | None) -> str:
        """The task (classification | regression | lm); `requested` is ``model.task``."""
        if requested is not None and requested not in TASKS:
            raise ConfigError("model.task", requested, f"one of {list(TASKS)}")
        return requested or "classification"

    def default_seq_len(self, kwargs: dict) -> int | None:
        """Tokens per sample when ``data.seq_len`` is not set (lm); None: it must be."""
        return None

    def max_seq_len(self, kwargs: dict) -> int | None:
        """The longest context the model takes (positions it has), if it has a limit."""
        return None

    def default_tokenizer(self, kwargs: dict) -> str | None:
        """Where ``data.tokenizer`` points by default (an hf model's own directory);
        None: the model reads bytes."""
        return None

    def vocab_size(self, kwargs: dict) -> int | None:
        """Rows of the token embedding (a tokenizer may not have more ids), if known."""
        return None

    def needs_data(self, kwargs: dict) -> bool:
        """Whether `fill_from_data` must run before the model can be built or planned."""
        return False

    def pretrained_files(self, kwargs: dict) -> list[str] | None:
        """Safetensors files to load after building (each rank its own slices), or None."""
        return None

    def reference_kwargs(self, kwargs: dict, path: str) -> dict:
        """The kwargs that build a preference run's reference model from the folder `path`
        (``train.dpo.reference``) beside a policy built from `kwargs`; `ConfigError` where
        the family reads no model folder, or the folder's model cannot score the policy's tokens."""
        raise ConfigError("train.dpo.reference", path, f"'auto' for model '{self.name}' (a reference "
                          f"folder is read for {self._families_with('reference_kwargs')} models)")

    def init_buffers(self, model: "nn.Module", device: "torch.device") -> None:
        """Recompute buffers a meta-device build left empty (after ``to_empty``)."""

    def checkpoint_sources(self, model: "nn.Module", keys: list[str]) -> "dict[str, str | ConvertedWeight] | None":
        """Where each tensor of `model` (by its state-dict name) is in pretrained files
        holding `keys`: a key, or a `ConvertedWeight` built from several; None (the
        default): each under its own name."""
        return None

    def export_hf(self, model: "nn.Module", kwargs: dict, out: str, *, tokenizer: str | None = None,
                  max_shard_size: str = "5GB") -> None:
        """Write `model` as a Hugging Face directory (config, safetensors, tokenizer)."""
        raise ConfigError("--format", "hf", f"safetensors for model '{self.name}' (a Hugging Face export "
                          "needs an hf model)")

    def fill_from_data(self, kwargs: dict, *, num_features: int, num_classes: int,
                       task: str) -> dict:
        """kwargs the data decides (the mlp's input and output sizes); default: none."""
        return kwargs

    def check_model_parallel(self, kwargs: dict, *, tp: int, pp: int, stages: int,
                             pp_split: list[int] | None) -> None:
        """A `ConfigError` when this model cannot be split ``tp`` x ``pp`` ways."""
        if tp * pp > 1:
            field_, value = ("parallel.tp_size", tp) if tp > 1 else ("parallel.pp_size", pp)
            raise ConfigError(field_, value, f"1 for model '{self.name}' (tensor/pipeline parallel plans "
                              f"exist for {self._families_with('check_model_parallel')})")

    def takes_position_ids(self, kwargs: dict) -> bool:
        """Whether its forward takes ``position_ids=`` (B, T) and ``use_cache=False`` and
        keeps apart the documents whose positions restart (``data.packing: documents``);
        default no."""
        return False

    def precheck(self, kwargs: dict, *, block_class: str | None, needs_blocks: str | None) -> None:
        """What can be checked before Ray starts (user builders: import, kwargs, type).
        `needs_blocks`: the config field set that works on the model's blocks
        (``parallel.activation_checkpointing``, ``parallel.compile``), or None."""

    def check_devices(self, kwargs: dict, *, use_gpu: bool) -> None:
        """A `ConfigError` when the model's kwargs need a device the job does not use
        (flash attention without ``scaling.use_gpu``); checked with the config."""

    # ---- the module ------------------------------------------------------------------
    def build(self, kwargs: dict, *, device: "str | torch.device | None" = None) -> "nn.Module":
        """The module, initialised, on `device` (default CPU). On ``"meta"`` no memory is
        allocated: ``to_empty(device=...)`` then `init_weights`, or load weights."""
        raise NotImplementedError

    def init_weights(self, model: "nn.Module") -> None:
        """Initialise a model built on the meta device after ``to_empty``."""
        reset = getattr(model, "reset_parameters", None)
        if reset is None:
            raise ConfigError("model.name", self.name, "a model with reset_parameters() to be "
                              "initialised after a meta-device build")
        reset()

    def blocks(self, model: "nn.Module", *, block_class: str | None = None) -> list[tuple[str, "nn.Module"]]:
        """The repeated blocks: each is an FSDP unit and an activation-checkpointing unit."""
        return find_blocks(model, block_class=block_class)

    def logits(self, output: Any) -> "torch.Tensor":
        """The logits of a forward's output (a tensor, or an output with ``.logits``)."""
        return logits_of(output, self.name)

    def aux_loss_coef(self, kwargs: dict) -> float:
        """The weight of the auxiliary loss the model's forward returns as ``aux_loss``
        (a Hugging Face-style output: a mixture of experts' router load-balancing loss),
        added to the training loss; 0.0 (the default) when there is none."""
        return 0.0

    def output_head(self, model: "nn.Module") -> "nn.Module | None":
        """The module that turns the final hidden states ``(B, T, hidden)`` into the
        logits, when the model's forward returns its result as it is (any
        post-processing elementwise): ``train.logits: counted`` runs it on the counted
        tokens only (`core/counted.py`). None (the default): every position."""
        return None

    # ---- parallel plans ----------------------------------------------------------------
    def tp_plan(self, model: "nn.Module", kwargs: dict) -> dict[str, str]:
        """Module FQN -> one of `TP_KINDS`."""
        raise ConfigError("parallel.tp_size", "> 1", f"1 for model '{self.name}' (it has no "
                          "tensor-parallel plan)")

    def pipeline_layout(self, model: "nn.Module") -> PipelineLayout:
        """Where `model` (what `pipeline_module` returned) splits into stages."""
        raise ConfigError("parallel.pp_size", "> 1", f"1 for model '{self.name}' (it has no "
                          "pipeline split)")

    def pipeline_module(self, model: "nn.Module") -> "nn.Module":
        """The module the pipeline cuts where `pipeline_layout` says (default: `model`
        itself, whose forward skips the ends a stage lacks). Same parameter names."""
        return model

    # ---- planner, export, serving --------------------------------------------------------
    def shape(self, kwargs: dict, *, seq_len: int | None = None) -> "ModelShape":
        """The model as `rtp plan` sees it at `seq_len` tokens per sample (default: the
        family's own); `ConfigError` when the family cannot say."""
        raise ConfigError("model.name", self.name, "a model family with a planner shape "
                          f"({self._families_with('shape')}); for another model use rtp plan "
                          "--params/--layers/--hidden/--seq-len")

    def planner_kwargs(self, *, layers: int | None, hidden: int | None, heads: int | None,
                       seq_len: int | None) -> dict:
        """kwargs for ``rtp plan --model NAME --layers/--hidden/--heads/--seq-len``."""
        raise ConfigError("--model", self.name, "a family with planner sizes")

    def export_state_dict(self, state: dict[str, "torch.Tensor"], kwargs: dict) -> dict[str, "torch.Tensor"]:
        """The checkpoint's tensors under the names an export uses (default: as trained)."""
        return state

    def serving(self, kwargs: dict, task: str) -> ServingSpec:
        """How it is served; by default tabular tasks through ``predict``."""
        if task == "lm":
            raise ConfigError("model.name", self.name, "a model family that can generate text "
                              "to serve an lm model")
        return ServingSpec("predict", {"num_features": kwargs.get("input_dim"),
                                       "num_outputs": kwargs.get("num_outputs")})


def check_stage_counts(n_layer: int, layers: str, *, pp: int, stages: int, pp_split: list[int] | None,
                       unit: str = "block") -> None:
    """A `ConfigError` when ``stages`` pipeline stages (``pp`` ranks) cannot split the
    model's ``n_layer`` blocks (more stages than blocks), or ``pp_split`` does not give
    each stage its count; `layers` names where the count comes from
    (``model.kwargs.n_layer``, ``num_hidden_layers``)."""
    if n_layer < stages:
        raise ConfigError("parallel.pp_size", pp, f"at most {layers} ({n_layer}) pipeline "
                          f"stages in all ({pp} ranks x {stages // pp} per rank = {stages})")
    if pp_split is not None and (len(pp_split) != stages or sum(pp_split) != n_layer):
        raise ConfigError("parallel.pp_split", pp_split, f"{stages} {unit} counts (one per stage) "
                          f"summing to {layers} ({n_layer})")


def logits_of(output: Any, model_name: str) -> "torch.Tensor":
    """A tensor as it is; a Hugging Face-style output (an object or dict with ``logits``)
    by its logits. Anything else is one line naming the model and what it returned."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    what = type(output).__name__
    if isinstance(output, dict):
        what += f" with keys {sorted(map(str, output))[:6]}"
    raise ConfigError("model.name", model_name, f"a module whose forward returns logits (a tensor) or an "
                      f"output with .logits; it returned {what}")


def find_blocks(model: "nn.Module", *, block_class: str | None = None) -> list[tuple[str, "nn.Module"]]:
    """The model's repeated blocks: every outermost module of class `block_class`, or
    else the children of its largest ``ModuleList``/``ModuleDict`` whose children all
    share one class (a transformer's layers). ``[]`` when it has none.

    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    ...         self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    >>> [name for name, _ in find_blocks(Net())]
    ['layers.0', 'layers.1', 'layers.2']
    >>> [name for name, _ in find_blocks(Net(), block_class="ReLU")]
    ['stem.1']
    """
    from torch import nn

    if block_class is not None:
        found: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            inside = any(name.startswith(f"{outer}.") for outer, _ in found)
            if type(module).__name__ == block_class and not inside and module is not model:
                found.append((name, module))
        if not found:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError("model.block_class", block_class,
                              f"the class name of the model's repeated blocks; its modules are {classes}")
        return found
    best: tuple[str, nn.ModuleList | nn.ModuleDict] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        if len({type(child) for child in module.children()}) == 1 and (best is None or len(module) > len(best[1])):
            best = (name, module)
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [(prefix + child, m) for child, m in best[1].named_children()]
