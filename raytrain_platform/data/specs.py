"""What a reader needs, as plain picklable values shipped to Ray tasks: `SourceSpec`
(a whole source, from the config), `TokenSpec` (what tokenizing and packing depend
on) and `DataInfo` (what the driver knows before training starts). No I/O here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_platform.data.splits import default_text_root
from raytrain_platform.errors import ConfigError

if TYPE_CHECKING:
    from raytrain_platform.config import JobConfig
    from raytrain_platform.config.data_section import DataConfig

__all__ = ["FORMATS", "PACKINGS", "TOKENIZED_KINDS", "RecordFields", "RecordSpec", "record_fields", "SourceSpec",
           "TokenSpec", "DataInfo", "split_by_file"]

FORMATS = ("text", "prompt_completion", "chat", "alpaca", "sharegpt",
           "preference")  # record formats (data/encode.py; pairs: data/preference.py)
PACKINGS = ("documents", "concat")  # how documents fill windows (data/packing.py)
TOKENIZED_KINDS = ("jsonl", "hf_dataset")  # always tokenized (text is with a tokenizer; parquet for lm)


@dataclass(frozen=True, kw_only=True)
class RecordFields:
    """The field names records are read by (``data.*_field``): one list for every spec
    that reads records (keyword-only: they follow a subclass's own fields)."""

    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    system_field: str = "system"
    conversations_field: str = "conversations"
    chosen_field: str = "chosen"  # preference
    rejected_field: str = "rejected"


@dataclass(frozen=True)
class RecordSpec(RecordFields):
    """A record format and the field names it reads (``data.format``, ``data.*_field``):
    all that checking and tokenizing a record needs. Picklable."""

    format: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError("data.format", self.format, f"one of {', '.join(FORMATS)}")

    @property
    def fields(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the fields a record of this format must have, those it may have).

        >>> RecordSpec("alpaca").fields
        (('instruction', 'output'), ('input', 'system'))
        """
        return {"text": ((self.text_field,), ()),
                "prompt_completion": ((self.prompt_field, self.completion_field), ()),
                "chat": ((self.messages_field,), ()),
                "alpaca": ((self.instruction_field, self.output_field), (self.input_field, self.system_field)),
                "sharegpt": ((self.conversations_field,), ()),
                "preference": ((self.prompt_field, self.chosen_field, self.rejected_field), ())}[self.format]


def record_fields(source: object) -> dict[str, Any]:
    """The field names `source` holds (a spec, or the ``data`` config), by name: what
    another spec is made with."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(RecordFields)}


@dataclass(frozen=True)
class TokenSpec(RecordFields):
    """What a tokenized source's windows depend on: its records' format and field
    names, the tokenizer, the window length, the split and the packing."""

    path: str  # the source's root: a .jsonl file or a folder (recursive); local path or URI
    format: str  # one of FORMATS
    tokenizer: str  # local folder of a Hugging Face tokenizer
    seq_len: int  # tokens per window, including the extra target token (context + 1)
    val_fraction: float
    packing: str = "concat"  # documents | concat (`packing.py`); preference: never packed

    @property
    def pairs(self) -> bool:
        """``data.format: preference``: one row per pair (`preference.py`), not windows."""
        return self.format == "preference"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError("data.format", self.format, f"one of {', '.join(FORMATS)}")
        if self.packing not in PACKINGS:
            raise ConfigError("data.packing", self.packing, f"one of {', '.join(PACKINGS)}")
        if not (isinstance(self.seq_len, int) and self.seq_len >= 2):
            raise ConfigError("data.seq_len", self.seq_len, "an integer >= 2 (context + 1)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", self.val_fraction, "a number in [0, 1)")


@dataclass(frozen=True)
class SourceSpec(RecordFields):
    """Everything a reader needs, as plain picklable values (shipped to Ray tasks)."""

    kind: str  # text | synthetic | parquet | jsonl
    task: str  # lm | classification | regression
    val_fraction: float
    seq_len: int = 0  # lm: tokens per sample (data.seq_len + 1)
    path: str | None = None
    val_path: str | None = None
    glob: str = "**/*.py"
    max_files: int | None = None
    num_samples: int = 0
    num_features: int = 0
    num_classes: int = 0
    seed: int = 0
    feature_columns: tuple[str, ...] = ()
    label_column: str = "label"
    max_read_rows_per_s: float | None = None  # a read task sleeps to stay under this rate
    tokenizer: str | None = None  # text, jsonl: a local tokenizer folder (None: text as bytes)
    format: str = "text"  # jsonl: text | prompt_completion | chat
    packing: str = "concat"  # records: documents | concat (`packing.py`)
    cache_root: str | None = None  # tokenized: where the tokenized datasets are written (`prepared.py`)
    prepared: str | None = None  # tokenized: the folder of this source's tokenized dataset, once known
    parts: tuple["SourceSpec", ...] = ()  # a mixture (kind "mixture"): its sources, in order
    weights: tuple[float, ...] = ()  # a mixture: their weights

    @classmethod
    def from_config(cls, cfg: "JobConfig", *, prepared: str | None = None) -> "SourceSpec":
        """The config's source; `prepared`: its tokenized dataset (`DataInfo.prepared`).
        ``data.sources`` makes a mixture (kind ``mixture``): each entry its own spec; the
        mixture's draws are seeded by ``data.shuffle_seed`` (default ``train.seed``)."""
        d = cfg.data
        if d.sources is None:
            return cls._of(cfg, d, prepared)
        entries = d.source_entries()
        seed = d.shuffle_seed if d.shuffle_seed is not None else cfg.train.seed
        return cls(kind="mixture", task=cfg.model.resolved_task, val_fraction=d.val_fraction,
                   seq_len=cls._of(cfg, d, None).seq_len, seed=seed, cache_root=d.cache_root(cfg.run.storage_path),
                   prepared=prepared, parts=tuple(cls._of(cfg, e.data, None) for e in entries),
                   weights=tuple(e.weight for e in entries))

    @classmethod
    def _of(cls, cfg: "JobConfig", d: "DataConfig", prepared: str | None) -> "SourceSpec":
        m, tokens = cfg.model, cfg.seq_len  # tokens: None unless lm (then required)
        seq_len = tokens + 1 if tokens is not None else 0  # + 1: targets are inputs shifted by one
        # The default text root resolved here, on the driver: every process then splits
        # (and reads) the files the driver listed under the same root.
        path = d.path if d.path or d.source != "text" else default_text_root()
        return cls(kind=d.source, task=m.resolved_task, val_fraction=d.val_fraction, seq_len=seq_len,
                   path=path, val_path=d.val_path, glob=d.glob, max_files=d.max_files,
                   num_samples=d.num_samples, num_features=d.num_features,
                   num_classes=d.num_classes, seed=d.seed,
                   feature_columns=tuple(d.feature_columns or ()), label_column=d.label_column,
                   max_read_rows_per_s=d.max_read_rows_per_s, tokenizer=d.tokenizer_for(m),
                   format=d.format, **record_fields(d), packing=d.resolved_packing,
                   cache_root=d.cache_root(cfg.run.storage_path), prepared=prepared)

    @property
    def tokenized(self) -> bool:
        """Records (jsonl, a Hugging Face dataset, Parquet for a language model), or text
        read through a tokenizer: token ids and a loss mask, not bytes or table rows."""
        return self.kind in TOKENIZED_KINDS or self.kind == "mixture" or (
            self.kind in ("text", "parquet") and self.tokenizer is not None)

    def token_spec(self) -> TokenSpec:
        """What tokenizing and packing depend on (a tokenized source only)."""
        assert self.tokenized and self.tokenizer, self
        return TokenSpec(path=self.path or default_text_root(), tokenizer=self.tokenizer,
                         format=self.format if self.kind != "text" else "text",
                         seq_len=self.seq_len, val_fraction=self.val_fraction, **record_fields(self),
                         packing=self.packing if self.kind != "text" else "concat")

    @property
    def pairs(self) -> bool:
        """``data.format: preference`` (jsonl): rows of preference pairs, not windows."""
        return self.kind == "jsonl" and self.format == "preference"

    @property
    def window_packing(self) -> str:
        """How a tokenized source's windows were packed: ``documents`` where they carry
        position ids (a mixture's, where any of its sources' do), else ``concat``."""
        if self.kind == "mixture":
            return "documents" if any(p.window_packing == "documents" for p in self.parts) else "concat"
        return self.token_spec().packing

    def throttle(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sleep as long as reading these rows takes at ``max_read_rows_per_s`` (no-op
        without a limit): slow storage on demand, which `rtp doctor`'s tests rely on."""
        if self.max_read_rows_per_s:
            time.sleep(rows["sample_id"].shape[0] / self.max_read_rows_per_s)
        return rows


def split_by_file(spec: SourceSpec) -> bool:
    """Whether `spec`'s validation split is dealt by `split_keys` (scheme 2): byte-level
    text, Parquet without data.val_path and jsonl, with a validation split at all."""
    by_file = spec.kind in ("jsonl", "hf_dataset") or (spec.kind == "text" and not spec.tokenized) or (
        spec.kind == "parquet" and not spec.val_path)
    return by_file and spec.val_fraction > 0


@dataclass(frozen=True)
class DataInfo:
    """What the driver knows about the data before any training worker starts."""

    num_train: int
    num_val: int
    num_features: int = 0  # tabular
    num_classes: int = 0  # classification
    feature_columns: tuple[str, ...] = ()
    truncated: int = 0  # data.packing documents: documents longer than a window, cut to it
    prepared: str | None = None  # tokenized: the manifest of the tokenized dataset (`prepared.py`)
