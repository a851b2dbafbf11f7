"""The sources read without a tokenizer (numpy only): text files cut into byte
windows, and synthetic rows generated from a seed.

Text windows are ``file_index << 32 | window_index``, split by the file's name under
``data.path`` and the window's place in it (`splits.split_keys`); synthetic rows are
their index, each row a function of (seed, id) alone.
"""

from __future__ import annotations

import numpy as np

from raytrain_platform.data.specs import SourceSpec
from raytrain_platform.data.splits import default_text_root, split_key, split_keys, split_mask

__all__ = ["text_window_ids", "text_split", "text_windows", "synthetic_rows", "synthetic_ids"]

_SYNTH_CHUNK = 256  # rows generated together from one seeded RNG


def text_window_ids(file_index: int, size: int, seq_len: int) -> np.ndarray:
    n = size // seq_len  # non-overlapping windows; the tail of each file is dropped
    return (np.int64(file_index) << np.int64(32)) | np.arange(n, dtype=np.int64)


def text_split(path: str, size: int, spec: SourceSpec, split: str) -> np.ndarray:
    """Which of the file's windows belong to `split`, by the file's name and their place."""
    n = size // spec.seq_len
    keys = split_keys(split_key(path, spec.path or default_text_root()), np.arange(n))
    return split_mask(keys, spec.val_fraction, split)


def text_windows(file_index: int, path: str, spec: SourceSpec, split: str) -> dict[str, np.ndarray]:
    """One file cut into byte windows of seq_len tokens: tokens (n, seq_len) uint8."""
    raw = np.fromfile(path, dtype=np.uint8)
    n = raw.size // spec.seq_len
    ids = text_window_ids(file_index, raw.size, spec.seq_len)
    keep = text_split(path, raw.size, spec, split)
    tokens = raw[: n * spec.seq_len].reshape(n, spec.seq_len)[keep]
    return spec.throttle({"tokens": tokens, "sample_id": ids[keep]})



# ---------------------------------------------------------------- synthetic


def _synthetic_chunk(chunk: int, spec: SourceSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([spec.seed, chunk])
    if spec.task == "lm":
        # Learnable structure: each token follows from the previous by a fixed random
        # permutation, with 10% of positions replaced by noise.
        perm = np.random.default_rng([spec.seed, 1 << 30]).permutation(256)
        toks = np.empty((_SYNTH_CHUNK, spec.seq_len), dtype=np.uint8)
        toks[:, 0] = rng.integers(0, 256, _SYNTH_CHUNK)
        noise = rng.random((_SYNTH_CHUNK, spec.seq_len)) < 0.1
        rand = rng.integers(0, 256, (_SYNTH_CHUNK, spec.seq_len))
        for t in range(1, spec.seq_len):
            toks[:, t] = np.where(noise[:, t], rand[:, t], perm[toks[:, t - 1]])
        return {"tokens": toks}
    w_rng = np.random.default_rng([spec.seed, 1 << 31])
    x = rng.standard_normal((_SYNTH_CHUNK, spec.num_features)).astype(np.float32)
    if spec.task == "classification":
        w = w_rng.standard_normal((spec.num_features, spec.num_classes))
        return {"x": x, "y": np.argmax(x @ w, axis=1).astype(np.int64)}
    w = w_rng.standard_normal(spec.num_features)
    y = x @ w / np.sqrt(spec.num_features) + 0.1 * rng.standard_normal(_SYNTH_CHUNK)
    return {"x": x, "y": y.astype(np.float32)}


def synthetic_rows(ids: np.ndarray, spec: SourceSpec) -> dict[str, np.ndarray]:
    """Rows for the given ids; each row depends only on (seed, id)."""
    ids = np.asarray(ids, dtype=np.int64)
    parts: dict[str, list[np.ndarray]] = {}
    chunks = ids // _SYNTH_CHUNK
    for chunk in np.unique(chunks):
        rows = _synthetic_chunk(int(chunk), spec)
        sel = ids[chunks == chunk] - chunk * _SYNTH_CHUNK
        for key, value in rows.items():
            parts.setdefault(key, []).append(value[sel])
    out = {k: np.concatenate(v) for k, v in parts.items()}
    out["sample_id"] = ids
    return spec.throttle(out)


def synthetic_ids(spec: SourceSpec, split: str) -> np.ndarray:
    ids = np.arange(spec.num_samples, dtype=np.int64)
    return ids[split_mask(ids, spec.val_fraction, split)]
