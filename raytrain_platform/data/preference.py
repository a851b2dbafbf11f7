"""Preference pairs (``data.format: preference``) as rows of token ids and loss masks
(numpy and a tokenizer only: no Ray, no torch). Pure and deterministic: a record gets
the rows it gets alone, however many records are encoded per tokenizer call.

A record is one JSON object in either of two shapes (field names: `PairSpec`):

* text: ``{"prompt": str, "chosen": str, "rejected": str}``; a response is
  ``[BOS] + prompt + response + EOS``, the prompt and the response tokenized apart
  (as ``prompt_completion`` does, so chosen and rejected share the prompt's ids), and
  EOS is trained on;
* chat: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``,
  ``prompt + chosen`` rendered by the tokenizer's chat template; the loss counts the
  assistant turns of the response (what the template adds after the generation prompt
  that opens each: its content and end-of-turn) and no EOS is added (the template
  closes the turn), as TRL's DPOTrainer does for conversations.

A pair is one row (never packed) of ``row_len = data.seq_len + 1`` tokens per side:
``chosen_tokens``/``rejected_tokens`` int32, ``chosen_mask``/``rejected_mask`` uint8
(``mask[t] = 1``: token ``t`` is a target, predicted from ``tokens[:t]``; only response
tokens are), right-padded with the tokenizer's pad id (`packing.pad_id`), padding mask
0, and a ``sample_id`` int64 the caller chooses.

Too long: the row keeps the start, as TRL's default ``truncation_mode="keep_start"``:
the whole prompt and the response's first tokens (its end, EOS included, is cut);
`encode_pairs` counts such pairs. A prompt that leaves no response token within the row
is a `DataError` naming the record (TRL drops such examples silently).

>>> spec = PairSpec(row_len=129)
>>> check_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, spec)
'text'
>>> check_pair({"prompt": "2+2?", "chosen": "4", "rejected": "4"}, spec)
Traceback (most recent call last):
  ...
raytrain_platform.errors.DataError: 'chosen' equals 'rejected': a preference pair needs two different responses
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from raytrain_platform.data.encode import (RecordError, assistant_spans, bos_ids, check_messages, check_unicode,
                                           render_chat, token_ids)
from raytrain_platform.data.packing import PAIR_ARRAYS, pad_id
from raytrain_platform.errors import DataError

if TYPE_CHECKING:
    from raytrain_platform.data.specs import TokenSpec

__all__ = ["PAIR_ARRAYS", "SIDES", "PairSpec", "pair_spec", "check_pair", "encode_pairs", "empty_pairs"]

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PairSpec:
    """What encoding a pair needs: tokens per row (``data.seq_len + 1``) and the
    record's field names (``data.prompt_field``, ``data.chosen_field``,
    ``data.rejected_field``)."""

    row_len: int
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"

    def __post_init__(self) -> None:
        if not (isinstance(self.row_len, int) and self.row_len >= 2):
            raise ValueError(f"row_len must be an integer >= 2 (data.seq_len + 1), not {self.row_len!r}")

    def field(self, side: str) -> str:
        """The record's field of `side` ("chosen" | "rejected")."""
        return self.chosen_field if side == "chosen" else self.rejected_field


def pair_spec(spec: "TokenSpec") -> PairSpec:
    """What encoding a tokenized source's pairs needs: its rows' length and field names."""
    return PairSpec(row_len=spec.seq_len, prompt_field=spec.prompt_field, chosen_field=spec.chosen_field,
                    rejected_field=spec.rejected_field)


def _type_name(value: Any) -> str:
    return "a list" if isinstance(value, list) else "a string" if isinstance(value, str) else type(value).__name__


def check_pair(record: Any, spec: PairSpec) -> str:
    """The record's shape, "text" or "chat"; a one-line `DataError` (without a
    location: the reader adds ``path:line``) for a record that is not a JSON object,
    lacks a field, mixes shapes, holds no Unicode text, or whose chosen equals its
    rejected."""
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    p, c, r = spec.prompt_field, spec.chosen_field, spec.rejected_field
    for name in (p, c, r):
        if name not in record:
            raise DataError(f"expected a field {name!r} (data.format preference: a prompt, a chosen "
                            "and a rejected response)")
    prompt = record[p]
    if isinstance(prompt, str):
        for name in (p, c, r):
            if not isinstance(record[name], str):
                raise DataError(f"expected {name!r} to be a string like {p!r} (data.format preference, text "
                                f"pairs), got {_type_name(record[name])}")
            check_unicode(record[name], f"field {name!r}")
        shape = "text"
    elif isinstance(prompt, list):
        check_messages(prompt, p, need_assistant=False)
        for name in (c, r):
            if not isinstance(record[name], list):
                raise DataError(f"expected {name!r} to be a list of assistant messages like {p!r}'s list "
                                f"(data.format preference, chat pairs), got {_type_name(record[name])}")
            check_messages(record[name], name)
        shape = "chat"
    else:
        raise DataError(f"expected {p!r} to be a string or a list of messages (data.format preference), "
                        f"got {_type_name(prompt)}")
    if record[c] == record[r]:
        raise DataError(f"{c!r} equals {r!r}: a preference pair needs two different responses")
    return shape


# ---------------------------------------------------------------- encoding

# One side of a pair before it is cut to the row: all token ids, and the loss mask.
_Side = tuple[list[int], list[int]]


def _text_sides(tok: Any, records: list[dict], spec: PairSpec) -> list[tuple[_Side, _Side]]:
    """[BOS] + prompt + response + EOS per side, the responses and EOS trained on;
    every prompt and response of `records` in one tokenizer call."""
    n, bos, eos = len(records), bos_ids(tok), tok.eos_token_id
    texts = [rec[spec.prompt_field] for rec in records] + [rec[spec.field(s)] for s in SIDES for rec in records]
    ids = token_ids(tok, texts)
    out = []
    for k in range(n):
        prefix = bos + ids[k]
        sides = [(prefix + ids[n * (1 + j) + k] + [eos], [0] * len(prefix) + [1] * (len(ids[n * (1 + j) + k]) + 1))
                 for j in range(len(SIDES))]
        out.append((sides[0], sides[1]))
    return out


def _chat_sides(tok: Any, records: list[dict], spec: PairSpec) -> list[tuple[_Side, _Side]]:
    """prompt + response rendered by the chat template per side, the response's
    assistant turns trained on; every conversation of `records` in one tokenizer call.
    A record the template cannot render is a `RecordError` of its index."""
    if not getattr(tok, "chat_template", None):
        raise RecordError(0, "a chat pair needs a tokenizer with a chat_template (data.tokenizer)")
    rendered: list[tuple[str, list[tuple[int, int]]]] = []
    for k, rec in enumerate(records):
        prompt = rec[spec.prompt_field]
        for side in SIDES:
            messages = prompt + rec[spec.field(side)]
            try:
                full = render_chat(tok, messages)
                rendered.append((full, assistant_spans(tok, messages, full, first=len(prompt))))
            except DataError as exc:
                raise RecordError(k, f"{spec.field(side)!r}: {exc}") from None
    if not rendered:
        return []
    enc = tok([full for full, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    sides: list[_Side] = []
    for (_, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
        starts = np.array([s for s, _ in offsets], dtype=np.int64)
        inside = np.zeros(starts.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (starts >= lo) & (starts < hi)
        sides.append((list(ids), inside.astype(int).tolist()))
    return [(sides[2 * k], sides[2 * k + 1]) for k in range(len(records))]


def _row(side: _Side, row_len: int, pad: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(tokens, mask, cut) of one side in a row: its first `row_len` tokens (TRL's
    keep_start), right-padded; token 0 is never a target (nothing comes before it)."""
    ids, mask = side
    tokens = np.full(row_len, pad, dtype=np.int32)
    kept = np.zeros(row_len, dtype=np.uint8)
    n = min(len(ids), row_len)
    tokens[:n], kept[:n] = ids[:n], mask[:n]
    kept[0] = 0
    return tokens, kept, len(ids) > row_len


def _no_room(side: _Side, spec: PairSpec, name: str) -> str:
    ids, mask = side
    if 1 not in mask:
        return f"the {name!r} response renders to no token of its own"
    prompt = mask.index(1)
    if prompt == 0:
        return f"the prompt is empty and the {name!r} response one token: nothing comes before it to predict it from"
    return (f"the prompt takes {prompt} tokens, leaving no room for the {name!r} response within "
            f"data.seq_len = {spec.row_len - 1} (+1 token per row); shorten the prompt or raise data.seq_len")


def _sides(tok: Any, records: list[dict], spec: PairSpec) -> tuple[list[tuple[_Side, _Side] | None], RecordError | None]:
    """Each checked record's two sides, each shape's records in one tokenizer call; a
    chat record the template cannot render is returned as the error, the sides of
    the records after it None."""
    shapes = [check_pair(rec, spec) for rec in records]
    sides: list[tuple[_Side, _Side] | None] = [None] * len(records)
    failed = None
    for shape in ("text", "chat"):
        at = [k for k, s in enumerate(shapes) if s == shape]
        if not at:
            continue
        group = [records[k] for k in at]
        try:
            done = _text_sides(tok, group, spec) if shape == "text" else _chat_sides(tok, group, spec)
        except RecordError as exc:  # the chat records before it still count
            failed = RecordError(at[exc.index], str(exc))
            done = _chat_sides(tok, group[:exc.index], spec)
        for k, pair in zip(at, done):
            sides[k] = pair
    return sides, failed


def encode_pairs(tok: Any, records: list[dict], spec: PairSpec, sample_ids: np.ndarray, *,
                 where: Callable[[int], str] = lambda k: "") -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(rows, cut): the pair rows of checked `records` (`check_pair`), arrays
    `PAIR_ARRAYS` of ``len(records)`` rows with `sample_ids`, and whether each pair
    had a side longer than a row, cut to it (bool). The tokenizer is called once per
    shape for all of them. The first record whose prompt leaves no response token in
    the row, or that the chat template cannot render, raises `RecordError` (a
    DataError) of its index, its message prefixed by ``where(its index)`` (``"path:line: "``)."""
    if len(sample_ids) != len(records):
        raise ValueError(f"{len(sample_ids)} sample ids for {len(records)} records")
    sides, failed = _sides(tok, records, spec)
    rows = empty_pairs(len(records), spec.row_len)
    rows["sample_id"][:] = sample_ids
    pad, cut = pad_id(tok), np.zeros(len(records), dtype=bool)
    for k, found in enumerate(sides):
        if failed is not None and k == failed.index:
            raise RecordError(k, f"{where(k)}{failed}")
        assert found is not None, "every record before the failed one has its sides"
        for side, name in zip(found, SIDES):
            tokens, mask, side_cut = _row(side, spec.row_len, pad)
            if not mask.any():
                raise RecordError(k, f"{where(k)}{_no_room(side, spec, spec.field(name))}")
            rows[f"{name}_tokens"][k], rows[f"{name}_mask"][k] = tokens, mask
            cut[k] |= side_cut
    return rows, cut


def empty_pairs(n: int, row_len: int) -> dict[str, np.ndarray]:
    """Zeroed arrays of `n` pair rows (`PAIR_ARRAYS`), as `encode_pairs` fills them.

    >>> {k: (v.shape, str(v.dtype)) for k, v in empty_pairs(2, 5).items()}["chosen_mask"]
    ((2, 5), 'uint8')
    """
    out: dict[str, np.ndarray] = {}
    for side in SIDES:
        out[f"{side}_tokens"] = np.zeros((n, row_len), np.int32)
        out[f"{side}_mask"] = np.zeros((n, row_len), np.uint8)
    out["sample_id"] = np.zeros(n, np.int64)
    return out
