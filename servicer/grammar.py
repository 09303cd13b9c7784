"""Checking a structured-output grammar against the model's vocabulary (handler side, no MLX).

The llguidance tokenizer is built once from the model's Hugging Face tokenizer (slow for
large vocabularies, so off the event loop); `compile` may then run on any thread. What it
returns is the request's compiled grammar: an engine in this process (thread mode) starts its
rows from copies of it (`Constraint.compiled`), so each grammar is compiled once a request.
"""

from __future__ import annotations

import logging
from typing import Any

import llguidance

log = logging.getLogger(__name__)


def llg_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: int) -> llguidance.LLTokenizer:
    import llguidance.hf  # it imports transformers: only once a tokenizer is at hand

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's error, whole: its reason on the first line, then llguidance's parser
    state, many lines long ("" when it gives none)."""
    return (matcher.get_error() or "").strip()


class GrammarChecker:
    """Compiles grammars on this model's vocabulary, refusing one that cannot run there."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int) -> None:
        self.tokenizer: llguidance.LLTokenizer | None = None
        self.unavailable: str | None = None
        try:
            self.tokenizer = llg_tokenizer(hf_tokenizer, vocab_size, eos)
        except Exception as exc:  # a tokenizer llguidance cannot read: no structured output
            self.unavailable = f"structured output is unavailable for this model: {exc}"
            log.warning("%s", self.unavailable)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The grammar compiled on the vocabulary: a matcher at its start, which the engine
        copies for each row. ValueError says why it cannot run here."""
        if self.tokenizer is None:
            raise ValueError(self.unavailable)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error() or "invalid grammar")
        error = self._first_token_error(matcher)
        if error is not None:
            raise ValueError(error)
        return matcher

    def _first_token_error(self, matcher: llguidance.LLMatcher) -> str | None:
        """Why no token can begin the grammar's text, or None: a grammar that matches nothing
        (`root ::= root`) compiles, and would otherwise fail at the request's first token,
        after its stream began. Computing the first mask leaves the matcher at its start."""
        import llguidance.numpy

        assert self.tokenizer is not None
        mask = llguidance.numpy.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        if not matcher.is_error():
            return None
        reason = matcher_error(matcher).splitlines()
        return "no token of this model's vocabulary can begin it" + (
            f" ({reason[0]})" if reason else ""
        )
