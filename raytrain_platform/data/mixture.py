"""Weighted mixtures of tokenized sources: which source, and which of its windows, fills
each position of an epoch. Pure numpy; the caller reads the windows (``read``).

Sources ``k = 0..K-1`` have weights ``w_k`` (shares ``p_k = w_k / sum(w)``) and ``n_k``
training windows. An epoch has ``N = max_k ceil(n_k / p_k)`` positions ("all exhausted",
as ``datasets.interleave_datasets(..., stopping_strategy="all_exhausted")``): every window
of every source is drawn at least once, and a source whose share is larger than its size
is cycled, its windows in order, wrapping around. Every epoch is the same sequence.

Positions are cut into chunks of ``chunk_size``. `plan` decides each chunk's count per
source so that at every chunk boundary ``P`` each source's count so far lies between
``floor(p_k P)`` and ``ceil(p_k P)``; inside a chunk the sources' places are a
permutation seeded by ``(seed, chunk)``. A source's windows are drawn in order, so any
range of positions is produced directly (`position_range`): a resumed epoch reads
nothing before its position.

>>> mix = plan([1, 3], [4, 100], chunk_size=8)
>>> mix.positions, mix.counts[0].tolist()  # 134 = ceil(100 / 0.75); 2 and 6 of the first 8
(134, [2, 6])
>>> read = read_arrays([{"sample_id": np.arange(4)}, {"sample_id": np.arange(100)}])
>>> ids = position_range(mix, read, 0, 134)["sample_id"]
>>> np.bincount(source_of(ids)).tolist()  # 33.5 and 100.5 owed: source 0 cycled 8 times, 1 once
[33, 101]
>>> sorted(set(local_id(ids[source_of(ids) == 0]).tolist()))
[0, 1, 2, 3]

Sample ids say the source: ``source << SOURCE_SHIFT | id``, so source 0's ids are its
own and no bit of an existing id is touched (jsonl: ``piece << 32 | window`` with bit 31
for validation; Parquet's ``data.val_path`` rows from ``1 << 62``): at most
`MAX_SOURCES` sources, and `MAX_PIECES` pieces per source.

Validation of a mixture is each source's own validation split (its own rules), in source
order, unweighted: `validation_windows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from raytrain_platform.errors import ConfigError, DataError

__all__ = ["MAX_PIECES", "MAX_SOURCES", "MixturePlan", "Read", "SOURCE_SHIFT", "chunk_sources", "check_pieces",
           "draws", "local_id", "mark_source", "mixture_windows", "plan", "position_range", "read_arrays",
           "source_of", "validation_windows"]

SOURCE_SHIFT = 54  # above jsonl's piece << 32 (pieces < 2**22), below Parquet's val_path bit 62
SOURCE_BITS = 8
MAX_SOURCES = 1 << SOURCE_BITS
MAX_PIECES = 1 << (SOURCE_SHIFT - 32)  # a piece's windows are piece << 32 | window
_SOURCE_MASK = np.int64((MAX_SOURCES - 1) << SOURCE_SHIFT)
SHARE_SCALE = 1 << 30  # weights become integer shares of this: every boundary's count is exact
MAX_POSITIONS = 1 << 31  # share x position stays within int64

# read(source, start, count): windows start .. start + count - 1 of that source's training
# split, 0 <= start and start + count <= its size; arrays with `count` rows each.
Read = Callable[[int, int, int], dict[str, np.ndarray]]


@dataclass(frozen=True)
class MixturePlan:
    """One epoch of a mixture: ``drawn[c, k]`` is how many windows of source ``k`` come
    before chunk ``c`` (the last row: the whole epoch's)."""

    shares: np.ndarray  # int64 (K,): p_k = shares[k] / shares.sum()
    sizes: np.ndarray  # int64 (K,): training windows per source
    chunk_size: int
    seed: int
    drawn: np.ndarray  # int64 (chunks + 1, K)

    @property
    def positions(self) -> int:
        """Windows in one epoch, ``N``."""
        return int(self.drawn[-1].sum())

    @property
    def num_chunks(self) -> int:
        return len(self.drawn) - 1

    @property
    def counts(self) -> np.ndarray:
        """``(chunks, K)``: each chunk's windows per source."""
        return np.diff(self.drawn, axis=0)


def plan(weights: Sequence[float], sizes: Sequence[int], *, chunk_size: int = 256, seed: int = 0) -> MixturePlan:
    """The mixture of sources with these `weights` (> 0) and training `sizes` (windows):
    each chunk's count per source, computed chunk after chunk (time O(chunks x K)).

    >>> plan([0.2, 0.3, 0.5], [10, 10, 10], chunk_size=10).counts.tolist()  # 50 = 10 / 0.2
    [[2, 3, 5], [2, 3, 5], [2, 3, 5], [2, 3, 5], [2, 3, 5]]
    """
    w, n = np.asarray(weights, np.float64), np.asarray(sizes, np.int64)
    if not 1 <= len(w) <= MAX_SOURCES or len(n) != len(w):
        raise ValueError(f"{len(w)} weights and {len(n)} sizes: expected as many, 1 to {MAX_SOURCES}")
    for k, weight in enumerate(w):
        if not (np.isfinite(weight) and weight > 0):
            raise ConfigError(f"data.sources[{k}].weight", float(weight), "a number > 0")
    for k, size in enumerate(n):
        if size < 1:
            raise DataError(f"data.sources[{k}] has no training windows: a mixture draws from every source")
    if chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size}: expected an integer >= 1")
    shares = np.maximum(1, np.rint(w / w.sum() * SHARE_SCALE)).astype(np.int64)
    total = int(shares.sum())
    positions = int(max(-(-int(size) * total // int(share)) for size, share in zip(n, shares)))
    if positions > MAX_POSITIONS:
        raise DataError(f"a mixture epoch of {positions:,} windows: at most {MAX_POSITIONS:,} (a large source "
                        "with a small weight makes the epoch long: raise its weight)")
    chunks = -(-positions // chunk_size)
    drawn = np.zeros((chunks + 1, len(w)), np.int64)
    for c in range(chunks):
        drawn[c + 1] = _next_drawn(drawn[c], shares, total, min((c + 1) * chunk_size, positions))
    return MixturePlan(shares=shares, sizes=n, chunk_size=chunk_size, seed=seed, drawn=drawn)


def _next_drawn(drawn: np.ndarray, shares: np.ndarray, total: int, end: int) -> np.ndarray:
    """Counts per source at position `end`, from those at the previous boundary: each
    source at least ``floor(p_k end)``, the rest given one each to the sources whose next
    window falls due soonest (earliest deadline first, ties by source index), never
    above ``ceil(p_k end)``. Earliest deadline first keeps every later boundary within
    the same bounds (a unit-task schedule with release times and deadlines)."""
    low = shares * end // total
    high = -(-shares * end // total)
    out = np.maximum(drawn, low)
    extra = end - int(out.sum())
    open_ = np.flatnonzero(out < high)
    assert 0 <= extra <= len(open_), (drawn, end, extra)  # EDF's guarantee: never fails
    due = -(-(out[open_] + 1) * total // shares[open_])  # the position by which its next window is owed
    out[open_[np.argsort(due, kind="stable")[:extra]]] += 1
    return out


def chunk_sources(mix: MixturePlan, chunk: int) -> np.ndarray:
    """The source of each position of `chunk`: its counts in a permutation seeded by
    ``(seed, chunk)``."""
    counts = mix.drawn[chunk + 1] - mix.drawn[chunk]
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return np.random.default_rng([mix.seed, chunk]).permutation(labels)


def draws(mix: MixturePlan, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """``(sources, windows)`` of positions ``start .. stop - 1`` of the epoch: each
    position's source and the index of its window in that source's training split.

    >>> draws(plan([1, 1], [2, 3], chunk_size=4), 0, 6)[1].tolist()  # source 0 cycled
    [0, 0, 1, 1, 0, 2]
    """
    if not 0 <= start <= stop <= mix.positions:
        raise ValueError(f"positions [{start}, {stop}): expected 0 <= start <= stop <= {mix.positions}")
    if start == stop:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first, last, size = start // mix.chunk_size, (stop - 1) // mix.chunk_size, mix.chunk_size
    labels = np.concatenate([chunk_sources(mix, c) for c in range(first, last + 1)])
    skip = start - first * size
    sources = labels[skip:skip + stop - start]
    base = mix.drawn[first] + np.bincount(labels[:skip], minlength=len(mix.sizes))
    # each position's rank among its source's positions in the range (a stable sort by source)
    order = np.argsort(sources, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(sources, minlength=len(mix.sizes)))[:-1]])
    rank = np.empty_like(sources)
    rank[order] = np.arange(len(sources)) - starts[sources[order]]
    return sources, (base[sources] + rank) % mix.sizes[sources]


def position_range(mix: MixturePlan, read: Read, start: int, stop: int) -> dict[str, np.ndarray]:
    """The windows at positions ``start .. stop - 1``, in order, their ``sample_id``
    marked with the source (`mark_source`). Each source's windows in the range are
    consecutive (modulo its size): `read` is called once per source, or in pieces where
    they wrap around its end. A source without ``position_ids`` beside one with them
    gets ``0 .. width - 1`` (what a model uses without them)."""
    sources, windows = draws(mix, start, stop)
    parts: dict[int, dict[str, np.ndarray]] = {}
    for k in np.unique(sources).tolist():
        mine = windows[sources == k]
        rows = _read_wrapped(read, k, int(mine[0]), len(mine), int(mix.sizes[k]))
        parts[k] = {**rows, "sample_id": mark_source(rows["sample_id"], k)}
    return _interleave(parts, sources)


def mixture_windows(mix: MixturePlan, read: Read, first_chunk: int = 0,
                    stop_chunk: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The windows of chunks ``first_chunk .. stop_chunk - 1`` (default: to the end of
    the epoch), one dict per chunk, in order (`position_range` of each chunk)."""
    stop_chunk = mix.num_chunks if stop_chunk is None else stop_chunk
    for c in range(first_chunk, stop_chunk):
        yield position_range(mix, read, c * mix.chunk_size, min((c + 1) * mix.chunk_size, mix.positions))


def validation_windows(read: Read, sizes: Sequence[int], *, rows: int = 4096) -> Iterator[dict[str, np.ndarray]]:
    """A mixture's validation split: each source's own (``read`` over validation
    windows, `sizes` of them), whole and in source order, unweighted, ids marked; at most
    `rows` windows per dict.

    >>> read = read_arrays([{"sample_id": np.arange(2)}, {"sample_id": np.arange(3)}])
    >>> [source_of(b["sample_id"]).tolist() for b in validation_windows(read, [2, 3], rows=2)]
    [[0, 0], [1, 1], [1]]
    """
    for k, size in enumerate(sizes):
        for start in range(0, size, rows):
            count = min(rows, size - start)
            got = _checked(read(k, start, count), k, start, count)
            yield {**got, "sample_id": mark_source(got["sample_id"], k)}


def mark_source(ids: np.ndarray, source: int) -> np.ndarray:
    """``source << SOURCE_SHIFT | ids``; an id already using those bits is refused.

    >>> ids = np.array([5, (3 << 32) | (1 << 31)])  # jsonl: piece 3's validation window 0
    >>> (mark_source(ids, 2) == (2 << 54) | ids).all(), source_of(mark_source(ids, 2)).tolist()
    (np.True_, [2, 2])
    """
    if not 0 <= source < MAX_SOURCES:
        raise ValueError(f"source {source}: expected 0 to {MAX_SOURCES - 1}")
    ids = np.asarray(ids, np.int64)
    taken = np.flatnonzero(ids & _SOURCE_MASK)
    if len(taken):
        raise DataError(f"data.sources[{source}]: sample id {int(ids[taken[0]]):#x} uses bits {SOURCE_SHIFT} to "
                        f"{SOURCE_SHIFT + SOURCE_BITS - 1}, which say the source in a mixture: at most "
                        f"{MAX_PIECES:,} pieces (files or file groups) per source")
    return ids | np.int64(source << SOURCE_SHIFT)


def source_of(ids: np.ndarray) -> np.ndarray:
    """The source index of each mixture sample id (0 for an unmarked id)."""
    return (np.asarray(ids, np.int64) & _SOURCE_MASK) >> SOURCE_SHIFT


def local_id(ids: np.ndarray) -> np.ndarray:
    """Mixture sample ids without their source: the ids their source gave them."""
    return np.asarray(ids, np.int64) & ~_SOURCE_MASK


def check_pieces(source: int, pieces: int) -> None:
    """Refuse a source of `MAX_PIECES` or more pieces before reading it (their ids would
    reach the bits that say the source)."""
    if pieces > MAX_PIECES:
        raise DataError(f"data.sources[{source}] has {pieces:,} pieces (files or file groups): at most "
                        f"{MAX_PIECES:,} per source in a mixture")


def read_arrays(sources: Sequence[dict[str, np.ndarray]]) -> Read:
    """A `Read` over windows held in memory: one dict of equally long arrays per source."""
    def read(source: int, start: int, count: int) -> dict[str, np.ndarray]:
        return {key: values[start:start + count] for key, values in sources[source].items()}
    return read


def _read_wrapped(read: Read, source: int, start: int, count: int, size: int) -> dict[str, np.ndarray]:
    """`count` windows of `source` from `start`, wrapping around its end (several
    times when `count` exceeds its size)."""
    pieces = []
    while count:
        take = min(count, size - start)
        pieces.append(_checked(read(source, start, take), source, start, take))
        start, count = 0, count - take
    return pieces[0] if len(pieces) == 1 else {key: np.concatenate([p[key] for p in pieces]) for key in pieces[0]}


def _checked(rows: dict[str, np.ndarray], source: int, start: int, count: int) -> dict[str, np.ndarray]:
    got = {key: len(values) for key, values in rows.items()}
    if "sample_id" not in rows or set(got.values()) != {count}:
        raise ValueError(f"read({source}, {start}, {count}) gave {got}: expected {count} rows of each array, "
                         "sample_id included")
    return rows


def _interleave(parts: dict[int, dict[str, np.ndarray]], sources: np.ndarray) -> dict[str, np.ndarray]:
    """One dict whose row ``i`` is the next unused row of ``parts[sources[i]]``."""
    keys = set().union(*(p.keys() for p in parts.values()))
    widths = {p["position_ids"].shape[1] for p in parts.values() if "position_ids" in p}
    for k, rows in parts.items():
        if "position_ids" not in rows and widths:
            n = len(rows["sample_id"])
            rows["position_ids"] = np.broadcast_to(np.arange(max(widths), dtype=np.int32), (n, max(widths)))
        if set(rows) != keys:
            raise ValueError(f"source {k} gave arrays {sorted(rows)}, another {sorted(keys)}: expected the same")
    out = {}
    for key in sorted(keys):
        first = next(iter(parts.values()))[key]
        dtype = np.result_type(*(p[key].dtype for p in parts.values()))
        out[key] = np.empty((len(sources), *first.shape[1:]), dtype)
        for k, rows in parts.items():
            out[key][sources == k] = rows[key]
    return out
