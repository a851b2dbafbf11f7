"""The ``data`` section of a job config (config/sections.py lists them all), with a
mixture's entries (``data.sources``)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Union

from raytrain_platform.config.fields import (MAX_MIX_SOURCES, MAX_SYNTHETIC, REQUIRED, SEED_ALLOWED, SEED_LIMIT,
                                             check_field)
from raytrain_platform.config.model_section import ModelConfig
from raytrain_platform.errors import ConfigError
from raytrain_platform.models.registry import get_family

__all__ = ["DataConfig", "SourceEntry"]


class SourceEntry(NamedTuple):
    """One entry of ``data.sources``: its weight, and the config its source is read with."""

    weight: float
    data: "DataConfig"


@dataclass
class DataConfig:
    SECTION: ClassVar[str] = "data"
    source: str = REQUIRED  # parquet | synthetic | text | jsonl | hf_dataset
    """`text` (a folder of text files cut into byte windows of `data.seq_len + 1`, or read through
    `data.tokenizer` when there is one), `jsonl` (instruction or text records, one JSON object per line,
    tokenized and packed; see `data.format`), `hf_dataset` (the same records as the rows of a Hugging Face
    `datasets` folder written by `save_to_disk`, or of `.arrow` files), `parquet` (tabular; with an `lm`
    model, records as rows, as `hf_dataset`), `synthetic` (deterministic generator). See [data.md](data.md)."""
    batch_size: Union[int, str] = REQUIRED  # per-worker micro-batch, or "auto" (train.global_batch_size)
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
