"""The tokenizing pass: a tokenized source's pieces (`pieces.py`) tokenized once and
packed into windows, written as a dataset under the cache root (`prepared.py`).

On Ray (the driver of ``rtp train``, ``rtp sweep``, ``ray job submit``), two Ray Data
stages run over the cluster's CPUs: every block (a byte range of a .jsonl file, a group
of text files) is tokenized by its own task on whichever node has a free CPU, its
documents written to a staging folder beside the dataset; then every piece's blocks are
packed in order by one task per piece, which writes the piece's windows. The driver
hands out block descriptions and receives one small row per block and per piece: it
reads no record, tokenizes nothing, and holds no window. A bad record stops the pass as
soon as the blocks before it are in, with one line naming its file and line.

Without Ray (``rtp validate``, the torchrun core, tests), the same functions run in this
process, block after block, to the same files; torchrun's ranks take turns through a
file lock, and the first writes the dataset the others read.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import sys
import time
import uuid
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from raytrain_platform.data.pieces import (Block, Piece, PiecePacker, Tokenized, error_text, source_pieces,
                                           tokenize_block)
from raytrain_platform.data.prepared import (Manifest, WindowWriter, dataset_dir, dataset_key, find_manifest, join,
                                             load_manifest)
from raytrain_platform.data.specs import SourceSpec, TokenSpec
from raytrain_platform.data.splits import filesystem
from raytrain_platform.errors import DataError

__all__ = ["prepare", "say", "PROGRESS_EVERY_S", "QUIET_S"]

PROGRESS_EVERY_S = 10.0  # a pass says how far it is at most this often
QUIET_S = 5.0  # a pass shorter than this says only what it wrote (or its error)


def say(line: str) -> None:
    """How the pass says what it does: a line on stderr."""
    print(line, file=sys.stderr, flush=True)


def _size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class _Progress:
    """Blocks tokenized so far, said every `PROGRESS_EVERY_S` seconds once the pass has
    taken `QUIET_S` (a short pass says nothing before its summary)."""

    def __init__(self, pieces: list[Piece], where: str, say: Callable[[str], None]):
        self.total = sum(p.size for p in pieces)
        self.blocks = sum(len(p.blocks()) for p in pieces)
        self.where, self.say = where, say
        self.started = time.monotonic()
        self.next = self.started + QUIET_S
        self.done = self.bytes = self.documents = self.tokens = 0
        self.nodes: set[str] = set()
        what = "group(s) of text files" if pieces and pieces[0].kind == "text" else "file(s)"
        self.start_line = f"tokenizing {len(pieces):,} {what} ({_size_text(self.total)}, {self.blocks:,} blocks) {where}"

    def add(self, size: int, documents: int, tokens: int, node: str = "") -> None:
        self.done, self.bytes = self.done + 1, self.bytes + size
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        if node:
            self.nodes.add(node)
        now = time.monotonic()
        if now >= self.next:
            if self.start_line:
                self.say(self.start_line)
                self.start_line = ""
            self.say(f"tokenizing: {self.done:,}/{self.blocks:,} blocks, {_size_text(self.bytes)} of "
                     f"{_size_text(self.total)}, {self.documents:,} documents, {self.tokens:,} tokens "
                     f"({now - self.started:.0f} s)")
            self.next = now + PROGRESS_EVERY_S

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


# ---------------------------------------------------------------- one piece, packed and written


def _pack_piece(piece: Piece, blocks: Iterable[Tokenized], spec: TokenSpec, directory: str,
                attempt: str) -> dict[str, Any]:
    """Packs a piece's tokenized blocks in order and writes its windows per split."""
    packer = PiecePacker(piece, spec, rows=max(1, (1 << 16) // spec.seq_len))
    writers = {s: WindowWriter(join(directory, attempt, s, f"{piece.index:06d}.parquet"), spec.seq_len,
                               spec.packing, pairs=spec.pairs) for s in ("train", "val")}
    try:
        for tokenized in blocks:
            for split, chunk in packer.add(tokenized):
                writers[split].write(chunk)
        for split, chunk in packer.end():
            writers[split].write(chunk)
    finally:
        counts = {s: w.close() for s, w in writers.items()}
    return {"index": piece.index, "paths": list(piece.paths), "train": counts["train"], "val": counts["val"],
            "truncated": packer.truncated, "documents": packer.documents, "tokens": packer.tokens,
            "bytes": sum(w.bytes for w in writers.values())}


# ---------------------------------------------------------------- in this process


def _run_here(spec: SourceSpec, pieces: list[Piece], directory: str, attempt: str,
              say: Callable[[str], None]) -> tuple[list[dict], _Progress]:
    token_spec = spec.token_spec()
    progress = _Progress(pieces, "in this process", say)

    def blocks(piece: Piece) -> Iterator[Tokenized]:
        for block in piece.blocks():
            tokenized = tokenize_block(piece, block, token_spec)
            progress.add(block.length or piece.size, tokenized.documents, tokenized.tokens)
            yield tokenized

    return [_pack_piece(p, blocks(p), token_spec, directory, attempt) for p in pieces], progress


@contextlib.contextmanager
def _turns(directory: str) -> Iterator[None]:
    """Processes of this machine preparing the same dataset take turns (a local root only)."""
    if "://" in directory:
        yield
        return
    import fcntl
    import os

    os.makedirs(os.path.dirname(directory), exist_ok=True)
    with open(directory + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- on Ray


def _staged(staging: str, block: Block) -> str:
    return join(staging, f"{block.piece:06d}-{block.index:06d}.npz")


def _piece_of(batch: dict[str, np.ndarray], i: int) -> Piece:
    return Piece(int(batch["piece"][i]), str(batch["kind"][i]), tuple(json.loads(str(batch["paths"][i]))),
                 int(batch["size"][i]))


def tokenize_blocks(batch: dict[str, np.ndarray], *, spec: TokenSpec, staging: str) -> dict[str, np.ndarray]:
    """Ray Data stage 1: each block of `batch` tokenized, its documents written to `staging`."""
    import ray

    rows: dict[str, list] = {k: [] for k in ("piece", "block", "size", "documents", "tokens", "lines",
                                            "error_line", "error", "node")}
    for i in range(len(batch["piece"])):
        piece = _piece_of(batch, i)
        block = Block(piece.index, int(batch["block"][i]), int(batch["offset"][i]), int(batch["length"][i]))
        tokenized = tokenize_block(piece, block, spec)
        fs, local = filesystem(_staged(staging, block))
        with fs.open_output_stream(local) as f:
            f.write(tokenized.to_bytes())
        line, message = tokenized.error or (-2, "")
        for key, value in (("piece", piece.index), ("block", block.index), ("size", block.length or piece.size),
                           ("documents", tokenized.documents), ("tokens", tokenized.tokens),
                           ("lines", tokenized.lines), ("error_line", line), ("error", message),
                           ("node", ray.get_runtime_context().get_node_id())):
            rows[key].append(value)
    return {k: np.array(v) for k, v in rows.items()}


def pack_pieces(batch: dict[str, np.ndarray], *, spec: TokenSpec, staging: str, directory: str,
                attempt: str) -> dict[str, np.ndarray]:
    """Ray Data stage 2: each piece of `batch` packed from its staged blocks, in order."""
    out: list[dict[str, Any]] = []
    for i in range(len(batch["piece"])):
        piece = _piece_of(batch, i)

        def staged(piece: Piece = piece, blocks: int = int(batch["blocks"][i])) -> Iterator[Tokenized]:
            for index in range(blocks):  # as the driver cut them
                fs, local = filesystem(_staged(staging, Block(piece.index, index)))
                with fs.open_input_stream(local) as f:
                    tokenized = Tokenized.from_bytes(f.read())
                fs.delete_file(local)
                yield tokenized

        out.append(_pack_piece(piece, staged(), spec, directory, attempt))
    return {"entry": np.array([json.dumps(e) for e in out])}


def _items(pieces: list[Piece], *, blocks: bool) -> list[dict]:
    rows = []
    for p in pieces:
        common = {"piece": p.index, "kind": p.kind, "paths": json.dumps(list(p.paths)), "size": p.size}
        if not blocks:
            rows.append({**common, "blocks": len(p.blocks())})
            continue
        rows += [{**common, "block": b.index, "offset": b.offset, "length": b.length} for b in p.blocks()]
    return rows


def _first_error(pieces: list[Piece], errors: dict[tuple[int, int], tuple[int, str]],
                 lines: dict[tuple[int, int], int]) -> str | None:
    """The error of the first bad block whose piece's earlier blocks are all in, with its
    line in the file: the blocks' line counts before it, plus its line in the block."""
    for piece, block in sorted(errors):
        before = [(piece, b) for b in range(block)]
        if all(k in lines for k in before):
            return error_text(pieces[piece], sum(lines[k] for k in before), *errors[(piece, block)])
    return None


@contextlib.contextmanager
def _quiet_ray_data() -> Iterator[None]:
    """Ray Data's own lines (each execution's plan) left out of the driver's output: the
    pass says what it does in its own lines."""
    import logging

    logger = logging.getLogger("ray.data")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _run_on_ray(spec: SourceSpec, pieces: list[Piece], directory: str, attempt: str,
                say: Callable[[str], None]) -> tuple[list[dict], _Progress]:
    token_spec, staging = spec.token_spec(), join(directory, attempt, "staging")
    fs, local = filesystem(staging)
    fs.create_dir(local, recursive=True)
    try:
        with _quiet_ray_data():
            return _stages(token_spec, pieces, directory, attempt, staging, say)
    finally:  # the staged documents go, whatever stopped the pass
        with contextlib.suppress(OSError):
            fs.delete_dir(local)


def _stages(token_spec: TokenSpec, pieces: list[Piece], directory: str, attempt: str, staging: str,
            say: Callable[[str], None]) -> tuple[list[dict], _Progress]:
    """Ray Data's two stages: every block tokenized (the driver streams their rows and
    stops at a bad record), then every piece packed and written."""
    import ray.data

    progress = _Progress(pieces, "on the cluster", say)
    items = _items(pieces, blocks=True)
    blocks = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        functools.partial(tokenize_blocks, spec=token_spec, staging=staging), batch_size=1, batch_format="numpy")
    errors: dict[tuple[int, int], tuple[int, str]] = {}
    lines: dict[tuple[int, int], int] = {}
    for row in blocks.iter_rows():
        key = (int(row["piece"]), int(row["block"]))
        lines[key] = int(row["lines"])
        progress.add(int(row["size"]), int(row["documents"]), int(row["tokens"]), str(row["node"]))
        if int(row["error_line"]) != -2:  # -1: a table's reader named its row
            errors[key] = (int(row["error_line"]), str(row["error"]))
        said = _first_error(pieces, errors, lines) if errors else None
        if said:
            raise DataError(said)
    items = _items(pieces, blocks=False)
    packed = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        functools.partial(pack_pieces, spec=token_spec, staging=staging, directory=directory, attempt=attempt),
        batch_size=1, batch_format="numpy")
    entries = sorted((json.loads(str(row["entry"])) for row in packed.iter_rows()), key=lambda e: e["index"])
    return entries, progress


# ---------------------------------------------------------------- the pass


def _ray_is_up() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def prepare(spec: SourceSpec, *, on_ray: bool | None = None, say: Callable[[str], None] = say) -> Manifest:
    """The tokenized dataset of `spec`: found under its cache root if a pass wrote it,
    else written now, on Ray (`on_ray`; default: when this process is connected) or in
    this process. Says what it wrote (or found) in one line. DataError at a bad record
    (its file and line) or when there is no training window."""
    pieces = source_pieces(spec)
    directory = dataset_dir(spec, dataset_key(spec, pieces))
    found = find_manifest(directory)
    if found is None:
        use_ray = _ray_is_up() if on_ray is None else on_ray
        with contextlib.nullcontext() if use_ray else _turns(directory):
            found = find_manifest(directory)  # another process wrote it meanwhile
            if found is None:
                found = _write(spec, pieces, directory, _run_on_ray if use_ray else _run_here, say)
    else:
        w = found.windows
        rows = "pairs" if spec.token_spec().pairs else "windows"
        say(f"tokenized data: {w['train']:,} train + {w['val']:,} validation {rows}, written before: {directory}")
    if found.windows["train"] == 0:
        raise DataError(f"data.path = {spec.path!r}: no training window of data.seq_len = {spec.seq_len - 1} "
                        "tokens (+1) (too little data, or lower data.seq_len)")
    return found


def _write(spec: SourceSpec, pieces: list[Piece], directory: str, run: Callable, say: Callable[[str], None]) -> Manifest:
    attempt = uuid.uuid4().hex[:12]
    entries, progress = run(spec, pieces, directory, attempt, say)
    t = spec.token_spec()
    total = {k: sum(e[k] for e in entries) for k in ("train", "val", "truncated", "documents", "tokens", "bytes")}
    content = {"scheme": 1, "attempt": attempt, "source": spec.path, "kind": spec.kind, "format": t.format,
               "packing": t.packing, "seq_len": t.seq_len, "val_fraction": t.val_fraction,
               "tokenizer": t.tokenizer, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "windows": {"train": total["train"], "val": total["val"]}, "truncated": total["truncated"],
               "documents": total["documents"], "tokens": total["tokens"], "bytes": total["bytes"],
               "seconds": round(progress.seconds, 3), "nodes": len(progress.nodes) or 1, "pieces": entries}
    manifest = Manifest(directory, content)
    manifest.write()
    load_manifest.cache_clear()  # a process that read an earlier pass's manifest reads this one
    nodes = f" on {len(progress.nodes)} node(s)" if progress.nodes else ""
    docs, rows = ("records", "pairs") if t.pairs else ("documents", "windows")
    say(f"tokenized {total['documents']:,} {docs}, {total['tokens']:,} tokens into {total['train']:,} train + "
        f"{total['val']:,} validation {rows} ({_size_text(total['bytes'])}) in {progress.seconds:.1f} s{nodes}: "
        f"{directory}")
    return manifest
