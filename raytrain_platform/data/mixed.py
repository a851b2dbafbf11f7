"""A mixture's dataset (``data.sources``): each source tokenized by its own pass
(`tokenize_pass.prepare`, its own dataset and key), then a small manifest that names
them, their weights and the seed; its windows are drawn from theirs by `mixture.py`'s
plan, a chunk of positions at a time (numpy and pyarrow only: no Ray, no torch).

The training split of a mixture is one epoch of ``plan.positions`` windows, cut into
pieces of `CHUNKS_PER_PIECE` chunks for the read tasks; its validation split is each
source's own, in source order (a piece per source). Resume skips positions as for any
source: the plan gives any range of positions directly.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Callable, Iterable, Iterator

import numpy as np

from raytrain_platform.data import mixture
from raytrain_platform.data.prepared import Manifest, find_manifest, join, load_manifest, read_range
from raytrain_platform.data.specs import SourceSpec
from raytrain_platform.data.splits import rebatch
from raytrain_platform.data.tokenize_pass import prepare

__all__ = ["CHUNK_SIZE", "CHUNKS_PER_PIECE", "is_mixture", "prepare_mixture", "mixture_pieces", "mixture_windows"]

CHUNK_SIZE = 256  # positions whose sources are permuted together (mixture.py)
CHUNKS_PER_PIECE = 64  # a read task's share of the epoch


def is_mixture(manifest: Manifest) -> bool:
    return "mixture" in manifest.content


def prepare_mixture(spec: SourceSpec, *, on_ray: bool | None, say: Callable[[str], None]) -> Manifest:
    """Every source's dataset (tokenized where no pass has), then the mixture's manifest."""
    parts = [prepare(part, on_ray=on_ray, say=say) for part in spec.parts]
    for k, part in enumerate(parts):
        mixture.check_pieces(k, len(part.content["pieces"]))
    content = {"mixture": [{"dir": p.dir, "weight": w} for p, w in zip(parts, spec.weights)], "seed": spec.seed,
               "chunk_size": CHUNK_SIZE}
    key = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:24]
    assert spec.cache_root, "SourceSpec.from_config sets the cache root of a tokenized source"
    directory = join(spec.cache_root, f"mixture-{key}")
    found = find_manifest(directory)
    if found is None:
        mix = _plan(content)
        windows = {"train": mix.positions, "val": sum(p.windows["val"] for p in parts)}
        Manifest(directory, {**content, "scheme": 1, "windows": windows,
                             "truncated": sum(p.content["truncated"] for p in parts)}).write()
        shares = ", ".join(f"{w / sum(spec.weights):.0%}" for w in spec.weights)
        sizes = ", ".join(f"{p.windows['train']:,}" for p in parts)
        say(f"mixture of {len(parts)} sources ({shares}): {windows['train']:,} training windows per epoch "
            f"(the sources' {sizes}, every one drawn), {windows['val']:,} validation windows: {directory}")
    return load_manifest(directory)


def _plan(content: dict) -> mixture.MixturePlan:
    sizes = [load_manifest(s["dir"]).windows["train"] for s in content["mixture"]]
    return mixture.plan([s["weight"] for s in content["mixture"]], sizes, chunk_size=content["chunk_size"],
                        seed=content["seed"])


@functools.lru_cache(maxsize=8)
def _opened(directory: str) -> tuple[mixture.MixturePlan, list[Manifest]]:
    content = load_manifest(directory).content
    return _plan(content), [load_manifest(s["dir"]) for s in content["mixture"]]


def mixture_pieces(manifest: Manifest, split: str) -> list[int]:
    """The read tasks' pieces: of the training split, groups of chunks; of the
    validation split, each source with validation windows."""
    mix, parts = _opened(manifest.dir)
    if split == "train":
        return list(range(-(-mix.num_chunks // CHUNKS_PER_PIECE)))
    return [k for k, part in enumerate(parts) if part.windows["val"]]


def mixture_windows(manifest: Manifest, piece: int, split: str, rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Piece `piece`'s windows, `rows` at a time, their sample ids marked with the source."""
    mix, parts = _opened(manifest.dir)
    if split == "train":
        def read(k: int, start: int, count: int) -> dict[str, np.ndarray]:
            return read_range(parts[k], "train", start, count)

        first = piece * CHUNKS_PER_PIECE
        chunks = mixture.mixture_windows(mix, read, first, min(first + CHUNKS_PER_PIECE, mix.num_chunks))
        yield from rebatch(_same_arrays(chunks, parts), rows, tail=True)
        return
    size = parts[piece].windows["val"]
    for start in range(0, size, rows):
        got = read_range(parts[piece], "val", start, min(rows, size - start))
        yield from _same_arrays([{**got, "sample_id": mixture.mark_source(got["sample_id"], piece)}], parts)


def _same_arrays(chunks: Iterable[dict[str, np.ndarray]], parts: list[Manifest]) -> Iterator[dict[str, np.ndarray]]:
    """Chunks with the same arrays: where a source is packed by documents beside one
    packed as a stream, the stream's windows get ``position_ids`` 0 to the window's end
    (the positions a model uses without any)."""
    documents = any(p.content["packing"] == "documents" for p in parts)
    for chunk in chunks:
        if documents and "position_ids" not in chunk:
            n, width = chunk["tokens"].shape
            chunk = {**chunk, "position_ids": np.broadcast_to(np.arange(width, dtype=np.int32), (n, width)).copy()}
        yield chunk
