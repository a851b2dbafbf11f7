"""Constrained decoding for ``response_format`` (``json_object``, ``json_schema``) with
xgrammar: a JSON Schema compiles (once per schema, xgrammar caches it) into a grammar
over the tokenizer's vocabulary; each sequence keeps its own matcher, which masks the
tokens that cannot continue valid JSON before sampling and then accepts the token
sampled. Once the JSON is complete only the model's end-of-sequence tokens are allowed,
so the sequence ends there.

Why xgrammar: it runs on CPU (a C++ matcher and a CPU bitmask kernel), builds its
vocabulary from a ``transformers`` 5 tokenizer directly, and works a token at a time on
logits, which is all our KV-cache engine exposes (no generate() loop of its own).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Constraint", "JsonGrammars", "StructuredOutputError"]


class StructuredOutputError(ValueError):
    """A schema xgrammar cannot compile, or a model it cannot constrain (one line)."""


class JsonGrammars:
    """Compiles JSON Schemas for one tokenizer (a ``transformers`` tokenizer) whose model
    has `vocab_size` logits and ends sequences with `stop_token_ids`."""

    def __init__(self, hf_tokenizer: Any, *, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, schema: str) -> Any:
        """A compiled grammar for JSON Schema text; compact JSON (no free whitespace: a
        small model would spend its tokens on it)."""
        try:
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as exc:  # xgrammar's own message says what in the schema it refused
            raise StructuredOutputError(f"xgrammar cannot compile it: {str(exc).splitlines()[0][:200]}") from None


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar

        self._xgr = xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits (vocab,) of tokens the grammar does not allow next to -inf."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits[None], self._bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token)
