"""Preference pairs from real text, for `tiny_llm` (``data.format: preference``): the
chosen answer is a standard library docstring, the rejected one a damaged copy of it
(its words shuffled, or cut to its first half), so a model tuned on them should learn to
prefer the chosen. Deterministic: same pairs → same bytes.

>>> pair = preference_records([("What does `a.b` do?", "Return the sum of two numbers given.")])[0]
>>> pair["prompt"], pair["chosen"]
('What does `a.b` do?\\n', 'Return the sum of two numbers given.')
>>> sorted(pair["rejected"].split()) == sorted(pair["chosen"].split()) != pair["rejected"].split()
True
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

__all__ = ["damaged", "preference_records", "write_preference_jsonl"]


def damaged(answer: str, index: int) -> str:
    """A worse copy of `answer`, never equal to it: even `index`, its words shuffled
    (seeded by the index); odd, its first half of the words, the end cut."""
    words = answer.split()
    if index % 2 == 0 and len(set(words)) > 1:
        rng = random.Random(index)
        shuffled = words[:]
        while shuffled == words:
            rng.shuffle(shuffled)
        return " ".join(shuffled)
    cut = " ".join(words[: max(1, len(words) // 2)])
    return cut if cut != answer else answer[: max(1, len(answer) // 2)]


def preference_records(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """Text-shaped preference records of (question, answer) pairs: the prompt is the
    question and a newline (the prompt and response are tokenized apart and joined)."""
    return [{"prompt": q + "\n", "chosen": a, "rejected": damaged(a, i)} for i, (q, a) in enumerate(pairs)]


def write_preference_jsonl(out_dir: str | Path, pairs: Sequence[tuple[str, str]]) -> dict[str, Path]:
    """Write ``preference.jsonl`` (strings) and ``preference_chat.jsonl`` (message
    lists, rendered by the chat template) into `out_dir`; returns {"preference",
    "preference_chat"} → path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = preference_records(pairs)
    chat = [{"prompt": [{"role": "user", "content": q}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for (q, _), r in zip(pairs, text)]
    paths = {}
    for name, rows in (("preference", text), ("preference_chat", chat)):
        paths[name] = out / f"{name}.jsonl"
        with paths[name].open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return paths
