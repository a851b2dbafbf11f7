"""The token cache: what tokenizing files gave (token sums, and packed windows through
`window_cache`), kept under ``$RTP_CACHE_DIR`` by a key of the files' identity and of
everything their tokens depend on (the tokenizer's files, the library versions, the
tokenizing code, the spec's fields), so a rerun, a resume or a sweep's trial reads it
back instead of tokenizing again. `pieces.py`'s count pass writes it; its read tasks
map the windows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np

from raytrain_platform.data import window_cache
from raytrain_platform.data.encode import _folder_state
from raytrain_platform.data.packing import window_arrays
from raytrain_platform.data.sources import split_mask
from raytrain_platform.errors import DataError
from raytrain_platform.units import parse_size

if TYPE_CHECKING:
    from raytrain_platform.data.jsonl import JsonlSpec

__all__ = ["CACHE_ENV", "MAX_SIZE_ENV", "DEFAULT_MAX_SIZE", "cache_dir", "windows_limit"]


CACHE_ENV = "RTP_CACHE_DIR"
MAX_SIZE_ENV = "RTP_CACHE_MAX_SIZE"
DEFAULT_MAX_SIZE = "20GiB"
# A tokenizer folder is often the model's: its weights do not change the tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                    ".onnx", ".npz")


def cache_dir() -> Path | None:
    """Where token counts and windows are kept (`_TokenCache`): ``$RTP_CACHE_DIR`` (set
    empty: no cache), else ``~/.cache/raytrain_platform``."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value) if value else None
    try:
        return Path.home() / ".cache" / "raytrain_platform"
    except (RuntimeError, KeyError):  # no home directory to be found
        return None


def windows_limit(value: str | None = None, name: str = MAX_SIZE_ENV) -> int:
    """The bytes of kept windows the token cache holds at most: `value`, by default
    ``$RTP_CACHE_MAX_SIZE``, else 20GiB. Least recently used entries beyond it are
    removed. A bad value is a ConfigError naming `name`.

    >>> windows_limit("1.5GB"), windows_limit("")
    (1500000000, 21474836480)
    """
    value = os.environ.get(MAX_SIZE_ENV, "") if value is None else value
    return parse_size(name, value.strip() or DEFAULT_MAX_SIZE)


def _tokenizer_fingerprint(path: str) -> str:
    """Every file of the tokenizer folder (and its additional_chat_templates/) but weights."""
    digest = hashlib.sha256()
    for folder in (path, os.path.join(path, "additional_chat_templates")):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            full = os.path.join(folder, name)
            if not name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(full):
                with open(full, "rb") as f:
                    digest.update(full.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """The code of how records become tokens, splits and kept windows: jsonl.py,
    text_groups.py, pieces.py, encode.py, this module, sources.py, window_cache.py and packing.py."""
    from raytrain_platform.data import encode, jsonl, packing, pieces, sources, text_groups

    modules = (jsonl, text_groups, pieces, encode, sys.modules[__name__], sources, window_cache, packing)
    return hashlib.sha256(b"".join(Path(str(m.__file__)).read_bytes() for m in modules)).hexdigest()


@functools.lru_cache(maxsize=8)
def _shared_key(tokenizer: str, state: tuple) -> dict:
    """What every entry's key holds: the tokenizer's files, the libraries, the code.
    `state` (`_folder_state`) keys the memo: a changed tokenizer file is hashed again."""
    return {"tokenizer": _tokenizer_fingerprint(tokenizer), "code": _code_fingerprint(),
            "libraries": [_version(p) for p in ("transformers", "tokenizers", "jinja2")]}


def _arrays(key: dict) -> tuple[str, ...]:
    """The arrays a windows entry of this key holds (`jsonl._file_key` names a packing
    other than concat)."""
    return window_arrays(key.get("packing", "concat"))


@dataclass(frozen=True)
class _TokenCache:
    """What tokenizing files gave, kept under `root` by a key of the files' identity
    and everything their tokens depend on: `shared` (the tokenizer's files, the library
    versions, this code) and each entry's own part (the spec's fields). Two kinds:
    token sums (``token-counts/``, the driver's count, any seq_len) and packed windows
    (``token-windows/``, `window_cache`, per seq_len and split)."""

    root: Path
    shared: dict
    # Each file's stamp, taken once per cache object (a count pass, a piece's read): a
    # count's sums and both splits' windows are keyed by one look at the file (one stat,
    # or one request for a URI), the look taken before its tokens are read.
    stamps: dict = field(default_factory=dict, compare=False, repr=False)
    # The window entries read or written through this object: `prune` leaves them.
    used: set = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def open(cls, spec: JsonlSpec) -> "_TokenCache | None":
        """None when there is no cache: none configured, or its key cannot be read."""
        root = cache_dir()
        if root is None or not os.path.isdir(spec.tokenizer):
            return None
        try:
            shared = _shared_key(spec.tokenizer, (_folder_state(spec.tokenizer),
                                                  _folder_state(os.path.join(spec.tokenizer,
                                                                             "additional_chat_templates"))))
        except OSError:  # an unreadable file beside the tokenizer's, code without sources
            return None
        return cls(root, shared)

    @staticmethod
    def _stamp(path: str) -> list | None:
        """What identifies the file's content: path, size, modification and change times
        and inode where the file is local (a change time cannot be set back), modification
        time for a URI; None when the filesystem gives no time."""
        try:
            if "://" not in path:
                st = os.stat(path)
                return [path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            from raytrain_platform.data.sources import filesystem

            fs, local = filesystem(path)
            info = fs.get_file_info(local)
        except (OSError, DataError):  # the count itself then says what is wrong
            return None
        return None if info.mtime_ns is None else [path, info.size, info.mtime_ns]

    def _key(self, paths: Iterable[str], key: dict) -> dict | None:
        """The whole key of an entry (as JSON gives it back), None if a file has no stamp."""
        for p in paths:
            if p not in self.stamps:
                self.stamps[p] = self._stamp(p)
        stamps = [self.stamps[p] for p in paths]
        if any(stamp is None for stamp in stamps):
            return None
        return json.loads(json.dumps({**self.shared, **key, "files": stamps}))

    @staticmethod
    def _name(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def _tokens_path(self, paths: Iterable[str], key: dict) -> tuple[Path, dict] | None:
        full = self._key(paths, key)
        return None if full is None else (self.root / "token-counts" / f"{self._name(full)}.json", full)

    def held_tokens(self, paths: Iterable[str], key: dict, sums: int) -> list[int] | None:
        """The `sums` token sums of the files at `paths` kept for this key, or None (none
        kept, a broken entry, a cache that cannot be read)."""
        entry = self._tokens_path(paths, key)
        if entry is None:
            return None
        try:
            tokens = json.loads(entry[0].read_text())["tokens"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if isinstance(tokens, list) and len(tokens) == sums and all(type(t) is int and t >= 0 for t in tokens):
            return tokens
        return None

    def keep_tokens(self, paths: Iterable[str], key: dict, tokens: list[int]) -> None:
        """Keeps those sums (replacing any); a cache that cannot be written is no cache."""
        entry = self._tokens_path(paths, key)
        if entry is None:
            return
        path, full = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps({"key": full, "tokens": tokens}))
            os.replace(tmp, path)
        except OSError:
            pass

    def _windows_entry(self, paths: Iterable[str], key: dict, split: str,
                       seq_len: int) -> tuple[Path, dict] | None:
        full = self._key(paths, {**key, "split": split, "seq_len": seq_len, "windows": window_cache.FORMAT})
        return None if full is None else (self.root / "token-windows" / self._name(full), full)

    def windows(self, paths: Iterable[str], key: dict, split: str, seq_len: int) -> window_cache.Held | None:
        """The `split` windows of the files at `paths` as a complete entry holds them
        (memory-mapped, under a shared lock until closed), or None."""
        entry = self._windows_entry(paths, key, split, seq_len)
        if entry is None:
            return None
        held = window_cache.read(entry[0], entry[1], seq_len, _arrays(key))
        if held is not None:
            self.used.add(entry[0])
        return held

    def window_writer(self, paths: Iterable[str], key: dict, split: str,
                      seq_len: int) -> window_cache.Writer | None:
        """A new entry for those windows, None where it cannot be written (or another
        process is writing it)."""
        entry = self._windows_entry(paths, key, split, seq_len)
        if entry is None:
            return None
        try:
            writer = window_cache.Writer(entry[0], entry[1], seq_len, _arrays(key))
        except OSError:  # BlockingIOError included
            return None
        self.used.add(entry[0])
        return writer

    def prune(self, max_bytes: int, recent_s: float = window_cache.RECENT_S) -> window_cache.Pruned:
        """Evicts the least recently used windows beyond `max_bytes` (`windows_limit`),
        leaving those this object used, those being read and those used within
        `recent_s` seconds."""
        return window_cache.prune(self.root / "token-windows", max_bytes, keep=self.used, recent_s=recent_s)

    def missing_windows(self, paths: list[str], key: dict, spec: JsonlSpec) -> list[str]:
        """With `spec.window_cache`: the splits of those files without a complete entry
        (the count then tokenizes them, though it holds their sums, to keep the windows);
        each one that has one is marked used."""
        missing: list[str] = []
        for split in ("train", "val") if spec.window_cache else ():
            held = self.windows(paths, key, split, spec.seq_len)
            if held is None:
                missing.append(split)
            else:
                held.close()
        return missing


class _CountedWindows:
    """The count pass's windows of one piece, the `splits` its token cache lacks
    (`_TokenCache.missing_windows`), written there as it tokenizes them: the read tasks
    then map them instead of tokenizing again. Nothing without a cache; a split whose
    entry cannot be written is left out."""

    def __init__(self, cache: _TokenCache | None, paths: list[str], key: dict, spec: JsonlSpec,
                 splits: list[str]):
        self.val_fraction = spec.val_fraction
        self.writers: dict[str, window_cache.Writer] = {}
        if cache is None:
            return
        for split in splits:
            writer = cache.window_writer(paths, key, split, spec.seq_len)
            if writer is not None:
                self.writers[split] = writer

    def wants(self, split: str) -> bool:
        return split in self.writers

    def put(self, split: str, chunks: Iterable[dict[str, np.ndarray]]) -> None:
        writer = self.writers.get(split)
        if writer is None:
            return
        for chunk in chunks:
            if not writer.add(chunk):  # dropped (a full disk): pack no more for it
                del self.writers[split]
                return

    def put_by_id(self, chunks: Iterable[dict[str, np.ndarray]]) -> None:
        """Windows of both splits, each to its own by its sample id (text groups)."""
        for chunk in chunks:
            val = split_mask(chunk["sample_id"], self.val_fraction, "val")
            self.put("val", [{k: v[val] for k, v in chunk.items()}])
            self.put("train", [{k: v[~val] for k, v in chunk.items()}])

    def commit(self) -> None:
        for writer in self.writers.values():
            writer.commit()

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
