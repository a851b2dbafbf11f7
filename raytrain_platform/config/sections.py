"""The six sections of a job config: model, data, train, parallel, scaling, run. Each
is a dataclass that checks its own fields in ``__post_init__``; what needs several
sections at once is `job.JobConfig`'s. The string below each field documents it for users:
config/docs.py turns those into docs/configuration.md."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Union

from raytrain_platform.errors import ConfigError
from raytrain_platform.models.family import TASKS
from raytrain_platform.models.lora import resolve_lora
from raytrain_platform.models.registry import get_family
from raytrain_platform.parallel.dims import PP_SCHEDULES
from raytrain_platform.parallel.registry import STRATEGIES, strategy_names
from raytrain_platform.units import parse_size

__all__ = ["ModelConfig", "DataConfig", "DpoConfig", "TrainConfig", "ParallelConfig", "ScalingConfig", "RunConfig",
           "SECTIONS", "Section", "SourceEntry", "TRACKERS", "MAX_MIX_SOURCES", "check_field"]

_REQUIRED: Any = dataclasses.MISSING
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "$" lets a final newline in
MAX_SYNTHETIC = 100_000_000
MAX_MIX_SOURCES = 256  # data/mixture.py's MAX_SOURCES: sample ids keep 8 bits for the source
SEED_LIMIT = 2**32  # numpy's and every generator's range; torch takes it too
SEED_ALLOWED = "an integer from 0 to 2**32 - 1"
# Experiment trackers `run.tracking` accepts; raytrain_platform/tracking/ implements each.
TRACKERS: tuple[str, ...] = ("mlflow", "tensorboard")
MAX_TORCH_THREADS = 4096  # torch.set_num_threads takes a C int; no machine has more cores


def check_field(ok: bool, path: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(path, value, allowed)


@dataclass
class ModelConfig:
    """`name` is a model family (`gpt`, `mlp`, `hf`; models/registry.py) or an import path
    ``pkg.module:build_fn`` whose function takes ``**kwargs`` and returns an ``nn.Module``.
    The family validates `kwargs` and decides the task."""

    SECTION: ClassVar[str] = "model"
    name: str = _REQUIRED
    """A model family: `gpt`, `mlp`, `hf` (a Hugging Face causal LM from `model.kwargs.path`; see
    [hf.md](hf.md)), or a user model `pkg.module:build_fn` (a function taking `**kwargs` and returning an
    `nn.Module`; see [models.md](models.md))."""
    kwargs: dict = field(default_factory=dict)
    """The model's sizes. `gpt`: `n_layer` 2, `n_head` 4, `n_embd` 128, `block_size` 64 (context length),
    `dropout` 0.0, `bias` true, `init_std` 0.02 (byte-level vocabulary of 256). `mlp`: `hidden_sizes` [64,
    64], `dropout` 0.0, `input_dim`/`num_outputs` (default: from the data), `task` classification or
    regression. `hf`: `path`, `init` (pretrained), `dtype` (float32), `attn_implementation` (null: transformers'
    pick for the architecture); see [hf.md](hf.md). User models: passed as keyword arguments."""
    task: Union[str, None] = None  # classification | regression | lm; built-ins know theirs
    """`classification`, `regression` or `lm`; needed only for user models (default classification); the
    built-in families know theirs."""
    block_class: Union[str, None] = None
    """The class name of the model's repeated blocks, which FSDP shards one by one and activation checkpointing
    wraps (default: the children of its largest `nn.ModuleList` of one class)."""
    lora: Union[dict, None] = None
    """LoRA adapters `{r, alpha, dropout, target_modules}` (defaults 8, 16, 0.0, `all-linear`: peft's rule,
    every `nn.Linear` and `Conv1D` but the output head, resolved to module names before Ray; on a mixture of
    experts, its fused experts and router too, as peft's `get_peft_model` adapts them): the base is frozen and only the adapters train; see
    [hf.md](hf.md#lora-fine-tuning-modellora)."""

    def __post_init__(self) -> None:
        family = get_family(self.name)
        check_field(self.task is None or self.task in TASKS, "model.task", self.task, f"one of {list(TASKS)}")
        # Fills in defaults and rejects unknown or bad keys with the field named.
        self.kwargs = family.resolve_kwargs(self.kwargs)
        self.task = family.resolve_task(self.kwargs, self.task)
        check_field(self.block_class is None or bool(re.fullmatch(r"[A-Za-z_]\w*", self.block_class)),
               "model.block_class", self.block_class, "a Python class name, or null")
        if self.lora is not None:
            self.lora = resolve_lora(self.lora)

    @property
    def resolved_task(self) -> str:
        """`task` as ``__post_init__`` settled it (the family's own when the config gave none)."""
        assert self.task is not None, "ModelConfig.__post_init__ resolves the task from its family"
        return self.task


class SourceEntry(NamedTuple):
    """One entry of ``data.sources``: its weight, and the config its source is read with."""

    weight: float
    data: "DataConfig"


@dataclass
class DataConfig:
    SECTION: ClassVar[str] = "data"
    source: str = _REQUIRED  # parquet | synthetic | text | jsonl | hf_dataset
    """`text` (a folder of text files cut into byte windows of `data.seq_len + 1`, or read through
    `data.tokenizer` when there is one), `jsonl` (instruction or text records, one JSON object per line,
    tokenized and packed; see `data.format`), `hf_dataset` (the same records as the rows of a Hugging Face
    `datasets` folder written by `save_to_disk`, or of `.arrow` files), `parquet` (tabular; with an `lm`
    model, records as rows, as `hf_dataset`), `synthetic` (deterministic generator). See [data.md](data.md)."""
    batch_size: Union[int, str] = _REQUIRED  # per-worker micro-batch, or "auto" (train.global_batch_size)
    """Per-worker micro-batch (samples per worker per micro-step), or `auto`: the largest that fits in memory,
    with `train.global_batch_size` (see [plan-and-doctor.md](plan-and-doctor.md#let-the-plan-decide-auto))."""
    path: Union[str, None] = None  # parquet/jsonl file, folder or URI; text folder (default: Python's stdlib)
    """`text`: folder (default: this Python's standard library sources); `parquet`, `jsonl`, `hf_dataset`
    (required): a folder/file or a pyarrow filesystem URI (`s3://...`, `gs://...`); a folder's `.jsonl` or
    `.parquet` files are read recursively, sorted; an `hf_dataset` folder's files in the order its `state.json`
    lists them (a `DatasetDict` folder: its `train` split)."""
    format: str = "text"
    """Records of `jsonl`, `hf_dataset` and `parquet` with an `lm` model: `text` (every token trained on),
    `prompt_completion` (the loss counts only the completion and its EOS), `chat` (`messages` rendered by the
    tokenizer's chat template; the loss counts only the assistant turns), `alpaca` (`instruction`, optional
    `input` and `system`, `output`: chat messages as LLaMA-Factory makes them; the loss counts only the output's
    turn), `sharegpt` (`conversations` of `from`/`value`, `from` human/gpt/system or user/assistant; the loss
    counts only the gpt turns). Documents end with EOS and are packed into windows of `data.seq_len + 1`
    tokens; how they are counted, kept and read: [data.md](data.md#jsonl-and-tokenized-text). `preference`
    (`jsonl` only; with `train.objective: dpo`, and only with it): pairs for preference tuning,
    `{prompt, chosen, rejected}` as strings or as message lists (chat template), one pair per row of
    `data.seq_len + 1` tokens per side, never packed; the loss counts only the responses; see
    [preference.md](preference.md#data)."""
    tokenizer: Union[str, None] = None
    """`text`, and records (`jsonl`, `hf_dataset`, `parquet` with an `lm` model): a local Hugging Face
    tokenizer folder (never downloaded). Default: the model family's own (an `hf` model's directory); a family
    without one (`gpt`, user builders) reads `text` as bytes and needs it set for records. Checked before Ray:
    it loads, has a chat template for `chat`, `alpaca` and `sharegpt`, and has no more tokens than the model's
    embeddings where the family knows them."""
    text_field: str = "text"  # record field (or column) names, per format
    """`text` format: the field (a table's column) holding the text."""
    prompt_field: str = "prompt"
    """`prompt_completion` and `preference` formats: the prompt's field."""
    completion_field: str = "completion"
    """`prompt_completion` format: the completion's field."""
    messages_field: str = "messages"
    """`chat` format: the field holding `[{"role": ..., "content": ...}, ...]`."""
    instruction_field: str = "instruction"
    """`alpaca` format: the instruction's field (a string; the user turn)."""
    input_field: str = "input"
    """`alpaca` format: the optional input's field, joined to the instruction by a newline where it is there
    and not empty."""
    output_field: str = "output"
    """`alpaca` format: the output's field (a string; the assistant turn, the one trained on)."""
    system_field: str = "system"
    """`alpaca` format: the optional system prompt's field (a system message where it is not empty)."""
    conversations_field: str = "conversations"
    """`sharegpt` format: the field holding `[{"from": ..., "value": ...}, ...]`."""
    chosen_field: str = "chosen"
    """`preference` format: the preferred response's field (a string, or a list of assistant messages when the
    prompt is a list of messages)."""
    rejected_field: str = "rejected"
    """`preference` format: the dispreferred response's field (the same type as `chosen_field`'s; a record
    whose rejected equals its chosen is an error)."""
    feature_columns: Union[list[str], None] = None  # parquet: input columns (default: all but label)
    """`parquet` (tabular): input columns (default: every column but the label)."""
    label_column: str = "label"
    """`parquet` (tabular): integer class index below 1,000,000 (classification; the model gets one output per index up
    to the largest in `data.path` and `data.val_path`) or finite number (regression); a null label or
    feature is an error naming the file and column."""
    val_path: Union[str, None] = None  # parquet: separate validation data (else val_fraction)
    """Tabular `parquet` only (another source refuses it): separate validation data: validation is every row of it and
    training every row of `data.path` (`val_fraction` is not used); otherwise `val_fraction` is held out."""
    val_fraction: float = 0.05  # held out by a hash of each sample's file and place (data/sources.py)
    """Share of samples held out for validation, chosen by a hash (the same at every world size) of the file's
    path under `data.path` and the sample's place in it; see [data.md](data.md#the-validation-split)."""
    num_samples: int = 4096  # synthetic
    """`synthetic`: rows (at most 100,000,000)."""
    num_features: int = 16  # synthetic tabular
    """`synthetic`: tabular features."""
    num_classes: int = 4  # synthetic classification
    """`synthetic`: classes."""
    seed: int = 0  # synthetic generator
    """`synthetic`: generator seed (0 to 2**32 - 1, as every seed)."""
    glob: str = "**/*.py"  # text: which files under path
    """`text`: which files under the folder, matched against each file's path below it: `*` stays within one
    folder, `**/` is zero or more folders (so `**/*.py` takes the top-level files too), a final `/**` is
    everything below (`sub/*.txt`: the .txt files directly in `sub`)."""
    seq_len: Union[int, None] = None
    """`lm`: tokens of context per sample (each sample holds `seq_len + 1` tokens: targets are the inputs
    shifted by one). Default: the model's context. `gpt`: `block_size`, and may not exceed it; `hf`: the
    model's `max_position_embeddings`, at most 2048, and may not exceed its positions; a user language model
    needs it set."""
    max_files: Union[int, None] = None  # text: use only the first N files (sorted)
    """`text`: use only the first N files (sorted)."""
    prefetch_batches: int = 2
    """Batches each worker prefetches ahead of the step."""
    shuffle_buffer: int = 0  # local shuffle buffer in rows per worker; 0 = source order
    """Local shuffle buffer in rows per worker, for the training split under Ray (validation always keeps
    source order, so every evaluation sees the same samples; the torchrun reader keeps source order); 0
    keeps source order."""
    shuffle_seed: Union[int, None] = None  # default: train.seed
    """Seed of the local shuffle (default: `train.seed`; plus the epoch)."""
    split_across_workers: bool = True
    """Split the training set so each sample goes to one rank per epoch; `false` gives every worker the whole
    set (Ray Train's unsplit datasets), which duplicates samples across ranks: `rtp doctor` flags it."""
    max_read_rows_per_s: Union[float, None] = None  # throttle each read task (simulate slow storage)
    """Throttle each read task to this many rows/s: simulates slow storage (what `rtp doctor`'s data-loading
    check is tested with)."""
    cache_path: Union[str, None] = None
    """`jsonl`, and `text` with a tokenizer: where the tokenized dataset is written (a folder, a shared mount or
    a pyarrow URI such as `s3://bucket/datasets`; default `<run.storage_path>/datasets`). One Ray Data pass
    over the cluster tokenizes and packs the source once; every later run, resume, sweep trial and node reads
    the same windows. It must be writable (checked before Ray starts). See
    [data.md](data.md#tokenized-once-on-the-cluster)."""
    packing: Union[str, None] = None
    """Records (`jsonl`, `hf_dataset`, lm `parquet`): how documents fill the windows of `data.seq_len + 1`
    tokens. `documents`: whole documents,
    best-fit packed, each apart (its positions start at 0 and it attends only to itself, through position ids
    that transformers turns into a block-causal mask); the rest of a window is padding (loss mask 0); a
    document longer than a window is truncated, and `rtp validate` says how many. `concat`: one stream cut
    into windows (a document may span two and attends to those before it). Default: `documents` for
    every format but `text` where the model is shown to keep packed documents apart (`hf` architectures
    but OPT; user models whose forward takes `position_ids`), else `concat`. Not with `parallel.pp_size > 1`.
    `preference` pairs are never packed (one pair per row): `documents` is refused, `concat` has no effect.
    See [data.md](data.md#packing-documents-or-one-stream)."""
    sources: Union[list[dict], None] = None
    """A weighted mixture, in place of `data.path`: a list of entries `{path, weight, source, format,
    text_field, prompt_field, completion_field, messages_field}`, each a source read by its own rules. `path`
    is required; `weight` is a number > 0 (default 1); the others default to the `data` keys of the same
    names (`source`: `jsonl`, `text`, `hf_dataset` or `parquet`). Each epoch draws from the sources in proportion to their weights,
    the same sequence every epoch, until every window of every source has been drawn (a small source is
    cycled); sample ids say the source; validation is each source's own split, in order, unweighted. At most
    256 entries. See [data.md](data.md#mixtures)."""

    _ALLOWED: ClassVar[dict[str, str]] = {
        "batch_size": "an integer >= 1, or 'auto' (with train.global_batch_size)",
        "sources": "a list of mappings {path, weight, ...} (a mixture), or null"}

    _SOURCES: ClassVar[tuple[str, ...]] = ("parquet", "synthetic", "text", "jsonl", "hf_dataset")
    # Sources of records in data.format (parquet's with an lm model only: JobConfig checks it).
    RECORD_SOURCES: ClassVar[tuple[str, ...]] = ("jsonl", "hf_dataset", "parquet")
    _FORMATS: ClassVar[tuple[str, ...]] = ("text", "prompt_completion", "chat", "alpaca", "sharegpt",
                                           "preference")  # data/encode.py, data/preference.py
    _FIELDS: ClassVar[tuple[str, ...]] = ("text_field", "prompt_field", "completion_field", "messages_field",
                                          "instruction_field", "input_field", "output_field", "system_field",
                                          "conversations_field", "chosen_field", "rejected_field")
    MIX_SOURCES: ClassVar[tuple[str, ...]] = ("jsonl", "text", "hf_dataset", "parquet")  # tokenized: data/mixture.py
    _ENTRY_KEYS: ClassVar[tuple[str, ...]] = ("path", "weight", "source", "format", *_FIELDS)

    def __post_init__(self) -> None:
        check_field(self.source in self._SOURCES, "data.source", self.source, f"one of {list(self._SOURCES)}")
        check_field(self.format in self._FORMATS, "data.format", self.format, f"one of {list(self._FORMATS)}")
        check_field(self.format == "text" or self.source in self.RECORD_SOURCES, "data.format", self.format,
               f"'text' for data.source {self.source} (the other formats are records of "
               f"{', '.join(self.RECORD_SOURCES)})")
        check_field(self.format != "preference" or self.source == "jsonl", "data.format", self.format,
               f"not preference for data.source {self.source} (preference pairs are read from jsonl)")
        if self.tokenizer is not None:
            check_field(self.source in ("text", *self.RECORD_SOURCES), "data.tokenizer", self.tokenizer,
                   f"null for data.source {self.source} (a tokenizer reads text and records)")
            check_field(bool(self.tokenizer), "data.tokenizer", self.tokenizer, "a tokenizer folder, or null")
        for name in self._FIELDS:
            check_field(bool(getattr(self, name)), f"data.{name}", getattr(self, name), "a JSON field name")
        check_field(self.source != "jsonl" or bool(self.path) or self.sources is not None, "data.path", self.path,
               "a .jsonl file, a folder of them or a URI when data.source is jsonl")
        check_field(self.source != "hf_dataset" or bool(self.path) or self.sources is not None, "data.path", self.path,
               "a datasets save_to_disk folder, .arrow files or a URI when data.source is hf_dataset")
        check_field(self.batch_size == "auto" or (isinstance(self.batch_size, int) and self.batch_size >= 1),
               "data.batch_size", self.batch_size, self._ALLOWED["batch_size"])
        check_field(self.cache_path is None or bool(self.cache_path), "data.cache_path", self.cache_path,
               "a folder or pyarrow URI, or null (<run.storage_path>/datasets)")
        check_field(self.source != "parquet" or bool(self.path) or self.sources is not None, "data.path", self.path,
               "a folder or URI of Parquet files when data.source is parquet")
        check_field(self.val_path is None or self.source == "parquet", "data.val_path", self.val_path,
               f"null for data.source {self.source} (a separate validation path is read for parquet; "
               "the other sources hold out data.val_fraction)")
        check_field(0.0 <= self.val_fraction < 1.0, "data.val_fraction", self.val_fraction,
               "a number in [0, 1)")
        check_field(1 <= self.num_samples <= MAX_SYNTHETIC, "data.num_samples", self.num_samples,
               f"an integer from 1 to {MAX_SYNTHETIC:,} (synthetic data: its sample ids are held in memory)")
        check_field(self.num_features >= 1, "data.num_features", self.num_features, "an integer >= 1")
        check_field(self.num_classes >= 2, "data.num_classes", self.num_classes, "an integer >= 2")
        check_field(self.max_files is None or self.max_files >= 1, "data.max_files", self.max_files,
               "an integer >= 1 or null")
        check_field(self.seq_len is None or self.seq_len >= 1, "data.seq_len", self.seq_len,
               "an integer >= 1 or null (the model's context)")
        for name in ("seed", "shuffle_seed"):
            value = getattr(self, name)
            check_field(value is None or 0 <= value < SEED_LIMIT, f"data.{name}", value, SEED_ALLOWED)
        check_field(self.prefetch_batches >= 0, "data.prefetch_batches", self.prefetch_batches,
               "an integer >= 0")
        check_field(self.shuffle_buffer >= 0, "data.shuffle_buffer", self.shuffle_buffer,
               "an integer >= 0 (0 = no shuffle)")
        check_field(self.max_read_rows_per_s is None or self.max_read_rows_per_s > 0,
               "data.max_read_rows_per_s", self.max_read_rows_per_s, "a number > 0 or null (no limit)")
        check_field(self.packing in (None, "documents", "concat"), "data.packing", self.packing,
               "documents, concat, or null (documents for jsonl prompt_completion and chat)")
        check_field(self.packing != "documents" or self.source in self.RECORD_SOURCES, "data.packing",
               self.packing, f"concat for data.source {self.source} (documents packs records of "
               f"{', '.join(self.RECORD_SOURCES)})")
        check_field(self.packing != "documents" or self.format != "preference", "data.packing", self.packing,
               "null or concat for data.format preference (one pair per row, never packed)")
        check_field(self.feature_columns is None or len(self.feature_columns) > 0,
               "data.feature_columns", self.feature_columns, "a non-empty list of column names or null")
        self._check_sources()

    def _check_sources(self) -> None:
        """`sources`: no `path` beside it, 1 to `MAX_MIX_SOURCES` entries, each valid by its own source's rules."""
        if self.sources is None:
            return
        check_field(self.path is None, "data.path", self.path, "null when data.sources is set (each entry has a path)")
        check_field(1 <= len(self.sources) <= MAX_MIX_SOURCES, "data.sources",
                    f"{len(self.sources)} entries" if self.sources else self.sources,
                    f"a list of 1 to {MAX_MIX_SOURCES} entries, or null")
        check_field(self.source in self.MIX_SOURCES, "data.source", self.source,
                    f"one of {list(self.MIX_SOURCES)} with data.sources (the source its entries default to)")
        for index, entry in enumerate(self.source_entries()):  # a mixture draws windows; pairs are not
            check_field(entry.data.format != "preference", f"data.sources[{index}].format", entry.data.format,
                        "a format of documents, not preference (preference pairs are read from data.path alone)")

    def source_entries(self) -> list["SourceEntry"]:
        """Every entry of `sources` (`source_entry`), in order; empty without a mixture."""
        return [self.source_entry(index) for index in range(len(self.sources or []))]

    def source_entry(self, index: int) -> "SourceEntry":
        """Entry `index` of `sources`: its weight, and its source's own config (this one, with the entry's
        keys and no `sources`), checked by that source's rules; a bad key is one line naming the entry.

        >>> d = DataConfig(source="jsonl", batch_size=8, sources=[{"path": "a.jsonl", "weight": 3}])
        >>> d.source_entry(0).weight, d.source_entry(0).data.path
        (3.0, 'a.jsonl')
        """
        entry, where = (self.sources or [])[index], f"data.sources[{index}]"
        for key, value in entry.items():
            check_field(key in self._ENTRY_KEYS, f"{where}.{key}", value,
                        f"no such key; an entry's keys are {list(self._ENTRY_KEYS)}")
            check_field(key == "weight" or (isinstance(value, str) and bool(value)), f"{where}.{key}", value,
                        "a non-empty string")
        check_field("path" in entry, f"{where}.path", None, "a file, folder or URI (required)")
        weight = entry.get("weight", 1)
        check_field(isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < float("inf"),
                    f"{where}.weight", weight, "a number > 0")
        check_field(entry.get("source", self.source) in self.MIX_SOURCES, f"{where}.source", entry.get("source"),
                    f"one of {list(self.MIX_SOURCES)} (a tokenized source)")
        try:
            data = dataclasses.replace(self, sources=None, **{k: v for k, v in entry.items() if k != "weight"})
        except ConfigError as exc:  # the source's own rule, said of the entry
            key = exc.field.removeprefix("data.")
            field_ = f"{where}.{key}" if key in self._ENTRY_KEYS else f"{exc.field} (for {where})"
            raise ConfigError(field_, exc.value, exc.allowed) from None
        return SourceEntry(float(weight), data)

    @property
    def micro_batch(self) -> int:
        """``batch_size`` as the number a run uses: ``auto`` is decided before Ray starts
        (resolve_job, plan/auto.py), so a resolved job's config always has one.

        >>> DataConfig(source="synthetic", batch_size=8).micro_batch
        8
        """
        if isinstance(self.batch_size, int):
            return self.batch_size
        raise ConfigError("data.batch_size", self.batch_size,
                          "a number here: 'auto' is decided when the job is resolved (rtp validate, rtp train)")

    @property
    def resolved_packing(self) -> str:
        """``packing``, or where unset the format's default: documents for records of
        every format but text, concat otherwise (resolve_job sets it to concat for a
        model that takes no position ids; preference pairs are never packed, whatever it says).

        >>> DataConfig(source="jsonl", path="d", format="chat", batch_size=8).resolved_packing
        'documents'
        """
        if self.packing is not None:
            return self.packing
        return "documents" if self.source in self.RECORD_SOURCES and self.format not in ("text", "preference") \
            else "concat"

    def reads_records(self, model: ModelConfig) -> bool:
        """Whether the source is records of ``format`` (jsonl, hf_dataset, and parquet
        for an lm model; tabular parquet is not)."""
        return self.source in self.RECORD_SOURCES and (self.source != "parquet" or model.task == "lm")

    def tokenizer_for(self, model: ModelConfig) -> str | None:
        """The tokenizer folder text and records are read with: ``data.tokenizer``, else the
        model family's own (an hf model's directory); None: text is read as bytes."""
        if self.source != "text" and not self.reads_records(model):
            return None
        return self.tokenizer or get_family(model.name).default_tokenizer(model.kwargs)

    def cache_root(self, storage_path: str) -> str:
        """Where tokenized datasets are written: ``cache_path``, else ``<storage_path>/datasets``
        (local paths absolute: Ray's processes start elsewhere).

        >>> DataConfig(source="jsonl", path="d", batch_size=8, cache_path="s3://b/ds").cache_root("/runs")
        's3://b/ds'
        >>> DataConfig(source="jsonl", path="d", batch_size=8).cache_root("/runs")
        '/runs/datasets'
        """
        root = self.cache_path or storage_path.rstrip("/") + "/datasets"
        return root if "://" in root else os.path.abspath(os.path.expanduser(root))


@dataclass
class DpoConfig:
    """`train.dpo`: preference tuning (`train.objective: dpo`); the losses as TRL defines them
    (models/preference.py). See [preference.md](preference.md)."""

    SECTION: ClassVar[str] = "train.dpo"
    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are `beta` x (policy - reference)
    log-probs of a response; for `ipo`, the regularization `tau` of the IPO paper. A number > 0."""
    loss: str = "sigmoid"
    """`sigmoid` (DPO), `ipo` (squared loss on the length-normalized log-ratio margin) or `hinge` (SLiC), as
    TRL's `DPOTrainer` computes them."""
    label_smoothing: float = 0.0
    """Conservative DPO (`loss: sigmoid` only): the share of preference labels assumed flipped, in [0, 0.5)."""
    reference: str = "auto"
    """The frozen reference model. `auto`: the policy's own starting weights (the pretrained files or the
    seed's initialization): a frozen copy sharded like the policy, or with `model.lora` the same model with
    its adapters switched off (no second copy). A path: a Hugging Face model folder (`hf` models) with the
    same vocabulary, built and sharded like the policy."""
    precompute_reference: bool = False
    """One pass before training scores every pair with the reference and keeps the log-probs with the
    tokenized data (found again by reruns, resumes and sweep trials): no reference model is held while
    training. See [preference.md](preference.md#precomputed-reference-log-probs)."""

    _LOSSES: ClassVar[tuple[str, ...]] = ("sigmoid", "ipo", "hinge")

    def __post_init__(self) -> None:
        check_field(self.beta > 0, "train.dpo.beta", self.beta, "a number > 0")
        check_field(self.loss in self._LOSSES, "train.dpo.loss", self.loss, f"one of {list(self._LOSSES)}")
        check_field(0.0 <= self.label_smoothing < 0.5, "train.dpo.label_smoothing", self.label_smoothing,
                    "a number in [0, 0.5)")
        check_field(self.label_smoothing == 0.0 or self.loss == "sigmoid", "train.dpo.label_smoothing",
                    self.label_smoothing, f"0 for train.dpo.loss {self.loss} (label smoothing is sigmoid's)")
        check_field(bool(self.reference.strip()), "train.dpo.reference", self.reference,
                    "'auto' or a Hugging Face model folder")
        if self.reference != "auto":
            self.reference = os.path.abspath(os.path.expanduser(self.reference))  # workers: another cwd


@dataclass
class TrainConfig:
    SECTION: ClassVar[str] = "train"
    max_steps: Union[int, None] = None  # optimizer steps; stops at whichever of these comes first
    """Optimizer steps; the run stops at whichever of `max_steps` and `epochs` comes first (at least one is
    required)."""
    epochs: Union[int, None] = None
    """Passes over the training split."""
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    """Micro-steps per optimizer step; the gradient sync runs only on the last one (derived when
    `data.batch_size` is `auto`)."""
    global_batch_size: Union[int, None] = None  # with data.batch_size auto: samples per optimizer step
    """Samples per optimizer step over all replicas; required with `data.batch_size: auto`, otherwise optional
    and must equal `batch_size x grad_accum_steps x data-parallel workers`."""
    lr: float = 1e-3
    """Peak learning rate."""
    optimizer: str = "adamw"  # adamw | sgd
    """`adamw` (the fused single-kernel AdamW on CPU and CUDA, DTensors included) or `sgd` (multi-tensor)."""
    weight_decay: float = 0.0
    """On matrices only (not biases and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    momentum: float = 0.9  # sgd
    """SGD momentum."""
    lr_schedule: str = "cosine"  # cosine | constant (both after warmup)
    """`cosine` (down to `min_lr_ratio` x lr) or `constant`, both after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    """Cosine floor as a fraction of `lr`."""
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    """Max global gradient norm; 0 = off."""
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    """`fp32` or `bf16` (autocast)."""
    seed: int = 0
    """Weights, dropout and shuffling; the same config twice gives the same losses (0 to 2**32 - 1)."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: `stop` (exit 1 at that step, one line naming it and the
    newest checkpoint whose loss was finite) or `skip_step` (no update; counted as `nonfinite_skips` in the
    metrics). See [clusters.md](clusters.md#diverged-runs-keep-their-good-checkpoints)."""
    max_nonfinite_skips: int = 10
    """`skip_step`: more skipped steps than this in a row stop the run as `stop` does."""
    logits: str = "counted"
    """Language models on instruction data (a loss mask): `counted` runs the output head, the fp32 cast and the
    cross-entropy on the tokens the loss counts only (the same loss and gradients, less compute and
    activation memory where the head is a large share of the weight matmuls; see
    [hf.md](hf.md#the-head-on-counted-tokens)); `all` on every position, as Hugging Face's own loss does.
    Without a loss mask every token counts and both are the same. `hf` models (and `gpt`'s head; a pipeline
    stage, or a head whose input is a sequence shard, runs every position); a model whose forward reshapes
    its head's output is refused at the first step, naming `all`."""

    objective: str = "sft"
    """`sft`: next-token cross-entropy on the counted tokens (pretraining, instruction tuning). `dpo`:
    preference tuning on pairs of a chosen and a rejected response (`lm` models, not with
    `parallel.pp_size > 1`), set in `train.dpo`; see [preference.md](preference.md)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Preference tuning, read with `train.objective: dpo`: the keys below."""

    _ON_NONFINITE: ClassVar[tuple[str, ...]] = ("stop", "skip_step")
    _OBJECTIVES: ClassVar[tuple[str, ...]] = ("sft", "dpo")
    _LOGITS: ClassVar[tuple[str, ...]] = ("counted", "all")

    def __post_init__(self) -> None:
        check_field(self.max_steps is not None or self.epochs is not None, "train.max_steps",
               self.max_steps, "an integer >= 1 (or set train.epochs)")
        check_field(self.max_steps is None or self.max_steps >= 1, "train.max_steps", self.max_steps,
               "an integer >= 1 or null")
        check_field(self.epochs is None or self.epochs >= 1, "train.epochs", self.epochs,
               "an integer >= 1 or null")
        check_field(self.grad_accum_steps >= 1, "train.grad_accum_steps", self.grad_accum_steps,
               "an integer >= 1")
        check_field(self.global_batch_size is None or self.global_batch_size >= 1, "train.global_batch_size",
               self.global_batch_size, "an integer >= 1 or null")
        check_field(self.lr > 0, "train.lr", self.lr, "a number > 0")
        check_field(0 <= self.seed < SEED_LIMIT, "train.seed", self.seed, SEED_ALLOWED)
        check_field(self.optimizer in ("adamw", "sgd"), "train.optimizer", self.optimizer,
               "one of ['adamw', 'sgd']")
        check_field(self.logits in self._LOGITS, "train.logits", self.logits, f"one of {list(self._LOGITS)}")
        check_field(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "a number >= 0")
        check_field(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas",
               self.betas, "two numbers in [0, 1)")
        check_field(0 <= self.momentum < 1, "train.momentum", self.momentum, "a number in [0, 1)")
        check_field(self.lr_schedule in ("cosine", "constant"), "train.lr_schedule", self.lr_schedule,
               "one of ['cosine', 'constant']")
        check_field(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "an integer >= 0")
        check_field(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio,
               "a number in [0, 1]")
        check_field(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "a number >= 0 (0 = off)")
        check_field(self.precision in ("fp32", "bf16"), "train.precision", self.precision,
               "one of ['fp32', 'bf16']")
        check_field(self.on_nonfinite in self._ON_NONFINITE, "train.on_nonfinite", self.on_nonfinite,
               f"one of {list(self._ON_NONFINITE)}")
        check_field(self.max_nonfinite_skips >= 1, "train.max_nonfinite_skips", self.max_nonfinite_skips,
               "an integer >= 1 (consecutive skipped steps before the run stops)")
        check_field(self.objective in self._OBJECTIVES, "train.objective", self.objective,
                    f"one of {list(self._OBJECTIVES)}")


@dataclass
class ParallelConfig:
    SECTION: ClassVar[str] = "parallel"
    strategy: str = "none"
    """`none` (exactly 1 worker), `ddp`, `fsdp`, or `auto` (the decision guide picks, for the cluster it runs
    on: see [plan-and-doctor.md](plan-and-doctor.md#let-the-plan-decide-auto)); an unknown name lists the
    known ones."""
    ddp_bucket_cap_mb: float = 25.0
    """DDP gradient bucket size."""
    find_unused_parameters: bool = False
    """DDP: for models whose forward skips parameters."""
    # FSDP only (parallel/fsdp.py). mixed_precision and cpu_offload need GPUs: rejected on CPU.
    mixed_precision: bool = False  # bf16 parameters in forward/backward, fp32 gradient reduction
    """FSDP on GPU: bf16 parameters, fp32 gradient reduction."""
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3)
    """FSDP: free gathered parameters after forward (ZeRO-3); false keeps them until backward (ZeRO-2-like,
    more memory, less communication)."""
    cpu_offload: bool = False  # sharded parameters, gradients, optimizer state in host memory
    """FSDP on GPU: keep sharded parameters, gradients and optimizer state in host memory."""
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    """Recompute each block's activations in backward; any model with repeated blocks (`gpt`, `hf`, user
    models; not `mlp`), on every layout: `none`, `ddp`, `fsdp`, TP (x FSDP) and pipeline stages; with
    `parallel.compile`, inside each compiled block's graph."""
    compile: bool = False  # torch.compile each repeated block (parallel/compile.py)
    """`torch.compile` (TorchInductor) each repeated block in place, after TP shards it and before DDP/FSDP
    wrap it; any model with repeated blocks, on every layout. The first step compiles; a CPU worker needs a
    C++ compiler (`$CXX`, else `g++`), a GPU worker Triton. See
    [parallelism.md](parallelism.md#compiled-blocks-parallelcompile)."""
    # Model parallelism (gpt, hf; parallel/dims.py): data-parallel size = num_workers / (tp x pp).
    tp_size: int = 1  # tensor-parallel ranks per model replica (heads split across them)
    """`gpt`, or an `hf` architecture whose transformers config has a `base_model_tp_plan` (not gpt2, opt):
    tensor-parallel ranks per model replica (must divide the heads, and the kv heads). The data-parallel size
    is `scaling.num_workers / (tp_size x pp_size)`; `strategy` is the data-parallel layer over it (`fsdp` for
    TP x FSDP)."""
    pp_size: int = 1  # pipeline-parallel ranks (stages) per model replica
    """`gpt`, or an `hf` architecture with a `base_model_pp_plan` whose stages are shown to give transformers'
    logits (`PIPELINE_TYPES` in models/hf_pipeline.py), tied embeddings included: pipeline stages (ranks) per
    model replica; `strategy: ddp` or `fsdp` on top gives PP x DP; with `tp_size` > 1
    too, each stage is tensor parallel (TP x PP, and `fsdp` on top for 3-D)."""
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    """`gpipe`, `1f1b`, `interleaved_1f1b` (2 stages per rank)."""
    pp_microbatches: Union[int, None] = None  # pipeline chunks per micro-batch; default pp_size
    """Pipeline chunks each micro-batch is cut into (default: `pp_size`); divides `data.batch_size`, at least
    `pp_size` for the 1F1B schedules, and a multiple of `pp_size` for `interleaved_1f1b`."""
    pp_split: Union[list[int], None] = None  # blocks (decoder layers) per stage; default balanced
    """Blocks per stage, e.g. `[1, 3]` (default: balanced); one entry per stage (2 x `pp_size` for
    interleaved), summing to `n_layer` (`num_hidden_layers` for `hf`)."""
    sequence_parallel: bool = False  # TP: norms and dropout on sequence shards
    """TP: layer norms and dropout run on sequence shards (activation memory / tp). Refused for `hf` before
    launch (transformers builds its rotary positions from the sequence shard a rank holds)."""

    _FSDP_ONLY: ClassVar[dict[str, bool]] = {
        "mixed_precision": False, "reshard_after_forward": True, "cpu_offload": False}
    # Options that work on the model's repeated blocks, on every layout (parallel/compose.py):
    # field -> (what it does to a block, what the run summary says the blocks are).
    BLOCK_OPTIONS: ClassVar[dict[str, tuple[str, str]]] = {
        "activation_checkpointing": ("checkpoint", "checkpointed"),
        "compile": ("compile", "compiled (TorchInductor, during the first step)")}

    def block_options_set(self) -> list[str]:
        """The `BLOCK_OPTIONS` turned on, as config fields (``parallel.compile``...)."""
        return [f"parallel.{name}" for name in self.BLOCK_OPTIONS if getattr(self, name)]

    def __post_init__(self) -> None:
        check_field(self.strategy in STRATEGIES or self.strategy == "auto", "parallel.strategy",
               self.strategy, f"one of {strategy_names()} or 'auto' (chosen by the plan at launch)")
        check_field(self.ddp_bucket_cap_mb > 0, "parallel.ddp_bucket_cap_mb", self.ddp_bucket_cap_mb,
               "a number > 0")
        for name in ("tp_size", "pp_size"):
            check_field(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "an integer >= 1")
        check_field(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
               f"one of {list(PP_SCHEDULES)}")
        check_field(self.pp_microbatches is None or self.pp_microbatches >= 1, "parallel.pp_microbatches",
               self.pp_microbatches, "an integer >= 1 or null")
        check_field(self.pp_split is None or all(n >= 1 for n in self.pp_split), "parallel.pp_split",
               self.pp_split, "a list of block counts >= 1, or null")
        check_field(self.tp_size > 1 or not self.sequence_parallel, "parallel.sequence_parallel",
               self.sequence_parallel, "false unless parallel.tp_size > 1")
        if self.strategy not in ("fsdp", "auto"):
            for name, default in self._FSDP_ONLY.items():
                check_field(getattr(self, name) == default, f"parallel.{name}", getattr(self, name),
                       f"{str(default).lower()} unless parallel.strategy is 'fsdp'")


@dataclass
class ScalingConfig:
    SECTION: ClassVar[str] = "scaling"
    num_workers: int = 1
    """Training workers (one process each, one GPU each with `use_gpu`); `{min: M, max: N}` for an elastic run
    (stored as `num_workers: N`, `min_workers: M`)."""
    use_gpu: bool = False
    """GPUs and nccl; otherwise CPUs and gloo."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker. Keep `num_workers x cpus_per_worker` at least 0.5 below the cluster's CPUs, or
    Ray Data has none left to read with (rejected up front)."""
    torch_threads: Union[int, None] = None  # intra-op threads per worker; default from CPUs
    """Intra-op threads per worker, 1 to 4,096 (default: `floor(cpus_per_worker)`, at least 1)."""
    memory_budget: Union[str, None] = None  # per CPU worker, for the auto fields, e.g. "4GiB"
    """CPU workers: memory per worker the `auto` fields plan against, e.g. `4GiB` (default: 80% of a node's
    memory shared by its workers); GPUs use the device's memory."""
    min_workers: Union[int, None] = None
    """Elastic: Ray starts with what the cluster has from `min_workers` up to `num_workers`, and restarts
    smaller after a lost node; accumulation keeps the global batch (`grad_accum_steps x num_workers` must
    divide by every count in between). ddp, fsdp or auto, with `tp_size` and `pp_size` 1."""
    placement_strategy: str = "PACK"  # Ray placement group: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    """Ray placement group of the workers: `PACK`, `SPREAD` (one node each where possible), `STRICT_PACK`,
    `STRICT_SPREAD`."""

    _PLACEMENT: ClassVar[tuple[str, ...]] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

    @classmethod
    def normalize(cls, data: dict) -> dict:
        """``num_workers: {min: m, max: M}`` -> ``num_workers: M, min_workers: m``."""
        n = data.get("num_workers")
        if not isinstance(n, dict):
            return data
        check_field(set(n) == {"min", "max"} and all(isinstance(v, int) and not isinstance(v, bool)
                                                 for v in n.values()),
               "scaling.num_workers", n, "an integer >= 1, or {min: M, max: N} with integers (elastic)")
        check_field("min_workers" not in data, "scaling.min_workers", data.get("min_workers"),
               "unset when scaling.num_workers is {min, max}")
        return {**data, "num_workers": n["max"], "min_workers": n["min"]}

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    def __post_init__(self) -> None:
        check_field(self.min_workers is None or 1 <= self.min_workers <= self.num_workers,
               "scaling.min_workers", self.min_workers,
               f"null or an integer from 1 to scaling.num_workers ({self.num_workers})")
        check_field(self.placement_strategy in self._PLACEMENT, "scaling.placement_strategy",
               self.placement_strategy, f"one of {list(self._PLACEMENT)}")
        if self.memory_budget is not None:
            parse_size("scaling.memory_budget", self.memory_budget)
        check_field(self.num_workers >= 1, "scaling.num_workers", self.num_workers, "an integer >= 1")
        check_field(self.cpus_per_worker > 0, "scaling.cpus_per_worker", self.cpus_per_worker,
               "a number > 0")
        check_field(self.torch_threads is None or 1 <= self.torch_threads <= MAX_TORCH_THREADS, "scaling.torch_threads",
               self.torch_threads, f"an integer from 1 to {MAX_TORCH_THREADS} or null")

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_size("scaling.memory_budget", self.memory_budget)


@dataclass
class RunConfig:
    SECTION: ClassVar[str] = "run"
    name: str = _REQUIRED
    """The run directory's name under `storage_path`; the same name again resumes."""
    storage_path: str = "./runs"  # local folder (or shared mount) holding run directories
    """Local folder, shared mount or URI holding run directories; `rtp validate` and `rtp train` check, before
    Ray, that a folder exists or can be created and is writable (a URI: that its pyarrow filesystem
    resolves)."""
    checkpoint_every: int = 50  # optimizer steps between checkpoints; 0 = only at the end
    """Optimizer steps between checkpoints (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept, and always the newest whose loss was finite."""
    max_failures: int = 0  # worker-failure retries (FailureConfig); -1 = unlimited
    """Worker-failure retries from the latest checkpoint (Ray `FailureConfig`); -1 = unlimited."""
    eval_every: int = 50  # optimizer steps between validation passes; 0 = only at the end
    """Optimizer steps between validation passes (and at the end); 0 = only at the end."""
    eval_batches: int = 8  # validation micro-batches per rank per pass
    """Validation micro-batches per data-parallel rank per pass (the ranks of one TP or PP group share them)."""
    log_every: int = 1  # optimizer steps between metric reports
    """Optimizer steps between metric reports (console line, `metrics.jsonl`)."""
    tracking: list[str] = field(default_factory=list)  # any of TRACKERS; none by default
    """Experiment trackers fed at every report: any of `mlflow`, `tensorboard` (see
    [tracking.md](tracking.md))."""
    tracking_uri: Union[str, None] = None
    """MLflow store: `MLFLOW_TRACKING_URI` if set, else `sqlite:///<storage_path>/mlflow.db`; a relative path
    (`mlruns`, `file:./mlruns`, `sqlite:///m.db`) is relative to the directory the driver runs in."""
    experiment: Union[str, None] = None  # MLflow experiment; default "raytrain_platform"
    """MLflow experiment; null = `raytrain_platform`."""
    log_checkpoints: bool = False  # also log the best checkpoint to MLflow (large)
    """Also log the best checkpoint to MLflow (with `mlflow` only; large)."""
    eval_tasks: list[str] = field(default_factory=list)  # lm-evaluation-harness tasks after training
    """lm-evaluation-harness tasks scored at the end of `rtp train` on the final checkpoint (hf models; needs
    the `eval` extra): names of tasks in `eval_include` folders or of lm_eval, or task YAML files; as
    `rtp eval` (see [evaluation.md](evaluation.md)), results in the run's `eval/` folder and trackers."""
    eval_include: list[str] = field(default_factory=list)  # folders of lm_eval task YAML files
    """Folders of lm_eval task YAML files that `eval_tasks` names come from (`rtp eval --include`)."""

    _ALLOWED: ClassVar[dict[str, str]] = {
        "tracking": f"a list of trackers, any of {list(TRACKERS)} (default: none)"}

    @classmethod
    def normalize(cls, data: dict) -> dict:
        """``tracking: mlflow`` (or ``--set run.tracking=mlflow``) -> ``tracking: [mlflow]``;
        ``eval_tasks: a,b`` -> ``[a, b]``."""
        for key in ("eval_tasks", "eval_include"):
            if isinstance(data.get(key), str):
                data = {**data, key: [t.strip() for t in data[key].split(",") if t.strip()]}
        value = data.get("tracking")
        if isinstance(value, str):
            return {**data, "tracking": [value]}
        return {**data, "tracking": []} if "tracking" in data and value is None else data

    def __post_init__(self) -> None:
        check_field(bool(_RUN_NAME.fullmatch(self.name)), "run.name", self.name,
               "1-128 characters of letters, digits, '_', '-', '.' starting with a letter or digit")
        check_field(bool(self.storage_path), "run.storage_path", self.storage_path, "a non-empty path")
        check_field(self.checkpoint_every >= 0, "run.checkpoint_every", self.checkpoint_every,
               "an integer >= 0")
        check_field(self.keep_checkpoints >= 1, "run.keep_checkpoints", self.keep_checkpoints,
               "an integer >= 1")
        check_field(self.max_failures >= -1, "run.max_failures", self.max_failures,
               "an integer >= -1 (-1 = unlimited)")
        check_field(self.eval_every >= 0, "run.eval_every", self.eval_every, "an integer >= 0")
        check_field(self.eval_batches >= 1, "run.eval_batches", self.eval_batches, "an integer >= 1")
        check_field(self.log_every >= 1, "run.log_every", self.log_every, "an integer >= 1")
        self._check_tracking()
        for name in ("eval_tasks", "eval_include"):
            values = getattr(self, name)
            for i, value in enumerate(values):
                check_field(isinstance(value, str) and bool(value.strip()), f"run.{name}[{i}]", value,
                            "a non-empty string" + (" (a task name or task YAML file)" if name == "eval_tasks"
                                                    else " (a folder of task YAML files)"))
        check_field(not self.eval_include or bool(self.eval_tasks), "run.eval_include", self.eval_include,
                    "[] unless run.eval_tasks names tasks")

    def _check_tracking(self) -> None:
        for i, name in enumerate(self.tracking):
            check_field(name in TRACKERS, f"run.tracking[{i}]", name, f"one of {list(TRACKERS)}")
        self.tracking = list(dict.fromkeys(self.tracking))
        for key in ("tracking_uri", "experiment"):
            check_field(getattr(self, key) is None or bool(getattr(self, key).strip()), f"run.{key}",
                   getattr(self, key), "a non-empty string, or null (the default)")
        mlflow = "mlflow" in self.tracking
        check_field(mlflow or not self.log_checkpoints, "run.log_checkpoints", self.log_checkpoints,
               "false unless run.tracking includes mlflow")
        # The default store is a SQLite file in storage_path, which must then be a local path.
        check_field(not mlflow or self.tracking_uri is not None or "://" not in self.storage_path
               or bool(os.environ.get("MLFLOW_TRACKING_URI")), "run.tracking_uri", None,
               f"an MLflow tracking URI when run.storage_path is a URI ({self.storage_path}): "
               "the default SQLite store needs a local storage_path (or set MLFLOW_TRACKING_URI)")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.name)


Section = ModelConfig | DataConfig | TrainConfig | ParallelConfig | ScalingConfig | RunConfig
SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "scaling": ScalingConfig,
    "run": RunConfig,
}
