"""Serving's detokenizer: the cost of turning each generated token into streamed text, by
completion length, for `serve/text.TextStream` (incremental: each token decodes a window
of a few ids) against decoding the whole completion again at every token (what
`TextStream` did before 2026-12-06), side by side in one process.

    python benchmarks/stream_decode.py            # ~15 s on one quiet CPU core
    python benchmarks/stream_decode.py --smoke    # tiny, seconds (a test)

The tokenizer is `tools/tiny_llm.py`'s byte-level BPE (vocabulary 512, trained on the
standard library, as served by `rtp serve`); the completion is stdlib docstrings, the
prompt a question, with two stop strings that never match (a chat client's usual
``stop``). Each length is streamed token by token, the two sides alternating per
repeat; the figure is the median time per token, and both sides must release exactly
the text of decoding the completion in one go.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved, stamp, write_result  # noqa: E402

SIZES = {"full": {"lengths": [256, 1024, 4096], "repeats": 5}, "smoke": {"lengths": [64, 256], "repeats": 1}}
STOP = ("\n\nUser:", "<|im_end|>")


def _whole_decode_stream():
    """`TextStream` as it was: every token decodes the prompt's last ids and the whole
    completion again (the stop-string and partial-character holding are the same)."""
    from raytrain_platform.serve.text import TextStream

    class WholeDecode(TextStream):
        def __init__(self, tokenizer, stop=(), prompt=()):
            super().__init__(tokenizer, stop, prompt)
            self._head_ids, self._ids = list(prompt[-self.PREFIX_IDS:]), []
            self._head = tokenizer.decode(self._head_ids) if self._head_ids else ""

        def _decode_next(self, token: int) -> str:
            self._ids.append(token)
            text = self.tokenizer.decode(self._head_ids + self._ids)
            text = text[len(self._head):] if text.startswith(self._head) else self.tokenizer.decode(self._ids)
            self._final, self._pending = text, ""  # what finish() releases
            return text

    return WholeDecode


def _stream(cls, tok, prompt: list[int], completion: list[int]) -> tuple[str, float]:
    stream = cls(tok, stop=STOP, prompt=prompt)
    t0 = time.perf_counter()
    deltas = [stream.push(t) for t in completion]
    deltas.append(stream.finish())
    return "".join(deltas), (time.perf_counter() - t0) / len(completion)


def measure(size: dict, folder: Path) -> dict:
    from raytrain_platform.serve.text import HFTokenizer, TextStream
    from raytrain_platform.tools.tiny_llm import _qa_pairs, make_tokenizer

    make_tokenizer(folder / "tok", vocab_size=512)
    tok = HFTokenizer(str(folder / "tok"))
    pairs = _qa_pairs(400)
    prompt = tok.encode(pairs[0][0])
    corpus = tok.encode("\n\n".join(answer for _, answer in pairs))
    sides = {"incremental": TextStream, "whole re-decode": _whole_decode_stream()}
    rows = []
    for n in size["lengths"]:
        if len(corpus) < n:
            raise SystemExit(f"the docstrings give {len(corpus)} tokens, fewer than {n}")
        completion = corpus[:n]
        expected = tok.decode(completion)

        def side(cls):
            def run(_: int) -> float:  # µs per token
                text, per_token = _stream(cls, tok, prompt, completion)
                if text != expected:
                    raise SystemExit(f"{cls.__name__} released other text than the whole decode at {n} tokens")
                return round(per_token * 1e6, 2)  # µs
            return run

        times = interleaved({name: side(cls) for name, cls in sides.items()}, size["repeats"], label=f"{n} tokens: ")
        inc, whole = (statistics.median(times[k]) for k in sides)
        rows.append({"tokens": n, "incremental_us_per_token": round(inc, 1),
                     "whole_us_per_token": round(whole, 1), "speedup": round(whole / inc, 1)})
    return {"tokenizer": "tiny_llm byte-level BPE, vocabulary 512", "stop": list(STOP), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; writes nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result (default: benchmarks/stream_decode.json; with --smoke only where given)")
    args = parser.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rtp-stream-decode-") as tmp:
        result = {**stamp(), **measure(size, Path(tmp))}
    result["command"] = " ".join(["python benchmarks/stream_decode.py", *(argv if argv is not None else sys.argv[1:])])
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print("| completion tokens | incremental, µs/token | whole re-decode, µs/token | speedup |")
    print("|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['tokens']:,} | {r['incremental_us_per_token']:,} | {r['whole_us_per_token']:,} | "
              f"{r['speedup']}x |")
    write_result(result, args.out if args.smoke else (args.out or Path(__file__).with_suffix(".json")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
